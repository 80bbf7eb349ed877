"""Replacement policies: which resident expert a promoted miss replaces, and which experts hold the pins.

The residency core (coordinator.residency_core) consults its policy at three points and nowhere
else: `touch` after every demand wave it leased (the experts the wave used, hits and misses),
the wave's fenced release, where its misses are promoted in `promotion_order`, each replacing
the smallest `eviction_key` among the layer's ready, unleased slots (idle slots always go before
any of them: the core's rule) unless `admit` keeps it out, and the same victim choice (`choose_victim`)
when a prefetch needs a slot (coordinator.residency_prefetch). The core's invariants do not
depend on the policy: it only ever ranks slots the core offers (never leased, never loading,
never one of the wave's own slots).

- `lru` is the seed's policy, kept as the manager's default so its semantics stay checkable:
  least recently used first, pins fixed (moved only by the LFRU live repin at safe points).
- `lrfu` ranks by a decayed use count (LRFU, Lee et al. 1999): each use adds 1 to an expert's
  score and every score halves once per `half_life` visits of its layer; the victim is the
  smallest score, ties to the least recent. Its pins are adaptive (`adaptive_pins`): a pinned
  expert is ranked like any resident of its layer, and when it is the one to go, its pin
  passes to the layer's highest-ranked unpinned resident, so the layer's capacity and the
  pinned tier's size never change; history only chooses what is resident at the start.
- `nextuse` (coordinator.next_use, the system's default) ranks by a chance of use at the layer's
  next visit that a small logistic model learns online (recency, two decayed counts, and decayed
  transitions: which experts follow the ones just used). It admits a miss only when the miss
  ranks above its victim, and the core promotes a wave's misses in the order `promotion_order`
  gives (likeliest first), so a layer keeps the likeliest of its residents and the wave's misses.
  Its pins are adaptive as under `lrfu`.

Why `lrfu` admits every miss: on real routing (DeepSeek-V2-Lite, `scripts/replay.py`)
an expert used at the layer's previous visit is the likeliest to be used at the next (the
consecutive-token overlap), so misses are always kept; among the older residents, how often an
expert was used lately predicts its next use much better than when it was last used. Declining
misses whose score is below the victim's (TinyLFU-style admission) lost 3 to 13 points there
at 8 slots per layer, in a simulation of that rule for half-lives from 8 to unbounded; a decayed
count is the wrong yardstick for a miss, which `nextuse`'s learned chance is not.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from coordinator.next_use import NextUse
from coordinator.slot_table import SlotRecord, SlotTable, least_recent
from shared.config import parse_replacement

# The LRFU half-life in visits of a layer (decode: tokens). On real routing (DeepSeek-V2-Lite, no
# pins) the hit rate moves by at most 0.4 points from 4 to 64: 34.3 / 34.5 / 34.6 / 34.5 / 34.2%
# at 8 slots per layer, 50.7 / 51.2 / 51.5 / 51.3 / 50.8% at 16 (LRU 32.3 / 49.0%).
DEFAULT_HALF_LIFE = 16


class ReplacementPolicy(Protocol):
    """What the residency core asks of a replacement policy."""

    name: str
    adaptive_pins: bool  # pins are ranked with the layer's residents and may pass to another expert

    def touch(self, layer: int, expert_ids: Sequence[int]) -> None:
        """One demand wave of `layer` used `expert_ids` (unique, hits and misses)."""
        ...

    def eviction_key(self, record: SlotRecord) -> tuple:
        """A ready slot's rank: the smallest key is replaced first (idle slots go first unranked)."""
        ...

    def admit(self, layer: int, expert_id: int, victim: SlotRecord) -> bool:
        """Whether a miss of `layer` may replace `victim` (False: it is served and dropped)."""
        ...

    def promotion_order(self, layer: int, expert_ids: Sequence[int]) -> list[int]:
        """The order in which a released wave's misses (`expert_ids`, the core's order) are promoted."""
        ...


class LRU:
    """Least recently used (the seed): the core's clock (`SlotRecord.last_use`) is its only state."""

    name = "lru"
    adaptive_pins = False

    def touch(self, layer: int, expert_ids: Sequence[int]) -> None:
        pass  # the core stamps `last_use` at every lease

    def eviction_key(self, record: SlotRecord) -> tuple:
        return least_recent(record)

    def admit(self, layer: int, expert_id: int, victim: SlotRecord) -> bool:
        return True

    def promotion_order(self, layer: int, expert_ids: Sequence[int]) -> list[int]:
        return list(expert_ids)


