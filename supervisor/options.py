"""The supervisor's command line (`moeslab-launch`): every flag, checked, as one frozen `SupervisorOptions`.

A bad value is refused by argparse with the flag and the value named (exit 2).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.config import (
    COPY_AHEAD_MODES,
    DEFAULT_REPLACEMENT,
    LEASE_PATHS,
    MAX_PREFETCH_DISTANCE,
    PREFETCH_MODES,
    check_compute_lanes,
    check_jobs_endpoint,
    check_prefetch_distance,
    parse_replacement,
)
from shared.scheduling import HELPER_SCHEDULING
from supervisor.budget import DEFAULT_KV_RESERVE_BYTES, parse_size
from supervisor.http_child import check_http

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DESCRIPTION = "The supervisor: `moeslab-launch` (or `python scripts/launch.py`) starts and watches a whole system."


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
    io_workers: int | None = None  # None: auto (shared.scheduling.resolve_io_workers)
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
    hang_timeout: float = 10.0  # a worker owing work and silent this long (plus its work's allowance) is hung
    restart: RestartPolicy = RestartPolicy()
    compute_lanes: int | None = None  # None: the GPU worker's auto choice
    prefetch: str = "auto"  # next-layer prefetch: auto | on | off
    prefetch_margin: int | None = None  # experts predicted beyond top-k (None: RunConfig's, a quarter of top-k)
    prefetch_distance: int = 1  # sparse layers ahead a decode step's prefetch predicts
    replacement: str = DEFAULT_REPLACEMENT  # the residency manager's replacement policy
    lease_path: str = "shared"  # shared.config.LEASE_PATHS
    copy_ahead: str = "on"  # shared.config.COPY_AHEAD_MODES
    helper_scheduling: str = "auto"  # the coordinator's and I/O workers' class or CPU (shared/scheduling.py)
    # The job front door's limits (coordinator/job_limits.py); None: the model's context, or half the queue.
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None
    max_queued_per_client: int | None = None
    max_sequences: int | None = None  # jobs decoding together (None: RunConfig's default)
    test_io_read_delay_ms: float = 0.0
    test_hooks: tuple[str, ...] = ()
    curve: bool = False  # the jobs endpoint a CURVE server with a key pair made for this run
    curve_keys: str | None = None  # ... or with the pair in this directory (shared.curve)
    http: str | None = None  # HOST:PORT of the HTTP front (the OpenAI API); None: no HTTP front
    api_key: str | None = field(default=None, repr=False)  # the bearer token the HTTP front requires


def job_limits(options: SupervisorOptions) -> dict[str, int]:
    """The front door's limits the flags set, as `RunConfig` fields (an unset one keeps its default)."""
    names = ("max_prompt_tokens", "max_tokens", "max_queued_per_client", "max_sequences")
    return {name: getattr(options, name) for name in names if getattr(options, name) is not None}


def prediction_fields(options: SupervisorOptions) -> dict[str, object]:
    """The flags for the next layers' experts (copy ahead, prefetch margin and distance) and for the
    helpers' scheduling as `RunConfig` fields."""
    fields: dict[str, object] = {
        "copy_ahead": options.copy_ahead,
        "helper_scheduling": options.helper_scheduling,
        "prefetch_distance": options.prefetch_distance,
    }
    if options.prefetch_margin is not None:
        fields["prefetch_margin"] = options.prefetch_margin
    return fields


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


def _io_workers(text: str) -> int | None:
    return None if text == "auto" else _count(1)(text)


def _distance(text: str) -> int:
    try:
        return check_prefetch_distance(_count(1)(text), name="D")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _pins(text: str) -> int | str:
    return "auto" if text == "auto" else _count(0)(text)


