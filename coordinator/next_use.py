"""The `nextuse` replacement policy: rank a layer's experts by the learned chance of use at its next visit.

Why: on real routing (DeepSeek-V2-Lite, `scripts/replay.py`), recency and decayed counts alone
plateau (every LRFU half-life from 4 to 64 lands within 0.4 points), and declining misses by a
decayed count loses. What they miss is which experts follow which: the experts a layer used at
this visit say much about the ones it uses at the next (a per-layer transition estimate, decayed
so it follows the prompt). No one weighting of these signals is right for every model and
prompt, so a small logistic model learns it online from the routing it serves: after every
visit of a layer it is told which experts that visit used, takes one gradient step, and ranks
the layer's experts for the next visit.

Features of expert e at a layer, after a visit V (all per layer, online, no history needed):
  1, [e in V], log1p(decayed count, half-life 8), log1p(decayed count, half-life 64),
  log(p_e + 1e-3), p_e = mean over a in V of P(e next | a now) from decayed transition counts
  with a prior of the layer's overall selection shares.
One weight vector serves every layer (a layer's visits teach the others), so it is learned
from the first tokens on. The rank is the logit; ties go to the least recent.

A layer is dormant until the core first asks for a rank there (its first victim among
residents): until then its visits are only queued (the last `DORMANT_VISITS`) and folded in at
that first ask. The model costs 60-100 us a visit; where every expert of a layer has a slot
(an all-resident system) no rank is ever asked, and on a host whose cores all compute, that
CPU came out of decode (6 points at 48 layers, issue 13's note). An awake layer's visit is
folded in lazily too (`settle`, which every rank asks for first, in the visits' order): the
core settles when its loop is idle, so the fold is not between a demand read's reply and its
lease (where it took ~0.1 ms of a 48-layer round trip here).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import numpy as np

from coordinator.slot_table import SlotRecord

DEFAULT_TRANSITION_HALF_LIFE = 128  # visits of the layer
LEARNING_RATE = 0.05
# Visits a dormant layer queues: past this the oldest are dropped (counts of half-life 64 and
# transitions of 128 have decayed to a quarter and a half; the fold at the first ask is bounded).
DORMANT_VISITS = 128
_PRIOR = 2.0  # pseudo-visits of the layer's selection shares behind every transition row
_L2 = 1e-4
# The lazy decay's scale is folded back into the counts past this (the transitions are float32, to
# halve an E x E matrix per layer: 36 MB for 61 layers of 384 experts; float32 ends at 3.4e38).
_RESCALE_AT = 1e30
# Initial weights: a recency-first ranking (the experts just used are kept first), so the first
# visits behave like LRU with a transition hint until the model has seen some routing.
_INITIAL_WEIGHTS = (-2.5, 1.0, 0.0, 0.0, 0.5)


# Per row of a layer's counts: selections (undecayed), and decayed counts of half-life 8 and 64 visits.
_COUNT_DECAYS = np.array([[1.0], [0.5 ** (1 / 8)], [0.5 ** (1 / 64)]])


class _LayerModel:
    """One layer's routing statistics, and its experts' features after its last visit.

    Arrays are laid out expert-last, so a feature or count row is contiguous and a rank is one
    product (`weights @ features`)."""

    def __init__(self, experts: int, transition_decay: float) -> None:
        self.visits = 0
        self._transition_decay = transition_decay
        # Transition counts (row: used at a visit, column: used at the next) and their row sums are
        # stored times `_scale`, which grows instead of every count decaying at every visit.
        self._scale = 1.0
        self._transitions = np.zeros((0, 0), dtype=np.float32)
        self._row_totals = np.zeros(0)
        self._counts = np.zeros((len(_COUNT_DECAYS), 0))
        self._selections = 0  # the sum of the counts' first row, kept rather than summed every visit
        self._previous = np.zeros(0, dtype=np.int64)
        self._grow(experts)

    @property
    def experts(self) -> int:
        return self._row_totals.size

    def _grow(self, experts: int) -> None:
        """Room for expert ids below `experts`, what was counted kept (features are recomputed)."""
        old = self.experts
        transitions = np.zeros((experts, experts), dtype=np.float32)
        transitions[:old, :old] = self._transitions
        self._transitions = transitions
        row_totals, counts = np.zeros(experts), np.zeros((len(_COUNT_DECAYS), experts))
        row_totals[:old], counts[:, :old] = self._row_totals, self._counts
        self._row_totals, self._counts = row_totals, counts
        self.features = np.zeros((len(_INITIAL_WEIGHTS), experts))

    def observe(self, used: np.ndarray) -> None:
        """Fold in one visit that used the expert ids `used` (unique) and recompute the features."""
        if used.size and int(used.max()) >= self.experts:
            self._grow(max(int(used.max()) + 1, 2 * self.experts))
        self.visits += 1
        self._scale /= self._transition_decay
        if self._scale > _RESCALE_AT:
            self._transitions /= self._scale
            self._row_totals /= self._scale
            self._scale = 1.0
        if self._previous.size and used.size:
            self._transitions[self._previous[:, None], used] += self._scale
            self._row_totals[self._previous] += self._scale
        self._previous = used
        counts = self._counts
        counts *= _COUNT_DECAYS
        counts[:, used] += 1.0

        self._selections += used.size
        total = self._selections
        shares = counts[0] * (used.size / total) if total else np.full(self.experts, 1.0 / self.experts)
        features = self.features
        if used.size:
            # mean over a in used of (T[a] + prior * shares) / (row_total[a] + prior), as one product
            prior = _PRIOR * self._scale
            inverse = 1.0 / (self._row_totals[used] + prior)
            follow = (inverse @ self._transitions[used] + (prior * inverse.sum()) * shares) / used.size
        else:
            follow = shares
        features[0] = 1.0
        features[1] = 0.0
        features[1, used] = 1.0
        np.log1p(counts[1:], out=features[2:4])
        np.log(follow + 1e-3, out=features[4])


class NextUse:
    """Ranks experts by a logistic model of their use at the layer's next visit (see the module).

    `admit` keeps a miss only when it ranks above the victim, and misses are promoted likeliest
    first (`promotion_order`), so a layer keeps the likeliest of its residents and the wave's
    misses. Pins are adaptive as under `lrfu`.
    """

    name = "nextuse"
    adaptive_pins = True

    def __init__(self, *, transition_half_life: int = DEFAULT_TRANSITION_HALF_LIFE) -> None:
        if (
            isinstance(transition_half_life, bool)
            or not isinstance(transition_half_life, int)
            or transition_half_life < 1
        ):
            raise ValueError(f"transition_half_life must be a positive integer (visits), got {transition_half_life!r}")
        self.transition_half_life = transition_half_life
        self._transition_decay = 0.5 ** (1.0 / transition_half_life)
        self._weights = np.array(_INITIAL_WEIGHTS, dtype=np.float64)
        self._layers: dict[int, _LayerModel] = {}  # the awake layers
        self._dormant: dict[int, deque[np.ndarray]] = {}  # layer -> its visits until its first rank
        self._ranks: dict[int, np.ndarray] = {}  # layer -> logit per expert after its last visit
        self._pending: list[tuple[int, np.ndarray]] = []  # visits touched, not folded in yet (`settle`)

    @property
    def weights(self) -> tuple[float, ...]:
        """The model's weights now (bias, used now, short count, long count, transition)."""
        self.settle()
        return tuple(float(w) for w in self._weights)

    def ranks(self, layer: int) -> np.ndarray | None:
        """The layer's logit per expert after its last visit (None: never visited). A dormant
        layer's queued visits are folded in first (see the module)."""
        if self._pending:
            self.settle()
        ranks = self._ranks.get(layer)
        if ranks is None and layer in self._dormant:
            queued = self._dormant.pop(layer)
            largest = max((int(used.max()) for used in queued if used.size), default=0)
            model = self._layers[layer] = _LayerModel(max(64, largest + 1), self._transition_decay)
            for used in queued:
                self._fold(layer, model, used)
            ranks = self._ranks[layer]
        return ranks

    def rank(self, layer: int, expert_id: int) -> float:
        """The expert's logit after the layer's last visit (-inf: the layer never visited, or an id past
        every id it has seen)."""
        ranks = self.ranks(layer)
        if ranks is None or not 0 <= expert_id < ranks.size:
            return -math.inf
        return float(ranks[expert_id])

    def touch(self, layer: int, expert_ids: Sequence[int]) -> None:
        """Record a visit; it is folded in at `settle`, which every rank asks for first. The fold (a
        gradient step and the layer's features: 30 us here, about 0.1 ms on a busy coordinator) would
        otherwise sit between a demand read's reply and its lease; the core settles when idle."""
        used = np.fromiter(expert_ids, dtype=np.int64, count=len(expert_ids))
        if used.size and int(used.min()) < 0:
            raise ValueError(f"expert ids must be non-negative, got {list(expert_ids)!r}")
        self._pending.append((layer, used))

    def settle(self) -> None:
        """Fold in the visits touched since the last settle, in the order they came (so the ranks
        are the same as if each had been folded in at its touch)."""
        pending, self._pending = self._pending, []
        for layer, used in pending:
            model = self._layers.get(layer)
            if model is None:
                self._dormant.setdefault(layer, deque(maxlen=DORMANT_VISITS)).append(used)
            else:
                self._fold(layer, model, used)

    def _fold(self, layer: int, model: _LayerModel, used: np.ndarray) -> None:
        if model.visits:
            self._learn(model, used)  # last visit's features against what this visit used
        model.observe(used)
        self._ranks[layer] = self._weights @ model.features

    def _learn(self, model: _LayerModel, used: np.ndarray) -> None:
        """One gradient step of the log loss: the last visit's features against what this one used."""
        features = model.features
        used = used[used < features.shape[1]]  # an expert beyond the last visit's size had no features
        chance = 1.0 / (1.0 + np.exp(-(self._weights @ features)))
        gradient = (features @ chance - features[:, used].sum(axis=1)) / features.shape[1]
        self._weights -= LEARNING_RATE * (gradient + _L2 * self._weights)

    def eviction_key(self, record: SlotRecord) -> tuple:
        if record.layer is None or record.expert_id is None:
            return (-math.inf, record.last_use, record.id)
        return (self.rank(record.layer, record.expert_id), record.last_use, record.id)

    def admit(self, layer: int, expert_id: int, victim: SlotRecord) -> bool:
        if victim.layer is None or victim.expert_id is None:
            return True  # an idle slot: keeping the miss costs nothing
        return self.rank(layer, expert_id) >= self.rank(victim.layer, victim.expert_id)

    def promotion_order(self, layer: int, expert_ids: Sequence[int]) -> list[int]:
        """The wave's misses, likeliest first: each then meets the least likely resident left, so
        the layer ends with the likeliest of residents and misses."""
        return sorted(expert_ids, key=lambda expert: -self.rank(layer, expert))
