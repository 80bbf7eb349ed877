"""Unit tests of ExpertResidencyManager / ExpertBatchLease over InMemoryBackend.

Every scenario is small enough to follow by hand: slot ids are laid out
working bank first, then each sparse layer's slots, then the pinned slots;
roles move between ids, bytes never move. No pytest-asyncio: each async test
body runs under its own `asyncio.run` (see `run_async`).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from coordinator.memory_backend import BackendProtocolError, InMemoryBackend
from coordinator.residency import ExpertResidencyManager
from coordinator.residency_types import (
    ExpertBatchLease,
    ExpertRepinEvent,
    ExpertResidencyLeaseEntry,
    ResidencyError,
    ResidencyPressureError,
    StaleLeaseError,
)
from coordinator.usage import ExpertLfruCandidate, ExpertUsageLedger
from shared.plan import plan_expert_residency
from shared.segments import ExpertIOHintSegment, ExpertIOSegment, ExpertResidencyLocation
from tests.helpers.residency import one_byte_plan, run_async


def seg_bytes(expert: int) -> int:
    return 10 + expert + 1


def locate(layer: int, expert: int) -> ExpertResidencyLocation:
    """Two segments per expert; the first one's offset encodes (layer, expert)."""
    return ExpertResidencyLocation(
        layer,
        expert,
        (
            ExpertIOSegment(file=layer, offset=expert * 1000, length=10, destination=0),
            ExpertIOSegment(file=layer, offset=expert * 1000 + 10, length=expert + 1, destination=10),
        ),
    )


def failing(layer: int, expert: int):
    """fail_load predicate matching the load of (layer, expert)."""
    return lambda slot, segments: segments[0].file == layer and segments[0].offset == expert * 1000


def make(
    *,
    layers=(0,),
    working=2,
    per_layer=2,
    pins=(),
    manual=False,
    hint_capacity=None,
    backend=None,
    backend_slot_bytes=1,
    locator=locate,
    usage=None,
    observer=None,
    record_history=False,
):
    plan = one_byte_plan(layers=layers, working=working, per_layer=per_layer, pins=len(pins))
    if backend is None:
        backend = InMemoryBackend(
            plan.total_slots,
            slot_bytes=backend_slot_bytes,
            manual=manual,
            hint_capacity=hint_capacity,
            record_history=record_history,
        )
    manager = ExpertResidencyManager(
        plan=plan,
        sparse_layer_ids=list(layers),
        backend=backend,
        locate=locator,
        pinned=list(pins),
        usage=usage,
        route_observer=observer,
    )
    return manager, backend


def resident(manager) -> dict[tuple[int, int], tuple[int, str]]:
    """(layer, expert) -> (slot, tier) of every ready resident/pinned expert."""
    return {(e.layer, e.expert_id): (e.slot, e.tier) for e in manager.residency_map()}


def states(backend, slots) -> list[str]:
    return [backend.state(slot)[0] for slot in slots]


async def wave(manager, layer, ids, **kwargs):
    lease = await manager.acquire_block(layer, ids, **kwargs)
    lease.release_fenced()
    return lease


def entry_summary(lease):
    return [(e.expert_id, e.slot, e.generation, e.hit) for e in lease.entries]


# -- construction --------------------------------------------------------------


def test_initial_layout_and_snapshot() -> None:
    manager, _backend = make(layers=(3, 1), working=2, per_layer=2, pins=((1, 4),))
    assert manager.sparse_layer_ids == (3, 1)
    assert manager.pinned == ((1, 4),)
    assert manager.active is False
    snap = manager.snapshot()
    assert (snap.working, snap.resident, snap.pinned, snap.disabled) == (2, 4, 1, 0)
    assert (snap.loading, snap.leased, snap.clock, snap.generation) == (0, 0, 0, 0)
    assert (snap.hits, snap.misses, snap.evictions, snap.pressure_evictions, snap.repin_swaps) == (0, 0, 0, 0, 0)
    assert snap.physical_footprint == 0 and snap.budget_bytes == 7
    assert manager.snapshot(123).physical_footprint == 123
    assert manager.residency_map() == []


def test_constructor_validation() -> None:
    plan = plan_expert_residency(
        budget_bytes=6, fixed_bytes=0, slot_bytes=1, sparse_layers=2, working_slots=1, pinned_experts=1
    )
    assert plan.total_slots == 6  # 1 working + 1 pinned + 2 x 2
    backend = InMemoryBackend(plan.total_slots)

    def build(**overrides):
        arguments = dict(plan=plan, sparse_layer_ids=[0, 1], backend=backend, locate=locate, pinned=[(0, 3)])
        arguments.update(overrides)
        return ExpertResidencyManager(**arguments)

    build()
    with pytest.raises(TypeError, match="plan must be an ExpertResidencyPlan"):
        build(plan={"total_slots": 6})
    with pytest.raises(ValueError, match=r"each of the plan's 2 sparse layers exactly once, got \[0\]"):
        build(sparse_layer_ids=[0])
    with pytest.raises(ValueError, match="exactly once"):
        build(sparse_layer_ids=[0, 1, 2])
    with pytest.raises(ValueError, match=r"exactly once, got \[1, 1\]"):
        build(sparse_layer_ids=[1, 1])
    with pytest.raises(TypeError, match="sparse layer id"):
        build(sparse_layer_ids=[0, 1.0])
    with pytest.raises(ValueError, match="sparse layer id"):
        build(sparse_layer_ids=[0, -1])
    with pytest.raises(ValueError, match=r"^expert backend has 7 slots; plan requires 6$"):
        build(backend=InMemoryBackend(7))
    with pytest.raises(ValueError, match=r"^expert pinned set has 0 entries; plan reserves 1$"):
        build(pinned=None)
    with pytest.raises(ValueError, match=r"^expert pinned set has 2 entries; plan reserves 1$"):
        build(pinned=[(0, 3), (1, 3)])
    with pytest.raises(ValueError, match="not in a sparse layer"):
        build(pinned=[(5, 3)])
    with pytest.raises(TypeError, match="pinned expert id"):
        build(pinned=[(0, "3")])
    with pytest.raises(ValueError, match="pinned layer"):
        build(pinned=[(-1, 3)])


def test_duplicate_pins_refused() -> None:
    plan = plan_expert_residency(
        budget_bytes=5, fixed_bytes=0, slot_bytes=1, sparse_layers=1, working_slots=1, pinned_experts=2
    )
    with pytest.raises(ValueError, match=r"^duplicate pinned expert 0:3$"):
        ExpertResidencyManager(
            plan=plan,
            sparse_layer_ids=[0],
            backend=InMemoryBackend(plan.total_slots),
            locate=locate,
            pinned=[(0, 3), (0, 3)],
        )


# -- acquire: the happy paths --------------------------------------------------


@run_async
async def test_first_acquire_loads_misses_into_the_working_bank_in_request_order() -> None:
    manager, backend = make(working=3, per_layer=3)
    lease = await manager.acquire_block(0, [7, 2, 5])
    assert isinstance(lease, ExpertBatchLease) and not lease.released
    assert entry_summary(lease) == [(7, 0, 1, False), (2, 1, 2, False), (5, 2, 3, False)]
    assert all(entry.layer == 0 for entry in lease.entries)
    assert states(backend, [0, 1, 2]) == ["leased"] * 3
    assert manager.active is True
    snap = manager.snapshot()
    assert (snap.leased, snap.loading, snap.generation, snap.clock, snap.misses, snap.hits) == (3, 0, 3, 3, 3, 0)
    assert backend.counters.submits == 3 and backend.counters.leases == 3
    # Leased slots are not in the residency map until released.
    assert manager.residency_map() == []
    lease.release_fenced()
    assert lease.released and manager.active is False
    assert manager.snapshot().leased == 0


@run_async
async def test_hits_and_misses_entries_follow_the_request_order() -> None:
    manager, _backend = make(working=4, per_layer=3)
    await wave(manager, 0, [4, 6])
    lease = await manager.acquire_block(0, [9, 6, 1, 4])
    assert [(e.expert_id, e.hit) for e in lease.entries] == [(9, False), (6, True), (1, False), (4, True)]
    # Hits are leased first (clock 3, 4 for 6 then 4), misses after their loads complete.
    lease.release_fenced()
    snap = manager.snapshot()
    assert (snap.hits, snap.misses, snap.clock, snap.generation) == (2, 4, 6, 4)


