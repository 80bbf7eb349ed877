"""Launch a whole moeslab system: run directory, slab, coordinator, I/O workers, GPU worker.

    with start_system(model_dir=path, memory_budget=2 << 30) as system:
        ...  # a client talks to system.endpoint

`start_system` plans the budget first (a budget that cannot start raises
`BudgetError` naming every part, before anything is created), then creates
the run directory (0700), the slab, `config.json` and `manifest.json`,
spawns every child with its own death pipe, and waits until the
coordinator's `health` says ready, while watching every child: one that exits
or stalls fails the launch (`LaunchError`) with its name, exit code and last
stderr lines. `stop()` terminates the children, unlinks the slab and removes
what the launch created. The supervisor script reuses all of this.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

import posix_ipc
import zmq

from coordinator.residency_plan import DEFAULT_EXPERT_WORKING_SLOTS, ExpertResidencyPlan, plan_expert_residency
from coordinator.usage import ExpertUsageLedger
from ioworker.main import WorkerConfig
from ioworker.spawn import spawn_io_worker
from shared.children import ChildProcess, child_env, spawn_child
from shared.config import (
    CONFIG_FILE,
    IO_MODES,
    MANIFEST_FILE,
    TEST_HOOKS,
    RunConfig,
    SlabSpec,
    ipc_path,
    run_endpoints,
    write_config,
)
from shared.job_messages import CLIENT_ACCEPTS, HealthReply, HealthRequest
from shared.protocol import MAX_MESSAGE_BYTES, ProtocolError, decode, encode
from shared.slab import Slab
from shared.store import ExpertStore

logger = logging.getLogger("moeslab.launch")

DEFAULT_KV_RESERVE_BYTES = 256 * 2**20


class BudgetError(ValueError):
    """The memory budget cannot hold the model's fixed parts and the minimum slots."""


class LaunchError(RuntimeError):
    """A child died or stalled while the system started; the message says which and why."""


# ------------------------------------------------------------------ planning


def plan_budget(store: ExpertStore, *, memory_budget: int, kv_reserve_bytes: int = DEFAULT_KV_RESERVE_BYTES,
                working_slots: int | None = None, slots_per_layer: int | None = None,
                pinned: int = 0) -> ExpertResidencyPlan:  # fmt: skip
    """The residency plan for `store` in `memory_budget`, or BudgetError naming every part."""
    fixed = store.dense_bytes + kv_reserve_bytes
    working = DEFAULT_EXPERT_WORKING_SLOTS if working_slots is None else working_slots
    layers, slot = len(store.sparse_layers), store.slot_bytes
    if all(isinstance(n, int) and not isinstance(n, bool) for n in (memory_budget, working, pinned, kv_reserve_bytes)):
        needed = fixed + (working + pinned + layers) * slot
        if memory_budget < needed:
            raise BudgetError(
                f"memory budget {memory_budget} bytes cannot start {store.model_dir}: it needs the dense weights "
                f"({store.dense_bytes} bytes) + the KV reserve ({kv_reserve_bytes} bytes) + {working} working "
                f"slots + {pinned} pinned slots + one slot for each of {layers} sparse layers, at {slot} bytes "
                f"per slot: {needed} bytes"
            )
    # Anything else wrong (a negative count, a non-integer) is the planner's to name.
    return plan_expert_residency(budget_bytes=memory_budget, fixed_bytes=fixed, slot_bytes=slot, sparse_layers=layers,
                                 working_slots=working, pinned_experts=pinned,
                                 max_slots_per_layer=slots_per_layer)  # fmt: skip


