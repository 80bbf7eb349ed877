"""The shared lease path makes exactly the residency decisions the message path makes.

A routing trace is replayed through two lease services, each over its own residency manager
(InMemoryBackend, no processes). The message path: every decode visit a `routes` -> `lease`
round trip with the previous fence piggybacked, and `fence` at each token's end. The shared
path: a reader that behaves as the GPU worker's `LeaseClient` does (gpuworker/lease_client.py)
leases published experts through the lease words, only when the coordinator has processed
every residency message it sent, counts out at once (the copy path), and tells the visits in
one `visited` before its next message or at the token's end, carrying a pending fence.

After every token both must agree on hits, misses and evictions, on which slot holds which
expert, and on the routes recorded; the lease words must publish exactly the ready residents.
Traces: synthetic ones with prompt-like reuse, random ones (hypothesis), and the real
DeepSeek-V2-Lite routing of ../shared/traces when this checkout has it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.lease_publisher import LeasePublisher, PublishingBackend
from coordinator.leases import LeaseRefused, LeaseService
from coordinator.memory_backend import InMemoryBackend
from coordinator.prefetch import PrefetchBook
from coordinator.residency import ExpertResidencyManager
from shared.gpu_messages import COORDINATOR_ACCEPTS_FROM_GPU, Fence, Fenced, Lease, RouteMatrix, Routes, Visited
from shared.lease_words import LeaseWords, lease_words_bytes
from shared.protocol import decode, encode
from shared.segments import ExpertIOSegment, ExpertResidencyLocation
from shared.trace import Trace, generate_trace, read_trace
from tests.helpers.residency import one_byte_plan, run_async

REAL_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "dsv2lite-dev.txt.gz"


def _locate(layer: int, expert: int) -> ExpertResidencyLocation:
    return ExpertResidencyLocation(layer, expert, (ExpertIOSegment(file=0, offset=0, length=64, destination=0),))


def _wire(message):
    return decode(encode(message), COORDINATOR_ACCEPTS_FROM_GPU)  # as it arrives over the wire


class _Side:
    """One lease service over its own manager; `words` given: the shared path's publisher too."""

    def __init__(self, layers, experts, *, per_layer, working, replacement, shared: bool) -> None:
        plan = one_byte_plan(layers=layers, working=working, per_layer=per_layer)
        self.routes: list[tuple[int, tuple[int, ...]]] = []
        self.words = None
        inner = InMemoryBackend(plan.total_slots)
        if shared:
            size = lease_words_bytes(slots=plan.total_slots, layers=max(layers) + 1, experts=experts)
            self.words = LeaseWords(
                bytearray(size), offset=0, slots=plan.total_slots, layers=max(layers) + 1, experts=experts
            )
        self.publisher = LeasePublisher(self.words)
        self.manager = ExpertResidencyManager(
            plan=plan,
            sparse_layer_ids=layers,
            backend=PublishingBackend(inner, self.publisher),
            locate=_locate,
            prefetch=PrefetchBook(mode="off"),
            replacement=replacement,
            route_observer=lambda layer, rows: self.routes.append((layer, tuple(np.asarray(rows).reshape(-1)))),
        )
        self.publisher.attach(self.manager)
        self.service = LeaseService(manager=self.manager, experts_per_layer=experts)
        self.unsent: int | None = None  # the message path's lease fenced, not yet told
        self.sent = 0
        self.visits: list[tuple[int, np.ndarray]] = []
        self.carried: int | None = None
        self.shared_visits = 0

    async def _send(self, message):
        """The coordinator's handling of one worker message (coordinator.service._gpu_message)."""
        if self.visits:
            await self._send_visited(end_step=False)
        reply = await self.service.handle(_wire(message))
        self.publisher.processed()
        assert self.publisher.stale() == []  # the changed slots re-matched are all that changed
        self.sent += 1
        return reply

    async def _send_visited(self, *, end_step: bool) -> None:
        fence, self.carried = self.carried, None
        counts = tuple(rows.shape[0] for _, rows in self.visits)
        message = Visited(
            layers=tuple(layer for layer, _ in self.visits),
            routes=RouteMatrix(np.concatenate([rows for _, rows in self.visits])),
            fence=fence,
            end_step=end_step,
            visit_rows=counts if set(counts) != {1} else (),
        )
        self.visits = []
        reply = await self.service.handle(_wire(message))
        assert reply == (None if fence is None else Fenced(lease_id=fence)), reply
        if fence is not None:
            self.publisher.processed()
            assert self.publisher.stale() == []
            self.sent += 1

    async def visit(self, layer: int, rows: np.ndarray) -> None:
        """One layer visit of a decode step: one route row per sequence decoding together."""
        rows = np.atleast_2d(rows).astype(np.int32)
        if self.words is not None and self.words.processed() == self.sent:
            slots = self.words.lease(layer, list(dict.fromkeys(rows.reshape(-1).tolist())))
            if slots is not None:
                self.words.release(slots)  # the copy is done: nothing reads the slots
                if self.unsent is not None:
                    self.carried, self.unsent = self.unsent, None
                self.visits.append((layer, rows))
                self.shared_visits += 1
                return
        lease = await self._send(Routes(layer=layer, routes=RouteMatrix(rows), fence=self.unsent))
        assert isinstance(lease, Lease) and lease.waves == 1, lease
        self.unsent = lease.lease_id

    async def end_step(self) -> None:
        if self.visits:
            await self._send_visited(end_step=self.unsent is None)
        if self.unsent is not None:
            lease_id, self.unsent = self.unsent, None
            assert await self._send(Fence(lease_id=lease_id)) == Fenced(lease_id=lease_id)

    def decisions(self) -> tuple:
        snap = self.manager.snapshot()
        resident = sorted((e.slot, e.layer, e.expert_id) for e in self.manager.residency_map())
        return snap.hits, snap.misses, snap.evictions, tuple(resident), len(self.routes)

    def check_published(self) -> None:
        """The lease words publish exactly the ready residents, each at its slot."""
        assert self.words is not None
        table = self.manager.slot_table
        for layer in self.manager.sparse_layer_ids:
            for expert in range(self.words.experts):
                slot = table.lookup.get((layer, expert))
                ready = slot is not None and table.slots[slot].phase in ("ready", "leased")
                entry = self.words.entry(layer, expert)
                if ready:
                    assert entry is not None and entry[0] == slot and not self.words.claimed(slot), (layer, expert)
                    assert self.words.generation(slot) == entry[1]
                else:
                    assert entry is None or self.words.generation(entry[0]) != entry[1], (layer, expert, entry)
        assert all(self.words.readers(slot) == 0 for slot in range(self.words.slots))


