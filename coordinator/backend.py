"""IOWorkerBackend: the ExpertResidencyBackend over N I/O worker processes.

The coordinator binds a ROUTER (zmq.asyncio); each worker's DEALER says hello,
is welcomed and reports ready. Loads go to the worker with the fewest in
flight. The backend keeps its own per-slot phase (idle/loading/ready/leased/
failed) and refuses anything that could write a leased slot: a submit into a
loading or leased slot, a discard of a leased (or still loading) one. Every
load carries a generation that must grow per slot, so a stale or late
completion is recognised, counted and ignored, never applied.

`ioworker.pool.IOWorkerPool` spawns workers and connects a backend for tests
and the bench; the supervisor will own spawning and reuse
`ioworker.spawn.spawn_io_worker`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from coordinator.residency_plan import (
    Consumer,
    ExpertIOHintSegment,
    ExpertIOHintSnapshot,
    ExpertIOSegment,
    require_int,
)
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
from shared.protocol import MAX_MESSAGE_BYTES, ProtocolError, decode, encode
from shared.slab import Slab

if TYPE_CHECKING:
    from ioworker.spawn import WorkerProcess

logger = logging.getLogger(__name__)


class BackendStateError(RuntimeError):
    """A call the slot's phase forbids (e.g. submit into a leased slot)."""


class StaleGenerationError(BackendStateError):
    """A call naming a generation the slot no longer (or never) holds."""


class ExpertLoadError(RuntimeError):
    """A load that failed; names the slot, generation and, for a read error, file and offset."""

    def __init__(self, message: str, *, slot: int, generation: int, code: str | None = None,
                 file: int | None = None, offset: int | None = None) -> None:  # fmt: skip
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


@dataclass(slots=True)
class _Load:
    generation: int
    worker: int
    segments: tuple[ExpertIOSegment, ...]
    future: asyncio.Future[None]
    submitted: float
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
    ready: bool = False
    lost: bool = False
    modes: tuple[str, ...] = ()
    outstanding: set[tuple[int, int]] = field(default_factory=set)
    hints_sent: int = 0
    hint_status: HintStatus = HintStatus()
    telemetry_waiters: list[asyncio.Future[WorkerTelemetry]] = field(default_factory=list)


def _check_segments(
    segments: Sequence[ExpertIOSegment], slot_bytes: int, files: int | None
) -> tuple[ExpertIOSegment, ...]:
    checked = tuple(segments)
    if not checked:
        raise ValueError("a load needs at least one segment")
    for index, segment in enumerate(checked):
        if not isinstance(segment, ExpertIOSegment):
            raise TypeError(f"segment {index} must be an ExpertIOSegment, got {segment!r}")
        for name in ("file", "offset", "destination"):
            require_int(getattr(segment, name), f"segment {index} {name}")
        require_int(segment.length, f"segment {index} length", minimum=1)
        if files is not None and segment.file >= files:
            raise ValueError(f"segment {index} file index {segment.file} is not in the manifest of {files} files")
        if segment.destination + segment.length > slot_bytes:
            raise ValueError(
                f"segment {index} destination [{segment.destination}, {segment.destination + segment.length}) "
                f"is outside the slot of {slot_bytes} bytes"
            )
    return checked


