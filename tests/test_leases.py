"""The lease service against the real residency manager over InMemoryBackend (no processes).

Waves, the piggybacked fence, per-job statistics, a lost GPU worker, and every
refusal leaving the state exactly as it was; then the test hooks around a
backend that writes real bytes into a real slab.
"""

from __future__ import annotations

import numpy as np
import pytest

from coordinator import leases as leases_module
from coordinator.fence_checks import SCRIBBLE, FenceCheckedBackend, with_fence_checks
from coordinator.leases import LOAD_FAILED, LeaseService
from coordinator.memory_backend import InMemoryBackend
from coordinator.metered_backend import LoadTimer, MeteredBackend
from coordinator.prefetch import PrefetchBook, PrefetchTelemetry
from coordinator.prefetch_trial import StepTrial
from coordinator.residency import ExpertResidencyManager
from coordinator.stats import prefetch_fields
from coordinator.usage import ExpertUsageLedger
from shared.gpu_messages import COORDINATOR_ACCEPTS_FROM_GPU, Fence, Fenced, Lease, Prefetch, RouteMatrix, Routes
from shared.plan import plan_expert_residency
from shared.protocol import BAD_REQUEST, ErrorReply, decode, encode
from shared.segments import ExpertIOSegment, ExpertResidencyLocation
from shared.slab import Slab
from tests.helpers.residency import run_async

LAYERS = (1, 3)
EXPERTS = 8


def locate(layer: int, expert: int) -> ExpertResidencyLocation:
    return ExpertResidencyLocation(
        layer, expert, (ExpertIOSegment(file=0, offset=(layer * 100 + expert) * 64, length=64, destination=0),)
    )


def make(*, working=2, per_layer=1, backend=None, usage=None, prefetch="off", book=None, timer=None):
    plan = plan_expert_residency(
        budget_bytes=10**9,
        fixed_bytes=0,
        slot_bytes=1,
        sparse_layers=len(LAYERS),
        working_slots=working,
        max_slots_per_layer=per_layer,
    )
    backend = backend if backend is not None else InMemoryBackend(plan.total_slots)
    manager = ExpertResidencyManager(
        plan=plan,
        sparse_layer_ids=LAYERS,
        backend=backend,
        locate=locate,
        usage=usage,
        prefetch=book if book is not None else PrefetchBook(mode=prefetch),
    )
    return LeaseService(manager=manager, experts_per_layer=EXPERTS, timer=timer), manager, backend


def routes(layer, rows, fence=None) -> Routes:
    message = Routes(layer=layer, routes=RouteMatrix(np.array(rows, dtype=np.int32)), fence=fence)
    return decode(encode(message), COORDINATOR_ACCEPTS_FROM_GPU)  # as it arrives over the wire


def state(service, manager, backend, usage=None):
    """Everything a refused request must leave untouched."""
    snapshot = manager.snapshot()
    slots = tuple(backend.state(slot) for slot in range(backend.slots))
    resident = tuple((e.slot, e.layer, e.expert_id) for e in manager.residency_map())
    counts = usage.snapshot() if usage is not None else None
    return service.held, snapshot, slots, resident, manager.active, counts


# ---------------------------------------------------------------------------------------------
# Waves and fences


@run_async
async def test_single_wave_lease_and_fence():
    service, manager, backend = make()
    lease = await service.handle(routes(1, [[0, 5]]))
    assert isinstance(lease, Lease)
    assert (lease.layer, lease.wave, lease.waves, lease.experts, lease.hits) == (1, 0, 1, (0, 5), 0)
    assert len(set(lease.slots)) == 2 and all(g > 0 for g in lease.generations)
    assert all(backend.state(slot) == ("leased", g) for slot, g in zip(lease.slots, lease.generations))
    assert service.held == lease.lease_id and manager.active
    fenced = await service.handle(Fence(lease_id=lease.lease_id))
    assert fenced == Fenced(lease_id=lease.lease_id)
    assert service.held is None and not manager.active and manager.snapshot().leased == 0