def _replacement(text: str) -> str:
    try:
        parse_replacement(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _endpoint(text: str) -> str:
    try:  # the form only: whether it may be exposed depends on --curve, checked after parsing
        return check_jobs_endpoint(text, curve=True)
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


class _Parser(argparse.ArgumentParser):
    """A usage error is one line (argparse's own starts with the whole usage synopsis)."""

    def error(self, message: str):  # type: ignore[override]  # argparse's NoReturn
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv: Sequence[str] | None = None) -> SupervisorOptions:
    parser = _Parser(prog="moeslab-launch", description=DESCRIPTION)
    add = parser.add_argument
    add("--model", required=True, metavar="DIR", help="the mlx-lm model directory")
    add(
        "--memory-budget",
        required=True,
        type=_size,
        metavar="SIZE",
        help="total for dense weights, KV reserve and slab: 8GiB, 512MiB, 1.5GB or bytes",
    )
    add(
        "--io-workers",
        type=_io_workers,
        default=None,
        metavar="N|auto",
        help="I/O worker processes (auto: 1 on a host of at most 2 usable cores, else 2)",
    )
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
    add(
        "--prefetch",
        choices=PREFETCH_MODES,
        default="auto",
        help="load the experts the next layer's router predicts while a layer computes "
        "(auto: a layer whose prefetches are not used stops)",
    )
    add(
        "--prefetch-margin",
        type=_count(0),
        default=None,
        metavar="M",
        help="experts predicted per layer beyond top-k (default: a quarter of top-k); each one the "
        "layer does not pick is a wasted read, each one it picks a miss hidden",
    )
    add(
        "--prefetch-distance",
        type=_distance,
        default=1,
        metavar="D",
        help=f"sparse layers ahead a prefetch predicts, 1..{MAX_PREFETCH_DISTANCE} (default 1); more where a "
        "layer computes faster than a prefetch lands (a GPU), at the cost of a less exact prediction",
    )
    add(
        "--copy-ahead",
        choices=COPY_AHEAD_MODES,
        default="on",
        help="copy path (CPU, CUDA): copy the experts the next layer's router predicts while a layer "
        "computes, so that only mispredicted ones are copied when the layer's routes are known",
    )
    add(
        "--helper-scheduling",
        choices=HELPER_SCHEDULING,
        default="auto",
        help="Linux: last-cpu puts every thread of the coordinator and the I/O workers on the last usable CPU, so "
        "that where MLX computes on the CPU their wake-ups preempt the computation on one core only; batch runs "
        "them as SCHED_BATCH (an experiment); normal changes nothing; auto (default): last-cpu on a Linux host "
        "of at most 2 usable cores, else normal (README says what each measured)",
    )
    add(
        "--lease-path",
        choices=LEASE_PATHS,
        default="shared",
        help="shared: the GPU worker leases resident experts through atomic words in shared memory "
        "(misses take messages); messages: every layer visit is a round trip to the coordinator",
    )
    add(
        "--replacement",
        type=_replacement,
        default=DEFAULT_REPLACEMENT,
        metavar="NAME",
        help=f"the resident experts' replacement policy: nextuse[:TRANSITION_HALF_LIFE], lrfu[:HALF_LIFE] "
        f"or lru (default {DEFAULT_REPLACEMENT})",
    )
    add(
        "--max-prompt-tokens",
        type=_count(1),
        default=None,
        metavar="N",
        help="refuse a prompt of more tokens (default and upper bound: the model's context)",
    )
    add(
        "--max-tokens",
        type=_count(1),
        default=None,
        metavar="N",
        help="refuse a job asking for more tokens (default: the model's context; the prompt plus "
        "max_tokens must fit the context too)",
    )
    add(
        "--max-queued-per-client",
        type=_count(1),
        default=None,
        metavar="N",
        help="waiting jobs one client may hold (default: half the queue, so no client fills it)",
    )
    add(
        "--max-sequences",
        type=_count(1),
        default=None,
        metavar="N",
        help="jobs decoded together, one batched forward pass per step (default: 4; 1 decodes one job at a time)",
    )
    add("--run-dir", default=None, metavar="DIR", help="default: a fresh private directory")
    add(
        "--endpoint",
        type=_endpoint,
        default=None,
        metavar="URL",
        help="jobs endpoint (default ipc://RUN_DIR/jobs; tcp://127.0.0.1:PORT; another tcp host needs --curve)",
    )
    curve = parser.add_mutually_exclusive_group()
    curve.add_argument(
        "--curve",
        action="store_true",
        help="serve jobs over ZeroMQ CURVE with a key pair made for this run (RUN_DIR/curve); "
        "clients need the ready line's curve_public_key",
    )
    curve.add_argument(
        "--curve-keys", default=None, metavar="DIR", help="like --curve with DIR/server.key_secret (mode 0600)"
    )
    add(
        "--http",
        default=None,
        metavar="HOST:PORT",
        help="serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics) "
        "on HOST:PORT (port 0: a free one, named in the ready line); a host other than loopback needs --api-key",
    )
    add("--api-key", default=None, metavar="KEY", help="with --http: every request needs 'Authorization: Bearer KEY'")
    add("--usage-file", default=None, metavar="PATH", help="the expert usage ledger")
    add("--log-level", type=str.upper, choices=LOG_LEVELS, default="INFO")
    add("--kv-reserve", type=_size, default=DEFAULT_KV_RESERVE_BYTES, metavar="SIZE")
    add("--start-timeout", type=_seconds, default=120.0, metavar="S", help="for a child to become ready")
    add(
        "--hang-timeout",
        type=_seconds,
        default=10.0,
        metavar="S",
        help="a worker that owes work and shows no progress this long (plus an allowance for the bytes or rows "
        "it owes) is killed and replaced like a dead one; the coordinator's health probe has the same deadline",
    )
    add("--max-restarts", type=_count(0), default=5, metavar="N", help="per child, within --restart-window")
    add("--restart-window", type=_seconds, default=60.0, metavar="S")
    add("--test-io-read-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    add("--test-hooks", default="", help=argparse.SUPPRESS)  # comma-separated coordinator test hooks
    ns = parser.parse_args(argv)
    if ns.api_key is not None and ns.http is None:
        parser.error("--api-key is for the HTTP front: add --http HOST:PORT")
    if ns.http is not None:
        try:
            check_http(ns.http, ns.api_key)
        except ValueError as error:
            parser.error(str(error))
    if ns.endpoint is not None:
        try:
            check_jobs_endpoint(ns.endpoint, curve=ns.curve or ns.curve_keys is not None)
        except ValueError as error:
            parser.error(str(error))
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
        hang_timeout=ns.hang_timeout,
        restart=RestartPolicy(max_restarts=ns.max_restarts, window_s=ns.restart_window),
        compute_lanes=ns.compute_lanes,
        prefetch=ns.prefetch,
        prefetch_margin=ns.prefetch_margin,
        prefetch_distance=ns.prefetch_distance,
        replacement=ns.replacement,
        lease_path=ns.lease_path,
        copy_ahead=ns.copy_ahead,
        helper_scheduling=ns.helper_scheduling,
        max_prompt_tokens=ns.max_prompt_tokens,
        max_tokens=ns.max_tokens,
        max_queued_per_client=ns.max_queued_per_client,
        max_sequences=ns.max_sequences,
        test_io_read_delay_ms=ns.test_io_read_delay_ms,
        test_hooks=tuple(hook for hook in ns.test_hooks.split(",") if hook),
        curve=ns.curve,
        curve_keys=ns.curve_keys,
        http=ns.http,
        api_key=ns.api_key,
    )


__all__ = ["LOG_LEVELS", "RestartPolicy", "SupervisorOptions", "job_limits", "parse_args"]
