"""The shared lease path of `gpuworker.lease_client.LeaseClient` (a mixin of it).

A decode visit whose experts are all resident leases them without a message: through the lease
words (`shared.lease_words`), by counting itself in on their slots, and only when the
coordinator has processed every message sent that may change residency (`_sent`), so that it
sees what a `routes` sent now would have seen. On the copy path the counts end as soon as the
last part is copied (nothing reads the slots after that); on the zero-copy path at the wave's
fence. The visits are told in one `visited` before any other message, or at the end of the
forward step (`_send_visited`), carrying the fence of a message-path lease that preceded them,
so the coordinator records them (ledger, recency) in the order a `routes` per visit would have.
A visit that predicts the next layer's experts is told at once (no reply awaited), so that the
coordinator reads them while the layer computes, as it would for a `routes`; a `visited` that
fences or predicts counts in `_sent`. A miss, or a lost race, takes the message path.
"""

from __future__ import annotations

import time

import numpy as np

from gpuworker.copy_ahead import StagedSet
from gpuworker.expert_provider import LeasedWave
from gpuworker.lanes import decode_parts, part_lanes
from gpuworker.lease_stats import DECODE
from gpuworker.lease_visit import Visit, counted_lease, visit_wave
from gpuworker.slots import COPY
from shared.gpu_messages import Prediction, RouteMatrix, Visited

__all__ = ["SharedLeasing"]


class SharedLeasing:
    """The lease client's shared path (its attributes: words, channel, working_slots,
    compute_lanes, _sent, _visited_*, _unsent, _acks, _visit, _stack_pool, _ahead, _stats, _bucket,
    _phase, and its `_wrap`/`_wrap_part`)."""

    def _send_visited(self, *, end_step: bool) -> None:
        fence, self._visited_fence = self._visited_fence, None
        counts = tuple(rows.shape[0] for rows in self._visited_rows)
        message = Visited(
            layers=tuple(self._visited_layers),
            routes=RouteMatrix(np.concatenate(self._visited_rows)),
            fence=fence,
            end_step=end_step,
            predictions=tuple(self._visited_predictions),
            visit_rows=counts if any(count != 1 for count in counts) else (),
        )
        self._visited_layers, self._visited_rows, self._visited_predictions = [], [], []
        self.channel.send(message)
        if fence is not None or message.predictions:  # it may change residency: counted
            self._sent += 1
        if fence is not None:  # its `fenced` is taken like an end-of-step fence's
            self._acks.add(fence)

    def _acquire_shared(
        self,
        layer: int,
        routes: np.ndarray,
        prefetch: tuple[int, tuple[int, ...]] | None,
        staged: StagedSet | None = None,
    ) -> list[LeasedWave] | None:
        """The shared path for a decode visit of one or more sequences' rows (see the module
        docstring); None: take messages. `staged`: this layer's experts copied ahead, if any."""
        assert self.words is not None
        if self.words.processed() != self._sent:
            self._stats.shared_behind += 1
            return None
        started = time.perf_counter()
        experts = tuple(dict.fromkeys(routes.reshape(-1).tolist()))  # unique, first seen: the coordinator's order
        if len(experts) > self.working_slots:
            return None
        slots = self.words.lease(layer, experts)
        if slots is None:
            self._stats.shared_misses += 1
            return None
        if self._unsent is not None:  # the last wave of a message-path visit: the coordinator
            # releases it before it records this visit, as it would before this visit's routes
            self._visited_fence, self._unsent = self._unsent, None
        self._visited_layers.append(layer)
        self._visited_rows.append(np.asarray(routes, dtype=np.int32).reshape(routes.shape[0], -1))
        if prefetch is not None:
            visit_index = len(self._visited_layers) - 1
            self._visited_predictions.append(Prediction(visit=visit_index, layer=prefetch[0], experts=prefetch[1]))
        self._phase = DECODE
        self._bucket = self._stats.bucket(layer, DECODE)
        self._bucket[0] += 1
        self._bucket[4] += len(experts)
        self._bucket[5] += len(experts)
        self._bucket[8] += 1
        elapsed = time.perf_counter() - started
        self._bucket[2] += elapsed  # the lease wait, as a round trip's would be
        self._stats.wait_s += elapsed
        lease = counted_lease(layer, experts, slots)
        visit = Visit(layer, [experts], [lease], [False], stacked=self._stack_pool is not None, shared=slots)
        self._visit = visit
        self._stats.visit_waits.append(elapsed)
        if prefetch is not None:  # the prediction's reads start while this layer computes, as a routes' do
            self._send_visited(end_step=False)
        try:
            if self._stack_pool is None:  # zero copy: the views read the slots until the fence
                return [visit_wave(visit, 0, self._wrap(layer, experts, lease))]
            one_row = routes.shape[0] == 1  # parts split one row's ranks (gpuworker.streamed)
            parts = (
                decode_parts(experts, lanes=self.compute_lanes) if one_row and self._in_parts(layer, experts) else ()
            )
            lanes = part_lanes(len(parts), self.compute_lanes)

            def whole():
                try:
                    return self._wrap(layer, experts, lease)
                finally:
                    self._count_out(visit)  # copied: nothing reads the slots any more

            def take_part(index: int):
                try:
                    return self._wrap_part(layer, parts[index], index, lease, lane=lanes[index])
                finally:
                    if index == len(parts) - 1:
                        self._count_out(visit)

            if staged is not None and one_row and not parts:
                return [self._staged_wave(visit, staged, experts, slots)]
            if not parts:
                return [visit_wave(visit, 0, whole)]
            return [visit_wave(visit, 0, whole, parts=parts, part_lanes=lanes, take_part=take_part)]
        except BaseException:
            self._visit = None
            self._count_out(visit)
            raise

    def _staged_wave(self, visit: Visit, staged: StagedSet, experts: tuple[int, ...], slots: tuple[int, ...]):
        """The visit's one wave from the set copied ahead (`slots`: its experts', leased by either
        path): only the experts the set lacks are copied now."""
        rows = self._ahead.place(staged, experts)
        visit.staged = staged

        def whole():
            self._settle_pending()  # the layers before: evaluated already (this layer's input)
            started = time.perf_counter()
            try:
                tensors, copied = self._ahead.fill(staged, experts, slots)
            finally:
                if visit.shared is not None:
                    self._count_out(visit)  # copied: nothing reads the slots any more
            self._stats.count_copy(self._bucket, time.perf_counter() - started, copied, COPY, exposed=True)
            return tensors

        return visit_wave(visit, 0, whole, stack_rows=rows)

    def _count_out(self, visit: Visit) -> None:
        """End a shared-path visit's counts (once): nothing reads its slots any more."""
        slots, visit.shared = visit.shared, ()
        if slots and self.words is not None:
            self.words.release(slots)
