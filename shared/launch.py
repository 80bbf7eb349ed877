"""Launch a whole moeslab system: run directory, slab, coordinator, I/O workers, GPU worker.

    with start_system(model_dir=path, memory_budget=2 << 30) as system:
        ...  # a client talks to system.endpoint

`start_system` plans the budget first (a budget that cannot start raises
`BudgetError` naming every part, before anything is created), then creates
the run directory (0700), its owner record (`supervisor.json`, before the
slab, so a crash never leaves a segment nobody can attribute), the slab,
`config.json` and `manifest.json`, spawns every child with its own death
pipe, and waits until the coordinator's `health` says ready, while watching
every child: one that exits or stalls fails the launch (`LaunchError`) with
its name, exit code and last stderr lines. `respawn()` replaces a dead I/O or
GPU worker, `restart_all()` every child (the coordinator holds all policy
state, so its workers' sessions die with it). `stop()` terminates the
children, unlinks the slab and removes what the launch created. The
supervisor (`shared.supervisor`) drives all of this.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import posix_ipc
import zmq

from coordinator.backend import REPLACEMENT_GRACE_ENV
from ioworker.main import WorkerConfig
from ioworker.spawn import spawn_io_worker
from shared.budget import DEFAULT_KV_RESERVE_BYTES, BudgetError, check_pins, choose_pins, plan_budget
from shared.children import ChildProcess, child_env, spawn_child
from shared.config import (
    CONFIG_FILE,
    IO_MODES,
    MANIFEST_FILE,
    MAX_IPC_PATH,
    TEST_HOOKS,
    Endpoints,
    RunConfig,
    SlabSpec,
    check_compute_lanes,
    ipc_path,
    run_endpoints,
    write_config,
)
from shared.job_messages import CLIENT_ACCEPTS, HealthReply, HealthRequest
from shared.plan import ExpertResidencyPlan
from shared.protocol import MAX_MESSAGE_BYTES, ProtocolError, decode, encode
from shared.slab import Slab, new_slab_name
from shared.stale import write_run_record
from shared.store import ExpertStore

logger = logging.getLogger("moeslab.launch")

# How long the coordinator's I/O backend keeps loads of a lost worker when no live worker is
# left, waiting for the restarted one (the supervisor restarts dead workers).
IO_REPLACEMENT_GRACE_S = 60.0
COORDINATOR, GPU_WORKER = "coordinator", "GPU worker"


class LaunchError(RuntimeError):
    """A child died or stalled while the system started; the message says which and why."""


class LaunchCancelled(LaunchError):
    """The `cancel` callback asked to stop while the system was starting."""


def io_worker_name(index: int) -> str:
    return f"I/O worker {index}"


def check_jobs_endpoint(endpoint: str) -> str:
    """An `ipc://ABSOLUTE_PATH` or loopback `tcp://127.x.x.x:PORT` endpoint; ValueError otherwise."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        if not os.path.isabs(path) or len(path.encode()) > MAX_IPC_PATH:
            raise ValueError(f"ipc endpoint {endpoint!r} needs an absolute path of at most {MAX_IPC_PATH} bytes")
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        try:
            loopback = ipaddress.ip_address(host).is_loopback and ipaddress.ip_address(host).version == 4
        except ValueError:
            loopback = False
        if not loopback:
            # Jobs carry no authentication: only this machine may reach the front door.
            raise ValueError(f"endpoint {endpoint!r} refused: only loopback tcp (tcp://127.0.0.1:PORT) is allowed")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"endpoint {endpoint!r} needs a port between 1 and 65535")
        return endpoint
    raise ValueError(f"endpoint {endpoint!r} must be ipc://PATH or tcp://127.0.0.1:PORT")


# ------------------------------------------------------------------ the system


@dataclass(frozen=True, slots=True)
class _Options:
    io_workers: int
    io_mode: str
    test_hooks: tuple[str, ...]
    log_level: str
    start_timeout: float
    gpu_command: tuple[str, ...] | None
    python: str
    jobs_endpoint: str | None
    io_read_delay_ms: float
    compute_lanes: int | None


