"""An in-memory `ExpertResidencyBackend`: no bytes move, every rule is checked.

The replay tool runs the real residency manager over it, and the policy tests
use it as their fake. It enforces the slot state machine the slab relies on
(a leased or loading slot is never written or discarded), so a policy bug
shows up here as an error, not as a silently corrupted answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from coordinator.residency_backend import Consumer, ExpertIOHintSnapshot
from shared.checks import require_int
from shared.segments import ExpertIOHintSegment, ExpertIOSegment

SlotState = Literal["idle", "loading", "ready", "leased"]


class BackendProtocolError(RuntimeError):
    """The manager asked the backend for a transition the slab forbids."""


class LoadCancelledError(RuntimeError):
    """`wait` on a load that was cancelled before it completed."""


@dataclass(slots=True)
class _Slot:
    state: SlotState = "idle"
    generation: int = 0
    segments: tuple[ExpertIOSegment, ...] = ()
    failure: BaseException | None = None
    done: asyncio.Event | None = None


@dataclass(slots=True)
class MemoryBackendCounters:
    submits: int = 0
    cancels: int = 0
    leases: int = 0
    releases: int = 0
    discards: int = 0
    bytes_loaded: int = 0
    history: list[tuple[str, int, int]] = field(default_factory=list)


class InMemoryBackend:
    """Slots that "load" instantly (or when told to), with injectable failures.

    `fail_load(slot_or_predicate)` makes the next matching load raise from
    `wait`; `manual=True` holds loads until `complete(slot, generation)` so
    tests can interleave cancel and completion. The footprint is the occupied
    slots' bytes plus `extra_footprint`, or `footprint` when that is set.
    """

    def __init__(
        self,
        slots: int,
        *,
        slot_bytes: int = 1,
        manual: bool = False,
        hint_capacity: int | None = None,
        record_history: bool = False,
    ) -> None:
        self._slots = [_Slot() for _ in range(require_int(slots, "slots", minimum=1))]
        self.slot_bytes = require_int(slot_bytes, "slot_bytes", minimum=1)
        self.manual = manual
        self.footprint: int | None = None  # a fixed measurement, when set
        self.extra_footprint = 0  # bytes beyond the occupied slots (dense weights, say)
        self.counters = MemoryBackendCounters()
        self._record_history = record_history
        self._failures: list[Callable[[int, Sequence[ExpertIOSegment]], bool]] = []
        self._fail_cancel: set[int] = set()
        self._fail_release: set[int] = set()
        self._fail_discard: set[int] = set()
        self._hint_capacity = hint_capacity
        self._hints = ExpertIOHintSnapshot()

    # -- the protocol ------------------------------------------------------

    @property
    def slots(self) -> int:
        return len(self._slots)

    def submit_segments(self, slot: int, generation: int, segments: Sequence[ExpertIOSegment]) -> None:
        record = self._get(slot)
        if record.state in ("loading", "leased"):
            raise BackendProtocolError(f"submit into slot {slot} while {record.state}")
        if generation <= record.generation:
            raise BackendProtocolError(f"slot {slot} generation {generation} is not newer than {record.generation}")
        record.state = "loading"
        record.generation = generation
        record.segments = tuple(segments)
        record.failure = None
        record.done = asyncio.Event()
        for predicate in list(self._failures):
            if predicate(slot, record.segments):
                self._failures.remove(predicate)
                record.failure = OSError(f"injected read failure for slot {slot} generation {generation}")
                break
        self.counters.submits += 1
        self._log("submit", slot, generation)
        if not self.manual:
            self.complete(slot, generation)

    async def wait(self, slot: int, generation: int) -> None:
        record = self._current(slot, generation)
        if record.done is None:
            raise BackendProtocolError(f"slot {slot} generation {generation} was never submitted")
        await record.done.wait()
        if record.failure is not None:
            raise record.failure

    def cancel(self, slot: int, generation: int) -> None:
        record = self._current(slot, generation)
        self.counters.cancels += 1
        self._log("cancel", slot, generation)
        if slot in self._fail_cancel:
            self._fail_cancel.discard(slot)
            raise BackendProtocolError(f"injected cancel failure for slot {slot}")
        if record.state == "loading":
            record.failure = record.failure or LoadCancelledError(f"slot {slot} load cancelled")
            self.complete(slot, generation)

    def lease(self, slot: int, generation: int, consumer: Consumer = "gpu") -> None:
        record = self._current(slot, generation)
        if record.state != "ready":
            raise BackendProtocolError(f"lease of slot {slot} while {record.state}")
        record.state = "leased"
        self.counters.leases += 1
        self._log("lease", slot, generation)

    def release_gpu_fenced(self, slot: int, generation: int) -> None:
        record = self._current(slot, generation)
        if slot in self._fail_release:
            self._fail_release.discard(slot)
            raise BackendProtocolError(f"injected release failure for slot {slot}")
        if record.state != "leased":
            raise BackendProtocolError(f"fenced release of slot {slot} while {record.state}")
        record.state = "ready"
        self.counters.releases += 1
        self._log("release", slot, generation)

    def discard(self, slot: int, generation: int) -> None:
        record = self._current(slot, generation)
        if slot in self._fail_discard:
            self._fail_discard.discard(slot)
            raise BackendProtocolError(f"injected discard failure for slot {slot}")
        if record.state in ("loading", "leased"):
            raise BackendProtocolError(f"discard of slot {slot} while {record.state}")
        record.state = "idle"
        record.segments = ()
        self.counters.discards += 1
        self._log("discard", slot, generation)

    def physical_footprint(self) -> int:
        if self.footprint is not None:
            return self.footprint
        occupied = sum(1 for record in self._slots if record.state != "idle")
        return self.extra_footprint + self.slot_bytes * occupied

    def hint_segments(self, segments: Sequence[ExpertIOHintSegment]) -> bool:
        h = self._hints
        if self._hint_capacity is not None and h.queue_depth >= self._hint_capacity:
            self._hints = replace(h, dropped=h.dropped + 1)
            return False
        nbytes = sum(segment.length for segment in segments)
        # Hints complete at once here: there is no page cache to warm.
        self._hints = replace(
            h,
            submitted=h.submitted + 1,
            completed=h.completed + 1,
            operations=h.operations + len(segments),
            bytes=h.bytes + nbytes,
        )
        return True

    def hint_telemetry(self) -> ExpertIOHintSnapshot:
        return self._hints

    # -- test controls -----------------------------------------------------

    def complete(self, slot: int, generation: int) -> None:
        """Finish a load (manual mode); the slot becomes ready."""
        record = self._current(slot, generation)
        if record.state != "loading" or record.done is None:
            raise BackendProtocolError(f"complete of slot {slot} while {record.state}")
        record.state = "ready"
        if record.failure is None:
            self.counters.bytes_loaded += sum(s.length for s in record.segments)
        record.done.set()

    def fail_load(self, predicate: Callable[[int, Sequence[ExpertIOSegment]], bool]) -> None:
        """The next load for which predicate(slot, segments) holds fails in `wait`."""
        self._failures.append(predicate)

    def fail_next(self, action: Literal["cancel", "release", "discard"], slot: int) -> None:
        {"cancel": self._fail_cancel, "release": self._fail_release, "discard": self._fail_discard}[action].add(slot)

    def state(self, slot: int) -> tuple[SlotState, int]:
        record = self._get(slot)
        return record.state, record.generation

    def pending(self) -> list[tuple[int, int]]:
        return [(i, r.generation) for i, r in enumerate(self._slots) if r.state == "loading"]

    # -- internals ---------------------------------------------------------

    def _get(self, slot: int) -> _Slot:
        index = require_int(slot, "slot")
        if index >= len(self._slots):
            raise BackendProtocolError(f"slot {slot} out of range 0..{len(self._slots) - 1}")
        return self._slots[index]

    def _current(self, slot: int, generation: int) -> _Slot:
        record = self._get(slot)
        if record.generation != generation:
            raise BackendProtocolError(f"stale generation {generation} for slot {slot} (current {record.generation})")
        return record

    def _log(self, action: str, slot: int, generation: int) -> None:
        if self._record_history:
            self.counters.history.append((action, slot, generation))
