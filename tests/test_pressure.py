"""Footprint pressure: what is measured, what is corrected, and what fails with `memory_pressure`.

The footprint compared with the budget is dense weights + slab resident bytes +
every process's private-memory growth since it started serving (+ the test
offset); see coordinator/footprint.py. Unit tests pin that formula and the page
release down; the system tests run a model whose experts are several times the
budget (its footprint, measured from outside with psutil, stays within it), then
add a synthetic offset (the `test_footprint_offset_bytes` test knob) that
pressure correction can absorb by evicting, and one it cannot.
"""

from __future__ import annotations

import asyncio
import logging
import re

import psutil
import pytest

from coordinator.footprint import FootprintMeter, process_private_bytes
from coordinator.memory_backend import InMemoryBackend
from coordinator.metered_backend import LoadTimer, MeteredBackend
from coordinator.residency import ExpertResidencyManager
from coordinator.safepoint import SafePoints
from shared.client import Client, JobFailedError
from shared.plan import plan_expert_residency
from shared.segments import ExpertIOSegment, ExpertResidencyLocation
from shared.slab import Slab
from shared.store import ExpertStore
from tests.helpers.footprint import FootprintProbe, slab_resident
from tests.helpers.models import write_tiny_model
from tests.helpers.system import PROMPT, run_job, start_test_system

log = logging.getLogger(__name__)
SLOT = 64 * 1024
KV_RESERVE = 8 << 20  # room for the KV cache and MLX's buffers (copies of leased slots): ~6 MB measured
STRICT = dict(pressure_tolerance_bytes=0, footprint_interval_ms=1.0)  # correct at every safe point


# ---------------------------------------------------------------------------------------------
# The formula and the page release, without processes


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_footprint_is_dense_plus_slab_plus_growth_plus_offset():
    with Slab.create(total_slots=4, slot_bytes=SLOT) as slab:
        private = {1: 100_000, 2: 50_000}
        pids, clock = [1, 2], _Clock()
        meter = FootprintMeter(
            slab=slab,
            pids=lambda: pids,
            dense_bytes=lambda: 30_000,
            interval_s=0.1,
            offset=7,
            read=lambda pid: private[pid],
            clock=clock,
        )
        assert meter.sample(force=True) and meter.footprint() == 30_000 + 0 + 0 + 7
        assert meter.overhead() == 150_000 - 30_000  # the processes at start, less the dense weights
        view = slab.slot_view(2)
        view[:] = b"\1" * SLOT  # a loaded slot: its pages count once, whoever touched them
        view.release()
        private[1] += 4096
        assert not meter.sample()  # within the interval: nothing measured
        clock.now = 0.2
        assert meter.sample() and meter.footprint() == 30_000 + SLOT + 4096 + 7
        pids.append(3)  # a restarted worker: its first sample is its baseline
        private[3] = 10**6
        clock.now = 0.4
        assert meter.sample() and meter.growth() == 4096
        pids.remove(2)  # an exited one: its memory left with it
        clock.now = 0.6
        meter.sample()
        assert meter.overhead() == 100_000 + 10**6 - 30_000 and meter.run_peak == 30_000 + SLOT + 4096 + 7


def test_real_processes_are_measured_without_the_slab_pages():
    """private(p) excludes shared memory: touching a slab page does not grow it."""
    with Slab.create(total_slots=64, slot_bytes=SLOT) as slab:
        me = psutil.Process().pid
        before = process_private_bytes(me)
        for slot in range(64):
            view = slab.slot_view(slot)
            view[:] = b"\2" * SLOT
            view.release()
        assert slab.resident_bytes() == 64 * SLOT
        assert process_private_bytes(me) - before < 64 * SLOT // 2
        info = psutil.Process(me).memory_info()  # the same RssAnon as psutil's rss - shared (no swap here)
        assert abs(process_private_bytes(me) - (info.rss - info.shared)) < 1 << 20
    with pytest.raises(psutil.NoSuchProcess):
        process_private_bytes(2**22 + 12345)


