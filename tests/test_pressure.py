"""The budget covers the whole system: what is measured, how the slab is sized, what is corrected.

The footprint compared with the budget is every process's PSS less its share
of the slab, plus the slab's resident pages once (+ the test offset); see
coordinator/footprint.py. Unit tests pin that formula, the sizing of the
slab after the measured processes and the page release down. The system
tests measure a system's processes, then run it under a budget just above
them: the slab gets what is left, and the sum of every process's PSS,
sampled from outside every 10 ms, stays within the budget. A budget the
processes leave no room in is refused, naming them; a synthetic offset (the
`test_footprint_offset_bytes` knob) is absorbed by evicting, or fails the
job with `memory_pressure` when it cannot be.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from coordinator.footprint import FootprintMeter
from coordinator.memory_backend import InMemoryBackend
from coordinator.metered_backend import LoadTimer, MeteredBackend
from coordinator.residency import ExpertResidencyManager
from coordinator.safepoint import SafePoints
from gpuworker.lanes import jit_compiler_bytes
from instruments.memory_watch import FootprintWatch
from shared.client import Client, JobFailedError
from shared.plan import plan_after_baseline, plan_expert_residency
from shared.segments import ExpertIOSegment, ExpertResidencyLocation
from shared.slab import Slab
from shared.store import ExpertStore
from shared.system_memory import ProcessMemory, child_pids, descendant_pids, private_bytes, process_memory
from supervisor.readiness import LaunchError
from tests.helpers.models import write_tiny_model
from tests.helpers.system import PROMPT, run_job, start_test_system, with_processes

log = logging.getLogger(__name__)
SLOT = 64 * 1024
# Room for what grows while serving: the KV cache, MLX's buffers and copies of leased slots (the GPU
# worker, ~6 MB measured), the Python heaps of all processes.
KV_RESERVE = 32 << 20
# The processes' memory varies a little from one start to the next (a few hundred KiB measured).
BASELINE_MARGIN = 4 << 20
STRICT = dict(pressure_tolerance_bytes=0, footprint_interval_ms=1.0)  # correct at every safe point


# ---------------------------------------------------------------------------------------------
# The formula, the sizing and the page release, without processes


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_footprint_is_every_process_without_its_slab_share_plus_the_slab_once_plus_offset():
    with Slab.create(total_slots=4, slot_bytes=SLOT) as slab:
        memory = {11: ProcessMemory(pss=100_000, shmem=40_000), 12: ProcessMemory(pss=50_000, shmem=0)}
        roles, clock = {"coordinator": 11, "gpu_worker": 12}, _Clock()
        below: dict[int, list[int]] = {}  # pid -> the processes it started

        def read(pid: int) -> ProcessMemory:
            if pid not in memory:
                raise ProcessLookupError(pid)
            return memory[pid]

        meter = FootprintMeter(
            slab=slab,
            pids=lambda: roles,
            interval_s=0.1,
            offset=7,
            read=read,
            probe=lambda pid: None,  # every sample a full read (as off Linux); the probe's own test is below
            below=lambda pid, skip: [child for child in below.get(pid, []) if child not in skip],
            clock=clock,
        )
        assert meter.mark_baseline() == 60_000 + 50_000  # the offset stands for growth, not the baseline
        assert meter.footprint() == 110_000 + 0 + 7 and meter.parts() == {"coordinator": 60_000, "gpu_worker": 50_000}
        view = slab.slot_view(2)
        view[:] = b"\1" * SLOT  # a loaded slot: its pages count once, whoever touched them
        view.release()
        memory[12] = ProcessMemory(pss=54_096, shmem=0)
        assert not meter.sample()  # within the interval: nothing measured
        clock.now = 0.2
        assert meter.sample() and meter.footprint() == 60_000 + 54_096 + SLOT + 7
        below[11] = [12]  # a role's child that is itself a role counts once, as its own role
        below[12], memory[21] = [21, 22], ProcessMemory(pss=30_000, shmem=0)  # its compiler (22: gone already)
        clock.now = 0.35
        assert meter.sample() and meter.parts() == {"coordinator": 60_000, "gpu_worker": 54_096 + 30_000}
        below.clear()
        del memory[12]  # exiting: its last reading stands while it is still listed
        clock.now = 0.5
        assert meter.sample() and meter.parts()["gpu_worker"] == 54_096 + 30_000  # its compiler's share with it
        roles["gpu_worker"] = 13  # its replacement: a new pid, measured afresh (gone now: not counted)
        clock.now = 0.7
        assert meter.sample() and meter.parts() == {"coordinator": 60_000}
        assert meter.baseline == 110_000 and meter.run_peak == 60_000 + 54_096 + 30_000 + SLOT + 7
        assert "coordinator 60000" in meter.describe() and f"slab resident {SLOT}" in meter.describe()


def _one_process_meter(slab: Slab, **options) -> FootprintMeter:
    """A meter of one GPU worker (pid 11), sampled every 0.1 s and read in full every 5 s."""
    return FootprintMeter(
        slab=slab,
        pids=lambda: {"gpu_worker": 11},
        interval_s=0.1,
        below=lambda pid, skip: [],
        full_interval_s=5.0,
        **options,
    )


def test_a_process_is_read_in_full_every_interval_and_between_follows_its_anonymous_bytes():
    """A full read walks the process's page tables (37 ms for a 3.3 GB GPU worker here): between
    two, the process's own share is its last full reading plus its anonymous move."""
    with Slab.create(total_slots=1, slot_bytes=SLOT) as slab:
        memory, private, clock, reads = {11: ProcessMemory(pss=100_000, shmem=0)}, {11: 5_000}, _Clock(), []

        def read(pid: int) -> ProcessMemory:
            reads.append(pid)
            return memory[pid]

        meter = _one_process_meter(slab, read=read, probe=private.get, clock=clock)
        assert meter.mark_baseline() == 100_000 and reads == [11]
        private[11], memory[11] = 5_600, ProcessMemory(pss=100_650, shmem=0)  # 600 anonymous, 50 file bytes more
        clock.now = 0.2
        assert meter.sample() and meter.parts() == {"gpu_worker": 100_600} and reads == [11]  # no walk
        private[11] = 4_600 + 200_000_000  # a copy path's churn: followed, up and down, without a walk
        clock.now = 0.4
        assert meter.sample(force=True) and meter.parts() == {"gpu_worker": 200_099_600} and len(reads) == 1
        private[11] = 4_600
        clock.now = 4.9  # 4.9 s since the full read: an estimate still
        assert meter.sample() and meter.parts() == {"gpu_worker": 99_600} and len(reads) == 1
        clock.now = 5.1  # stale: read in full, and the file bytes show
        assert meter.sample() and meter.parts() == {"gpu_worker": 100_650} and reads == [11, 11]
        assert meter.full_reads == 2 and meter.footprint() == 100_650
        assert meter.sample(force=True, full=True) and len(reads) == 3
        private.clear()  # no probe (off Linux, or gone): every sample reads in full
        clock.now = 5.3
        assert meter.sample() and len(reads) == 4