@run_async
async def test_numpy_ids_are_accepted_and_normalized() -> None:
    manager, _ = make()
    lease = await manager.acquire_block(np.int64(0), np.array([3, 1], dtype=np.int32))
    assert [type(e.expert_id) for e in lease.entries] == [int, int]
    assert [e.expert_id for e in lease.entries] == [3, 1]
    lease.release_fenced()


@run_async
async def test_empty_wave_is_a_no_op_lease() -> None:
    manager, backend = make()
    seen = []
    lease = await manager.acquire_block(0, [], seen.append)
    assert lease.entries == () and manager.active
    assert seen == [()]
    lease.release_fenced()
    assert not manager.active
    telemetry = manager.drain_demand_telemetry()
    assert telemetry.foreground_wait.count == 0 and telemetry.loads == 0
    assert backend.counters.submits == 0


@pytest.mark.parametrize("asynchronous", [False, True])
@run_async
async def test_before_miss_submit_sees_exactly_the_leased_hits(asynchronous: bool) -> None:
    manager, backend = make(working=4, per_layer=3)
    await wave(manager, 0, [1, 2])
    slot_of = {expert: slot for (_, expert), (slot, _) in resident(manager).items()}
    submits_before = backend.counters.submits
    seen = []

    def observe(hits):
        seen.append(
            (
                hits,
                [backend.state(e.slot)[0] for e in hits],
                backend.counters.submits - submits_before,
                manager.active,
            )
        )

    if asynchronous:

        async def callback(hits):
            await asyncio.sleep(0)
            observe(hits)
    else:
        callback = observe

    lease = await manager.acquire_block(0, [3, 2, 4, 1], callback)
    ((hits, hit_states, submitted, active),) = seen
    assert isinstance(hits, tuple)
    assert [(e.expert_id, e.slot, e.hit) for e in hits] == [(2, slot_of[2], True), (1, slot_of[1], True)]
    assert hit_states == ["leased", "leased"]
    assert submitted == 0 and active
    assert [e.expert_id for e in lease.entries] == [3, 2, 4, 1]
    lease.release_fenced()


@run_async
async def test_before_miss_submit_called_even_with_no_misses() -> None:
    manager, _backend = make()
    await wave(manager, 0, [1])
    seen = []
    lease = await manager.acquire_block(0, [1], seen.append)
    assert [[e.expert_id for e in hits] for hits in seen] == [[1]]
    assert lease.entries[0].hit
    lease.release_fenced()


@run_async
async def test_promotion_keeps_bytes_in_place_and_swaps_roles() -> None:
    # Slots: 0, 1 working; 2, 3 layer 0.
    manager, backend = make(working=2, per_layer=2)
    lease = await wave(manager, 0, [1, 2])
    assert entry_summary(lease) == [(1, 0, 1, False), (2, 1, 2, False)]
    # Misses promote in reverse: expert 2 (slot 1) takes idle victim 2, expert 1 takes 3;
    # the loaded slots become the layer's, the victims join the working bank.
    assert resident(manager) == {(0, 1): (0, "resident"), (0, 2): (1, "resident")}
    assert states(backend, range(4)) == ["ready", "ready", "idle", "idle"]
    assert manager.snapshot().evictions == 0
    assert backend.counters.discards == 0
    # Misses now land in the lowest-id working slot: 2, then 3.
    lease = await manager.acquire_block(0, [8, 9])
    assert [(e.expert_id, e.slot) for e in lease.entries] == [(8, 2), (9, 3)]
    lease.release_fenced()


@run_async
async def test_lru_victim_is_least_recent_ready_slot_and_eviction_counted() -> None:
    manager, backend = make(working=1, per_layer=2)
    await wave(manager, 0, [1])  # slot 0, clock 1
    await wave(manager, 0, [2])  # slot 1 (the idle victim of wave 1), clock 2
    assert resident(manager) == {(0, 1): (0, "resident"), (0, 2): (1, "resident")}
    await wave(manager, 0, [1])  # hit: expert 1 becomes most recent (clock 3)
    lease = await wave(manager, 0, [3])
    assert lease.entries[0].slot == 2  # the only working slot now
    # Least recent is expert 2 (clock 2), evicted; expert 3 keeps slot 2.
    assert resident(manager) == {(0, 1): (0, "resident"), (0, 3): (2, "resident")}
    snap = manager.snapshot()
    assert snap.evictions == 1 and (snap.hits, snap.misses) == (1, 3)
    assert backend.state(1)[0] == "idle"  # the victim's bytes were discarded


@run_async
async def test_protected_slots_of_the_same_wave_are_never_victims() -> None:
    manager, backend = make(working=3, per_layer=2)
    await wave(manager, 0, [1, 2])  # experts 1, 2 fill both layer slots (0, 1)
    lease = await manager.acquire_block(0, [1, 5, 6])
    hit_slot = lease.entries[0].slot
    lease.release_fenced()
    # Reverse order: 6 evicts the unprotected expert 2; 5 finds only protected slots
    # (the hit 1 and the just-promoted 6), so it is discarded, not promoted.
    assert resident(manager) == {(0, 1): (hit_slot, "resident"), (0, 6): (lease.entries[2].slot, "resident")}
    assert backend.state(lease.entries[1].slot)[0] == "idle"
    assert manager.snapshot().evictions == 1
    assert manager.snapshot().working == 3


@run_async
async def test_miss_discarded_when_the_only_layer_slot_is_a_hit_in_the_wave() -> None:
    manager, backend = make(working=2, per_layer=1)
    await wave(manager, 0, [1])
    before = resident(manager)
    lease = await manager.acquire_block(0, [1, 2])
    miss_slot = lease.entries[1].slot
    lease.release_fenced()
    assert resident(manager) == before
    assert backend.state(miss_slot)[0] == "idle"
    assert manager.snapshot().evictions == 0 and manager.snapshot().working == 2


@run_async
async def test_layers_are_independent() -> None:
    manager, _backend = make(layers=(2, 5), working=2, per_layer=1)
    await wave(manager, 2, [1])
    await wave(manager, 5, [1])
    assert set(resident(manager)) == {(2, 1), (5, 1)}
    lease = await manager.acquire_block(5, [1])
    assert lease.entries[0].hit and lease.entries[0].layer == 5
    lease.release_fenced()


@run_async
async def test_pinned_expert_promoted_into_an_idle_pinned_slot() -> None:
    # Slots: 0, 1 working; 2, 3 layer 0; 4 pinned.
    manager, _backend = make(working=2, per_layer=2, pins=((0, 7),))
    lease = await wave(manager, 0, [7, 1])
    assert resident(manager) == {(0, 7): (0, "pinned"), (0, 1): (1, "resident")}
    snap = manager.snapshot()
    assert (snap.working, snap.resident, snap.pinned) == (2, 2, 1)
    # The idle pinned slot 4 and layer slot 2 joined the working bank.
    lease = await manager.acquire_block(0, [8, 9])
    assert sorted(e.slot for e in lease.entries) == [2, 4]
    lease.release_fenced()
    # The pinned expert is never an LRU victim: it hits forever.
    lease = await manager.acquire_block(0, [7])
    assert lease.entries[0].hit and lease.entries[0].slot == 0
    lease.release_fenced()


@run_async
async def test_pinned_expert_without_an_idle_pinned_slot_falls_back_to_the_layer() -> None:
    manager, backend = make(working=1, per_layer=2, pins=((0, 7),))
    await wave(manager, 0, [7])
    pinned_slot = resident(manager)[(0, 7)][0]
    # A failed fenced release disables the pinned slot holding 7 ...
    lease = await manager.acquire_block(0, [7])
    backend.fail_next("release", pinned_slot)
    with pytest.raises(ExceptionGroup):
        lease.release_fenced()
    assert manager.snapshot().disabled == 1 and manager.snapshot().pinned == 0
    # ... so the next load of 7 finds no idle pinned slot and takes a layer slot.
    await wave(manager, 0, [7])
    assert resident(manager)[(0, 7)][1] == "resident"