def _locate(layer: int, expert: int) -> ExpertResidencyLocation:
    return ExpertResidencyLocation(layer=layer, expert_id=expert, segments=(ExpertIOSegment(0, 0, SLOT, 0),))


def test_pressure_correction_evicts_frees_the_pages_and_reports_what_it_cannot_fix():
    async def scenario():
        with Slab.create(total_slots=2 + 2 * 4, slot_bytes=SLOT) as slab:
            inner = InMemoryBackend(slab.total_slots, slot_bytes=SLOT)
            timer = LoadTimer()
            offset = [0]
            meter = FootprintMeter(
                slab=slab, pids=lambda: [], dense_bytes=lambda: 0, interval_s=0.0, read=lambda pid: 0
            )
            backend = MeteredBackend(inner, slab=slab, timer=timer, footprint=lambda: meter.footprint() + offset[0])
            plan = plan_expert_residency(
                budget_bytes=10 * SLOT, fixed_bytes=0, slot_bytes=SLOT, sparse_layers=2, working_slots=2
            )
            manager = ExpertResidencyManager(plan=plan, sparse_layer_ids=[0, 1], backend=backend, locate=_locate)
            points = SafePoints(
                manager=manager, backend=backend, meter=meter, ledger=None, tolerance=0, flush_interval_s=1.0
            )
            for layer in (0, 1):
                for pair in ((0, 1), (2, 3), (4, 5)):
                    lease = await manager.acquire_block(layer, pair)
                    for entry in lease.entries:  # what an I/O worker's read would have written
                        view = slab.slot_view(entry.slot)
                        view[:] = b"\3" * SLOT
                        view.release()
                    lease.release_fenced()
            assert len(timer.disk_ms) == 12 and len(timer.wait_ms) == 6  # every load, every wave timed
            full = slab.resident_bytes()
            assert points.check_pressure() is None  # within the budget: nothing to do
            offset[0] = 3 * SLOT  # 3 slots too many: 3 of the 6 evictable (4 per layer, keep 1) go
            report = points.check_pressure()
            assert report is not None and not report.failed and len(report.evicted) == 3
            assert slab.resident_bytes() == full - 3 * SLOT and backend.released_bytes == 3 * SLOT
            assert manager.snapshot().pressure_evictions == 3 and manager.snapshot().disabled == 3
            offset[0] = 20 * SLOT  # more than everything evictable
            report = points.check_pressure()
            assert report.failed and len(report.evicted) == 3  # the last 3; one slot per layer stays
            message = report.message()
            assert f"footprint {report.after} bytes exceeds the memory budget {10 * SLOT} bytes" in message
            assert "nothing evictable remains" in message

    asyncio.run(scenario())


# ---------------------------------------------------------------------------------------------
# The real system


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # 4 sparse layers x 48 experts of 400 KB: 78 MB of experts, a few times any budget below.
    return write_tiny_model(
        tmp_path_factory.mktemp("pressure"),
        family="qwen3_moe",
        num_hidden_layers=4,
        num_experts=48,
        moe_intermediate_size=512,
    )


def _budget(store: ExpertStore, per_layer: int) -> int:
    return store.dense_bytes + KV_RESERVE + (store.top_k + len(store.sparse_layers) * per_layer) * store.slot_bytes


@pytest.fixture(scope="module")
def calibration(model):
    """A job on experts 6x the budget: (store, footprint at its end, slab then) for the next tests."""
    store = ExpertStore.open(model)
    budget = _budget(store, per_layer=2)
    experts = store.slot_bytes * store.experts_per_layer * len(store.sparse_layers)
    assert experts >= 4 * budget
    with start_test_system(model, memory_budget=budget, kv_reserve_bytes=KV_RESERVE, run_config=STRICT) as system:
        with FootprintProbe(system, dense_bytes=store.dense_bytes) as probe:
            done = run_job(system, max_tokens=32, return_logprobs=False).done
        slab = slab_resident(system)
    return dict(store=store, budget=budget, experts=experts, done=done, probe=probe, slab=slab)


