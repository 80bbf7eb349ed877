"""Messages between clients (DEALER) and the coordinator's job front door (ROUTER).

    client `generate` → coord `token`… then `done` (with stats) or `error`;
                        or at once `busy` when the queue is full
    client `cancel`   → coord `error` (code "cancelled") for that job, or
                        `error` (code "unknown_job")
    client `stats`    → coord `stats_reply` (cumulative)
    client `health`   → coord `health_reply`

Every reply names the request `id` the client chose. A frame that is not
msgpack is dropped (there is nothing to answer); a map with an unknown op, a
missing or wrongly typed field gets `error` with `id` when one could be read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from shared.protocol import ErrorReply, make_registry, wire

MAX_PROMPT_CHARS = 1 << 20
MAX_PROMPT_TOKENS = 1 << 20
MAX_ID_CHARS = 128

# error codes of `error` replies beyond shared.protocol's generic ones
CANCELLED = "cancelled"
UNKNOWN_JOB = "unknown_job"
PROMPT_TOO_LONG = "prompt_too_long"
MAX_TOKENS_TOO_LARGE = "max_tokens_too_large"  # over --max-tokens or the model's context
CONTEXT_EXCEEDED = "context_exceeded"  # the prompt's tokens plus max_tokens exceed the model's context
CLIENT_QUEUE_FULL = "client_queue_full"  # this client holds its share of the queue (--max-queued-per-client)
WORKER_FAILED = "worker_failed"
WORKER_HUNG = "worker_hung"  # the GPU worker owed the job progress and showed none in time (killed, replaced)
PRESSURE = "memory_pressure"
SHUTTING_DOWN = "shutting_down"
DUPLICATE_ID = "duplicate_id"  # a generate whose id this client already has queued or running
TOO_LARGE = "message_too_large"  # a frame over MAX_REQUEST_BYTES (answered without being parsed)

# The largest legal `generate` is 1 Mi prompt tokens at up to 9 msgpack bytes each; a larger
# frame is refused unread. (The jobs socket's ZMQ_MAXMSGSIZE is higher still: a frame over
# that one drops the sender's connection, and cannot be answered at all.)
MAX_REQUEST_BYTES = 12 * 1024 * 1024


# ------------------------------------------------------------- requests


MAX_CHAT_MESSAGES = 1024


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message of a chat prompt; the GPU worker renders them with the tokenizer's chat template."""

    role: str = wire(max_len=64)
    content: str = wire(default="", max_len=MAX_PROMPT_CHARS)


def chat_messages(messages: Sequence[Mapping[str, str]]) -> tuple[ChatMessage, ...]:
    """{"role", "content"} maps as the wire's `ChatMessage`s; ValueError naming a bad one."""
    out = []
    for index, message in enumerate(messages):
        role, content = message.get("role"), message.get("content", "")
        if not isinstance(role, str) or not isinstance(content, str):
            raise ValueError(f"message {index} needs a string role and content, got {message!r}")
        out.append(ChatMessage(role=role, content=content))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Generate:
    """A generation job; exactly one of `prompt`, `prompt_tokens` and `messages`."""

    OP: ClassVar[str] = "generate"
    id: str = wire(max_len=MAX_ID_CHARS)
    prompt: str | None = wire(default=None, max_len=MAX_PROMPT_CHARS)
    prompt_tokens: tuple[int, ...] | None = wire(default=None, max_items=MAX_PROMPT_TOKENS)
    max_tokens: int = wire(default=64, minimum=1, maximum=1 << 20)
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    return_logprobs: bool = False  # testing aid: each `token` carries the step's log-probabilities
    messages: tuple[ChatMessage, ...] | None = wire(default=None, max_items=MAX_CHAT_MESSAGES)


@dataclass(frozen=True, slots=True)
class CancelJob:
    OP: ClassVar[str] = "cancel"
    id: str = wire(max_len=MAX_ID_CHARS)


@dataclass(frozen=True, slots=True)
class StatsRequest:
    OP: ClassVar[str] = "stats"
    id: str = wire(default="", max_len=MAX_ID_CHARS)


@dataclass(frozen=True, slots=True)
class HealthRequest:
    OP: ClassVar[str] = "health"
    id: str = wire(default="", max_len=MAX_ID_CHARS)


# -------------------------------------------------------------- replies


