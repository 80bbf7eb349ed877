"""Split decode visits (gpuworker.split_visit) on a real `LeaseClient`, lease words and slab bytes,
with the coordinator's replies given by hand: the resident experts' parts are copied before the
lease comes (and their counts end at once), only a part with a miss waits for it, and every
reply the `routes` owes is taken, whatever the module did, so no later request reads it."""

from __future__ import annotations

from collections import deque

import mlx.core as mx
import numpy as np
import pytest

from gpuworker.channel import LeaseError
from gpuworker.lanes import decode_parts
from gpuworker.lease_client import LeaseClient
from gpuworker.split_visit import resident_first
from shared.gpu_messages import Fence, Fenced, Lease, Routes
from shared.lease_words import LeaseWords, lease_words_bytes
from shared.protocol import ErrorReply
from shared.store import SlotTensor

LAYER, EXPERTS, TOP_K, SLOTS = 0, 8, 4, 8
SHAPE = (4, 4)
SLOT_BYTES = 64  # one float32 4x4 tensor per expert


class _Store:
    top_k = TOP_K
    sparse_layers = (LAYER,)

    def __init__(self) -> None:
        self._layouts = {e: (SlotTensor("w", "F32", SHAPE, 0, SLOT_BYTES),) for e in range(EXPERTS)}

    def layout(self, layer: int, expert: int):
        return self._layouts[expert]


class _Channel:
    """Sends are recorded; `wait_reply` takes the replies queued by the test (none: the test
    would have blocked on a reply that was not due)."""

    def __init__(self) -> None:
        self.sent: list[object] = []
        self.replies: deque[object] = deque()
        self.waits = 0

    def send(self, message: object) -> None:
        self.sent.append(message)

    def stop_requested(self) -> bool:
        return False

    def wait_reply(self, what: str, *, timeout_s: float) -> object:
        self.waits += 1
        if not self.replies:
            raise AssertionError(f"waited for a reply to {what} that the test did not queue")
        reply = self.replies.popleft()
        if isinstance(reply, ErrorReply):
            raise LeaseError(f"the coordinator refused {what}: {reply.code}: {reply.message}")
        return reply


class _Setup:
    def __init__(self, resident: dict[int, int], *, lanes: int = 2) -> None:
        self.slab = bytearray(SLOTS * SLOT_BYTES)
        for slot in range(SLOTS):  # slot s holds the value 100 + s everywhere
            np.frombuffer(self.slab, dtype=np.float32)[slot * 16 : (slot + 1) * 16] = 100 + slot
        size = lease_words_bytes(slots=SLOTS, layers=1, experts=EXPERTS)
        self.words = LeaseWords(bytearray(size), offset=0, slots=SLOTS, layers=1, experts=EXPERTS)
        self.words.init()
        for expert, slot in resident.items():
            self.words.publish(slot, LAYER, expert)
        self.channel = _Channel()
        self.client = LeaseClient(
            self.channel,
            store=_Store(),
            buffer=self.slab,
            total_slots=SLOTS,
            slot_bytes=SLOT_BYTES,
            working_slots=TOP_K,
            zero_copy=False,
            compute_lanes=lanes,
            words=self.words,
            parts_min_bytes=0,
        )
        self.client._sent = 1  # the coordinator is behind: the shared path stands aside

    def readers(self) -> list[int]:
        return [self.words.readers(slot) for slot in range(SLOTS)]


def _lease(experts, slots, *, lease_id: int = 7) -> Lease:
    return Lease(
        lease_id=lease_id,
        layer=LAYER,
        wave=0,
        waves=1,
        experts=tuple(experts),
        slots=tuple(slots),
        generations=(1,) * len(slots),
        hits=0,
    )


def _value(tensors, row: int = 0) -> float:
    return float(np.array(tensors["w"][row]).reshape(-1)[0])


def test_resident_first_orders_and_counts_the_ready_parts():
    for lanes in (1, 2):
        parts, ready = resident_first((5, 1, 7, 2), {1: 0, 2: 3}, lanes=lanes)
        assert [e for part in parts for e in part] == [1, 2, 5, 7]
        assert parts == decode_parts((1, 2, 5, 7), lanes=lanes)
        assert all(set(part) <= {1, 2} for part in parts[:ready])
        assert ready == len(parts) or not set(parts[ready]) <= {1, 2}
    assert resident_first((5, 1), {}, lanes=2)[1] == 0
    assert resident_first((5, 1), {5: 0, 1: 1}, lanes=2)[1] == 2


