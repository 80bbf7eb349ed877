"""The residency manager's prefetch path (coordinator/residency_prefetch.py) and its book (coordinator/prefetch.py).

Over InMemoryBackend: predicted experts are read into the layer's reclaimable
slots, a demand lease that finds one still reading waits for that read (one
read, not two), a visited layer's unwanted reads are cancelled, what each
prefetch became is counted, and the adaptive book stops a layer whose
prefetches do not pay. A hypothesis state machine interleaves prefetches with
demand waves, fences and completions and checks that nothing a demand lease
holds is ever touched.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from coordinator.memory_backend import InMemoryBackend
from coordinator.metered_backend import LoadSamples, LoadTimer, MeteredBackend
from coordinator.prefetch import PrefetchBook, prefetch_count
from coordinator.residency import ExpertResidencyManager
from coordinator.residency_types import ResidencyPressureError
from shared.segments import ExpertIOSegment, ExpertResidencyLocation
from tests.helpers.residency import one_byte_plan, run_async


def locate(layer: int, expert: int) -> ExpertResidencyLocation:
    return ExpertResidencyLocation(layer, expert, (ExpertIOSegment(layer, expert * 100, 10 + expert, 0),))


def make(*, layers=(0, 1), working=2, per_layer=3, mode="on", manual=False, window=64, meter=None):
    plan = one_byte_plan(layers=layers, working=working, per_layer=per_layer)
    backend = InMemoryBackend(plan.total_slots, manual=manual)
    book = PrefetchBook(mode=mode, window=window)
    served = backend if meter is None else MeteredBackend(backend, slab=None, timer=meter, footprint=lambda: 0)
    manager = ExpertResidencyManager(
        plan=plan, sparse_layer_ids=list(layers), backend=served, locate=locate, prefetch=book
    )
    return manager, backend, book


async def wave(manager, layer, ids):
    lease = await manager.acquire_block(layer, ids)
    lease.release_fenced()
    return lease


def test_the_predicted_count_is_top_k_plus_a_margin():
    assert prefetch_count("auto", 8, None) == 10 and prefetch_count("on", 6, None) == 8
    assert prefetch_count("on", 2, None) == 3 and prefetch_count("on", 8, 0) == 8
    assert prefetch_count("off", 8, None) == 0
    with pytest.raises(ValueError, match="prefetch must be one of"):
        prefetch_count("sometimes", 8, None)


@run_async
async def test_prefetched_experts_are_demand_hits_and_count_as_useful():
    manager, _, book = make()
    assert manager.prefetch(1, [4, 5]) == 2
    await manager.settle_prefetch()
    lease = await manager.acquire_block(1, [4, 5])
    assert all(entry.hit for entry in lease.entries)
    lease.release_fenced()
    telemetry = book.drain()
    assert (telemetry.predicted, telemetry.issued, telemetry.useful, telemetry.wasted) == (2, 2, 2, 0)
    assert telemetry.issued_bytes == 14 + 15 and telemetry.waits == 0 and telemetry.precision == 1.0
    assert manager.drain_prefetch_io().loads == 2 and manager.drain_demand_telemetry().loads == 0


@run_async
async def test_a_demand_lease_waits_for_a_prefetch_in_flight_instead_of_reading_twice():
    manager, backend, book = make(manual=True)
    manager.prefetch(1, [4])
    slot = manager._lookup[(1, 4)]
    submits = backend.counters.submits
    demand = asyncio.ensure_future(manager.acquire_block(1, [4]))
    await asyncio.sleep(0.01)
    assert not demand.done() and backend.counters.submits == submits  # waiting, not reading again
    backend.complete(slot, backend.state(slot)[1])
    lease = await asyncio.wait_for(demand, 5)
    assert [(entry.slot, entry.hit) for entry in lease.entries] == [(slot, True)]
    lease.release_fenced()
    telemetry = book.drain()
    assert (telemetry.useful, telemetry.waits) == (1, 1) and telemetry.wait_ms > 0


@run_async
async def test_a_demand_reads_its_misses_while_it_waits_for_prefetches_in_flight():
    manager, backend, book = make(manual=True, working=3)
    manager.prefetch(0, [1, 2])
    prefetched = {manager._lookup[(0, 1)], manager._lookup[(0, 2)]}
    demand = asyncio.ensure_future(manager.acquire_block(0, [1, 2, 3]))
    await asyncio.sleep(0.01)
    reading = {slot for slot, _ in backend.pending()}
    assert prefetched < reading and len(reading - prefetched) == 1  # the miss is on its way already
    for slot, generation in backend.pending():
        backend.complete(slot, generation)
    lease = await asyncio.wait_for(demand, 5)
    assert sorted((entry.expert_id, entry.hit) for entry in lease.entries) == [(1, True), (2, True), (3, False)]
    lease.release_fenced()
    telemetry = book.drain()
    assert (telemetry.useful, telemetry.waits) == (2, 2)


@run_async
async def test_prefetch_reads_are_left_out_of_the_jobs_disk_and_wait_figures():
    timer = LoadTimer()
    manager, inner, _book = make(manual=True, meter=timer)
    manager.prefetch(1, [4, 5])
    for slot, generation in inner.pending():
        inner.complete(slot, generation)
    await manager.settle_prefetch()
    assert timer.take() == LoadSamples()  # prefetches are nobody's foreground wait
    demand = asyncio.ensure_future(manager.acquire_block(1, [4, 6]))
    await asyncio.sleep(0.01)
    for slot, generation in inner.pending():
        inner.complete(slot, generation)
    (await asyncio.wait_for(demand, 5)).release_fenced()
    taken = timer.take()
    assert len(taken.disk) == 1 and len(taken.wait) == 1  # the one demand miss (6), one wave


@run_async
async def test_a_failed_prefetch_leaves_a_plain_miss():
    manager, backend, book = make()
    backend.fail_load(lambda slot, segments: segments[0].offset == 400)
    manager.prefetch(1, [4])
    await manager.settle_prefetch()
    assert (1, 4) not in manager._lookup
    lease = await manager.acquire_block(1, [4])
    assert [entry.hit for entry in lease.entries] == [False]
    lease.release_fenced()
    telemetry = book.drain()
    assert (telemetry.issued, telemetry.useful, telemetry.wasted) == (1, 0, 1)


@run_async
async def test_a_visited_layer_cancels_its_unwanted_reads():
    manager, backend, book = make(manual=True)
    manager.prefetch(1, [4, 5, 6])
    assert manager.cancel_prefetch(1, keep=[5]) == 2
    await asyncio.sleep(0)  # the cancelled reads settle
    slot = manager._lookup[(1, 5)]
    backend.complete(slot, backend.state(slot)[1])
    await manager.settle_prefetch()
    assert set(key for key in manager._lookup if key[0] == 1) == {(1, 5)}
    telemetry = book.drain()
    assert (telemetry.issued, telemetry.wasted) == (3, 2) and telemetry.wasted_bytes == 14 + 16


@run_async
async def test_prefetch_never_touches_the_active_wave_nor_evicts_its_own_prediction():
    manager, backend, _book = make(per_layer=2)
    await wave(manager, 1, [7])
    lease = await manager.acquire_block(0, [0, 1])
    held = {entry.slot: entry.generation for entry in lease.entries}
    assert manager.prefetch(0, [2, 3]) == 0  # the active wave's layer
    assert manager.prefetch(1, [7, 8, 9]) == 1  # two slots: 7 (resident, kept) and one read (8)
    await manager.settle_prefetch()
    assert {key for key in manager._lookup if key[0] == 1} == {(1, 7), (1, 8)}
    assert {entry.slot: backend.state(entry.slot)[1] for entry in lease.entries} == held
    assert all(backend.state(slot)[0] == "leased" for slot in held)
    lease.release_fenced()


@run_async
async def test_an_unused_prefetch_evicted_later_counts_as_wasted():
    manager, _backend, book = make(per_layer=1)
    manager.prefetch(1, [4])
    await manager.settle_prefetch()
    await wave(manager, 1, [6])  # the demand miss is promoted over the unused prefetch
    telemetry = book.drain()
    assert (telemetry.issued, telemetry.useful, telemetry.wasted, telemetry.wasted_bytes) == (1, 0, 1, 14)


@run_async
async def test_auto_stops_a_layer_whose_prefetches_do_not_pay_and_on_keeps_it(caplog):
    caplog.set_level("INFO", logger="coordinator.prefetch")
    for mode, stops in (("auto", True), ("on", False)):
        manager, _, book = make(per_layer=1, mode=mode, window=4)
        for step in range(6):
            manager.prefetch(1, [10 + step])  # always wrong: each evicts the last, unused
            await manager.settle_prefetch()
            await wave(manager, 1, [step])
        assert (1 in book.drain().disabled_layers) is stops
        assert (manager.prefetch(1, [40]) == 0) is stops
    assert "prefetch for layer 1 stopped: 0 of its last 4" in caplog.text


@run_async
async def test_off_predicts_nothing():
    manager, _, book = make(mode="off")
    assert manager.prefetch(1, [4]) == 0
    assert book.drain().predicted == 1


def complete_all(backend: InMemoryBackend) -> None:
    """Finish every read in flight (a manual backend)."""
    for slot, generation in backend.pending():
        backend.complete(slot, generation)


def check_lookup(manager: ExpertResidencyManager) -> None:
    """The lookup maps each expert to one slot, and that slot holds it (loading or resident)."""
    for (layer, expert), slot in manager._lookup.items():
        record = manager._slots[slot]
        assert (record.layer, record.expert_id) == (layer, expert) and record.phase != "idle"
    assert len(set(manager._lookup.values())) == len(manager._lookup)


def run_in(loop: asyncio.AbstractEventLoop, call):
    """`call()` inside `loop` (the prefetch path starts tasks on the running loop)."""

    async def run():
        return call()

    return loop.run_until_complete(run())


class PrefetchMachine(RuleBasedStateMachine):
    """Demand waves, fences, prefetches, cancels and read completions (some failing) in any order
    (manual backend); nothing a demand lease holds is ever touched."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.manager, self.backend = self.start()
        self.lease = None
        self.held: dict[int, int] = {}
        self.pending: asyncio.Future | None = None

    def start(self) -> tuple[ExpertResidencyManager, InMemoryBackend]:
        manager, backend, _ = make(layers=(0, 1, 2), working=3, per_layer=2, manual=True)
        return manager, backend

    def teardown(self) -> None:
        for _ in range(100):  # let every read land and every task finish (a demand may read again)
            complete_all(self.backend)
            self._spin()
            if (self.pending is None or self.pending.done()) and not self.manager._reads:
                break
        if self.pending is not None and self.pending.done() and not self.pending.cancelled():
            self.pending.exception()
        self.loop.close()

    def _spin(self) -> None:
        self.loop.run_until_complete(asyncio.sleep(0))

    @precondition(lambda self: self.lease is None and self.pending is None)
    @rule(layer=st.integers(0, 2), experts=st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True))
    def demand(self, layer, experts):
        self.pending = asyncio.ensure_future(self.manager.acquire_block(layer, experts), loop=self.loop)
        self._spin()

    @rule(fail=st.booleans())
    def complete_reads(self, fail):
        if fail:
            self.backend.fail_load(lambda slot, segments: True)  # the next read submitted fails
        complete_all(self.backend)
        for _ in range(3):
            self._spin()
        if self.pending is not None and self.pending.done():
            error = self.pending.exception()
            if error is None:
                self.lease = self.pending.result()
                self.held = {entry.slot: entry.generation for entry in self.lease.entries}
            else:
                assert isinstance(error, OSError), error  # a failed read fails its wave, nothing else
            self.pending = None

    @precondition(lambda self: self.lease is not None)
    @rule()
    def fence(self):
        self.lease.release_fenced()
        self.lease, self.held = None, {}

    @rule(layer=st.integers(0, 2), experts=st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True))
    def prefetch(self, layer, experts):
        run_in(self.loop, lambda: self.manager.prefetch(layer, experts))
        self._spin()

    @rule(layer=st.integers(0, 2), keep=st.lists(st.integers(0, 5), max_size=3))
    def cancel(self, layer, keep):
        self.manager.cancel_prefetch(layer, keep)
        self._spin()

    @invariant()
    def demand_leases_are_untouched(self):
        for slot, generation in self.held.items():
            assert self.backend.state(slot)[:2] == ("leased", generation)

    @invariant()
    def the_lookup_maps_each_expert_to_one_slot_holding_it(self):
        check_lookup(self.manager)


