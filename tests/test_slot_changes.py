"""The slot table tells the lease publisher which slots changed; a sync re-matches only those.

`coordinator.lease_publisher.LeasePublisher.sync` used to match every slot after each of the GPU
worker's messages (832 slots on the deep bench shape, 14% of the coordinator's samples there).
What it may skip is exactly what `SlotTable.changed` leaves out, so that is what is tested here:
every change of what is published marks its slot, and a sync leaves nothing stale.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.lease_publisher import LeasePublisher
from coordinator.slot_table import SlotTable
from shared.lease_words import LeaseWords, lease_words_bytes

SLOTS, LAYERS, EXPERTS = 6, 2, 3


def _table() -> SlotTable:
    table = SlotTable(backend=None)  # type: ignore[arg-type]  # the bookkeeping alone
    for slot in range(SLOTS):
        table.new_slot("layer", slot % LAYERS)
    return table


def _publisher(table: SlotTable) -> LeasePublisher:
    words = LeaseWords(
        bytearray(lease_words_bytes(slots=SLOTS, layers=LAYERS, experts=EXPERTS)),
        offset=0,
        slots=SLOTS,
        layers=LAYERS,
        experts=EXPERTS,
    )
    publisher = LeasePublisher(words)
    publisher.attach(SimpleNamespace(slot_table=table, on_landed=None))  # type: ignore[arg-type]
    return publisher


def test_what_is_published_marks_its_slot_and_nothing_else_does():
    table = _table()
    assert table.take_changed() == list(range(SLOTS)) and table.take_changed() == []
    record = table.slots[2]
    record.last_use, record.generation, record.prefetched = 5, 3, True
    assert table.take_changed() == []  # not what the words say of a slot
    record.phase = "ready"
    record.expert_id = 1
    assert table.take_changed() == [2]
    table.lookup[(0, 1)] = 2
    assert table.take_changed() == [2]
    table.lookup[(0, 1)] = 4  # the entry named 2 and now names 4: both may change
    assert table.take_changed() == [2, 4]
    del table.lookup[(0, 1)]
    assert table.take_changed() == [4]
    for change in ("pop", "clear", "update", "setdefault", "popitem"):
        with pytest.raises(TypeError, match="changes only by"):
            getattr(table.lookup, change)()
    assert table.take_changed() == []


def test_a_withdrawal_is_matched_again_at_the_next_sync():
    table = _table()
    publisher = _publisher(table)
    record = table.slots[1]
    record.phase, record.expert_id = "ready", 2
    table.lookup[(1, 2)] = 1
    publisher.sync()
    assert publisher.words.lease(1, [2]) == (1,)
    publisher.words.release([1])
    publisher.withdraw(1)  # e.g. a load into it that the backend then refused: the table is as it was
    assert publisher.words.lease(1, [2]) is None
    publisher.sync()
    assert publisher.stale() == [] and publisher.words.lease(1, [2]) == (1,)


_CHANGES = st.lists(
    st.tuples(
        st.sampled_from(["phase", "expert", "look_up", "forget", "withdraw"]),
        st.integers(0, SLOTS - 1),
        st.sampled_from(["idle", "loading", "ready", "leased"]),
        st.integers(0, EXPERTS - 1),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(rounds=st.lists(_CHANGES, min_size=1, max_size=6))
def test_a_sync_after_any_changes_leaves_no_slot_stale(rounds):
    table = _table()
    publisher = _publisher(table)
    for changes in rounds:
        for kind, slot, phase, expert in changes:
            record = table.slots[slot]
            if kind == "phase":
                record.phase = phase
            elif kind == "expert":
                record.expert_id = expert
            elif kind == "look_up" and record.expert_id is not None:
                table.lookup[(record.layer, record.expert_id)] = slot
            elif kind == "forget" and record.expert_id is not None:
                if table.lookup.get((record.layer, record.expert_id)) == slot:
                    del table.lookup[(record.layer, record.expert_id)]
            elif kind == "withdraw":
                publisher.withdraw(slot)
        publisher.sync()
        assert publisher.stale() == []
