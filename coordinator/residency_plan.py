"""Residency planning: the slab layout, batch unions, hint segments, latencies.

Pure functions and value types shared by the residency manager, the I/O
backend and the replay tool. `coordinator.residency` re-exports all of it.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import numpy as np

DEFAULT_EXPERT_WORKING_SLOTS = 64

Consumer = Literal["cpu", "gpu"]


def require_int(value: object, name: str, *, minimum: int = 0) -> int:
    """Return `value` as an int, or raise naming the offending value.

    bool is refused (it is an int subclass, never a count); numpy integers are
    accepted because routes arrive as numpy arrays.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    number = operator.index(value)
    if number < minimum:
        qualifier = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{name} must be {qualifier}, got {number}")
    return number


@dataclass(frozen=True, slots=True)
class ExpertIOSegment:
    """One byte range of a manifest file that lands at `destination` in a slot."""

    file: int
    offset: int
    length: int
    destination: int


@dataclass(frozen=True, slots=True)
class ExpertIOHintSegment:
    """An advisory readahead range: warm the page cache, move nothing."""

    file: int
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class ExpertIOHintSnapshot:
    """Cumulative counters of a backend's advisory hint queue."""

    submitted: int = 0
    completed: int = 0
    dropped: int = 0
    operations: int = 0
    bytes: int = 0
    errors: int = 0
    queue_depth: int = 0
    in_flight: int = 0


EMPTY_HINT_SNAPSHOT = ExpertIOHintSnapshot()


@dataclass(frozen=True, slots=True)
class ExpertResidencyLocation:
    """Where one expert's bytes live; `hint_segments` may be a subset for readahead."""

    layer: int
    expert_id: int
    segments: tuple[ExpertIOSegment, ...]
    hint_segments: tuple[ExpertIOHintSegment, ...] | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers but keep the value immutable.
        object.__setattr__(self, "segments", tuple(self.segments))
        if self.hint_segments is not None:
            object.__setattr__(self, "hint_segments", tuple(self.hint_segments))


@runtime_checkable
class ExpertResidencyBackend(Protocol):
    """What the residency manager needs from the slot store.

    `wait` is the only asynchronous call: it resolves when the load of
    (slot, generation) has finished and raises if the read failed. Optional:
    `hint_segments(segments) -> bool` (False when the bounded queue is full)
    and `hint_telemetry() -> ExpertIOHintSnapshot`.
    """

    @property
    def slots(self) -> int: ...

    def submit_segments(self, slot: int, generation: int, segments: Sequence[ExpertIOSegment]) -> None: ...

    async def wait(self, slot: int, generation: int) -> None: ...

    def cancel(self, slot: int, generation: int) -> None: ...

    def lease(self, slot: int, generation: int, consumer: Consumer = "gpu") -> None: ...

    def release_gpu_fenced(self, slot: int, generation: int) -> None: ...

    def discard(self, slot: int, generation: int) -> None: ...

    def physical_footprint(self) -> int: ...


@dataclass(frozen=True, slots=True)
class ExpertResidencyPlan:
    """The only admissible fixed-capacity slab layout for a budget."""

    budget_bytes: int
    fixed_bytes: int
    slot_bytes: int
    sparse_layers: int
    working_slots: int
    pinned_slots: int
    slots_per_layer: int
    resident_slots: int
    total_slots: int
    slab_bytes: int
    planned_bytes: int


def plan_expert_residency(
    *,
    budget_bytes: int,
    fixed_bytes: int,
    slot_bytes: int,
    sparse_layers: int,
    working_slots: int | None = None,
    pinned_experts: int | None = None,
    max_slots_per_layer: int | None = None,
) -> ExpertResidencyPlan:
    """Split a memory budget into working, pinned and per-layer resident slots.

    One persistent slot per sparse layer plus the whole working bank is the
    startup floor; a budget below it is refused with every part named.
    """
    budget = require_int(budget_bytes, "budget_bytes", minimum=1)
    fixed = require_int(fixed_bytes, "fixed_bytes", minimum=0)
    slot = require_int(slot_bytes, "slot_bytes", minimum=1)
    layers = require_int(sparse_layers, "sparse_layers", minimum=1)
    working = require_int(
        DEFAULT_EXPERT_WORKING_SLOTS if working_slots is None else working_slots,
        "working_slots",
        minimum=1,
    )
    pinned = require_int(0 if pinned_experts is None else pinned_experts, "pinned_experts")
    cap = None if max_slots_per_layer is None else require_int(max_slots_per_layer, "max_slots_per_layer", minimum=1)

    mandatory_bytes = (working + pinned + layers) * slot
    if fixed + mandatory_bytes > budget:
        raise ValueError(
            f"expert residency budget cannot start: {budget} bytes does not fit "
            f"{fixed} fixed + {working} working + {pinned} pinned + one slot for "
            f"each of {layers} sparse layers, at {slot} bytes per slot "
            f"(needs {fixed + mandatory_bytes} bytes)"
        )
    variable_bytes = budget - fixed - (working + pinned) * slot
    slots_per_layer = variable_bytes // (layers * slot)
    if cap is not None:
        slots_per_layer = min(slots_per_layer, cap)
    resident = slots_per_layer * layers
    total = working + pinned + resident
    slab = total * slot
    return ExpertResidencyPlan(
        budget_bytes=budget,
        fixed_bytes=fixed,
        slot_bytes=slot,
        sparse_layers=layers,
        working_slots=working,
        pinned_slots=pinned,
        slots_per_layer=slots_per_layer,
        resident_slots=resident,
        total_slots=total,
        slab_bytes=slab,
        planned_bytes=fixed + slab,
    )


