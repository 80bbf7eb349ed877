"""The replacement policies (coordinator.replacement) and the manager under each of them.

Each policy's choices by hand (LRU's recency, LRFU's decayed counts and their half-life), the
registry and the spec grammar shared with the launcher and the replay tool, and small manager
scenarios where the policies part ways: which resident a miss replaces, a pin passing to a
hotter expert of its layer (the pinned tier's size and the layer's capacity unchanged), the LFRU
live repin standing aside for adaptive pins, a policy that declines to admit a miss, and a
prediction's victims ranked once giving the choices `choose_victim` gives one by one.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.memory_backend import InMemoryBackend
from coordinator.replacement import DEFAULT_HALF_LIFE, LRFU, LRU, choose_victim, replacement_policy, victims_in_order
from coordinator.residency import ExpertResidencyManager
from coordinator.residency_types import StaleLeaseError
from coordinator.slot_table import SlotTable
from coordinator.usage import ExpertUsageLedger
from shared.config import DEFAULT_REPLACEMENT, REPLACEMENT_POLICIES, parse_replacement
from shared.plan import plan_expert_residency
from tests.helpers.residency import locate_one_byte as _locate
from tests.helpers.residency import make_manager as make
from tests.helpers.residency import record, resident, visit

# -- names ---------------------------------------------------------------------------------


def test_registry_matches_the_shared_names_and_the_spec_grammar():
    assert {replacement_policy(name).name for name in REPLACEMENT_POLICIES} == set(REPLACEMENT_POLICIES)
    assert DEFAULT_REPLACEMENT in REPLACEMENT_POLICIES
    assert parse_replacement("lru") == ("lru", None) and parse_replacement("lrfu:32") == ("lrfu", 32)
    assert replacement_policy("lrfu:32").half_life == 32 and replacement_policy("lrfu").half_life == DEFAULT_HALF_LIFE
    assert isinstance(replacement_policy(), LRU)  # the manager's own default: the seed's
    policy = LRFU(half_life=4)
    assert replacement_policy(policy) is policy
    for bad, needle in [
        ("mru", "unknown replacement policy 'mru'"),
        ("lru:4", "takes no knob"),
        ("lrfu:", "positive integer"),
        ("lrfu:0", "positive integer"),
        ("lrfu:-2", "positive integer"),
        ("lrfu:1.5", "positive integer"),
        ("LRU", "unknown"),
    ]:
        with pytest.raises(ValueError, match=needle):
            replacement_policy(bad)
    with pytest.raises(ValueError, match="must be a string"):
        parse_replacement(None)
    with pytest.raises(ValueError, match="half_life"):
        LRFU(half_life=0)


# -- each policy's choices -------------------------------------------------------------------


def test_lru_ranks_by_last_use_then_slot_id():
    policy = LRU()
    policy.touch(0, [1, 2])  # no state of its own: the core's clock is its clock
    older, newer, tie = record(slot=5, expert=1, last_use=3), record(slot=1, expert=2, last_use=9), record(slot=2)
    assert min([newer, older], key=policy.eviction_key) is older
    assert min([record(slot=7), tie], key=policy.eviction_key) is tie
    assert policy.admit(0, 3, older) and not policy.adaptive_pins


def test_lrfu_counts_decay_by_half_every_half_life_visits_of_the_layer():
    policy = LRFU(half_life=2)
    policy.touch(0, [1, 2])
    policy.touch(0, [1])
    assert policy.score(0, 1) == pytest.approx(2**-0.5 + 1)
    assert policy.score(0, 2) == pytest.approx(2**-0.5)
    policy.touch(1, [2])  # another layer's visits age nothing here
    assert policy.score(0, 2) == pytest.approx(2**-0.5) and policy.score(1, 2) == 1.0
    policy.touch(0, [])
    policy.touch(0, [])  # two more visits of layer 0: one half-life
    assert policy.score(0, 1) == pytest.approx((2**-0.5 + 1) / 2)
    assert policy.score(0, 9) == 0.0 and policy.score(5, 1) == 0.0  # never used, unknown layer


def test_lrfu_evicts_the_least_used_lately_ties_to_the_least_recent():
    policy = LRFU(half_life=8)
    for ids in ([1, 2], [1], [1, 3], [3]):
        policy.touch(0, ids)
    # 1: three uses, the last two visits ago; 3: two uses, the latest; 2: one use, oldest
    one, two, three = (record(slot=s, expert=e, last_use=u) for s, e, u in ((0, 1, 4), (1, 2, 2), (2, 3, 6)))
    assert sorted([one, two, three], key=policy.eviction_key) == [two, three, one]
    policy.touch(0, [4])
    policy.touch(0, [5])
    a, b = record(slot=3, expert=4, last_use=7), record(slot=4, expert=5, last_use=8)
    assert min([b, a], key=policy.eviction_key) is a  # 4 decayed one visit more than 5
    idle = record(slot=9, expert=None, layer=None, phase="idle")
    assert policy.eviction_key(idle) < policy.eviction_key(two)
    assert policy.admit(0, 6, two) and policy.adaptive_pins


# -- the manager under each policy -------------------------------------------------------------


@pytest.mark.parametrize(("replacement", "kept"), [("lru", {2, 3}), ("lrfu", {1, 3})])
def test_the_policy_chooses_the_victim(replacement, kept):
    manager = make(replacement=replacement)
    assert manager.replacement == replacement
    for ids in ([1], [1], [1], [2]):
        visit(manager, 0, ids)
    assert visit(manager, 0, [3]) == [False]
    # LRU drops 1 (least recent); LRFU drops 2 (used once, against 1's three uses)
    assert {expert for _, expert in resident(manager)} == kept
    assert visit(manager, 0, [1]) == [1 in kept]


def test_the_manager_default_is_the_seed_lru():
    plan = plan_expert_residency(
        budget_bytes=4, fixed_bytes=0, slot_bytes=1, sparse_layers=1, working_slots=2, pinned_experts=0
    )
    manager = ExpertResidencyManager(plan=plan, sparse_layer_ids=[0], backend=InMemoryBackend(4), locate=_locate)
    assert manager.replacement == "lru"


def test_policy_loads_do_not_count_as_uses():
    policy = LRFU()
    manager = make(replacement=policy, pins=[(0, 7)])
    asyncio.run(manager.preload_pinned())
    assert policy.score(0, 7) == 0.0
    visit(manager, 0, [7, 1])
    assert policy.score(0, 7) == 1.0 and policy.score(0, 1) == 1.0


@pytest.mark.parametrize("replacement", ["lru", "lrfu"])
def test_a_pin_that_stops_earning_its_slot_passes_to_a_hotter_expert_only_when_adaptive(replacement):
    manager = make(replacement=replacement, layers=(0, 1), per_layer=1, pins=[(0, 7), (1, 7)])
    asyncio.run(manager.preload_pinned())
    visit(manager, 0, [1])  # into the layer's idle slot
    visit(manager, 0, [1])
    assert visit(manager, 0, [2]) == [False]
    after = resident(manager)
    snapshot = manager.snapshot()
    assert (snapshot.pinned, snapshot.resident, snapshot.working) == (2, 2, 2)
    assert after[(1, 7)] == "pinned"  # the other layer is untouched
    if replacement == "lru":  # pins fixed: the layer's own slot turns over
        assert manager.pinned == ((0, 7), (1, 7))
        assert after == {(0, 7): "pinned", (0, 2): "resident", (1, 7): "pinned"}
    else:  # the unused pin went; its pin passed to 1, its slot now holds 2 as a slot of layer 0
        assert manager.pinned == ((0, 1), (1, 7))
        assert after == {(0, 1): "pinned", (0, 2): "resident", (1, 7): "pinned"}
        assert visit(manager, 0, [1, 2]) == [True, True]
        # Layer 0 still owns two slots (one pinned, one not), layer 1 too.
        assert len(manager._layer_slots[0]) == 1 and len(manager._layer_slots[1]) == 1


def test_a_pin_passes_to_a_slot_of_this_wave_and_stays_when_no_resident_can_take_it():
    manager = make(replacement="lrfu", per_layer=1, pins=[(0, 7)])
    asyncio.run(manager.preload_pinned())
    # 2 takes the idle layer slot; for 1 the only candidate is the unused pin 7, whose pin passes
    # to the layer's best resident, 2 (this wave's own slot: ready, so it may be pinned).
    assert visit(manager, 0, [1, 2]) == [False, False]
    assert manager.pinned == ((0, 2),) and resident(manager) == {(0, 2): "pinned", (0, 1): "resident"}

    manager = make(replacement="lrfu", per_layer=1, pins=[(0, 7)])
    asyncio.run(manager.preload_pinned())
    visit(manager, 0, [1])
    lease = asyncio.run(manager.acquire_block(0, [1]))
    (entry,) = lease.entries
    forged = type(entry)(entry.layer, entry.expert_id, entry.slot, entry.generation + 1, entry.hit)
    with pytest.raises(StaleLeaseError):
        manager.release_fenced([forged])  # the layer's one slot stays leased for good
    # The pin is the only candidate, but no ready slot of the layer can take its pin: it stays.
    assert visit(manager, 0, [2]) == [False]
    assert manager.pinned == ((0, 7),) and resident(manager) == {(0, 7): "pinned"}


def test_live_repin_stands_aside_for_adaptive_pins(tmp_path):
    candidates = {}
    for replacement in ("lru", "lrfu"):
        ledger = ExpertUsageLedger(tmp_path / f"{replacement}.usage", layers=[0], experts_per_layer=8)
        manager = make(replacement=replacement, pins=[(0, 7)], usage=ledger)
        asyncio.run(manager.preload_pinned())
        for _ in range(12):
            manager.record_routes(0, [[1, 2]])
            visit(manager, 0, [1, 2])
        candidates[replacement] = manager.repin_candidates()
    assert [(c.cold_expert_id, c.hot_expert_id in (1, 2)) for c in candidates["lru"]] == [(7, True)]
    assert candidates["lrfu"] == []


class DeclineAll(LRU):
    name = "decline-all"

    def admit(self, layer, expert_id, victim):
        return False


def test_a_declined_miss_is_served_and_dropped():
    manager = make(replacement=DeclineAll())
    visit(manager, 0, [1])  # admission is asked of every victim, an idle slot too
    assert resident(manager) == {} and visit(manager, 0, [1]) == [False]
    snapshot = manager.snapshot()
    assert (snapshot.hits, snapshot.misses, snapshot.evictions, snapshot.working) == (0, 2, 0, 2)


# -- a prediction's victims, ranked once ---------------------------------------------------

_PHASES = ("idle", "ready", "loading", "leased")


def _table(slots, pins=()):
    """One layer (0) of `slots` (phase, expert, last use) plus pinned slots holding `pins`."""
    table = SlotTable(InMemoryBackend(len(slots) + len(pins)))
    table.layer_slots[0] = set()
    for phase, expert, last_use in slots:
        record = table.new_slot("layer", 0)
        table.layer_slots[0].add(record.id)
        record.phase, record.last_use = phase, last_use
        if phase != "idle":
            record.expert_id = expert
            table.lookup[(0, expert)] = record.id
    for expert in pins:
        record = table.new_slot("pinned", 0)
        record.phase, record.expert_id = "ready", expert
        table.lookup[(0, expert)] = record.id
    return table


def _taken_one_by_one(policy, table, protected, pinned, want):
    taken = []
    while len(taken) < want and (victim := choose_victim(policy, table, 0, protected, pinned=pinned)) is not None:
        victim.phase = "loading"  # what a prefetch's read makes of it
        protected.add(victim.id)
        taken.append(victim.id)
    return taken


def _taken_in_order(policy, table, protected, pinned, want):
    taken, victims = [], victims_in_order(policy, table, 0, protected, pinned=pinned)
    while len(taken) < want and (victim := next(victims, None)) is not None:
        victim.phase = "loading"
        protected.add(victim.id)
        taken.append(victim.id)
    return taken


@settings(max_examples=150, deadline=None)
@given(
    spec=st.sampled_from(["lru", "lrfu", "nextuse"]),
    slots=st.lists(
        st.tuples(st.sampled_from(_PHASES), st.integers(0, 63), st.integers(0, 40)),
        min_size=1,
        max_size=24,
        unique_by=lambda slot: slot[1],
    ),
    visits=st.lists(st.lists(st.integers(0, 63), min_size=1, max_size=8, unique=True), max_size=6),
    protect=st.sets(st.integers(0, 23), max_size=6),
    want=st.integers(1, 30),
)
def test_a_prediction_takes_the_victims_choose_victim_gives_one_by_one(spec, slots, visits, protect, want):
    taken = []
    for take in (_taken_one_by_one, _taken_in_order):
        policy = replacement_policy(spec)
        for used in visits:  # the ranks of the layer (the same for both)
            policy.touch(0, used)
        table = _table(slots)
        taken.append(take(policy, table, set(protect), ([], set()), want))
    assert taken[0] == taken[1]
    assert len(set(taken[0])) == len(taken[0])


def test_a_prediction_whose_layer_holds_a_pin_passes_it_as_choose_victim_does():
    # LRFU ranks the pinned 9 (never used) lowest; its pin passes to the layer's best resident.
    results = []
    for take in (_taken_one_by_one, _taken_in_order):
        policy = LRFU()
        policy.touch(0, [1, 2])
        policy.touch(0, [1])
        table = _table([("ready", 1, 5), ("ready", 2, 6)], pins=[9])
        pin_list = [(0, 9)]
        pinned = (pin_list, set(pin_list))
        taken = take(policy, table, set(), pinned, 2)
        results.append((taken, list(pin_list), sorted(pinned[1])))
    assert results[0] == results[1]
    assert results[0][0][0] == 2 and results[0][1] == [(0, 1)]  # the pin's slot went first; 1 holds the pin