class IOWorkerBackend:
    """Slots of a slab, filled by I/O workers connected to `endpoint`.

    Construct and use it inside a running asyncio loop; `await start()` waits
    for `workers` workers to become ready. Only `wait` is asynchronous.
    """

    def __init__(self, *, slab: Slab, endpoint: str, workers: int, files: int | None = None,
                 hint_capacity: int = 64, context: zmq.asyncio.Context | None = None) -> None:  # fmt: skip
        self._slab = slab
        self._expected = require_int(workers, "workers", minimum=1)
        self._files = files
        self._hint_capacity = require_int(hint_capacity, "hint_capacity", minimum=1)
        self._context = context or zmq.asyncio.Context.instance()
        self._sock = self._context.socket(zmq.ROUTER)
        for option, value in ((zmq.LINGER, 0), (zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES), (zmq.SNDHWM, 0),
                              (zmq.RCVHWM, 0), (zmq.ROUTER_MANDATORY, 1)):  # fmt: skip
            # No ROUTER_HANDOVER: a second peer reusing a live worker's identity is refused.
            self._sock.setsockopt(option, value)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError:
            self._sock.close(linger=0)
            raise
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._records = [_Slot() for _ in range(slab.total_slots)]
        self._workers: dict[int, _Worker] = {}
        self._by_identity: dict[bytes, int] = {}
        self._start_errors: dict[int, str] = {}
        self._receiver: asyncio.Task[None] | None = None
        self._counts = dict.fromkeys(BackendTelemetry.__slots__, 0)
        self._hint_local = dict(submitted=0, dropped=0, errors=0)
        self._next = 0
        self._closed = False

    # ------------------------------------------------------------ lifecycle

    async def start(self, *, timeout: float = 30.0, processes: Sequence[WorkerProcess] = ()) -> None:
        """Wait until every worker is ready; raise IOWorkerStartError naming the
        failure (a worker's setup error, a child's exit code and stderr, a timeout)."""
        if self._receiver is None:
            self._receiver = asyncio.get_running_loop().create_task(self._receive(), name="ioworker-replies")
        deadline = time.monotonic() + timeout
        while sum(w.ready for w in self._workers.values()) < self._expected:
            dead = [p for p in processes if p.exit_code is not None]
            if self._start_errors or dead:
                await asyncio.sleep(0.2)  # let a dying child's last stderr lines arrive
                reasons = [f"I/O worker {i}: {message}" for i, message in sorted(self._start_errors.items())]
                reasons += [p.describe_exit() for p in processes if p.exit_code is not None]
                raise IOWorkerStartError("I/O workers failed to start:\n" + "\n".join(reasons))
            if time.monotonic() > deadline:
                ready = sorted(i for i, w in self._workers.items() if w.ready)
                raise IOWorkerStartError(
                    f"only I/O workers {ready} of {self._expected} were ready after {timeout} s"
                )
            await asyncio.sleep(0.01)

    def shutdown_workers(self) -> None:
        """Ask every connected worker to exit (non-blocking)."""
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
        if self._receiver is not None:
            self._receiver.cancel()
            try:
                await self._receiver
            except asyncio.CancelledError:
                pass
        for slot, record in enumerate(self._records):
            if record.phase == "loading" and record.load is not None:
                self._fail(slot, record.load, "the I/O backend was closed", code="closed")
        self._sock.close(linger=0)
        if self.endpoint.startswith("ipc://") and not self.endpoint.startswith("ipc://@"):
            try:  # libzmq leaves the socket file of a bound ipc endpoint behind
                os.unlink(self.endpoint.removeprefix("ipc://"))
            except FileNotFoundError:
                pass

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
        checked = _check_segments(segments, self._slab.slot_bytes, self._files)
        worker = self._choose_worker()
        self._send(worker, Load(slot=slot, generation=generation, segments=checked))
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        record.phase, record.generation, record.consumer = "loading", generation, None
        record.load = _Load(generation, worker.index, checked, future, time.monotonic())
        worker.outstanding.add((slot, generation))
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
                f"discard of slot {slot} generation {generation} refused: its load is in flight "
                f"(cancel and wait first)"
            )
        record.phase, record.load, record.consumer = "idle", None, None

    def physical_footprint(self) -> int:
        return self._slab.resident_bytes()

    def hint_segments(self, segments: Sequence[ExpertIOHintSegment]) -> bool:
        """Queue advisory readahead; False when every worker's hint queue is full."""
        checked = tuple(segments)
        for index, segment in enumerate(checked):
            for name in ("file", "offset"):
                require_int(getattr(segment, name), f"hint segment {index} {name}")
            require_int(segment.length, f"hint segment {index} length", minimum=1)
            if self._files is not None and segment.file >= self._files:
                raise ValueError(f"hint segment {index} file index {segment.file} is not in the manifest")
        if not checked:
            return True
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
        statuses = [w.hint_status for w in self._workers.values()]
        outstanding = sum(self._hints_outstanding(w) for w in self._workers.values())
        in_flight = sum(s.in_flight for s in statuses)
        return ExpertIOHintSnapshot(
            submitted=self._hint_local["submitted"],
            completed=sum(s.completed for s in statuses),
            dropped=self._hint_local["dropped"] + sum(s.dropped for s in statuses),
            operations=sum(s.operations for s in statuses),
            bytes=sum(s.bytes for s in statuses),
            errors=self._hint_local["errors"] + sum(s.errors for s in statuses),
            queue_depth=max(0, outstanding - in_flight),
            in_flight=in_flight,
        )

    # ------------------------------------------------------------ telemetry

    def telemetry(self) -> BackendTelemetry:
        counts = dict(self._counts, in_flight=sum(len(w.outstanding) for w in self._workers.values()))
        return BackendTelemetry(**counts)

    def worker_modes(self) -> dict[int, tuple[str, ...]]:
        """I/O mode per manifest file, as each ready worker reported it."""
        return {i: w.modes for i, w in sorted(self._workers.items()) if w.ready}

    async def request_telemetry(self, *, timeout: float = 5.0) -> tuple[WorkerTelemetry, ...]:
        """Ask every ready worker for its counters."""
        loop = asyncio.get_running_loop()
        waiters = []
        for worker in self._workers.values():
            if worker.ready and not worker.lost:
                future: asyncio.Future[WorkerTelemetry] = loop.create_future()
                worker.telemetry_waiters.append(future)
                self._send(worker, TelemetryRequest())
                waiters.append(future)
        return tuple(await asyncio.wait_for(asyncio.gather(*waiters), timeout))

    def worker_lost(self, index: int, reason: str) -> None:
        """A worker process is gone: fail its in-flight loads (nothing writes them any more)."""
        worker = self._workers.get(index)
        if worker is None or worker.lost:
            return
        worker.lost = True
        logger.error("I/O worker %d lost: %s", index, reason)
        for slot, generation in sorted(worker.outstanding):
            record = self._records[slot]
            if record.load is not None and record.load.generation == generation and record.phase == "loading":
                self._fail(slot, record.load, f"I/O worker {index} was lost: {reason}", code="worker_lost")
        worker.outstanding.clear()
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

    def _choose_worker(self) -> _Worker:
        live = [w for w in self._workers.values() if w.ready and not w.lost]
        if not live:
            raise BackendStateError("no I/O worker is ready")
        # Fewest in flight; ties rotate so equal workers share the load.
        self._next += 1
        return min(live, key=lambda w: (len(w.outstanding), (w.index - self._next) % len(self._workers)))

    def _hints_outstanding(self, worker: _Worker) -> int:
        return worker.hints_sent - worker.hint_status.completed - worker.hint_status.dropped

    def _send(self, worker: _Worker, message: object, *, required: bool = True) -> bool:
        if self._closed:
            raise BackendStateError("the I/O backend is closed")
        frames = [worker.identity, encode(message)]  # type: ignore[arg-type]
        sent = self._sock.send_multipart(frames, flags=zmq.DONTWAIT)
        error = sent.exception()  # DONTWAIT resolves at once
        if error is None:
            return True
        if required:
            raise BackendStateError(f"cannot reach I/O worker {worker.index}: {error}") from error
        logger.warning("message to I/O worker %d dropped: %s", worker.index, error)
        return False

    def _fail(self, slot: int, load: _Load, message: str, *, code: str | None = None,
              file: int | None = None, offset: int | None = None) -> None:  # fmt: skip
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
        if previous is not None and not previous.lost:
            # Replacing a live worker could let two processes write the same slots.
            self._bad("hello from pid %d for index %d, held by pid %d", hello.pid, hello.index, previous.pid)
            refusal = ErrorReply(code="duplicate_index", message=f"I/O worker index {hello.index} is taken")
            self._send(_Worker(index=hello.index, identity=identity, pid=hello.pid), refusal, required=False)
            return
        if previous is not None:
            self._by_identity.pop(previous.identity, None)  # a restarted worker after worker_lost()
        worker = _Worker(index=hello.index, identity=identity, pid=hello.pid)
        self._workers[hello.index] = worker
        self._by_identity[identity] = hello.index
        self._send(worker, Welcome(index=hello.index), required=False)

    def _loaded(self, worker: _Worker, reply: Loaded) -> None:
        key = (reply.slot, reply.generation)
        if key not in worker.outstanding:
            self._counts["stale_completions"] += 1
            logger.info("ignored stale completion of slot %d generation %d from I/O worker %d",
                        reply.slot, reply.generation, worker.index)  # fmt: skip
            return
        worker.outstanding.discard(key)
        record = self._records[reply.slot]
        load = record.load
        if record.phase != "loading" or load is None or load.generation != reply.generation:
            self._counts["stale_completions"] += 1
            return
        if not reply.ok:
            return self._fail(reply.slot, load, reply.error or "unknown error", code=reply.code,
                              file=reply.file, offset=reply.offset)  # fmt: skip
        load.completion = LoadCompletion(
            slot=reply.slot, generation=reply.generation, worker=worker.index, bytes=reply.bytes,
            service_ms=reply.service_ms, queued_ms=reply.queued_ms,
            latency_ms=(time.monotonic() - load.submitted) * 1e3,
        )  # fmt: skip
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
