"""The supervisor's entry: `moeslab-launch` (or `python -m supervisor`, `python scripts/launch.py`).

    moeslab-launch --model DIR --memory-budget 8GiB [--io-workers N|auto] [--endpoint tcp://127.0.0.1:5555]
        [--http 127.0.0.1:8080 [--api-key KEY]]

One entry function, `run_supervisor`: setup (stop signals, stale-run
cleanup, `start_system`: run directory, slab, children, startup handshake),
then exactly one JSON line on stdout (`{"event": "ready", ...}`; everything
else goes to stderr), the watch loop (`supervisor.watch`: restarts, liveness)
until SIGINT/SIGTERM (a clean stop, exit 0) or a fatal failure (exit 1), and
a `finally` that stops the children, unlinks the slab and removes the run
directory. The children also exit when the supervisor dies (their death
pipes report end of file). Flags: `supervisor.options`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace

import zmq

from shared.children import CHILD_LOGGER
from shared.plan import plan_after_baseline
from shared.process import ProcessLife
from shared.process_table import role_key
from shared.store import ExpertStore
from shared.usage_profile import default_usage_file
from supervisor.budget import auto_pins
from supervisor.options import SupervisorOptions, job_limits, parse_args, prediction_fields
from supervisor.readiness import LaunchCancelled
from supervisor.refusals import REFUSALS, StartupLogHandler, check_endpoint_free, refuse, release_startup_lines
from supervisor.rundir import claim_run_dir, clean_stale_runs
from supervisor.system import RunningSystem, start_system
from supervisor.watch import EXIT_FAILED, EXIT_OK, Watcher

logger = logging.getLogger("moeslab.supervisor")

EXIT_USAGE = 2


class _Formatter(logging.Formatter):
    """The supervisor's own lines with its process name; children's lines as they wrote them."""

    def format(self, record: logging.LogRecord) -> str:
        if record.name.startswith(CHILD_LOGGER):
            return record.getMessage()
        return super().format(record)


def _setup_logging(level: str) -> None:
    # Startup's INFO lines wait until something started, so a refusal is the only line.
    handler = StartupLogHandler(hold=level != "DEBUG")
    handler.setFormatter(_Formatter("%(asctime)s supervisor[%(process)d] %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def ready_line(system: RunningSystem) -> str:
    """The one line of stdout: where to connect, what runs, what was planned."""
    pids = {"supervisor": os.getpid(), **{role_key(name): pid for name, pid in system.pids.items()}}
    assert system.config is not None
    # The coordinator sized the slab after measuring every process: the plan in use is that one.
    health = system.health()
    kv_reserve = system.config.kv_reserve_bytes
    plan = plan_after_baseline(
        system.plan,
        baseline_bytes=health.baseline_bytes,
        kv_reserve_bytes=kv_reserve,
        compiler_bytes=health.compiler_bytes,
    )
    memory = {
        "budget_bytes": plan.budget_bytes,
        "baseline_bytes": health.baseline_bytes,
        "kv_reserve_bytes": kv_reserve,
        "compiler_bytes": health.compiler_bytes,
        "slab_bytes": plan.slab_bytes,
        "processes": {info.name: info.memory_bytes for info in health.processes},
    }
    return json.dumps(
        {
            "event": "ready",
            "endpoint": system.endpoint,
            "run_dir": system.run_dir,
            "slab": system.slab_name,
            "pids": pids,
            "plan": asdict(plan),
            "memory": memory,
            "pinned": [list(pair) for pair in system.config.pinned],
            "curve_public_key": system.curve_public_key,  # null: no CURVE; else what clients pass as --server-key
            "http": system.http_url,  # null: no HTTP front; else http://HOST:PORT (the port it really listens on)
        }
    )


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
    system: RunningSystem | None = None
    watcher: Watcher | None = None
    context = zmq.Context()
    # The supervisor has no death pipe and its parent may be a shell that exits: it watches signals only.
    with ProcessLife(death_fd=None, watch_parent=False) as life:
        try:
            options = _with_default_usage_file(options)  # opens the store: a missing model is refused here
            report = clean_stale_runs()
            if report.removed_dirs:
                logger.info(
                    "removed %d stale run(s) and %d segment(s) of dead launchers",
                    len(report.removed_dirs),
                    len(report.removed_segments),
                )
            if options.run_dir is not None:
                claim_run_dir(options.run_dir)
            if options.endpoint is not None:
                check_endpoint_free(options.endpoint)
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
                hang_timeout=options.hang_timeout,
                jobs_endpoint=options.endpoint,
                io_read_delay_ms=options.test_io_read_delay_ms,
                compute_lanes=options.compute_lanes,
                prefetch=options.prefetch,
                replacement=options.replacement,
                lease_path=options.lease_path,
                # The launcher's own memory is in the budget (coordinator/footprint.py).
                run_config={**job_limits(options), **prediction_fields(options), "supervisor_pid": os.getpid()},
                curve=options.curve,
                curve_keys=options.curve_keys,
                http=options.http,
                api_key=options.api_key,
                cancel=lambda: life.stop_requested,
            )
            release_startup_lines()
            try:
                sys.stdout.write(ready_line(system) + "\n")
                sys.stdout.flush()
            except BrokenPipeError:
                logger.warning("stdout is closed; the ready line was not delivered")
            logger.info("ready: jobs at %s, run directory %s", system.endpoint, system.run_dir)
            if system.http_url is not None:
                logger.info("serving the OpenAI API at %s/v1", system.http_url)
            watcher = Watcher(system, options, life, context)
            return watcher.run()
        except LaunchCancelled:
            logger.info("stopped by a signal while starting")
            return EXIT_OK
        except REFUSALS as error:  # a model dir that is not a model, a budget too small, ...: one line
            refuse(error, debug=options.log_level == "DEBUG")
            return EXIT_FAILED
        finally:
            release_startup_lines()
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


__all__ = ["main", "ready_line", "run_supervisor"]
