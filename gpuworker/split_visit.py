"""Split decode visits, for `gpuworker.lease_client.LeaseClient` (a mixin of it): the resident
experts of a visit that misses compute while the missing ones load.

A decode visit with a miss takes the message path: its `routes` goes to the coordinator, which
reads the misses and only then answers with the lease. Most of the visit's experts are resident
already, yet without this the compute lanes idle through the whole round trip. So once `routes`
is sent, the experts the lease words name resident are counted in, the decode parts made of them
alone are copied into the pool, and the counts end (the shared lease's protocol: a copy is the
expert's bytes whatever its slot holds afterwards). The module computes those parts while the
reply travels; the first part with a miss waits for it and is copied from the lease.

The visit's experts go resident first, then missing (each in rank order), cut by `decode_parts`
so that the parts have the sizes, and the pool the sets, of any decode visit; `StreamedSwitch`
puts the outputs back in rank order. Nothing else changes: the coordinator sees the same
`routes`, leases, records and is fenced as for any message-path visit. A reply the module never
asked for (it gave up first) is taken by the fence or the release, so no reply is ever left
behind for the next request.
"""

from __future__ import annotations

import logging
import time

import mlx.core as mx

from gpuworker.channel import LeaseError
from gpuworker.expert_provider import LeasedWave
from gpuworker.lanes import decode_parts, part_lanes
from gpuworker.lease_stats import DECODE
from gpuworker.lease_visit import SplitPending, Visit, counted_lease, visit_wave
from shared.gpu_messages import Lease

__all__ = ["SplitLeasing", "resident_first"]

logger = logging.getLogger(__name__)


def resident_first(experts: tuple[int, ...], resident: dict[int, int], *, lanes: int) -> tuple[tuple, int]:
    """(parts, ready): `experts` resident first, then missing, in decode parts for `lanes` lanes,
    and how many leading parts hold resident experts only."""
    order = tuple(e for e in experts if e in resident) + tuple(e for e in experts if e not in resident)
    parts = decode_parts(order, lanes=lanes)
    ready = 0
    for part in parts:
        if not all(expert in resident for expert in part):
            break
        ready += 1
    return parts, ready


class SplitLeasing:
    """The lease client's split visits (its attributes: words, compute_lanes, _stats, _phase,
    _unsent, _unsent_last, and its `_in_parts`, `_send`, `_await_reply`, `_lease_of`, `_settle`,
    `_admit`, `_flush`, `_wrap`, `_wrap_part`)."""

    def _may_split(self, visit: Visit, routes, staged) -> bool:
        """Whether a message-path visit may split: one decode row, one wave, copied in parts."""
        return (
            self.words is not None
            and visit.stacked
            and staged is None
            and routes.shape[0] == 1
            and len(visit.waves) == 1
            and self._in_parts(visit.layer, visit.waves[0])
        )

    def _send_split(self, visit: Visit, message: object, piggyback: int | None) -> list[LeasedWave] | None:
        """Send `routes` (`message`) and copy the parts of resident experts; the visit's wave, or
        None when nothing is to split (all missing, or all resident after all): the caller then
        waits for the lease as on the message path."""
        layer, experts = visit.layer, visit.waves[0]
        self._send(message)
        resident: dict[int, int] = {}  # expert -> slot, counted in
        copied: list[dict[str, mx.array]] | None = None
        try:
            try:
                resident = self.words.lease_resident(layer, experts)
                parts, ready = resident_first(experts, resident, lanes=self.compute_lanes)
                lanes = part_lanes(len(parts), self.compute_lanes)
                if ready and len(resident) < len(experts):
                    counted = counted_lease(layer, tuple(resident), tuple(resident.values()))
                    # While the request travels: no compute waits for these copies.
                    copied = [
                        self._wrap_part(layer, parts[i], i, counted, lane=lanes[i], exposed=False) for i in range(ready)
                    ]
            finally:
                self.words.release(tuple(resident.values()))  # copied: nothing reads the slots any more
        except BaseException:
            self._abandon_request(visit, piggyback)
            raise
        if copied is None:  # all missing, or all resident after all
            return None
        visit.pending = SplitPending(piggyback)
        self._stats.split_visits += 1
        self._stats.split_early_experts += sum(len(parts[index]) for index in range(ready))

        def take_part(index: int) -> dict[str, mx.array]:
            if index < ready:
                return copied[index]
            lease = self._split_lease(visit)
            return self._wrap_part(layer, parts[index], index, lease, lane=lanes[index])

        def whole():  # a module that takes the wave whole: the copies above go unused
            return self._wrap(layer, experts, self._split_lease(visit))

        return [visit_wave(visit, 0, whole, parts=parts, part_lanes=lanes, take_part=take_part)]

    def _split_lease(self, visit: Visit) -> Lease:
        """The visit's lease: the reply its `routes` owes, taken (and checked) once."""
        pending = visit.pending
        if pending is None:
            lease = visit.leases[0]
            if lease is None:
                raise LeaseError(f"layer {visit.layer}: the split visit's lease was refused")
            return lease
        visit.pending = None
        what = f"routes of layer {visit.layer}"
        started = time.perf_counter()
        try:
            lease = self._lease_of(self._await_reply(what, started), what, pending.piggyback)
        except LeaseError:
            self._settle(pending.piggyback)
            raise
        if self._phase == DECODE:
            self._stats.visit_waits.append(time.perf_counter() - started)
        self._admit(visit, 0, lease, wrap=False)
        return lease

    def _take_owed_reply(self, visit: Visit | None) -> None:
        """Error and fence paths: take a split visit's reply the module never asked for, so that
        its lease is fenced and the next request reads its own reply."""
        if visit is None or visit.pending is None:
            return
        try:
            self._split_lease(visit)
        except LeaseError as error:  # nothing leased: nothing to fence
            logger.info("layer %d: split visit's lease: %s", visit.layer, error)

    def _abandon_request(self, visit: Visit, piggyback: int | None) -> None:
        """The copy failed after `routes` was sent: take the lease it gets and fence it unread."""
        visit.pending = SplitPending(piggyback)
        try:
            lease = self._split_lease(visit)
        except LeaseError as error:
            logger.info("layer %d: lease of a failed split visit: %s", visit.layer, error)
            return
        visit.leases[0] = None
        self._unsent, self._unsent_last = lease.lease_id, False
        self._flush()
