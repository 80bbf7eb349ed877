"""The coordinator's side of the lease words: publish the manager's resident experts, withdraw a
slot before its bytes change, count the GPU worker's messages processed.

`LeasePublisher.sync` makes the residency map in shared memory (`shared.lease_words`) equal to
the slot table's ready residents: a slot is published while it holds a landed expert that the
lookup names, and claimed (unleasable) otherwise. `PublishingBackend` wraps the backend the
manager drives, so that every `discard` and `submit_segments` (the only ways a slot's bytes or
meaning change) first withdraws the slot: claim, wait for the readers still in, withdraw. That
ordering is what makes a lease the GPU worker takes itself safe; `sync` only adds.

`processed(...)` ends each worker message that may change residency (routes, fence, prefetch, a
`visited` that fences or predicts): sync, then publish the count. The worker leases through the words only
while that count equals what it sent, so it sees the residency its next `routes` would have seen.
Between two messages a prefetch that lands is published at once (`landed`): that only adds a
ready resident, which a `routes` sent then would find as well, and it is what lets the visit the
prefetch was for lease without a round trip.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from coordinator.slot_table import SlotRecord, SlotTable
from shared.config import RunConfig
from shared.lease_words import LeaseWords
from shared.slab import Slab

if TYPE_CHECKING:
    from coordinator.residency_prefetch import PrefetchingCore

logger = logging.getLogger(__name__)

__all__ = ["LeasePublisher", "PublishingBackend", "lease_words_for"]


class LeasePublisher:
    """Keeps the lease words equal to a slot table (disabled: `words` None, every call a no-op)."""

    def __init__(self, words: LeaseWords | None, *, claim_timeout_s: float = 10.0) -> None:
        self.words = words
        self.claim_timeout_s = claim_timeout_s
        self._published: list[tuple[int, int] | None] = [None] * (words.slots if words is not None else 0)
        self._table: SlotTable | None = None
        self.count = 0  # the GPU worker's residency messages processed
        self.claim_waits = 0  # withdrawals that waited for a reader to leave
        self.claim_wait_s = 0.0
        if words is not None:
            words.init()

    @property
    def enabled(self) -> bool:
        return self.words is not None

    def attach(self, manager: PrefetchingCore) -> None:
        """Follow `manager`'s slot table: synced at `processed`, and a landed prefetch at once."""
        self._table = manager.slot_table
        manager.on_landed = self.landed

    def withdraw(self, slot: int) -> None:
        """Before `slot`'s bytes change: no reader may be in it, or enter it, from here on."""
        if self.words is None or not 0 <= slot < len(self._published):
            return
        key = self._published[slot]
        if key is None:
            return  # unpublished slots stay claimed
        waited = self.words.claim(slot, timeout_s=self.claim_timeout_s)
        if waited:
            self.claim_waits += 1
            self.claim_wait_s += waited
        self.words.withdraw(slot, *key)
        self._published[slot] = None
        if self._table is not None:  # matched again at the next sync, as a change of the table is
            self._table.changed.add(slot)

    def sync(self) -> None:
        """Publish every slot whose expert is ready and withdraw every other published slot: the
        ones the table says changed (`SlotTable.changed`: every slot, the first time) are matched
        again; the others are as the last sync left them."""
        if self.words is None or self._table is None:
            return
        table = self._table
        for slot in table.take_changed():
            self._match(table.slots[slot], table.lookup)

    def stale(self) -> list[int]:
        """Slots whose published entry is not what the table says (none after a sync; tests)."""
        if self.words is None or self._table is None:
            return []
        return [r.id for r in self._table.slots if self._published[r.id] != self._key(r, self._table.lookup)]

    def landed(self, record: SlotRecord) -> None:
        """A read between two messages made `record`'s expert resident (a prefetch landed while its
        layer waits to be visited): publish it now, so that the visit can lease it without a round
        trip. Publishing only adds a ready resident, which a `routes` sent now would also find."""
        if self.words is not None and self._table is not None:
            self._match(record, self._table.lookup)

    @staticmethod
    def _key(record: SlotRecord, lookup: dict[tuple[int, int], int]) -> tuple[int, int] | None:
        """What the words should say of `record`'s slot: its expert while ready and looked up."""
        if record.phase in ("ready", "leased") and record.layer is not None and record.expert_id is not None:
            candidate = (record.layer, record.expert_id)
            if lookup.get(candidate) == record.id:
                return candidate
        return None

    def _match(self, record: SlotRecord, lookup: dict[tuple[int, int], int]) -> None:
        """Make the words' entry of one slot what the table says of it."""
        assert self.words is not None
        key = self._key(record, lookup)
        now = self._published[record.id]
        if key == now:
            return
        if now is not None:
            self.withdraw(record.id)
        if key is not None:
            self.words.publish(record.id, *key)
            self._published[record.id] = key

    def processed(self) -> None:
        """One more of the GPU worker's residency messages is fully handled."""
        if self.words is None:
            return
        self.sync()
        self.count += 1
        self.words.set_processed(self.count)

    def reader_lost(self) -> int:
        """The GPU worker is gone: its counts are dropped and the next one starts from zero."""
        if self.words is None:
            return 0
        dropped = self.words.reset_readers()
        self.count = 0
        self.words.set_processed(0)
        if dropped:
            logger.warning("dropped %d reader count(s) of the lost GPU worker", dropped)
        return dropped


class PublishingBackend:
    """The manager's backend, with each slot withdrawn from the lease words before it changes."""

    def __init__(self, inner: object, publisher: LeasePublisher) -> None:
        self._inner = inner
        self._publisher = publisher

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: object) -> None:
        # The backend's own switches (e.g. `releasing`, set around pressure correction) are its.
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._inner, name, value)

    def discard(self, slot: int, generation: int) -> None:
        self._publisher.withdraw(slot)
        self._inner.discard(slot, generation)  # type: ignore[attr-defined]

    def submit_segments(self, slot: int, generation: int, segments) -> None:
        self._publisher.withdraw(slot)
        self._inner.submit_segments(slot, generation, segments)  # type: ignore[attr-defined]


def lease_words_for(config: RunConfig, slab: Slab) -> LeaseWords | None:
    """The lease words the GPU worker may lease resident experts through; None (every visit a
    round trip) when the run asks for messages."""
    spec = config.slab
    if config.lease_path != "shared" or not spec.lease_layers or slab.tail_bytes < spec.tail_bytes:
        logger.info("lease path: messages (--lease-path %s)", config.lease_path)
        return None
    logger.info(
        "lease path: shared lease words for %d slots, %d layers x %d experts",
        spec.total_slots,
        spec.lease_layers,
        spec.lease_experts,
    )
    return LeaseWords(
        slab.buffer,
        offset=slab.tail_offset,
        slots=spec.total_slots,
        layers=spec.lease_layers,
        experts=spec.lease_experts,
    )
