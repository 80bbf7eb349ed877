"""Fences at the forward pass's end, and on error and stop paths, for
`gpuworker.lease_client.LeaseClient` (a mixin of it).

Fences are deferred, never early (`gpuworker.lease_client`): what the module fenced is told to
the coordinator with the next request, or here, after the forward pass (`end_step`), so that
between tokens nothing is leased; `release` tells it every lease still held when a visit was
left unfinished.
"""

from __future__ import annotations

import time

from gpuworker.channel import LeaseError
from gpuworker.lease_stats import END_STEP
from shared.gpu_messages import Fence, Fenced

__all__ = ["FenceEnding"]


class FenceEnding:
    """The lease client's fence endings (its attributes: channel, reply_timeout_s, _visit,
    _visited_layers, _unsent, _acks, _stats, _bucket, _phase, and its `_send`, `_send_visited`,
    `_round_trip`, `_count_out`, `_take_owed_reply`)."""

    # -- forward-pass boundaries ------------------------------------------------------------------

    def end_step(self, *, wait: bool = True) -> None:
        """After a forward pass: fence what is held, so nothing is leased between tokens.

        `wait=False` (between the tokens of a job) sends the fence without waiting for its
        `fenced`: the coordinator applies it at once (it reads this socket in order, so the
        fence precedes the next `routes`), and the worker, which dropped every array reading
        the slots before sending it, goes on with the next token's dense layers. The reply is
        taken with the next one (`_round_trip`), or by a waiting `end_step`/`release`.
        """
        if self._visit is not None:
            visit = self._visit
            self.release()
            raise LeaseError(f"layer {visit.layer}: forward pass ended with waves not fenced")
        if self._visited_layers:  # with the step's end, unless a message-path fence must follow
            self._send_visited(end_step=self._unsent is None)
        if self._unsent is not None:
            self._bucket = self._stats.bucket(END_STEP, self._phase)
        if wait:
            self._flush()
            self._drain()
        elif self._unsent is not None:
            lease_id, self._unsent = self._unsent, None
            started = time.perf_counter()
            self._send(Fence(lease_id=lease_id, next=False))
            self._acks.add(lease_id)
            elapsed = time.perf_counter() - started
            self._stats.round_trips += 1
            self._stats.wait_s += elapsed
            self._bucket[1] += 1
            self._bucket[2] += elapsed

    def release(self) -> None:
        """Error and stop path: tell the coordinator every lease this client still holds."""
        visit, self._visit = self._visit, None
        self._take_owed_reply(visit)
        if visit is not None and visit.shared is not None:
            self._count_out(visit)
            visit = None
        if visit is not None:
            for index, lease in enumerate(visit.leases):
                if lease is not None and not visit.fenced[index]:
                    if self._unsent is not None:
                        self._flush()
                    visit.fenced[index] = True
                    self._unsent, self._unsent_last = lease.lease_id, False
        self._flush()
        self._drain()

    def _flush(self) -> None:
        if self._unsent is None:
            return
        lease_id, self._unsent = self._unsent, None
        reply = self._round_trip(Fence(lease_id=lease_id, next=False), f"fence of lease {lease_id}")
        if not (isinstance(reply, Fenced) and reply.lease_id == lease_id):
            raise LeaseError(f"fence of lease {lease_id}: expected fenced {lease_id}, got {reply!r}")

    def _drain(self) -> None:
        """Wait for the `fenced` of every fence sent without waiting (`end_step(wait=False)`)."""
        if not self._acks:
            return
        started = time.perf_counter()
        try:
            while self._acks:
                reply = self.channel.wait_reply(f"fence of lease {min(self._acks)}", timeout_s=self.reply_timeout_s)
                if not (isinstance(reply, Fenced) and reply.lease_id in self._acks):
                    waiting, self._acks = sorted(self._acks), set()
                    raise LeaseError(f"fences of leases {waiting}: expected fenced, got {reply!r}")
                self._acks.discard(reply.lease_id)
        finally:
            elapsed = time.perf_counter() - started
            self._stats.wait_s += elapsed
            self._stats.bucket(END_STEP, self._phase)[2] += elapsed