@run_async
async def test_waves_in_first_seen_order_and_fence_next():
    service, manager, backend = make(working=2)
    # unique, row-major then rank-major: 4, 1, 2, 6, 0 -> waves [4, 1] [2, 6] [0]
    first = await service.handle(routes(3, [[4, 1], [2, 4], [6, 0], [1, 2]]))
    assert (first.wave, first.waves, first.experts) == (0, 3, (4, 1))
    second = await service.handle(Fence(lease_id=first.lease_id, next=True))
    assert isinstance(second, Lease) and second.lease_id > first.lease_id
    assert (second.layer, second.wave, second.waves, second.experts) == (3, 1, 3, (2, 6))
    # wave 0's slots were released: only wave 1's are leased
    assert manager.snapshot().leased == 2
    third = await service.handle(Fence(lease_id=second.lease_id, next=True))
    assert (third.wave, third.experts) == (2, (0,))
    # next=True on the last wave is refused, and the lease stays held
    before = state(service, manager, backend)
    refused = await service.handle(Fence(lease_id=third.lease_id, next=True))
    assert isinstance(refused, ErrorReply) and refused.code == BAD_REQUEST
    assert "wave 2 is the last of 3 of layer 3" in refused.message
    assert state(service, manager, backend) == before
    assert await service.handle(Fence(lease_id=third.lease_id)) == Fenced(lease_id=third.lease_id)
    assert manager.snapshot().leased == 0


@run_async
async def test_piggybacked_fence_releases_then_leases():
    service, manager, _ = make()
    first = await service.handle(routes(1, [[0, 1]]))
    second = await service.handle(routes(3, [[2, 3]], fence=first.lease_id))
    assert isinstance(second, Lease) and second.layer == 3
    assert service.held == second.lease_id
    assert manager.snapshot().leased == 2  # first's slots were released
    # a repeat of layer 1's experts: one of them stayed resident (one slot per layer)
    third = await service.handle(routes(1, [[0, 1]], fence=second.lease_id))
    assert third.hits == 1
    await service.handle(Fence(lease_id=third.lease_id))
    assert manager.snapshot().leased == 0


@run_async
async def test_every_selection_is_recorded_before_dedup(tmp_path):
    usage = ExpertUsageLedger(tmp_path / "usage", layers=LAYERS, experts_per_layer=EXPERTS)
    service, _, _ = make(usage=usage)
    lease = await service.handle(routes(1, [[0, 1], [1, 0], [1, 2]]))
    await service.handle(Fence(lease_id=lease.lease_id, next=True))
    assert usage.snapshot().route_selections == 6
    assert usage.entry(1, 1).count == 3 and usage.entry(1, 0).count == 2 and usage.entry(1, 2).count == 1


# ---------------------------------------------------------------------------------------------
# Refusals: an error naming the value, and nothing changed