class PinnedPrefetchMachine(PrefetchMachine):
    """The same, with everything else the lease path does: pins, the replacement policy
    `replacement`, demand waves abandoned mid-read, and pressure correction."""

    replacement = "lru"

    def start(self) -> tuple[ExpertResidencyManager, InMemoryBackend]:
        plan = one_byte_plan(layers=(0, 1, 2), working=3, per_layer=2, pins=3)
        backend = InMemoryBackend(plan.total_slots)
        manager = ExpertResidencyManager(
            plan=plan,
            sparse_layer_ids=[0, 1, 2],
            backend=backend,
            locate=locate,
            pinned=[(0, 0), (1, 1), (2, 2)],
            replacement=self.replacement,
            prefetch=PrefetchBook(mode="on"),
        )
        self.loop.run_until_complete(manager.preload_pinned())
        backend.manual = True
        return manager, backend

    @precondition(lambda self: self.pending is not None)
    @rule()
    def abandon(self):
        """The worker went away mid-read: the demand wave is cancelled."""
        if self.pending.done():
            if self.pending.exception() is None:
                self.pending.result().release_fenced()
        else:
            self.pending.cancel()
            for _ in range(40):
                self._spin()
            assert self.pending.done()
        self.pending = None

    @precondition(lambda self: self.lease is None and self.pending is None)
    @rule(over=st.booleans())
    def pressure(self, over):
        """A footprint measured over the budget shrinks the layers (for the run); one under it does nothing."""
        before = self.manager.snapshot().pressure_evictions
        self.backend.footprint = 10**6 if over else 0
        try:
            self.manager.correct_for_pressure()
        except ResidencyPressureError:
            assert over  # every layer is down to its one slot: the pressure cannot be met
        finally:
            self.backend.footprint = None
        if not over:
            assert self.manager.snapshot().pressure_evictions == before

    @invariant()
    def a_resident_pin_lives_in_a_pinned_slot(self):
        pins = self.manager.pinned
        assert len(pins) == len(set(pins)), pins
        for key in pins:
            if key in self.manager._lookup:
                assert self.manager._slots[self.manager._lookup[key]].role == "pinned", key


class PinnedLRFUPrefetchMachine(PinnedPrefetchMachine):
    replacement = "lrfu:1"  # a short half-life: pins pass on often


class PinnedNextUsePrefetchMachine(PinnedPrefetchMachine):
    replacement = "nextuse:1"  # declines misses, promotes by rank, passes pins


def _machine_settings(examples: int) -> settings:
    return settings(
        max_examples=examples, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )


PrefetchMachine.TestCase.settings = _machine_settings(60)
PinnedPrefetchMachine.TestCase.settings = _machine_settings(50)
PinnedLRFUPrefetchMachine.TestCase.settings = _machine_settings(50)
PinnedNextUsePrefetchMachine.TestCase.settings = _machine_settings(50)
test_prefetch_state_machine = PrefetchMachine.TestCase
test_prefetch_with_pins_failures_and_pressure_lru = PinnedPrefetchMachine.TestCase
test_prefetch_with_pins_failures_and_pressure_lrfu = PinnedLRFUPrefetchMachine.TestCase
test_prefetch_with_pins_failures_and_pressure_nextuse = PinnedNextUsePrefetchMachine.TestCase
