"""The run configuration: written once by the supervisor, read by the coordinator; the children's argv derive from it.

`RUN_DIR/config.json` holds everything a coordinator needs to serve one run:
the residency plan, the slab's name and geometry, the model directory, the
three endpoints, the I/O mode, the pinned experts, the usage file and any
test hooks. It is plain JSON (no pickle); `read_config` checks every field
and names the offending one, so a damaged file fails the start clearly.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import math
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.plan import ExpertResidencyPlan
from shared.scheduling import HELPER_SCHEDULING

CONFIG_VERSION = 1
CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.json"
IO_MODES = ("auto", "direct", "dontneed", "buffered")
# Next-layer prefetch (coordinator/prefetch.py): auto stops a layer whose prefetches do not pay.
PREFETCH_MODES = ("auto", "on", "off")
# How the GPU worker leases resident experts: `shared` (the lease words, shared.lease_words; misses
# take messages) or `messages` (every layer visit a routes -> lease round trip).
LEASE_PATHS = ("shared", "messages")
COPY_AHEAD_MODES = ("on", "off")  # gpuworker/copy_ahead.py
STAGING_MODES = ("auto", "on", "off")  # native.staging.STAGING_REQUESTS
TEST_HOOKS = ("scribble_fenced", "verify_fenced")
MAX_SEQUENCES = 64  # jobs decoded together at most (each holds its KV cache in the GPU worker)
# The residency manager's replacement policies (coordinator.replacement implements each; the one
# knob of a policy that has one follows its name: `lrfu:16`). The system default is the best one
# measured on real routing with scripts/replay.py; the manager's own default stays `lru`.
REPLACEMENT_POLICIES = ("lru", "lrfu", "nextuse")
REPLACEMENT_KNOBS = ("lrfu", "nextuse")  # the policies that take a knob
DEFAULT_REPLACEMENT = "nextuse"
# The GPU worker's --compute-lanes bound (MLX streams for a decode wave's parts; gpuworker.lanes).
MAX_COMPUTE_LANES = 16
# How many sparse layers ahead a prefetch may predict (gpuworker.prediction): each layer further
# names fewer of the experts its layer picks (the deep bench shape: 96%, 93%, 90% at 1, 2, 3).
MAX_PREFETCH_DISTANCE = 8
# sun_path is 108 bytes on Linux, 104 on macOS; keep a margin for the socket names.
MAX_IPC_PATH = 100


def check_compute_lanes(value: object, *, name: str = "compute_lanes") -> int:
    """`value` if it is a lane count (an int in [1, MAX_COMPUTE_LANES]); else ValueError naming
    `name` and the value."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COMPUTE_LANES:
        raise ValueError(f"{name} must be in [1, {MAX_COMPUTE_LANES}] (an int), got {value!r}")
    return value