def test_with_background_reads_a_stale_process_is_read_on_another_thread_and_its_estimate_stands_meanwhile():
    """The coordinator samples in its event loop: a 37 ms walk there would stall the GPU worker's
    next lease request. With `background_reads` a stale process is read on the meter's own thread
    and its anonymous-move estimate stands until the reading arrives; a failed read changes nothing."""
    with Slab.create(total_slots=1, slot_bytes=SLOT) as slab:
        memory, private, clock, reads = {11: ProcessMemory(pss=100_000, shmem=0)}, {11: 5_000}, _Clock(), []
        read_done, release = threading.Event(), threading.Event()

        def read(pid: int) -> ProcessMemory:
            reads.append(threading.current_thread().name)
            if threading.current_thread().name == "footprint-reads":
                assert release.wait(10)  # held until the test has sampled meanwhile
                release.clear()
                read_done.set()
            if pid not in memory:
                raise psutil.NoSuchProcess(pid)
            return memory[pid]

        meter = _one_process_meter(slab, read=read, probe=private.get, clock=clock, background_reads=True)
        try:
            assert meter.mark_baseline() == 100_000 and reads == ["MainThread"]  # the first reading: at once
            private[11], memory[11] = 5_600, ProcessMemory(pss=100_650, shmem=0)  # 600 anonymous, 50 file bytes
            clock.now = 5.1  # stale: asked for, not read here; the estimate stands
            assert meter.sample() and meter.parts() == {"gpu_worker": 100_600} and reads == ["MainThread"]
            clock.now = 5.3  # still reading: asked again, read once
            assert meter.sample() and meter.parts() == {"gpu_worker": 100_600}
            release.set()
            assert read_done.wait(10)
            read_done.clear()
            deadline = time.monotonic() + 10
            while meter.full_reads < 2 and time.monotonic() < deadline:  # merged by the next sample
                clock.now += 0.2
                meter.sample()
                time.sleep(0.01)
            assert meter.parts() == {"gpu_worker": 100_650} and reads == ["MainThread", "footprint-reads"]
            assert meter.full_reads == 2
            # A reading that fails (the process exits meanwhile) is dropped: the estimate stands.
            del memory[11]
            clock.now += 5.0
            private[11] = 5_700
            assert meter.sample() and meter.parts() == {"gpu_worker": 100_750}
            release.set()
            assert read_done.wait(10)
            clock.now += 0.2
            assert meter.sample() and meter.parts() == {"gpu_worker": 100_750} and meter.full_reads == 2
        finally:
            release.set()
            meter.close()
        assert not any(thread.name == "footprint-reads" for thread in threading.enumerate())


