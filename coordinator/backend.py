"""IOWorkerBackend: the ExpertResidencyBackend over N I/O worker processes.

The coordinator binds a ROUTER (zmq.asyncio); each worker's DEALER says hello,
is welcomed and reports ready. Loads go to the worker with the fewest in
flight. The backend keeps its own per-slot phase (idle/loading/ready/leased/
failed) and refuses anything that could write a leased slot: a submit into a
loading or leased slot, a discard of a leased (or still loading) one. Every
load carries a generation that must grow per slot, so a stale or late
completion is recognised, counted and ignored, never applied.

A worker that dies is noticed by a pid watchdog (its pid comes with its hello)
or by `worker_lost()`; its in-flight loads are re-submitted at once, same
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

import psutil
import zmq
import zmq.asyncio

from coordinator.residency_backend import Consumer, ExpertIOHintSnapshot
from shared.checks import require_int
from shared.io_messages import (
    WORKER_REPLIES,
    Cancel,
    ErrorReply,
    Hello,
    Hint,
    HintStatus,
    Load,
    Loaded,
    Ready,
    Shutdown,
    TelemetryRequest,
    Welcome,
    WorkerTelemetry,
)
from shared.protocol import ProtocolError, decode, encode
from shared.segments import ExpertIOHintSegment, ExpertIOSegment, check_segments
from shared.slab import Slab
from shared.sockets import bound_endpoint, open_socket, remove_ipc_file

if TYPE_CHECKING:
    from shared.children import ChildProcess

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.1
LOST = "worker_lost"  # ExpertLoadError.code of a load no worker could take over


class BackendStateError(RuntimeError):
    """A call the slot's phase forbids (e.g. submit into a leased slot)."""


class StaleGenerationError(BackendStateError):
    """A call naming a generation the slot no longer (or never) holds."""


class ExpertLoadError(RuntimeError):
    """A load that failed; names the slot, generation and, for a read error, file and offset."""

    def __init__(
        self,
        message: str,
        *,
        slot: int,
        generation: int,
        code: str | None = None,
        file: int | None = None,
        offset: int | None = None,
    ) -> None:
        super().__init__(message)
        self.slot, self.generation, self.code, self.file, self.offset = slot, generation, code, file, offset


class IOWorkerStartError(RuntimeError):
    """Workers did not all become ready; the message carries exit codes and stderr."""


@dataclass(frozen=True, slots=True)
class LoadCompletion:
    slot: int
    generation: int
    worker: int
    bytes: int
    service_ms: float  # the worker's read time
    queued_ms: float  # time queued inside the worker
    latency_ms: float  # submit to reply, as seen here


@dataclass(frozen=True, slots=True)
class BackendTelemetry:
    submitted: int = 0
    completed: int = 0
    failed: int = 0
    cancels_sent: int = 0
    stale_completions: int = 0
    bad_replies: int = 0
    worker_errors: int = 0
    bytes: int = 0
    in_flight: int = 0
    workers_lost: int = 0
    resubmitted: int = 0  # loads of a lost worker sent again (to another or its restarted one)


@dataclass(slots=True)
class _Load:
    generation: int
    worker: int
    segments: tuple[ExpertIOSegment, ...]
    future: asyncio.Future[None]
    submitted: float
    parked_until: float | None = None  # waiting for any live worker (worker is then -1)
    orphaned: bool = False  # its worker was lost after it was sent
    completion: LoadCompletion | None = None
    error: ExpertLoadError | None = None


@dataclass(slots=True)
class _Slot:
    phase: str = "idle"  # idle | loading | ready | leased | failed
    generation: int = 0  # the last generation submitted (0: never)
    load: _Load | None = None
    consumer: Consumer | None = None


@dataclass(slots=True)
class _Worker:
    index: int
    identity: bytes
    pid: int
    process: psutil.Process | None = None  # None: the pid named no process at hello
    ready: bool = False
    lost: bool = False
    modes: tuple[str, ...] = ()
    outstanding: set[tuple[int, int]] = field(default_factory=set)
    hints_sent: int = 0
    hint_status: HintStatus = field(default_factory=HintStatus)
    telemetry_waiters: list[asyncio.Future[WorkerTelemetry]] = field(default_factory=list)