@run_async
async def test_victim_order_idle_first_then_least_recent_then_lowest_id() -> None:
    # 1 working, 2 slots in layer 0, 2 pins. Slots: 0 working, 1-2 layer, 3-4 pinned.
    manager, _backend = make(working=1, per_layer=2, pins=((0, 7), (0, 8)))
    await manager.preload_pinned()
    assert resident(manager) == {(0, 7): (0, "pinned"), (0, 8): (3, "pinned")}
    # Demote 7 for 5: 5 loads into working slot 4, takes the idle layer slot 1.
    await manager.apply_repin(ExpertLfruCandidate(0, 0, 7, 5, 0, 2000, 7))
    assert resident(manager) == {(0, 7): (0, "resident"), (0, 8): (3, "pinned"), (0, 5): (4, "pinned")}
    # Layer 0 now holds slot 0 (expert 7, ready, last_use 0) and slot 2 (idle, last_use 0):
    # idle wins over the lower id, so no eviction.
    await wave(manager, 0, [9])
    assert manager.snapshot().evictions == 0
    assert resident(manager)[(0, 7)] == (0, "resident")
    nine_slot = resident(manager)[(0, 9)][0]
    assert nine_slot == 1
    # Now both layer slots are ready: 7 (last_use 0) is older than 9: evicted.
    await wave(manager, 0, [10])
    assert (0, 7) not in resident(manager) and (0, 9) in resident(manager)
    assert manager.snapshot().evictions == 1


@run_async
async def test_victim_tie_on_last_use_goes_to_the_lowest_slot_id() -> None:
    manager, _backend = make(working=1, per_layer=2, pins=((0, 7), (0, 8)))
    await manager.preload_pinned()
    await manager.apply_repin(ExpertLfruCandidate(0, 0, 7, 5, 0, 2000, 7))
    await manager.apply_repin(ExpertLfruCandidate(0, 0, 8, 6, 0, 2000, 7))
    # Both demoted pins sit in layer 0 with last_use 0: slots 0 (expert 7) and 3 (expert 8).
    layer_view = {k: v for k, v in resident(manager).items() if v[1] == "resident"}
    assert layer_view == {(0, 7): (0, "resident"), (0, 8): (3, "resident")}
    assert all(e.last_use == 0 for e in manager.residency_map() if e.tier == "resident")
    await wave(manager, 0, [9])
    assert (0, 7) not in resident(manager)
    assert resident(manager)[(0, 8)] == (3, "resident")
    assert manager.snapshot().evictions == 1


@run_async
async def test_clock_and_last_use() -> None:
    manager, _ = make(working=2, per_layer=2)
    await wave(manager, 0, [1, 2])
    await wave(manager, 0, [2])
    last_use = {e.expert_id: e.last_use for e in manager.residency_map()}
    assert last_use == {1: 1, 2: 3}
    assert manager.snapshot().clock == 3


# -- acquire: refusals ---------------------------------------------------------


@pytest.mark.parametrize(
    "layer, ids, error, match",
    [
        (1, [0], ValueError, "layer 1 is not a sparse residency layer"),
        (-1, [0], ValueError, "layer"),
        (True, [0], TypeError, "layer"),
        ("0", [0], TypeError, "layer"),
        (0.0, [0], TypeError, "layer"),
        (0, [1, 2, 1], ValueError, "must already be deduplicated"),
        (0, [1, 2, 3], ValueError, r"^expert block has 3 unique experts; working capacity is 2$"),
        (0, [-1], ValueError, "expert id"),
        (0, [-1, -1], ValueError, "expert id must be >= 0"),  # ids are checked before dedup
        (0, [1.0], TypeError, "expert id"),
        (0, [2.5, 2.5], TypeError, "expert id"),
        (0, [True], TypeError, "expert id"),
        (0, ["1"], TypeError, "expert id"),
        (0, [None], TypeError, "expert id"),
    ],
)
@run_async
async def test_acquire_refusals_change_nothing(layer, ids, error, match) -> None:
    manager, backend = make(layers=(0, 2))
    with pytest.raises(error, match=match):
        await manager.acquire_block(layer, ids)
    assert not manager.active
    assert manager.snapshot() == make(layers=(0, 2))[0].snapshot()
    assert backend.counters.submits == 0
    await wave(manager, 0, [1, 2])  # still usable


@run_async
async def test_acquire_refuses_unknown_classification() -> None:
    manager, _ = make()
    with pytest.raises(ValueError, match="classification"):
        await manager.acquire_block(0, [1], None, "prefetch")
    assert not manager.active


@run_async
async def test_concurrent_wave_refused_while_a_lease_is_held() -> None:
    manager, backend = make()
    lease = await manager.acquire_block(0, [1])
    with pytest.raises(ResidencyError, match="another expert wave is active"):
        await manager.acquire_block(0, [2])
    with pytest.raises(ResidencyError, match="another expert wave is active"):
        await manager.acquire_block(0, [1])
    assert backend.counters.submits == 1
    lease.release_fenced()
    await wave(manager, 0, [2])


@run_async
async def test_concurrent_wave_refused_while_an_acquire_is_in_flight() -> None:
    manager, _backend = make()
    await wave(manager, 0, [1])
    gate = asyncio.Event()

    async def hold(_hits):
        await gate.wait()

    first = asyncio.create_task(manager.acquire_block(0, [1, 2], hold))
    await asyncio.sleep(0)
    assert manager.active
    with pytest.raises(ResidencyError, match="another expert wave is active"):
        await manager.acquire_block(0, [3])
    gate.set()
    lease = await first
    assert [e.expert_id for e in lease.entries] == [1, 2]
    lease.release_fenced()


@run_async
async def test_concurrent_wave_refused_while_loads_are_in_flight_manual() -> None:
    manager, backend = make(manual=True)
    task = asyncio.create_task(manager.acquire_block(0, [1, 2]))
    await asyncio.sleep(0)
    assert backend.pending() == [(0, 1), (1, 2)]
    assert manager.snapshot().loading == 2
    with pytest.raises(ResidencyError):
        await manager.acquire_block(0, [3])
    backend.complete(1, 2)
    backend.complete(0, 1)
    lease = await task
    assert entry_summary(lease) == [(1, 0, 1, False), (2, 1, 2, False)]
    lease.release_fenced()


# -- acquire: failures and cleanup --------------------------------------------------


@run_async
async def test_failed_load_rolls_back_everything() -> None:
    # Slots: 0-2 working, 3-5 layer 0.
    manager, backend = make(working=3, per_layer=3)
    await wave(manager, 0, [1])
    manager.drain_demand_telemetry()
    hit_slot = resident(manager)[(0, 1)][0]
    before = manager.snapshot()
    backend.fail_load(failing(0, 3))
    with pytest.raises(OSError, match="injected read failure"):
        await manager.acquire_block(0, [1, 2, 3])
    assert not manager.active
    snap = manager.snapshot()
    assert (snap.leased, snap.loading, snap.disabled) == (0, 0, 0)
    # Failed acquires count no hit or miss; both loads advanced the generation.
    assert (snap.hits, snap.misses) == (before.hits, before.misses)
    assert snap.generation == before.generation + 2
    assert snap.clock == before.clock + 2  # the hit and the successful miss were leased
    # The hit went back to ready and is still resident; both misses were discarded.
    assert backend.state(hit_slot)[0] == "ready"
    assert resident(manager) == {(0, 1): (hit_slot, "resident")}
    assert [s for s in range(6) if backend.state(s)[0] != "idle"] == [hit_slot]
    # Releases: 1 from the first wave, then the hit and the successful miss in cleanup.
    assert backend.counters.discards == 2 and backend.counters.releases == 3
    telemetry = manager.drain_demand_telemetry()
    assert (telemetry.hits, telemetry.misses, telemetry.loads) == (0, 0, 2)
    assert telemetry.read_operations == 4
    assert telemetry.read_bytes == seg_bytes(2) + seg_bytes(3)
    assert telemetry.disk_service.count == 2 and telemetry.foreground_wait.count == 1
    # The manager is fully usable: 1 hits, 2 and 3 miss again.
    lease = await manager.acquire_block(0, [1, 2, 3])
    assert [e.hit for e in lease.entries] == [True, False, False]
    lease.release_fenced()


