"""The lease hot path's shared words: the residency map and a reader count per slot.

The coordinator publishes which slot holds each resident expert; the GPU worker leases a
layer's resident experts itself, by counting itself in on their slots
(`native/leasewords.c`, whose header states the protocol), and counts itself out (its fence)
once nothing reads them. The coordinator alone decides residency: before a slot's content
changes it claims the slot (new readers back out), waits until the readers still in have left,
and withdraws it from the map; it publishes a slot only once its load has landed.

The words live after the slots in the slab segment (one segment to create, unlink and check
for leaks). Header word 1 counts the GPU worker's messages the coordinator has processed:
the worker takes the fast path only when every message it sent that may change residency has
been processed, so a fast lease sees what a `routes` request sent at that moment would have.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from native import _leasewords

__all__ = ["LeaseWords", "ReaderStuck", "lease_words_bytes"]

PROCESSED_WORD = 1
CLAIMED = 1 << 32


def lease_words_bytes(*, slots: int, layers: int, experts: int) -> int:
    """Bytes of the region for `slots` slots and a map of `layers` x `experts`."""
    return int(_leasewords.region_bytes(slots, layers, experts))


class ReaderStuck(TimeoutError):
    """A slot's readers did not leave within the claim's deadline (a hung or dead reader)."""


class LeaseWords:
    """The region of lease words at `offset` of a writable `buffer` (see the module docstring).

    `layers` is one more than the highest sparse layer id: the map is indexed by layer id.
    """

    __slots__ = ("_args", "buffer", "experts", "layers", "offset", "slots")

    def __init__(self, buffer, *, offset: int, slots: int, layers: int, experts: int) -> None:
        self.buffer, self.offset = buffer, int(offset)
        self.slots, self.layers, self.experts = int(slots), int(layers), int(experts)
        self._args = (buffer, self.offset, self.slots, self.layers, self.experts)
        _leasewords.word(*self._args, 0)  # checks the geometry against the buffer now

    # -- the writer (coordinator) -----------------------------------------------------------------

    def init(self) -> None:
        """Every slot claimed and withdrawn, no reader, nothing processed."""
        _leasewords.init(*self._args)

    def claim(self, slot: int, *, timeout_s: float = 10.0) -> float:
        """Bar new readers from `slot` and wait until the readers in it have left; the seconds
        waited. Raises `ReaderStuck` (the slot stays claimed) when they do not leave in time."""
        readers = _leasewords.claim(*self._args, slot)
        if not readers:
            return 0.0
        started = time.perf_counter()
        deadline = started + timeout_s
        while readers:
            if time.perf_counter() > deadline:
                raise ReaderStuck(f"slot {slot}: {readers} reader(s) still in after {timeout_s:.1f} s")
            time.sleep(0)  # a copy or one layer's compute: yield, do not sleep a tick
            readers = self.readers(slot)
        return time.perf_counter() - started

    def withdraw(self, slot: int, layer: int | None = None, expert: int | None = None) -> None:
        """The claimed `slot` leaves the map (its entry for layer:expert, if that is it)."""
        if layer is None or expert is None:
            _leasewords.withdraw(*self._args, slot, -1, 0)
        else:
            _leasewords.withdraw(*self._args, slot, layer, expert)

    def publish(self, slot: int, layer: int, expert: int) -> None:
        """The claimed `slot`, holding layer:expert ready, becomes leasable."""
        _leasewords.publish(*self._args, slot, layer, expert)

    def reset_readers(self) -> int:
        """The reader died: drop its counts (how many)."""
        return int(_leasewords.reset_readers(*self._args))

    def set_processed(self, count: int) -> None:
        _leasewords.set_header(*self._args, PROCESSED_WORD, count)

    # -- the reader (GPU worker) ------------------------------------------------------------------

    def lease(self, layer: int, experts: Sequence[int]) -> tuple[int, ...] | None:
        """Count in on every expert's slot (in `experts` order), or on none: None (a miss)."""
        return _leasewords.lease(*self._args, layer, experts)

    def lease_resident(self, layer: int, experts: Sequence[int]) -> dict[int, int]:
        """Count in on the slot of each of `experts` that is resident: {expert: slot}, in
        `experts` order (the others are left out)."""
        slots = _leasewords.lease(*self._args, layer, experts)
        if slots is not None:
            return dict(zip(experts, slots))
        resident = {}
        for expert in experts:
            got = _leasewords.lease(*self._args, layer, (expert,))
            if got is not None:
                resident[expert] = got[0]
        return resident

    def release(self, slots: Sequence[int]) -> None:
        """Count out of each slot (a fence)."""
        _leasewords.release(*self._args, slots)

    def processed(self) -> int:
        return int(_leasewords.word(*self._args, PROCESSED_WORD))

    # -- views (tests, diagnostics) ---------------------------------------------------------------

    def readers(self, slot: int) -> int:
        return int(_leasewords.word(*self._args, _leasewords.HEADER + self._slot(slot))) & (CLAIMED - 1)

    def claimed(self, slot: int) -> bool:
        return bool(int(_leasewords.word(*self._args, _leasewords.HEADER + self._slot(slot))) & CLAIMED)

    def generation(self, slot: int) -> int:
        return int(_leasewords.word(*self._args, _leasewords.HEADER + self.slots + self._slot(slot)))

    def entry(self, layer: int, expert: int) -> tuple[int, int] | None:
        """(slot, generation) published for layer:expert, or None."""
        if not (0 <= layer < self.layers and 0 <= expert < self.experts):
            raise ValueError(f"layer {layer} expert {expert} is outside {self.layers} layers x {self.experts} experts")
        word = int(_leasewords.word(*self._args, _leasewords.HEADER + 2 * self.slots + layer * self.experts + expert))
        return None if word == 0 else ((word & 0xFFFFFFFF) - 1, word >> 32)

    def _slot(self, slot: int) -> int:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is outside the {self.slots} slots")
        return slot