def check_prefetch_distance(value: object, *, name: str = "prefetch_distance") -> int:
    """`value` if it is a prefetch distance (an int in [1, MAX_PREFETCH_DISTANCE]); else ValueError
    naming `name` and the value."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PREFETCH_DISTANCE:
        raise ValueError(f"{name} must be in [1, {MAX_PREFETCH_DISTANCE}] (an int), got {value!r}")
    return value


def parse_replacement(spec: object) -> tuple[str, int | None]:
    """A replacement policy's name and its knob (None: the policy's default) from `NAME` or
    `NAME:N` (N a positive integer, for a policy that has a knob); ValueError naming the spec."""
    if not isinstance(spec, str):
        raise ValueError(f"replacement policy must be a string, got {spec!r}")
    name, colon, knob = spec.partition(":")
    if name not in REPLACEMENT_POLICIES:
        raise ValueError(f"unknown replacement policy {spec!r}; known: {', '.join(REPLACEMENT_POLICIES)}")
    if not colon:
        return name, None
    if name not in REPLACEMENT_KNOBS:
        raise ValueError(f"replacement policy {name!r} takes no knob, got {spec!r}")
    if not knob.isdigit() or not knob.isascii() or int(knob) < 1:
        raise ValueError(f"replacement policy {spec!r}: the knob after ':' must be a positive integer")
    return name, int(knob)


# Durations that must be positive (io_replacement_grace_s may be 0: lost loads fail at once).
POSITIVE_FLOATS = ("start_timeout_s", "footprint_interval_ms", "usage_flush_s", "hang_timeout_s")


class ConfigError(ValueError):
    """A run configuration that cannot be used; the message names the field."""


@dataclass(frozen=True, slots=True)
class SlabSpec:
    name: str
    total_slots: int
    slot_bytes: int
    # The lease words after the slots (shared.lease_words): a map of `lease_layers` (one more than
    # the highest sparse layer id) x `lease_experts`; 0 layers: no words.
    lease_layers: int = 0
    lease_experts: int = 0

    @property
    def tail_bytes(self) -> int:
        if not self.lease_layers:
            return 0
        from shared.lease_words import lease_words_bytes  # the native module, only where words exist

        return lease_words_bytes(slots=self.total_slots, layers=self.lease_layers, experts=self.lease_experts)


@dataclass(frozen=True, slots=True)
class Endpoints:
    io: str  # I/O workers' DEALERs connect here (the coordinator's ROUTER)
    gpu: str  # the GPU worker's DEALER
    jobs: str  # clients


@dataclass(frozen=True, slots=True)
class RunConfig:
    run_dir: str
    model_dir: str
    block_size: int
    manifest: str  # JSON array of the checkpoint's absolute file paths (what I/O workers may read)
    manifest_files: int
    plan: ExpertResidencyPlan
    slab: SlabSpec
    endpoints: Endpoints
    io_workers: int
    io_mode: str
    kv_reserve_bytes: int
    dense_bytes: int
    pinned: tuple[tuple[int, ...], ...] = ()  # (layer, expert) pairs, len == plan.pinned_slots
    usage_file: str | None = None
    test_hooks: tuple[str, ...] = ()
    log_level: str = "INFO"
    start_timeout_s: float = 120.0  # how long the coordinator waits for its I/O workers
    version: int = CONFIG_VERSION
    # The coordinator's policy knobs (coordinator/jobs.py, coordinator/safepoint.py).
    queue_limit: int = 16  # generate jobs waiting behind the running one; one more is answered `busy`
    # The footprint is sampled at most this often (at safe points). Reading a process's PSS
    # (/proc/PID/smaps_rollup) walks its page tables under its memory-map lock: ~10 ms for a GPU
    # worker of 400 MB here, time taken from a core decode computes on.
    footprint_interval_ms: float = 500.0
    pressure_tolerance_bytes: int = 8 * 2**20  # measurement noise allowed above the budget before correcting
    usage_flush_s: float = 30.0  # the usage ledger is flushed this often while dirty (and after each job)
    test_footprint_offset_bytes: int = 0  # TEST KNOB: added to every measured footprint; 0 in real runs
    # How long the coordinator's I/O backend keeps the loads of a lost I/O worker when no live one is
    # left, waiting for the one the supervisor restarts (0: fail them at once).
    io_replacement_grace_s: float = 60.0
    # The GPU worker's --compute-lanes (MLX streams for a decode wave's parts); None: its auto choice.
    compute_lanes: int | None = None
    test_io_read_delay_ms: float | None = None  # TEST KNOB: every I/O worker holds each load this long
    # A worker that owes work and shows no progress for this long (plus what the work owed needs:
    # coordinator/liveness.py) is hung: killed and handled as a dead one.
    hang_timeout_s: float = 10.0
    # The supervisor's pid when `moeslab-launch` started the system: its memory counts in the budget
    # (coordinator/footprint.py). 0 when a program embeds the system (tests, benchmarks).
    supervisor_pid: int = 0
    prefetch: str = "auto"  # next-layer prefetch: auto | on | off
    lease_path: str = "shared"  # LEASE_PATHS
    # A decode wave of fewer bytes is copied and computed whole, not in parts over the compute
    # lanes: each part's evaluation costs ~0.1 ms of dispatch here, more than a small copy hides.
    decode_parts_min_bytes: int = 4 * 1024 * 1024
    # Copy path: a decode step copies the next sparse layer's predicted experts while this layer
    # computes (gpuworker/copy_ahead.py), so that only mispredicted ones are copied on its critical path.
    copy_ahead: str = "on"  # COPY_AHEAD_MODES
    io_staging: str = "auto"  # the I/O workers' huge-page staging of direct reads (native/staging.py): auto | on | off
    # The coordinator's and the I/O workers' CPU or class (shared/scheduling.py): auto | last-cpu | batch | normal.
    helper_scheduling: str = "auto"
    prefetch_margin: int | None = None  # experts predicted beyond top-k (None: a quarter of top-k)
    # Sparse layers ahead a decode step's prefetch predicts (gpuworker.prediction): 1 where a layer
    # computes for longer than a prefetch takes to land; more where layers compute faster than that.
    prefetch_distance: int = 1
    replacement: str = DEFAULT_REPLACEMENT  # the residency manager's replacement policy (parse_replacement)
    # The job front door's limits (coordinator/job_limits.py); None: the model's context, or for
    # the per-client share half the queue.
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None
    max_queued_per_client: int | None = None
    # Jobs decoded together (one batched forward pass per step, gpuworker/batch_serve.py); 1: one at a time.
    max_sequences: int = 4
    # The directory of the jobs ROUTER's CURVE key pair (shared.curve; RUN_DIR/curve); None: no CURVE.
    curve_keys: str | None = None


def run_endpoints(run_dir: str | os.PathLike[str]) -> Endpoints:
    """The ipc endpoints of a run directory; refuses one too long for a socket path."""
    root = os.path.abspath(os.fspath(run_dir))
    longest = os.path.join(root, "jobs")
    if len(longest.encode()) > MAX_IPC_PATH:
        raise ConfigError(
            f"run directory {root!r} is too long for ipc socket paths ({len(longest.encode())} > {MAX_IPC_PATH} bytes)"
        )
    return Endpoints(io=f"ipc://{root}/io", gpu=f"ipc://{root}/gpu", jobs=f"ipc://{root}/jobs")


def endpoint_exposed(endpoint: str) -> bool:
    """True for a tcp endpoint other machines may reach: any host but loopback (127.0.0.0/8,
    [::1], localhost), so a wildcard (`*`, 0.0.0.0), an interface name or a host name too."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rpartition(":")[0]
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return True