@run_async
async def test_first_failure_in_load_order_is_the_one_raised() -> None:
    manager, backend = make(working=3, per_layer=1)
    backend.fail_load(failing(0, 6))
    backend.fail_load(failing(0, 4))
    with pytest.raises(OSError, match=r"slot 1 generation 2"):
        await manager.acquire_block(0, [5, 6, 4])
    assert manager.snapshot().leased == 0 and not manager.active


@run_async
async def test_cleanup_failure_discard_raises_group_with_the_original_first() -> None:
    manager, backend = make(working=2, per_layer=2)
    backend.fail_load(failing(0, 2))
    backend.fail_next("discard", 1)  # expert 2 loads into slot 1
    with pytest.raises(ExceptionGroup) as caught:
        await manager.acquire_block(0, [1, 2])
    group = caught.value
    assert str(group).startswith("expert acquire failed and cleanup was incomplete")
    assert isinstance(group.exceptions[0], OSError)
    assert isinstance(group.exceptions[1], BackendProtocolError) and "discard" in str(group.exceptions[1])
    assert len(group.exceptions) == 2
    assert not manager.active
    snap = manager.snapshot()
    assert (snap.disabled, snap.working, snap.leased) == (1, 1, 0)
    assert backend.state(0)[0] == "idle"  # the successful miss was discarded


@run_async
async def test_cleanup_failure_release_of_a_hit_disables_it() -> None:
    manager, backend = make(working=2, per_layer=2)
    await wave(manager, 0, [1])
    hit_slot = resident(manager)[(0, 1)][0]
    backend.fail_load(failing(0, 2))
    backend.fail_next("release", hit_slot)
    with pytest.raises(ExceptionGroup) as caught:
        await manager.acquire_block(0, [1, 2])
    assert [type(e) for e in caught.value.exceptions] == [OSError, BackendProtocolError]
    assert "release" in str(caught.value.exceptions[1])
    snap = manager.snapshot()
    assert snap.disabled == 1 and snap.resident == 1 and not manager.active
    assert (0, 1) not in resident(manager)
    lease = await manager.acquire_block(0, [1])
    assert not lease.entries[0].hit
    lease.release_fenced()


@run_async
async def test_locate_error_cancels_and_drains_submitted_loads() -> None:
    def locator(layer, expert):
        if expert == 9:
            raise KeyError("no such expert")
        return locate(layer, expert)

    manager, backend = make(working=2, per_layer=2, locator=locator)
    with pytest.raises(KeyError, match="no such expert"):
        await manager.acquire_block(0, [1, 9])
    assert backend.counters.cancels == 1
    assert backend.state(0) == ("idle", 1)
    assert not manager.active and manager.snapshot().loading == 0
    assert manager.snapshot().generation == 1


@run_async
async def test_cancel_failure_during_cleanup_is_grouped_and_slot_still_drained() -> None:
    def locator(layer, expert):
        if expert == 9:
            raise KeyError("no such expert")
        return locate(layer, expert)

    manager, backend = make(working=2, per_layer=2, locator=locator)
    backend.fail_next("cancel", 0)
    with pytest.raises(ExceptionGroup) as caught:
        await manager.acquire_block(0, [1, 9])
    assert [type(e) for e in caught.value.exceptions] == [KeyError, BackendProtocolError]
    assert backend.state(0)[0] == "idle"
    assert manager.snapshot().disabled == 0 and not manager.active


@run_async
async def test_locator_returning_the_wrong_expert_is_refused() -> None:
    manager, backend = make(working=2, per_layer=2, locator=lambda layer, expert: locate(layer, expert + 1))
    with pytest.raises(ResidencyError, match=r"^expert locator returned 0:5 for 0:4$"):
        await manager.acquire_block(0, [4])
    assert backend.counters.submits == 0 and not manager.active
    manager2, _backend2 = make(locator=lambda layer, expert: locate(layer + 1, expert))
    with pytest.raises(ResidencyError, match="returned 1:4 for 0:4"):
        await manager2.acquire_block(0, [4])
    assert manager2.snapshot().generation == 0


@run_async
async def test_refused_submit_leaves_the_slot_idle_and_the_generation_unconsumed() -> None:
    manager, backend = make(working=2, per_layer=2)
    real_submit = backend.submit_segments
    calls = []

    def submit(slot, generation, segments):
        calls.append((slot, generation))
        if len(calls) == 2:
            raise BackendProtocolError("queue refused")
        real_submit(slot, generation, segments)

    backend.submit_segments = submit
    with pytest.raises(BackendProtocolError, match="queue refused"):
        await manager.acquire_block(0, [1, 2])
    assert calls == [(0, 1), (1, 2)]
    assert manager.snapshot().generation == 1
    assert states(backend, [0, 1]) == ["idle", "idle"]
    assert manager.drain_demand_telemetry().loads == 1
    lease = await manager.acquire_block(0, [3])
    assert entry_summary(lease) == [(3, 0, 2, False)]
    lease.release_fenced()


@run_async
async def test_before_miss_submit_error_releases_the_hits() -> None:
    manager, backend = make()
    await wave(manager, 0, [1])

    async def boom(_hits):
        raise RuntimeError("worker gone")

    with pytest.raises(RuntimeError, match="worker gone"):
        await manager.acquire_block(0, [1, 2], boom)
    assert not manager.active and manager.snapshot().leased == 0
    assert backend.counters.submits == 1
    assert (0, 1) in resident(manager)


@run_async
async def test_task_cancellation_during_loads_cancels_and_discards_them() -> None:
    manager, backend = make(manual=True, working=2, per_layer=2)
    task = asyncio.create_task(manager.acquire_block(0, [1]))
    await asyncio.sleep(0)
    backend.complete(0, 1)
    (await task).release_fenced()
    hit_slot = resident(manager)[(0, 1)][0]
    task = asyncio.create_task(manager.acquire_block(0, [1, 2]))
    await asyncio.sleep(0)
    # Slot 0 became layer 0's; the working bank is {1, 2}: the miss goes to slot 1.
    assert backend.pending() == [(1, 2)]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert backend.counters.cancels == 1
    assert not manager.active
    assert manager.snapshot().loading == 0 and manager.snapshot().leased == 0
    assert backend.state(1)[0] == "idle"
    assert backend.state(hit_slot)[0] == "ready" and (0, 1) in resident(manager)


class _SlowCancelBackend(InMemoryBackend):
    """A cancel that is only acknowledged later, like a real I/O worker's."""

    def cancel(self, slot, generation):
        self.counters.cancels += 1


@run_async
async def test_second_cancellation_during_cleanup_does_not_wedge_the_manager() -> None:
    plan = plan_expert_residency(budget_bytes=4, fixed_bytes=0, slot_bytes=1, sparse_layers=1, working_slots=2)
    backend = _SlowCancelBackend(plan.total_slots, manual=True)
    manager = ExpertResidencyManager(plan=plan, sparse_layer_ids=[0], backend=backend, locate=locate)
    task = asyncio.create_task(manager.acquire_block(0, [1, 2]))
    for _ in range(3):
        await asyncio.sleep(0)
    task.cancel()  # cleanup starts and waits for the cancel acknowledgements
    for _ in range(3):
        await asyncio.sleep(0)
    task.cancel()  # e.g. shutdown cancelling again
    for _ in range(3):
        await asyncio.sleep(0)
    for slot, generation in backend.pending():
        backend.complete(slot, generation)  # the worker finally acknowledges
    done, _ = await asyncio.wait({task}, timeout=5)
    assert done == {task}
    with pytest.raises(BaseException):  # noqa: B017 - CancelledError, or a group holding it
        task.result()
    for _ in range(5):
        await asyncio.sleep(0)
    assert not manager.active
    assert manager.snapshot().loading == 0


