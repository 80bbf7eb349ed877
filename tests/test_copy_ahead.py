"""Copy ahead (`gpuworker.copy_ahead`): the next layer's predicted experts copied into a staged
set while a layer computes, and the visit's experts served from it.

Why: a staged row that holds the wrong expert's bytes, a routed expert left out, a reader count
left behind (the coordinator could then never reclaim the slot) or a set rewritten while a layer
still reads it would silently corrupt or stall decoding. Unit tests pin each step; a property
test checks, over random residency, predictions and routes, that every routed expert's row holds
exactly its slot's bytes and no count stays in; the system tests (`test_system_generate`) check
tokens against mlx-lm with copy ahead serving visits.
"""

from __future__ import annotations

import logging
import types

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuworker import copy_ahead as copy_ahead_module
from gpuworker.copy_ahead import MIN_USEFUL, RETRY_VISITS, WINDOW, CopyAhead
from gpuworker.expert_provider import LeasedWave
from shared.lease_words import LeaseWords, lease_words_bytes
from shared.store import SlotTensor

SLOT = 256
SLOTS, LAYERS, EXPERTS, TOP_K = 12, 3, 16, 4
LAYER = 1
# Two tensors per expert; a second layout names them in another order (stores order by offset).
LAYOUT = (SlotTensor("gate_proj.weight", "U32", (4, 4), 0, 64), SlotTensor("gate_proj.scales", "F32", (6,), 128, 24))
OTHER_ORDER = (LAYOUT[1], SlotTensor("gate_proj.weight", "U32", (4, 4), 64, 64))


class _Store:
    """layout(layer, expert): one tuple per expert, as the real store hands out."""

    def __init__(self) -> None:
        self._layouts = {e: (OTHER_ORDER if e % 3 == 0 else LAYOUT) for e in range(EXPERTS)}

    def layout(self, layer: int, expert: int):
        return self._layouts[expert]


def _setup(resident: dict[int, int], seed: int = 0):
    """A slab of random bytes whose lease words publish layer LAYER's `resident` {expert: slot}."""
    buffer = bytearray(SLOTS * SLOT + lease_words_bytes(slots=SLOTS, layers=LAYERS, experts=EXPERTS))
    buffer[: SLOTS * SLOT] = np.random.default_rng(seed).integers(0, 256, SLOTS * SLOT, dtype=np.uint8).tobytes()
    words = LeaseWords(buffer, offset=SLOTS * SLOT, slots=SLOTS, layers=LAYERS, experts=EXPERTS)
    words.init()
    for expert, slot in resident.items():
        words.publish(slot, LAYER, expert)
    ahead = CopyAhead(buffer=buffer, slot_bytes=SLOT, store=_Store(), words=words, top_k=TOP_K)
    return buffer, words, ahead


def _tensor_bytes(buffer, slot: int, expert: int, name: str) -> bytes:
    tensor = next(t for t in _Store().layout(LAYER, expert) if t.name == name)
    start = slot * SLOT + tensor.offset
    return bytes(buffer[start : start + tensor.nbytes])


def _row_bytes(tensors: dict[str, mx.array], name: str, row: int) -> bytes:
    return np.array(tensors[name][row]).tobytes()


def _serve(ahead: CopyAhead, resident: dict[int, int], routed: list[int]):
    """What the lease client does for a visit that finds a staged set: place, then fill."""
    staged = ahead.take(LAYER)
    assert staged is not None
    rows = ahead.place(staged, routed)
    tensors, copied = ahead.fill(staged, routed, [resident[e] for e in routed])
    return staged, rows, tensors, copied


def test_staged_rows_and_filled_rows_hold_each_experts_bytes():
    resident = {2: 0, 5: 3, 7: 4, 9: 8, 11: 10}
    buffer, words, ahead = _setup(resident)
    copied, seconds = ahead.stage(LAYER, (5, 1, 9))  # expert 1 is not resident: not staged
    assert copied == 2 * 88 and seconds >= 0
    assert [words.readers(slot) for slot in range(SLOTS)] == [0] * SLOTS  # counted out after copying
    staged, rows, tensors, copied = _serve(ahead, resident, [9, 2, 7])
    assert staged.rows == {5: 0, 9: 1} and rows == (1, 2, 3)  # 9 where staged; 2 and 7 after the staged rows
    assert copied == 2 * 88 and staged.used == 1
    for expert, row in zip([9, 2, 7], rows):
        for name in ("gate_proj.weight", "gate_proj.scales"):
            assert _row_bytes(tensors, name, row) == _tensor_bytes(buffer, resident[expert], expert, name)
    assert (ahead.staged, ahead.used, ahead.routed) == (2, 1, 3)


def test_a_set_serves_only_the_next_visit_of_its_layer():
    resident = {e: e for e in range(8)}
    _, _, ahead = _setup(resident)
    ahead.stage(LAYER, (1, 2))
    assert ahead.take(LAYER + 1) is None  # another layer's visit drops it
    assert ahead.take(LAYER) is None
    ahead.stage(LAYER, (1, 2))
    assert ahead.take(LAYER) is not None and ahead.take(LAYER) is None  # once
    ahead.stage(LAYER, (1, 2))
    ahead.stage(LAYER, (3,))  # a newer stage replaces it
    assert ahead.take(LAYER).rows == {3: 0}


def test_nothing_resident_or_claimed_is_staged_and_counts_never_stay():
    resident = {3: 1, 4: 2}
    _, words, ahead = _setup(resident)
    words.claim(2)  # the coordinator is about to rewrite expert 4's slot: new readers back out
    assert ahead.stage(LAYER, (4, 6)) == (0, 0.0)
    assert ahead.take(LAYER) is None
    assert [words.readers(slot) for slot in range(SLOTS)] == [0] * SLOTS
    ahead.stage(LAYER, (4, 3))
    assert ahead.take(LAYER).rows == {3: 0}