@dataclass(frozen=True, slots=True)
class ExpertUnionEntry:
    """One unique expert of a wave and every (row, rank) that selected it."""

    expert_id: int
    consumers: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class ExpertUnionWave:
    """At most `max_unique_per_wave` unique experts, leased together."""

    entries: tuple[ExpertUnionEntry, ...]

    @property
    def expert_ids(self) -> tuple[int, ...]:
        return tuple(entry.expert_id for entry in self.entries)


def _route_rows(routes: Sequence[Sequence[int]] | np.ndarray) -> Iterable[Sequence[int]]:
    if isinstance(routes, np.ndarray):
        if routes.ndim != 2:
            raise ValueError(f"routes array must be 2-D (rows x top-k), got shape {routes.shape}")
        if not np.issubdtype(routes.dtype, np.integer):
            raise TypeError(f"routes array must hold integers, got dtype {routes.dtype}")
        return routes.tolist()
    if isinstance(routes, (str, bytes)) or not isinstance(routes, Sequence):
        raise TypeError(f"routes must be a sequence of rows or a 2-D array, got {type(routes).__name__}")
    return routes


def build_expert_batch_union(
    routes: Sequence[Sequence[int]] | np.ndarray,
    max_unique_per_wave: int = DEFAULT_EXPERT_WORKING_SLOTS,
) -> list[ExpertUnionWave]:
    """Deduplicate router output into waves, stable row-major then rank-major.

    A repeated expert keeps its first position and collects every consumer;
    no wave holds more unique experts than the working bank.
    """
    limit = require_int(max_unique_per_wave, "max_unique_per_wave", minimum=1)
    consumers: dict[int, list[tuple[int, int]]] = {}
    for row, route in enumerate(_route_rows(routes)):
        if isinstance(route, (str, bytes)) or not isinstance(route, (Sequence, np.ndarray)):
            raise TypeError(f"route {row} must be a sequence of expert ids, got {route!r}")
        for rank, expert in enumerate(route):
            try:
                expert_id = require_int(expert, f"route {row} rank {rank} expert")
            except (TypeError, ValueError) as error:
                raise type(error)(f"route {row} rank {rank} has invalid expert {expert!r}") from None
            consumers.setdefault(expert_id, []).append((row, rank))
    entries = [ExpertUnionEntry(expert, tuple(users)) for expert, users in consumers.items()]
    return [ExpertUnionWave(tuple(entries[begin : begin + limit])) for begin in range(0, len(entries), limit)]


def build_expert_hint_segments(
    segments: Sequence[ExpertIOSegment], scale_offset: int, no_cache: bool
) -> list[ExpertIOHintSegment]:
    """Readahead ranges for an expert.

    Buffered demand may warm the whole expert; cache-bypassing demand warms
    only the tail from `scale_offset` on (the scales), because warming weight
    pages would be wasted by the O_DIRECT read that follows.
    """
    scale = require_int(scale_offset, "scale_offset")
    if not no_cache:
        return [ExpertIOHintSegment(s.file, s.offset, s.length) for s in segments]
    hints = []
    for segment in segments:
        skip = max(0, scale - segment.destination)
        if skip < segment.length:
            hints.append(ExpertIOHintSegment(segment.file, segment.offset + skip, segment.length - skip))
    return hints


@dataclass(frozen=True, slots=True)
class ExpertLatencySummary:
    count: int = 0
    total_ms: float = 0.0
    p50_ms: float = 0.0
    p95_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0


def summarize_expert_latencies(samples: Iterable[float]) -> ExpertLatencySummary:
    """Nearest-rank percentiles (the seed's definition) of millisecond samples."""
    ordered = sorted(float(sample) for sample in samples)
    if not ordered:
        return ExpertLatencySummary()

    def percentile(fraction: float) -> float:
        return ordered[math.ceil(fraction * len(ordered)) - 1]

    return ExpertLatencySummary(
        count=len(ordered),
        total_ms=math.fsum(ordered),
        p50_ms=percentile(0.5),
        p95_ms=percentile(0.95),
        p99_ms=percentile(0.99),
        max_ms=ordered[-1],
    )
