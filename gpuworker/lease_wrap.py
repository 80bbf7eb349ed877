"""Leased slots into MLX arrays, for `gpuworker.lease_client.LeaseClient` (a mixin of it).

The copy path (CPU, CUDA) writes each slot once into pooled stacked buffers (`StackBuffers`):
a whole wave, or a decode wave's parts one at a time while the part before computes; the zero-
copy path (Metal) wraps each slot's tensors as views. What each copy cost is counted in the
client's `LeaseCounters` (`_stats`, on its current `_bucket`).
"""

from __future__ import annotations

import time

import mlx.core as mx

from gpuworker.slots import slot_arrays
from gpuworker.stacking import stacked_slot_arrays
from shared.gpu_messages import Lease

__all__ = ["WaveWrapping"]


class WaveWrapping:
    """The lease client's slot-to-array copies (its attributes: buffer, slot_bytes, store,
    zero_copy, _stack_pool, _pending, _stats, _bucket)."""

    def _wrap_part(
        self,
        layer: int,
        expert_ids: tuple[int, ...],
        index: int,
        lease: Lease,
        *,
        lane: int,
        exposed: bool | None = None,
    ) -> dict[str, mx.array]:
        """Part `index` of a decode wave (for compute lane `lane`), stacked in the part's (rank) order
        into pool set `index`; `exposed`: whether no compute overlaps the copy (default: part 0's)."""
        slot_of = dict(zip(lease.experts, lease.slots))
        if index == 0:  # the previous visit's outputs may still read these sets
            self._settle_pending()
        assert self._stack_pool is not None
        started = time.perf_counter()
        tensors, wrap = stacked_slot_arrays(
            self.buffer,
            [slot_of[e] for e in expert_ids],
            self.slot_bytes,
            [self.store.layout(layer, e) for e in expert_ids],
            self._stack_pool,
            tag=index,
        )
        # Later parts copy while the part before computes: only part 0's copy is exposed.
        elapsed, exposed = time.perf_counter() - started, index == 0 if exposed is None else exposed
        self._stats.count_copy(self._bucket, elapsed, wrap.bytes_copied, wrap.path, exposed=exposed)
        self._stats.lane_parts[lane] += 1
        return tensors

    def _settle_pending(self) -> None:
        """Evaluate detached outputs that may still read the pool's buffers, before rewriting them
        (normally done already: the next layer's input needed them)."""
        if self._pending:
            mx.eval(*self._pending)
            self._pending.clear()

    def _wrap(self, layer: int, expert_ids: tuple[int, ...], lease: Lease):
        """The wave's tensors: stacked in ascending expert id (copy path: one copy, into the
        pool), or per expert in `expert_ids` order (zero copy: views of the slots)."""
        slot_of = dict(zip(lease.experts, lease.slots))
        self._settle_pending()
        started = time.perf_counter()
        if self._stack_pool is not None:
            ordered = sorted(expert_ids)
            tensors, wrap = stacked_slot_arrays(
                self.buffer,
                [slot_of[e] for e in ordered],
                self.slot_bytes,
                [self.store.layout(layer, e) for e in ordered],
                self._stack_pool,
            )
            copied = wrap.bytes_copied
        else:
            tensors, copied = [], 0
            for expert in expert_ids:
                arrays, wrap = slot_arrays(
                    self.buffer,
                    slot_of[expert],
                    self.slot_bytes,
                    self.store.layout(layer, expert),
                    zero_copy=self.zero_copy,
                )
                copied += wrap.bytes_copied
                tensors.append(arrays)
        self._stats.count_copy(self._bucket, time.perf_counter() - started, copied, wrap.path, exposed=True)
        return tensors