@dataclass(frozen=True, slots=True)
class JobStats:
    """Per job in `done`; cumulative in `stats_reply`."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    hits: int = 0
    misses: int = 0
    hit_rate: float = 0.0
    all_resident: float = 0.0  # fraction of layer visits whose k experts were all resident
    shared_leases: float = 0.0  # fraction of layer visits leased through the lease words (no round trip)
    bytes_read: int = 0
    disk_p50_ms: float = 0.0
    disk_p99_ms: float = 0.0
    wait_p50_ms: float = 0.0
    wait_p99_ms: float = 0.0
    # The same over decode steps' loads only (one-row visits); the figures above include a
    # prompt's loads, which come at once and queue behind one another.
    decode_disk_p50_ms: float = 0.0
    decode_disk_p99_ms: float = 0.0
    decode_wait_p50_ms: float = 0.0
    decode_wait_p99_ms: float = 0.0
    evictions: int = 0
    pressure_evictions: int = 0
    repin_swaps: int = 0
    hints_submitted: int = 0
    hints_dropped: int = 0
    hints_skipped_resident: int = 0
    wrap_path: str = "copy"
    bytes_copied: int = 0
    footprint_bytes: int = 0  # every process's PSS, the slab once: processes + slab (coordinator/footprint.py)
    peak_footprint_bytes: int = 0  # the largest footprint sampled during the job (at safe points)
    budget_bytes: int = 0
    io_fallback_ops: int = 0  # reads served buffered because O_DIRECT was refused
    baseline_bytes: int = 0  # the processes' memory when the slab was sized (the plan subtracted it)
    processes_bytes: int = 0  # the processes' memory now (their PSS less the slab's share), in footprint_bytes
    slab_bytes: int = 0  # the slab's resident pages now, in footprint_bytes
    # Next-layer prefetch (coordinator/prefetch.py): reads of predicted experts, apart from bytes_read.
    prefetch_predicted: int = 0  # experts the GPU worker predicted
    prefetch_issued: int = 0  # ... not resident, so read
    prefetch_useful: int = 0  # ... then leased by demand before eviction
    prefetch_wasted: int = 0  # ... evicted, cancelled or failed first
    prefetch_bytes: int = 0  # bytes the prefetch reads issued
    prefetch_wasted_bytes: int = 0
    # useful / (useful + decode visits' demand misses): the share of decode misses prefetch avoided or
    # shortened (prefill is never predicted: its misses are not counted)
    prefetch_recall: float = 0.0
    prefetch_precision: float = 0.0  # useful / issued
    prefetch_prediction_recall: float = 0.0  # share of a predicted layer's decode selections the prediction named
    prefetch_waits: int = 0  # demand leases that waited for a prefetch read in flight
    prefetch_wait_ms: float = 0.0
    prefetch_disabled_layers: int = 0  # layers whose prefetch stopped itself (auto)
    prefetch_steps_without: int = 0  # decode steps auto ran without prefetch (its timing trial, or a pause)
    prefetch_paused: bool = False  # auto found decode faster without prefetch (coordinator/prefetch_trial.py)
    prefetch_trialling: bool = False  # auto was still timing decode steps with prefetch and without
    active_sequences: int = 0  # jobs decoding together now (cumulative stats; a job's: the most it shared with)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    OP: ClassVar[str] = "token"
    id: str
    index: int
    token: int
    text: str = ""
    logprobs: bytes | None = None  # float32 little-endian, vocabulary-sized, when asked for
    prompt_tokens: int = 0  # the job's prompt as the GPU worker tokenized it (usage, before `done`)


@dataclass(frozen=True, slots=True)
class Done:
    OP: ClassVar[str] = "done"
    id: str
    tokens: tuple[int, ...] = wire(max_items=1 << 20)
    text: str = wire(default="", max_len=1 << 24)
    finish_reason: str = "length"
    stats: JobStats = field(default_factory=JobStats)


@dataclass(frozen=True, slots=True)
class JobFailed:
    """`error` with the job's id (the generic ErrorReply has none)."""

    OP: ClassVar[str] = "error"
    code: str
    message: str
    id: str = ""  # empty when the request's id could not be read


@dataclass(frozen=True, slots=True)
class Busy:
    OP: ClassVar[str] = "busy"
    id: str
    queued: int


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """One process serving now: its role (`supervisor`, `coordinator`, `gpu_worker`, `io_worker_0`, ...),
    its pid, and how many times the supervisor has restarted that role."""

    name: str = wire(max_len=64)
    pid: int = wire(maximum=(1 << 31) - 1)
    restarts: int = 0
    memory_bytes: int = 0  # its PSS less the slab's share at the coordinator's last sample (0: not measured)


@dataclass(frozen=True, slots=True)
class StatsReply:
    OP: ClassVar[str] = "stats_reply"
    id: str
    jobs_done: int = 0
    jobs_failed: int = 0
    queued: int = 0
    running: str | None = None
    stats: JobStats = field(default_factory=JobStats)
    processes: tuple[ProcessInfo, ...] = ()


@dataclass(frozen=True, slots=True)
class HealthReply:
    OP: ClassVar[str] = "health_reply"
    id: str
    ready: bool
    pid: int = 0
    io_workers: int = 0
    gpu_worker: bool = False
    accepting: bool = True
    processes: tuple[ProcessInfo, ...] = ()  # the supervisor's record of who serves now (shared/process_table.py)
    baseline_bytes: int = 0  # the processes' memory the slab was sized after (0: not sized yet)
    compiler_bytes: int = 0  # the room kept for the GPU worker's kernel compiler when it was sized
    slots_per_layer: int = 0  # resident slots per sparse layer once sized (coordinator/footprint.py)
    liveness: str = ""  # how the coordinator sees a worker exit: "pidfd", or "psutil" (polled; shared/pid_watch.py)


COORDINATOR_ACCEPTS_FROM_CLIENTS = make_registry(Generate, CancelJob, StatsRequest, HealthRequest)
"""Ops the job front door accepts."""

CLIENT_ACCEPTS = make_registry(TokenEvent, Done, JobFailed, Busy, StatsReply, HealthReply)
"""Ops a client accepts (JobFailed decodes every `error`, with or without id)."""

__all__ = [name for name in dir() if not name.startswith("_")] + ["ErrorReply"]