def test_a_model_with_experts_4x_the_budget_stays_within_it(calibration, record_property):
    stats, probe, budget = calibration["done"].stats, calibration["probe"], calibration["budget"]
    assert stats.misses > 0 and stats.generated_tokens > 0 and stats.pressure_evictions == 0
    # what the test measured itself, every 10 ms during the job, and what the coordinator sampled
    assert probe.samples > 10 and probe.peak <= budget, (probe.peak, budget)
    assert stats.peak_footprint_bytes <= budget and stats.budget_bytes == budget
    assert calibration["slab"] <= calibration["store"].slot_bytes * (2 + 4 * 2)  # the plan's slab, no more
    figures = dict(
        experts=calibration["experts"],
        budget=budget,
        probe_peak=probe.peak,
        coordinator_peak=stats.peak_footprint_bytes,
        overhead=stats.overhead_bytes,
    )
    record_property("figures", figures)
    log.info("footprint figures: %s", figures)


def test_pressure_above_the_budget_is_corrected_by_evicting(model, calibration, caplog, record_property):
    caplog.set_level(logging.INFO)
    store, done = calibration["store"], calibration["done"]
    growth = done.stats.footprint_bytes - store.dense_bytes - calibration["slab"]
    per_layer = 8
    budget = _budget(store, per_layer)
    full = store.dense_bytes + growth + (store.top_k + len(store.sparse_layers) * per_layer) * store.slot_bytes
    evictable = len(store.sparse_layers) * (per_layer - 1) * store.slot_bytes
    offset = max(0, budget - full) + evictable // 2  # half of what can be evicted must go
    with start_test_system(
        model,
        memory_budget=budget,
        kv_reserve_bytes=KV_RESERVE,
        run_config=dict(STRICT, test_footprint_offset_bytes=offset),
    ) as system:
        result = run_job(system, max_tokens=32, return_logprobs=False)
        with Client(system.endpoint, timeout=30) as client:
            total = client.stats().stats
    stats = result.done.stats
    assert result.done.finish_reason in ("length", "stop") and stats.pressure_evictions > 0
    assert total.footprint_bytes <= budget + store.slot_bytes, (total.footprint_bytes, budget)
    evictions = [
        re.search(r"evicted (\d+) resident experts \(layer:expert@slot\) (\S+)", r.getMessage())
        for r in caplog.records
        if "memory pressure: footprint" in r.getMessage()
    ]
    evicted = sum(int(match.group(1)) for match in evictions if match)
    assert evicted == total.pressure_evictions > 0 and evicted < evictable // store.slot_bytes
    figures = dict(budget=budget, offset=offset, pressure_evictions=total.pressure_evictions)
    record_property("figures", figures)
    log.info("pressure figures: %s", figures)


def test_pressure_that_cannot_be_corrected_fails_the_job(model, calibration):
    store = calibration["store"]
    budget = _budget(store, per_layer=2)
    with (
        start_test_system(
            model,
            memory_budget=budget,
            kv_reserve_bytes=KV_RESERVE,
            run_config=dict(STRICT, test_footprint_offset_bytes=budget),
        ) as system,
        Client(system.endpoint, timeout=30) as client,
    ):
        for _ in range(2):  # every job fails the same way; the system keeps serving
            with pytest.raises(JobFailedError) as caught:
                client.generate(prompt_tokens=list(PROMPT), max_tokens=10_000).result()
            assert caught.value.code == "memory_pressure"
            assert f"exceeds the memory budget {budget} bytes" in caught.value.message
            assert re.search(r"the physical footprint \d+ bytes", caught.value.message)
        stats = client.stats()
        assert stats.running is None and stats.jobs_failed == 2 and client.health().ready
