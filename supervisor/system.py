"""Launch a whole moeslab system: run directory, slab, coordinator, I/O workers, GPU worker.

    with start_system(model_dir=path, memory_budget=2 << 30) as system:
        ...  # a client talks to system.endpoint

`start_system` plans the budget first (a budget that cannot start raises
`BudgetError` naming every part, before anything is created), then creates
the run directory (0700), its owner record (`supervisor.json`, before the
slab, so a crash never leaves a segment nobody can attribute), the slab,
`config.json` (the one `RunConfig` every child's command line derives from,
`shared.commands`) and `manifest.json`, spawns every child with its own
death pipe, and waits until the coordinator's `health` says ready, while
watching every child: one that exits or stalls fails the launch
(`LaunchError`) with its name, exit code and last stderr lines; with `http`,
the HTTP front first (`supervisor.http_child`). `respawn()` replaces a dead
I/O or GPU worker or HTTP front, `restart_all()` every child (the
coordinator holds all policy state, so its workers' sessions die with it).
`stop()` terminates the children, unlinks the slab and removes what the
launch created. `supervisor.main` drives all of this.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shared.children import ChildProcess, spawn_child, stop_children
from shared.commands import (
    COORDINATOR_MODULE,
    GPU_WORKER_MODULE,
    IO_WORKER_MODULE,
    CoordinatorArgs,
    child_command,
    coordinator_argv,
    gpu_worker_args_for,
    gpu_worker_argv,
    io_worker_args_for,
    io_worker_argv,
)
from shared.config import (
    CONFIG_FILE,
    DEFAULT_REPLACEMENT,
    IO_MODES,
    LEASE_PATHS,
    MANIFEST_FILE,
    PREFETCH_MODES,
    TEST_HOOKS,
    Endpoints,
    RunConfig,
    SlabSpec,
    check_compute_lanes,
    check_jobs_endpoint,
    parse_replacement,
    run_endpoints,
    write_config,
)
from shared.curve import CURVE_DIR, CurveKeys, load_server_keys, new_server_keys, write_server_keys
from shared.job_messages import HealthReply
from shared.plan import ExpertResidencyPlan
from shared.process_table import role_key, write_process_table
from shared.scheduling import resolve_io_workers
from shared.slab import Slab, new_slab_name
from shared.sockets import ipc_path, remove_ipc_file
from shared.store import ExpertStore
from supervisor.budget import DEFAULT_KV_RESERVE_BYTES, check_pins, choose_pins, plan_budget
from supervisor.http_child import HTTP_FRONT, HttpFrontChild, HttpServing, check_http
from supervisor.readiness import COORDINATOR, GPU_WORKER, LaunchError, ask_health, io_worker_name, wait_until_ready
from supervisor.rundir import remove_run, write_run_record

logger = logging.getLogger("moeslab.launch")


@dataclass(frozen=True, slots=True)
class _Launch:
    """How the children are started, beyond what the run configuration says."""

    python: str
    gpu_command: tuple[str, ...] | None  # replaces `python -m gpuworker` (tests)
    jobs_endpoint: str | None
    curve: CurveKeys | None = None  # the jobs endpoint's CURVE server key pair (written to RUN_DIR/curve)
    http: HttpServing | None = None  # the HTTP front's address and API key (supervisor/http_child.py)


class RunningSystem:
    """A started system; a context manager whose exit is `stop()`."""

    def __init__(
        self,
        *,
        store: ExpertStore,
        plan: ExpertResidencyPlan,
        run_dir: str | None,
        config_fields: dict[str, Any],
        launch: _Launch,
    ) -> None:
        self.store, self.plan = store, plan
        self.run_dir: str = run_dir or ""
        self._owns_run_dir = run_dir is None
        self._fields, self._launch = config_fields, launch
        self.config: RunConfig | None = None
        self.children: list[ChildProcess] = []
        self._slab_name: str | None = None
        self._created: list[str] = []
        self.restarts: dict[str, int] = {}  # child name -> times restarted (the process table's counts)
        self._stopped = False
        self.http: HttpFrontChild | None = None

    # ------------------------------------------------------------ public

    @property
    def endpoint(self) -> str:
        """The jobs endpoint clients connect to."""
        assert self.config is not None
        return self.config.endpoints.jobs

    @property
    def curve_public_key(self) -> str | None:
        """The CURVE server key (z85) a client of the jobs endpoint needs; None without CURVE."""
        return None if self._launch.curve is None else self._launch.curve.server_public.decode()

    @property
    def http_url(self) -> str | None:  # http://HOST:PORT, once the HTTP front listens
        return None if self.http is None else self.http.url

    @property
    def pids(self) -> dict[str, int]:
        return {child.name: child.pid for child in self.children}

    @property
    def slab_name(self) -> str | None:
        return self._slab_name

    @property
    def io_workers(self) -> int:
        return self._fields["io_workers"]

    def dead_children(self) -> list[str]:
        """Descriptions of the children that have exited."""
        return [child.describe() for child in self.children if child.exit_code is not None]

    def health(self, *, timeout: float = 5.0) -> HealthReply:
        reply = ask_health(self.endpoint, timeout=timeout, server_key=self.curve_public_key)
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
        if self._launch.jobs_endpoint is not None:
            endpoints = Endpoints(io=endpoints.io, gpu=endpoints.gpu, jobs=self._launch.jobs_endpoint)
        sockets = [path for path in map(ipc_path, (endpoints.io, endpoints.gpu, endpoints.jobs)) if path]
        for path in sockets:
            if os.path.exists(path):
                raise LaunchError(f"{path} exists: is another system running in {self.run_dir}?")
        plan = self.plan
        # The record names the segment before it exists: a crash in between leaves a record of a
        # missing segment (harmless), never a segment no record names.
        name = new_slab_name()
        self._created.append(write_run_record(self.run_dir, name))
        self._slab_name = name
        slab = SlabSpec(
            name=name,
            total_slots=plan.total_slots,
            slot_bytes=plan.slot_bytes,
            lease_layers=max(self.store.sparse_layers) + 1,
            lease_experts=self.store.experts_per_layer,
        )
        # The lease words follow the slots in the same segment (the coordinator initialises them).
        Slab.create(
            total_slots=plan.total_slots, slot_bytes=plan.slot_bytes, name=name, tail_bytes=slab.tail_bytes
        ).close()  # workers map it
        manifest = os.path.join(self.run_dir, MANIFEST_FILE)
        self._write(manifest, json.dumps([os.path.abspath(path) for path in self.store.manifest]))
        if self._launch.curve is not None:  # the key pair lives, and is removed, with the run
            self._fields["curve_keys"] = os.path.join(self.run_dir, CURVE_DIR)
            self._created += write_server_keys(self._fields["curve_keys"], self._launch.curve)
        config = RunConfig(
            run_dir=self.run_dir, manifest=manifest, plan=plan, endpoints=endpoints, slab=slab, **self._fields
        )
        config_path = os.path.join(self.run_dir, CONFIG_FILE)
        write_config(config, config_path)
        self._created.append(config_path)
        self.config = config
        self._created += sockets
        self.http = None if self._launch.http is None else HttpFrontChild(self._launch.http, self.run_dir)
        self._created += self.http.prepare() if self.http is not None else []
        self._spawn_all(cancel)
        self._wait_ready(cancel)
        logger.info("system ready in %s: %s", self.run_dir, self.pids)

    def _spawners(self) -> dict[str, Callable[[], ChildProcess]]:
        """How to start each child by name (also how to restart one): by its command line only."""
        config, launch = self.config, self._launch
        assert config is not None
        coordinator = coordinator_argv(CoordinatorArgs(config=os.path.join(self.run_dir, CONFIG_FILE)))
        commands = {COORDINATOR: child_command(COORDINATOR_MODULE, coordinator, python=launch.python)}
        for index in range(config.io_workers):
            argv = io_worker_argv(io_worker_args_for(config, index))
            commands[io_worker_name(index)] = child_command(IO_WORKER_MODULE, argv, python=launch.python)
        gpu = gpu_worker_argv(gpu_worker_args_for(config))
        commands[GPU_WORKER] = (
            [*launch.gpu_command, *gpu]
            if launch.gpu_command
            else child_command(GPU_WORKER_MODULE, gpu, python=launch.python)
        )
        if self.http is not None:
            commands[HTTP_FRONT] = self.http.command(config, server_key=self.curve_public_key, python=launch.python)
        return {name: (lambda name=name, argv=argv: spawn_child(name, argv)) for name, argv in commands.items()}

    def _spawn_all(self, cancel: Callable[[], bool] | None) -> None:
        spawners = self._spawners()
        if self.http is not None:  # listening (libraries loaded) before the coordinator measures the processes
            self.children.append(spawners.pop(HTTP_FRONT)())
            self.http.wait_ready(self.children[-1], timeout=self._fields["start_timeout_s"], cancel=cancel)
        for spawn in spawners.values():
            self.children.append(spawn())
        self._record_processes()

    def _record_processes(self) -> None:
        """Rewrite the process table the coordinator answers `health` from (shared/process_table.py)."""
        pids = {"supervisor": os.getpid(), **{role_key(child.name): child.pid for child in self.children}}
        restarts = {role_key(name): count for name, count in self.restarts.items()}
        path = write_process_table(self.run_dir, pids, restarts)
        if path not in self._created:
            self._created.append(path)

    def _wait_ready(self, cancel: Callable[[], bool] | None = None) -> None:
        assert self.config is not None
        wait_until_ready(
            self.endpoint,
            self.children,
            io_workers=self.config.io_workers,
            timeout=self.config.start_timeout_s,
            cancel=cancel,
            server_key=self.curve_public_key,
        )

    def _write(self, path: str, text: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self._created.append(path)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)

    # ------------------------------------------------------------ restarts

    def respawn(self, child: ChildProcess) -> ChildProcess:
        """Start a new I/O or GPU worker or HTTP front in the place of `child`, which has exited."""
        if child.exit_code is None:
            raise ValueError(f"{child.name} (pid {child.pid}) is still running")
        if child.name == COORDINATOR:
            raise ValueError("the coordinator is restarted with restart_all()")
        position = self.children.index(child)
        child.close_death_pipe()
        child.join()
        replacement = self._spawners()[child.name]()
        self.children[position] = replacement
        self.restarts[child.name] = self.restarts.get(child.name, 0) + 1
        self._record_processes()
        logger.info("restarted %s as pid %d", child.name, replacement.pid)
        return replacement

    def restart_all(self, *, cancel: Callable[[], bool] | None = None) -> None:
        """Stop every child that is left, then start them all again and wait until ready.

        The slab, run directory and configuration stay; the new coordinator starts with every
        slot idle and reads the usage ledger from its file. LaunchError if it does not come up."""
        for child in self.children:  # their sessions died with the coordinator: nothing to finish
            child.kill()
        stop_children(self.children, timeout=5.0)
        for child in self.children:
            self.restarts[child.name] = self.restarts.get(child.name, 0) + 1
        self.children.clear()
        assert self.config is not None
        for endpoint in (self.config.endpoints.io, self.config.endpoints.gpu, self.config.endpoints.jobs):
            remove_ipc_file(endpoint)
        self._spawn_all(cancel)
        self._wait_ready(cancel)
        logger.info("system restarted: %s", self.pids)

    # ------------------------------------------------------------ stop

    def stop(self, *, timeout: float = 10.0) -> None:
        """Stop every child in order, SIGKILL stragglers, unlink the slab, remove what the launch created.

        The GPU worker first: it ends its job at the next lease reply (the coordinator is still
        there to answer and to relay the job's error), fences and exits. Then the coordinator:
        it answers queued jobs, flushes the ledger and tells the I/O workers to exit, while they
        can still finish the loads it waits for. Then whatever I/O workers are left, and the HTTP
        front (last: it has relayed the door's answers to its own clients)."""
        if self._stopped:
            return
        self._stopped = True
        try:
            deadline = time.monotonic() + timeout
            groups = (
                [c for c in self.children if c.name == GPU_WORKER],
                [c for c in self.children if c.name == COORDINATOR],
                [c for c in self.children if c.name not in (GPU_WORKER, COORDINATOR)],
            )
            for group in groups:
                stop_children(group, timeout=max(1.0, deadline - time.monotonic()))
            for child in self.children:
                if child.process.returncode not in (0, -signal.SIGTERM):  # SIGTERM before its handler was set
                    logger.warning("%s", child.describe())
        finally:
            remove_run(self._slab_name, self._created, self.run_dir if self._owns_run_dir else None)


def start_system(
    *,
    model_dir: str | os.PathLike[str],
    memory_budget: int,
    io_workers: int | None = None,
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
    hang_timeout: float = 10.0,
    gpu_command: Sequence[str] | None = None,
    python: str = sys.executable,
    jobs_endpoint: str | None = None,
    io_read_delay_ms: float = 0.0,
    compute_lanes: int | None = None,
    prefetch: str = "auto",
    io_staging: str = "auto",
    replacement: str = DEFAULT_REPLACEMENT,
    lease_path: str = "shared",
    run_config: Mapping[str, Any] | None = None,
    cancel: Callable[[], bool] | None = None,
    curve: bool = False,
    curve_keys: str | os.PathLike[str] | None = None,
    http: str | None = None,
    api_key: str | None = None,
) -> RunningSystem:
    """Start the coordinator, `io_workers` I/O workers (None: auto) and the GPU worker; ready on return.

    `pinned`: a count (the usage profile's most counted experts first) or explicit (layer, expert)
    pairs. `gpu_command` replaces `python -m gpuworker` (tests); its arguments follow
    (`shared.commands.gpu_worker_argv`, then `--death-fd N`). `jobs_endpoint` replaces
    `ipc://RUN_DIR/jobs` (see `check_jobs_endpoint`). `io_read_delay_ms` slows every I/O worker's
    loads (tests). `compute_lanes`: the GPU worker's `--compute-lanes` (None: its auto choice,
    `gpuworker.lanes.resolve_lanes`). `prefetch`: next-layer prefetch, auto | on | off
    (`coordinator.prefetch`). `io_staging`: the I/O workers' `--staging`. `replacement`: the
    residency manager's replacement policy (`shared.config.parse_replacement`). `lease_path`: how the
    GPU worker leases resident experts (`shared.config.LEASE_PATHS`). `run_config`: more
    `RunConfig` fields (the coordinator's policy knobs, e.g. `queue_limit`, `usage_flush_s`).
    `cancel` is polled while waiting for readiness: True stops the launch (`LaunchCancelled`), with
    everything it created removed. `curve`: the jobs endpoint is a CURVE server with a fresh key pair;
    `curve_keys`: ... with the pair in that directory (`shared.curve.load_server_keys`). `http`:
    HOST:PORT the HTTP front serves the OpenAI API on (`api_key`: the bearer token it requires).
    """
    for name, choice, allowed in (("io_mode", io_mode, IO_MODES), ("prefetch", prefetch, PREFETCH_MODES)):
        if choice not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {choice!r}")
    hooks = tuple(test_hooks)
    if any(hook not in TEST_HOOKS for hook in hooks):
        raise ValueError(f"unknown test hook(s) {[h for h in hooks if h not in TEST_HOOKS]}; known: {list(TEST_HOOKS)}")
    io_workers, why = resolve_io_workers(io_workers)
    logger.info("%d I/O worker(s) (%s)", io_workers, why)
    if compute_lanes is not None:
        check_compute_lanes(compute_lanes)
    parse_replacement(replacement)
    if lease_path not in LEASE_PATHS:
        raise ValueError(f"lease_path must be one of {LEASE_PATHS}, got {lease_path!r}")
    serving = None if http is None else check_http(http, api_key)
    keys = load_server_keys(curve_keys) if curve_keys is not None else new_server_keys() if curve else None
    endpoint = None if jobs_endpoint is None else check_jobs_endpoint(jobs_endpoint, curve=keys is not None)
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
    fields: dict[str, Any] = dict(
        model_dir=store.model_dir,
        block_size=block_size,
        manifest_files=len(store.manifest),
        kv_reserve_bytes=kv_reserve_bytes,
        dense_bytes=store.dense_bytes,
        pinned=pins,
        usage_file=usage,
        io_workers=io_workers,
        io_mode=io_mode,
        test_hooks=hooks,
        log_level=log_level,
        start_timeout_s=float(start_timeout),
        hang_timeout_s=float(hang_timeout),
        compute_lanes=compute_lanes,
        prefetch=prefetch,
        io_staging=io_staging,
        replacement=replacement,
        lease_path=lease_path,
        test_io_read_delay_ms=float(io_read_delay_ms) if io_read_delay_ms else None,
        **(run_config or {}),
    )
    gpu = tuple(gpu_command) if gpu_command else None
    launch = _Launch(python=python, gpu_command=gpu, jobs_endpoint=endpoint, curve=keys, http=serving)
    system = RunningSystem(
        store=store,
        plan=plan,
        run_dir=None if run_dir is None else os.fspath(run_dir),
        config_fields=fields,
        launch=launch,
    )
    try:
        system._start(cancel)
    except BaseException:
        system.stop(timeout=5.0)
        raise
    return system


__all__ = ["RunningSystem", "start_system"]
