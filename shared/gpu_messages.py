"""Messages between the coordinator (ROUTER) and the GPU worker (DEALER).

Startup: worker `gpu_hello` → coordinator `gpu_welcome` (the plan, the slab)
→ worker loads its dense weights → `gpu_ready` (or `error` if that failed).

Lease protocol, per sparse layer of a forward pass:

    worker `routes` (every row × top-k selection, before dedup; optionally the
           fence of the previous layer's last wave, which saves a round trip,
           and the experts predicted for the next sparse layer: a prefetch
           the coordinator starts once this layer's lease is answered)
    coord  `lease`  (wave 0 of this layer visit: expert → slot, generation)
    worker `prefetch` (at most once per decode step, before the first layer's
           `routes`: the experts the first sparse layer is predicted to pick)
    worker computes, `mx.eval`s the outputs, drops every array reading the
           slots, and only then: `fence` (lease id, next=True when it wants
           the visit's next wave)
    coord  `lease`  (the next wave) or `fenced` (no wave follows)

Generation: coord `job` → worker `token`… then `job_done` or `job_error`;
coord `job_cancel` may arrive at any time (the worker checks between tokens).
Everything the worker cannot serve gets `error`; a `routes`/`fence` the
coordinator refuses gets `error` too, and the worker fails the job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from shared.job_messages import MAX_CHAT_MESSAGES, ChatMessage
from shared.protocol import BAD_FIELD, ErrorReply, ProtocolError, make_registry, register_codec, shown, wire

MAX_ROUTE_ROWS = 1 << 16  # a prefill chunk's rows
MAX_TOP_K = 64
MAX_WAVE_EXPERTS = 4096
MAX_PREFETCH = 256  # predicted experts per routes message
MAX_VISITS = 4096  # layer visits per `visited` message (a forward step's sparse layers)


@dataclass(frozen=True, slots=True, eq=False)
class RouteMatrix:
    """Router selections, rows × top-k int32; travels as [rows, top_k, raw bytes]."""

    array: np.ndarray

    def __post_init__(self) -> None:
        array = np.ascontiguousarray(self.array, dtype="<i4")
        if array.ndim != 2:
            raise ValueError(f"routes must be rows x top-k, got shape {array.shape}")
        object.__setattr__(self, "array", array)


def _encode_routes(routes: RouteMatrix) -> list[Any]:
    rows, top_k = routes.array.shape
    return [rows, top_k, routes.array.tobytes()]


def _decode_routes(value: Any, where: str) -> RouteMatrix:
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise ProtocolError(BAD_FIELD, f"{where} must be [rows, top_k, bytes], got {type(value).__name__}")
    rows, top_k, raw = value
    for name, number, limit in (("rows", rows, MAX_ROUTE_ROWS), ("top_k", top_k, MAX_TOP_K)):
        if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= limit:
            raise ProtocolError(BAD_FIELD, f"{where} {name} must be an integer in 1..{limit}, got {shown(number)}")
    if not isinstance(raw, bytes) or len(raw) != rows * top_k * 4:
        size = len(raw) if isinstance(raw, bytes) else type(raw).__name__
        raise ProtocolError(BAD_FIELD, f"{where} must carry {rows * top_k * 4} bytes of int32, got {size}")
    array = np.frombuffer(raw, dtype="<i4").reshape(rows, top_k)
    if array.size and int(array.min()) < 0:
        raise ProtocolError(BAD_FIELD, f"{where} holds a negative expert id {int(array.min())}")
    return RouteMatrix(array)


register_codec(RouteMatrix, _encode_routes, _decode_routes)


# ------------------------------------------------------------- startup


@dataclass(frozen=True, slots=True)
class GpuHello:
    OP: ClassVar[str] = "gpu_hello"
    pid: int


@dataclass(frozen=True, slots=True)
class GpuGoodbye:
    """The worker exits on purpose (a signal, a stop): its exit that follows is not a loss."""

    OP: ClassVar[str] = "gpu_goodbye"
    pid: int
    reason: str


@dataclass(frozen=True, slots=True)
class GpuWelcome:
    """What the worker needs to read slots: the slab and its geometry."""

    OP: ClassVar[str] = "gpu_welcome"
    slab_name: str
    total_slots: int
    slot_bytes: int
    working_slots: int
    block_size: int  # the store's alignment; layouts depend on it
    prefetch: int = 0  # experts to predict per decode step for the next sparse layer (0: no prediction)
    # The lease words after the slots (shared.lease_words): lease resident experts through them;
    # 0 layers: every visit takes the message path.
    lease_layers: int = 0
    lease_experts: int = 0
    parts_min_bytes: int = 0  # a smaller decode wave is copied and computed whole (0: always in parts)
    copy_ahead: int = 0  # experts of the next sparse layer to copy ahead per decode step (0: none)


@dataclass(frozen=True, slots=True)
class GpuReady:
    OP: ClassVar[str] = "gpu_ready"
    pid: int
    dense_bytes: int
    sparse_layers: tuple[int, ...] = wire(max_items=4096)
    wrap_path: str = "copy"  # "zero_copy" where Metal wraps slots without copying
    compiler_bytes: int = 0  # room for the kernel compiler MLX's CPU backend runs as a child process


# ------------------------------------------------------- lease protocol


@dataclass(frozen=True, slots=True)
class Routes:
    """One sparse layer's router output for the rows of this forward pass."""

    OP: ClassVar[str] = "routes"
    layer: int
    routes: RouteMatrix
    fence: int | None = None  # lease id of the previous layer's last wave, now done
    # Experts predicted for sparse layer `prefetch_layer` (the next one), most likely first:
    # the coordinator may load them while this layer computes. No reply is owed for them.
    prefetch_layer: int | None = None
    prefetch: tuple[int, ...] = wire(default=(), max_items=MAX_PREFETCH)


