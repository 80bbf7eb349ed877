"""The supervisor: `moeslab-launch` (or `python scripts/launch.py`) starts and watches a whole system.

    moeslab-launch --model DIR --memory-budget 8GiB [--io-workers 2] [--endpoint tcp://127.0.0.1:5555]

One entry function, `run_supervisor`: setup (signal handlers, stale-run
cleanup, `start_system`: run directory, slab, children, startup handshake),
then exactly one JSON line on stdout (`{"event": "ready", ...}`; everything
else goes to stderr), a loop that waits on the children's exit sentinels and
the signal pipe, and a `finally` that stops the children, unlinks the slab
and removes the run directory. In the loop:

- a dead I/O worker is restarted with its index (the coordinator's backend
  has already re-submitted its in-flight loads to a live worker);
- a dead GPU worker is restarted (the coordinator has failed its job);
- a dead coordinator takes every session with it: all children restart;
- each child may be restarted at most `--max-restarts` times per
  `--restart-window` seconds, with a growing pause; one more death stops the
  system with a message naming the child (exit 1);
- a restarted child that is not ready within `--start-timeout` is killed
  (which counts as another death);
- SIGINT / SIGTERM: a clean stop, exit 0. The children also exit when the
  supervisor dies (their death pipes report end of file).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import zmq

from shared.budget import DEFAULT_KV_RESERVE_BYTES, BudgetError, auto_pins, parse_size
from shared.children import CHILD_LOGGER, ChildProcess
from shared.config import check_compute_lanes
from shared.job_messages import CLIENT_ACCEPTS, HealthReply, HealthRequest
from shared.launch import (
    COORDINATOR,
    GPU_WORKER,
    LaunchCancelled,
    LaunchError,
    RunningSystem,
    check_jobs_endpoint,
    start_system,
)
from shared.protocol import MAX_MESSAGE_BYTES, ProtocolError, decode, encode
from shared.stale import RunDirInUse, claim_run_dir, clean_stale_runs
from shared.store import ExpertStore
from shared.usage_profile import default_usage_file

logger = logging.getLogger("moeslab.supervisor")

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
HEALTH_INTERVAL_S = 0.5
# After this long the coordinator has noticed a dead child (its watchdogs look every 0.1-0.5 s).
READY_SETTLE_S = 1.5


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    max_restarts: int = 5  # per child, within window_s
    window_s: float = 60.0

    def backoff(self, deaths: int) -> float:
        """The pause before restarting a child that died `deaths` times in the window."""
        return 0.0 if deaths <= 1 else min(0.5 * 2 ** (deaths - 2), 5.0)


@dataclass(frozen=True, slots=True)
class SupervisorOptions:
    model: str
    memory_budget: int
    io_workers: int = 2
    working_slots: int | None = None
    slots_per_layer: int | None = None
    pinned_experts: int | str = 0  # a count or "auto"
    io_mode: str = "direct"
    run_dir: str | None = None
    endpoint: str | None = None
    usage_file: str | None = None
    log_level: str = "INFO"
    kv_reserve: int = DEFAULT_KV_RESERVE_BYTES
    start_timeout: float = 120.0
    restart: RestartPolicy = RestartPolicy()
    compute_lanes: int | None = None  # None: the GPU worker's auto choice
    test_io_read_delay_ms: float = 0.0
    test_hooks: tuple[str, ...] = ()


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _lanes(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        return check_compute_lanes(_count(1)(text), name="N")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _pins(text: str) -> int | str:
    return "auto" if text == "auto" else _count(0)(text)


def _endpoint(text: str) -> str:
    try:
        return check_jobs_endpoint(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> SupervisorOptions:
    parser = argparse.ArgumentParser(prog="moeslab-launch", description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", required=True, metavar="DIR", help="the mlx-lm model directory")
    add(
        "--memory-budget",
        required=True,
        type=_size,
        metavar="SIZE",
        help="total for dense weights, KV reserve and slab: 8GiB, 512MiB, 1.5GB or bytes",
    )
    add("--io-workers", type=_count(1), default=2, metavar="N")
    add("--working-slots", type=_count(1), default=None, metavar="N")
    add(
        "--slots-per-layer",
        type=_count(1),
        default=None,
        metavar="N",
        help="upper bound on resident slots per sparse layer",
    )
    add("--pinned-experts", type=_pins, default=0, metavar="N|auto")
    add("--io-mode", choices=("direct", "buffered"), default="direct")
    add(
        "--compute-lanes",
        type=_lanes,
        default=None,
        metavar="N|auto",
        help="MLX streams a decode step's experts compute on (auto: 2 on a CPU with 2+ cores, else 1)",
    )
    add("--run-dir", default=None, metavar="DIR", help="default: a fresh private directory")
    add(
        "--endpoint",
        type=_endpoint,
        default=None,
        metavar="URL",
        help="jobs endpoint (default ipc://RUN_DIR/jobs; tcp://127.0.0.1:PORT allowed, loopback only)",
    )
    add("--usage-file", default=None, metavar="PATH", help="the expert usage ledger")
    add("--log-level", type=str.upper, choices=LOG_LEVELS, default="INFO")
    add("--kv-reserve", type=_size, default=DEFAULT_KV_RESERVE_BYTES, metavar="SIZE")
    add("--start-timeout", type=_seconds, default=120.0, metavar="S", help="for a child to become ready")
    add("--max-restarts", type=_count(0), default=5, metavar="N", help="per child, within --restart-window")
    add("--restart-window", type=_seconds, default=60.0, metavar="S")
    add("--test-io-read-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    add("--test-hooks", default="", help=argparse.SUPPRESS)  # comma-separated coordinator test hooks
    ns = parser.parse_args(argv)
    return SupervisorOptions(
        model=ns.model,
        memory_budget=ns.memory_budget,
        io_workers=ns.io_workers,
        working_slots=ns.working_slots,
        slots_per_layer=ns.slots_per_layer,
        pinned_experts=ns.pinned_experts,
        io_mode=ns.io_mode,
        run_dir=ns.run_dir,
        endpoint=ns.endpoint,
        usage_file=ns.usage_file,
        log_level=ns.log_level,
        kv_reserve=ns.kv_reserve,
        start_timeout=ns.start_timeout,
        restart=RestartPolicy(max_restarts=ns.max_restarts, window_s=ns.restart_window),
        compute_lanes=ns.compute_lanes,
        test_io_read_delay_ms=ns.test_io_read_delay_ms,
        test_hooks=tuple(hook for hook in ns.test_hooks.split(",") if hook),
    )


# ------------------------------------------------------------------ signals and logging


class _Signals:
    """SIGINT/SIGTERM set a flag and wake the loop through a pipe (signal.set_wakeup_fd)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.fd = -1
        self._write = -1
        self._previous: dict[int, object] = {}
        self._previous_fd = -1

    def requested(self) -> bool:
        return self.received is not None

    def drain(self) -> None:
        try:
            while os.read(self.fd, 512):
                pass
        except BlockingIOError:
            pass

    def _handle(self, signum: int, _frame: object) -> None:
        if self.received is None:
            self.received = signum

    def __enter__(self) -> _Signals:
        self.fd, self._write = os.pipe()
        for fd in (self.fd, self._write):
            os.set_blocking(fd, False)
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self.fd)
        os.close(self._write)