@run_async
async def test_refusals_leave_state_unchanged(tmp_path):
    usage = ExpertUsageLedger(tmp_path / "usage", layers=LAYERS, experts_per_layer=EXPERTS)
    service, manager, backend = make(usage=usage)

    async def refused(message, *needles):
        before = state(service, manager, backend, usage)
        reply = await service.handle(message)
        assert isinstance(reply, ErrorReply), reply
        assert reply.code == BAD_REQUEST
        for needle in needles:
            assert needle in reply.message, reply.message
        assert state(service, manager, backend, usage) == before

    # nothing held yet
    await refused(Fence(lease_id=7), "fence of lease 7", "no lease is held")
    await refused(routes(1, [[0]], fence=3), "piggyback fence of lease 3", "no lease is held")
    await refused(routes(2, [[0, 1]]), "layer 2", "not a sparse layer", "[1, 3]")
    await refused(routes(1, [[0, 1], [3, 8]]), "row 1 rank 1 names expert 8", "0..7")

    lease = await service.handle(routes(1, [[0, 1], [2, 3]]))  # two waves
    assert lease.waves == 2
    await refused(routes(3, [[0, 1]]), f"while lease {lease.lease_id}", "still held")
    await refused(
        routes(3, [[0, 1]], fence=lease.lease_id + 5),
        f"fence of lease {lease.lease_id + 5}",
        f"the held lease is {lease.lease_id}",
    )
    await refused(Fence(lease_id=lease.lease_id + 1), f"fence of lease {lease.lease_id + 1}")
    await refused(routes(1, [[9, 0]], fence=lease.lease_id), "names expert 9")
    await refused(routes(0, [[0]], fence=lease.lease_id), "layer 0", "not a sparse layer")

    second = await service.handle(Fence(lease_id=lease.lease_id, next=True))
    assert second.wave == 1
    await refused(
        Fence(lease_id=lease.lease_id), f"fence of lease {lease.lease_id}", f"the held lease is {second.lease_id}"
    )
    await refused(Fence(lease_id=second.lease_id, next=True), "is the last of 2")
    assert await service.handle(Fence(lease_id=second.lease_id)) == Fenced(lease_id=second.lease_id)
    # already released
    await refused(Fence(lease_id=second.lease_id), f"fence of lease {second.lease_id}", "no lease is held")
    # and the service still works
    again = await service.handle(routes(3, [[5, 6]]))
    assert isinstance(again, Lease)
    assert usage.snapshot().route_selections == 6


@run_async
async def test_load_failure_is_an_error_and_the_service_recovers():
    service, manager, backend = make()
    backend.fail_load(lambda slot, segments: segments[0].offset == (1 * 100 + 5) * 64)
    reply = await service.handle(routes(1, [[0, 5]]))
    assert isinstance(reply, ErrorReply) and reply.code == LOAD_FAILED
    assert "layer 1 wave 0" in reply.message and "injected read failure" in reply.message
    assert service.held is None and not manager.active and manager.snapshot().leased == 0
    lease = await service.handle(routes(1, [[0, 5]]))
    assert isinstance(lease, Lease) and lease.experts == (0, 5)


@run_async
async def test_lost_worker_lease_is_released_on_its_behalf():
    service, manager, backend = make()
    lease = await service.handle(routes(1, [[0, 1]]))
    assert service.release_for_lost_worker("test") == lease.lease_id
    assert service.held is None and not manager.active and manager.snapshot().leased == 0
    assert all(backend.state(slot)[0] != "leased" for slot in lease.slots)
    assert service.release_for_lost_worker("again") is None
    reply = await service.handle(Fence(lease_id=lease.lease_id))
    assert isinstance(reply, ErrorReply)
    assert isinstance(await service.handle(routes(1, [[0, 1]])), Lease)


# ---------------------------------------------------------------------------------------------
# Per-job statistics


@run_async
async def test_job_stats():
    service, _manager, _ = make(working=2, per_layer=1)
    service.begin_job()
    held = None
    for step in range(4):  # decode-like: one row, alternating experts of layer 1
        pair = [[0, 1]] if step % 2 == 0 else [[0, 2]]
        lease = await service.handle(routes(1, pair, fence=held))
        held = lease.lease_id
    await service.handle(Fence(lease_id=held))
    stats = service.end_job()
    assert stats.visits == 4 and stats.waves == 4 and stats.abandoned_waves == 0
    assert stats.hits + stats.misses == 8 and stats.misses > 0 and stats.evictions > 0
    assert stats.loads == stats.misses and stats.bytes_read == 64 * stats.loads
    assert 0 <= stats.all_resident < 1 and stats.disk_p99_ms >= stats.disk_p50_ms >= 0
    # the next job starts from zero
    service.begin_job()
    assert service.end_job().visits == 0


