"""Copy ahead: the next sparse layer's predicted experts, copied while this layer computes.

On the copy path (CPU, CUDA) a decode visit's experts are copied from their slots into MLX
memory before the layer can compute, and that copy sits on the critical path: the router's
evaluation has just returned and MLX waits for it. The next sparse layer's router applied to
this layer's MoE input names most of the experts that layer will pick (`gpuworker.prediction`),
and MLX runs a whole decode wave on one core (`gpuworker.lanes`): so once this layer's experts
are dispatched, the predicted ones are copied into a staged set on the other core, and when the
next layer's routes are known only the experts the prediction missed are copied.

What it changes and what it does not:
- the staging reads slots only under reader counts of the lease words (counted in, copied,
  counted out: the shared lease's own protocol, so no slot is rewritten while it is read), and
  a copy is the expert's bytes whatever its slot holds afterwards;
- it records nothing: no visit, no recency, no ledger count. The next layer's visit is leased
  and told exactly as it would be without it; only where its tensors come from changes. A
  predicted expert that is not resident is not staged;
- a staged set is written only after every output that read it before is evaluated.

Adaptive: when fewer than `MIN_USEFUL` of the routed experts were found staged over a window
(a model whose routing the next layer's router does not predict), it stops, logs why and says
so in the lease telemetry (`copy_ahead` "stopped"). After `RETRY_VISITS` decode visits stopped
it tries again for a window (`due`), and logs that: a verdict reached in a job's first tokens,
when a streaming system has little resident yet, must not hold for the rest of its life (on the
deep bench shape at 25% residency it stopped in the first warm-up job and never ran again).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from gpuworker.stacking import StackBuffers, stack_into
from shared.lease_words import LeaseWords

__all__ = ["MIN_USEFUL", "RETRY_VISITS", "UNSORTED_ROUTES", "WINDOW", "CopyAhead", "StagedSet"]

logger = logging.getLogger(__name__)

SETS = 2  # one set read by the layer computing, one being filled for the next
# mlx-lm's SwitchGLU/SwitchMLP sort routes of this many entries or more by expert; fewer are computed
# in route order, so a staged set's rows need not ascend with the expert ids (a decode row's top-k).
UNSORTED_ROUTES = 64
WINDOW = 256  # routed experts per usefulness judgement
MIN_USEFUL = 0.25  # share of routed experts found staged below which copying ahead stops
RETRY_VISITS = 2048  # decode visits stopped before a new trial (a trial copies for one window)


@dataclass(slots=True)
class StagedSet:
    """Experts of `layer` copied into rows of pool set `tag` ahead of the layer's visit."""

    layer: int
    tag: int
    rows: dict[int, int]  # expert -> row
    filled: int  # rows written (0 .. filled-1)
    capacity: int
    target: dict[str, tuple[np.ndarray, mx.array]]
    used: int = 0  # routed experts the visit found here


