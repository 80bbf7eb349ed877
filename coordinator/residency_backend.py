"""What the residency manager needs from the slot store, and the hint queue's counters.

Two backends implement it: `coordinator.backend.IOWorkerBackend` (I/O worker
processes filling a shared-memory slab) and `coordinator.memory_backend.
InMemoryBackend` (tests and the replay tool).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from shared.segments import ExpertIOSegment

Consumer = Literal["cpu", "gpu"]


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


@runtime_checkable
class ExpertResidencyBackend(Protocol):
    """What the residency manager needs from the slot store.

    `wait` is the only asynchronous call: it resolves when the load of
    (slot, generation) has finished and raises if the read failed. Optional:
    `hint_segments(segments) -> bool` (False when the bounded queue is full),
    `hint_telemetry() -> ExpertIOHintSnapshot`, and `send_submitted()`: loads
    submitted so far leave now (a backend that batches a turn's submits; the
    demand path calls it before it waits, so its reads do not wait for the turn's end).
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


__all__ = ["EMPTY_HINT_SNAPSHOT", "Consumer", "ExpertIOHintSnapshot", "ExpertResidencyBackend"]