def test_the_processes_a_process_started_are_found_down_to_its_grandchildren():
    shell = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(descendant_pids(os.getpid())) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        found = descendant_pids(os.getpid())
        assert shell.pid in found and len(set(found)) == 3, found  # the shell and its two sleeps
        assert set(descendant_pids(shell.pid)) == set(found) - {shell.pid} and child_pids(os.getpid()) == [shell.pid]
        assert descendant_pids(os.getpid(), skip=[shell.pid]) == []  # a skipped process, and all below it
    finally:
        for pid in descendant_pids(shell.pid):
            os.kill(pid, signal.SIGKILL)
        shell.kill()
        shell.wait()
    assert descendant_pids(shell.pid) == [] and child_pids(shell.pid) == []


def test_a_real_process_is_measured_without_the_slab_pages_it_touches():
    """Its PSS less its slab share (the full read), and its anonymous bytes (the probe between two
    full reads): neither moves with the slab's pages; the probe moves with the heap."""
    linux = sys.platform.startswith("linux")
    with Slab.create(total_slots=64, slot_bytes=SLOT) as slab:
        before, private_before = process_memory(os.getpid()), private_bytes(os.getpid())
        for slot in range(64):
            view = slab.slot_view(slot)
            view[:] = b"\2" * SLOT
            view.release()
        after, private_after = process_memory(os.getpid()), private_bytes(os.getpid())
        assert slab.resident_bytes() == 64 * SLOT
        assert after.shmem - before.shmem >= 64 * SLOT // 2  # the slab's pages are in its PSS ...
        assert after.own - before.own < 64 * SLOT // 2  # ... and taken out of what it owns
        # A private mapping of its own, a byte written in each page: fresh anonymous pages. A
        # bytearray could be served from heap pages that earlier tests in this process freed but
        # malloc kept resident (seen in CI: the probe moved by 0).
        heap_flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        with mmap.mmap(-1, 64 * 2**20, flags=heap_flags) as heap:
            for offset in range(0, len(heap), mmap.PAGESIZE):
                heap[offset] = 1
            private_heap = private_bytes(os.getpid())
    if linux:
        assert private_before is not None and private_after is not None and private_heap is not None
        assert private_after - private_before < 64 * SLOT // 2  # the slab is not anonymous memory
        assert 60 * 2**20 <= private_heap - private_after < 68 * 2**20, private_heap - private_after
    else:
        assert private_before is private_after is private_heap is None
    with pytest.raises(psutil.NoSuchProcess):
        process_memory(2**22 + 12345)
    assert private_bytes(2**22 + 12345) is None


