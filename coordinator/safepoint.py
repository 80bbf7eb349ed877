"""What the coordinator does at safe points: pressure correction, live repin, heat decay, ledger flushes.

A safe point is a moment when no wave is leased: right after the GPU worker's
`fenced` (the end of a forward step), after each `token`, and between jobs.
Inside a job only the footprint is checked (sampled at most every
`footprint_interval_ms`); between jobs the footprint is checked, then LFRU
live repin (at most `REPIN_SWAPS_PER_PASS` swaps), heat decay (the ledger's
heat halves once per job, so a burst fades over a few jobs) and a ledger
flush. The ledger is also flushed every `usage_flush_s` while dirty, and at
shutdown (coordinator.main).

The footprint and how it is measured: coordinator.footprint. Above
`budget + pressure_tolerance_bytes` the manager's `correct_for_pressure`
evicts resident experts (least recent first, each disabled for the run) until
the footprint is at most the budget; their pages are punched out of the slab
(MADV_REMOVE, by coordinator.metered_backend) so the eviction really frees
memory. If that cannot bring it under `budget + tolerance`, the running job
fails with `memory_pressure`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from coordinator.footprint import FootprintMeter
from coordinator.metered_backend import MeteredBackend
from coordinator.residency import ExpertResidencyManager
from coordinator.residency_types import ResidencyError, ResidencyPressureError
from coordinator.usage import ExpertUsageLedger, select_expert_lfru_candidates

logger = logging.getLogger(__name__)

REPIN_SWAPS_PER_PASS = 4


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


__all__ = ["REPIN_SWAPS_PER_PASS", "PressureReport", "SafePoints"]
