"""The I/O workers as the coordinator knows them: their ROUTER, sessions, liveness and hint queues.

Each worker's DEALER says hello (index and pid), is welcomed and reports ready; a hello for an
index held by a live worker is refused (two writers of the same slots), one for an index whose
worker is known dead replaces it. A worker that dies is noticed by a pid watchdog (the pid comes
with its hello; `shared.pid_watch.PidWatch` names the process itself, so a reused pid does not look
alive) or by `worker_lost()`. What a worker owes is its `outstanding` set of (slot, generation) loads:
the sessions tell the slot side (`coordinator.backend.IOWorkerBackend`) about completions,
readiness, losses and undelivered loads through callbacks and never touch a slot themselves.
Loads are queued and sent once per turn of the event loop, a worker's in one message, and a turn's
loads go to one worker (`worker_for_load`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq

from coordinator.io_hints import HintTotals
from coordinator.io_results import BackendStateError, IOWorkerStartError
from coordinator.liveness import ProgressDeadline, kill_hung
from coordinator.residency_backend import ExpertIOHintSnapshot
from shared.io_messages import (
    MAX_FRAMES,
    WORKER_REPLIES,
    ErrorReply,
    Hello,
    Hint,
    HintStatus,
    Loaded,
    Ready,
    Shutdown,
    TelemetryRequest,
    Welcome,
    WorkerTelemetry,
)
from shared.loop_socket import LoopSocket, plain_context
from shared.pid_watch import PidWatch
from shared.protocol import ProtocolError, decode, encode
from shared.segments import ExpertIOHintSegment
from shared.sockets import bound_endpoint, open_socket, remove_ipc_file

if TYPE_CHECKING:
    from shared.children import ChildProcess

logger = logging.getLogger("coordinator.backend")

TURN_LOADS = 16  # a turn's loads one worker takes before the next takes the rest: a decode wave stays whole,
# a prefill's larger waves spread (one thread's io_submit pins and maps every range it submits)

WATCH_INTERVAL_S = 0.1


@dataclass(slots=True)
class WorkerSession:
    index: int
    identity: bytes
    pid: int
    process: PidWatch | None = None  # its process, watched from its hello on (None: a refused hello's)
    ready: bool = False
    lost: bool = False
    modes: tuple[str, ...] = ()
    outstanding: dict[tuple[int, int], int] = field(default_factory=dict)  # (slot, generation) it owes -> bytes
    progress_at: float = 0.0  # its last message, or when it began to owe (coordinator/liveness.py)
    hints_sent: int = 0
    hint_status: HintStatus = field(default_factory=HintStatus)
    outbox: list[tuple[object, bytes]] = field(default_factory=list)  # queued commands, encoded
    telemetry_waiters: list[asyncio.Future[WorkerTelemetry]] = field(default_factory=list)

    def hints_outstanding(self) -> int:
        return self.hints_sent - self.hint_status.completed - self.hint_status.dropped


def running(process: PidWatch | None) -> bool:
    return process is not None and process.alive()


@dataclass(frozen=True, slots=True)
class SessionEvents:
    """What the slot side hears from the sessions."""

    loaded: Callable[[WorkerSession, Loaded, bool], None]  # (worker, reply, it owed that load)
    ready: Callable[[], None]  # a worker became ready: parked loads can go
    lost: Callable[[int, list[tuple[int, int]], str], None]  # (index, the loads it owed, reason)
    tick: Callable[[], None]  # every watchdog interval
    # (worker, queued commands a send could not deliver, the send's error): nothing of them left
    undelivered: Callable[[WorkerSession, list[object], BaseException], None]


class IOWorkerSessions:
    """The ROUTER the I/O workers connect to, and one session per worker index."""

    def __init__(
        self,
        *,
        context: zmq.Context,
        endpoint: str,
        workers: int,
        hint_capacity: int,
        events: SessionEvents,
        deadline: ProgressDeadline | None = None,
    ) -> None:
        # A plain socket served from the loop (shared.loop_socket): replies are handed on as they come.
        self._sock = LoopSocket(open_socket(plain_context(context), zmq.ROUTER, bind=endpoint), self._on_frames)
        self._flush_scheduled = False
        self.endpoint: str = bound_endpoint(self._sock.sock)
        self.expected = workers
        self._hint_capacity = hint_capacity
        self._events = events
        self._deadline = deadline  # None: hung workers are not looked for
        self.workers: dict[int, WorkerSession] = {}
        self._by_identity: dict[bytes, int] = {}
        self._start_errors: dict[int, str] = {}
        self._watchdog: asyncio.Task[None] | None = None
        self.counts = dict(bad_replies=0, worker_errors=0, workers_lost=0, workers_hung=0)
        self._hints = HintTotals()
        self._next = 0
        self.started = False  # every expected worker was ready once
        self.closed = False
        self.stopping = False  # shutdown_workers() was called: exits are expected, not losses

    # ------------------------------------------------------------ lifecycle

    async def start(self, *, timeout: float, processes: Sequence[ChildProcess] = ()) -> None:
        """Wait until every worker is ready; IOWorkerStartError naming the failure
        (a worker's setup error, a child's exit code and stderr, a timeout)."""
        if self._watchdog is None:
            self._sock.start()
            self._watchdog = asyncio.get_running_loop().create_task(self._watch(), name="ioworker-watchdog")
        deadline = time.monotonic() + timeout
        while sum(w.ready for w in self.workers.values()) < self.expected:
            dead = [p for p in processes if p.exit_code is not None]
            if self._start_errors or dead:
                await asyncio.sleep(0.2)  # let a dying child's last stderr lines arrive
                reasons = [f"I/O worker {i}: {message}" for i, message in sorted(self._start_errors.items())]
                reasons += [p.describe() for p in processes if p.exit_code is not None]
                raise IOWorkerStartError("I/O workers failed to start:\n" + "\n".join(reasons))
            if time.monotonic() > deadline:
                ready = sorted(i for i, w in self.workers.items() if w.ready)
                raise IOWorkerStartError(f"only I/O workers {ready} of {self.expected} were ready after {timeout} s")
            await asyncio.sleep(0.01)
        self.started = True

    def shutdown_workers(self) -> None:
        """Ask every connected worker to exit (non-blocking); their exits are no longer losses."""
        self.stopping = True
        for worker in self.workers.values():
            if not worker.lost:
                self.send(worker, Shutdown(), required=False)

    async def aclose(self) -> None:
        """Stop receiving and watching, close the socket and remove its ipc file."""
        self.closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            try:
                await self._watchdog
            except asyncio.CancelledError:
                pass
        self._sock.close()
        remove_ipc_file(self.endpoint)
        for worker in self.workers.values():
            if worker.process is not None:
                worker.process.close()

    # ------------------------------------------------------------ workers

    def live(self, exclude: set[int] | None = None) -> list[WorkerSession]:
        return [w for w in self.workers.values() if w.ready and not w.lost and w.index not in (exclude or ())]

    def worker_for_load(self, exclude: set[int] | None = None) -> WorkerSession | None:
        """Where a load goes: the live worker already taking this turn's loads while it has fewer
        than TURN_LOADS (they go as one message, which the worker reads as one: a wave's wake-ups
        once, not once per worker), else the one with the fewest loads in flight (ties rotate so
        equal workers share); None if none."""
        live = self.live(exclude)
        if not live:
            return None
        for worker in live:
            if 0 < len(worker.outbox) < TURN_LOADS:
                return worker
        self._next += 1
        return min(live, key=lambda w: (len(w.outstanding), (w.index - self._next) % len(self.workers)))

    def queue(self, worker: WorkerSession, message: object) -> None:
        """Send `message` with the rest queued for `worker` after this turn of the event loop (a
        prefetch wave's loads: one message); what a failed send leaves goes to `undelivered`."""
        if self.closed:
            raise BackendStateError("the I/O backend is closed")
        worker.outbox.append((message, encode(message)))  # type: ignore[arg-type]
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Send every worker's queued commands now."""
        self._flush_scheduled = False
        for worker in [w for w in self.workers.values() if w.outbox and not self.closed]:
            self._deliver(worker, [])

    def try_send(self, worker: WorkerSession, message: object) -> BaseException | None:
        """Send without blocking, after (and with) what is queued for `worker`; the error (e.g. host
        unreachable: the peer is gone) or None."""
        return self._deliver(worker, [encode(message)])  # type: ignore[arg-type]

    def _deliver(self, worker: WorkerSession, frames: list[bytes]) -> BaseException | None:
        if self.closed:
            raise BackendStateError("the I/O backend is closed")
        queued, worker.outbox = worker.outbox, []
        payload = [frame for _, frame in queued] + frames
        error: BaseException | None = None
        for start in range(0, len(payload), MAX_FRAMES):
            try:
                self._sock.send_multipart([worker.identity, *payload[start : start + MAX_FRAMES]])
            except zmq.ZMQError as failed:
                error = failed
                break
        if error is not None and queued:
            # ZeroMQ takes a message whole or not at all: the chunks before the failed one were sent.
            self._events.undelivered(worker, [message for message, _ in queued[min(start, len(queued)) :]], error)
        return error

    def send(self, worker: WorkerSession, message: object, *, required: bool = True) -> bool:
        error = self.try_send(worker, message)
        if error is None:
            return True
        if required:
            raise BackendStateError(f"cannot reach I/O worker {worker.index}: {error}") from error
        logger.warning("message to I/O worker %d dropped: %s", worker.index, error)
        return False

    def worker_lost(self, index: int, reason: str) -> None:
        """A worker process is gone: the slot side gets the loads it owed (`SessionEvents.lost`)."""
        worker = self.workers.get(index)
        if worker is None or worker.lost:
            return
        if worker.process is not None:
            worker.process.close()  # lost for good: a restarted worker comes with a hello and a watch of its own
        if self.stopping and not worker.outstanding:  # it did what shutdown_workers() asked
            worker.lost = True
            logger.info("I/O worker %d (pid %d) exited after shutdown", index, worker.pid)
            return
        worker.lost = True
        worker.outbox.clear()  # what it would have been sent is in what it owes (orphaned below)
        self.counts["workers_lost"] += 1
        orphans = sorted(worker.outstanding)
        worker.outstanding.clear()
        logger.error("I/O worker %d (pid %d) lost with %d loads in flight: %s", index, worker.pid, len(orphans), reason)
        self._events.lost(index, orphans, reason)
        for future in worker.telemetry_waiters:
            if not future.done():
                future.set_exception(IOWorkerStartError(f"I/O worker {index} was lost"))
        worker.telemetry_waiters.clear()

    def in_flight(self) -> int:
        return sum(len(w.outstanding) for w in self.workers.values())

    def worker_modes(self) -> dict[int, tuple[str, ...]]:
        """I/O mode per manifest file, as each ready (and not lost) worker reported it."""
        return {i: w.modes for i, w in sorted(self.workers.items()) if w.ready and not w.lost}

    def worker_pids(self) -> dict[int, int]:
        """The hello pid of each ready worker that is not lost, by index."""
        return {i: w.pid for i, w in sorted(self.workers.items()) if w.ready and not w.lost}

    async def request_telemetry(self, *, timeout: float) -> tuple[WorkerTelemetry, ...]:
        """Ask every ready worker for its counters (one that cannot be reached is left out)."""
        loop = asyncio.get_running_loop()
        waiters = []
        for worker in self.live():
            error = self.try_send(worker, TelemetryRequest())
            if error is not None:  # dead before the watchdog's next look, or disconnected
                logger.warning("no telemetry from I/O worker %d: %s", worker.index, error)
                if not running(worker.process):
                    self.worker_lost(worker.index, f"pid {worker.pid} exited (unreachable: {error})")
                continue
            future: asyncio.Future[WorkerTelemetry] = loop.create_future()
            worker.telemetry_waiters.append(future)
            waiters.append(future)
        return tuple(await asyncio.wait_for(asyncio.gather(*waiters), timeout))

    # ------------------------------------------------------------ hints

    def hint(self, segments: tuple[ExpertIOHintSegment, ...]) -> bool:
        """Queue advisory readahead on the worker with the fewest hints queued; False when every queue is full."""
        live = self.live()
        if not live:
            raise BackendStateError("no I/O worker is ready")
        worker = min(live, key=WorkerSession.hints_outstanding)
        if worker.hints_outstanding() >= self._hint_capacity:
            self._hints.dropped += 1
            return False
        if not self.send(worker, Hint(segments=segments), required=False):
            self._hints.errors += 1
            return False
        worker.hints_sent += 1
        self._hints.submitted += 1
        return True

    def hint_telemetry(self) -> ExpertIOHintSnapshot:
        """Cumulative hint counters (`HintTotals.snapshot`)."""
        live = [w for w in self.workers.values() if not w.lost]
        return self._hints.snapshot(
            (w.hint_status for w in self.workers.values()),
            outstanding=sum(w.hints_outstanding() for w in live),
            in_flight=sum(w.hint_status.in_flight for w in live),
        )

    # ------------------------------------------------------------ replies

    async def _watch(self) -> None:
        """Notice dead workers by pid (nobody may call worker_lost), and give the slot side its tick."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            now = time.monotonic()
            for worker in list(self.workers.values()):
                if not worker.lost and not running(worker.process):
                    self.worker_lost(worker.index, f"pid {worker.pid} exited")
                elif not worker.lost and worker.outstanding and self._deadline is not None:
                    self._judge(worker, now, self._deadline)
            self._events.tick()

    def owe(self, worker: WorkerSession, slot: int, generation: int, nbytes: int) -> None:
        """`worker` now owes this load; its progress clock starts if it owed nothing."""
        if not worker.outstanding:
            worker.progress_at = time.monotonic()
        worker.outstanding[(slot, generation)] = nbytes

    def _judge(self, worker: WorkerSession, now: float, deadline: ProgressDeadline) -> None:
        """Kill a worker that owes loads and has been silent past their deadline; then it is lost."""
        allowed = deadline.io_allowance(owed_bytes=sum(worker.outstanding.values()), owed_loads=len(worker.outstanding))
        silent = now - worker.progress_at
        if silent <= allowed:
            return
        reason = (
            f"no message for {silent:.1f} s while it owes {len(worker.outstanding)} loads "
            f"({sum(worker.outstanding.values())} bytes; allowed {allowed:.1f} s)"
        )
        self.counts["workers_hung"] += 1
        kill_hung(worker.process, worker.pid, f"I/O worker {worker.index}", reason)
        self.worker_lost(worker.index, f"hung: {reason}")

    def _on_frames(self, frames: list[bytes]) -> None:
        if self.closed:
            return
        try:
            self._dispatch(frames)
        except Exception:  # a bad reply must never stop the coordinator
            self.counts["bad_replies"] += 1
            logger.exception("failed to handle a reply from an I/O worker")

    def _bad(self, message: str, *args: object) -> None:
        self.counts["bad_replies"] += 1
        logger.warning("bad reply from an I/O worker: " + message, *args)

    def _dispatch(self, frames: list[bytes]) -> None:
        if not 2 <= len(frames) <= MAX_FRAMES + 1:
            return self._bad("expected identity + 1 to %d frames, got %d frames", MAX_FRAMES, len(frames))
        identity = frames[0]
        for payload in frames[1:]:
            self._reply(identity, payload)

    def _reply(self, identity: bytes, payload: bytes) -> None:
        try:
            reply = decode(payload, WORKER_REPLIES)
        except ProtocolError as error:
            return self._bad("%s: %s", identity, error)
        if isinstance(reply, Hello):
            return self._hello(identity, reply)
        index = self._by_identity.get(identity)
        worker = None if index is None else self.workers[index]
        if worker is None:
            return self._bad("%r from %s before its hello", reply, identity)
        worker.progress_at = time.monotonic()
        if isinstance(reply, Loaded):
            key = (reply.slot, reply.generation)
            owed = worker.outstanding.pop(key, None) is not None
            self._events.loaded(worker, reply, owed)
        elif isinstance(reply, Ready):
            if reply.index != worker.index:
                return self._bad("ready for index %d from worker %d", reply.index, worker.index)
            worker.ready, worker.modes = True, reply.modes
            logger.info("I/O worker %d (pid %d) ready, modes %s", worker.index, reply.pid, sorted(set(reply.modes)))
            self._events.ready()
        elif isinstance(reply, HintStatus):
            worker.hint_status = reply
        elif isinstance(reply, WorkerTelemetry):
            while worker.telemetry_waiters:
                future = worker.telemetry_waiters.pop(0)
                if not future.done():
                    future.set_result(reply)
                    break
        elif isinstance(reply, ErrorReply):
            self.counts["worker_errors"] += 1
            if not worker.ready:
                self._start_errors[worker.index] = f"{reply.code}: {reply.message}"
            logger.warning("I/O worker %d reported %s: %s", worker.index, reply.code, reply.message)

    def _hello(self, identity: bytes, hello: Hello) -> None:
        if hello.index >= self.expected:
            return self._bad("hello from index %d; only %d workers are expected", hello.index, self.expected)
        previous = self.workers.get(hello.index)
        if previous is not None and not previous.lost and not running(previous.process):
            # Its replacement said hello before the watchdog's next look.
            self.worker_lost(previous.index, f"pid {previous.pid} exited; pid {hello.pid} replaces it")
        if previous is not None and not previous.lost:
            # Replacing a live worker could let two processes write the same slots.
            self._bad("hello from pid %d for index %d, held by pid %d", hello.pid, hello.index, previous.pid)
            refusal = ErrorReply(code="duplicate_index", message=f"I/O worker index {hello.index} is taken")
            self.send(WorkerSession(index=hello.index, identity=identity, pid=hello.pid), refusal, required=False)
            return
        if previous is not None:
            self._by_identity.pop(previous.identity, None)  # a restarted worker after worker_lost()
            self._hints.retire(previous.hint_status)
            logger.info("I/O worker %d: pid %d replaces lost pid %d", hello.index, hello.pid, previous.pid)
        worker = WorkerSession(index=hello.index, identity=identity, pid=hello.pid, process=PidWatch(hello.pid))
        self.workers[hello.index] = worker
        self._by_identity[identity] = hello.index
        self.send(worker, Welcome(index=hello.index), required=False)


__all__ = [
    "TURN_LOADS",
    "WATCH_INTERVAL_S",
    "IOWorkerSessions",
    "SessionEvents",
    "WorkerSession",
    "running",
]