@dataclass(frozen=True, slots=True)
class Lease:
    """One wave: `experts[i]` is readable in `slots[i]` at `generations[i]` until fenced."""

    OP: ClassVar[str] = "lease"
    lease_id: int
    layer: int
    wave: int
    waves: int
    experts: tuple[int, ...] = wire(max_items=MAX_WAVE_EXPERTS)
    slots: tuple[int, ...] = wire(max_items=MAX_WAVE_EXPERTS)
    generations: tuple[int, ...] = wire(max_items=MAX_WAVE_EXPERTS)
    hits: int = 0  # how many of the wave's experts were already resident


@dataclass(frozen=True, slots=True)
class Fence:
    """The worker no longer reads any slot of `lease_id`."""

    OP: ClassVar[str] = "fence"
    lease_id: int
    next: bool = False  # True: lease the same layer visit's next wave


@dataclass(frozen=True, slots=True)
class Prefetch:
    """Experts predicted for a sparse layer before any `routes` could carry them (the first
    sparse layer, predicted from the token's embedding). Never answered, not even when refused
    (the coordinator logs that): the worker waits for no reply to it."""

    OP: ClassVar[str] = "prefetch"
    layer: int
    experts: tuple[int, ...] = wire(max_items=MAX_PREFETCH)


@dataclass(frozen=True, slots=True)
class Visited:
    """Decode layer visits the worker leased itself through the lease words, in order: what a
    `routes` per visit would have told the coordinator (every selection, and predictions), sent
    before any other message and at the end of a forward step, with no reply awaited. `fence`:
    a lease of the message path done before the first of them (answered with `fenced`).
    `end_step`: the forward step is over (nothing is leased)."""

    OP: ClassVar[str] = "visited"
    layers: tuple[int, ...] = wire(max_items=MAX_VISITS)
    routes: RouteMatrix | None = None  # the visits' route rows, in `layers` order
    fence: int | None = None
    end_step: bool = False
    predictions: tuple[Prediction, ...] = wire(default=(), max_items=MAX_VISITS)
    # Route rows per visit (batched decode: one per sequence); empty: one row each.
    visit_rows: tuple[int, ...] = wire(default=(), max_items=MAX_VISITS)


@dataclass(frozen=True, slots=True)
class Prediction:
    """What visit `visit` of a `visited` predicted for sparse layer `layer` (as `routes` carries it)."""

    visit: int
    layer: int
    experts: tuple[int, ...] = wire(max_items=MAX_PREFETCH)


@dataclass(frozen=True, slots=True)
class Fenced:
    OP: ClassVar[str] = "fenced"
    lease_id: int


# ----------------------------------------------------------- generation


@dataclass(frozen=True, slots=True)
class Job:
    """Generate up to `max_tokens` tokens; `prompt_tokens` wins over `messages`, which win over `prompt`."""

    OP: ClassVar[str] = "job"
    job_id: int
    prompt: str | None = wire(default=None, max_len=1 << 20)
    prompt_tokens: tuple[int, ...] | None = wire(default=None, max_items=1 << 20)
    max_tokens: int = wire(default=64, minimum=1, maximum=1 << 20)
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    return_logprobs: bool = False
    predict: bool = True  # decode steps predict the next layer's experts (False while auto paused prefetch)
    # The front door's limits on what only the GPU worker can count (a text prompt's tokens):
    # a prompt over `max_prompt_tokens` is refused, and with `fit_context` so is a prompt whose
    # tokens plus max_tokens exceed the model's context (coordinator/job_limits.py).
    max_prompt_tokens: int | None = None
    fit_context: bool = False
    messages: tuple[ChatMessage, ...] | None = wire(default=None, max_items=MAX_CHAT_MESSAGES)


@dataclass(frozen=True, slots=True)
class JobCancel:
    OP: ClassVar[str] = "job_cancel"
    job_id: int


@dataclass(frozen=True, slots=True)
class Token:
    OP: ClassVar[str] = "token"
    job_id: int
    index: int
    token: int
    text: str = ""
    elapsed_ms: float = 0.0  # since the previous token (or since the job began)
    logprobs: bytes | None = None  # float32 little-endian, vocabulary-sized, when asked for
    prompt_tokens: int = 0  # the job's prompt as the GPU worker tokenized it (a front's usage figures)


@dataclass(frozen=True, slots=True)
class JobDone:
    OP: ClassVar[str] = "job_done"
    job_id: int
    tokens: tuple[int, ...] = wire(max_items=1 << 20)
    text: str = wire(default="", max_len=1 << 24)
    prompt_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    finish_reason: str = "length"  # "length" | "stop" | "cancelled"
    wrap_path: str = "copy"
    bytes_copied: int = 0
    copy_ms: float = 0.0
    lease_wait_ms: float = 0.0  # time spent waiting for lease replies


@dataclass(frozen=True, slots=True)
class JobError:
    OP: ClassVar[str] = "job_error"
    job_id: int
    code: str
    message: str


GPU_WORKER_ACCEPTS = make_registry(GpuWelcome, Lease, Fenced, Job, JobCancel, ErrorReply)
"""Ops the GPU worker accepts from the coordinator."""

COORDINATOR_ACCEPTS_FROM_GPU = make_registry(
    GpuHello, GpuReady, GpuGoodbye, Routes, Fence, Prefetch, Visited, Token, JobDone, JobError, ErrorReply
)
"""Ops the coordinator accepts from the GPU worker."""
