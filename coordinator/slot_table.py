"""Slot bookkeeping of the residency manager: roles, phases, the expert lookup.

The manager decides *when* a slot changes; this table keeps the records
consistent while it does (the lookup only ever maps ready or leased slots,
or a prefetch's slot while its read is in flight, which demand waits for;
a layer's slot set and the working bank partition the live slots).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn

from coordinator.residency_backend import ExpertResidencyBackend
from coordinator.residency_types import ExpertResidencyLeaseEntry, ResidencyError

SlotRole = Literal["working", "layer", "pinned", "disabled"]
SlotPhase = Literal["idle", "loading", "ready", "leased"]


@dataclass(slots=True, eq=False)
class SlotRecord:
    """One slab slot: its role, phase and the expert it holds (if any)."""

    id: int
    role: SlotRole
    layer: int | None
    phase: SlotPhase = "idle"
    expert_id: int | None = None
    generation: int = 0
    last_use: int = 0
    prefetched: bool = False  # read by a prefetch and not yet leased by demand
    changed: set[int] | None = field(default=None, repr=False)  # its table's `changed`

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        if name in _WHAT_IS_PUBLISHED:
            changed = getattr(self, "changed", None)  # not yet set while __init__ runs
            if changed is not None:
                changed.add(self.id)


_WHAT_IS_PUBLISHED = frozenset(("phase", "layer", "expert_id"))  # what the lease words publish of a slot


class _Lookup(dict[tuple[int, int], int]):
    """The expert lookup, telling `changed` the slot an entry named before a change and after it:
    those are the only slots whose published state the change can alter."""

    __slots__ = ("changed",)

    def __init__(self, changed: set[int]) -> None:
        super().__init__()
        self.changed = changed

    def __setitem__(self, key: tuple[int, int], slot: int) -> None:
        before = self.get(key)
        if before is not None:
            self.changed.add(before)
        self.changed.add(slot)
        super().__setitem__(key, slot)

    def __delitem__(self, key: tuple[int, int]) -> None:
        self.changed.add(self[key])
        super().__delitem__(key)

    def _untold(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("the expert lookup changes only by `lookup[key] = slot` and `del lookup[key]`")

    pop = popitem = clear = update = setdefault = __ior__ = _untold  # type: ignore[assignment]


def least_recent(record: SlotRecord) -> tuple[int, int]:
    """The seed's rank of a ready slot: least recently used first, ties to the lowest slot id."""
    return (record.last_use, record.id)


