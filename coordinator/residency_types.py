"""Result and error types of the residency manager (frozen, cheap to ship), and its nearest-rank percentile."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

Classification = Literal["demand", "policy"]


@dataclass(frozen=True, slots=True)
class ExpertLatencySummary:
    count: int = 0
    total_ms: float = 0.0
    p50_ms: float = 0.0
    p95_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0


def nearest_rank(ordered: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile of sorted samples (the seed's definition); 0.0 when there are none.

    The one percentile rule of the coordinator: the residency telemetry below and the job statistics.
    """
    if not ordered:
        return 0.0
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def summarize_expert_latencies(samples: Iterable[float]) -> ExpertLatencySummary:
    """Nearest-rank percentiles of millisecond samples."""
    ordered = sorted(float(sample) for sample in samples)
    if not ordered:
        return ExpertLatencySummary()
    return ExpertLatencySummary(
        count=len(ordered),
        total_ms=math.fsum(ordered),
        p50_ms=nearest_rank(ordered, 0.5),
        p95_ms=nearest_rank(ordered, 0.95),
        p99_ms=nearest_rank(ordered, 0.99),
        max_ms=ordered[-1],
    )


class ResidencyError(RuntimeError):
    """A residency operation that cannot proceed in the manager's current state."""


class StaleLeaseError(ResidencyError):
    """A lease entry no longer matches its slot's phase or generation."""


class ResidencyPressureError(ResidencyError):
    """The measured footprint exceeds the budget and nothing more can be evicted."""


@dataclass(frozen=True, slots=True)
class ExpertResidencyLeaseEntry:
    """One expert of a wave, readable in `slot` until the lease is fenced."""

    layer: int
    expert_id: int
    slot: int
    generation: int
    hit: bool


@dataclass(frozen=True, slots=True)
class ExpertResidencySnapshot:
    clock: int
    generation: int
    working: int
    resident: int
    pinned: int
    disabled: int
    loading: int
    leased: int
    physical_footprint: int
    budget_bytes: int
    hits: int
    misses: int
    evictions: int
    pressure_evictions: int
    repin_swaps: int


@dataclass(frozen=True, slots=True)
class ExpertResidencyMapEntry:
    slot: int
    layer: int
    expert_id: int
    tier: Literal["resident", "pinned"]
    last_use: int
    usage: object | None  # ExpertUsageEntry when a ledger is attached


@dataclass(frozen=True, slots=True)
class ExpertRepinEvent:
    layer: int
    evicted_pin: int
    admitted_pin: int
    gain: int


@dataclass(frozen=True, slots=True)
class ExpertDemandTelemetry:
    """I/O of one drain period: demand (model forward) or policy (preload, repin)."""

    hits: int
    misses: int
    loads: int
    read_operations: int
    read_bytes: int
    disk_service: ExpertLatencySummary
    foreground_wait: ExpertLatencySummary


ExpertPolicyTelemetry = ExpertDemandTelemetry


@dataclass(slots=True)
class IOCounters:
    """Telemetry accumulated between two drains of one classification."""

    hits: int = 0
    misses: int = 0
    loads: int = 0
    read_operations: int = 0
    read_bytes: int = 0
    disk_service_ms: list[float] = field(default_factory=list)
    foreground_wait_ms: list[float] = field(default_factory=list)

    def drain(self) -> ExpertDemandTelemetry:
        return ExpertDemandTelemetry(
            hits=self.hits,
            misses=self.misses,
            loads=self.loads,
            read_operations=self.read_operations,
            read_bytes=self.read_bytes,
            disk_service=summarize_expert_latencies(self.disk_service_ms),
            foreground_wait=summarize_expert_latencies(self.foreground_wait_ms),
        )


@dataclass(frozen=True, slots=True)
class ExpertHintTelemetry:
    candidates: int
    resident_skipped: int
    submit_errors: int
    submitted: int
    completed: int
    dropped: int
    operations: int
    bytes: int
    errors: int
    queue_depth: int
    in_flight: int


class _Releases(Protocol):
    """What a lease needs of its manager (coordinator.residency_core.ResidencyCore)."""

    def release_fenced(self, entries: Sequence[ExpertResidencyLeaseEntry]) -> None: ...


class ExpertBatchLease:
    """The slots of one wave; release exactly once, after the fence."""

    def __init__(self, manager: _Releases, entries: Iterable[ExpertResidencyLeaseEntry]) -> None:
        self._manager: _Releases | None = manager
        self.entries: tuple[ExpertResidencyLeaseEntry, ...] = tuple(entries)

    @property
    def released(self) -> bool:
        return self._manager is None

    def release_fenced(self) -> None:
        """Release after every graph reading these slots was evaluated and dropped."""
        manager = self._manager
        if manager is None:
            raise ResidencyError("expert batch lease has already been released")
        try:
            manager.release_fenced(self.entries)
        finally:
            self._manager = None
