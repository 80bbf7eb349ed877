"""Messages between the coordinator (ROUTER) and the I/O workers (DEALER).

Startup: worker `hello` -> coordinator `welcome` -> worker `ready` (or worker
`error` when its setup failed). Then the coordinator sends `load`, `cancel`,
`hint`, `telemetry`, `shutdown`; the worker answers each `load` with exactly
one `loaded`, a `telemetry` request with `telemetry`, reports hint progress
with `hint_status`, and answers a frame it cannot serve with `error`.

A message is one or more frames, each one command or reply: the coordinator
sends a prefetch wave's loads to a worker as one message, and a worker sends
the replies it has ready at once as one, so a wave costs one wake-up of each
side's socket thread, not one per load. Every frame is decoded and answered on
its own (a bad one gets its `error`, the others are served).

Segments travel as compact arrays: [file, offset, length, destination] and
[file, offset, length]. Their values are checked by the worker against its
manifest and slot (so it can answer `loaded` with the offending value), not
here: the codec only insists on integers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from shared.protocol import (
    BAD_FIELD,
    ErrorReply,
    ProtocolError,
    make_registry,
    register_codec,
    shown,
    wire,
)
from shared.segments import ExpertIOHintSegment, ExpertIOSegment

MAX_SEGMENTS = 4096  # per load or hint message
MAX_FRAMES = 256  # commands or replies per message


def _ints(value: Any, where: str, count: int, names: str) -> list[int]:
    if (
        not isinstance(value, (list, tuple))
        or len(value) != count
        or any(isinstance(item, bool) or not isinstance(item, int) for item in value)
    ):
        raise ProtocolError(BAD_FIELD, f"{where} must be [{names}] integers, got {shown(value)}")
    return list(value)


register_codec(
    ExpertIOSegment,
    lambda s: [s.file, s.offset, s.length, s.destination],
    lambda value, where: ExpertIOSegment(*_ints(value, where, 4, "file, offset, length, destination")),
)
register_codec(
    ExpertIOHintSegment,
    lambda s: [s.file, s.offset, s.length],
    lambda value, where: ExpertIOHintSegment(*_ints(value, where, 3, "file, offset, length")),
)


# ---------------------------------------------------------------- commands


@dataclass(frozen=True, slots=True)
class Welcome:
    """The coordinator accepts a worker's hello."""

    OP: ClassVar[str] = "welcome"
    index: int


@dataclass(frozen=True, slots=True)
class Load:
    """Read every segment into `slot`; destinations are offsets inside the slot."""

    OP: ClassVar[str] = "load"
    slot: int
    generation: int
    segments: tuple[ExpertIOSegment, ...] = wire(max_items=MAX_SEGMENTS)


@dataclass(frozen=True, slots=True)
class Cancel:
    """Drop a load that has not started; one in flight still completes."""

    OP: ClassVar[str] = "cancel"
    slot: int
    generation: int


@dataclass(frozen=True, slots=True)
class Hint:
    """Advisory readahead of one expert's ranges; may be dropped when the queue is full."""

    OP: ClassVar[str] = "hint"
    segments: tuple[ExpertIOHintSegment, ...] = wire(max_items=MAX_SEGMENTS)


@dataclass(frozen=True, slots=True)
class TelemetryRequest:
    OP: ClassVar[str] = "telemetry"


@dataclass(frozen=True, slots=True)
class Shutdown:
    OP: ClassVar[str] = "shutdown"


# ------------------------------------------------------------------ replies


@dataclass(frozen=True, slots=True)
class Hello:
    """First message of a worker: it is connected and alive."""

    OP: ClassVar[str] = "hello"
    index: int
    pid: int


@dataclass(frozen=True, slots=True)
class Ready:
    """The worker has opened its manifest, attached the slab and serves loads."""

    OP: ClassVar[str] = "ready"
    index: int
    pid: int
    block_size: int
    modes: tuple[str, ...] = wire(max_items=1 << 16)  # I/O mode actually used, per manifest file


@dataclass(frozen=True, slots=True)
class Loaded:
    """The terminal answer to one load. On failure `error` says why and, for a
    read error, `file`/`offset` name the segment."""

    OP: ClassVar[str] = "loaded"
    slot: int
    generation: int
    ok: bool
    bytes: int = 0
    service_ms: float = 0.0
    queued_ms: float = 0.0
    error: str | None = None
    code: str | None = None
    file: int | None = None
    offset: int | None = None


@dataclass(frozen=True, slots=True)
class HintStatus:
    """Cumulative hint counters of one worker; units follow ExpertIOHintSnapshot:
    submitted/completed/dropped count hint messages, operations/bytes segments."""

    OP: ClassVar[str] = "hint_status"
    submitted: int = 0
    completed: int = 0
    dropped: int = 0
    operations: int = 0
    bytes: int = 0
    errors: int = 0
    queue_depth: int = 0
    in_flight: int = 0


@dataclass(frozen=True, slots=True)
class WorkerTelemetry:
    """Cumulative counters of one worker."""

    OP: ClassVar[str] = "telemetry"
    index: int
    pid: int
    loads: int = 0
    loads_failed: int = 0
    cancelled: int = 0
    cancel_misses: int = 0
    bytes: int = 0  # requested bytes delivered
    read_bytes: int = 0  # bytes transferred, alignment slack included
    read_ops: int = 0
    service_ms: float = 0.0  # summed over loads
    queued: int = 0
    in_flight: int = 0
    bad_commands: int = 0
    files: int = 0
    bypass_files: int = 0
    fallback_files: int = 0  # bypass asked for, refused by the filesystem
    fallback_ops: int = 0  # reads served buffered + DONTNEED because of a fallback
    hints: HintStatus = HintStatus()
    staging: bool = False  # direct reads through huge-page buffers (native/staging.py)
    staging_reason: str = ""
    staging_bytes: int = 0  # memory of the staging buffers
    staging_huge_bytes: int = 0  # of which the kernel put on huge pages
    staged_reads: int = 0
    staged_bytes: int = 0
    staging_copy_ms: float = 0.0
    scheduling: str = ""  # the worker's scheduling class (shared/scheduling.py), or why it kept the default
    aio: bool = False  # direct reads submitted through kernel AIO (native/bypassio.c)
    aio_reason: str = ""  # why not, when not
    aio_ranges: int = 0
    aio_reread: int = 0  # returned short or failed, read again with pread
    aio_refused: int = 0  # not queued by the kernel, read with pread
    aio_busy: int = 0  # loads that found every AIO context in use and ran on the pool's threads


WORKER_COMMANDS = make_registry(Welcome, Load, Cancel, Hint, TelemetryRequest, Shutdown)
"""Ops an I/O worker accepts."""

WORKER_REPLIES = make_registry(Hello, Ready, Loaded, HintStatus, WorkerTelemetry, ErrorReply)
"""Ops the coordinator accepts from an I/O worker."""

__all__ = [
    "MAX_FRAMES",
    "MAX_SEGMENTS",
    "WORKER_COMMANDS",
    "WORKER_REPLIES",
    "Cancel",
    "ErrorReply",
    "Hello",
    "Hint",
    "HintStatus",
    "Load",
    "Loaded",
    "Ready",
    "Shutdown",
    "TelemetryRequest",
    "Welcome",
    "WorkerTelemetry",
]
