"""The lease service: the GPU worker's `routes` / `fence` against the residency manager.

One layer visit: `routes` (every selection) → the unique experts split into
waves of at most the working bank → wave 0 leased; each `fence(next=True)`
releases the wave and leases the next; `fence(next=False)` (or the next
visit's piggybacked fence) ends the visit. Every request is validated before
the manager is touched, so a refused one (error reply naming the offending
value) leaves the state exactly as it was.

Transport-agnostic: `handle` takes a decoded message and returns the reply.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from coordinator.metered_backend import LoadTimer
from coordinator.residency import ExpertResidencyManager
from coordinator.residency_types import ExpertBatchLease
from shared.gpu_messages import Fence, Fenced, Lease, Prefetch, Routes, Visited
from shared.protocol import BAD_REQUEST, INTERNAL, ErrorReply
from shared.waves import ExpertUnionWave, build_expert_batch_union

logger = logging.getLogger(__name__)

LOAD_FAILED = "load_failed"  # an expert of the wave could not be loaded (the reply names it)


@dataclass(frozen=True, slots=True)
class LeaseServiceStats:
    """What the lease service saw between `begin_job` and `end_job`."""

    visits: int = 0
    all_resident_visits: int = 0  # visits whose every expert was already resident
    shared_visits: int = 0  # visits the worker leased itself through the lease words (no round trip)
    waves: int = 0
    abandoned_waves: int = 0  # waves of a visit the worker ended before leasing them
    hits: int = 0
    misses: int = 0
    decode_misses: int = 0  # of `misses`, those of one-row (decode) visits: what a prefetch could avoid
    loads: int = 0
    bytes_read: int = 0
    disk_p50_ms: float = 0.0
    disk_p99_ms: float = 0.0
    wait_p50_ms: float = 0.0
    wait_p99_ms: float = 0.0
    evictions: int = 0
    pressure_evictions: int = 0
    repin_swaps: int = 0
    refused: int = 0  # requests answered with an error

    @property
    def all_resident(self) -> float:
        return self.all_resident_visits / self.visits if self.visits else 0.0


@dataclass(slots=True)
class _Visit:
    layer: int
    waves: list[ExpertUnionWave]
    decode: bool  # one route row: a decode step's visit (prefill and batches are not predicted)
    missed: bool = False


@dataclass(slots=True)
class _Held:
    lease_id: int
    visit: _Visit
    wave: int
    lease: ExpertBatchLease


@dataclass(slots=True)
class _Counts:
    visits: int = 0
    all_resident_visits: int = 0
    shared_visits: int = 0
    waves: int = 0
    abandoned_waves: int = 0
    decode_misses: int = 0
    refused: int = 0
    baseline: tuple[int, int, int] = (0, 0, 0)  # evictions, pressure evictions, repin swaps


class LeaseRefused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def _refuse(message: str, code: str = BAD_REQUEST) -> LeaseRefused:
    return LeaseRefused(code, message)


class LeaseService:
    """Serves one GPU worker's lease protocol over an ExpertResidencyManager."""

    def __init__(
        self,
        *,
        manager: ExpertResidencyManager,
        experts_per_layer: int,
        working_slots: int | None = None,
        timer: LoadTimer | None = None,
    ) -> None:
        self._manager = manager
        self._timer = timer  # told each wave's phase, so that decode's load timings stand apart
        self._experts = int(experts_per_layer)
        self._working = int(working_slots if working_slots is not None else manager.plan.working_slots)
        self._sparse = frozenset(manager.sparse_layer_ids)
        self._held: _Held | None = None
        self._last_id = 0
        self._counts = _Counts()
        # Layers the current forward step has visited (a step ends with fence(next=False)): a
        # prediction for one of them is ignored, so a prefetch never evicts what this token used there.
        self._step: set[int] = set()
        self._predicted: dict[int, frozenset[int]] = {}  # layer -> the experts its last prediction named

    # ---------------------------------------------------------------- state

    @property
    def held(self) -> int | None:
        """The lease id the GPU worker holds (not yet fenced), if any."""
        return None if self._held is None else self._held.lease_id

    @property
    def held_slots(self) -> tuple[int, ...]:
        return () if self._held is None else tuple(entry.slot for entry in self._held.lease.entries)

    # -------------------------------------------------------------- requests

    async def handle(self, message: Routes | Fence | Visited) -> Lease | Fenced | ErrorReply | None:
        """The reply to one `routes`, `fence` or `visited` (None: a `visited` that owes none);
        never raises for bad input."""
        try:
            if isinstance(message, Routes):
                return await self._routes(message)
            if isinstance(message, Fence):
                return await self._fence(message)
            if isinstance(message, Visited):
                return await self.visited(message)
            raise _refuse(f"the lease service takes routes and fence, not {type(message).__name__}")
        except LeaseRefused as refusal:
            self._counts.refused += 1
            logger.warning("refused %s: %s", getattr(message, "OP", "?"), refusal.message)
            return ErrorReply(code=refusal.code, message=refusal.message)
        except Exception as error:  # a bug here: still answer, the worker is waiting for a reply
            self._counts.refused += 1
            logger.exception("%s failed", getattr(message, "OP", "?"))
            return ErrorReply(code=INTERNAL, message=f"{getattr(message, 'OP', '?')} failed: {error!r}")

    def _check_routes(self, layer: int, routes: np.ndarray) -> None:
        if layer not in self._sparse:
            raise _refuse(f"routes for layer {layer}: not a sparse layer; sparse layers are {sorted(self._sparse)}")
        if routes.size == 0:
            raise _refuse(f"routes for layer {layer} hold no selection")
        top, bottom = int(routes.max()), int(routes.min())
        if top >= self._experts or bottom < 0:
            top = top if top >= self._experts else bottom
            row, rank = (int(i) for i in np.argwhere(routes == top)[0])
            raise _refuse(
                f"routes for layer {layer}: row {row} rank {rank} names expert {top}; "
                f"the layer has experts 0..{self._experts - 1}"
            )

    def _check_fence(self, what: str, fence: int | None) -> _Held | None:
        """The held lease a message's piggybacked `fence` ends (None: none may be held)."""
        held = self._held
        if fence is not None:
            if held is None or held.lease_id != fence:
                raise _refuse(f"{what} piggyback fence of lease {fence}, but {self._describe_held()}")
        elif held is not None:
            raise _refuse(
                f"{what} while lease {held.lease_id} (layer {held.visit.layer} "
                f"wave {held.wave}) is still held; fence it first"
            )
        if held is None and self._manager.active:  # a wave active without a lease: an internal failure
            raise _refuse("the residency manager still has an active wave", INTERNAL)
        return held

    def _open_visit(self, layer: int, routes: np.ndarray, experts: list[int]) -> None:
        """What every visit tells the policy before its experts are leased: its selections (the
        ledger), the decode step it belongs to, the prefetches it makes moot, its prediction's score."""
        if not self._step:  # a forward step's first layer: auto's trial times decode steps
            if routes.shape[0] == 1:
                self._manager.prefetch_book.decode_step(time.perf_counter())
            else:
                self._manager.prefetch_book.not_decoding()
        self._manager.record_routes(layer, routes)  # every selection, before dedup
        # The layer is visited now: its prefetch reads for experts it does not route to can stop.
        self._manager.cancel_prefetch(layer, experts)
        self._counts.visits += 1
        self._step.add(layer)
        predicted = self._predicted.pop(layer, None)
        if predicted is not None and routes.shape[0] == 1:  # how good was the prediction (decode steps)
            routed = set(routes.reshape(-1).tolist())
            self._manager.prefetch_book.scored(len(routed & predicted), len(routed))

    async def visited(self, message: Visited) -> Fenced | None:
        """Decode visits the worker leased itself (the lease words): each is recorded as its
        `routes` and all-hit lease would have been, in order, after the fence it carries; their
        predictions are started as a `routes`' are. Checked whole before anything changes: a
        refused one raises `LeaseRefused` (the caller logs it: no reply is owed unless it fences)."""
        what = f"visited of layers {list(message.layers)[:8]}"
        routes = message.routes.array if message.routes is not None else np.zeros((0, 0), dtype=np.int32)
        counts = message.visit_rows or (1,) * len(message.layers)
        if len(counts) != len(message.layers) or min(counts, default=1) < 1:
            raise _refuse(
                f"{what}: visit_rows {list(counts)[:8]} do not give rows to each of {len(message.layers)} visits"
            )
        if routes.shape[0] != sum(counts):
            raise _refuse(f"{what}: {routes.shape[0]} route rows for visits of {sum(counts)}")
        ends = np.cumsum(counts).tolist()
        rows = [routes[end - count : end] for end, count in zip(ends, counts)]
        uniques = []
        for layer, visit_routes in zip(message.layers, rows):
            self._check_routes(layer, visit_routes)
            uniques.append(list(dict.fromkeys(visit_routes.reshape(-1).tolist())))  # first seen: a wave's order
            if len(uniques[-1]) > self._working:
                raise _refuse(f"{what}: layer {layer} names {len(uniques[-1])} experts; a wave holds {self._working}")
        for prediction in message.predictions:
            if not 0 <= prediction.visit < len(message.layers):
                raise _refuse(f"{what}: a prediction names visit {prediction.visit} of {len(message.layers)}")
            self._check_prediction(what, prediction.layer, message.layers[prediction.visit], prediction.experts)
        held = self._check_fence(what, message.fence)

        if held is not None:
            self._release(held, ended=True)
        predictions = {prediction.visit: prediction for prediction in message.predictions}
        for index, layer in enumerate(message.layers):
            row, experts = rows[index], uniques[index]
            self._open_visit(layer, row, experts)
            self._counts.all_resident_visits += 1
            self._counts.shared_visits += 1
            self._manager.record_hits(layer, experts)
            prediction = predictions.get(index)
            if prediction is not None and prediction.layer not in self._step:
                self._predicted[prediction.layer] = frozenset(prediction.experts)
                try:
                    self._manager.prefetch(prediction.layer, prediction.experts)
                except Exception:
                    logger.exception("prefetch for layer %d failed", prediction.layer)
        if message.end_step:
            self._step.clear()
        return None if message.fence is None else Fenced(lease_id=message.fence)

    async def _routes(self, message: Routes) -> Lease:
        layer, routes = message.layer, message.routes.array
        self._check_routes(layer, routes)
        self._check_prefetch(message)
        held = self._check_fence(f"routes for layer {layer}", message.fence)

        # Validated: from here on the request is served (or fails for a reason that is not its own).
        if held is not None:
            self._release(held, ended=True)
        visit = _Visit(layer, build_expert_batch_union(routes, self._working), decode=routes.shape[0] == 1)
        self._open_visit(layer, routes, [expert for wave in visit.waves for expert in wave.expert_ids])
        return await self._acquire(visit, 0)

    def prefetch(self, message: Routes | Prefetch) -> int:
        """Start the reads a prediction asks for; how many were issued. A `routes`' prediction runs
        after its lease was answered (the demand reads go first) and was checked with it; a
        `prefetch` message, which is never answered (the worker waits for no reply), is checked
        here and a bad one is logged and counted as refused. A failure to read is logged."""
        if isinstance(message, Prefetch):
            try:
                self._check_prediction(f"prefetch for layer {message.layer}", message.layer, None, message.experts)
            except LeaseRefused as refusal:
                self._counts.refused += 1
                logger.warning("ignored prefetch: %s", refusal.message)
                return 0
            layer, experts = message.layer, message.experts
        else:
            if message.prefetch_layer is None or not message.prefetch:
                return 0
            layer, experts = message.prefetch_layer, message.prefetch
        if layer in self._step:
            return 0
        self._predicted[layer] = frozenset(experts)
        try:
            return self._manager.prefetch(layer, experts)
        except Exception:
            logger.exception("prefetch for layer %d failed", layer)
            return 0

    def _check_prefetch(self, message: Routes) -> None:
        """A prediction riding on `routes` is checked with it: a bad one refuses the whole request."""
        if message.prefetch_layer is None:
            if message.prefetch:
                raise _refuse(
                    f"routes for layer {message.layer} predict experts {list(message.prefetch)[:8]} "
                    "but name no prefetch_layer"
                )
            return
        self._check_prediction(
            f"routes for layer {message.layer}", message.prefetch_layer, message.layer, message.prefetch
        )

    def _check_prediction(self, what: str, layer: int, visited: int | None, experts: tuple[int, ...]) -> None:
        if layer not in self._sparse or layer == visited:
            raise _refuse(f"{what}: prefetch layer {layer} is not another sparse layer")
        bad = [expert for expert in experts if expert >= self._experts]
        if bad or len(set(experts)) != len(experts):
            raise _refuse(f"{what}: prefetch {list(experts)} must name distinct experts 0..{self._experts - 1}")

    async def _fence(self, message: Fence) -> Lease | Fenced:
        held = self._held
        if held is None or held.lease_id != message.lease_id:
            raise _refuse(f"fence of lease {message.lease_id}, but {self._describe_held()}")
        last = len(held.visit.waves) - 1
        if message.next and held.wave >= last:
            raise _refuse(
                f"fence of lease {message.lease_id} asks for the next wave, but wave {held.wave} "
                f"is the last of {last + 1} of layer {held.visit.layer}"
            )
        self._release(held, ended=not message.next)
        if message.next:
            return await self._acquire(held.visit, held.wave + 1)
        self._step.clear()  # nothing is leased: the forward step is over
        return Fenced(lease_id=message.lease_id)

    # ------------------------------------------------------------- lifecycle

    def release_for_lost_worker(self, reason: str) -> int | None:
        # (the lease words' reader counts are reset by the caller: `LeasePublisher.reader_lost`)
        """The GPU worker process is gone: nothing reads its slots any more; release its lease."""
        held = self._held
        if held is None:
            return None
        logger.warning(
            "releasing lease %d (layer %d wave %d, slots %s) on behalf of the lost GPU worker: %s",
            held.lease_id,
            held.visit.layer,
            held.wave,
            list(self.held_slots),
            reason,
        )
        try:
            self._release(held, ended=True)
        except LeaseRefused as failure:
            logger.error("%s", failure.message)
        return held.lease_id

    def begin_job(self) -> None:
        """Start a job's statistics (the manager's demand telemetry is drained)."""
        self._manager.prefetch_book.not_decoding()  # the time since the last job's last step is no step
        self._step.clear()  # no step is in progress (one a lost GPU worker left unfenced is over)
        self._manager.drain_demand_telemetry()
        snap = self._manager.snapshot()
        self._counts = _Counts(baseline=(snap.evictions, snap.pressure_evictions, snap.repin_swaps))

    def end_job(self) -> LeaseServiceStats:
        """The statistics since `begin_job`."""
        self._manager.prefetch_book.not_decoding()
        telemetry = self._manager.drain_demand_telemetry()
        snap = self._manager.snapshot()
        counts = self._counts
        evictions, pressure, repins = counts.baseline
        stats = LeaseServiceStats(
            visits=counts.visits,
            all_resident_visits=counts.all_resident_visits,
            shared_visits=counts.shared_visits,
            waves=counts.waves,
            abandoned_waves=counts.abandoned_waves,
            hits=telemetry.hits,
            misses=telemetry.misses,
            decode_misses=counts.decode_misses,
            loads=telemetry.loads,
            bytes_read=telemetry.read_bytes,
            disk_p50_ms=telemetry.disk_service.p50_ms,
            disk_p99_ms=telemetry.disk_service.p99_ms,
            wait_p50_ms=telemetry.foreground_wait.p50_ms,
            wait_p99_ms=telemetry.foreground_wait.p99_ms,
            evictions=snap.evictions - evictions,
            pressure_evictions=snap.pressure_evictions - pressure,
            repin_swaps=snap.repin_swaps - repins,
            refused=counts.refused,
        )
        self._counts = _Counts(baseline=(snap.evictions, snap.pressure_evictions, snap.repin_swaps))
        return stats

    # ------------------------------------------------------------- internals

    def _describe_held(self) -> str:
        if self._held is None:
            return "no lease is held" + (f" (the last one issued was {self._last_id})" if self._last_id else "")
        return f"the held lease is {self._held.lease_id}"

    async def _acquire(self, visit: _Visit, wave: int) -> Lease:
        ids = visit.waves[wave].expert_ids
        if self._timer is not None:
            self._timer.decode = visit.decode
        try:
            lease = await self._manager.acquire_block(visit.layer, ids)
        except Exception as error:  # the manager has undone the acquire; the visit is over
            self._finish_visit(visit, wave)
            logger.error("layer %d wave %d (experts %s) failed: %s", visit.layer, wave, list(ids), error)
            raise LeaseRefused(LOAD_FAILED, f"layer {visit.layer} wave {wave} experts {list(ids)}: {error}") from None
        self._last_id += 1
        self._held = _Held(self._last_id, visit, wave, lease)
        self._counts.waves += 1
        hits = sum(entry.hit for entry in lease.entries)
        if hits != len(lease.entries):
            visit.missed = True
            if visit.decode:
                self._counts.decode_misses += len(lease.entries) - hits
        entries = lease.entries
        return Lease(
            lease_id=self._last_id,
            layer=visit.layer,
            wave=wave,
            waves=len(visit.waves),
            experts=tuple(e.expert_id for e in entries),
            slots=tuple(e.slot for e in entries),
            generations=tuple(e.generation for e in entries),
            hits=hits,
        )

    def _release(self, held: _Held, *, ended: bool) -> None:
        self._held = None
        try:
            held.lease.release_fenced()
        except Exception as error:  # stale or refused by the backend: a bug, never the worker's input
            logger.exception("fenced release of lease %d failed", held.lease_id)
            self._finish_visit(held.visit, len(held.visit.waves))
            raise LeaseRefused(INTERNAL, f"fenced release of lease {held.lease_id} failed: {error}") from None
        if ended:
            self._finish_visit(held.visit, held.wave + 1)

    def _finish_visit(self, visit: _Visit, served: int) -> None:
        """`served` waves of the visit were leased (and released); count the visit once."""
        abandoned = len(visit.waves) - served
        if abandoned > 0:
            self._counts.abandoned_waves += abandoned
            logger.info("layer %d visit ended with %d of %d waves not leased", visit.layer, abandoned, len(visit.waves))
        elif not visit.missed:
            self._counts.all_resident_visits += 1


__all__ = ["LOAD_FAILED", "LeaseRefused", "LeaseService", "LeaseServiceStats"]