class RunningSystem:
    """A started system; a context manager whose exit is `stop()`."""

    def __init__(
        self,
        *,
        store: ExpertStore,
        plan: ExpertResidencyPlan,
        run_dir: str | None,
        owns_run_dir: bool,
        config_fields: dict,
        options: _Options,
    ) -> None:
        self.store, self.plan = store, plan
        self.run_dir: str = run_dir or ""
        self._owns_run_dir = owns_run_dir
        self._fields, self._options = config_fields, options
        self.config: RunConfig | None = None
        self.children: list[ChildProcess] = []
        self._slab_name: str | None = None
        self._created: list[str] = []
        self._stopped = False

    # ------------------------------------------------------------ public

    @property
    def endpoint(self) -> str:
        """The jobs endpoint clients connect to."""
        assert self.config is not None
        return self.config.endpoints.jobs

    @property
    def pids(self) -> dict[str, int]:
        return {child.name: child.pid for child in self.children}

    @property
    def slab_name(self) -> str | None:
        return self._slab_name

    @property
    def io_workers(self) -> int:
        return self._options.io_workers

    def dead_children(self) -> list[str]:
        """Descriptions of the children that have exited."""
        return [child.describe() for child in self.children if child.exit_code is not None]

    def health(self, *, timeout: float = 5.0) -> HealthReply:
        reply = _health(self.endpoint, timeout=timeout)
        if reply is None:
            raise TimeoutError(f"no health reply from {self.endpoint} within {timeout} s")
        return reply

    def __enter__(self) -> RunningSystem:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ start

    def _start(self, cancel: Callable[[], bool] | None) -> None:
        if self._owns_run_dir:
            self.run_dir = tempfile.mkdtemp(prefix="moeslab-")  # mode 0700
        else:
            os.makedirs(self.run_dir, mode=0o700, exist_ok=True)
            os.chmod(self.run_dir, 0o700)
        self.run_dir = os.path.abspath(self.run_dir)
        endpoints = run_endpoints(self.run_dir)
        if self._options.jobs_endpoint is not None:
            endpoints = Endpoints(io=endpoints.io, gpu=endpoints.gpu, jobs=self._options.jobs_endpoint)
        for endpoint in (endpoints.io, endpoints.gpu, endpoints.jobs):
            if os.path.exists(ipc_path(endpoint) or ""):
                raise LaunchError(f"{ipc_path(endpoint)} exists: is another system running in {self.run_dir}?")
        plan = self.plan
        # The record names the segment before it exists: a crash in between leaves a record of a
        # missing segment (harmless), never a segment no record names.
        name = new_slab_name()
        self._created.append(write_run_record(self.run_dir, name))
        self._slab_name = name
        Slab.create(total_slots=plan.total_slots, slot_bytes=plan.slot_bytes, name=name).close()  # workers map it
        manifest = os.path.join(self.run_dir, MANIFEST_FILE)
        self._write(manifest, json.dumps([os.path.abspath(path) for path in self.store.manifest]))
        options = self._options
        config = RunConfig(
            run_dir=self.run_dir,
            manifest=manifest,
            plan=plan,
            endpoints=endpoints,
            slab=SlabSpec(name=name, total_slots=plan.total_slots, slot_bytes=plan.slot_bytes),
            io_workers=options.io_workers,
            io_mode=options.io_mode,
            test_hooks=options.test_hooks,
            log_level=options.log_level,
            start_timeout_s=options.start_timeout,
            **self._fields,
        )
        config_path = os.path.join(self.run_dir, CONFIG_FILE)
        write_config(config, config_path)
        self._created.append(config_path)
        self.config = config
        self._created += [ipc_path(e) or "" for e in (endpoints.io, endpoints.gpu, endpoints.jobs)]
        self._spawn_all()
        self._wait_ready(options.start_timeout, cancel)
        logger.info("system ready in %s: %s", self.run_dir, self.pids)

    def _spawners(self) -> dict[str, Callable[[], ChildProcess]]:
        """How to start each child by name (also how to restart one)."""
        spawners: dict[str, Callable[[], ChildProcess]] = {COORDINATOR: self._spawn_coordinator}
        for index in range(self._options.io_workers):
            spawners[io_worker_name(index)] = lambda index=index: self._spawn_io_worker(index)
        spawners[GPU_WORKER] = self._spawn_gpu_worker
        return spawners

    def _spawn_all(self) -> None:
        for spawn in self._spawners().values():
            self.children.append(spawn())

    def _spawn_coordinator(self) -> ChildProcess:
        assert self.config is not None
        env = {REPLACEMENT_GRACE_ENV: str(IO_REPLACEMENT_GRACE_S)}
        argv = [self._options.python, "-m", "coordinator", "--config", os.path.join(self.run_dir, CONFIG_FILE)]
        return spawn_child(COORDINATOR, argv, env=env)

    def _spawn_gpu_worker(self) -> ChildProcess:
        assert self.config is not None
        options = self._options
        gpu = list(options.gpu_command or (options.python, "-m", "gpuworker"))
        lanes = [] if options.compute_lanes is None else ["--compute-lanes", str(options.compute_lanes)]
        return spawn_child(
            GPU_WORKER,
            gpu
            + [
                "--model",
                self.config.model_dir,
                "--endpoint",
                self.config.endpoints.gpu,
                "--log-level",
                options.log_level,
                *lanes,
            ],
        )

    def _spawn_io_worker(self, index: int) -> ChildProcess:
        config = self.config
        assert config is not None
        death_r, death_w = os.pipe()
        try:
            worker = spawn_io_worker(
                WorkerConfig(
                    index=index,
                    endpoint=config.endpoints.io,
                    manifest=config.manifest,
                    slab_name=config.slab.name,
                    total_slots=config.slab.total_slots,
                    slot_bytes=config.slab.slot_bytes,
                    block_size=config.block_size,
                    io_mode=config.io_mode,
                    death_fd=death_r,  # type: ignore[arg-type]
                    handshake_timeout=config.start_timeout_s,
                    log_level=config.log_level,
                    test_read_delay_ms=self._options.io_read_delay_ms,
                ),
                env=child_env(),
                new_group=True,
            )
        except BaseException:
            os.close(death_w)
            raise
        finally:
            os.close(death_r)
        # ioworker.spawn already pumps its stderr (to the ioworker.child logger) and keeps the tail.
        return ChildProcess(io_worker_name(index), worker.process, death_w, tail_source=worker)

    def _wait_ready(self, timeout: float, cancel: Callable[[], bool] | None = None) -> None:
        deadline = time.monotonic() + timeout
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        last: HealthReply | None = None
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sock.connect(self.endpoint)
            asked = 0
            next_ask = 0.0
            while True:
                if cancel is not None and cancel():
                    raise LaunchCancelled("stopped while the system was starting")
                dead = [child for child in self.children if child.exit_code is not None]
                if dead:
                    time.sleep(0.3)  # let the others' last words and exits arrive too
                    dead = [child for child in self.children if child.exit_code is not None]
                    raise LaunchError("the system failed to start:\n" + "\n".join(c.describe() for c in dead))
                now = time.monotonic()
                if now > deadline:
                    raise LaunchError(self._stalled(timeout, last))
                if now >= next_ask:
                    asked += 1
                    sock.send(encode(HealthRequest(id=f"launch-{asked}")))
                    next_ask = now + 0.5
                if sock.poll(100):
                    try:
                        reply = decode(sock.recv(), CLIENT_ACCEPTS)
                    except ProtocolError as error:
                        raise LaunchError(f"the coordinator answered health with a bad frame: {error}") from None
                    if isinstance(reply, HealthReply):
                        last = reply
                        if reply.ready and reply.io_workers == self._options.io_workers:
                            return
        finally:
            sock.close(linger=0)
            context.term()

    def _stalled(self, timeout: float, last: HealthReply | None) -> str:
        if last is None:
            waiting = [COORDINATOR]  # it never answered health
        else:
            waiting = [io_worker_name(i) for i in range(last.io_workers, self._options.io_workers)]
            waiting += [] if last.gpu_worker else [GPU_WORKER]
        state = (
            "no health reply"
            if last is None
            else (
                f"health: {last.io_workers} of {self._options.io_workers} I/O workers ready, "
                f"GPU worker {'ready' if last.gpu_worker else 'not ready'}"
            )
        )
        # Which I/O worker is missing is not known by index; show the tails of every unready kind.
        kinds = {name.split(" ")[0] for name in waiting}
        shown = [c.describe() for c in self.children if c.name.split(" ")[0] in kinds]
        return f"the system was not ready after {timeout} s ({state}); waiting for {', '.join(waiting)}:\n" + "\n".join(
            shown
        )

    def _write(self, path: str, text: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self._created.append(path)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)

    # ------------------------------------------------------------ restarts

    def respawn(self, child: ChildProcess) -> ChildProcess:
        """Start a new I/O or GPU worker in the place of `child`, which has exited."""
        if child.exit_code is None:
            raise ValueError(f"{child.name} (pid {child.pid}) is still running")
        if child.name == COORDINATOR:
            raise ValueError("the coordinator is restarted with restart_all()")
        position = self.children.index(child)
        child.close_death_pipe()
        child.join()
        replacement = self._spawners()[child.name]()
        self.children[position] = replacement
        logger.info("restarted %s as pid %d", child.name, replacement.pid)
        return replacement

    def restart_all(self, *, cancel: Callable[[], bool] | None = None) -> None:
        """Stop every child that is left, then start them all again and wait until ready.

        The slab, run directory and configuration stay; the new coordinator starts with every
        slot idle and reads the usage ledger from its file. LaunchError if it does not come up."""
        for child in self.children:  # their sessions died with the coordinator: nothing to finish
            if child.exit_code is None:
                child.process.kill()
        self._terminate(self.children, timeout=5.0)
        self.children.clear()
        assert self.config is not None
        for endpoint in (self.config.endpoints.io, self.config.endpoints.gpu, self.config.endpoints.jobs):
            path = ipc_path(endpoint)
            if path and os.path.lexists(path):
                os.unlink(path)
        self._spawn_all()
        self._wait_ready(self._options.start_timeout, cancel)
        logger.info("system restarted: %s", self.pids)

    # ------------------------------------------------------------ stop

    def _terminate(self, children: Sequence[ChildProcess], *, timeout: float) -> None:
        """SIGTERM, wait up to `timeout` in all, SIGKILL stragglers; then close pipes and join."""
        for child in children:
            child.terminate()
        deadline = time.monotonic() + timeout
        for child in children:
            try:
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s (pid %d) ignored SIGTERM; killing it", child.name, child.pid)
                child.process.kill()
                child.process.wait()
        for child in children:
            child.close_death_pipe()
            child.join()

    def stop(self, *, timeout: float = 10.0) -> None:
        """Stop every child in order, SIGKILL stragglers, unlink the slab, remove what the launch created.

        The GPU worker first: it ends its job at the next lease reply (the coordinator is still
        there to answer and to relay the job's error), fences and exits. Then the coordinator:
        it answers queued jobs, flushes the ledger and tells the I/O workers to exit, while they
        can still finish the loads it waits for. Then whatever I/O workers are left."""
        if self._stopped:
            return
        self._stopped = True
        try:
            deadline = time.monotonic() + timeout
            for group in (
                [c for c in self.children if c.name == GPU_WORKER],
                [c for c in self.children if c.name == COORDINATOR],
                [c for c in self.children if c.name not in (GPU_WORKER, COORDINATOR)],
            ):
                self._terminate(group, timeout=max(1.0, deadline - time.monotonic()))
            for child in self.children:
                if child.process.returncode not in (0, -signal.SIGTERM):  # SIGTERM before its handler was set
                    logger.warning("%s", child.describe())
        finally:
            if self._slab_name is not None:
                try:
                    posix_ipc.unlink_shared_memory(self._slab_name)
                except posix_ipc.ExistentialError:
                    pass
            for path in self._created:
                if path and os.path.lexists(path):
                    os.unlink(path)
            if self._owns_run_dir and self.run_dir:
                shutil.rmtree(self.run_dir, ignore_errors=True)


