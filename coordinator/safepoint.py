"""What the coordinator does at safe points: footprint, pressure, live repin, heat decay, ledger flushes.

A safe point is a moment when no wave is leased: right after the GPU worker's
`fenced` (the end of a forward step), after each `token`, and between jobs.
Inside a job only the footprint is checked (sampled at most every
`footprint_interval_ms`); between jobs the footprint is checked, then LFRU
live repin (at most `REPIN_SWAPS_PER_PASS` swaps), heat decay (the ledger's
heat halves once per job, so a burst fades over a few jobs) and a ledger
flush. The ledger is also flushed every `usage_flush_s` while dirty, and at
shutdown (coordinator.main).

Footprint (what is compared with the plan's `budget_bytes`, which covers the
dense weights, the KV reserve and the slab):

    footprint = dense_bytes                      (as the GPU worker reports them)
              + slab resident bytes              (tmpfs st_blocks: every touched page, once)
              + sum over the coordinator, the I/O workers and the GPU worker of
                (private(p) now - private(p) when p started serving)
              + test_footprint_offset_bytes      (a test knob; 0 in real runs)

private(p) is the process's anonymous memory, resident or swapped out: RssAnon +
VmSwap of /proc/PID/status on Linux (RssAnon is psutil's `rss - shared`; one
small read, cheap): unlike USS it excludes the slab's shared-memory pages,
which USS counts for a page only one process has mapped (counting them twice),
and clean file pages such as library code, which the kernel drops without
swapping. Elsewhere it is psutil's USS (which may count slab pages twice). The processes'
private memory when they started serving (the GPU worker's at `gpu_ready`,
minus the dense weights it holds; the others' when the I/O workers were
ready) is Python, the libraries and the tokenizer: the plan never budgeted it,
so it is reported as `overhead_bytes` and not compared. Growth after that (KV
cache, MLX's buffers and copies of leased slots, Python heap) is what the KV
reserve is for, and counts.

Above `budget + pressure_tolerance_bytes` the manager's `correct_for_pressure`
evicts resident experts (least recent first, each disabled for the run) until
the footprint is at most the budget; their pages are punched out of the slab
(MADV_REMOVE) so the eviction really frees memory. If that cannot bring it
under `budget + tolerance`, the running job fails with `memory_pressure`.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import psutil

from coordinator.residency import ExpertResidencyManager
from coordinator.residency_types import ResidencyError, ResidencyPressureError
from coordinator.stats import LoadTimer
from coordinator.usage import ExpertUsageLedger, select_expert_lfru_candidates
from shared.slab import Slab

logger = logging.getLogger(__name__)

REPIN_SWAPS_PER_PASS = 4


def process_private_bytes(pid: int) -> int:
    """Private anonymous bytes of `pid`, resident or swapped out (module docstring); psutil.Error if gone."""
    if sys.platform.startswith("linux"):
        try:
            with open(f"/proc/{pid}/status", "rb") as status:  # one small read: cheap enough for every token
                fields = dict(line.split(b":", 1) for line in status.read().splitlines() if b":" in line)
        except (FileNotFoundError, ProcessLookupError):
            raise psutil.NoSuchProcess(pid) from None
        if b"RssAnon" in fields:  # kB; swapped-out pages count too, or swapping would hide pressure
            return sum(int(fields.get(key, b"0 kB").split()[0]) for key in (b"RssAnon", b"VmSwap")) * 1024
        info = psutil.Process(pid).memory_info()  # kernels before 4.5: RssAnon is rss - shared
        return max(0, info.rss - info.shared)
    return psutil.Process(pid).memory_full_info().uss


class FootprintMeter:
    """The footprint of the module docstring, sampled at most every `interval_s`."""

    def __init__(
        self,
        *,
        slab: Slab,
        pids: Callable[[], Sequence[int]],
        dense_bytes: Callable[[], int],
        interval_s: float,
        offset: int = 0,
        read: Callable[[int], int] = process_private_bytes,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._slab, self._pids, self._dense, self._read, self._clock = slab, pids, dense_bytes, read, clock
        self._interval = interval_s
        self._offset = offset
        self._base: dict[int, int] = {}  # pid -> private bytes at its first sample
        self._now: dict[int, int] = {}
        self._last: float | None = None
        self.samples = 0
        self.job_peak = 0
        self.run_peak = 0

    def sample(self, *, force: bool = False) -> bool:
        """Measure every process now, unless the last sample is more recent than the interval."""
        now = self._clock()
        if not force and self._last is not None and now - self._last < self._interval:
            return False
        self._last = now
        current: dict[int, int] = {}
        for pid in dict.fromkeys(self._pids()):
            try:
                current[pid] = self._read(pid)
            except (psutil.Error, OSError):  # exiting (it leaves the listing soon): its last reading stands
                if pid not in self._now:
                    continue
                current[pid] = self._now[pid]
            self._base.setdefault(pid, current[pid])
        self._base = {pid: base for pid, base in self._base.items() if pid in current}
        self._now = current
        self.samples += 1
        footprint = self.footprint()
        self.job_peak, self.run_peak = max(self.job_peak, footprint), max(self.run_peak, footprint)
        return True

    def growth(self) -> int:
        return sum(self._now[pid] - self._base[pid] for pid in self._now)

    def slab_bytes(self) -> int:
        return self._slab.resident_bytes()

    def footprint(self) -> int:
        """Dense + slab resident (live) + growth (last sample) + the test offset."""
        return self._dense() + self.slab_bytes() + self.growth() + self._offset

    def overhead(self) -> int:
        """The processes' private memory at start, less the dense weights: not compared."""
        return max(0, sum(self._base.values()) - self._dense())

    def begin_job(self) -> None:
        self.job_peak = self.footprint()

    def describe(self) -> str:
        offset = f" + test offset {self._offset}" if self._offset else ""
        return (
            f"dense weights {self._dense()} + slab resident {self.slab_bytes()} + process growth "
            f"{self.growth()}{offset}"
        )


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