@run_async
async def test_decode_waves_load_timings_stand_apart_from_the_prompts():
    """The service tells the timer each wave's phase: a prompt's loads (several route rows) count
    among all loads only, a decode step's (one row) also among decode's own."""
    timer = LoadTimer()
    inner = InMemoryBackend(6)
    service, _manager, _ = make(
        working=2, per_layer=2, timer=timer, backend=MeteredBackend(inner, slab=None, timer=timer, footprint=lambda: 0)
    )
    prompt = await service.handle(routes(1, [[0, 1], [2, 3]]))  # 4 misses in two waves of 2
    second = await service.handle(Fence(lease_id=prompt.lease_id, next=True))
    await service.handle(Fence(lease_id=second.lease_id))
    after_prompt = timer.take()
    assert (len(after_prompt.disk), len(after_prompt.wait)) == (4, 2)
    assert after_prompt.decode_disk == after_prompt.decode_wait == ()
    step = await service.handle(routes(3, [[5, 6]]))  # a decode step: one row, 2 misses, one wave
    await service.handle(Fence(lease_id=step.lease_id))
    held = await service.handle(routes(3, [[5, 6]]))  # all hits: no load, no wave to time
    await service.handle(Fence(lease_id=held.lease_id))
    decode = timer.take()
    assert (len(decode.disk), len(decode.wait)) == (2, 1)
    assert decode.decode_disk == decode.disk and decode.decode_wait == decode.wait
    assert all(ms >= 0 for ms in decode.disk + decode.wait)


@run_async
async def test_decode_misses_leave_out_the_prompts_visits():
    """Prefetch recall is counted against decode visits' misses alone: prefill is never predicted,
    and its misses (every expert a prompt routes to) would drown the figure."""
    service, _manager, _ = make(working=4, per_layer=4)
    service.begin_job()
    lease = await service.handle(routes(1, [[0, 1], [2, 3]]))  # a prompt of two tokens: 4 misses
    lease = await service.handle(routes(1, [[4, 0]], fence=lease.lease_id))  # a decode step: 0 is resident, 4 is read
    assert lease.hits == 1
    await service.handle(Fence(lease_id=lease.lease_id))
    stats = service.end_job()
    assert (stats.misses, stats.decode_misses) == (5, 1)
    assert prefetch_fields(PrefetchTelemetry(useful=3, issued=4), stats.decode_misses)["prefetch_recall"] == 0.75


@run_async
async def test_all_resident_fraction():
    service, _, _ = make(working=2, per_layer=4)
    service.begin_job()
    lease = await service.handle(routes(1, [[0, 1]]))
    await service.handle(Fence(lease_id=lease.lease_id))
    for _ in range(3):
        lease = await service.handle(routes(1, [[1, 0]]))
        assert lease.hits == 2
        await service.handle(Fence(lease_id=lease.lease_id))
    stats = service.end_job()
    assert stats.visits == 4 and stats.all_resident == pytest.approx(0.75)


# ---------------------------------------------------------------------------------------------
# Test hooks around a backend that writes real bytes


class SlabBackend(InMemoryBackend):
    """InMemoryBackend whose loads write a pattern of (slot, generation) into a real slab."""

    def __init__(self, slab: Slab) -> None:
        super().__init__(slab.total_slots, slot_bytes=slab.slot_bytes)
        self.slab = slab

    def submit_segments(self, slot, generation, segments):
        super().submit_segments(slot, generation, segments)
        view = self.slab.slot_view(slot)
        view[:] = bytes([(slot * 31 + generation) % 251]) * len(view)
        view.release()


def slot_bytes(slab: Slab, slot: int) -> bytes:
    view = slab.slot_view(slot)
    try:
        return bytes(view)
    finally:
        view.release()