def _health(endpoint: str, *, timeout: float) -> HealthReply | None:
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.connect(endpoint)
        sock.send(encode(HealthRequest(id="health")))
        if sock.poll(timeout * 1000):
            reply = decode(sock.recv(), CLIENT_ACCEPTS)
            return reply if isinstance(reply, HealthReply) else None
        return None
    finally:
        sock.close(linger=0)
        context.term()


def start_system(
    *,
    model_dir: str | os.PathLike[str],
    memory_budget: int,
    io_workers: int = 2,
    working_slots: int | None = None,
    slots_per_layer: int | None = None,
    pinned: int | Sequence[tuple[int, int]] = 0,
    io_mode: str = "direct",
    run_dir: str | os.PathLike[str] | None = None,
    usage_file: str | os.PathLike[str] | None = None,
    test_hooks: Sequence[str] = (),
    log_level: str = "INFO",
    kv_reserve_bytes: int = DEFAULT_KV_RESERVE_BYTES,
    block_size: int = 4096,
    start_timeout: float = 120.0,
    gpu_command: Sequence[str] | None = None,
    python: str = sys.executable,
    jobs_endpoint: str | None = None,
    io_read_delay_ms: float = 0.0,
    compute_lanes: int | None = None,
    cancel: Callable[[], bool] | None = None,
) -> RunningSystem:
    """Start coordinator, `io_workers` I/O workers and the GPU worker for `model_dir`; ready on return.

    `pinned`: a count (the usage profile's most counted experts first) or explicit (layer, expert)
    pairs. `gpu_command` replaces `python -m gpuworker` (tests); the launcher appends
    `--model DIR --endpoint E --log-level L --death-fd N`. `jobs_endpoint` replaces
    `ipc://RUN_DIR/jobs` (see `check_jobs_endpoint`). `io_read_delay_ms` slows every I/O worker's
    loads (tests). `compute_lanes`: the GPU worker's `--compute-lanes` (None: its auto choice,
    `gpuworker.lanes.resolve_lanes`). `cancel` is polled while waiting for readiness: True stops the launch
    (`LaunchCancelled`), with everything it created removed.
    """
    if io_mode not in IO_MODES:
        raise ValueError(f"io_mode must be one of {IO_MODES}, got {io_mode!r}")
    hooks = tuple(test_hooks)
    if any(hook not in TEST_HOOKS for hook in hooks):
        raise ValueError(f"unknown test hook(s) {[h for h in hooks if h not in TEST_HOOKS]}; known: {list(TEST_HOOKS)}")
    if isinstance(io_workers, bool) or not isinstance(io_workers, int) or io_workers < 1:
        raise ValueError(f"io_workers must be a positive integer, got {io_workers!r}")
    if compute_lanes is not None:
        check_compute_lanes(compute_lanes)
    endpoint = None if jobs_endpoint is None else check_jobs_endpoint(jobs_endpoint)
    store = ExpertStore.open(model_dir, block_size=block_size)
    usage = os.path.abspath(os.fspath(usage_file)) if usage_file is not None else None
    if isinstance(pinned, int):
        pins = choose_pins(store, pinned, usage) if pinned else ()
    else:
        pins = check_pins(store, pinned)
    plan = plan_budget(
        store,
        memory_budget=memory_budget,
        kv_reserve_bytes=kv_reserve_bytes,
        working_slots=working_slots,
        slots_per_layer=slots_per_layer,
        pinned=len(pins),
    )
    fields = dict(
        model_dir=store.model_dir,
        block_size=block_size,
        manifest_files=len(store.manifest),
        kv_reserve_bytes=kv_reserve_bytes,
        dense_bytes=store.dense_bytes,
        pinned=pins,
        usage_file=usage,
    )
    options = _Options(
        io_workers=io_workers,
        io_mode=io_mode,
        test_hooks=hooks,
        log_level=log_level,
        start_timeout=float(start_timeout),
        gpu_command=tuple(gpu_command) if gpu_command else None,
        python=python,
        jobs_endpoint=endpoint,
        io_read_delay_ms=float(io_read_delay_ms),
        compute_lanes=compute_lanes,
    )
    system = RunningSystem(
        store=store,
        plan=plan,
        run_dir=None if run_dir is None else os.fspath(run_dir),
        owns_run_dir=run_dir is None,
        config_fields=fields,
        options=options,
    )
    try:
        system._start(cancel)
    except BaseException:
        system.stop(timeout=5.0)
        raise
    return system


__all__ = [
    "COORDINATOR",
    "DEFAULT_KV_RESERVE_BYTES",
    "GPU_WORKER",
    "IO_REPLACEMENT_GRACE_S",
    "BudgetError",
    "ChildProcess",
    "LaunchCancelled",
    "LaunchError",
    "RunningSystem",
    "check_jobs_endpoint",
    "check_pins",
    "choose_pins",
    "io_worker_name",
    "plan_budget",
    "spawn_child",
    "start_system",
]