@dataclass(frozen=True, slots=True)
class PressureReport:
    before: int  # footprint that triggered the correction
    after: int
    budget: int
    tolerance: int
    evicted: tuple[tuple[int, int, int], ...]  # (layer, expert, slot)
    failed: bool  # still above budget + tolerance
    detail: str  # what the footprint is made of, after

    def message(self) -> str:
        return (
            f"the physical footprint {self.after} bytes exceeds the memory budget {self.budget} bytes "
            f"(+{self.tolerance} tolerance) and pressure correction cannot lower it: it evicted "
            f"{len(self.evicted)} resident experts and nothing evictable remains ({self.detail})"
        )


class SafePoints:
    """The coordinator's safe-point policy over the manager, the meter and the ledger."""

    def __init__(
        self,
        *,
        manager: ExpertResidencyManager,
        backend: MeteredBackend,
        meter: FootprintMeter,
        ledger: ExpertUsageLedger | None,
        tolerance: int,
        flush_interval_s: float,
        repin_limit: int = REPIN_SWAPS_PER_PASS,
    ) -> None:
        self._manager, self._backend, self._meter, self._ledger = manager, backend, meter, ledger
        self._budget = manager.plan.budget_bytes
        self._tolerance = tolerance
        self._flush_interval = flush_interval_s
        self._repin_limit = repin_limit
        self.flushes = 0

    # --------------------------------------------------------------- inside a job

    def step(self) -> PressureReport | None:
        """Between two tokens: sample if due, correct if over; a report when something was done."""
        if self._manager.active or not self._meter.sample():
            return None
        return self.check_pressure()

    def check_pressure(self) -> PressureReport | None:
        """Correct an over-budget footprint; None when it was within budget + tolerance."""
        before = self._backend.physical_footprint()  # exactly what correct_for_pressure compares
        limit = self._budget + self._tolerance
        if before <= limit:
            return None
        resident = self._resident()
        self._backend.releasing = True
        try:
            self._manager.correct_for_pressure()  # evicts down to the budget itself (hysteresis)
        except ResidencyPressureError as error:
            logger.debug("pressure correction stopped: %s", error)
        finally:
            self._backend.releasing = False
        left = self._resident()
        evicted = tuple(
            sorted((layer, expert, slot) for (layer, expert), slot in resident.items() if (layer, expert) not in left)
        )
        after = self._backend.physical_footprint()
        report = PressureReport(
            before=before,
            after=after,
            budget=self._budget,
            tolerance=self._tolerance,
            evicted=evicted,
            failed=after > limit,
            detail=self._meter.describe(),
        )
        logger.warning(
            "memory pressure: footprint %d bytes > budget %d (+%d tolerance); evicted %d resident "
            "experts (layer:expert@slot) %s; footprint now %d bytes (%s)",
            before,
            self._budget,
            self._tolerance,
            len(evicted),
            " ".join(f"{layer}:{e}@{s}" for layer, e, s in evicted) or "-",
            after,
            report.detail,
        )
        if report.failed:
            logger.error("%s", report.message())
        return report

    # --------------------------------------------------------------- between jobs

    async def between_jobs(self) -> None:
        """Footprint, live repin, heat decay, ledger flush; only at a safe point."""
        if self._manager.active:
            logger.warning("skipped the safe point between jobs: a wave is active")
            return
        self._meter.sample(force=True)
        report = self.check_pressure()
        if report is not None and report.failed:
            logger.error("between jobs: %s; the next job will fail unless memory is freed", report.message())
        await self.repin()
        if self._ledger is not None:
            self._ledger.decay_heat()
        self.flush("after a job")

    async def repin(self) -> int:
        """At most `repin_limit` LFRU swaps of cold pins for hot resident experts; the number made."""
        candidates = select_expert_lfru_candidates(self._manager.repin_candidates(), self._repin_limit)
        swaps = 0
        for candidate in candidates:
            try:
                event = await self._manager.apply_repin(candidate)
            except (ResidencyError, OSError, RuntimeError) as error:  # I/O or a stale candidate: skip it
                logger.warning(
                    "live repin of layer %d %d -> %d failed: %s",
                    candidate.layer,
                    candidate.cold_expert_id,
                    candidate.hot_expert_id,
                    error,
                )
                continue
            swaps += 1
            logger.info(
                "live repin: layer %d pin %d -> %d (gain %d)",
                event.layer,
                event.evicted_pin,
                event.admitted_pin,
                event.gain,
            )
        if candidates:
            policy = self._manager.drain_policy_telemetry()
            logger.info(
                "live repin: %d of %d swaps, %d loads, %d bytes read",
                swaps,
                len(candidates),
                policy.loads,
                policy.read_bytes,
            )
        return swaps

    # --------------------------------------------------------------- the ledger

    def flush(self, reason: str) -> bool:
        """Persist the ledger if it changed; False (logged) when the write failed."""
        ledger = self._ledger
        if ledger is None or not ledger.snapshot().dirty:
            return True
        try:
            os.makedirs(os.path.dirname(os.path.abspath(ledger.path)), mode=0o700, exist_ok=True)
            ledger.flush()
        except OSError as error:  # the profile is derived state: keep serving, retry at the next flush
            logger.error("usage ledger flush (%s) to %s failed: %s", reason, ledger.path, error)
            return False
        self.flushes += 1
        logger.debug("usage ledger flushed (%s) to %s", reason, ledger.path)
        return True

    async def flush_periodically(self) -> None:
        """Every `usage_flush_s`, flush the ledger while it is dirty (a task of the coordinator)."""
        if self._ledger is None:
            return
        while True:
            await asyncio.sleep(self._flush_interval)
            self.flush("periodic")

    # --------------------------------------------------------------- helpers

    def _resident(self) -> Mapping[tuple[int, int], int]:
        return {(e.layer, e.expert_id): e.slot for e in self._manager.residency_map() if e.tier == "resident"}


__all__ = [
    "REPIN_SWAPS_PER_PASS",
    "FootprintMeter",
    "MeteredBackend",
    "PressureReport",
    "SafePoints",
    "process_private_bytes",
]