async def _replay(
    trace: Trace, *, per_layer: int, replacement: str = "lru", tokens: int | None = None, rows: int = 1
) -> _Side:
    """Both paths through the trace; `rows` > 1: that many consecutive tokens decode together
    (a batched step's visit of a layer holds each one's route row), in a working bank for them."""
    layers = trace.layer_ids
    experts = trace.num_experts
    working = max(trace.top_k, 2) * rows
    sides = [
        _Side(layers, experts, per_layer=per_layer, working=working, replacement=replacement, shared=shared)
        for shared in (False, True)
    ]
    order = np.unique(trace.tokens)
    order = order[:tokens] if tokens else order
    for count in range(0, len(order), rows):
        batch = [np.flatnonzero(trace.tokens == token) for token in order[count : count + rows]]
        for side in sides:
            for layer in layers:  # every token visits the sparse layers in order
                visit = [trace.experts[at[trace.layers[at] == layer][0]] for at in batch if layer in trace.layers[at]]
                if visit:
                    await side.visit(int(layer), np.stack(visit))
            await side.end_step()
        assert sides[0].decisions() == sides[1].decisions(), f"step {count}"
        assert sides[0].routes == sides[1].routes
    sides[1].check_published()
    return sides[1]


@pytest.mark.parametrize("replacement", ["lru", "lrfu"])
@pytest.mark.parametrize("per_layer", [2, 6, 16])
@run_async
async def test_a_prompt_like_trace_gets_the_same_decisions_on_both_paths(per_layer, replacement):
    trace = generate_trace(layers=4, experts=24, top_k=4, tokens=120, overlap=0.5, zipf=1.0, seed=per_layer)
    shared = await _replay(trace, per_layer=per_layer, replacement=replacement)
    assert shared.manager.snapshot().misses > 0  # the message path ran
    if per_layer >= 6:  # room for a visit's 4 experts to be resident together: the shared path ran
        assert shared.shared_visits > 0


@run_async
async def test_every_visit_of_a_fully_resident_model_after_the_first_token_is_shared():
    trace = generate_trace(layers=3, experts=8, top_k=2, tokens=40, overlap=0.3, seed=1)
    shared = await _replay(trace, per_layer=8)
    visits = trace.num_visits
    # The first visit of each expert loads it; once all are resident nothing takes messages.
    assert shared.shared_visits >= visits - 3 * 8


