"""The `nextuse` replacement policy (coordinator.next_use): what it learns, what it keeps, its edges.

The manager scenarios are where it parts ways with LRU: a routing cycle longer than the layer's
slots (LRU misses every time; the transitions tell which set comes next), a one-off miss that
is served but not kept in place of a pair in steady use, and the core promoting a wave's misses
in the policy's order. The model's own edges: the lazy decay of the transition counts equals a
plain decay, expert ids past the first size grow the arrays, and bad ids are refused with the
policy's state unchanged.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import coordinator.next_use as next_use
from coordinator.next_use import NextUse
from coordinator.replacement import replacement_policy
from tests.helpers.residency import make_manager as make
from tests.helpers.residency import record, resident, visit


def test_the_spec_names_the_transition_half_life():
    assert replacement_policy("nextuse").transition_half_life == next_use.DEFAULT_TRANSITION_HALF_LIFE
    assert replacement_policy("nextuse:32").transition_half_life == 32
    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="transition_half_life"):
            NextUse(transition_half_life=bad)


def _hit_rate(replacement, cycle, *, per_layer, rounds):
    manager = make(replacement=replacement, working=4, per_layer=per_layer)
    hits = [visit(manager, 0, cycle[i % len(cycle)]) for i in range(rounds * len(cycle))]
    late = hits[len(hits) // 2 :]
    return sum(map(sum, late)) / sum(map(len, late))


def test_a_cycle_longer_than_the_slots_misses_under_lru_and_hits_under_nextuse():
    cycle = [[1, 2], [3, 4], [5, 6]]  # six experts through four slots, always in this order
    assert _hit_rate("lru", cycle, per_layer=4, rounds=40) == 0.0
    # nextuse learns that after {5, 6} comes {1, 2}, and keeps the set that comes next
    assert _hit_rate("nextuse", cycle, per_layer=4, rounds=40) >= 0.45


def test_a_one_off_miss_is_served_and_not_kept_in_place_of_a_pair_in_steady_use():
    for replacement, hits in (("lru", [False, True]), ("nextuse", [True, True])):
        manager = make(replacement=replacement, per_layer=2)
        for _ in range(30):
            visit(manager, 0, [1, 2])
        assert visit(manager, 0, [9]) == [False]
        assert visit(manager, 0, [1, 2]) == hits, replacement  # LRU put 9 in place of 1
        if replacement == "nextuse":
            assert set(resident(manager)) == {(0, 1), (0, 2)}
            assert manager.snapshot().evictions == 0


def test_misses_are_promoted_likeliest_first_and_admitted_only_above_the_victim():
    policy = NextUse()
    for _ in range(20):
        policy.touch(0, [1, 2, 3])
    policy.touch(0, [1, 7])
    assert policy.rank(0, 1) > policy.rank(0, 7)  # used now and often beats used now once
    assert policy.promotion_order(0, [7, 1]) == [1, 7]
    cold, hot = record(slot=0, expert=7), record(slot=1, expert=1)
    assert policy.admit(0, 1, cold) and not policy.admit(0, 7, hot)
    assert policy.admit(0, 7, record(slot=2, layer=None, expert=None, phase="idle"))  # idle: always
    assert policy.eviction_key(cold) < policy.eviction_key(hot)
    assert policy.rank(0, 40) < policy.rank(0, 7)  # never used: least likely
    assert policy.rank(5, 1) == -math.inf and policy.rank(0, 10_000) == -math.inf  # never seen


def test_the_lazy_transition_decay_equals_decaying_every_count(monkeypatch):
    rng = np.random.default_rng(3)
    visits = [sorted(rng.choice(64, 6, replace=False).tolist()) for _ in range(120)]
    plain = NextUse(transition_half_life=2)
    for ids in visits:
        plain.touch(0, ids)
    plain_ranks = plain.ranks(0)  # folded before the patch
    monkeypatch.setattr(next_use, "_RESCALE_AT", 4.0)  # fold the scale back in every few visits
    folded = NextUse(transition_half_life=2)
    for ids in visits:
        folded.touch(0, ids)
    assert np.allclose(plain_ranks, folded.ranks(0), rtol=1e-5, atol=1e-6)  # float32 transitions
    assert np.allclose(plain.weights, folded.weights, rtol=1e-5)
    assert folded._layers[0]._scale <= 4.0 * 2**0.5


def test_ids_past_the_first_size_grow_the_model_and_keep_what_it_learned():
    policy = NextUse()
    for _ in range(10):
        policy.touch(3, [1, 2])
    before = policy.rank(3, 1)
    policy.touch(3, [1, 300])
    policy.settle()  # touches are folded in lazily (at the next rank, or here)
    assert policy._layers[3].experts >= 301
    assert math.isfinite(policy.rank(3, 300)) and policy.rank(3, 1) > policy.rank(3, 5)
    assert before != policy.rank(3, 1)
    policy.touch(3, [])  # an empty visit decays and learns; nothing breaks
    assert all(math.isfinite(w) for w in policy.weights)


def test_a_negative_id_is_refused_and_changes_nothing():
    policy = NextUse()
    policy.touch(0, [1, 2])
    with pytest.raises(ValueError, match=r"\[3, -1\]"):
        policy.touch(0, [3, -1])  # dormant: nothing queued
    weights, ranks = policy.weights, policy.ranks(0).copy()
    with pytest.raises(ValueError, match=r"\[1, -4\]"):
        policy.touch(0, [1, -4])  # awake: nothing learned
    assert policy.weights == weights and np.array_equal(policy.ranks(0), ranks)
    assert policy._layers[0].visits == 1


def _visits(seed, count, *, experts=64, k=6):
    rng = np.random.default_rng(seed)
    return [sorted(rng.choice(experts, k, replace=False).tolist()) for _ in range(count)]


def test_a_dormant_layer_folds_its_queued_visits_at_its_first_rank_as_if_ranked_all_along(monkeypatch):
    visits = _visits(5, 40)
    eager = NextUse()
    for ids in visits:
        eager.touch(0, ids)
        eager.rank(0, 0)  # awake from the first visit
    folds = []
    monkeypatch.setattr(next_use._LayerModel, "observe", _counting(next_use._LayerModel.observe, folds))
    lazy = NextUse()
    for ids in visits:
        lazy.touch(0, ids)
    assert folds == []  # dormant: the visits were only queued
    assert np.array_equal(lazy.ranks(0), eager.ranks(0)) and lazy.weights == eager.weights
    assert len(folds) == len(visits)


def test_a_dormant_layer_keeps_only_its_latest_visits():
    visits = _visits(6, next_use.DORMANT_VISITS + 30)
    everything, latest = NextUse(), NextUse()
    for ids in visits:
        everything.touch(2, ids)
    for ids in visits[-next_use.DORMANT_VISITS :]:
        latest.touch(2, ids)
    assert np.array_equal(everything.ranks(2), latest.ranks(2)) and everything.weights == latest.weights
    assert everything._layers[2].visits == next_use.DORMANT_VISITS


def _counting(method, calls):
    def counted(self, *args):
        calls.append(args)
        return method(self, *args)

    return counted


class CountingRanks(NextUse):
    """nextuse that records every layer it is asked to rank."""

    def __init__(self):
        super().__init__()
        self.asked = []

    def ranks(self, layer):
        self.asked.append(layer)
        return super().ranks(layer)


def test_a_layer_whose_slots_hold_every_expert_it_uses_is_never_ranked():
    """An all-resident layer never needs a victim, so the model never runs there (its CPU would
    come out of compute); the first miss that must meet a resident wakes it."""
    policy = CountingRanks()
    manager = make(replacement=policy, working=4, per_layer=8)
    for ids in _visits(7, 60, experts=8, k=3):
        visit(manager, 0, ids)
    assert policy.asked == [] and policy._layers == {}
    assert visit(manager, 0, [8, 9]) == [False, False]
    assert policy.asked and set(policy._layers) == {0}
    assert len(resident(manager)) == 8


class FixedRanks(NextUse):
    """nextuse with each expert's rank fixed to its id: the core's use of the ranks, by hand."""

    def rank(self, layer, expert_id):
        return float(expert_id)


def test_the_core_promotes_a_waves_misses_in_the_policys_order():
    """Residents 1 and 5; a wave misses 10 and 2 (the core's own order would promote 2 first).
    Likeliest first, 10 replaces 1 and 2 then loses to 5; in the other order 2 would have taken
    1's slot and 10 then 5's, keeping the less likely 2 over 5."""
    manager = make(replacement=FixedRanks(), per_layer=2)
    visit(manager, 0, [1])
    visit(manager, 0, [5])
    assert visit(manager, 0, [10, 2]) == [False, False]
    assert set(resident(manager)) == {(0, 5), (0, 10)}


def test_touches_fold_in_lazily_and_in_order_so_ranks_are_the_same_as_eager_folds():
    """`touch` only records; every rank (and the weights) settles first, in the touches' order: a
    policy settled after every touch and one settled only when asked rank identically."""
    eager, lazy = NextUse(), NextUse()
    visits = _visits(5, 60)
    for step, used in enumerate(visits):
        layer = step % 3
        for policy in (eager, lazy):
            policy.touch(layer, used)
        eager.settle()
        if step % 7 == 6:  # the lazy one is asked now and then, across layers
            assert np.array_equal(eager.ranks(layer), lazy.ranks(layer))
    assert lazy._pending  # touched since its last rank
    assert eager.weights == lazy.weights and not lazy._pending
    for layer in range(3):
        assert np.array_equal(eager.ranks(layer), lazy.ranks(layer))