class LRFU:
    """Decayed use counts per (layer, expert), kept for experts resident or not (see the module)."""

    name = "lrfu"
    adaptive_pins = True

    def __init__(self, *, half_life: int = DEFAULT_HALF_LIFE) -> None:
        if isinstance(half_life, bool) or not isinstance(half_life, int) or half_life < 1:
            raise ValueError(f"half_life must be a positive integer (visits), got {half_life!r}")
        self.half_life = half_life
        self._decay = 0.5 ** (1.0 / half_life)  # per visit of the layer
        self._visits: dict[int, int] = {}  # layer -> demand waves so far (its clock)
        self._scores: dict[tuple[int, int], tuple[float, int]] = {}  # (score, layer clock when stamped)

    def score(self, layer: int, expert_id: int) -> float:
        """The decayed count now (0.0 for an expert never used)."""
        stamped = self._scores.get((layer, expert_id))
        if stamped is None:
            return 0.0
        value, at = stamped
        return value * self._decay ** (self._visits[layer] - at)

    def touch(self, layer: int, expert_ids: Sequence[int]) -> None:
        clock = self._visits.get(layer, 0) + 1
        self._visits[layer] = clock
        for expert in expert_ids:
            self._scores[(layer, expert)] = (self.score(layer, expert) + 1.0, clock)

    def eviction_key(self, record: SlotRecord) -> tuple:
        if record.layer is None or record.expert_id is None:
            return (-1.0, record.last_use, record.id)
        return (self.score(record.layer, record.expert_id), record.last_use, record.id)

    def admit(self, layer: int, expert_id: int, victim: SlotRecord) -> bool:
        return True  # see the module: the just-used expert is the likeliest to be used next

    def promotion_order(self, layer: int, expert_ids: Sequence[int]) -> list[int]:
        return list(expert_ids)


def choose_victim(
    policy: ReplacementPolicy,
    table: SlotTable,
    layer: int,
    protected: set[int],
    *,
    pinned: tuple[list[tuple[int, int]], set[tuple[int, int]]],
) -> SlotRecord | None:
    """The slot a promoted miss of `layer` replaces (None: no slot can take it), as `policy` ranks them.

    `protected` are the releasing wave's slots. `pinned` is the core's pin list and its set of
    keys: with adaptive pins the layer's pinned experts are ranked too, and one chosen passes its
    pin to the layer's highest-ranked resident (`SlotTable.pass_pin`; both containers updated)
    and is replaced as a slot of the layer, so the layer's capacity and the pinned tier's size
    stay as planned.
    """
    pins = _rankable_pins(policy, table, layer, pinned[0])
    target = table.layer_victim(layer, protected, key=policy.eviction_key, pins=pins)
    if target is None or target.role != "pinned":
        return target
    heir = table.pass_pin(target, layer, policy.eviction_key)
    if heir is None:  # no resident of the layer can take the pin: it stays
        return table.layer_victim(layer, protected, key=policy.eviction_key)
    pin_list, pin_keys = pinned
    cold, hot = (layer, target.expert_id), (layer, heir.expert_id)
    pin_list[pin_list.index(cold)] = hot
    pin_keys.discard(cold)
    pin_keys.add(hot)
    return target


def replacement_policy(spec: str | ReplacementPolicy = "lru") -> ReplacementPolicy:
    """A policy from its spec (`lru`, `lrfu`, `lrfu:32`, `nextuse`, `nextuse:256`:
    `shared.config.parse_replacement`), or `spec` itself when it already is one."""
    if not isinstance(spec, str):
        return spec
    name, knob = parse_replacement(spec)
    if name == "lrfu":
        return LRFU() if knob is None else LRFU(half_life=knob)
    if name == "nextuse":
        return NextUse() if knob is None else NextUse(transition_half_life=knob)
    return LRU()


def victims_in_order(
    policy: ReplacementPolicy,
    table: SlotTable,
    layer: int,
    protected: set[int],
    *,
    pinned: tuple[list[tuple[int, int]], set[tuple[int, int]]],
) -> Iterator[SlotRecord]:
    """`choose_victim`'s choices for several slots of `layer` (a prediction's experts), in order.

    The caller protects each slot it takes (or stops): then the layer is ranked once, not once
    per slot (at the default benchmark shape a prediction took ~7 slots of 32: ~220 keys asked,
    now 32). No key changes meanwhile: the policies' keys move only at `touch` and at a slot's
    own use. Where a pin may pass (adaptive pins and the layer holds pinned experts), each
    choice is `choose_victim`'s own, as the passes change which slots are the layer's."""
    if _rankable_pins(policy, table, layer, pinned[0]):
        while (victim := choose_victim(policy, table, layer, protected, pinned=pinned)) is not None:
            yield victim
        return
    yield from table.layer_victims(layer, protected, key=policy.eviction_key)


def _rankable_pins(
    policy: ReplacementPolicy, table: SlotTable, layer: int, pin_list: list[tuple[int, int]]
) -> list[SlotRecord]:
    """The layer's pinned slots a victim choice ranks with its residents (adaptive pins only)."""
    if not policy.adaptive_pins:
        return []
    lookup, slots = table.lookup, table.slots
    return [
        slots[lookup[key]]
        for key in pin_list
        if key[0] == layer and key in lookup and slots[lookup[key]].role == "pinned"
    ]


__all__ = [
    "DEFAULT_HALF_LIFE",
    "LRFU",
    "LRU",
    "NextUse",
    "ReplacementPolicy",
    "choose_victim",
    "replacement_policy",
    "victims_in_order",
]