class CopyAhead:
    """The staged sets of one lease client (see the module docstring)."""

    def __init__(self, *, buffer, slot_bytes: int, store, words: LeaseWords, top_k: int) -> None:
        self.buffer, self.slot_bytes, self.store, self.words = buffer, int(slot_bytes), store, words
        self.top_k = int(top_k)
        self._pool = StackBuffers(max_pooled=1 << 16, max_sets=SETS)
        self._next_tag = 0
        self._staged: StagedSet | None = None
        self._last_readers: dict[int, list[mx.array]] = {}  # tag -> outputs that read it last
        self.on = True
        self.retries = 0  # trials started after a stop
        self._stopped_visits = 0
        self._window_routed = 0
        self._window_used = 0
        self.reset_counters()

    def reset_counters(self) -> None:
        """Telemetry since the last reset (a job's): the lease client's stats take it."""
        self.staged = 0  # experts copied ahead
        self.used = 0  # routed experts served from a staged set
        self.routed = 0  # routed experts of the visits a staged set served

    def due(self) -> bool:
        """Whether this decode visit copies the next layer's experts ahead: while on; stopped, once
        every `RETRY_VISITS` visits, when a new trial starts (module docstring)."""
        if self.on:
            return True
        self._stopped_visits += 1
        if self._stopped_visits < RETRY_VISITS:
            return False
        self.on, self._stopped_visits = True, 0
        self.retries += 1
        logger.info("copy ahead: trying again after %d decode visits stopped", RETRY_VISITS)
        return True

    def stage(self, layer: int, experts: Sequence[int]) -> tuple[int, float]:
        """Copy the resident ones of `experts` (predicted for sparse layer `layer`) into a set;
        the bytes copied and the seconds it took."""
        self._staged = None
        if not self.on or not experts:
            return 0, 0.0
        started = time.perf_counter()
        tag = self._next_tag
        self._next_tag = (tag + 1) % SETS
        readers = self._last_readers.pop(tag, None)
        if readers:  # done already (the layers since fed on them), but say so to MLX
            mx.eval(*readers)
        resident = self.words.lease_resident(layer, experts)
        staged_experts, staged_slots = list(resident), list(resident.values())
        if not staged_slots:
            return 0, 0.0
        try:
            layouts = [self.store.layout(layer, e) for e in staged_experts]
            capacity = len(experts) + self.top_k  # room for every routed expert the prediction missed
            target = self._pool.get(capacity, layouts[0], tag=tag)
            wrap = stack_into(self.buffer, staged_slots, self.slot_bytes, layouts, target)
        finally:
            self.words.release(staged_slots)  # copied: nothing reads the slots any more
        self._staged = StagedSet(
            layer=layer,
            tag=tag,
            rows={expert: row for row, expert in enumerate(staged_experts)},
            filled=len(staged_experts),
            capacity=capacity,
            target=target,
        )
        self.staged += len(staged_experts)
        return wrap.bytes_copied, time.perf_counter() - started

    def take(self, layer: int) -> StagedSet | None:
        """The set staged for `layer` (once); any other visit drops it."""
        staged, self._staged = self._staged, None
        return staged if staged is not None and staged.layer == layer else None

    def place(self, staged: StagedSet, experts: Sequence[int]) -> tuple[int, ...]:
        """Each of `experts`' row in `staged`: where it was staged, or a free row after them."""
        rows, missing = [], []
        for expert in experts:
            row = staged.rows.get(expert)
            if row is None:
                missing.append(expert)
                row = staged.filled + len(missing) - 1
            rows.append(row)
        if staged.filled + len(missing) > staged.capacity:
            raise ValueError(f"layer {staged.layer}: {len(missing)} experts do not fit the staged set")
        staged.used = len(experts) - len(missing)
        return tuple(rows)

    def fill(self, staged: StagedSet, experts: Sequence[int], slots: Sequence[int]) -> tuple[dict, int]:
        """Copy the experts `place` found missing (`slots`: each expert's, leased) into their rows;
        the set's arrays and the bytes copied now."""
        missing = [(e, s) for e, s in zip(experts, slots) if e not in staged.rows]
        copied = 0
        if missing:
            layouts = [self.store.layout(staged.layer, e) for e, _ in missing]
            wrap = stack_into(
                self.buffer, [s for _, s in missing], self.slot_bytes, layouts, staged.target, row=staged.filled
            )
            copied = wrap.bytes_copied
        self.used += staged.used
        self.routed += len(experts)
        self._judge(len(experts), staged.used)
        return {name: array for name, (_, array) in staged.target.items()}, copied

    def read_by(self, staged: StagedSet, outputs: Sequence[mx.array]) -> None:
        """`outputs` read `staged`'s set: evaluated before the set is written again."""
        self._last_readers[staged.tag] = list(outputs)

    def _judge(self, routed: int, used: int) -> None:
        self._window_routed += routed
        self._window_used += used
        if self._window_routed < WINDOW:
            return
        share = self._window_used / self._window_routed
        self._window_routed = self._window_used = 0
        if share < MIN_USEFUL:
            self.on = False
            self._staged = None
            self._pool.clear()
            self._last_readers.clear()
            logger.info(
                "copy ahead stopped: %.0f%% of the routed experts were staged (below %.0f%%)",
                100 * share,
                100 * MIN_USEFUL,
            )