@run_async
async def test_working_bank_shortage_is_refused_and_hits_released() -> None:
    # Slots 0-2 working, 3-4 layer 0. Two failed discards in cleanup disable slots 1, 2.
    manager, backend = make(working=3, per_layer=2)
    backend.fail_load(failing(0, 2))
    backend.fail_load(failing(0, 3))
    backend.fail_next("discard", 1)
    backend.fail_next("discard", 2)
    with pytest.raises(ExceptionGroup) as caught:
        await manager.acquire_block(0, [1, 2, 3])
    assert [type(e) for e in caught.value.exceptions] == [OSError, BackendProtocolError, BackendProtocolError]
    assert manager.snapshot().working == 1 and manager.snapshot().disabled == 2
    await wave(manager, 0, [5])
    hit_slot = resident(manager)[(0, 5)][0]
    submits = backend.counters.submits
    with pytest.raises(ResidencyError, match=r"^working tier has 1 free slots for 2 misses$"):
        await manager.acquire_block(0, [5, 6, 7])
    assert not manager.active and backend.counters.submits == submits
    assert backend.state(hit_slot)[0] == "ready"
    lease = await manager.acquire_block(0, [5, 6])
    assert [e.hit for e in lease.entries] == [True, False]
    lease.release_fenced()


@run_async
async def test_stale_lease_leaves_slots_leased_and_later_hit_is_refused() -> None:
    manager, backend = make(working=2, per_layer=2)
    await wave(manager, 0, [1])
    lease = await manager.acquire_block(0, [1])
    (entry,) = lease.entries
    bad = ExpertResidencyLeaseEntry(entry.layer, entry.expert_id, entry.slot, entry.generation + 1, entry.hit)
    with pytest.raises(StaleLeaseError, match=r"stale expert lease 0:1"):
        manager.release_fenced([bad])
    assert not manager.active
    # The reader may still hold the slot: it stays leased, never reused.
    assert backend.state(entry.slot)[0] == "leased"
    assert manager.snapshot().leased == 1
    with pytest.raises(ResidencyError, match="resident expert 0:1 is leased, not ready"):
        await manager.acquire_block(0, [1])
    assert not manager.active and manager.snapshot().leased == 1
    # Other experts still work.
    await wave(manager, 0, [2])


# -- release_fenced ------------------------------------------------------------


@run_async
async def test_release_twice_and_release_without_a_wave() -> None:
    manager, _ = make()
    with pytest.raises(ResidencyError, match="no active expert batch lease"):
        manager.release_fenced([])
    lease = await manager.acquire_block(0, [1])
    lease.release_fenced()
    with pytest.raises(ResidencyError, match="already been released"):
        lease.release_fenced()
    with pytest.raises(ResidencyError, match="no active expert batch lease"):
        manager.release_fenced(lease.entries)


@run_async
async def test_stale_lease_not_leased_ends_the_wave() -> None:
    manager, backend = make(working=2, per_layer=2)
    old = await wave(manager, 0, [1])
    lease = await manager.acquire_block(0, [2])
    # The old entry's slot is ready now (not leased): stale.
    with pytest.raises(StaleLeaseError):
        manager.release_fenced(old.entries)
    assert not manager.active
    assert backend.state(lease.entries[0].slot)[0] == "leased"
    # The lease object itself now finds no active wave.
    with pytest.raises(ResidencyError, match="no active expert batch lease"):
        lease.release_fenced()
    assert lease.released
    with pytest.raises(ResidencyError, match="already been released"):
        lease.release_fenced()


@run_async
async def test_stale_lease_with_an_out_of_range_slot() -> None:
    manager, _ = make()
    lease = await manager.acquire_block(0, [1])
    with pytest.raises(StaleLeaseError):
        manager.release_fenced([ExpertResidencyLeaseEntry(0, 1, 99, 1, False)])
    assert not manager.active
    del lease


@run_async
async def test_stale_check_precedes_any_release() -> None:
    manager, backend = make(working=2, per_layer=2)
    lease = await manager.acquire_block(0, [1, 2])
    good, other = lease.entries
    bad = ExpertResidencyLeaseEntry(other.layer, other.expert_id, other.slot, 77, other.hit)
    with pytest.raises(StaleLeaseError):
        manager.release_fenced([good, bad])
    assert backend.counters.releases == 0
    assert states(backend, [good.slot, other.slot]) == ["leased", "leased"]


@run_async
async def test_backend_release_failure_groups_disables_and_discards_misses() -> None:
    manager, backend = make(working=3, per_layer=3)
    await wave(manager, 0, [1])
    hit_slot = resident(manager)[(0, 1)][0]
    lease = await manager.acquire_block(0, [1, 2, 3])
    failed_slot = lease.entries[1].slot
    ok_miss_slot = lease.entries[2].slot
    backend.fail_next("release", failed_slot)
    with pytest.raises(ExceptionGroup) as caught:
        lease.release_fenced()
    assert str(caught.value).startswith("expert lease release failed")
    assert len(caught.value.exceptions) == 1 and isinstance(caught.value.exceptions[0], BackendProtocolError)
    assert not manager.active and lease.released
    snap = manager.snapshot()
    assert snap.disabled == 1 and snap.working == 2
    # The disabled slot keeps its (backend) lease; the good miss is discarded, not promoted;
    # the hit is released and stays resident.
    assert backend.state(failed_slot)[0] == "leased"
    assert backend.state(ok_miss_slot)[0] == "idle"
    assert resident(manager) == {(0, 1): (hit_slot, "resident")}
    assert snap.evictions == 0
    lease = await manager.acquire_block(0, [2, 3])
    assert [e.hit for e in lease.entries] == [False, False]
    assert failed_slot not in {e.slot for e in lease.entries}
    lease.release_fenced()


@run_async
async def test_release_failure_then_discard_failure_both_reported() -> None:
    manager, backend = make(working=2, per_layer=2)
    lease = await manager.acquire_block(0, [1, 2])
    backend.fail_next("release", lease.entries[0].slot)
    backend.fail_next("discard", lease.entries[1].slot)
    with pytest.raises(ExceptionGroup) as caught:
        lease.release_fenced()
    assert len(caught.value.exceptions) == 2
    assert manager.snapshot().disabled == 2 and manager.snapshot().working == 0
    assert not manager.active


@run_async
async def test_promotion_failure_ends_the_wave_and_a_ready_working_slot_is_reused() -> None:
    manager, backend = make(working=1, per_layer=1)
    await wave(manager, 0, [1])
    layer_slot = resident(manager)[(0, 1)][0]
    lease = await manager.acquire_block(0, [2])
    miss_slot = lease.entries[0].slot
    backend.fail_next("discard", layer_slot)  # the LRU victim cannot be discarded
    with pytest.raises(BackendProtocolError, match="discard"):
        lease.release_fenced()
    assert not manager.active
    # Expert 2 was left ready in the working bank and is still found there.
    lease = await manager.acquire_block(0, [2])
    assert lease.entries[0].hit and lease.entries[0].slot == miss_slot
    lease.release_fenced()
    # A miss reuses that ready working slot after discarding its contents.
    discards = backend.counters.discards
    lease = await manager.acquire_block(0, [3])
    assert lease.entries[0].slot == miss_slot
    assert backend.counters.discards == discards + 1
    lease.release_fenced()
    lease = await manager.acquire_block(0, [2])
    assert not lease.entries[0].hit
    lease.release_fenced()


# -- correct_for_pressure -----------------------------------------------------


@run_async
async def test_pressure_evicts_oldest_only_from_layers_with_more_than_one_slot() -> None:
    # Budget 5 (1 working + 2 layers x 2); the backend counts 2 bytes per occupied slot.
    manager, _backend = make(layers=(0, 1), working=1, per_layer=2, backend_slot_bytes=2)
    await wave(manager, 0, [1])
    await wave(manager, 0, [2])
    await wave(manager, 1, [3])
    await wave(manager, 1, [4])
    assert manager.snapshot().physical_footprint == 8
    snap = manager.correct_for_pressure()
    # 1 (oldest) goes; then layer 0 is down to one slot, so 3 goes rather than 2.
    assert set(resident(manager)) == {(0, 2), (1, 4)}
    assert (snap.pressure_evictions, snap.disabled, snap.resident, snap.physical_footprint) == (2, 2, 2, 4)
    assert snap.evictions == 0
    # Disabled capacity is gone for good: layer 0 now has one slot.
    await wave(manager, 0, [5])
    assert set(resident(manager)) == {(0, 5), (1, 4)}


