"""Lease words (`shared.lease_words` over `native/leasewords.c`): the shared residency map and
per-slot reader counts of the coordinator (the one writer) and the GPU worker (the reader).

Why: a count lost or kept by mistake, or a stale map word that still leases, lets the GPU worker
read a slot while the coordinator overwrites it: torn or wrong expert weights, silently. Unit
tests pin each operation's contract; a hypothesis state machine checks every word against a
pure-Python model of the protocol over random writer and reader steps; a two-process stress test
runs a real writer and reader on POSIX shared memory and checks no lease sees a torn or wrong slot.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import random
import secrets
import struct
import sys
import time
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection

import posix_ipc
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from native import _leasewords
from shared.lease_words import LeaseWords, ReaderStuck, lease_words_bytes

S, L, E = 4, 2, 3  # slots, layers, experts of the small geometry
OFFSET = 64
KEYS = [(layer, expert) for layer in range(L) for expert in range(E)]
Key = tuple[int, int]


def _words() -> LeaseWords:
    buffer = bytearray(OFFSET + lease_words_bytes(slots=S, layers=L, experts=E))
    words = LeaseWords(buffer, offset=OFFSET, slots=S, layers=L, experts=E)
    words.init()
    return words


def _readers(words: LeaseWords) -> list[int]:
    return [words.readers(slot) for slot in range(words.slots)]


def _set_map_word(words: LeaseWords, layer: int, expert: int, slot: int, generation: int) -> None:
    """Store a raw map word: what a reader that fetched it earlier holds in a register."""
    index = _leasewords.HEADER + 2 * words.slots + layer * words.experts + expert
    struct.pack_into("=Q", words.buffer, words.offset + 8 * index, (generation << 32) | (slot + 1))


# -- unit tests -------------------------------------------------------------------------------------


def test_init_claims_every_slot_and_nothing_leases() -> None:
    words = _words()
    assert words.lease(0, [0]) is None and words.lease(1, [0, 1, 2]) is None
    words.publish(0, 0, 0)
    assert words.lease(0, [0]) == (0,)
    words.set_processed(7)
    assert words.processed() == 7
    words.init()  # a re-init forgets everything
    assert [(words.claimed(s), words.readers(s), words.generation(s)) for s in range(S)] == [(True, 0, 0)] * S
    assert all(words.entry(*key) is None for key in KEYS) and words.processed() == 0


def test_lease_is_all_or_nothing_in_the_experts_order() -> None:
    words = _words()
    for slot, expert in ((2, 1), (0, 2), (3, 0)):
        words.publish(slot, 0, expert)
    assert not words.claimed(2) and words.entry(0, 1) == (2, 0)
    assert words.lease(0, [2, 0, 1]) == (0, 3, 2)
    assert words.lease(0, [1, 1]) == (2, 2)  # a repeated expert counts twice
    assert _readers(words) == [1, 0, 3, 1]
    words.release((0, 3, 2))
    words.release((2, 2))
    words.publish(1, 1, 0)
    assert words.lease(1, [0, 1]) is None and words.lease(1, [1, 0]) is None  # one misses: none kept
    with pytest.raises(ValueError, match="layer 1 expert 5"):
        words.lease(1, [0, 5])
    with pytest.raises(ValueError, match="layer 7"):
        words.lease(7, [0])
    assert _readers(words) == [0] * S


def test_lease_resident_counts_in_on_the_resident_ones_only() -> None:
    words = _words()
    for slot, expert in ((2, 1), (0, 2)):
        words.publish(slot, 0, expert)
    assert words.lease_resident(0, [2, 0, 1]) == {2: 0, 1: 2}  # expert 0 is not resident
    assert list(words.lease_resident(0, [1, 2])) == [1, 2]  # all resident: the experts' order
    assert words.lease_resident(0, [0]) == {}
    assert _readers(words) == [2, 0, 2, 0]
    words.release((0, 2, 0, 2))
    assert _readers(words) == [0] * S


def test_release_errors_change_nothing() -> None:
    words = _words()
    words.publish(1, 0, 0)
    with pytest.raises(ValueError, match=r"slot 0 1 time.*fewer readers"):
        words.release([0])
    assert words.lease(0, [0]) == (1,)
    with pytest.raises(ValueError, match=r"slot 2 1 time.*fewer readers"):
        words.release([1, 2])
    for slot in (9, -1):
        with pytest.raises(ValueError, match=f"slot {slot} is outside the 4 slots"):
            words.release([1, slot])
    assert _readers(words) == [0, 1, 0, 0]


def test_release_of_more_counts_than_held_raises() -> None:
    words = _words()
    words.publish(0, 0, 0)
    assert words.lease(0, [0]) == (0,)
    with pytest.raises(ReaderStuck):
        words.claim(0, timeout_s=0.0)  # the writer waits for the one reader in
    with pytest.raises(ValueError, match="slot 0 2 time"):  # never an underflow that borrows CLAIMED
        words.release([0, 0])
    assert (words.readers(0), words.claimed(0)) == (1, True)


def test_constructor_names_bad_geometry_and_short_buffers() -> None:
    for bad, named in (("offset", 3), ("offset", -8), ("slots", 0), ("layers", 0), ("experts", 0)):
        args = {"offset": 0, "slots": S, "layers": L, "experts": E} | {bad: named}
        with pytest.raises(ValueError, match=f"{bad}={named}"):
            LeaseWords(bytearray(4096), **args)
    need = lease_words_bytes(slots=S, layers=L, experts=E)
    with pytest.raises(ValueError, match=f"buffer of {need - 1} bytes cannot hold {need} bytes"):
        LeaseWords(bytearray(need - 1), offset=0, slots=S, layers=L, experts=E)
    with pytest.raises(ValueError, match=f"buffer of {need} bytes cannot hold {need} bytes at offset 8"):
        LeaseWords(bytearray(need), offset=8, slots=S, layers=L, experts=E)


def test_claim_waits_for_readers_and_bars_new_ones() -> None:
    words = _words()
    words.publish(0, 0, 0)
    assert words.claim(0) == 0.0 and words.claimed(0)  # no reader in: the slot is the writer's
    words.publish(0, 0, 0)
    assert words.lease(0, [0]) == (0,)
    with pytest.raises(ReaderStuck, match="slot 0: 1 reader"):
        words.claim(0, timeout_s=0.01)
    assert words.claimed(0) and words.readers(0) == 1  # stays claimed: the writer retries
    assert words.lease(0, [0]) is None and words.readers(0) == 1  # a new reader backs out
    words.release([0])  # the reader in still leaves
    assert words.readers(0) == 0 and words.claim(0, timeout_s=0.0) == 0.0


def test_withdraw_and_republish_another_expert() -> None:
    words = _words()
    words.publish(0, 0, 1)
    words.publish(2, 1, 1)
    words.release(words.lease(0, [1]) or ())
    words.claim(0)
    words.withdraw(0, 1, 1)  # layer 1 expert 1 is slot 2's: its entry stays
    assert words.generation(0) == 1 and words.entry(1, 1) == (2, 0) and words.lease(1, [1]) == (2,)
    words.withdraw(0, 0, 1)
    assert words.generation(0) == 2 and words.entry(0, 1) is None and words.lease(0, [1]) is None
    words.publish(0, 0, 2)
    assert words.entry(0, 1) is None and words.entry(0, 2) == (0, 2)
    assert words.lease(0, [1]) is None and words.lease(0, [2]) == (0,)


def test_stale_map_word_never_leases() -> None:
    words = _words()
    words.publish(0, 0, 1)
    fetched = words.entry(0, 1)
    assert fetched == (0, 0)
    words.claim(0)
    words.withdraw(0)  # without a key the entry stays in the map, with an old generation
    words.publish(0, 0, 2)
    assert words.entry(0, 1) == fetched and words.generation(0) == 1
    assert words.lease(0, [1]) is None and words.readers(0) == 0
    words.release(words.lease(0, [2]) or ())
    # A reader that fetched the map word before a republish holds a word the map no longer has.
    words.claim(0)
    words.withdraw(0, 0, 2)
    words.publish(0, 1, 0)
    _set_map_word(words, 0, 2, 0, 1)  # its fetched word: slot 0, generation 1
    assert words.lease(0, [2]) is None
    assert (words.readers(0), words.claimed(0)) == (0, False) and words.lease(1, [0]) == (0,)


def test_reset_readers_drops_counts_and_keeps_claims() -> None:
    words = _words()
    words.publish(0, 0, 0)
    words.publish(1, 0, 1)
    assert words.lease(0, [0, 1]) == (0, 1) and words.lease(0, [1]) == (1,)
    with pytest.raises(ReaderStuck):
        words.claim(1, timeout_s=0.0)
    assert words.reset_readers() == 3
    assert _readers(words) == [0] * S and [words.claimed(s) for s in range(S)] == [False, True, True, True]
    assert words.reset_readers() == 0


def test_writer_errors_are_named_and_change_nothing() -> None:
    words = _words()
    words.publish(0, 0, 0)
    with pytest.raises(ValueError, match="publish of slot 0, which is not claimed"):
        words.publish(0, 0, 1)
    with pytest.raises(ValueError, match="withdraw of slot 0, which is not claimed"):
        words.withdraw(0, 0, 0)
    for layer, expert in ((2, 0), (0, 3), (0, -1)):
        with pytest.raises(ValueError, match=f"layer {layer} expert {expert} is outside 2 layers x 3 experts"):
            words.publish(1, layer, expert)
        with pytest.raises(ValueError, match=f"layer {layer} expert {expert} is outside"):
            words.withdraw(1, layer, expert)
    for call in (lambda: words.publish(4, 0, 0), lambda: words.claim(4), lambda: words.readers(4)):
        with pytest.raises(ValueError, match="slot 4 is outside the 4 slots"):
            call()
    with pytest.raises(ValueError, match="layer 5 expert 0"):
        words.entry(5, 0)
    assert [words.entry(*key) for key in KEYS] == [(0, 0)] + [None] * (len(KEYS) - 1)
    assert [words.generation(s) for s in range(S)] == [0] * S and words.claimed(1)


# -- the protocol against a model -------------------------------------------------------------------


class LeaseMachine(RuleBasedStateMachine):
    """The coordinator's discipline (claim, wait, withdraw, write, publish) and a reader's leases."""

    def __init__(self) -> None:
        super().__init__()
        self.words = _words()
        self.claimed, self.readers, self.generation = [True] * S, [0] * S, [0] * S
        self.map: dict[Key, tuple[int, int]] = {}  # the map words: key -> (slot, generation)
        self.fresh = [True] * S  # withdrawn (or never published) since its last publish
        self.held: list[tuple[int, ...]] = []

    def _valid(self, key: Key) -> bool:  # its map word's generation is its slot's
        return key in self.map and self.generation[self.map[key][0]] == self.map[key][1]

    def _leasable(self, key: Key) -> int | None:
        return self.map[key][0] if self._valid(key) and not self.claimed[self.map[key][0]] else None

    def _writable(self) -> list[int]:  # claimed, and the readers left: the writer may change it
        return [s for s in range(S) if self.claimed[s] and self.readers[s] == 0]

    @precondition(lambda self: not all(self.readers))
    @rule(data=st.data())
    def claim_free(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from([s for s in range(S) if self.readers[s] == 0]))
        assert self.words.claim(slot, timeout_s=0.0) == 0.0
        self.claimed[slot] = True

    @precondition(lambda self: any(self.readers))
    @rule(data=st.data())
    def claim_while_held(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from([s for s in range(S) if self.readers[s]]))
        with pytest.raises(ReaderStuck):
            self.words.claim(slot, timeout_s=0.0)
        self.claimed[slot] = True

    @precondition(lambda self: bool(self._writable()))
    @rule(data=st.data())
    def withdraw(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(self._writable()))
        own = [k for k in KEYS if self._valid(k) and self.map[k][0] == slot] or [None]
        key = data.draw(st.one_of(st.sampled_from(own), st.none(), st.sampled_from(KEYS)))
        self.words.withdraw(slot, *(key or (None, None)))
        self.generation[slot] += 1
        self.fresh[slot] = True
        if key is not None and self.map.get(key, (-1, 0))[0] == slot:
            del self.map[key]

    @precondition(lambda self: any(self.fresh[s] for s in self._writable()))
    @rule(data=st.data())
    def load_and_publish(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from([s for s in self._writable() if self.fresh[s]]))
        # Never one key in two slots: a key valid in another slot is withdrawn there first.
        key = data.draw(st.sampled_from([k for k in KEYS if not self._valid(k)] or [None]))
        if key is not None:
            self.words.publish(slot, *key)
            self.map[key] = (slot, self.generation[slot])
            self.claimed[slot], self.fresh[slot] = False, False

    @rule(layer=st.integers(0, L - 1), experts=st.lists(st.integers(0, E - 1), min_size=1, max_size=3, unique=True))
    def lease(self, layer: int, experts: list[int]) -> None:
        want = [self._leasable((layer, e)) for e in experts]
        got = self.words.lease(layer, experts)
        assert got == (None if None in want else tuple(want)), (layer, experts, got, want)
        if got is not None:
            self.held.append(got)
            for slot in got:
                self.readers[slot] += 1

    @precondition(lambda self: any(self._valid(k) and self.claimed[self.map[k][0]] for k in KEYS))
    @rule(data=st.data())
    def lease_loses_race_with_claim(self, data: st.DataObject) -> None:
        layer, expert = data.draw(st.sampled_from([k for k in KEYS if self._valid(k) and self.claimed[self.map[k][0]]]))
        others = [e for e in range(E) if e != expert and self._leasable((layer, e)) is not None]
        assert self.words.lease(layer, data.draw(st.permutations([*others, expert]))) is None

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        slots = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.words.release(slots)
        for slot in slots:
            self.readers[slot] -= 1

    @rule(slot=st.integers(0, S - 1))
    def release_without_reader(self, slot: int) -> None:
        if self.readers[slot] == 0:
            with pytest.raises(ValueError, match="fewer readers"):
                self.words.release([slot])

    @rule()
    def reader_died(self) -> None:
        assert self.words.reset_readers() == sum(self.readers)
        self.readers, self.held = [0] * S, []

    @invariant()
    def words_match_the_model(self) -> None:
        for slot in range(S):
            readers = self.words.readers(slot)
            assert not (self.claimed[slot] and self.readers[slot] == 0 and readers), f"slot {slot} written, read"
            assert (readers, self.words.claimed(slot)) == (self.readers[slot], self.claimed[slot])
            assert self.words.generation(slot) == self.generation[slot]
        assert {k: self.words.entry(*k) for k in KEYS} == {k: self.map.get(k) for k in KEYS}


LeaseMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None, database=None)
TestLeaseMachine = LeaseMachine.TestCase


# -- a real writer and reader on POSIX shared memory -------------------------------------------------

SLOT_BYTES = 4096
WS, WL, WE = 8, 2, 6  # the stress geometry: 8 slots for 12 keys, so leases both hit and miss
SLOT_AREA = WS * SLOT_BYTES
PRIME = 1_000_003  # a slot's every word: version * PRIME + key id
RUN_S = 3.0
GUARD_S = 60.0  # the test fails, never hangs, past this
MIN_LEASES = 200


def _key_id(layer: int, expert: int) -> int:
    return layer * WE + expert + 1


def _reader_main(name: str, conn: Connection) -> None:
    """The child: lease, check every leased slot's bytes, release; report the counts."""
    counts = dict.fromkeys(("leases", "misses", "torn", "wrong_key", "stale"), 0)
    try:
        shm = posix_ipc.SharedMemory(name)
        region = mmap.mmap(shm.fd, shm.size)
        shm.close_fd()
        try:
            words = LeaseWords(region, offset=SLOT_AREA, slots=WS, layers=WL, experts=WE)
            rng, newest = random.Random(), [0] * WS
            conn.send("ready")
            started = time.monotonic()
            while (elapsed := time.monotonic() - started) < RUN_S or counts["leases"] < MIN_LEASES:
                assert elapsed < GUARD_S / 3, f"only {counts} by the guard"
                layer, experts = rng.randrange(WL), rng.sample(range(WE), rng.randint(1, 3))
                slots = words.lease(layer, experts)
                counts["misses" if slots is None else "leases"] += 1
                for expert, slot in zip(experts, slots or ()):
                    values = set(memoryview(region[slot * SLOT_BYTES : (slot + 1) * SLOT_BYTES]).cast("Q"))
                    version, key_id = divmod(max(values), PRIME)
                    counts["torn"] += len(values) != 1
                    counts["wrong_key"] += key_id != _key_id(layer, expert)
                    counts["stale"] += version < newest[slot]
                    newest[slot] = max(newest[slot], version)
                if slots is not None:
                    words.release(slots)
            del words
        finally:
            region.close()
        conn.send(("ok", counts))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _write_until_reader_done(words: LeaseWords, region: mmap.mmap, conn: Connection) -> int:
    """The parent: republish random slots under random keys until the reader reports; how many."""
    rng, keys = random.Random(0), [(layer, expert) for layer in range(WL) for expert in range(WE)]
    holds: list[Key | None] = [None] * WS
    version, stop = 0, time.monotonic() + GUARD_S
    while not conn.poll(0):
        assert time.monotonic() < stop, "the reader never reported"
        slot = rng.randrange(WS)
        words.claim(slot, timeout_s=10.0)
        words.withdraw(slot, *(holds[slot] or (None, None)))
        holds[slot] = None
        key = rng.choice([k for k in keys if k not in holds])
        version += 1
        word = (version * PRIME + _key_id(*key)).to_bytes(8, sys.byteorder)
        region[slot * SLOT_BYTES : (slot + 1) * SLOT_BYTES] = word * (SLOT_BYTES // 8)
        words.publish(slot, *key)
        holds[slot] = key
    return version


@pytest.fixture(scope="module")
def resource_tracker() -> Iterator[None]:
    """Spawn starts multiprocessing's resource tracker: before the leak check looks, not in a test."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    yield
    resource_tracker._resource_tracker._stop()


@pytest.mark.usefixtures("resource_tracker")
def test_writer_and_reader_processes_never_see_a_torn_or_wrong_slot() -> None:
    name = f"/moeslab-lwtest-{secrets.token_hex(3)}"
    size = SLOT_AREA + lease_words_bytes(slots=WS, layers=WL, experts=WE)
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = None
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
    try:
        region = mmap.mmap(shm.fd, size)
        shm.close_fd()
        try:
            words = LeaseWords(region, offset=SLOT_AREA, slots=WS, layers=WL, experts=WE)
            words.init()
            child = ctx.Process(target=_reader_main, args=(name, theirs), daemon=True)
            child.start()
            theirs.close()
            assert ours.poll(GUARD_S) and ours.recv() == "ready", "the reader never attached"
            republishes = _write_until_reader_done(words, region, ours)
            status, counts = ours.recv()
            assert status == "ok", counts
            child.join(GUARD_S)
            assert child.exitcode == 0
            assert [words.readers(s) for s in range(WS)] == [0] * WS  # every lease released
            del words
        finally:
            region.close()
    finally:
        if child is not None and child.is_alive():
            child.kill()
            child.join()
        theirs.close()
        ours.close()
        posix_ipc.unlink_shared_memory(name)
    with pytest.raises(posix_ipc.ExistentialError):  # unlinked
        posix_ipc.SharedMemory(name)
    assert (counts["torn"], counts["wrong_key"], counts["stale"]) == (0, 0, 0), counts
    assert counts["leases"] > 100 and counts["misses"] > 0 and republishes > 100, counts