def check_jobs_endpoint(endpoint: str, *, curve: bool = False) -> str:
    """An `ipc://ABSOLUTE_PATH` or `tcp://HOST:PORT` endpoint; ValueError otherwise. A tcp host other
    machines can reach (`endpoint_exposed`) needs `curve` (the front door a CURVE server)."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        if not os.path.isabs(path) or len(path.encode()) > MAX_IPC_PATH:
            raise ValueError(f"ipc endpoint {endpoint!r} needs an absolute path of at most {MAX_IPC_PATH} bytes")
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        if not host or (":" in host and not (host.startswith("[") and host.endswith("]"))):
            raise ValueError(f"endpoint {endpoint!r} needs tcp://HOST:PORT (an IPv6 address in brackets)")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"endpoint {endpoint!r} needs a port between 1 and 65535")
        if endpoint_exposed(endpoint) and not curve:
            # Plain jobs carry no authentication: without CURVE only this machine may reach the front door.
            raise ValueError(
                f"endpoint {endpoint!r} refused: other machines can reach it, and without CURVE only loopback "
                "tcp (tcp://127.0.0.1:PORT) is allowed; pass --curve (or --curve-keys DIR) to require "
                "the server's CURVE key"
            )
        return endpoint
    raise ValueError(f"endpoint {endpoint!r} must be ipc://PATH or tcp://HOST:PORT")


def config_to_dict(config: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def write_config(config: RunConfig, path: str | os.PathLike[str]) -> None:
    """Write atomically (temp file + rename), mode 0600."""
    target = Path(path)
    temp = target.with_name(f".{target.name}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(config_to_dict(config), handle, indent=2, sort_keys=True)
        handle.write("\n")
    os.replace(temp, target)


def _value(kind: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(kind):
            return None
        (inner,) = [arg for arg in typing.get_args(kind) if arg is not type(None)]
        return _value(inner, value, where)
    if origin is tuple:
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be an array, got {value!r}")
        item = typing.get_args(kind)[0]
        return tuple(_value(item, entry, f"{where}[{index}]") for index, entry in enumerate(value))
    if dataclasses.is_dataclass(kind):
        return _build(kind, value, where)
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{where} must be a non-negative integer, got {value!r}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"{where} must be a non-negative number, got {value!r}")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    raise TypeError(f"{where}: unsupported config type {kind!r}")


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {unknown}")
    values = {}
    for name, spec in fields.items():
        if name not in data:
            if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{where}: missing field {name!r}")
            continue
        values[name] = _value(hints[name], data[name], f"{where}.{name}")
    return cls(**values)


def check_config(config: RunConfig) -> RunConfig:
    """Cross-field checks; returns `config` or raises ConfigError naming the mismatch."""
    if config.version != CONFIG_VERSION:
        raise ConfigError(f"config version {config.version} is not {CONFIG_VERSION}")
    plan, slab = config.plan, config.slab
    if slab.total_slots != plan.total_slots or slab.slot_bytes != plan.slot_bytes:
        raise ConfigError(
            f"slab {slab.total_slots} x {slab.slot_bytes} bytes does not match the plan's "
            f"{plan.total_slots} x {plan.slot_bytes}"
        )
    if config.io_mode not in IO_MODES:
        raise ConfigError(f"io_mode must be one of {IO_MODES}, got {config.io_mode!r}")
    if config.io_workers < 1:
        raise ConfigError(f"io_workers must be >= 1, got {config.io_workers}")
    for name in POSITIVE_FLOATS:
        if not getattr(config, name) > 0:
            raise ConfigError(f"{name} must be a positive number, got {getattr(config, name)!r}")
    if not 1 <= config.max_sequences <= MAX_SEQUENCES:
        raise ConfigError(f"max_sequences must be in 1..{MAX_SEQUENCES}, got {config.max_sequences}")
    if config.queue_limit < 1:
        raise ConfigError(f"queue_limit must be >= 1, got {config.queue_limit}")
    for name in ("max_prompt_tokens", "max_tokens", "max_queued_per_client"):
        if getattr(config, name) is not None and getattr(config, name) < 1:
            raise ConfigError(f"{name} must be >= 1, got {getattr(config, name)}")
    if config.helper_scheduling not in HELPER_SCHEDULING:
        raise ConfigError(f"helper_scheduling must be one of {HELPER_SCHEDULING}, got {config.helper_scheduling!r}")
    if config.io_staging not in STAGING_MODES:
        raise ConfigError(f"io_staging must be one of {STAGING_MODES}, got {config.io_staging!r}")
    if config.prefetch_margin is not None and not 0 <= config.prefetch_margin <= 64:
        raise ConfigError(f"prefetch_margin must be in [0, 64], got {config.prefetch_margin}")
    try:
        check_prefetch_distance(config.prefetch_distance)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if config.copy_ahead not in COPY_AHEAD_MODES:
        raise ConfigError(f"copy_ahead must be one of {COPY_AHEAD_MODES}, got {config.copy_ahead!r}")
    if config.lease_path not in LEASE_PATHS:
        raise ConfigError(f"lease_path must be one of {LEASE_PATHS}, got {config.lease_path!r}")
    if config.prefetch not in PREFETCH_MODES:
        raise ConfigError(f"prefetch must be one of {PREFETCH_MODES}, got {config.prefetch!r}")
    if config.compute_lanes is not None:
        try:
            check_compute_lanes(config.compute_lanes)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    try:
        parse_replacement(config.replacement)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    unknown = [hook for hook in config.test_hooks if hook not in TEST_HOOKS]
    if unknown:
        raise ConfigError(f"unknown test hook(s) {unknown}; known: {list(TEST_HOOKS)}")
    if len(config.pinned) != plan.pinned_slots or any(len(pair) != 2 for pair in config.pinned):
        raise ConfigError(f"pinned must hold {plan.pinned_slots} (layer, expert) pairs, got {list(config.pinned)}")
    for name in ("io", "gpu", "jobs"):
        if not getattr(config.endpoints, name):
            raise ConfigError(f"endpoints.{name} is empty")
    if config.curve_keys is not None and not os.path.isabs(config.curve_keys):
        raise ConfigError(f"curve_keys must be an absolute path, got {config.curve_keys!r}")
    if config.curve_keys is None and endpoint_exposed(config.endpoints.jobs):
        raise ConfigError(
            f"endpoints.jobs {config.endpoints.jobs!r} is reachable from other machines and needs curve_keys"
        )
    return config


def config_from_dict(data: Any) -> RunConfig:
    return check_config(_build(RunConfig, data, "config"))


def read_config(path: str | os.PathLike[str]) -> RunConfig:
    """Load and check a config.json; ConfigError names the file and the bad field."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ConfigError(f"cannot read run configuration {os.fspath(path)}: {error}") from None
    try:
        return config_from_dict(data)
    except ConfigError as error:
        raise ConfigError(f"{os.fspath(path)}: {error}") from None


__all__ = [
    "CONFIG_FILE",
    "CONFIG_VERSION",
    "COPY_AHEAD_MODES",
    "DEFAULT_REPLACEMENT",
    "IO_MODES",
    "LEASE_PATHS",
    "MANIFEST_FILE",
    "PREFETCH_MODES",
    "REPLACEMENT_KNOBS",
    "REPLACEMENT_POLICIES",
    "TEST_HOOKS",
    "ConfigError",
    "Endpoints",
    "RunConfig",
    "SlabSpec",
    "check_config",
    "check_jobs_endpoint",
    "config_from_dict",
    "config_to_dict",
    "endpoint_exposed",
    "parse_replacement",
    "read_config",
    "run_endpoints",
    "write_config",
]
