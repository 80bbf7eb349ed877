"""IOWorkerBackend: the ExpertResidencyBackend over N I/O worker processes.

The workers' side (their ROUTER, sessions, liveness, hint queues) is
`coordinator.io_sessions`; this module is the slot side. Loads go to the
worker with the fewest in flight. The backend keeps its own per-slot phase (idle/loading/ready/leased/
failed) and refuses anything that could write a leased slot: a submit into a
loading or leased slot, a discard of a leased (or still loading) one. Every
load carries a generation that must grow per slot, so a stale or late
completion is recognised, counted and ignored, never applied.

A worker that dies (noticed by the sessions' pid watchdog or by
`worker_lost()`) hands back the loads it owed; they are re-submitted at once, same
slot and generation, to a live worker, so the residency manager never sees the
loss. With no live worker left they wait (`replacement_grace_s`; 0: fail at
once) for a restarted worker, whose hello for the same index is accepted once
the old one is known dead.

`coordinator.io_pool.IOWorkerPool` spawns workers and connects a backend for
tests and the bench; in a real system the supervisor spawns and restarts them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq.asyncio

from coordinator.io_results import (
    BackendStateError,
    BackendTelemetry,
    ExpertLoadError,
    LoadCompletion,
    StaleGenerationError,
)
from coordinator.io_sessions import IOWorkerSessions, SessionEvents, WorkerSession, running
from coordinator.liveness import ProgressDeadline
from coordinator.residency_backend import Consumer, ExpertIOHintSnapshot
from shared.checks import require_int
from shared.io_messages import Cancel, Load, Loaded, WorkerTelemetry
from shared.segments import ExpertIOHintSegment, ExpertIOSegment, check_segments
from shared.slab import Slab

if TYPE_CHECKING:
    from shared.children import ChildProcess

logger = logging.getLogger(__name__)

LOST = "worker_lost"  # ExpertLoadError.code of a load no worker could take over


@dataclass(slots=True)
class _Load:
    generation: int
    worker: int
    segments: tuple[ExpertIOSegment, ...]
    future: asyncio.Future[None]
    submitted: float
    parked_until: float | None = None  # waiting for any live worker (worker is then -1)
    orphaned: bool = False  # its worker was lost after it was sent
    avoid: set[int] = field(default_factory=set)  # live workers a send of it could not reach
    completion: LoadCompletion | None = None
    error: ExpertLoadError | None = None


@dataclass(slots=True)
class _Slot:
    phase: str = "idle"  # idle | loading | ready | leased | failed
    generation: int = 0  # the last generation submitted (0: never)
    load: _Load | None = None
    consumer: Consumer | None = None


class IOWorkerBackend:
    """Slots of a slab, filled by I/O workers connected to `endpoint`.

    Construct and use it inside a running asyncio loop; `await start()` waits
    for `workers` workers to become ready. Only `wait` is asynchronous.
    """

    def __init__(
        self,
        *,
        slab: Slab,
        endpoint: str,
        workers: int,
        files: int | None = None,
        hint_capacity: int = 64,
        context: zmq.asyncio.Context | None = None,
        replacement_grace_s: float = 0.0,
        deadline: ProgressDeadline | None = None,
    ) -> None:
        if not replacement_grace_s >= 0:  # NaN too
            raise ValueError(f"replacement_grace_s must be >= 0, got {replacement_grace_s!r}")
        self._slab = slab
        self._grace = float(replacement_grace_s)
        self._files = files
        self._checked: dict[int, tuple[object, tuple]] = {}  # id -> (segments, checked); locations repeat
        events = SessionEvents(
            loaded=self._loaded,
            ready=self._worker_ready,
            lost=self._orphaned,
            tick=self._expire,
            undelivered=self._undelivered,
        )
        self._sessions = IOWorkerSessions(
            context=context or zmq.asyncio.Context.instance(),
            endpoint=endpoint,
            workers=require_int(workers, "workers", minimum=1),
            hint_capacity=require_int(hint_capacity, "hint_capacity", minimum=1),
            events=events,
            deadline=deadline,
        )
        self.endpoint: str = self._sessions.endpoint
        self._records = [_Slot() for _ in range(slab.total_slots)]
        self._parked: dict[int, _Load] = {}  # slot -> a load that waits for a live worker
        # The slot side's counters; the sessions keep bad_replies, worker_errors and workers_lost.
        self._counts = dict(
            submitted=0, completed=0, failed=0, cancels_sent=0, stale_completions=0, bytes=0, resubmitted=0
        )
        self._closed = False

    # ------------------------------------------------------------ lifecycle

    async def start(self, *, timeout: float = 30.0, processes: Sequence[ChildProcess] = ()) -> None:
        """Wait until every worker is ready; raise IOWorkerStartError naming the
        failure (a worker's setup error, a child's exit code and stderr, a timeout)."""
        await self._sessions.start(timeout=timeout, processes=processes)

    def shutdown_workers(self) -> None:
        """Ask every connected worker to exit (non-blocking); their exits are no longer losses."""
        self._sessions.shutdown_workers()

    async def aclose(self) -> None:
        """Stop receiving, fail pending waits, close the socket (idempotent).

        Call it once the workers have exited: a load still in flight in a live
        worker would keep writing its slot after its wait has failed."""
        if self._closed:
            return
        self._closed = True
        await self._sessions.aclose()
        self._parked.clear()
        for slot, record in enumerate(self._records):
            if record.phase == "loading" and record.load is not None:
                self._fail(slot, record.load, "the I/O backend was closed", code="closed")

    # ----------------------------------------------------- residency calls

    @property
    def slots(self) -> int:
        return len(self._records)

    def phase(self, slot: int) -> str:
        return self._record(slot).phase

    def completion(self, slot: int) -> LoadCompletion | None:
        """Timing of the slot's last successful load, if it still holds it."""
        load = self._record(slot).load
        return None if load is None else load.completion

    def submit_segments(self, slot: int, generation: int, segments: Sequence[ExpertIOSegment]) -> None:
        """Send a load to the least busy worker; refuses a loading or leased slot."""
        record = self._record(slot)
        generation = require_int(generation, "generation", minimum=1)
        if record.phase in ("loading", "leased"):
            raise BackendStateError(
                f"submit of generation {generation} into slot {slot} refused: it is {record.phase} "
                f"(generation {record.generation})"
            )
        if generation <= record.generation:
            raise StaleGenerationError(
                f"submit into slot {slot} refused: generation {generation} is not newer than {record.generation}"
            )
        checked = self._check_once(segments)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        load = _Load(generation, -1, checked, future, time.monotonic())
        self._place(slot, load)  # BackendStateError (nothing changed) when no worker can take it
        record.phase, record.generation, record.consumer = "loading", generation, None
        record.load = load
        self._counts["submitted"] += 1

    def _check_once(self, segments: Sequence[ExpertIOSegment]) -> tuple:
        """`check_segments` once per tuple of frozen segments (kept alive here: its id stays its own)."""
        known = self._checked.get(id(segments))
        if known is not None and known[0] is segments:
            return known[1]
        checked = check_segments(segments, slot_bytes=self._slab.slot_bytes, manifest=self._files)
        if isinstance(segments, tuple):
            if len(self._checked) >= 1 << 16:  # a caller that builds new tuples each time: stay bounded
                self._checked.clear()
            self._checked[id(segments)] = (segments, checked)
        return checked

    async def wait(self, slot: int, generation: int) -> None:
        """Resolve when the load finished; raise ExpertLoadError if it failed."""
        record = self._record(slot)
        load = record.load
        if load is None or load.generation != generation:
            raise StaleGenerationError(
                f"wait for slot {slot} generation {generation}: the slot holds generation "
                f"{record.generation} ({record.phase})"
            )
        if not load.future.done():
            await asyncio.shield(load.future)  # one waiter's cancellation must not cancel the load
        if load.error is not None:
            raise load.error

    def cancel(self, slot: int, generation: int) -> None:
        """Drop the load if it has not started; `wait` still resolves (with 'cancelled')."""
        record = self._record(slot)
        if record.generation != generation:
            raise StaleGenerationError(f"cancel of slot {slot} generation {generation}: it holds {record.generation}")
        if record.phase != "loading" or record.load is None:
            return
        if self._parked.get(slot) is record.load:  # never sent: nothing to tell a worker
            del self._parked[slot]
            self._fail(slot, record.load, "cancelled", code="cancelled")
            return
        worker = self._sessions.workers.get(record.load.worker)
        if worker is not None and not worker.lost:
            self._sessions.send(worker, Cancel(slot=slot, generation=generation), required=False)
            self._counts["cancels_sent"] += 1

    def lease(self, slot: int, generation: int, consumer: Consumer = "gpu") -> None:
        record = self._expect(slot, generation, "ready", "lease")
        record.phase, record.consumer = "leased", consumer

    def release_gpu_fenced(self, slot: int, generation: int) -> None:
        record = self._expect(slot, generation, "leased", "release")
        record.phase, record.consumer = "ready", None

    def discard(self, slot: int, generation: int) -> None:
        """Forget a slot's contents; refuses a leased slot and one still being written."""
        record = self._record(slot)
        if record.generation != generation:
            raise StaleGenerationError(f"discard of slot {slot} generation {generation}: it holds {record.generation}")
        if record.phase == "leased":
            raise BackendStateError(f"discard of slot {slot} generation {generation} refused: it is leased")
        if record.phase == "loading":
            raise BackendStateError(
                f"discard of slot {slot} generation {generation} refused: its load is in flight (cancel and wait first)"
            )
        record.phase, record.load, record.consumer = "idle", None, None

    def physical_footprint(self) -> int:
        return self._slab.resident_bytes()

    def send_submitted(self) -> None:
        """Send the loads queued for this turn now (a demand wave about to wait for them)."""
        self._sessions.flush()

    def hint_segments(self, segments: Sequence[ExpertIOHintSegment]) -> bool:
        """Queue advisory readahead; False when every worker's hint queue is full."""
        if not segments:
            return True
        return self._sessions.hint(check_segments(segments, slot_bytes=None, manifest=self._files))

    def hint_telemetry(self) -> ExpertIOHintSnapshot:
        """Cumulative hint counters: messages this backend sent; drops, its refusals and the workers'."""
        return self._sessions.hint_telemetry()

    # ------------------------------------------------------------ telemetry

    def telemetry(self) -> BackendTelemetry:
        in_flight = self._sessions.in_flight() + len(self._parked)
        return BackendTelemetry(**self._counts, **self._sessions.counts, in_flight=in_flight)

    def worker_modes(self) -> dict[int, tuple[str, ...]]:
        """I/O mode per manifest file, as each ready (and not lost) worker reported it."""
        return self._sessions.worker_modes()

    def worker_pids(self) -> dict[int, int]:
        """The hello pid of each ready worker that is not lost, by index."""
        return self._sessions.worker_pids()

    async def request_telemetry(self, *, timeout: float = 5.0) -> tuple[WorkerTelemetry, ...]:
        """Ask every ready worker for its counters (one that cannot be reached is left out)."""
        return await self._sessions.request_telemetry(timeout=timeout)

    def worker_lost(self, index: int, reason: str) -> None:
        """A worker process is gone: its in-flight loads go to a live worker at once (nothing writes
        them any more; its late completions are stale), or wait for a restarted one, or fail."""
        self._sessions.worker_lost(index, reason)

    # ------------------------------------------------------------- internals

    def _record(self, slot: int) -> _Slot:
        index = require_int(slot, "slot")
        if index >= len(self._records):
            raise ValueError(f"slot {index} is outside the slab's {len(self._records)} slots")
        return self._records[index]

    def _expect(self, slot: int, generation: int, phase: str, action: str) -> _Slot:
        record = self._record(slot)
        if record.generation != generation:
            raise StaleGenerationError(f"{action} of slot {slot} generation {generation}: it holds {record.generation}")
        if record.phase != phase:
            raise BackendStateError(f"{action} of slot {slot} generation {generation} refused: it is {record.phase}")
        return record

    def _place(self, slot: int, load: _Load) -> None:
        """Queue `load` for a live worker it has not failed to reach (`worker_for_load`: with the
        others of this turn of the event loop), or park it; BackendStateError if neither."""
        worker = self._sessions.worker_for_load(load.avoid)
        if worker is None:  # a load parked before keeps its first deadline
            if not (self._grace > 0 and self._sessions.started):  # no restarted worker will take it
                raise BackendStateError("no I/O worker is ready")
            load.worker = -1
            load.avoid.clear()  # a restarted worker takes the index of a lost one
            load.parked_until = load.parked_until or time.monotonic() + self._grace
            self._parked[slot] = load
            return
        self._sessions.queue(worker, Load(slot=slot, generation=load.generation, segments=load.segments))
        load.worker, load.parked_until = worker.index, None
        self._sessions.owe(worker, slot, load.generation, sum(seg.length for seg in load.segments))

    def _undelivered(self, worker: WorkerSession, messages: list[object], error: BaseException) -> None:
        """Queued commands a send could not deliver: a worker can die between the watchdog's looks
        (host unreachable). Dead, it is lost now (its loads move on); alive (a broken connection),
        only these loads avoid it: a live worker's loads are never sent twice, so no slot gets two
        writers. A cancel that did not go is moot: its load was not sent either, or completes."""
        logger.warning("I/O worker %d (pid %d) unreachable: %s", worker.index, worker.pid, error)
        if not running(worker.process):
            self.worker_lost(worker.index, f"pid {worker.pid} exited (unreachable: {error})")
            return
        for message in messages:
            owed = isinstance(message, Load) and worker.outstanding.pop((message.slot, message.generation), None)
            if not owed:
                continue
            load = self._records[message.slot].load
            if load is None or load.generation != message.generation or load.worker != worker.index:
                continue
            load.avoid.add(worker.index)
            try:
                self._place(message.slot, load)
            except BackendStateError as failure:
                self._fail(message.slot, load, f"I/O worker {worker.index} unreachable ({error}): {failure}", code=LOST)

    def _dispatch_parked(self) -> None:
        """A worker became ready: hand it (and any other live one) the loads that waited."""
        for slot, load in sorted(self._parked.items()):
            del self._parked[slot]
            try:
                self._place(slot, load)  # parks it again if nothing can take it
            except BackendStateError as error:
                self._fail(slot, load, str(error), code=LOST)
                continue
            if slot in self._parked:
                break
            self._counts["resubmitted"] += load.orphaned  # a load parked at submit was never sent
        logger.info("parked loads dispatched; %d still waiting", len(self._parked))

    def _worker_ready(self) -> None:
        if self._parked:
            self._dispatch_parked()

    def _orphaned(self, index: int, orphans: list[tuple[int, int]], reason: str) -> None:
        """The loads a lost worker owed: nothing writes them any more, so they go to a live worker
        (same slot and generation), wait for a restarted one, or fail."""
        moved: dict[int, int] = {}
        for slot, generation in orphans:
            record = self._records[slot]
            load = record.load
            if load is None or load.generation != generation or record.phase != "loading" or load.worker != index:
                continue
            load.orphaned = True
            try:
                self._place(slot, load)
            except BackendStateError:  # no live worker and no replacement to wait for
                self._fail(slot, load, f"I/O worker {index} was lost: {reason}", code=LOST)
                continue
            if load.worker >= 0:
                self._counts["resubmitted"] += 1
            moved[load.worker] = moved.get(load.worker, 0) + 1
        if moved:
            where = ", ".join(
                f"{n} waiting for a restarted worker" if i < 0 else f"{n} to I/O worker {i}"
                for i, n in sorted(moved.items())
            )
            logger.warning("re-submitted the in-flight loads of lost I/O worker %d: %s", index, where)

    def _expire(self) -> None:
        """Parked loads whose grace has passed fail (the watchdog's tick)."""
        now = time.monotonic()
        for slot, load in sorted(self._parked.items()):
            if load.parked_until is not None and now >= load.parked_until:
                del self._parked[slot]
                self._fail(
                    slot, load, f"every I/O worker was lost and none came back within {self._grace:g} s", code=LOST
                )

    def _fail(
        self,
        slot: int,
        load: _Load,
        message: str,
        *,
        code: str | None = None,
        file: int | None = None,
        offset: int | None = None,
    ) -> None:
        record = self._records[slot]
        text = f"load of slot {slot} generation {load.generation} failed: {message}"
        load.error = ExpertLoadError(text, slot=slot, generation=load.generation, code=code, file=file, offset=offset)
        record.phase = "failed"
        self._counts["failed"] += 1
        if not load.future.done():
            load.future.set_result(None)

    def _loaded(self, worker: WorkerSession, reply: Loaded, owed: bool) -> None:
        """A worker's `loaded`: applied only to the load it owed, into the slot still waiting for it."""
        if not owed:
            self._counts["stale_completions"] += 1
            logger.info(
                "ignored stale completion of slot %d generation %d from I/O worker %d",
                reply.slot,
                reply.generation,
                worker.index,
            )
            return
        record = self._records[reply.slot]
        load = record.load
        if record.phase != "loading" or load is None or load.generation != reply.generation:
            self._counts["stale_completions"] += 1
            return
        if not reply.ok:
            return self._fail(
                reply.slot, load, reply.error or "unknown error", code=reply.code, file=reply.file, offset=reply.offset
            )
        load.completion = LoadCompletion(
            slot=reply.slot,
            generation=reply.generation,
            worker=worker.index,
            bytes=reply.bytes,
            service_ms=reply.service_ms,
            queued_ms=reply.queued_ms,
            latency_ms=(time.monotonic() - load.submitted) * 1e3,
        )
        record.phase = "ready"
        self._counts["completed"] += 1
        self._counts["bytes"] += reply.bytes
        load.future.set_result(None)


__all__ = ["LOST", "IOWorkerBackend"]