def test_the_slab_is_sized_after_the_processes_and_a_budget_they_fill_is_refused_naming_them():
    plan = plan_expert_residency(
        budget_bytes=100 * SLOT, fixed_bytes=10 * SLOT, slot_bytes=SLOT, sparse_layers=4, working_slots=4
    )
    assert plan.slots_per_layer == 21
    sized = plan_after_baseline(plan, baseline_bytes=40 * SLOT, kv_reserve_bytes=8 * SLOT)
    assert (sized.slots_per_layer, sized.working_slots, sized.budget_bytes) == (12, 4, 100 * SLOT)
    assert sized.planned_bytes <= 100 * SLOT
    # never more than planned, however small the processes
    assert plan_after_baseline(plan, baseline_bytes=0, kv_reserve_bytes=0).slots_per_layer == 21
    with pytest.raises(ValueError) as caught:
        plan_after_baseline(plan, baseline_bytes=90 * SLOT, kv_reserve_bytes=8 * SLOT, parts="gpu_worker 1")
    message = str(caught.value)
    needed = 90 * SLOT + 8 * SLOT + 8 * SLOT
    assert f"memory budget {100 * SLOT} bytes cannot serve: the started processes use {90 * SLOT} bytes" in message
    assert "(gpu_worker 1)" in message and f"at least {needed}" in message
    # the room kept for the GPU worker's kernel compiler comes out of the slab, and is named
    with_compiler = plan_after_baseline(
        plan, baseline_bytes=40 * SLOT, kv_reserve_bytes=8 * SLOT, compiler_bytes=8 * SLOT
    )
    assert with_compiler.slots_per_layer == 10
    with pytest.raises(
        ValueError, match=f"the kernel compiler's {50 * SLOT} bytes.*at least {(40 + 8 + 50 + 8) * SLOT}"
    ):
        plan_after_baseline(plan, baseline_bytes=40 * SLOT, kv_reserve_bytes=8 * SLOT, compiler_bytes=50 * SLOT)


def _locate(layer: int, expert: int) -> ExpertResidencyLocation:
    return ExpertResidencyLocation(layer=layer, expert_id=expert, segments=(ExpertIOSegment(0, 0, SLOT, 0),))


def _manager_and_points(slab: Slab, offset: list[int]) -> tuple[ExpertResidencyManager, SafePoints, MeteredBackend]:
    inner = InMemoryBackend(slab.total_slots, slot_bytes=SLOT)
    meter = FootprintMeter(slab=slab, pids=dict, interval_s=0.0)
    backend = MeteredBackend(inner, slab=slab, timer=LoadTimer(), footprint=lambda: meter.footprint() + offset[0])
    plan = plan_expert_residency(
        budget_bytes=10 * SLOT, fixed_bytes=0, slot_bytes=SLOT, sparse_layers=2, working_slots=2
    )
    manager = ExpertResidencyManager(plan=plan, sparse_layer_ids=[0, 1], backend=backend, locate=_locate)
    points = SafePoints(manager=manager, backend=backend, meter=meter, ledger=None, tolerance=0, flush_interval_s=1.0)
    return manager, points, backend


async def _fill(manager: ExpertResidencyManager, slab: Slab) -> None:
    for layer in (0, 1):
        for pair in ((0, 1), (2, 3), (4, 5)):
            lease = await manager.acquire_block(layer, pair)
            for entry in lease.entries:  # what an I/O worker's read would have written
                view = slab.slot_view(entry.slot)
                view[:] = b"\3" * SLOT
                view.release()
            lease.release_fenced()


def test_limiting_a_layers_slots_disables_idle_ones_first_and_keeps_one():
    async def scenario():
        with Slab.create(total_slots=2 + 2 * 4, slot_bytes=SLOT) as slab:
            manager, _, _ = _manager_and_points(slab, [0])
            lease = await manager.acquire_block(0, (7,))  # layer 0: one ready slot among four
            lease.release_fenced()
            assert manager.limit_layer_slots(2) == 4  # two of each layer's four
            snapshot = manager.snapshot()
            assert snapshot.disabled == 4
            again = await manager.acquire_block(0, (7,))  # the ready one was kept: a hit
            assert [entry.hit for entry in again.entries] == [True]
            again.release_fenced()
            assert manager.limit_layer_slots(0) == 2  # at least one per layer stays
            assert manager.snapshot().disabled == 6

    asyncio.run(scenario())


def test_pressure_correction_evicts_frees_the_pages_and_reports_what_it_cannot_fix():
    async def scenario():
        with Slab.create(total_slots=2 + 2 * 4, slot_bytes=SLOT) as slab:
            offset = [0]
            manager, points, backend = _manager_and_points(slab, offset)
            await _fill(manager, slab)
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
    # 4 sparse layers x 48 experts of 400 KB: 78 MB of experts.
    return write_tiny_model(
        tmp_path_factory.mktemp("pressure"),
        family="qwen3_moe",
        num_hidden_layers=4,
        num_experts=48,
        moe_intermediate_size=512,
    )


def _slab_bytes(store: ExpertStore, per_layer: int) -> int:
    return (store.top_k + len(store.sparse_layers) * per_layer) * store.slot_bytes