@pytest.fixture
def slab():
    plan = plan_expert_residency(
        budget_bytes=10**9, fixed_bytes=0, slot_bytes=1, sparse_layers=2, working_slots=2, max_slots_per_layer=1
    )
    with Slab.create(total_slots=plan.total_slots, slot_bytes=16384) as created:
        yield created


@run_async
async def test_scribble_and_verify_hooks(slab):
    hooked = with_fence_checks(SlabBackend(slab), ("scribble_fenced", "verify_fenced"), slab=slab)
    assert isinstance(hooked, FenceCheckedBackend)
    service, _manager, _ = make(backend=hooked)
    lease = await service.handle(routes(1, [[0, 1]]))
    real = {slot: slot_bytes(slab, slot) for slot in lease.slots}
    await service.handle(Fence(lease_id=lease.lease_id))
    for slot in lease.slots:  # fenced: garbage now
        assert slot_bytes(slab, slot) == bytes([SCRIBBLE]) * slab.slot_bytes
    assert hooked.scribbles == 2 and hooked.verified == 2 and hooked.violations == 0
    # expert 0 or 1 stayed resident in layer 1's slot: leasing it again restores its bytes
    again = await service.handle(routes(1, [[1, 0]]))
    assert again.hits == 1
    kept = [
        (slot, gen)
        for slot, gen in zip(again.slots, again.generations)
        if (slot, gen) in set(zip(lease.slots, lease.generations))
    ]
    assert len(kept) == 1
    assert slot_bytes(slab, kept[0][0]) == real[kept[0][0]]
    assert hooked.restores == 1
    await service.handle(Fence(lease_id=again.lease_id))
    assert hooked.violations == 0

    # someone writes a leased slot: verify_fenced sees it at the fence
    third = await service.handle(routes(3, [[4, 5]]))
    view = slab.slot_view(third.slots[0])
    view[100] ^= 0x5A
    view.release()
    await service.handle(Fence(lease_id=third.lease_id))
    assert hooked.violations == 1 and "changed while it was leased" in hooked.messages[0]


def test_no_hooks_is_the_backend_itself(slab):
    backend = InMemoryBackend(slab.total_slots)
    assert with_fence_checks(backend, (), slab=slab) is backend
    with pytest.raises(ValueError, match="unknown test hook"):
        with_fence_checks(backend, ("scribble_everything",), slab=slab)


# ---------------------------------------------------------------------------------------------
# Predictions riding on routes, and the first layer's prefetch


def _predicting(layer, rows, *, fence=None, prefetch_layer=None, prefetch=()) -> Routes:
    message = Routes(
        layer=layer,
        routes=RouteMatrix(np.array(rows, dtype=np.int32)),
        fence=fence,
        prefetch_layer=prefetch_layer,
        prefetch=tuple(prefetch),
    )
    return decode(encode(message), COORDINATOR_ACCEPTS_FROM_GPU)


@pytest.mark.parametrize(
    ("prefetch_layer", "prefetch", "needle"),
    [
        (None, (1, 2), "predict experts [1, 2] but name no prefetch_layer"),
        (2, (1,), "prefetch layer 2 is not another sparse layer"),
        (1, (1,), "prefetch layer 1 is not another sparse layer"),
        (3, (1, 8), "prefetch [1, 8] must name distinct experts 0..7"),
        (3, (4, 4), "prefetch [4, 4] must name distinct experts 0..7"),
    ],
)
@run_async
async def test_a_bad_prediction_refuses_its_routes_and_changes_nothing(prefetch_layer, prefetch, needle):
    service, manager, backend = make(per_layer=2)
    before = state(service, manager, backend)
    reply = await service.handle(_predicting(1, [[0, 5]], prefetch_layer=prefetch_layer, prefetch=prefetch))
    assert isinstance(reply, ErrorReply) and reply.code == BAD_REQUEST and needle in reply.message, reply
    assert state(service, manager, backend) == before


