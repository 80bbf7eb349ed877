"""The backend the residency manager runs on: the real one, with load timing, the footprint and page release.

`MeteredBackend` wraps the slot backend (the I/O workers', possibly inside the
fence checks of coordinator.fence_checks) and adds what the coordinator's
other modules need from the load path without the manager knowing:

- `LoadTimer`: disk service per load and foreground wait per wave, for the job
  statistics (coordinator.stats);
- `physical_footprint()`: the footprint meter's figure (coordinator.footprint),
  what the manager's `correct_for_pressure` compares with the budget;
- page release: while the safe-point policy (coordinator.safepoint) corrects
  pressure, a discarded slot's pages are punched out of the slab, so an
  eviction really frees memory.
"""

from __future__ import annotations

import logging
import mmap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shared.slab import Slab

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadSamples:
    """A job's load timings in milliseconds: every demand load's disk service and every wave's
    foreground wait, and of them the decode steps' (`decode_*`: waves of one-row visits). A
    prompt's misses come at once and queue behind one another, so a job's figures over all its
    loads say what its prefill cost; the decode ones say what a miss costs a token."""

    disk: tuple[float, ...] = ()
    wait: tuple[float, ...] = ()
    decode_disk: tuple[float, ...] = ()
    decode_wait: tuple[float, ...] = ()


class LoadTimer:
    """Disk service per load (submit to completion) and foreground wait per wave.

    The manager submits a wave's misses, then awaits them together; so a wave
    is the loads submitted since the previous wave ended, and its foreground
    wait runs from the first `wait` on one of them to the end of the last.
    Samples accumulate until `take()`; waves are serial, so they never mix.
    `decode` is the phase of the waves submitted from now on, which the lease
    service sets before each wave it acquires.
    """

    def __init__(self) -> None:
        self._submitted: dict[tuple[int, int], tuple[float, bool]] = {}  # the current wave's loads not yet ended
        self._wave_started: float | None = None
        self.decode = False
        self._samples: tuple[list[float], ...] = ([], [], [], [])  # LoadSamples' fields, in order

    def submitted(self, slot: int, generation: int) -> None:
        self._submitted[(slot, generation)] = (time.perf_counter(), self.decode)

    def wait_started(self) -> None:
        if self._wave_started is None and self._submitted:
            self._wave_started = time.perf_counter()

    def wait_ended(self, slot: int, generation: int) -> None:
        now = time.perf_counter()
        started = self._submitted.pop((slot, generation), None)
        if started is None:  # a second waiter, or a load of no wave: nothing to time
            return
        disk, wait, decode_disk, decode_wait = self._samples
        submitted, decode = started
        disk.append((now - submitted) * 1e3)
        if decode:
            decode_disk.append(disk[-1])
        if not self._submitted and self._wave_started is not None:
            wait.append((now - self._wave_started) * 1e3)
            if decode:  # the wave's last load: the wave's phase
                decode_wait.append(wait[-1])
            self._wave_started = None

    def forget(self, slot: int, generation: int) -> None:
        """A load that will never be waited for (its slot was discarded)."""
        self._submitted.pop((slot, generation), None)

    def take(self) -> LoadSamples:
        """The samples since the last take."""
        taken = LoadSamples(*(tuple(samples) for samples in self._samples))
        for samples in self._samples:
            samples.clear()
        return taken


class MeteredBackend:
    """The residency manager's backend: the real one, plus load timing, the footprint and page release.

    `physical_footprint()` (what `correct_for_pressure` compares with the budget)
    is the meter's footprint. While `releasing` is set (only around pressure
    correction) a discarded slot's pages are punched out of the slab: the slot
    is being disabled, nothing reads or writes it again, and the memory is free.
    """

    def __init__(self, inner: object, *, slab: Slab, timer: LoadTimer, footprint: Callable[[], int]) -> None:
        self._inner, self._slab, self._timer, self._footprint = inner, slab, timer, footprint
        self.releasing = False
        self.released_bytes = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)  # hint_segments, telemetry, ... pass straight through

    @property
    def inner(self) -> object:
        return self._inner

    @property
    def slots(self) -> int:
        return self._inner.slots  # type: ignore[attr-defined]

    def submit_segments(self, slot: int, generation: int, segments: Sequence[object]) -> None:
        self._inner.submit_segments(slot, generation, segments)  # type: ignore[attr-defined]
        self._timer.submitted(slot, generation)

    def untimed(self, slot: int, generation: int) -> None:
        """A load that is no demand wave's (a prefetch): its disk time and wait are not sampled."""
        self._timer.forget(slot, generation)

    async def wait(self, slot: int, generation: int) -> None:
        self._timer.wait_started()
        try:
            await self._inner.wait(slot, generation)  # type: ignore[attr-defined]
        finally:
            self._timer.wait_ended(slot, generation)

    def cancel(self, slot: int, generation: int) -> None:
        self._inner.cancel(slot, generation)  # type: ignore[attr-defined]

    def lease(self, slot: int, generation: int, consumer: str = "gpu") -> None:
        self._inner.lease(slot, generation, consumer)  # type: ignore[attr-defined]

    def release_gpu_fenced(self, slot: int, generation: int) -> None:
        self._inner.release_gpu_fenced(slot, generation)  # type: ignore[attr-defined]

    def discard(self, slot: int, generation: int) -> None:
        self._inner.discard(slot, generation)  # type: ignore[attr-defined]
        self._timer.forget(slot, generation)
        if self.releasing:
            self._release_pages(slot)

    def physical_footprint(self) -> int:
        return self._footprint()

    def _release_pages(self, slot: int) -> None:
        buffer, advice = self._slab.buffer, getattr(mmap, "MADV_REMOVE", None)
        if buffer is None or advice is None:  # macOS: shm pages cannot be punched out
            return
        before = self._slab.resident_bytes()
        try:
            buffer.madvise(advice, self._slab.slot_offset(slot), self._slab.slot_bytes)
        except OSError as error:
            logger.warning("could not release the pages of slot %d: %s", slot, error)
            return
        self.released_bytes += max(0, before - self._slab.resident_bytes())


__all__ = ["LoadSamples", "LoadTimer", "MeteredBackend"]