class _Formatter(logging.Formatter):
    """The supervisor's own lines with its process name; children's lines as they wrote them."""

    def format(self, record: logging.LogRecord) -> str:
        if record.name.startswith((CHILD_LOGGER, "ioworker.child")):
            return record.getMessage()
        return super().format(record)


def _setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter("%(asctime)s supervisor[%(process)d] %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def _pid_key(name: str) -> str:
    return name.lower().replace("i/o worker ", "io_worker_").replace(" ", "_")


def ready_line(system: RunningSystem) -> str:
    """The one line of stdout: where to connect, what runs, what was planned."""
    pids = {"supervisor": os.getpid(), **{_pid_key(name): pid for name, pid in system.pids.items()}}
    assert system.config is not None
    return json.dumps(
        {
            "event": "ready",
            "endpoint": system.endpoint,
            "run_dir": system.run_dir,
            "slab": system.slab_name,
            "pids": pids,
            "plan": asdict(system.plan),
            "pinned": [list(pair) for pair in system.config.pinned],
        }
    )


# ------------------------------------------------------------------ the watch loop


@dataclass(frozen=True, slots=True)
class _Unready:
    deadline: float  # killed (a death like any other) if not ready by then
    since: float  # when it was restarted
    seen_down: bool = False  # health has shown it not ready since the restart


class _Watcher:
    """Restarts dead children within the restart budget; checks that restarted ones become ready."""

    def __init__(
        self, system: RunningSystem, options: SupervisorOptions, signals: _Signals, context: zmq.Context
    ) -> None:
        self.system, self.options, self.signals = system, options, signals
        self.deaths: dict[str, deque[float]] = {}
        self.restart_at: dict[str, float] = {}  # name -> when its dead child is restarted
        self.unready: dict[str, _Unready] = {}  # restarted children not known to be ready yet
        self.health = context.socket(zmq.DEALER)
        self.health.setsockopt(zmq.LINGER, 0)
        self.health.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.health.connect(system.endpoint)
        self.next_health = 0.0
        self.sent = 0
        self.asked: dict[str, float] = {}  # health request id -> when it was sent

    def run(self) -> int:
        while True:
            self._wait()
            if self.signals.requested():
                logger.info("%s: stopping", signal.Signals(self.signals.received or 0).name)
                return EXIT_OK
            now = time.monotonic()
            for child in list(self.system.children):
                if child.exit_code is not None and child.name not in self.restart_at:
                    if COORDINATOR in self.restart_at:
                        continue  # every child is restarted with it
                    if not self._died(child, now):
                        return EXIT_FAILED
            for name, due in sorted(self.restart_at.items(), key=lambda item: item[1]):
                # A coordinator restart clears the others' entries: every child starts anew.
                if name in self.restart_at and due <= now and not self._restart(name):
                    return EXIT_FAILED
            self._check_ready(time.monotonic())

    def _wait(self) -> None:
        sentinels = [child.sentinel for child in self.system.children if child.exit_code is None]
        timeout = 0.2 if None in sentinels else 1.0
        wakeups = list(self.restart_at.values()) + ([self.next_health] if self.unready else [])
        soonest = min(wakeups, default=None)
        if soonest is not None:
            timeout = min(timeout, max(0.0, soonest - time.monotonic()))
        select.select([self.signals.fd, *(fd for fd in sentinels if fd is not None)], [], [], timeout)
        self.signals.drain()

    def _died(self, child: ChildProcess, now: float) -> bool:
        """Schedule the restart of a dead child; False when its restart budget is spent."""
        policy = self.options.restart
        deaths = self.deaths.setdefault(child.name, deque())
        deaths.append(now)
        while deaths and deaths[0] < now - policy.window_s:
            deaths.popleft()
        self.unready.pop(child.name, None)
        logger.error("%s", child.describe())
        if len(deaths) > policy.max_restarts:
            logger.error(
                "%s died %d times within %g s (at most %d restarts allowed); stopping the system",
                child.name,
                len(deaths),
                policy.window_s,
                policy.max_restarts,
            )
            return False
        delay = policy.backoff(len(deaths))
        self.restart_at[child.name] = now + delay
        what = "every child (the coordinator holds all their sessions)" if child.name == COORDINATOR else child.name
        logger.warning(
            "restarting %s%s (restart %d of at most %d per %g s)",
            what,
            f" in {delay:g} s" if delay else "",
            len(deaths),
            policy.max_restarts,
            policy.window_s,
        )
        return True

    def _restart(self, name: str) -> bool:
        del self.restart_at[name]
        try:
            if name == COORDINATOR:
                self.unready.clear()
                self.restart_at.clear()  # the others' deaths are moot: every child starts again
                self.system.restart_all(cancel=self.signals.requested)
                return True
            child = next(c for c in self.system.children if c.name == name)
            replacement = self.system.respawn(child)
        except LaunchCancelled:
            return True  # a signal arrived; the loop stops next
        except (LaunchError, OSError) as error:
            logger.error("could not restart %s: %s", name, error)
            return False
        now = time.monotonic()
        self.unready[name] = _Unready(deadline=now + self.options.start_timeout, since=now)
        logger.info("%s restarted as pid %d; waiting for it to be ready", name, replacement.pid)
        return True

    def _check_ready(self, now: float) -> None:
        """Ask health while a restarted child is not ready yet; kill one that stalls.

        A reply may still describe the dead child (the coordinator notices a death by its own
        watchdog), so "ready" counts only once health has shown the child down, or in a reply
        to a request sent READY_SETTLE_S after the restart. Erring this way can only miss a stall,
        never kill a healthy child."""
        if not self.unready:
            return
        while self.health.poll(0):
            try:
                reply = decode(self.health.recv(), CLIENT_ACCEPTS)
            except ProtocolError:
                continue
            asked = self.asked.pop(reply.id, None) if isinstance(reply, HealthReply) else None
            if asked is None:
                continue
            for name, state in list(self.unready.items()):
                up = reply.gpu_worker if name == GPU_WORKER else reply.io_workers == self.system.io_workers
                if not up:
                    self.unready[name] = replace(state, seen_down=True)
                elif state.seen_down or asked >= state.since + READY_SETTLE_S:
                    del self.unready[name]
                    logger.info("%s is ready again", name)
        for name, state in list(self.unready.items()):
            if now > state.deadline:
                child = next(c for c in self.system.children if c.name == name)
                logger.error(
                    "%s (pid %d) was not ready %g s after its restart; killing it",
                    name,
                    child.pid,
                    self.options.start_timeout,
                )
                del self.unready[name]
                child.process.kill()
        if self.unready and now >= self.next_health:
            self.sent += 1
            request = f"supervisor-{self.sent}"
            self.health.send(encode(HealthRequest(id=request)), zmq.NOBLOCK)
            self.asked[request] = now
            self.next_health = now + HEALTH_INTERVAL_S

    def close(self) -> None:
        self.health.close(linger=0)


# ------------------------------------------------------------------ entry


def _pinned(options: SupervisorOptions) -> int | tuple[tuple[int, int], ...]:
    if options.pinned_experts != "auto":
        return int(options.pinned_experts)
    store = ExpertStore.open(options.model)
    usage = os.path.abspath(options.usage_file) if options.usage_file else None
    return auto_pins(
        store,
        memory_budget=options.memory_budget,
        kv_reserve_bytes=options.kv_reserve,
        working_slots=options.working_slots,
        usage_file=usage,
    )


def _with_default_usage_file(options: SupervisorOptions) -> SupervisorOptions:
    """Without --usage-file the run keeps its history in the model's cache directory,
    so a second run of the same model starts from what the first one learned."""
    if options.usage_file is not None:
        return options
    path = default_usage_file(ExpertStore.open(options.model))
    logger.info("expert usage history: %s (default for this model; --usage-file overrides)", path)
    return replace(options, usage_file=path)


def run_supervisor(options: SupervisorOptions) -> int:
    """Start the system, print the ready line, watch it until a signal or a fatal failure; the exit code."""
    options = _with_default_usage_file(options)
    system: RunningSystem | None = None
    watcher: _Watcher | None = None
    context = zmq.Context()
    with _Signals() as signals:
        try:
            report = clean_stale_runs()
            if report.removed_dirs:
                logger.info(
                    "removed %d stale run(s) and %d segment(s) of dead launchers",
                    len(report.removed_dirs),
                    len(report.removed_segments),
                )
            if options.run_dir is not None:
                claim_run_dir(options.run_dir)
            system = start_system(
                model_dir=options.model,
                memory_budget=options.memory_budget,
                io_workers=options.io_workers,
                working_slots=options.working_slots,
                slots_per_layer=options.slots_per_layer,
                pinned=_pinned(options),
                io_mode=options.io_mode,
                run_dir=options.run_dir,
                usage_file=options.usage_file,
                test_hooks=options.test_hooks,
                log_level=options.log_level,
                kv_reserve_bytes=options.kv_reserve,
                start_timeout=options.start_timeout,
                jobs_endpoint=options.endpoint,
                io_read_delay_ms=options.test_io_read_delay_ms,
                compute_lanes=options.compute_lanes,
                cancel=signals.requested,
            )
            try:
                sys.stdout.write(ready_line(system) + "\n")
                sys.stdout.flush()
            except BrokenPipeError:
                logger.warning("stdout is closed; the ready line was not delivered")
            logger.info("ready: jobs at %s, run directory %s", system.endpoint, system.run_dir)
            watcher = _Watcher(system, options, signals, context)
            return watcher.run()
        except LaunchCancelled:
            logger.info("stopped by a signal while starting")
            return EXIT_OK
        except (LaunchError, BudgetError, RunDirInUse) as error:
            logger.error("%s", error)
            return EXIT_FAILED
        except (ValueError, OSError) as error:  # a model dir that is not a model, a bad pin, ...
            logger.error("cannot start: %s: %s", type(error).__name__, error)
            return EXIT_FAILED
        finally:
            if watcher is not None:
                watcher.close()
            context.term()
            if system is not None:
                system.stop()
                logger.info("stopped; slab %s unlinked, run directory %s cleaned up", system.slab_name, system.run_dir)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        options = parse_args(argv)
    except SystemExit as exit_:  # argparse has printed the usage error
        return EXIT_USAGE if exit_.code else EXIT_OK
    _setup_logging(options.log_level)
    return run_supervisor(options)


__all__ = ["RestartPolicy", "SupervisorOptions", "main", "parse_args", "ready_line", "run_supervisor"]