class SlotTable:
    """Every slot record plus the indexes the policy consults."""

    def __init__(self, backend: ExpertResidencyBackend) -> None:
        self.backend = backend
        # Told when a slot a prefetch read loses its expert before any demand lease took it.
        self.on_prefetch_lost: Callable[[SlotRecord], None] | None = None
        self.slots: list[SlotRecord] = []
        self.working: set[int] = set()
        self.layer_slots: dict[int, set[int]] = {}
        # Slots whose phase, expert or lookup entry changed since the last `take_changed` (the lease
        # publisher re-matches only those, not every slot, after each of the GPU worker's messages).
        self.changed: set[int] = set()
        self.lookup: dict[tuple[int, int], int] = _Lookup(self.changed)

    def new_slot(self, role: SlotRole, layer: int | None) -> SlotRecord:
        record = SlotRecord(id=len(self.slots), role=role, layer=layer, changed=self.changed)
        self.changed.add(record.id)
        self.slots.append(record)
        return record

    def take_changed(self) -> list[int]:
        """The slots changed since the last call (`changed`), in order; forgets them."""
        taken = sorted(self.changed)
        self.changed.clear()
        return taken

    def entry(self, record: SlotRecord, *, hit: bool) -> ExpertResidencyLeaseEntry:
        assert record.layer is not None and record.expert_id is not None
        return ExpertResidencyLeaseEntry(
            layer=record.layer,
            expert_id=record.expert_id,
            slot=record.id,
            generation=record.generation,
            hit=hit,
        )

    def forget(self, record: SlotRecord, *, keep_layer: bool = False) -> None:
        """Discard a ready slot's contents and its lookup entry; it becomes idle."""
        if record.prefetched:
            record.prefetched = False
            if self.on_prefetch_lost is not None:
                self.on_prefetch_lost(record)
        key = (record.layer, record.expert_id)
        if record.layer is not None and record.expert_id is not None and self.lookup.get(key) == record.id:
            del self.lookup[key]
        self.backend.discard(record.id, record.generation)
        record.phase = "idle"
        record.expert_id = None
        if not keep_layer and record.role != "layer":
            record.layer = None

    def try_forget(self, record: SlotRecord, errors: list[BaseException]) -> None:
        try:
            self.forget(record)
        except Exception as error:
            errors.append(error)
            self.disable(record)

    def layer_victim(
        self,
        layer: int,
        protected: set[int],
        *,
        key: Callable[[SlotRecord], tuple] = least_recent,
        pins: Sequence[SlotRecord] = (),
    ) -> SlotRecord | None:
        """The slot a promoted miss of `layer` replaces: idle first, then the smallest `key` among
        the layer's ready slots and the ready `pins` offered (the replacement policy's rank).

        An idle slot is chosen without asking `key` (the least recent of them): an empty slot has
        no rank, and a policy that is never asked need not rank the layer at all (`nextuse`)."""
        # Not next(layer_victims(...)): a demand miss takes one slot, and a min is cheaper than a
        # generator and a sort on its round trip (at 48 layers that is ~290 choices a token).
        candidates = self._victim_candidates(layer, protected)
        idle = [record for record in candidates if record.phase == "idle"]
        if idle:
            return min(idle, key=least_recent)
        candidates += [record for record in pins if record.id not in protected and record.phase == "ready"]
        if not candidates:
            return None
        return min(candidates, key=key)

    def layer_victims(
        self,
        layer: int,
        protected: set[int],
        *,
        key: Callable[[SlotRecord], tuple] = least_recent,
        pins: Sequence[SlotRecord] = (),
    ) -> Iterator[SlotRecord]:
        """`layer_victim`'s choices one after another, each ranked once: the idle slots (least
        recent first), then the ready ones by `key`, skipping any the caller has since protected.

        The order is the one repeated `layer_victim` calls give when the caller protects (or
        makes loading) each slot it takes and changes no other slot's key meanwhile (a prefetch
        of several experts): one ranking of the layer instead of one per taken slot."""
        candidates = self._victim_candidates(layer, protected)
        idle = sorted((record for record in candidates if record.phase == "idle"), key=least_recent)
        for record in idle:
            if record.id not in protected and record.phase == "idle":
                yield record
        # Ranked only once the idle ones are taken (see `layer_victim`): a dormant layer stays unranked.
        ready = [record for record in candidates if record.phase == "ready"]
        ready += [record for record in pins if record.id not in protected and record.phase == "ready"]
        for record in sorted(ready, key=key):
            if record.id not in protected and record.phase == "ready":
                yield record

    def _victim_candidates(self, layer: int, protected: set[int]) -> list[SlotRecord]:
        slots = self.slots
        return [slots[i] for i in self.layer_slots[layer] if i not in protected and slots[i].phase in ("idle", "ready")]

    def idle_layer_slots(self, layer: int) -> int:
        """How many of `layer`'s slots are idle (a wave's misses up to this many need no victim)."""
        slots = self.slots
        return sum(1 for i in self.layer_slots[layer] if slots[i].phase == "idle")

    def pass_pin(self, pin: SlotRecord, layer: int, key: Callable[[SlotRecord], tuple]) -> SlotRecord | None:
        """Make the ready pinned slot `pin` one of `layer`'s slots and pin the layer's highest-ranked
        ready slot instead (its heir, returned); roles move, bytes do not. None (nothing moved)
        when the layer has no ready slot to take the pin."""
        ready = [self.slots[i] for i in self.layer_slots[layer] if self.slots[i].phase == "ready"]
        if not ready or pin.role != "pinned" or pin.layer != layer:
            return None
        heir = max(ready, key=key)
        self.layer_slots[layer].discard(heir.id)
        self.layer_slots[layer].add(pin.id)
        heir.role, pin.role = "pinned", "layer"
        return heir

    def swap_roles(
        self,
        loaded: SlotRecord,
        target: SlotRecord,
        role: Literal["layer", "pinned"],
        layer: int | None,
    ) -> None:
        """Promote a ready working slot into `target`'s role; target joins the bank.

        Only roles move: the loaded bytes stay in their slot, so no I/O happens.
        """
        if loaded.role != "working" or loaded.phase != "ready" or target.phase != "idle":
            raise ResidencyError(
                f"expert promotion requires a ready working slot and an idle destination "
                f"(slot {loaded.id} {loaded.role}/{loaded.phase}, slot {target.id} {target.role}/{target.phase})"
            )
        self.working.discard(loaded.id)
        self.working.add(target.id)
        target.role, target.layer, target.expert_id = "working", None, None
        loaded.role = role
        if role == "layer":
            assert layer is not None
            loaded.layer = layer
            self.layer_slots[layer].discard(target.id)
            self.layer_slots[layer].add(loaded.id)

    def disable(self, record: SlotRecord) -> None:
        """Retire a slot whose state the backend could not confirm."""
        key = (record.layer, record.expert_id)
        if record.layer is not None and record.expert_id is not None and self.lookup.get(key) == record.id:
            del self.lookup[key]
        self.working.discard(record.id)
        if record.layer is not None and record.layer in self.layer_slots:
            self.layer_slots[record.layer].discard(record.id)
        record.role = "disabled"
        record.layer = None
        record.expert_id = None