def test_pressure_noop_when_under_budget() -> None:
    manager, backend = make()
    snap = manager.correct_for_pressure()
    assert snap.pressure_evictions == 0 and snap.physical_footprint == 0
    backend.footprint = manager.plan.budget_bytes  # equal is fine
    assert manager.correct_for_pressure().physical_footprint == manager.plan.budget_bytes


@run_async
async def test_pressure_raises_when_budget_cannot_be_reached() -> None:
    manager, backend = make(layers=(0, 1), working=1, per_layer=2, pins=((0, 9),))
    await manager.preload_pinned()
    for layer, expert in ((0, 1), (0, 2), (1, 3)):
        await wave(manager, layer, [expert])
    backend.footprint = 1000
    with pytest.raises(
        ResidencyPressureError,
        match=r"^expert physical footprint 1000 exceeds budget 6, and no evictable capacity remains$",
    ):
        manager.correct_for_pressure()
    # What could go went: the older of layer 0's two; layer 1 had one ready (3) and an idle slot.
    snap = manager.snapshot()
    assert snap.pressure_evictions == 2 and snap.disabled == 2
    assert set(resident(manager)) == {(0, 9), (0, 2)}
    assert resident(manager)[(0, 9)][1] == "pinned"  # pins are never pressure victims
    assert isinstance(ResidencyPressureError("x"), ResidencyError)


@run_async
async def test_pressure_ignores_idle_and_leased_slots_and_refuses_during_a_wave() -> None:
    manager, backend = make(layers=(0,), working=1, per_layer=3)
    await wave(manager, 0, [1])
    lease = await manager.acquire_block(0, [1])
    with pytest.raises(ResidencyError, match="safe point"):
        manager.correct_for_pressure()
    lease.release_fenced()
    backend.footprint = 1000
    with pytest.raises(ResidencyPressureError):
        manager.correct_for_pressure()
    # Only the single ready slot could be evicted; idle slots are never disabled.
    assert manager.snapshot().pressure_evictions == 1
    assert manager.snapshot().disabled == 1 and manager.snapshot().resident == 2


@run_async
async def test_pressure_tie_on_last_use_evicts_the_lowest_slot_id() -> None:
    manager, backend = make(working=1, per_layer=2, pins=((0, 7), (0, 8)))
    await manager.preload_pinned()
    await manager.apply_repin(ExpertLfruCandidate(0, 0, 7, 5, 0, 2000, 7))
    await manager.apply_repin(ExpertLfruCandidate(0, 0, 8, 6, 0, 2000, 7))
    backend.footprint = 1000
    with pytest.raises(ResidencyPressureError):
        manager.correct_for_pressure()
    assert (0, 7) not in resident(manager)  # slot 0, last_use 0
    assert resident(manager)[(0, 8)] == (3, "resident")  # slot 3, last_use 0


# -- preload_pinned -----------------------------------------------------------


@run_async
async def test_preload_chunks_by_working_size_and_counts_as_policy() -> None:
    pins = ((0, 1), (0, 2), (1, 3), (0, 4), (0, 5), (0, 6))
    manager, backend = make(layers=(1, 0), working=2, per_layer=1, pins=pins, record_history=True)
    await manager.preload_pinned()
    submits = [event for event in backend.counters.history if event[0] == "submit"]
    assert len(submits) == 6
    policy = manager.drain_policy_telemetry()
    # Layer 1 first ([3]), then layer 0 in chunks [1, 2], [4, 5], [6].
    assert policy.foreground_wait.count == 4
    assert (policy.hits, policy.misses, policy.loads, policy.read_operations) == (0, 6, 6, 12)
    assert policy.read_bytes == sum(seg_bytes(e) for _, e in pins)
    assert policy.disk_service.count == 6
    demand = manager.drain_demand_telemetry()
    assert (demand.hits, demand.misses, demand.loads, demand.foreground_wait.count) == (0, 0, 0, 0)
    snap = manager.snapshot()
    assert (snap.hits, snap.misses) == (0, 0)
    assert {k: v[1] for k, v in resident(manager).items()} == {pin: "pinned" for pin in pins}
    # The history shows the chunk boundaries: each acquire releases before the next submits.
    actions = [a for a, _, _ in backend.counters.history if a in ("submit", "release")]
    assert actions == ["submit", "release"] + ["submit", "submit", "release", "release"] * 2 + ["submit", "release"]
    # Generation order follows layer order, then pin order.
    expert_of_generation = {}
    for action, slot, generation in backend.counters.history:
        if action == "submit":
            expert_of_generation[generation] = slot
    assert sorted(expert_of_generation) == [1, 2, 3, 4, 5, 6]
    # A second preload finds every pin resident: policy hits only.
    await manager.preload_pinned()
    policy = manager.drain_policy_telemetry()
    assert (policy.hits, policy.misses, policy.loads) == (6, 0, 0)
    assert policy.foreground_wait.count == 0


@run_async
async def test_preload_refused_during_a_wave_and_noop_without_pins() -> None:
    manager, _backend = make(pins=((0, 1),))
    lease = await manager.acquire_block(0, [2])
    with pytest.raises(ResidencyError, match="pinned preload requires a model safe point"):
        await manager.preload_pinned()
    lease.release_fenced()
    empty, empty_backend = make()
    await empty.preload_pinned()
    assert empty_backend.counters.submits == 0


# -- live repin ----------------------------------------------------------------


def _ledger(tmp_path, layers=(0, 1), experts=16) -> ExpertUsageLedger:
    return ExpertUsageLedger(tmp_path / "usage.txt", layers=list(layers), experts_per_layer=experts)


@run_async
async def test_repin_candidates_without_a_ledger_and_during_a_wave() -> None:
    manager, _ = make(pins=((0, 1),))
    assert manager.repin_candidates() == []
    lease = await manager.acquire_block(0, [2])
    with pytest.raises(ResidencyError, match="live repin requires a model safe point"):
        manager.repin_candidates()
    with pytest.raises(ResidencyError, match="live repin requires a model safe point"):
        await manager.apply_repin(ExpertLfruCandidate(0, 0, 1, 2, 0, 2000, 7))
    lease.release_fenced()


@pytest.mark.parametrize("hot_resident", [False, True])
@run_async
async def test_repin_with_the_real_ledger(tmp_path, hot_resident: bool) -> None:
    ledger = _ledger(tmp_path)
    manager, backend = make(layers=(0, 1), working=1, per_layer=2, pins=((0, 7),), usage=ledger)
    await manager.preload_pinned()
    manager.drain_policy_telemetry()
    manager.record_routes(0, [[5]] * 10)
    manager.record_routes(1, np.array([[2, 3]]))
    if hot_resident:
        await wave(manager, 0, [5])
    (candidate,) = manager.repin_candidates()  # layer 1 has no pins: no candidate
    assert (candidate.layer, candidate.cold_expert_id, candidate.hot_expert_id) == (0, 7, 5)
    pinned_slot = resident(manager)[(0, 7)][0]
    counters_before = (
        backend.counters.submits,
        backend.counters.leases,
        backend.counters.releases,
        backend.counters.discards,
        backend.counters.cancels,
    )
    event = await manager.apply_repin(candidate)
    assert event == ExpertRepinEvent(layer=0, evicted_pin=7, admitted_pin=5, gain=candidate.gain)
    counters_after = (
        backend.counters.submits,
        backend.counters.leases,
        backend.counters.releases,
        backend.counters.discards,
        backend.counters.cancels,
    )
    policy = manager.drain_policy_telemetry()
    if hot_resident:
        # The swap itself moves roles only: no backend call at all.
        assert counters_after == counters_before
        assert (policy.loads, policy.misses) == (0, 0)
    else:
        # Exactly one policy load of the hot expert, then a role swap with no more I/O.
        assert counters_after[0] == counters_before[0] + 1
        assert counters_after[3] == counters_before[3]  # nothing discarded: 5 took an idle slot
        assert (policy.loads, policy.misses, policy.hits) == (1, 1, 0)
        assert manager.drain_demand_telemetry().loads == 0
    assert manager.pinned == ((0, 5),)
    view = {e.expert_id: e for e in manager.residency_map() if e.layer == 0}
    assert view[5].tier == "pinned" and view[7].tier == "resident"
    assert view[7].slot == pinned_slot and view[7].last_use == 0
    assert view[7].usage == ledger.entry(0, 7)
    assert manager.snapshot().repin_swaps == 1
    assert (manager.snapshot().pinned, manager.snapshot().resident) == (1, 4)
    # The same candidate is stale now.
    with pytest.raises(ResidencyError, match="stale live-repin candidate"):
        await manager.apply_repin(candidate)
    # The demoted pin is the layer's next LRU victim (last_use 0), unless an idle slot exists.
    await wave(manager, 0, [11])
    await wave(manager, 0, [12])
    assert (0, 7) not in resident(manager)
    # The new pin is never evicted and hits.
    lease = await manager.acquire_block(0, [5])
    assert lease.entries[0].hit
    lease.release_fenced()