def check_pins(store: ExpertStore, pins: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Explicit (layer, expert) pins, checked against the store; ValueError names a bad one."""
    checked = tuple((int(layer), int(expert)) for layer, expert in pins)
    for layer, expert in checked:
        if layer not in store.sparse_layers or not 0 <= expert < store.experts_per_layer:
            raise ValueError(f"pinned expert {layer}:{expert} is not an expert of the sparse layers "
                             f"{list(store.sparse_layers)} x {store.experts_per_layer} experts")  # fmt: skip
    if len(set(checked)) != len(checked):
        raise ValueError(f"pinned experts repeat: {list(checked)}")
    return checked


def choose_pins(store: ExpertStore, count: int, usage_file: str | None) -> tuple[tuple[int, int], ...]:
    """`count` (layer, expert) pins: the usage profile's most counted first, then round robin."""
    pins: list[tuple[int, int]] = []
    if count and usage_file and os.path.exists(usage_file):
        ledger = ExpertUsageLedger.open(usage_file, layers=store.sparse_layers,
                                        experts_per_layer=store.experts_per_layer)  # fmt: skip
        pins = [(c.layer, c.expert_id) for c in ledger.ranked_counts()[:count]]
    for expert in range(store.experts_per_layer):
        for layer in store.sparse_layers:
            if len(pins) >= count:
                return tuple(pins)
            if (layer, expert) not in pins:
                pins.append((layer, expert))
    if len(pins) < count:
        raise BudgetError(f"{count} pinned experts asked for; the model has {len(pins)}")
    return tuple(pins)


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


class RunningSystem:
    """A started system; a context manager whose exit is `stop()`."""

    def __init__(self, *, store: ExpertStore, plan: ExpertResidencyPlan, run_dir: str | None, owns_run_dir: bool,
                 config_fields: dict, options: _Options) -> None:  # fmt: skip
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

    def _start(self) -> None:
        if self._owns_run_dir:
            self.run_dir = tempfile.mkdtemp(prefix="moeslab-")  # mode 0700
        else:
            os.makedirs(self.run_dir, mode=0o700, exist_ok=True)
            os.chmod(self.run_dir, 0o700)
        self.run_dir = os.path.abspath(self.run_dir)
        endpoints = run_endpoints(self.run_dir)
        for endpoint in (endpoints.io, endpoints.gpu, endpoints.jobs):
            if os.path.exists(ipc_path(endpoint) or ""):
                raise LaunchError(f"{ipc_path(endpoint)} exists: is another system running in {self.run_dir}?")
        plan = self.plan
        slab = Slab.create(total_slots=plan.total_slots, slot_bytes=plan.slot_bytes)
        self._slab_name = slab.name
        slab.close()  # the launcher only owns the name; the workers map it
        manifest = os.path.join(self.run_dir, MANIFEST_FILE)
        self._write(manifest, json.dumps([os.path.abspath(path) for path in self.store.manifest]))
        options = self._options
        config = RunConfig(run_dir=self.run_dir, manifest=manifest, plan=plan, endpoints=endpoints,
                           slab=SlabSpec(name=slab.name, total_slots=plan.total_slots, slot_bytes=plan.slot_bytes),
                           io_workers=options.io_workers, io_mode=options.io_mode, test_hooks=options.test_hooks,
                           log_level=options.log_level, start_timeout_s=options.start_timeout,
                           **self._fields)  # fmt: skip
        config_path = os.path.join(self.run_dir, CONFIG_FILE)
        write_config(config, config_path)
        self._created.append(config_path)
        self.config = config
        self._created += [ipc_path(e) or "" for e in (endpoints.io, endpoints.gpu, endpoints.jobs)]

        python = options.python
        self.children.append(spawn_child("coordinator", [python, "-m", "coordinator", "--config", config_path]))
        for index in range(options.io_workers):
            self._spawn_io_worker(index, config)
        gpu = list(options.gpu_command or (python, "-m", "gpuworker"))
        self.children.append(spawn_child("GPU worker", gpu + ["--model", config.model_dir, "--endpoint",
                                                              endpoints.gpu, "--log-level", options.log_level]))
        self._wait_ready(options.start_timeout)
        logger.info("system ready in %s: %s", self.run_dir, self.pids)

    def _spawn_io_worker(self, index: int, config: RunConfig) -> None:
        death_r, death_w = os.pipe()
        try:
            worker = spawn_io_worker(WorkerConfig(
                index=index, endpoint=config.endpoints.io, manifest=config.manifest, slab_name=config.slab.name,
                total_slots=config.slab.total_slots, slot_bytes=config.slab.slot_bytes,
                block_size=config.block_size, io_mode=config.io_mode, death_fd=death_r,  # type: ignore[arg-type]
                handshake_timeout=config.start_timeout_s, log_level=config.log_level), env=child_env())  # fmt: skip
        except BaseException:
            os.close(death_w)
            raise
        finally:
            os.close(death_r)
        # ioworker.spawn already pumps its stderr (to the ioworker.child logger) and keeps the tail.
        self.children.append(ChildProcess(f"I/O worker {index}", worker.process, death_w, tail_source=worker))

    def _wait_ready(self, timeout: float) -> None:
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
                        if reply.ready:
                            return
        finally:
            sock.close(linger=0)
            context.term()

    def _stalled(self, timeout: float, last: HealthReply | None) -> str:
        if last is None:
            waiting = ["coordinator"]  # it never answered health
        else:
            waiting = [f"I/O worker {i}" for i in range(last.io_workers, self._options.io_workers)]
            waiting += [] if last.gpu_worker else ["GPU worker"]
        state = "no health reply" if last is None else (
            f"health: {last.io_workers} of {self._options.io_workers} I/O workers ready, "
            f"GPU worker {'ready' if last.gpu_worker else 'not ready'}")  # fmt: skip
        # Which I/O worker is missing is not known by index; show the tails of every unready kind.
        kinds = {name.split(" ")[0] for name in waiting}
        shown = [c.describe() for c in self.children if c.name.split(" ")[0] in kinds]
        return (f"the system was not ready after {timeout} s ({state}); waiting for {', '.join(waiting)}:\n"
                + "\n".join(shown))  # fmt: skip

    def _write(self, path: str, text: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self._created.append(path)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)

    # ------------------------------------------------------------ stop

    def stop(self, *, timeout: float = 10.0) -> None:
        """SIGTERM every child, SIGKILL stragglers, unlink the slab, remove what the launch created."""
        if self._stopped:
            return
        self._stopped = True
        try:
            for child in self.children:
                if child.exit_code is None:
                    try:
                        child.process.terminate()
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + timeout
            for child in self.children:
                try:
                    child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("%s (pid %d) ignored SIGTERM; killing it", child.name, child.pid)
                    child.process.kill()
                    child.process.wait()
            for child in self.children:
                child.close_death_pipe()
                child.join()
                if child.process.returncode not in (0, -signal.SIGTERM):
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
) -> RunningSystem:
    """Start coordinator, `io_workers` I/O workers and the GPU worker for `model_dir`; ready on return.

    `pinned`: a count (the usage profile's most counted experts first) or explicit (layer, expert)
    pairs. `gpu_command` replaces `python -m gpuworker` (tests); the launcher appends
    `--model DIR --endpoint E --log-level L --death-fd N`.
    """
    if io_mode not in IO_MODES:
        raise ValueError(f"io_mode must be one of {IO_MODES}, got {io_mode!r}")
    hooks = tuple(test_hooks)
    if any(hook not in TEST_HOOKS for hook in hooks):
        raise ValueError(f"unknown test hook(s) {[h for h in hooks if h not in TEST_HOOKS]}; known: {list(TEST_HOOKS)}")
    if isinstance(io_workers, bool) or not isinstance(io_workers, int) or io_workers < 1:
        raise ValueError(f"io_workers must be a positive integer, got {io_workers!r}")
    store = ExpertStore.open(model_dir, block_size=block_size)
    usage = os.path.abspath(os.fspath(usage_file)) if usage_file is not None else None
    if isinstance(pinned, int):
        pins = choose_pins(store, pinned, usage) if pinned else ()
    else:
        pins = check_pins(store, pinned)
    plan = plan_budget(store, memory_budget=memory_budget, kv_reserve_bytes=kv_reserve_bytes,
                       working_slots=working_slots, slots_per_layer=slots_per_layer, pinned=len(pins))  # fmt: skip
    fields = dict(model_dir=store.model_dir, block_size=block_size, manifest_files=len(store.manifest),
                  kv_reserve_bytes=kv_reserve_bytes, dense_bytes=store.dense_bytes, pinned=pins,
                  usage_file=usage)  # fmt: skip
    options = _Options(io_workers=io_workers, io_mode=io_mode, test_hooks=hooks, log_level=log_level,
                       start_timeout=float(start_timeout), gpu_command=tuple(gpu_command) if gpu_command else None,
                       python=python)  # fmt: skip
    system = RunningSystem(store=store, plan=plan, run_dir=None if run_dir is None else os.fspath(run_dir),
                           owns_run_dir=run_dir is None, config_fields=fields, options=options)  # fmt: skip
    try:
        system._start()
    except BaseException:
        system.stop(timeout=5.0)
        raise
    return system


__all__ = [
    "DEFAULT_KV_RESERVE_BYTES",
    "BudgetError",
    "ChildProcess",
    "LaunchError",
    "RunningSystem",
    "check_pins",
    "choose_pins",
    "plan_budget",
    "spawn_child",
    "start_system",
]