def test_a_set_is_rewritten_only_after_what_read_it_is_evaluated(monkeypatch):
    evaluated = []
    fake_mx = types.SimpleNamespace(eval=lambda *arrays: evaluated.append(arrays))
    monkeypatch.setattr(copy_ahead_module, "mx", fake_mx)
    resident = {e: e for e in range(8)}
    _, _, ahead = _setup(resident)
    ahead.stage(LAYER, (1, 2))
    first = ahead.take(LAYER)
    reader = object()
    ahead.read_by(first, [reader])
    ahead.stage(LAYER, (3,))  # the other set: its readers (none) need nothing
    assert evaluated == []
    ahead.stage(LAYER, (4,))  # first's set again: its reader is evaluated first
    assert evaluated == [(reader,)]


def test_it_stops_when_the_prediction_finds_too_little(caplog):
    caplog.set_level(logging.INFO, logger="gpuworker.copy_ahead")
    resident = {e: e for e in range(12)}
    _, _, ahead = _setup(resident)
    served = 0
    while ahead.on:
        ahead.stage(LAYER, (0, 1, 2, 3))
        _serve(ahead, resident, [8, 9, 10, 11])  # never predicted
        served += 4
    assert served == WINDOW and MIN_USEFUL > 0
    assert "copy ahead stopped: 0% of the routed experts were staged" in caplog.text
    assert ahead.stage(LAYER, (0, 1)) == (0, 0.0) and ahead.take(LAYER) is None


def test_stopped_it_tries_again_now_and_then(caplog):
    """A verdict of a job's first tokens (little resident yet on a streaming system) must not hold
    for good: after RETRY_VISITS decode visits stopped, a new trial copies for a window."""
    caplog.set_level(logging.INFO, logger="gpuworker.copy_ahead")
    resident = {e: e for e in range(12)}
    _, _, ahead = _setup(resident)
    while ahead.on:  # stopped: the prediction finds nothing
        assert ahead.due()
        ahead.stage(LAYER, (0, 1, 2, 3))
        _serve(ahead, resident, [8, 9, 10, 11])
    assert [ahead.due() for _ in range(RETRY_VISITS - 1)] == [False] * (RETRY_VISITS - 1)
    assert not ahead.on and ahead.retries == 0
    assert ahead.due() and ahead.on and ahead.retries == 1
    assert f"copy ahead: trying again after {RETRY_VISITS} decode visits stopped" in caplog.text
    for _ in range(WINDOW // 4):  # now the prediction is good: it stays on
        assert ahead.due()
        ahead.stage(LAYER, (8, 9, 10, 11))
        _serve(ahead, resident, [8, 9, 10, 11])
    assert ahead.on and ahead.retries == 1


def test_a_useful_prediction_keeps_it_on():
    resident = {e: e for e in range(12)}
    _, _, ahead = _setup(resident)
    for _ in range(2 * WINDOW // TOP_K):
        ahead.stage(LAYER, (0, 1, 2, 3, 4))
        _serve(ahead, resident, [0, 1, 9, 10])  # half found
    assert ahead.on and ahead.used == WINDOW and ahead.routed == 2 * WINDOW


@settings(max_examples=60, deadline=None)
@given(
    slots=st.permutations(range(SLOTS)),
    resident_count=st.integers(TOP_K, SLOTS),
    predicted=st.lists(st.integers(0, EXPERTS - 1), max_size=TOP_K + 2, unique=True),
    routed_picks=st.lists(st.integers(0, SLOTS - 1), min_size=1, max_size=TOP_K, unique=True),
    seed=st.integers(0, 3),
)
def test_every_routed_expert_reads_its_own_bytes(slots, resident_count, predicted, routed_picks, seed):
    experts = list(range(0, EXPERTS, EXPERTS // SLOTS or 1))[:SLOTS]
    resident = {experts[i]: slots[i] for i in range(resident_count)}
    buffer, words, ahead = _setup(resident, seed)
    routed = [experts[i % resident_count] for i in routed_picks]
    routed = list(dict.fromkeys(routed))  # a visit's unique experts, all resident (the shared path)
    ahead.stage(LAYER, tuple(predicted))
    assert [words.readers(slot) for slot in range(SLOTS)] == [0] * SLOTS
    staged = ahead.take(LAYER)
    if staged is None:  # nothing predicted was resident
        assert not set(predicted) & set(resident)
        return
    assert set(staged.rows) == set(predicted) & set(resident)
    rows = ahead.place(staged, routed)
    tensors, copied = ahead.fill(staged, routed, [resident[e] for e in routed])
    assert len(set(rows)) == len(rows) and max(rows) < staged.capacity
    assert copied == 88 * len(set(routed) - set(staged.rows))
    for expert, row in zip(routed, rows):
        for name in ("gate_proj.weight", "gate_proj.scales"):
            assert _row_bytes(tensors, name, row) == _tensor_bytes(buffer, resident[expert], expert, name)


def test_a_wave_names_one_distinct_row_per_expert():
    stacked = {"w": mx.zeros((4, 2))}
    assert LeasedWave((3, 1), stacked, stacked=True, stack_rows=(2, 0)).stack_rows == (2, 0)
    for rows in [(0,), (1, 1), (-1, 0)]:
        with pytest.raises(ValueError, match="stack_rows"):
            LeasedWave((3, 1), stacked, stacked=True, stack_rows=rows)
    with pytest.raises(ValueError, match="stack_rows"):
        LeasedWave((3, 1), [{"w": mx.zeros(2)}, {"w": mx.zeros(2)}], stack_rows=(0, 1))