def test_resident_experts_are_copied_before_the_lease_comes():
    setup = _Setup({0: 0, 1: 1, 2: 2})  # expert 3 misses
    client, channel = setup.client, setup.channel
    [wave] = client.acquire(LAYER, np.array([[3, 0, 1, 2]], dtype=np.int32))
    assert isinstance(channel.sent[-1], Routes) and channel.waits == 0  # sent; nothing waited for yet
    assert setup.readers() == [0] * SLOTS  # copied, counted out
    assert [e for part in wave.parts for e in part] == [0, 1, 2, 3]
    ready = [wave.take_part(index) for index in range(3)]  # no reply needed for these
    assert channel.waits == 0
    assert [_value(tensors) for tensors in ready] == [100, 101, 102]
    channel.replies.append(_lease([3, 0, 1, 2], [5, 0, 1, 2]))
    last = wave.take_part(3)
    assert channel.waits == 1 and _value(last) == 105
    wave.outputs = ()
    client.fence(wave)
    assert client.holding  # the lease is fenced at the step's end, as on the message path
    channel.replies.append(Fenced(lease_id=7))
    client.end_step()
    assert isinstance(channel.sent[-1], Fence) and channel.sent[-1].lease_id == 7 and not client.holding
    stats = client.stats()
    assert (stats.split_visits, stats.split_early_experts) == (1, 3)


def test_a_refused_split_visit_fails_its_part_and_owes_nothing():
    setup = _Setup({0: 0, 1: 1})
    client, channel = setup.client, setup.channel
    [wave] = client.acquire(LAYER, np.array([[0, 1, 4, 5]], dtype=np.int32))
    wave.take_part(0)
    wave.take_part(1)
    channel.replies.append(ErrorReply("load_failed", "disk"))
    with pytest.raises(LeaseError, match="load_failed"):
        wave.take_part(2)
    wave.outputs = ()
    client.fence(wave)  # the module's error path: nothing was leased, nothing to fence
    assert not client.holding and not channel.replies and setup.readers() == [0] * SLOTS
    client.end_step()  # nothing held: no message, no wait
    assert channel.waits == 1 and not isinstance(channel.sent[-1], Fence)


@pytest.mark.parametrize("ending", ["fence", "release"])
def test_a_reply_the_module_never_asked_for_is_taken_and_fenced(ending):
    setup = _Setup({0: 0, 1: 1, 2: 2})
    client, channel = setup.client, setup.channel
    [wave] = client.acquire(LAYER, np.array([[0, 1, 2, 6]], dtype=np.int32))
    wave.take_part(0)  # then the module gives up
    channel.replies.append(_lease([0, 1, 2, 6], [0, 1, 2, 6], lease_id=9))
    channel.replies.append(Fenced(lease_id=9))
    if ending == "fence":
        wave.outputs = ()
        client.fence(wave)
        client.end_step()
    else:
        client.release()
    assert [m.lease_id for m in channel.sent if isinstance(m, Fence)] == [9]
    assert not channel.replies and not client.holding and setup.readers() == [0] * SLOTS


@pytest.mark.parametrize("resident", [{}, {e: e for e in range(TOP_K)}], ids=["none", "all"])
def test_nothing_to_split_waits_for_the_lease_as_the_message_path(resident):
    setup = _Setup(resident)
    client, channel = setup.client, setup.channel
    channel.replies.append(_lease([0, 1, 2, 3], [4, 5, 6, 7]))
    [wave] = client.acquire(LAYER, np.array([[0, 1, 2, 3]], dtype=np.int32))
    assert channel.waits == 1 and setup.readers() == [0] * SLOTS
    assert [e for part in wave.parts for e in part] == [0, 1, 2, 3]  # rank order
    assert [_value(wave.take_part(index)) for index in range(len(wave.parts))] == [104, 105, 106, 107]
    assert client.stats().split_visits == 0


def test_split_copies_wait_for_the_outputs_that_read_the_pool_before():
    setup = _Setup({0: 0, 1: 1})
    client = setup.client
    earlier = mx.ones((2,)) * 3
    client._pending.append(earlier)  # a detached output of the layer before
    client.acquire(LAYER, np.array([[0, 1, 2, 3]], dtype=np.int32))
    assert not client._pending  # evaluated before the pool's sets were written


def test_an_early_copy_that_fails_fences_the_lease_its_routes_gets(monkeypatch):
    setup = _Setup({0: 0, 1: 1})
    client, channel = setup.client, setup.channel

    def broken(*args, **kwargs):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(client, "_wrap_part", broken)
    channel.replies.extend([_lease([0, 1, 2, 3], [0, 1, 2, 3], lease_id=11), Fenced(lease_id=11)])
    with pytest.raises(RuntimeError, match="copy failed"):
        client.acquire(LAYER, np.array([[0, 1, 2, 3]], dtype=np.int32))
    # The lease came and was fenced unread; the counts ended; nothing is owed or held.
    assert isinstance(channel.sent[0], Routes) and [m.lease_id for m in channel.sent if isinstance(m, Fence)] == [11]
    assert not channel.replies and not client.holding and setup.readers() == [0] * SLOTS