@pytest.fixture(scope="module")
def calibration(model):
    """What the system's processes use once ready, and after a job (a start with plenty of room)."""
    store = ExpertStore.open(model)
    room = with_processes(store, store.dense_bytes + KV_RESERVE + _slab_bytes(store, 2), kv_reserve=KV_RESERVE)
    with start_test_system(model, **room, kv_reserve_bytes=KV_RESERVE) as system:
        health = system.health()
        done = run_job(system, max_tokens=32, return_logprobs=False).done
    assert health.baseline_bytes > store.dense_bytes and health.slots_per_layer == 2
    return dict(baseline=health.baseline_bytes, after_job=done.stats.processes_bytes)


@pytest.fixture(scope="module")
def baseline(calibration):
    return calibration["baseline"]


def _budget(store: ExpertStore, baseline: int, per_layer: int) -> int:
    return baseline + BASELINE_MARGIN + KV_RESERVE + jit_compiler_bytes() + _slab_bytes(store, per_layer)


def test_the_whole_system_stays_within_a_budget_just_above_its_processes(model, baseline, record_property):
    store = ExpertStore.open(model)
    budget = _budget(store, baseline, per_layer=3)
    experts = store.slot_bytes * store.experts_per_layer * len(store.sparse_layers)
    with start_test_system(model, memory_budget=budget, kv_reserve_bytes=KV_RESERVE, run_config=STRICT) as system:
        health = system.health()
        # the supervisor's plan bounded the slab by the dense weights only; sized, it holds what is left
        assert system.plan.slots_per_layer > 3 * 4
        assert (
            health.slots_per_layer
            == plan_after_baseline(
                system.plan,
                baseline_bytes=health.baseline_bytes,
                kv_reserve_bytes=KV_RESERVE,
                compiler_bytes=health.compiler_bytes,
            ).slots_per_layer
        )
        # 3 per layer, plus what the baseline's margin leaves when the processes are as measured before
        assert 3 <= health.slots_per_layer <= 3 + BASELINE_MARGIN // (store.slot_bytes * 4) + 1
        pids = tuple(system.pids.values())
        with FootprintWatch(None, f"/dev/shm{system.slab_name}", pids=pids, interval_s=0.01) as watch:
            done = run_job(system, max_tokens=32, return_logprobs=False).done
    stats = done.stats
    assert stats.misses > 0 and stats.generated_tokens > 0 and stats.pressure_evictions == 0
    assert experts >= 4 * _slab_bytes(store, health.slots_per_layer)  # the slab holds a small part of them
    # measured from outside: every process's PSS, the slab once; and what the coordinator sampled
    assert watch.samples > 10 and watch.peak <= budget, (watch.describe(), budget)
    assert stats.peak_footprint_bytes <= budget and stats.budget_bytes == budget
    assert stats.footprint_bytes == stats.processes_bytes + stats.slab_bytes
    assert stats.baseline_bytes == health.baseline_bytes
    assert stats.slab_bytes <= store.slot_bytes * (store.top_k + 4 * health.slots_per_layer)
    figures = dict(budget=budget, baseline=baseline, watch_peak=watch.peak, coordinator_peak=stats.peak_footprint_bytes)
    record_property("figures", figures)
    log.info("footprint figures: %s (%s)", figures, watch.describe())


def test_a_budget_the_processes_fill_is_refused_naming_them(model, baseline):
    store = ExpertStore.open(model)
    budget = baseline // 2  # above the dense weights and the slab's floor: the supervisor's plan accepts it
    with pytest.raises(LaunchError) as caught:
        start_test_system(model, memory_budget=budget, kv_reserve_bytes=KV_RESERVE)
    message = str(caught.value)
    assert f"memory budget {budget} bytes cannot serve: the started processes use" in message
    assert "gpu_worker" in message and "coordinator" in message and "io_worker_0" in message
    assert store.dense_bytes + KV_RESERVE + _slab_bytes(store, 1) < budget


def test_pressure_above_the_budget_is_corrected_by_evicting(model, calibration, caplog, record_property):
    caplog.set_level(logging.INFO)
    store = ExpertStore.open(model)
    per_layer = 8
    budget = _budget(store, calibration["baseline"], per_layer)
    full = calibration["after_job"] + _slab_bytes(store, per_layer)
    evictable = len(store.sparse_layers) * (per_layer - 1) * store.slot_bytes
    offset = max(0, budget - full) + evictable // 2  # about half of what can be evicted must go
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


def test_pressure_that_cannot_be_corrected_fails_the_job(model, baseline):
    store = ExpertStore.open(model)
    budget = _budget(store, baseline, per_layer=2)
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