@run_async
async def test_repin_candidates_query_the_ledger_per_layer_with_its_pins() -> None:
    calls = []

    class FakeLedger:
        def lfru_candidate(self, layer, ids):
            calls.append((layer, list(ids)))
            return ExpertLfruCandidate(layer, 0, ids[0], 3, 0, 2000, 7) if ids else None

        def entry(self, layer, expert):
            return ("entry", layer, expert)

        def record_routes(self, layer, routes):
            calls.append(("routes", layer))

    manager, _ = make(layers=(4, 2), working=1, per_layer=1, pins=((2, 6), (4, 1), (2, 8)), usage=FakeLedger())
    candidates = manager.repin_candidates()
    assert calls == [(4, [1]), (2, [6, 8])]
    assert [(c.layer, c.cold_expert_id) for c in candidates] == [(4, 1), (2, 6)]
    await manager.preload_pinned()
    assert all(e.usage == ("entry", e.layer, e.expert_id) for e in manager.residency_map())


@pytest.mark.parametrize(
    "cold, hot",
    [(9, 5), (7, 8), (7, 7)],  # cold is not pinned; hot is already pinned; hot == cold
)
@run_async
async def test_stale_repin_candidates_refused(cold: int, hot: int) -> None:
    manager, backend = make(working=1, per_layer=2, pins=((0, 7), (0, 8)))
    await manager.preload_pinned()
    submits = backend.counters.submits
    with pytest.raises(ResidencyError, match="stale live-repin candidate"):
        await manager.apply_repin(ExpertLfruCandidate(0, 0, cold, hot, 0, 2000, 7))
    assert backend.counters.submits == submits and manager.snapshot().repin_swaps == 0
    with pytest.raises(ResidencyError, match="stale"):
        await manager.apply_repin(ExpertLfruCandidate(3, 0, 7, 5, 0, 2000, 7))  # wrong layer


@run_async
async def test_repin_needs_the_cold_pin_materialized() -> None:
    manager, _backend = make(working=1, per_layer=2, pins=((0, 7),))
    with pytest.raises(ResidencyError, match="could not materialize both"):
        await manager.apply_repin(ExpertLfruCandidate(0, 0, 7, 5, 0, 2000, 7))
    assert manager.pinned == ((0, 7),) and manager.snapshot().repin_swaps == 0
    assert (0, 5) in resident(manager)  # the hot expert was loaded (policy) all the same
    assert manager.drain_policy_telemetry().loads == 1


@run_async
async def test_repin_needs_a_pinned_cold_slot() -> None:
    manager, backend = make(working=1, per_layer=2, pins=((0, 7),))
    await manager.preload_pinned()
    pinned_slot = resident(manager)[(0, 7)][0]
    lease = await manager.acquire_block(0, [7])
    backend.fail_next("release", pinned_slot)
    with pytest.raises(ExceptionGroup):
        lease.release_fenced()
    await wave(manager, 0, [7])  # 7 now lives in a layer slot
    with pytest.raises(ResidencyError, match="requires ready resident and pinned slots"):
        await manager.apply_repin(ExpertLfruCandidate(0, 0, 7, 5, 0, 2000, 7))
    assert manager.snapshot().repin_swaps == 0


# -- hint_experts -------------------------------------------------------------


@run_async
async def test_hints_skip_resident_dedupe_and_submit_full_segments() -> None:
    manager, backend = make(working=2, per_layer=2)
    await wave(manager, 0, [1])
    before = manager.snapshot()
    manager.hint_experts(0, [1, 2, 2, 3, np.int64(3)])
    telemetry = manager.drain_hint_telemetry()
    assert (telemetry.candidates, telemetry.resident_skipped, telemetry.submit_errors) == (3, 1, 0)
    assert (telemetry.submitted, telemetry.completed, telemetry.dropped) == (2, 2, 0)
    assert telemetry.operations == 4 and telemetry.bytes == seg_bytes(2) + seg_bytes(3)
    assert (telemetry.errors, telemetry.queue_depth, telemetry.in_flight) == (0, 0, 0)
    # Hints never touch slots.
    assert manager.snapshot() == before and backend.counters.submits == 1
    again = manager.drain_hint_telemetry()
    assert (again.candidates, again.resident_skipped, again.submitted, again.operations) == (0, 0, 0, 0)


@run_async
async def test_hints_use_hint_segments_when_the_locator_gives_them() -> None:
    def locator(layer, expert):
        base = locate(layer, expert)
        hints = () if expert == 4 else (ExpertIOHintSegment(layer, expert * 1000 + 10, 3),)
        return ExpertResidencyLocation(layer, expert, base.segments, hints)

    manager, _backend = make(locator=locator)
    manager.hint_experts(0, [2, 4])
    telemetry = manager.drain_hint_telemetry()
    # Expert 4's empty hint list is skipped silently (no submit, no error).
    assert (telemetry.candidates, telemetry.submitted, telemetry.operations, telemetry.bytes) == (2, 1, 1, 3)
    assert telemetry.submit_errors == 0


def test_hints_without_backend_support_count_submit_errors() -> None:
    class NoHints(InMemoryBackend):
        hint_segments = None
        hint_telemetry = None

    plan = plan_expert_residency(budget_bytes=4, fixed_bytes=0, slot_bytes=1, sparse_layers=1, working_slots=2)
    manager = ExpertResidencyManager(plan=plan, sparse_layer_ids=[0], backend=NoHints(plan.total_slots), locate=locate)
    manager.hint_experts(0, [1, 2])
    telemetry = manager.drain_hint_telemetry()
    assert (telemetry.candidates, telemetry.submit_errors, telemetry.submitted) == (2, 2, 0)
    assert (telemetry.queue_depth, telemetry.in_flight) == (0, 0)


def test_hints_dropped_when_the_queue_is_full_and_locator_errors_counted() -> None:
    manager, _backend = make(hint_capacity=0)
    manager.hint_experts(0, [1, 2])
    telemetry = manager.drain_hint_telemetry()
    assert (telemetry.candidates, telemetry.dropped, telemetry.submitted, telemetry.submit_errors) == (2, 2, 0, 0)

    def locator(layer, expert):
        raise LookupError("unknown")

    manager, _ = make(locator=locator)
    manager.hint_experts(0, [1])
    assert manager.drain_hint_telemetry().submit_errors == 1


def test_hint_baseline_is_taken_at_construction() -> None:
    backend = InMemoryBackend(4)
    backend.hint_segments([ExpertIOHintSegment(0, 0, 5)])
    plan = plan_expert_residency(budget_bytes=4, fixed_bytes=0, slot_bytes=1, sparse_layers=1, working_slots=2)
    manager = ExpertResidencyManager(plan=plan, sparse_layer_ids=[0], backend=backend, locate=locate)
    assert manager.drain_hint_telemetry().submitted == 0
    backend.hint_segments([ExpertIOHintSegment(0, 0, 5)])
    telemetry = manager.drain_hint_telemetry()
    assert (telemetry.submitted, telemetry.bytes, telemetry.candidates) == (1, 5, 0)