@pytest.mark.parametrize("rows", [2, 4])
@pytest.mark.parametrize("per_layer", [3, 8, 24])
@run_async
async def test_batched_decode_steps_get_the_same_decisions_on_both_paths(rows, per_layer):
    """Several sequences' rows in one visit (`visited` with `visit_rows`) are recorded as one
    `routes` of those rows would have been: ledger, recency, evictions, slot contents."""
    trace = generate_trace(layers=4, experts=24, top_k=4, tokens=96, overlap=0.5, zipf=1.0, seed=rows + per_layer)
    shared = await _replay(trace, per_layer=per_layer, rows=rows)
    assert shared.manager.snapshot().misses > 0
    if per_layer == 24:  # every expert fits: after the first steps, batched visits are leased shared
        assert shared.shared_visits > trace.num_visits // rows // 2


@pytest.mark.parametrize(
    ("rows", "visit_rows", "says"),
    [
        ([[1, 2], [3, 4], [5, 6]], (2,), "rows to each of 2 visits"),
        ([[1, 2], [3, 4], [5, 6]], (1, 1), "3 route rows for visits of 2"),
        ([[1, 2], [3, 4], [5, 6]], (0, 3), "rows to each of 2 visits"),
        ([[1, 2], [3, 4], [5, 6]], (1, 2), "names 4 experts; a wave holds 2"),
    ],
)
@run_async
async def test_a_bad_batched_visited_is_refused_whole(rows, visit_rows, says):
    side = _Side([0, 1], 8, per_layer=8, working=2, replacement="lru", shared=True)
    before = side.decisions()
    message = Visited(layers=(0, 1), routes=RouteMatrix(np.array(rows, dtype=np.int32)), visit_rows=visit_rows)
    with pytest.raises(LeaseRefused, match=says):
        await side.service.visited(_wire(message))  # `handle` logs the refusal; nothing is answered
    assert side.decisions() == before and side.manager.snapshot().hits == 0


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    per_layer=st.integers(1, 6),
    overlap=st.floats(0.0, 1.0),
    zipf=st.floats(0.0, 2.0),
)
def test_random_traces_get_the_same_decisions_on_both_paths(seed, per_layer, overlap, zipf):
    trace = generate_trace(layers=3, experts=10, top_k=3, tokens=30, overlap=overlap, zipf=zipf, seed=seed)
    run_async(_replay)(trace, per_layer=per_layer)


@pytest.mark.skipif(not REAL_TRACE.exists(), reason=f"the real routing trace is not in this checkout ({REAL_TRACE})")
@pytest.mark.parametrize("per_layer", [8, 16])
@run_async
async def test_real_routing_gets_the_same_decisions_on_both_paths(per_layer):
    shared = await _replay(read_trace(REAL_TRACE), per_layer=per_layer, tokens=80)
    assert shared.shared_visits > 0


@run_async
async def test_a_prefetch_that_lands_between_messages_is_published_at_once():
    """The visit a prefetch was for can lease it through the words with no message in between
    (coordinator.lease_publisher.LeasePublisher.landed); a read still in flight, or one that
    failed, is never published."""
    plan = one_byte_plan(layers=(0, 1), working=2, per_layer=3)
    size = lease_words_bytes(slots=plan.total_slots, layers=2, experts=8)
    words = LeaseWords(bytearray(size), offset=0, slots=plan.total_slots, layers=2, experts=8)
    backend = InMemoryBackend(plan.total_slots, manual=True)
    publisher = LeasePublisher(words)
    manager = ExpertResidencyManager(
        plan=plan,
        sparse_layer_ids=[0, 1],
        backend=PublishingBackend(backend, publisher),
        locate=lambda layer, expert: ExpertResidencyLocation(
            layer, expert, (ExpertIOSegment(file=0, offset=expert * 64, length=64, destination=0),)
        ),
        prefetch=PrefetchBook(mode="on"),
    )
    publisher.attach(manager)
    backend.fail_load(lambda slot, segments: segments[0].offset == 5 * 64)  # expert 5's read fails
    assert manager.prefetch(1, [4, 5]) == 2
    publisher.processed()  # the message that carried the prediction: both reads are in flight
    assert words.lease(1, [4]) is None and words.lease(1, [5]) is None
    four = manager.slot_table.lookup[(1, 4)]
    for slot, generation in backend.pending():
        backend.complete(slot, generation)
    await manager.settle_prefetch()
    assert words.lease(1, [4]) == (four,)  # landed: leasable before any further message
    words.release((four,))
    assert words.lease(1, [5]) is None and (1, 5) not in manager.slot_table.lookup  # the failed read
    assert words.processed() == 1  # no message was counted meanwhile
