"""Each child's command line, built and parsed in one place.

The supervisor starts every child by its command line (`python -m coordinator
...`, `python -m ioworker ...`, `python -m gpuworker ...`, `python -m httpfront
...`) and the child
parses it back; both sides use the dataclass and the two functions here, so
a flag cannot be spelled one way by the builder and another by the parser
(`parse_*(…_argv(args)) == args`, tested). The `*_for(run)` functions derive
a child's arguments from the one `RunConfig` of a run. `--death-fd` is
appended by whoever spawns the child (`shared.children.spawn_child`), which
owns the pipe.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from native import DEFAULT_BLOCK_SIZE, OpenMode, check_block_size
from native.staging import STAGING_REQUESTS, StagingRequest
from shared.config import (
    IO_MODES,
    MAX_COMPUTE_LANES,
    MAX_PREFETCH_DISTANCE,
    RunConfig,
    check_compute_lanes,
    check_prefetch_distance,
)
from shared.gpu_messages import MAX_ROUTE_ROWS
from shared.scheduling import HELPER_SCHEDULING

COORDINATOR_MODULE, IO_WORKER_MODULE, GPU_WORKER_MODULE = "coordinator", "ioworker", "gpuworker"
HTTP_FRONT_MODULE = "httpfront"
DEFAULT_PREFILL_STEP = 2048  # mlx-lm's generate_step default; <= MAX_ROUTE_ROWS / batch


def child_command(module: str, argv: Sequence[str], *, python: str = sys.executable) -> list[str]:
    """`python -m module argv...`: how every child is started."""
    return [python, "-m", module, *argv]


def _flags(args: object, names: Sequence[str]) -> list[str]:
    """`--name value` for each named field that is not None (bools: the flag alone when True)."""
    out: list[str] = []
    for name in names:
        value = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        out += [flag] if value is True else [flag, str(value)]
    return out


# ------------------------------------------------------------------ coordinator


@dataclass(frozen=True, slots=True)
class CoordinatorArgs:
    config: str  # the run's config.json: everything else the coordinator needs
    death_fd: int | None = None
    log_level: str | None = None  # overrides the config's


def coordinator_argv(args: CoordinatorArgs) -> list[str]:
    return _flags(args, [f.name for f in fields(CoordinatorArgs)])


def parse_coordinator_argv(argv: Sequence[str] | None = None) -> CoordinatorArgs:
    parser = argparse.ArgumentParser(prog="python -m coordinator", description="The coordinator process.")
    parser.add_argument("--config", required=True, help="the run's config.json")
    parser.add_argument("--death-fd", type=int, default=None, help="read end of the parent's death pipe")
    parser.add_argument("--log-level", default=None, help="overrides the config's log level")
    return CoordinatorArgs(**vars(parser.parse_args(argv)))


# ------------------------------------------------------------------ I/O worker


@dataclass(frozen=True, slots=True)
class IOWorkerArgs:
    index: int
    endpoint: str
    manifest: str  # JSON file: an array of absolute paths
    slab_name: str
    total_slots: int
    slot_bytes: int
    block_size: int = DEFAULT_BLOCK_SIZE
    queue_depth: int = 8
    io_mode: OpenMode = "auto"
    staging: StagingRequest = "auto"
    scheduling: str = "auto"  # shared.scheduling.HELPER_SCHEDULING
    hint_queue: int = 256
    death_fd: int | None = None
    handshake_timeout: float = 10.0
    log_level: str = "INFO"
    test_read_delay_ms: float = 0.0  # tests only: hold each load this long before reading


def io_worker_argv(args: IOWorkerArgs) -> list[str]:
    names = [f.name for f in fields(IOWorkerArgs) if f.name != "test_read_delay_ms"]
    return _flags(args, names) + _flags(args, ["test_read_delay_ms"] if args.test_read_delay_ms else [])


def parse_io_worker_argv(argv: Sequence[str] | None = None) -> IOWorkerArgs:
    parser = argparse.ArgumentParser(prog="python -m ioworker", description="The I/O worker process.")
    add = parser.add_argument
    add("--index", type=int, required=True)
    add("--endpoint", required=True, help="the coordinator's ROUTER endpoint")
    add("--manifest", required=True, help="JSON array of absolute file paths")
    add("--slab-name", required=True)
    add("--total-slots", type=int, required=True)
    add("--slot-bytes", type=int, required=True)
    add("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    add("--queue-depth", type=int, default=8, help="concurrent reads")
    add("--io-mode", choices=list(IO_MODES), default="auto")
    add("--staging", choices=list(STAGING_REQUESTS), default="auto", help="direct reads through huge-page buffers")
    add("--scheduling", choices=list(HELPER_SCHEDULING), default="auto", help="Linux scheduling class or CPU")
    add("--hint-queue", type=int, default=256, help="hint messages queued before drops")
    add("--death-fd", type=int, default=None, help="read end of the parent's death pipe")
    add("--handshake-timeout", type=float, default=10.0)
    add("--log-level", default="INFO")
    add("--test-read-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    for name in ("index", "total_slots", "slot_bytes", "queue_depth", "hint_queue"):
        minimum = 0 if name == "index" else 1
        if getattr(ns, name) < minimum:
            parser.error(f"--{name.replace('_', '-')} must be >= {minimum}, got {getattr(ns, name)}")
    try:
        check_block_size(ns.block_size)
    except ValueError as error:
        parser.error(str(error))
    return IOWorkerArgs(**vars(ns))


def io_worker_args_for(run: RunConfig, index: int) -> IOWorkerArgs:
    """I/O worker `index` of a run."""
    return IOWorkerArgs(
        index=index,
        endpoint=run.endpoints.io,
        manifest=run.manifest,
        slab_name=run.slab.name,
        total_slots=run.slab.total_slots,
        slot_bytes=run.slab.slot_bytes,
        block_size=run.block_size,
        io_mode=run.io_mode,  # type: ignore[arg-type]
        handshake_timeout=run.start_timeout_s,
        log_level=run.log_level,
        test_read_delay_ms=run.test_io_read_delay_ms or 0.0,
        staging=run.io_staging,  # type: ignore[arg-type]
        scheduling=run.helper_scheduling,
    )


# ------------------------------------------------------------------ GPU worker


@dataclass(frozen=True, slots=True)
class GpuWorkerArgs:
    model: str
    endpoint: str
    death_fd: int | None = None
    log_level: str = "INFO"
    handshake_timeout: float = 10.0
    reply_timeout: float = 60.0  # longest wait for one lease/fenced reply
    stop_grace: float = 5.0  # after SIGTERM, how long a pending lease reply is still awaited
    prefill_step_size: int = DEFAULT_PREFILL_STEP
    compute_lanes: int | None = None  # MLX streams for a decode wave's parts; None: auto (gpuworker.lanes)
    max_sequences: int = 1  # jobs decoded together (>1: mlx-lm's BatchGenerator, gpuworker/batch_serve.py)
    prefetch_distance: int = 1  # sparse layers ahead a decode step's prefetch predicts (gpuworker.prediction)


def gpu_worker_argv(args: GpuWorkerArgs) -> list[str]:
    return _flags(args, [f.name for f in fields(GpuWorkerArgs)])


def parse_gpu_worker_argv(argv: Sequence[str] | None = None) -> GpuWorkerArgs:
    parser = argparse.ArgumentParser(prog="python -m gpuworker", description="The GPU worker process.")
    add = parser.add_argument
    add("--model", required=True, help="the mlx-lm model directory")
    add("--endpoint", required=True, help="the coordinator's ROUTER endpoint")
    add("--death-fd", type=int, default=None, help="read end of the parent's death pipe")
    add("--log-level", default="INFO")
    add("--handshake-timeout", type=float, default=10.0, help="seconds to wait for gpu_welcome")
    add("--reply-timeout", type=float, default=60.0, help="seconds to wait for one lease reply")
    add("--stop-grace", type=float, default=5.0, help="seconds a pending lease reply is still awaited after SIGTERM")
    add("--prefill-step-size", type=int, default=DEFAULT_PREFILL_STEP)
    add("--max-sequences", type=int, default=1, help="jobs decoded together (1: one at a time)")
    add(
        "--prefetch-distance",
        type=int,
        default=1,
        help=f"sparse layers ahead a decode step's prefetch predicts, 1..{MAX_PREFETCH_DISTANCE}",
    )
    add(
        "--compute-lanes",
        type=int,
        default=None,
        help=f"MLX streams a decode wave's experts compute on, 1..{MAX_COMPUTE_LANES} "
        "(default: auto, 2 on a CPU with 2+ cores, else 1)",
    )
    ns = parser.parse_args(argv)
    try:
        if ns.compute_lanes is not None:
            check_compute_lanes(ns.compute_lanes, name="--compute-lanes")
        check_prefetch_distance(ns.prefetch_distance, name="--prefetch-distance")
    except ValueError as error:
        parser.error(str(error))
    for name in ("handshake_timeout", "reply_timeout", "prefill_step_size", "max_sequences"):
        if getattr(ns, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(ns, name)}")
    if ns.prefill_step_size > MAX_ROUTE_ROWS:  # one chunk's routes travel in one `routes`
        parser.error(f"--prefill-step-size must be <= {MAX_ROUTE_ROWS}, got {ns.prefill_step_size}")
    if ns.stop_grace < 0:
        parser.error(f"--stop-grace must be >= 0, got {ns.stop_grace}")
    if not Path(ns.model).is_dir():
        parser.error(f"--model {ns.model!r} is not a directory")
    return GpuWorkerArgs(**vars(ns))


def gpu_worker_args_for(run: RunConfig) -> GpuWorkerArgs:
    """The GPU worker of a run."""
    return GpuWorkerArgs(
        model=run.model_dir,
        endpoint=run.endpoints.gpu,
        log_level=run.log_level,
        compute_lanes=run.compute_lanes,
        max_sequences=run.max_sequences,
        prefetch_distance=run.prefetch_distance,
    )


# ------------------------------------------------------------------ HTTP front


@dataclass(frozen=True, slots=True)
class HttpFrontArgs:
    listen: str  # HOST:PORT (an IPv6 host in brackets); port 0 picks a free one
    jobs_endpoint: str  # the coordinator's job front door, which the front is a client of
    model_id: str  # what /v1/models names the model (the model directory's name)
    ready_file: str  # written (JSON: pid, url) once the port listens: how the supervisor sees it ready
    server_key: str | None = None  # the front door's CURVE public key (z85) when it is a CURVE server
    api_key_file: str | None = None  # a file holding the bearer token every request must carry (not on argv)
    death_fd: int | None = None
    log_level: str = "INFO"


def http_front_argv(args: HttpFrontArgs) -> list[str]:
    return _flags(args, [f.name for f in fields(HttpFrontArgs)])


def parse_http_front_argv(argv: Sequence[str] | None = None) -> HttpFrontArgs:
    parser = argparse.ArgumentParser(prog="python -m httpfront", description="The HTTP front (OpenAI API).")
    add = parser.add_argument
    add("--listen", required=True, metavar="HOST:PORT", help="where HTTP is served (port 0: a free port)")
    add("--jobs-endpoint", required=True, help="the coordinator's job front door")
    add("--model-id", required=True, help="the served model's id (/v1/models)")
    add("--ready-file", required=True, help="written once the port listens")
    add("--server-key", default=None, help="the job front door's CURVE public key (z85)")
    add("--api-key-file", default=None, help="a file holding the bearer token every request must carry")
    add("--death-fd", type=int, default=None, help="read end of the parent's death pipe")
    add("--log-level", default="INFO")
    ns = parser.parse_args(argv)
    try:
        split_host_port(ns.listen)
    except ValueError as error:
        parser.error(str(error))
    return HttpFrontArgs(**vars(ns))


def split_host_port(text: str) -> tuple[str, int]:
    """`HOST:PORT` (an IPv6 address in brackets: `[::1]:8080`) as (host without brackets, port);
    ValueError naming the text otherwise. Port 0 asks for a free port."""
    host, colon, port = text.rpartition(":")
    bare = host.removeprefix("[").removesuffix("]")
    if not colon or not bare or (":" in bare and not (host.startswith("[") and host.endswith("]"))):
        raise ValueError(f"{text!r} is not HOST:PORT (an IPv6 address in brackets, e.g. [::1]:8080)")
    if not port.isdigit() or not port.isascii() or not 0 <= int(port) < 65536:
        raise ValueError(f"{text!r} needs a port between 0 and 65535")
    return bare, int(port)


__all__ = [
    "COORDINATOR_MODULE",
    "DEFAULT_PREFILL_STEP",
    "GPU_WORKER_MODULE",
    "HTTP_FRONT_MODULE",
    "IO_WORKER_MODULE",
    "CoordinatorArgs",
    "GpuWorkerArgs",
    "HttpFrontArgs",
    "IOWorkerArgs",
    "child_command",
    "coordinator_argv",
    "gpu_worker_args_for",
    "gpu_worker_argv",
    "http_front_argv",
    "io_worker_args_for",
    "io_worker_argv",
    "parse_coordinator_argv",
    "parse_gpu_worker_argv",
    "parse_http_front_argv",
    "parse_io_worker_argv",
    "split_host_port",
]