def _process(pid: int) -> psutil.Process | None:
    """A handle that remembers the start time, so a reused pid does not look alive."""
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _running(process: psutil.Process | None) -> bool:
    try:
        return process is not None and process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


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
    ) -> None:
        if not replacement_grace_s >= 0:  # NaN too
            raise ValueError(f"replacement_grace_s must be >= 0, got {replacement_grace_s!r}")
        self._slab = slab
        self._grace = float(replacement_grace_s)
        self._expected = require_int(workers, "workers", minimum=1)
        self._files = files
        self._hint_capacity = require_int(hint_capacity, "hint_capacity", minimum=1)
        self._context = context or zmq.asyncio.Context.instance()
        self._sock = open_socket(self._context, zmq.ROUTER, bind=endpoint)
        self.endpoint: str = bound_endpoint(self._sock)
        self._records = [_Slot() for _ in range(slab.total_slots)]
        self._workers: dict[int, _Worker] = {}
        self._by_identity: dict[bytes, int] = {}
        self._start_errors: dict[int, str] = {}
        self._receiver: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._parked: dict[int, _Load] = {}  # slot -> a load that waits for a live worker
        self._counts = dict.fromkeys(BackendTelemetry.__slots__, 0)
        self._hint_local = dict(submitted=0, dropped=0, errors=0)
        # Hint counters of workers that were replaced, so the totals never go backwards.
        self._retired_hints = dict(completed=0, dropped=0, operations=0, bytes=0, errors=0)
        self._next = 0
        self._started = False  # every expected worker was ready once
        self._closed = False
        self._stopping = False  # shutdown_workers() was called: exits are expected, not losses

    # ------------------------------------------------------------ lifecycle

    async def start(self, *, timeout: float = 30.0, processes: Sequence[ChildProcess] = ()) -> None:
        """Wait until every worker is ready; raise IOWorkerStartError naming the
        failure (a worker's setup error, a child's exit code and stderr, a timeout)."""
        if self._receiver is None:
            loop = asyncio.get_running_loop()
            self._receiver = loop.create_task(self._receive(), name="ioworker-replies")
            self._watchdog = loop.create_task(self._watch(), name="ioworker-watchdog")
        deadline = time.monotonic() + timeout
        while sum(w.ready for w in self._workers.values()) < self._expected:
            dead = [p for p in processes if p.exit_code is not None]
            if self._start_errors or dead:
                await asyncio.sleep(0.2)  # let a dying child's last stderr lines arrive
                reasons = [f"I/O worker {i}: {message}" for i, message in sorted(self._start_errors.items())]
                reasons += [p.describe() for p in processes if p.exit_code is not None]
                raise IOWorkerStartError("I/O workers failed to start:\n" + "\n".join(reasons))
            if time.monotonic() > deadline:
                ready = sorted(i for i, w in self._workers.items() if w.ready)
                raise IOWorkerStartError(f"only I/O workers {ready} of {self._expected} were ready after {timeout} s")
            await asyncio.sleep(0.01)
        self._started = True

    def shutdown_workers(self) -> None:
        """Ask every connected worker to exit (non-blocking); their exits are no longer losses."""
        self._stopping = True
        for worker in self._workers.values():
            if not worker.lost:
                self._send(worker, Shutdown(), required=False)

    async def aclose(self) -> None:
        """Stop receiving, fail pending waits, close the socket (idempotent).

        Call it once the workers have exited: a load still in flight in a live
        worker would keep writing its slot after its wait has failed."""
        if self._closed:
            return
        self._closed = True
        for task in (self._receiver, self._watchdog):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        self._parked.clear()
        for slot, record in enumerate(self._records):
            if record.phase == "loading" and record.load is not None:
                self._fail(slot, record.load, "the I/O backend was closed", code="closed")
        self._sock.close(linger=0)
        remove_ipc_file(self.endpoint)

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
        checked = check_segments(segments, slot_bytes=self._slab.slot_bytes, manifest=self._files)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        load = _Load(generation, -1, checked, future, time.monotonic())
        self._place(slot, load)  # BackendStateError (nothing changed) when no worker can take it
        record.phase, record.generation, record.consumer = "loading", generation, None
        record.load = load
        self._counts["submitted"] += 1

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
        worker = self._workers.get(record.load.worker)
        if worker is not None and not worker.lost:
            self._send(worker, Cancel(slot=slot, generation=generation), required=False)
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

    def hint_segments(self, segments: Sequence[ExpertIOHintSegment]) -> bool:
        """Queue advisory readahead; False when every worker's hint queue is full."""
        if not segments:
            return True
        checked = check_segments(segments, slot_bytes=None, manifest=self._files)
        live = [w for w in self._workers.values() if w.ready and not w.lost]
        if not live:
            raise BackendStateError("no I/O worker is ready")
        worker = min(live, key=self._hints_outstanding)
        if self._hints_outstanding(worker) >= self._hint_capacity:
            self._hint_local["dropped"] += 1
            return False
        if not self._send(worker, Hint(segments=checked), required=False):
            self._hint_local["errors"] += 1
            return False
        worker.hints_sent += 1
        self._hint_local["submitted"] += 1
        return True

    def hint_telemetry(self) -> ExpertIOHintSnapshot:
        """Cumulative hint counters: submitted counts messages this backend sent,
        dropped both its own refusals and the workers' queue drops."""
        live = [w for w in self._workers.values() if not w.lost]
        statuses = [w.hint_status for w in self._workers.values()]
        outstanding = sum(self._hints_outstanding(w) for w in live)
        in_flight = sum(w.hint_status.in_flight for w in live)
        retired = self._retired_hints
        return ExpertIOHintSnapshot(
            submitted=self._hint_local["submitted"],
            completed=retired["completed"] + sum(s.completed for s in statuses),
            dropped=retired["dropped"] + self._hint_local["dropped"] + sum(s.dropped for s in statuses),
            operations=retired["operations"] + sum(s.operations for s in statuses),
            bytes=retired["bytes"] + sum(s.bytes for s in statuses),
            errors=retired["errors"] + self._hint_local["errors"] + sum(s.errors for s in statuses),
            queue_depth=max(0, outstanding - in_flight),
            in_flight=in_flight,
        )

    # ------------------------------------------------------------ telemetry

    def telemetry(self) -> BackendTelemetry:
        in_flight = sum(len(w.outstanding) for w in self._workers.values()) + len(self._parked)
        counts = dict(self._counts, in_flight=in_flight)
        return BackendTelemetry(**counts)

    def worker_modes(self) -> dict[int, tuple[str, ...]]:
        """I/O mode per manifest file, as each ready (and not lost) worker reported it."""
        return {i: w.modes for i, w in sorted(self._workers.items()) if w.ready and not w.lost}

    def worker_pids(self) -> dict[int, int]:
        """The hello pid of each ready worker that is not lost, by index."""
        return {i: w.pid for i, w in sorted(self._workers.items()) if w.ready and not w.lost}

    async def request_telemetry(self, *, timeout: float = 5.0) -> tuple[WorkerTelemetry, ...]:
        """Ask every ready worker for its counters (one that cannot be reached is left out)."""
        loop = asyncio.get_running_loop()
        waiters = []
        for worker in list(self._workers.values()):
            if worker.ready and not worker.lost:
                error = self._try_send(worker, TelemetryRequest())
                if error is not None:  # dead before the watchdog's next look, or disconnected
                    logger.warning("no telemetry from I/O worker %d: %s", worker.index, error)
                    if not _running(worker.process):
                        self.worker_lost(worker.index, f"pid {worker.pid} exited (unreachable: {error})")
                    continue
                future: asyncio.Future[WorkerTelemetry] = loop.create_future()
                worker.telemetry_waiters.append(future)
                waiters.append(future)
        return tuple(await asyncio.wait_for(asyncio.gather(*waiters), timeout))

    def worker_lost(self, index: int, reason: str) -> None:
        """A worker process is gone: its in-flight loads go to a live worker at once.

        Nothing writes them any more, so sending the same (slot, generation) again is safe;
        a late completion from the dead worker is stale (no longer outstanding) and ignored.
        With no live worker they wait for a restarted one, or fail (`worker_lost`)."""
        worker = self._workers.get(index)
        if worker is None or worker.lost:
            return
        if self._stopping and not worker.outstanding:  # it did what shutdown_workers() asked
            worker.lost = True
            logger.info("I/O worker %d (pid %d) exited after shutdown", index, worker.pid)
            return
        worker.lost = True
        self._counts["workers_lost"] += 1
        orphans = sorted(worker.outstanding)
        worker.outstanding.clear()
        logger.error("I/O worker %d (pid %d) lost with %d loads in flight: %s", index, worker.pid, len(orphans), reason)
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
        for future in worker.telemetry_waiters:
            if not future.done():
                future.set_exception(IOWorkerStartError(f"I/O worker {index} was lost"))
        worker.telemetry_waiters.clear()

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

    def _choose_worker(self, *, park: bool = False, exclude: set[int] | None = None) -> _Worker | None:
        """The least busy live worker; None (park the load) when no worker can take it but a
        restarted one may; BackendStateError when nothing can take it."""
        live = [w for w in self._workers.values() if w.ready and not w.lost and w.index not in (exclude or ())]
        if not live:
            if park and self._grace > 0 and self._started:  # a restarted worker will take it
                return None
            raise BackendStateError("no I/O worker is ready")
        # Fewest in flight; ties rotate so equal workers share the load.
        self._next += 1
        return min(live, key=lambda w: (len(w.outstanding), (w.index - self._next) % len(self._workers)))

    def _place(self, slot: int, load: _Load) -> None:
        """Send `load` to the least busy reachable worker, or park it; BackendStateError if neither.

        A worker can die between the watchdog's looks: its send fails (host unreachable). Dead,
        it is lost now (its loads move on); alive (a broken connection), only this load avoids
        it: a live worker's loads are never sent twice, so no slot gets two writers."""
        excluded: set[int] = set()
        while True:
            worker = self._choose_worker(park=True, exclude=excluded)
            if worker is None:  # a load parked before keeps its first deadline
                load.worker = -1
                load.parked_until = load.parked_until or time.monotonic() + self._grace
                self._parked[slot] = load
                return
            error = self._try_send(worker, Load(slot=slot, generation=load.generation, segments=load.segments))
            if error is None:
                load.worker, load.parked_until = worker.index, None
                worker.outstanding.add((slot, load.generation))
                return
            logger.warning("I/O worker %d (pid %d) unreachable: %s", worker.index, worker.pid, error)
            if _running(worker.process):
                excluded.add(worker.index)
            else:
                self.worker_lost(worker.index, f"pid {worker.pid} exited (unreachable: {error})")

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

    async def _watch(self) -> None:
        """Notice dead workers by pid (nobody may call worker_lost), and expire parked loads."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            for worker in list(self._workers.values()):
                if not worker.lost and not _running(worker.process):
                    self.worker_lost(worker.index, f"pid {worker.pid} exited")
            now = time.monotonic()
            for slot, load in sorted(self._parked.items()):
                if load.parked_until is not None and now >= load.parked_until:
                    del self._parked[slot]
                    self._fail(
                        slot, load, f"every I/O worker was lost and none came back within {self._grace:g} s", code=LOST
                    )

    def _hints_outstanding(self, worker: _Worker) -> int:
        return worker.hints_sent - worker.hint_status.completed - worker.hint_status.dropped

    def _try_send(self, worker: _Worker, message: object) -> BaseException | None:
        if self._closed:
            raise BackendStateError("the I/O backend is closed")
        frames = [worker.identity, encode(message)]  # type: ignore[arg-type]
        sent = self._sock.send_multipart(frames, flags=zmq.DONTWAIT)
        return sent.exception()  # DONTWAIT resolves at once

    def _send(self, worker: _Worker, message: object, *, required: bool = True) -> bool:
        error = self._try_send(worker, message)
        if error is None:
            return True
        if required:
            raise BackendStateError(f"cannot reach I/O worker {worker.index}: {error}") from error
        logger.warning("message to I/O worker %d dropped: %s", worker.index, error)
        return False

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

    async def _receive(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            while True:
                try:
                    self._dispatch(frames)
                except Exception:  # a bad reply must never stop the coordinator
                    self._counts["bad_replies"] += 1
                    logger.exception("failed to handle a reply from an I/O worker")
                # Drain what is already queued without a trip through the event loop.
                ready = self._sock.recv_multipart(flags=zmq.DONTWAIT)
                if ready.exception() is not None:  # zmq.Again: nothing more for now
                    break
                frames = ready.result()

    def _bad(self, message: str, *args: object) -> None:
        self._counts["bad_replies"] += 1
        logger.warning("bad reply from an I/O worker: " + message, *args)

    def _dispatch(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            return self._bad("expected identity + one frame, got %d frames", len(frames))
        identity, payload = frames
        try:
            reply = decode(payload, WORKER_REPLIES)
        except ProtocolError as error:
            return self._bad("%s: %s", identity, error)
        if isinstance(reply, Hello):
            return self._hello(identity, reply)
        index = self._by_identity.get(identity)
        worker = None if index is None else self._workers[index]
        if worker is None:
            return self._bad("%r from %s before its hello", reply, identity)
        if isinstance(reply, Loaded):
            self._loaded(worker, reply)
        elif isinstance(reply, Ready):
            if reply.index != worker.index:
                return self._bad("ready for index %d from worker %d", reply.index, worker.index)
            worker.ready, worker.modes = True, reply.modes
            logger.info("I/O worker %d (pid %d) ready, modes %s", worker.index, reply.pid, sorted(set(reply.modes)))
            if self._parked:
                self._dispatch_parked()
        elif isinstance(reply, HintStatus):
            worker.hint_status = reply
        elif isinstance(reply, WorkerTelemetry):
            while worker.telemetry_waiters:
                future = worker.telemetry_waiters.pop(0)
                if not future.done():
                    future.set_result(reply)
                    break
        elif isinstance(reply, ErrorReply):
            self._counts["worker_errors"] += 1
            if not worker.ready:
                self._start_errors[worker.index] = f"{reply.code}: {reply.message}"
            logger.warning("I/O worker %d reported %s: %s", worker.index, reply.code, reply.message)

    def _hello(self, identity: bytes, hello: Hello) -> None:
        if hello.index >= self._expected:
            return self._bad("hello from index %d; only %d workers are expected", hello.index, self._expected)
        previous = self._workers.get(hello.index)
        if previous is not None and not previous.lost and not _running(previous.process):
            # Its replacement said hello before the watchdog's next look.
            self.worker_lost(previous.index, f"pid {previous.pid} exited; pid {hello.pid} replaces it")
        if previous is not None and not previous.lost:
            # Replacing a live worker could let two processes write the same slots.
            self._bad("hello from pid %d for index %d, held by pid %d", hello.pid, hello.index, previous.pid)
            refusal = ErrorReply(code="duplicate_index", message=f"I/O worker index {hello.index} is taken")
            self._send(_Worker(index=hello.index, identity=identity, pid=hello.pid), refusal, required=False)
            return
        if previous is not None:
            self._by_identity.pop(previous.identity, None)  # a restarted worker after worker_lost()
            for name in self._retired_hints:
                self._retired_hints[name] += getattr(previous.hint_status, name)
            logger.info("I/O worker %d: pid %d replaces lost pid %d", hello.index, hello.pid, previous.pid)
        worker = _Worker(index=hello.index, identity=identity, pid=hello.pid, process=_process(hello.pid))
        self._workers[hello.index] = worker
        self._by_identity[identity] = hello.index
        self._send(worker, Welcome(index=hello.index), required=False)

    def _loaded(self, worker: _Worker, reply: Loaded) -> None:
        key = (reply.slot, reply.generation)
        if key not in worker.outstanding:
            self._counts["stale_completions"] += 1
            logger.info(
                "ignored stale completion of slot %d generation %d from I/O worker %d",
                reply.slot,
                reply.generation,
                worker.index,
            )
            return
        worker.outstanding.discard(key)
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


__all__ = [
    "BackendStateError",
    "BackendTelemetry",
    "ExpertLoadError",
    "IOWorkerBackend",
    "IOWorkerStartError",
    "LoadCompletion",
    "StaleGenerationError",
]
