"""Property-based tests of the residency manager over the in-memory backend.

A hypothesis state machine drives random acquires (some with failing loads),
held leases, fenced and stale releases, pressure correction, repins and hints,
and checks the invariants the slab relies on after every step; it runs once
per replacement policy (`TestResidencyMachine` is the seed's `lru`).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from coordinator.memory_backend import BackendProtocolError, InMemoryBackend
from coordinator.residency import ExpertResidencyManager
from coordinator.residency_types import ResidencyError, ResidencyPressureError, StaleLeaseError
from shared.config import REPLACEMENT_POLICIES
from shared.plan import plan_expert_residency
from shared.segments import ExpertIOSegment, ExpertResidencyLocation

EXPERTS = 8
SLOT_BYTES = 10


def _locate(layer: int, expert: int) -> ExpertResidencyLocation:
    # The offset encodes (layer, expert) so injected failures can target one expert.
    return ExpertResidencyLocation(
        layer,
        expert,
        (ExpertIOSegment(file=0, offset=(layer * EXPERTS + expert) * SLOT_BYTES, length=SLOT_BYTES, destination=0),),
    )


class ResidencyMachine(RuleBasedStateMachine):
    replacement = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.held = None
        self.requests = 0

    def teardown(self) -> None:
        self.loop.close()

    @initialize(
        layers=st.integers(1, 3),
        working=st.integers(1, 4),
        per_layer=st.integers(1, 4),
        pinned=st.integers(0, 2),
    )
    def setup(self, layers: int, working: int, per_layer: int, pinned: int) -> None:
        layer_ids = [layer * 2 + 1 for layer in range(layers)]  # non-contiguous ids on purpose
        budget = (working + pinned + layers * per_layer) * SLOT_BYTES
        self.plan = plan_expert_residency(
            budget_bytes=budget,
            fixed_bytes=0,
            slot_bytes=SLOT_BYTES,
            sparse_layers=layers,
            working_slots=working,
            pinned_experts=pinned,
        )
        assert self.plan.slots_per_layer == per_layer
        self.backend = InMemoryBackend(self.plan.total_slots, slot_bytes=SLOT_BYTES, record_history=True)
        self.layer_ids = layer_ids
        pins = [(layer_ids[i % layers], EXPERTS - 1 - i // layers) for i in range(pinned)]
        self.manager = ExpertResidencyManager(
            plan=self.plan,
            sparse_layer_ids=layer_ids,
            backend=self.backend,
            locate=_locate,
            pinned=pins,
            replacement=self.replacement,
        )
        assert self.manager.replacement == self.replacement.partition(":")[0]
        if pinned:
            self.loop.run_until_complete(self.manager.preload_pinned())
            self.manager.drain_policy_telemetry()

    # -- rules -------------------------------------------------------------

    def _resident(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self.manager._lookup

    # After a stale fence the wave's slots stay leased for good (the seed's
    # conservative choice); the machine then stops issuing demand acquires.
    @precondition(lambda self: self.held is None and not getattr(self, "abandoned", None))
    @rule(data=st.data(), fail=st.booleans(), hold=st.booleans())
    def acquire(self, data, fail: bool, hold: bool) -> None:
        layer = data.draw(st.sampled_from(self.layer_ids))
        experts = data.draw(
            st.lists(st.integers(0, EXPERTS - 1), min_size=1, max_size=self.plan.working_slots, unique=True)
        )
        resident_before = {e for e in experts if self._resident(layer, e)}
        misses = [e for e in experts if e not in resident_before]
        snapshot_before = self.manager.snapshot()
        failing = None
        if fail and misses:
            failing = data.draw(st.sampled_from(misses))
            offset = (layer * EXPERTS + failing) * SLOT_BYTES
            self.backend.fail_load(lambda slot, segments, offset=offset: segments[0].offset == offset)
        try:
            lease = self.loop.run_until_complete(self.manager.acquire_block(layer, experts))
        except OSError:
            event("acquire: injected load failure")
            assert failing is not None
            after = self.manager.snapshot()
            assert after.leased == 0 and after.loading == 0
            assert (after.hits, after.misses) == (snapshot_before.hits, snapshot_before.misses)
            # Hits stay resident; nothing of the failed wave was kept.
            for expert in experts:
                assert self._resident(layer, expert) == (expert in resident_before)
            assert not self.manager.active
            return
        assert failing is None
        event(f"acquire: {'all hits' if not misses else 'with misses'}")
        self.requests += len(experts)
        assert [entry.expert_id for entry in lease.entries] == experts
        for entry in lease.entries:
            assert entry.hit == (entry.expert_id in resident_before)
            assert self.backend.state(entry.slot) == ("leased", entry.generation)
        if hold:
            self.held = lease
        else:
            lease.release_fenced()

    @precondition(lambda self: self.held is not None)
    @rule()
    def release(self) -> None:
        lease, self.held = self.held, None
        history_start = len(self.backend.counters.history)
        lease.release_fenced()
        leased_slots = {entry.slot for entry in lease.entries}
        # Release only releases; promotion may discard *other* (victim) slots.
        for action, slot, _ in self.backend.counters.history[history_start:]:
            assert action in ("release", "discard")
            if action == "discard":
                assert slot not in leased_slots or not any(e.hit for e in lease.entries if e.slot == slot)

    @precondition(lambda self: self.held is not None)
    @rule(data=st.data())
    def everything_else_waits_for_the_fence(self, data) -> None:
        history_start = len(self.backend.counters.history)
        with pytest.raises(ResidencyError):
            self.loop.run_until_complete(self.manager.acquire_block(self.layer_ids[0], [0]))
        with pytest.raises(ResidencyError):
            self.manager.correct_for_pressure()
        with pytest.raises(ResidencyError):
            self.loop.run_until_complete(self.manager.preload_pinned())
        self.manager.hint_experts(self.layer_ids[0], [0, 1, 2])
        assert self.backend.counters.history[history_start:] == []

    @precondition(lambda self: self.held is not None)
    @rule(bump=st.integers(1, 3))
    def stale_release_is_detected(self, bump: int) -> None:
        lease, self.held = self.held, None
        entry = lease.entries[0]
        forged = SimpleNamespace(
            layer=entry.layer, expert_id=entry.expert_id, slot=entry.slot, generation=entry.generation + bump
        )
        history_start = len(self.backend.counters.history)
        with pytest.raises(StaleLeaseError):
            self.manager.release_fenced([forged])
        # A stale fence releases nothing: the slots stay leased, never reused.
        assert self.backend.counters.history[history_start:] == []
        assert all(self.backend.state(e.slot)[0] == "leased" for e in lease.entries)
        self.abandoned = getattr(self, "abandoned", set()) | {e.slot for e in lease.entries}

    @precondition(lambda self: self.held is None)
    @rule(excess=st.integers(-1, 3))
    def pressure(self, excess: int) -> None:
        manager = self.manager
        before = manager.snapshot()
        evictable = 0
        for layer in self.layer_ids:
            slots = manager._layer_slots[layer]
            ready = sum(1 for i in slots if manager._slots[i].phase == "ready")
            evictable += min(ready, len(slots) - 1)
        self.backend.extra_footprint = self.plan.budget_bytes + excess * SLOT_BYTES - self.backend.physical_footprint()
        try:
            after = manager.correct_for_pressure()
            event(f"pressure: evicted {after.pressure_evictions - before.pressure_evictions}")
            assert excess <= evictable
            assert after.pressure_evictions - before.pressure_evictions == max(0, excess)
            assert after.physical_footprint <= self.plan.budget_bytes
        except ResidencyPressureError as error:
            event("pressure: could not reach budget")
            assert excess > evictable
            assert manager.snapshot().pressure_evictions - before.pressure_evictions == evictable
            assert str(self.plan.budget_bytes) in str(error)
        finally:
            self.backend.extra_footprint = 0

    @precondition(
        lambda self: self.held is None and self.plan.pinned_slots > 0 and not getattr(self, "abandoned", None)
    )
    @rule(data=st.data())
    def repin(self, data) -> None:
        pins = list(self.manager.pinned)
        layer, cold = data.draw(st.sampled_from(pins))
        others = [e for e in range(EXPERTS) if (layer, e) not in set(pins)]
        assume(others)
        hot = data.draw(st.sampled_from(others))
        if not self._resident(layer, cold):
            return  # the cold pin was lost to a failure injection; nothing to swap
        candidate = SimpleNamespace(layer=layer, cold_expert_id=cold, hot_expert_id=hot, gain=1)
        if self.manager._replacement.adaptive_pins:  # the policy moves its pins itself
            history_start = len(self.backend.counters.history)
            with pytest.raises(ResidencyError, match="fixed pins"):
                self.loop.run_until_complete(self.manager.apply_repin(candidate))
            assert self.backend.counters.history[history_start:] == [] and self.manager.pinned == tuple(pins)
            event("repin: refused under adaptive pins")
            return
        repinned = self.loop.run_until_complete(self.manager.apply_repin(candidate))
        event("repin: swapped")
        assert (repinned.evicted_pin, repinned.admitted_pin) == (cold, hot)
        assert (layer, hot) in self.manager.pinned and (layer, cold) not in self.manager.pinned
        assert self._resident(layer, hot) and self._resident(layer, cold)

    @precondition(lambda self: self.held is None)
    @rule(data=st.data())
    def hint(self, data) -> None:
        layer = data.draw(st.sampled_from(self.layer_ids))
        experts = data.draw(st.lists(st.integers(0, EXPERTS - 1), max_size=4))
        history_start = len(self.backend.counters.history)
        self.manager.hint_experts(layer, experts)
        assert self.backend.counters.history[history_start:] == []

    # -- invariants ----------------------------------------------------------

    @invariant()
    def lookup_maps_only_live_slots_holding_that_expert(self) -> None:
        if not hasattr(self, "manager"):
            return
        for (layer, expert), slot in self.manager._lookup.items():
            record = self.manager._slots[slot]
            assert record.phase in ("ready", "leased"), (layer, expert, record)
            assert (record.layer, record.expert_id) == (layer, expert)
            assert self.backend.state(slot)[0] == record.phase

    @invariant()
    def manager_and_backend_agree(self) -> None:
        if not hasattr(self, "manager"):
            return
        for record in self.manager._slots:
            if record.role == "disabled":
                continue
            state, generation = self.backend.state(record.id)
            assert state == record.phase, record
            assert generation == record.generation

    @invariant()
    def every_layer_keeps_a_slot_and_roles_add_up(self) -> None:
        if not hasattr(self, "manager"):
            return
        for layer in self.layer_ids:
            assert len(self.manager._layer_slots[layer]) >= 1
        snap = self.manager.snapshot()
        assert snap.working + snap.resident + snap.pinned + snap.disabled == self.plan.total_slots
        assert snap.pinned == self.plan.pinned_slots
        assert snap.working == self.plan.working_slots

    @invariant()
    def pins_are_the_pinned_slots_contents(self) -> None:
        """Adaptive or not, the pin list keeps its size, names distinct experts of sparse layers,
        and a pinned slot holds a pinned expert; a resident pinned expert sits in a pinned slot."""
        if not hasattr(self, "manager"):
            return
        manager = self.manager
        pins = manager.pinned
        assert len(pins) == len(set(pins)) == self.plan.pinned_slots
        assert all(layer in self.layer_ids for layer, _ in pins)
        for record in manager._slots:
            if record.role == "pinned" and record.phase != "idle":
                assert (record.layer, record.expert_id) in pins, record
        for key in pins:
            if key in manager._lookup:
                assert manager._slots[manager._lookup[key]].role == "pinned", key

    @invariant()
    def hits_plus_misses_equal_requests(self) -> None:
        if not hasattr(self, "manager"):
            return
        snap = self.manager.snapshot()
        assert snap.hits + snap.misses == self.requests

    @invariant()
    def nothing_loading_between_steps(self) -> None:
        if not hasattr(self, "manager"):
            return
        snap = self.manager.snapshot()
        assert snap.loading == 0
        expected_leased = len(self.held.entries) if self.held is not None else 0
        expected_leased += len(getattr(self, "abandoned", ()))
        assert snap.leased == expected_leased


ResidencyMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestResidencyMachine = ResidencyMachine.TestCase


class LrfuResidencyMachine(ResidencyMachine):
    replacement = "lrfu"


class ShortHalfLifeResidencyMachine(ResidencyMachine):
    replacement = "lrfu:1"  # scores fall fast: pins pass between experts often


class NextUseResidencyMachine(ResidencyMachine):
    replacement = "nextuse:1"  # transitions forgotten fast: ranks, admissions and pins move often


for _machine in (LrfuResidencyMachine, ShortHalfLifeResidencyMachine, NextUseResidencyMachine):
    _machine.TestCase.settings = ResidencyMachine.TestCase.settings
TestLrfuResidencyMachine = LrfuResidencyMachine.TestCase
TestShortHalfLifeResidencyMachine = ShortHalfLifeResidencyMachine.TestCase
TestNextUseResidencyMachine = NextUseResidencyMachine.TestCase


def test_every_replacement_policy_has_a_machine() -> None:
    machines = (ResidencyMachine, LrfuResidencyMachine, ShortHalfLifeResidencyMachine, NextUseResidencyMachine)
    assert {machine.replacement.partition(":")[0] for machine in machines} == set(REPLACEMENT_POLICIES)


@given(
    slot_bytes=st.integers(1, 1 << 24),
    layers=st.integers(1, 64),
    working=st.integers(1, 128),
    pinned=st.integers(0, 64),
    fixed=st.integers(0, 1 << 34),
    extra=st.integers(0, 1 << 36),
    cap=st.one_of(st.none(), st.integers(1, 64)),
)
@settings(max_examples=300, deadline=None)
def test_plan_never_exceeds_budget(slot_bytes, layers, working, pinned, fixed, extra, cap) -> None:
    floor = fixed + (working + pinned + layers) * slot_bytes
    budget = floor + extra
    plan = plan_expert_residency(
        budget_bytes=budget,
        fixed_bytes=fixed,
        slot_bytes=slot_bytes,
        sparse_layers=layers,
        working_slots=working,
        pinned_experts=pinned,
        max_slots_per_layer=cap,
    )
    assert plan.planned_bytes <= budget
    assert plan.slots_per_layer >= 1
    assert plan.total_slots == working + pinned + plan.slots_per_layer * layers
    assert plan.slab_bytes == plan.total_slots * slot_bytes
    if cap is None or plan.slots_per_layer < cap:
        # Maximal: one more slot per layer would not fit.
        assert plan.planned_bytes + layers * slot_bytes > budget
    with pytest.raises(ValueError, match="cannot start"):
        plan_expert_residency(
            budget_bytes=floor - 1 if floor > 1 else 1,
            fixed_bytes=fixed + (1 if floor <= 1 else 0),
            slot_bytes=slot_bytes,
            sparse_layers=layers,
            working_slots=working,
            pinned_experts=pinned,
        )


def test_backend_refuses_what_the_manager_must_never_do() -> None:
    """The fake backend is the invariant's witness: prove it can fail."""
    backend = InMemoryBackend(2)
    backend.submit_segments(0, 1, ())
    backend.lease(0, 1)
    with pytest.raises(BackendProtocolError):
        backend.submit_segments(0, 2, ())
    with pytest.raises(BackendProtocolError):
        backend.discard(0, 1)