@run_async
async def test_a_prediction_is_read_after_the_lease_and_never_for_a_layer_this_step_visited():
    service, manager, _ = make(per_layer=2, prefetch="on")
    message = _predicting(1, [[0, 5]], prefetch_layer=3, prefetch=(6, 7))
    lease = await service.handle(message)
    assert isinstance(lease, Lease) and (3, 6) not in manager._lookup  # nothing read before the reply
    assert service.prefetch(message) == 2
    await manager.settle_prefetch()
    following = await service.handle(_predicting(3, [[6, 2]], fence=lease.lease_id, prefetch_layer=1, prefetch=(4,)))
    assert isinstance(following, Lease) and following.hits == 1  # 6 was prefetched; 2 was not
    assert service.prefetch(_predicting(3, [[6, 2]], prefetch_layer=1, prefetch=(4,))) == 0  # layer 1: visited
    fenced = await service.handle(Fence(lease_id=following.lease_id))
    assert isinstance(fenced, Fenced)
    assert service.prefetch(Prefetch(layer=1, experts=(4,))) == 1  # the next step: layer 1 is not visited yet
    await manager.settle_prefetch()
    assert manager.prefetch_book.drain().useful == 1


@run_async
async def test_a_bad_first_layer_prefetch_is_ignored_with_a_warning_naming_it(caplog):
    """A `prefetch` message is never answered (the worker waits for no reply): a bad one is
    logged with the offending value, counted as refused, and changes nothing."""
    service, manager, backend = make(per_layer=2)
    before = state(service, manager, backend)
    for message, needle in (
        (Prefetch(layer=2, experts=(1,)), "prefetch layer 2 is not another sparse layer"),
        (Prefetch(layer=1, experts=(9,)), "prefetch [9] must name distinct experts 0..7"),
    ):
        caplog.clear()
        with caplog.at_level("WARNING", logger="coordinator.leases"):
            assert service.prefetch(message) == 0
        assert any(needle in record.getMessage() for record in caplog.records), caplog.text
    assert state(service, manager, backend) == before
    assert service.end_job().refused == 2


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


async def _step(service, rows, clock, ms, *, predict=True):
    """One forward step over both layers, predicting layer 3 from layer 1; it takes `ms`."""
    message = _predicting(1, rows, prefetch_layer=3 if predict else None, prefetch=(6, 7) if predict else ())
    lease = await service.handle(message)
    issued = service.prefetch(message)
    following = await service.handle(_predicting(3, rows, fence=lease.lease_id))
    assert isinstance(await service.handle(Fence(lease_id=following.lease_id)), Fenced)
    clock.now += ms / 1e3
    return issued


@run_async
async def test_auto_times_decode_steps_and_pauses_prefetch_when_they_are_faster_without_it(monkeypatch):
    """The first layer's routes of a one-row step start a decode step for auto's trial; a prefill
    step (several rows) and a job's edges interrupt it; a paused trial issues no prefetch."""
    clock = _Clock()
    monkeypatch.setattr(leases_module, "time", clock)
    book = PrefetchBook(mode="auto", trial=StepTrial(epoch_steps=2, trial_epochs=2, recheck_steps=50))
    service, manager, _ = make(per_layer=2, book=book)
    service.begin_job()
    await _step(service, [[0, 5], [1, 2]], clock, 5000)  # prefill: not a decode step, not timed
    issued = []
    for _ in range(11):  # a warm-up epoch, two epochs a side, and the step that closes the last
        side = book.trial.prefetching
        issued.append(await _step(service, [[0, 5]], clock, 30 if side else 10))
        await manager.settle_prefetch()
    assert issued[0] == 2 and book.trial.state == "off" and not book.enabled(3)
    assert await _step(service, [[0, 5]], clock, 10) == 0  # paused: the prediction is not read
    service.end_job()
    telemetry = book.drain()
    assert telemetry.paused and telemetry.steps_without == 4 + 2  # two trial epochs, then the pause
