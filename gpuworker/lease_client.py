"""The lease protocol on the GPU worker's DEALER socket: an `ExpertProvider` over ZMQ.

The model's forward pass is synchronous, so is this client: `acquire` sends
`Routes` and blocks for the `Lease` of wave 0; each later wave is leased
lazily, when the module takes it, by `Fence(previous, next=True)`. Every
wave is predicted up front (`shared.waves.wave_partition`, the coordinator's
own rule) and each lease checked against it (`gpuworker.lease_visit`).

Fences are deferred, never early: a wave fenced by the module is only marked
done; the coordinator hears of it when the next wave is wanted (`next=True`),
with the next layer's `Routes` (the visit's last wave, piggybacked), or at
`end_step` after the forward pass (`next=False` -> `Fenced`), so that between
tokens nothing is leased (the coordinator's safe point).

On the copy path (CPU, CUDA) a decode wave is handed to the module in parts
(`gpuworker.lanes.decode_parts`: 1, 2, 4, ... experts in rank order, per
compute lane), each copied from its slots only when the module takes it,
while the part before computes: of the wave's copy only part 0's stays on
the critical path (`exposed_copy_ms`). With `compute_lanes` > 1 the parts
take turns over that many MLX streams. Every part is copied before the
wave's fence, like a whole wave.

The shared path (`words`): a decode visit whose experts are all resident
leases them without a message (`gpuworker.shared_lease`); one that misses
computes its resident experts while its `routes` travels
(`gpuworker.split_visit`); the slots become arrays in `gpuworker.lease_wrap`;
the fences at a forward pass's end are `gpuworker.lease_fencing`'s.

Waiting for replies (and for cancels, jobs and garbage arriving meanwhile)
is `gpuworker.channel.Channel`'s; what the leases cost is counted in
`gpuworker.lease_stats`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from gpuworker.channel import Channel, LeaseError, WorkerStopping
from gpuworker.copy_ahead import UNSORTED_ROUTES, CopyAhead
from gpuworker.expert_provider import ExpertProviderError, LeasedWave
from gpuworker.lanes import decode_parts, part_lanes
from gpuworker.lease_fencing import FenceEnding
from gpuworker.lease_stats import DECODE, END_STEP, PREFILL, LeaseClientStats, LeaseCounters
from gpuworker.lease_visit import Visit, check_lease, visit_wave
from gpuworker.lease_wrap import WaveWrapping
from gpuworker.shared_lease import SharedLeasing
from gpuworker.slots import COPY, ZERO_COPY, zero_copy_supported
from gpuworker.split_visit import SplitLeasing
from gpuworker.stacking import StackBuffers
from shared.config import check_compute_lanes
from shared.gpu_messages import Fence, Fenced, Lease, Prediction, Prefetch, RouteMatrix, Routes
from shared.lease_words import LeaseWords
from shared.waves import wave_partition

__all__ = ["LeaseClient"]

logger = logging.getLogger(__name__)


class LeaseClient(SharedLeasing, SplitLeasing, FenceEnding, WaveWrapping):
    """`ExpertProvider` on the coordinator's lease protocol (see the module docstring)."""

    def __init__(
        self,
        channel: Channel,
        *,
        store,
        buffer,
        total_slots: int,
        slot_bytes: int,
        working_slots: int,
        reply_timeout_s: float = 60.0,
        zero_copy: bool | None = None,
        compute_lanes: int = 1,
        words: LeaseWords | None = None,
        parts_min_bytes: int = 0,
        batch_rows: int = 1,
        copy_ahead: bool = False,
    ) -> None:
        if working_slots < 1:
            raise ValueError(f"working_slots must be >= 1, got {working_slots}")
        self.compute_lanes = check_compute_lanes(compute_lanes)  # decode parts run on this many MLX streams (copy path)
        self.channel = channel
        self.store = store
        self.buffer = buffer
        self.total_slots = int(total_slots)
        self.slot_bytes = int(slot_bytes)
        self.working_slots = int(working_slots)
        self.reply_timeout_s = reply_timeout_s
        self.zero_copy = zero_copy
        self._visit: Visit | None = None
        self.words = words
        # A decode wave smaller than this is copied and computed whole: each part costs an
        # evaluation's dispatch, which outweighs a small copy it would hide (gpuworker.lanes).
        self.parts_min_bytes = int(parts_min_bytes)
        self.batch_rows = max(1, int(batch_rows))  # a decode step's route rows (sequences decoded together)
        self._sent = 0  # messages sent that may change residency (the coordinator counts them too)
        self._visited_layers: list[int] = []  # shared-path visits not yet told (`visited`)
        self._visited_rows: list[np.ndarray] = []
        self._visited_predictions: list[Prediction] = []
        self._visited_fence: int | None = None  # a message-path lease fenced before the first of them
        self._unsent: int | None = None  # a lease fenced here, not yet told to the coordinator
        self._unsent_last = False  # ... and it was its visit's last wave (may ride on Routes)
        wraps = zero_copy if zero_copy is not None else zero_copy_supported()
        self.wrap_path = ZERO_COPY if wraps else COPY  # what a job that leased nothing reports
        # The copy path writes each leased slot once, straight into stacked arrays of this pool.
        # Decode waves (top-k experts) reuse one pooled set; larger (prefill) waves get fresh buffers.
        top_k = getattr(store, "top_k", None) or 8
        # Sets alive at once: a decode wave's parts and a whole wave (one more for slack), and a
        # batched decode wave of up to `batch_rows` rows' experts.
        sets = len(decode_parts(range(top_k), lanes=compute_lanes)) + 2
        self._stack_pool = (
            StackBuffers(max_pooled=top_k, max_sets=sets + 1, max_rows=top_k * batch_rows)
            if self.wrap_path == COPY
            else None
        )
        self._pending: list[mx.array] = []  # outputs of detached waves that may still read the pool
        self._expert_bytes: dict[int, int] = {}  # layer -> one expert's tensor bytes
        # Copy ahead (gpuworker.copy_ahead): copy path, lease words, routes mlx-lm leaves unsorted, and
        # whole decode waves (parts copy while computing already: ranking ahead would be for nothing).
        self._ahead = (
            CopyAhead(buffer=buffer, slot_bytes=slot_bytes, store=store, words=words, top_k=top_k)
            if copy_ahead
            and words is not None
            and self.wrap_path == COPY
            and top_k < UNSORTED_ROUTES
            and not self._in_parts(store.sparse_layers[0], range(top_k))
            else None
        )
        self.copies_ahead = self._ahead is not None  # whether `stage` can copy predicted experts ahead
        self._acks: set[int] = set()  # fences sent by end_step(wait=False), `fenced` not read yet
        self._stats = LeaseCounters(wrap_path=self.wrap_path, lane_parts=[0] * self.compute_lanes)
        self._phase = DECODE
        self._bucket: list = self._stats.bucket(END_STEP, DECODE)  # where the next round trip is counted

    # -- telemetry --------------------------------------------------------------------------------

    def stats(self) -> LeaseClientStats:
        return self._stats.snapshot(compute_lanes=self.compute_lanes, ahead=self._ahead)

    def reset_stats(self) -> None:
        self._stats = LeaseCounters(wrap_path=self.wrap_path, lane_parts=[0] * self.compute_lanes)
        self._bucket = self._stats.bucket(END_STEP, DECODE)
        if self._ahead is not None:
            self._ahead.reset_counters()

    @property
    def holding(self) -> bool:
        """Whether the coordinator may still consider a lease of this worker active."""
        return (
            self._unsent is not None
            or self._visited_fence is not None
            or bool(self._acks)
            or (
                self._visit is not None
                and (self._visit.pending is not None or any(lease is not None for lease in self._visit.leases))
            )
        )

    # -- ExpertProvider ---------------------------------------------------------------------------

    def acquire(
        self, layer: int, routes: np.ndarray, *, prefetch: tuple[int, tuple[int, ...]] | None = None
    ) -> Sequence[LeasedWave]:
        if self.channel.stop_requested():
            raise WorkerStopping("stop requested")
        if self._visit is not None or (self._unsent is not None and not self._unsent_last):
            # A visit the module left unfinished (it always fences every wave): end it first.
            self.release()
        staged = self._ahead.take(layer) if self._ahead is not None else None  # any other visit drops it
        if self.words is not None and routes.shape[0] <= self.batch_rows:  # a decode step's rows
            shared = self._acquire_shared(layer, routes, prefetch, staged)
            if shared is not None:
                return shared
        waves = wave_partition(routes, self.working_slots)
        piggyback, self._unsent = self._unsent, None
        visit = Visit(layer, waves, [None] * len(waves), [False] * len(waves), stacked=self._stack_pool is not None)
        self._visit = visit
        # A decode step has a row per sequence (a prompt this short counts as decode too).
        self._phase = DECODE if routes.shape[0] <= self.batch_rows else PREFILL
        self._bucket = self._stats.bucket(layer, self._phase)
        self._bucket[0] += 1
        started = time.perf_counter()
        try:
            try:
                message = (
                    Routes(layer=layer, routes=RouteMatrix(routes), fence=piggyback)
                    if prefetch is None
                    else Routes(
                        layer=layer,
                        routes=RouteMatrix(routes),
                        fence=piggyback,
                        prefetch_layer=prefetch[0],
                        prefetch=prefetch[1],
                    )
                )
                what = f"routes of layer {layer}"
                if self._may_split(visit, routes, staged):  # resident experts compute while it travels
                    split = self._send_split(visit, message, piggyback)
                    if split is not None:
                        return split
                    lease = self._lease_of(self._await_reply(what, started), what, piggyback)
                else:
                    lease = self._request(message, what, piggyback=piggyback)
            except LeaseError:
                self._settle(piggyback)
                raise
            if self._phase == DECODE:
                self._stats.visit_waits.append(time.perf_counter() - started)
            parts = (
                decode_parts(waves[0], lanes=self.compute_lanes)
                if visit.stacked and routes.shape[0] == 1 and len(waves) == 1 and self._in_parts(layer, waves[0])
                else ()
            )
            # Parts are copied when the module takes them, each while the one before computes.
            ahead = staged is not None and visit.stacked and routes.shape[0] == 1 and len(waves) == 1 and not parts
            first = self._admit(visit, 0, lease, wrap=not (parts or ahead))
        except BaseException:
            self._visit = None
            raise
        if ahead:  # the set copied ahead serves this wave too: its bytes are the experts' own
            slot_of = dict(zip(lease.experts, lease.slots))
            return [self._staged_wave(visit, staged, waves[0], tuple(slot_of[e] for e in waves[0]))]
        if parts:
            whole = lambda: self._wrap(layer, waves[0], lease)  # noqa: E731  (a module that takes it whole)
            lanes = part_lanes(len(parts), self.compute_lanes)
            return [
                visit_wave(
                    visit,
                    0,
                    whole,
                    parts=parts,
                    part_lanes=lanes,
                    take_part=lambda index: self._wrap_part(layer, parts[index], index, lease, lane=lanes[index]),
                )
            ]
        result = [visit_wave(visit, 0, first)]
        for index in range(1, len(waves)):
            result.append(visit_wave(visit, index, lambda index=index: self._load_next(visit, index)))
        return result

    def copy_ahead_due(self) -> bool:  # a decode visit stages (`CopyAhead.due`: stopped, tried now and then)
        return self._ahead is not None and self._ahead.due()

    def stage(self, layer: int, experts: tuple[int, ...]) -> None:
        """Copy the resident ones of `experts`, predicted for sparse layer `layer`, while the layer
        before computes (`gpuworker.copy_ahead`); a visit's parts copy while they compute already."""
        if self._ahead is None or self._in_parts(layer, experts[: self._ahead.top_k]):
            return
        copied, elapsed = self._ahead.stage(layer, experts)
        if copied:  # while the layer before computes: not exposed
            self._stats.count_copy(self._stats.bucket(layer, DECODE), elapsed, copied, COPY, exposed=False)

    def prefetch(self, layer: int, experts: tuple[int, ...]) -> None:
        """Send a prediction no `routes` can carry (the first sparse layer's); no reply is owed."""
        self._send(Prefetch(layer=layer, experts=experts))

    def fence(self, wave: LeasedWave) -> None:
        visit, index = getattr(wave, "visit", None), getattr(wave, "index", None)
        if visit is None or index is None:
            raise ExpertProviderError(f"fence of {wave!r}, which this client did not lease")
        if visit.fenced[index]:
            logger.warning("layer %d wave %d fenced twice", visit.layer, index)
            return
        visit.fenced[index] = True
        self._take_owed_reply(visit)  # a split visit the module gave up on before its lease came
        # A detached wave's outputs may still be computing from pooled buffers: the next copy
        # into the pool (or into the set copied ahead) waits for them (`_wrap`, `CopyAhead.stage`).
        self._pending.extend(getattr(wave, "outputs", ()))
        if visit.staged is not None and self._ahead is not None:
            self._ahead.read_by(visit.staged, getattr(wave, "outputs", ()))
        if visit.shared is not None:  # the shared path: count out (if the copy has not already)
            self._count_out(visit)
            if self._visit is visit:
                self._visit = None
            return
        lease = visit.leases[index]
        if lease is None:
            # Never leased (the module gave up before reaching it): end the visit here.
            self._flush()
            if self._visit is visit:
                self._visit = None
            return
        last = index == len(visit.waves) - 1
        # The module has evaluated and dropped everything reading the wave; telling the
        # coordinator can wait (deferring a fence is always safe, sending one early never is).
        self._unsent, self._unsent_last = lease.lease_id, last
        if last and self._visit is visit:
            self._visit = None

    # -- internals --------------------------------------------------------------------------------

    def _send(self, message: object) -> None:
        """Every message to the coordinator goes here: shared-path visits not yet told go first,
        and the ones that may change residency are counted (`_sent`)."""
        if self._visited_layers:
            self._send_visited(end_step=False)
        self.channel.send(message)
        if isinstance(message, (Routes, Fence, Prefetch)):
            self._sent += 1

    def _in_parts(self, layer: int, experts: Sequence[int]) -> bool:
        """Whether a decode wave of `experts` is handed over in parts (copy path)."""
        if not self.parts_min_bytes:
            return True
        one = self._expert_bytes.get(layer)
        if one is None:
            one = self._expert_bytes[layer] = sum(t.nbytes for t in self.store.layout(layer, experts[0]))
        return len(experts) * one >= self.parts_min_bytes

    def _round_trip(self, message: object, what: str) -> object:
        started = time.perf_counter()
        self._send(message)
        return self._await_reply(what, started)

    def _await_reply(self, what: str, started: float) -> object:
        """The reply to the request sent last (counted as a round trip waited since `started`)."""
        try:
            reply = self.channel.wait_reply(what, timeout_s=self.reply_timeout_s)
            # The `fenced` of fences sent without waiting come first (the coordinator answers in order).
            while self._acks and isinstance(reply, Fenced) and reply.lease_id in self._acks:
                self._acks.discard(reply.lease_id)
                reply = self.channel.wait_reply(what, timeout_s=self.reply_timeout_s)
            return reply
        finally:
            elapsed = time.perf_counter() - started
            self._stats.round_trips += 1
            self._stats.wait_s += elapsed
            self._bucket[1] += 1
            self._bucket[2] += elapsed

    def _request(self, message: object, what: str, *, piggyback: int | None = None) -> Lease:
        return self._lease_of(self._round_trip(message, what), what, piggyback)

    def _lease_of(self, reply: object, what: str, piggyback: int | None) -> Lease:
        # A `fenced` for the fence that rode on Routes is tolerated, not required.
        while isinstance(reply, Fenced) and piggyback is not None and reply.lease_id == piggyback:
            piggyback = None
            reply = self.channel.wait_reply(what, timeout_s=self.reply_timeout_s)
        if not isinstance(reply, Lease):
            raise LeaseError(f"{what}: expected a lease, got {reply!r}")
        self._stats.leases += 1
        self._bucket[4] += len(reply.experts)
        self._bucket[5] += reply.hits
        return reply

    def _load_next(self, visit: Visit, index: int) -> list[dict[str, mx.array]]:
        """Wave `index`'s tensors: only now, after wave index-1's fence, may its slots be filled."""
        previous = visit.leases[index - 1]
        if previous is None or not visit.fenced[index - 1] or self._unsent != previous.lease_id:
            raise ExpertProviderError(f"layer {visit.layer}: wave {index} taken before wave {index - 1} was fenced")
        if self.channel.stop_requested():
            raise WorkerStopping("stop requested")  # the module's error path fences wave index-1
        self._unsent = None
        try:
            lease = self._request(
                Fence(lease_id=previous.lease_id, next=True),
                f"fence of lease {previous.lease_id} (next wave of layer {visit.layer})",
            )
        except LeaseError:
            self._settle(previous.lease_id)
            raise
        return self._admit(visit, index, lease)

    def _settle(self, lease_id: int | None) -> None:
        """A refused request carried the fence of `lease_id`: whether the coordinator applied it
        is unknown, so fence it alone; "nothing held" is an answer too."""
        if lease_id is None:
            return
        try:
            self._round_trip(Fence(lease_id=lease_id, next=False), f"fence of lease {lease_id} (settling)")
        except LeaseError as error:
            logger.info("settling lease %d: %s", lease_id, error)

    def _admit(self, visit: Visit, index: int, lease: Lease, *, wrap: bool = True):
        """Check `lease` is wave `index` of `visit`, and wrap its slots (unless `wrap` is False:
        the module takes them later); on failure fence it unread."""
        try:
            check_lease(visit, index, lease, total_slots=self.total_slots, working_slots=self.working_slots)
            visit.leases[index] = lease
            return self._wrap(visit.layer, visit.waves[index], lease) if wrap else None
        except BaseException:
            # Nothing read the slots (or the copies are garbage now): give them back at once.
            # The module's error path then fences the wave as never leased (a no-op).
            visit.leases[index] = None
            self._unsent, self._unsent_last = lease.lease_id, False
            try:
                self._flush()
            except Exception:
                logger.exception("fence of refused lease %d failed", lease.lease_id)
            raise