@pytest.mark.parametrize(
    "layer, ids, error",
    [
        (3, [1], ValueError),
        (-1, [1], ValueError),
        ("0", [1], TypeError),
        (0, [1, -1], ValueError),
        (0, [1, "x"], TypeError),
        (0, [1, 2.0], TypeError),
        (0, [False], TypeError),
    ],
)
def test_bad_hints_raise_and_leave_counters_unchanged(layer, ids, error) -> None:
    manager, _backend = make()
    with pytest.raises(error):
        manager.hint_experts(layer, ids)
    telemetry = manager.drain_hint_telemetry()
    assert (telemetry.candidates, telemetry.submitted, telemetry.submit_errors, telemetry.resident_skipped) == (
        0,
        0,
        0,
        0,
    )


# -- record_routes, drains, snapshot ------------------------------------------------


def test_record_routes_feeds_the_ledger_then_the_observer(tmp_path) -> None:
    ledger = _ledger(tmp_path)
    seen = []

    def observer(layer, routes):
        seen.append((layer, routes, ledger.entry(layer, 3).count))

    manager, _ = make(layers=(0, 1), usage=ledger, observer=observer)
    routes = [[3, 3], [1, 3]]
    manager.record_routes(1, routes)
    assert ledger.entry(1, 3).count == 3 and ledger.entry(1, 1).count == 1
    assert ledger.entry(0, 3).count == 0
    assert seen == [(1, routes, 3)] and seen[0][1] is routes
    array = np.array([[2, 2]])
    manager.record_routes(0, array)
    assert seen[1][1] is array and ledger.entry(0, 2).count == 2


def test_record_routes_without_ledger_or_observer_and_bad_layer() -> None:
    manager, _ = make()
    manager.record_routes(0, [[1]])
    with pytest.raises(ValueError, match="not a sparse residency layer"):
        manager.record_routes(7, [[1]])
    seen = []
    manager, _ = make(observer=lambda layer, routes: seen.append(layer))
    manager.record_routes(0, [])
    assert seen == [0]


@run_async
async def test_demand_telemetry_counts_and_drain_resets() -> None:
    manager, _ = make(working=2, per_layer=2)
    await wave(manager, 0, [1, 2])
    await wave(manager, 0, [2, 3])
    telemetry = manager.drain_demand_telemetry()
    assert (telemetry.hits, telemetry.misses, telemetry.loads) == (1, 3, 3)
    assert telemetry.read_operations == 6
    assert telemetry.read_bytes == seg_bytes(1) + seg_bytes(2) + seg_bytes(3)
    assert telemetry.disk_service.count == 3 and telemetry.foreground_wait.count == 2
    assert telemetry.disk_service.total_ms >= 0 and telemetry.disk_service.max_ms >= telemetry.disk_service.p50_ms
    empty = manager.drain_demand_telemetry()
    assert (empty.hits, empty.misses, empty.loads, empty.read_operations, empty.read_bytes) == (0, 0, 0, 0, 0)
    assert empty.disk_service.count == 0 and empty.foreground_wait.count == 0
    # Snapshot counters are cumulative and not reset by a drain.
    assert (manager.snapshot().hits, manager.snapshot().misses) == (1, 3)
    # Policy telemetry stayed empty.
    policy = manager.drain_policy_telemetry()
    assert (policy.hits, policy.misses, policy.loads) == (0, 0, 0)


@run_async
async def test_policy_classification_is_kept_apart() -> None:
    manager, _ = make()
    await wave(manager, 0, [1], classification="policy")
    await wave(manager, 0, [1, 2], classification="policy")
    policy = manager.drain_policy_telemetry()
    assert (policy.hits, policy.misses, policy.loads, policy.foreground_wait.count) == (1, 2, 2, 2)
    assert manager.drain_policy_telemetry().loads == 0
    demand = manager.drain_demand_telemetry()
    assert (demand.hits, demand.misses, demand.loads) == (0, 0, 0)
    snap = manager.snapshot()
    assert (snap.hits, snap.misses, snap.generation) == (0, 0, 2)


@run_async
async def test_snapshot_counts_roles_and_phases_mid_wave() -> None:
    manager, backend = make(layers=(0, 1), working=2, per_layer=2, pins=((1, 9),), manual=True)
    task = asyncio.create_task(manager.acquire_block(1, [9, 4]))
    await asyncio.sleep(0)
    snap = manager.snapshot()
    assert (snap.loading, snap.leased, snap.physical_footprint) == (2, 0, 2)
    backend.complete(0, 1)
    backend.complete(1, 2)
    lease = await task
    snap = manager.snapshot()
    assert (snap.loading, snap.leased, snap.clock, snap.generation) == (0, 2, 2, 2)
    lease.release_fenced()
    snap = manager.snapshot()
    assert (snap.working, snap.resident, snap.pinned, snap.disabled, snap.leased) == (2, 4, 1, 0, 0)
    assert resident(manager) == {(1, 9): (0, "pinned"), (1, 4): (1, "resident")}


@run_async
async def test_residency_map_lists_only_ready_resident_and_pinned(tmp_path) -> None:
    ledger = _ledger(tmp_path, layers=(0,))
    manager, _ = make(working=2, per_layer=2, pins=((0, 3),), usage=ledger)
    manager.record_routes(0, [[3, 4]])
    await wave(manager, 0, [3, 4])
    entries = sorted(manager.residency_map(), key=lambda e: e.slot)
    assert [(e.slot, e.layer, e.expert_id, e.tier, e.last_use) for e in entries] == [
        (0, 0, 3, "pinned", 1),
        (1, 0, 4, "resident", 2),
    ]
    assert entries[0].usage == ledger.entry(0, 3) and entries[0].usage.count == 1
    lease = await manager.acquire_block(0, [4])
    assert [e.expert_id for e in manager.residency_map()] == [3]  # the leased one is hidden
    lease.release_fenced()
    manager_without, _ = make()
    await wave(manager_without, 0, [1])
    assert [e.usage for e in manager_without.residency_map()] == [None]


# -- acquire: the demand path's sends and waits ---------------------------------------


class _SendingBackend(InMemoryBackend):
    """Records the order of submits, the `send_submitted` hook and waits."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[tuple] = []

    def submit_segments(self, slot, generation, segments):
        super().submit_segments(slot, generation, segments)
        self.events.append(("submit", slot))

    def send_submitted(self):
        self.events.append(("send",))

    async def wait(self, slot, generation):
        self.events.append(("wait", slot))
        await super().wait(slot, generation)


@run_async
async def test_a_wave_sends_its_misses_before_it_waits_and_a_wave_of_hits_sends_nothing() -> None:
    plan = one_byte_plan(layers=(0,), working=2, per_layer=2)
    backend = _SendingBackend(plan.total_slots)
    manager = ExpertResidencyManager(plan=plan, sparse_layer_ids=[0], backend=backend, locate=locate)
    await wave(manager, 0, [1, 2])
    assert backend.events == [("submit", 0), ("submit", 1), ("send",), ("wait", 0), ("wait", 1)]
    backend.events.clear()
    await wave(manager, 0, [2, 1])  # both resident now
    assert backend.events == []
    await wave(manager, 0, [3])  # a single miss: awaited directly, sent first all the same
    assert [event[0] for event in backend.events] == ["submit", "send", "wait"]


@pytest.mark.parametrize("misses", [[3], [3, 4]])
@run_async
async def test_a_failed_miss_rolls_back_whether_alone_or_not(misses) -> None:
    """One miss is awaited directly, several through a gather: a read error leaves the same state."""
    manager, backend = make(working=2, per_layer=2)
    backend.fail_load(failing(0, 3))
    before = manager.snapshot()
    with pytest.raises(OSError, match="injected read failure"):
        await manager.acquire_block(0, misses)
    snap = manager.snapshot()
    assert not manager.active and (snap.leased, snap.loading, snap.disabled) == (0, 0, 0)
    assert (snap.hits, snap.misses) == (before.hits, before.misses) and resident(manager) == {}
    telemetry = manager.drain_demand_telemetry()
    assert telemetry.disk_service.count == len(misses) and telemetry.foreground_wait.count == 1
    lease = await manager.acquire_block(0, misses)  # usable: they miss again, and load
    assert [e.hit for e in lease.entries] == [False] * len(misses)
    lease.release_fenced()
