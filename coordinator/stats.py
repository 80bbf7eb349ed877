"""Job statistics: one job's `JobStats` for its `done`, and the run's cumulative ones for `stats`.

Sources: the lease service (hits, misses, visits, bytes read), the GPU
worker's `job_done` (tokens, prefill/decode time, wrap path, bytes copied),
the residency manager's snapshot (evictions, pressure evictions and repin
swaps, counted from the previous job's end so that what the safe point
between two jobs did shows in the next job), its hint telemetry, the footprint
meter (coordinator.footprint), and the `LoadTimer` of coordinator.metered_backend
(disk service and foreground wait, per load and per wave, timed around the backend).

Cumulative figures keep totals and recompute every rate from them (hit rate
= all hits / all lookups, decode tok/s = all generated tokens / all decode
time, ...). Percentiles of a job are exact (`nearest_rank` over the job's
samples, the residency telemetry's rule); cumulative percentiles come from a bounded uniform reservoir
(`RESERVOIR_SIZE` samples per measure, Vitter's algorithm R), so they are
exact until that many samples were seen and an unbiased estimate after.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field

from coordinator.footprint import FootprintMeter
from coordinator.leases import LeaseService, LeaseServiceStats
from coordinator.metered_backend import LoadSamples, LoadTimer
from coordinator.prefetch import PrefetchTelemetry
from coordinator.residency import ExpertResidencyManager
from coordinator.residency_types import ExpertHintTelemetry, ExpertResidencySnapshot, nearest_rank
from shared.gpu_messages import JobDone
from shared.job_messages import JobStats

RESERVOIR_SIZE = 8192


class Reservoir:
    """A uniform sample of at most `size` of every value ever added (algorithm R)."""

    def __init__(self, *, size: int = RESERVOIR_SIZE, seed: int = 0) -> None:
        self._size = size
        self._values: list[float] = []
        self._seen = 0
        self._random = random.Random(seed)  # seeded: the same run gives the same figures

    @property
    def seen(self) -> int:
        return self._seen

    def extend(self, values: Iterable[float]) -> None:
        for value in values:
            self._seen += 1
            if len(self._values) < self._size:
                self._values.append(value)
            else:
                index = self._random.randrange(self._seen)
                if index < self._size:
                    self._values[index] = value

    def percentiles(self, *fractions: float) -> tuple[float, ...]:
        ordered = sorted(self._values)
        return tuple(nearest_rank(ordered, fraction) for fraction in fractions)


@dataclass(frozen=True, slots=True)
class JobFigures:
    """Everything one job contributes to the statistics."""

    lease: LeaseServiceStats
    done: JobDone | None
    relayed_tokens: int  # tokens sent to the client (a failed job has no job_done)
    before: ExpertResidencySnapshot  # the manager at the previous job's end
    after: ExpertResidencySnapshot  # ... and at this job's end
    hints: ExpertHintTelemetry | None
    loads: LoadSamples
    wrap_path: str
    footprint: int
    peak_footprint: int
    budget: int
    baseline: int
    processes: int
    slab: int
    io_fallback_ops: int
    prefetch: PrefetchTelemetry


def _rate(count: int, milliseconds: float) -> float:
    return count / (milliseconds / 1e3) if milliseconds > 0 else 0.0


def job_stats(job: JobFigures) -> JobStats:
    """The `JobStats` of one job."""
    done, lease = job.done, job.lease
    disk, wait = sorted(job.loads.disk), sorted(job.loads.wait)
    decode_disk, decode_wait = sorted(job.loads.decode_disk), sorted(job.loads.decode_wait)
    served = lease.hits + lease.misses
    hints = job.hints
    return JobStats(
        prompt_tokens=done.prompt_tokens if done else 0,
        generated_tokens=len(done.tokens) if done else job.relayed_tokens,
        prefill_tok_s=_rate(done.prompt_tokens, done.prefill_ms) if done else 0.0,
        decode_tok_s=_rate(len(done.tokens), done.decode_ms) if done else 0.0,
        hits=lease.hits,
        misses=lease.misses,
        hit_rate=lease.hits / served if served else 0.0,
        all_resident=lease.all_resident,
        shared_leases=lease.shared_visits / lease.visits if lease.visits else 0.0,
        bytes_read=lease.bytes_read,
        disk_p50_ms=nearest_rank(disk, 0.5),
        disk_p99_ms=nearest_rank(disk, 0.99),
        wait_p50_ms=nearest_rank(wait, 0.5),
        wait_p99_ms=nearest_rank(wait, 0.99),
        decode_disk_p50_ms=nearest_rank(decode_disk, 0.5),
        decode_disk_p99_ms=nearest_rank(decode_disk, 0.99),
        decode_wait_p50_ms=nearest_rank(decode_wait, 0.5),
        decode_wait_p99_ms=nearest_rank(decode_wait, 0.99),
        evictions=job.after.evictions - job.before.evictions,
        pressure_evictions=job.after.pressure_evictions - job.before.pressure_evictions,
        repin_swaps=job.after.repin_swaps - job.before.repin_swaps,
        hints_submitted=hints.submitted if hints else 0,
        hints_dropped=hints.dropped if hints else 0,
        hints_skipped_resident=hints.resident_skipped if hints else 0,
        wrap_path=done.wrap_path if done else job.wrap_path,
        bytes_copied=done.bytes_copied if done else 0,
        footprint_bytes=job.footprint,
        peak_footprint_bytes=job.peak_footprint,
        budget_bytes=job.budget,
        io_fallback_ops=job.io_fallback_ops,
        baseline_bytes=job.baseline,
        processes_bytes=job.processes,
        slab_bytes=job.slab,
        **prefetch_fields(job.prefetch, lease.decode_misses),
    )


def prefetch_fields(prefetch: PrefetchTelemetry, decode_misses: int) -> dict[str, object]:
    """The `prefetch_*` fields of a `JobStats`. Recall is counted against the misses of decode
    visits alone: prefill is never predicted, and its misses (a prompt's every expert, at once)
    would drown the figure."""
    return dict(
        prefetch_predicted=prefetch.predicted,
        prefetch_issued=prefetch.issued,
        prefetch_useful=prefetch.useful,
        prefetch_wasted=prefetch.wasted,
        prefetch_bytes=prefetch.issued_bytes,
        prefetch_wasted_bytes=prefetch.wasted_bytes,
        prefetch_recall=prefetch.recall(decode_misses),
        prefetch_precision=prefetch.precision,
        prefetch_prediction_recall=prefetch.prediction_recall,
        prefetch_waits=prefetch.waits,
        prefetch_wait_ms=prefetch.wait_ms,
        prefetch_disabled_layers=len(prefetch.disabled_layers),
        prefetch_steps_without=prefetch.steps_without,
        prefetch_paused=prefetch.paused,
        prefetch_trialling=prefetch.trialling,
    )


@dataclass(slots=True)
class _Sums:
    prompt: int = 0
    generated: int = 0
    prefill_prompt: int = 0  # prompt tokens of the jobs whose prefill time is known
    prefill_ms: float = 0.0
    decode_generated: int = 0
    decode_ms: float = 0.0
    hits: int = 0
    misses: int = 0
    decode_misses: int = 0
    visits: int = 0
    all_resident_visits: int = 0
    shared_visits: int = 0
    bytes_read: int = 0
    hints_submitted: int = 0
    hints_dropped: int = 0
    hints_skipped: int = 0
    bytes_copied: int = 0
    io_fallback_ops: int = 0
    wrap_path: str = "copy"
    jobs: int = 0
    prefetch: PrefetchTelemetry = field(default_factory=PrefetchTelemetry)
    disk: Reservoir = field(default_factory=lambda: Reservoir(seed=1))
    wait: Reservoir = field(default_factory=lambda: Reservoir(seed=2))
    decode_disk: Reservoir = field(default_factory=lambda: Reservoir(seed=3))
    decode_wait: Reservoir = field(default_factory=lambda: Reservoir(seed=4))


class RunTotals:
    """Cumulative statistics over every job that ran (done, failed or cancelled)."""

    def __init__(self) -> None:
        self._sums = _Sums()

    @property
    def jobs(self) -> int:
        return self._sums.jobs

    def add(self, job: JobFigures) -> None:
        sums, done, lease = self._sums, job.done, job.lease
        sums.jobs += 1
        if done is not None:
            sums.prompt += done.prompt_tokens
            sums.generated += len(done.tokens)
            if done.prefill_ms > 0:
                sums.prefill_prompt += done.prompt_tokens
                sums.prefill_ms += done.prefill_ms
            if done.decode_ms > 0:
                sums.decode_generated += len(done.tokens)
                sums.decode_ms += done.decode_ms
            sums.bytes_copied += done.bytes_copied
            sums.wrap_path = done.wrap_path
        else:
            sums.generated += job.relayed_tokens
        sums.hits += lease.hits
        sums.misses += lease.misses
        sums.decode_misses += lease.decode_misses
        sums.visits += lease.visits
        sums.all_resident_visits += lease.all_resident_visits
        sums.shared_visits += lease.shared_visits
        sums.bytes_read += lease.bytes_read
        if job.hints is not None:
            sums.hints_submitted += job.hints.submitted
            sums.hints_dropped += job.hints.dropped
            sums.hints_skipped += job.hints.resident_skipped
        sums.io_fallback_ops += job.io_fallback_ops
        sums.prefetch = sums.prefetch + job.prefetch
        sums.disk.extend(job.loads.disk)
        sums.wait.extend(job.loads.wait)
        sums.decode_disk.extend(job.loads.decode_disk)
        sums.decode_wait.extend(job.loads.decode_wait)

    def add_between_jobs(self, prefetch: PrefetchTelemetry) -> None:
        self._sums.prefetch = self._sums.prefetch + prefetch

    def stats(self, *, now: ExpertResidencySnapshot, meter: FootprintMeter, budget: int) -> JobStats:
        """The cumulative `JobStats`; evictions and swaps are the manager's totals since the start."""
        sums = self._sums
        served = sums.hits + sums.misses
        disk_p50, disk_p99 = sums.disk.percentiles(0.5, 0.99)
        wait_p50, wait_p99 = sums.wait.percentiles(0.5, 0.99)
        decode_disk_p50, decode_disk_p99 = sums.decode_disk.percentiles(0.5, 0.99)
        decode_wait_p50, decode_wait_p99 = sums.decode_wait.percentiles(0.5, 0.99)
        return JobStats(
            prompt_tokens=sums.prompt,
            generated_tokens=sums.generated,
            prefill_tok_s=_rate(sums.prefill_prompt, sums.prefill_ms),
            decode_tok_s=_rate(sums.decode_generated, sums.decode_ms),
            hits=sums.hits,
            misses=sums.misses,
            hit_rate=sums.hits / served if served else 0.0,
            all_resident=sums.all_resident_visits / sums.visits if sums.visits else 0.0,
            shared_leases=sums.shared_visits / sums.visits if sums.visits else 0.0,
            bytes_read=sums.bytes_read,
            disk_p50_ms=disk_p50,
            disk_p99_ms=disk_p99,
            wait_p50_ms=wait_p50,
            wait_p99_ms=wait_p99,
            decode_disk_p50_ms=decode_disk_p50,
            decode_disk_p99_ms=decode_disk_p99,
            decode_wait_p50_ms=decode_wait_p50,
            decode_wait_p99_ms=decode_wait_p99,
            evictions=now.evictions,
            pressure_evictions=now.pressure_evictions,
            repin_swaps=now.repin_swaps,
            hints_submitted=sums.hints_submitted,
            hints_dropped=sums.hints_dropped,
            hints_skipped_resident=sums.hints_skipped,
            wrap_path=sums.wrap_path,
            bytes_copied=sums.bytes_copied,
            footprint_bytes=meter.footprint(),
            peak_footprint_bytes=meter.run_peak,
            budget_bytes=budget,
            io_fallback_ops=sums.io_fallback_ops,
            baseline_bytes=meter.baseline,
            processes_bytes=meter.processes_bytes(),
            slab_bytes=meter.slab_bytes(),
            **prefetch_fields(sums.prefetch, sums.decode_misses),
        )


class JobBook:
    """The statistics of the running job and of the run, over the coordinator's instruments."""

    def __init__(
        self, *, leases: LeaseService, manager: ExpertResidencyManager, meter: FootprintMeter, timer: LoadTimer
    ) -> None:
        self._leases, self._manager, self._meter, self._timer = leases, manager, meter, timer
        self._budget = manager.plan.budget_bytes
        self._before = manager.snapshot()  # the manager at the previous job's end
        self.totals = RunTotals()

    def begin(self) -> None:
        self._leases.begin_job()
        self._meter.begin_job()
        self._timer.take()  # samples of the preload or a live repin belong to no job
        self._manager.drain_hint_telemetry()
        # What prefetch did between jobs (the last job's last reads landing) counts for the run only.
        self.totals.add_between_jobs(self._manager.prefetch_book.drain())

    def end(self, done: JobDone | None, *, relayed: int, wrap_path: str, io_fallback_ops: int) -> JobStats:
        """The job's `JobStats`; the job also goes into the run's totals."""
        lease = self._leases.end_job()
        self._meter.sample(force=True)  # the job's last figure (a safe point: the worker has fenced)
        loads = self._timer.take()
        after = self._manager.snapshot()
        figures = JobFigures(
            lease=lease,
            done=done,
            relayed_tokens=relayed,
            before=self._before,
            after=after,
            hints=self._manager.drain_hint_telemetry(),
            loads=loads,
            wrap_path=wrap_path,
            footprint=self._meter.footprint(),
            peak_footprint=self._meter.job_peak,
            budget=self._budget,
            baseline=self._meter.baseline,
            processes=self._meter.processes_bytes(),
            slab=self._meter.slab_bytes(),
            io_fallback_ops=io_fallback_ops,
            prefetch=self._manager.prefetch_book.drain(),
        )
        self._before = after
        self.totals.add(figures)
        return job_stats(figures)

    def cumulative(self) -> JobStats:
        return self.totals.stats(now=self._manager.snapshot(), meter=self._meter, budget=self._budget)


__all__ = [
    "RESERVOIR_SIZE",
    "JobBook",
    "JobFigures",
    "Reservoir",
    "RunTotals",
    "job_stats",
]
