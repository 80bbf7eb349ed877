"""The job front door: clients' `generate` / `cancel` / `stats` / `health` on the jobs ROUTER.

A FIFO of generate requests, up to `max_running` running at once (the GPU
worker decodes them together: `--max-sequences`). A job that starts is
forwarded to the GPU worker as a `job`; each `token` is relayed to the client
that asked (its ROUTER identity), then `done` with the job's stats, or
`error`. The safe point between jobs runs when no job is running. A generate
that would make the queue longer than `queue_limit` is answered `busy` at
once and nothing is queued.

Bad input never stops the door and never half-changes it: a frame that is
not msgpack is dropped (there is nothing to answer); a frame over
`MAX_REQUEST_BYTES` gets `error` code `message_too_large` unread; every other
refusal (not a map, unknown op, wrong type, out-of-range value, both or
neither prompt, a request over a limit of `coordinator.job_limits` (tokens,
the client's share of the queue), a token outside the vocabulary, a duplicate
id) gets `error` with the request's id when one could be read, before
anything is queued.

Client liveness: the jobs socket is a ROUTER with ROUTER_MANDATORY and no
send high-water mark, so a send can only fail because the peer identity is
gone (EHOSTUNREACH). The rule is: the first failed send to an identity means
that client has disconnected; its running job is cancelled (the GPU worker
stops at its next token), its queued jobs are dropped, and nothing more is
sent to it. A client that vanishes while its job waits in the queue is
noticed when the job's first token cannot be delivered, so it costs at most
one forward pass, never a stalled queue.

The door talks to the rest of the coordinator only through `JobHost`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, field, replace
from typing import Protocol

from coordinator.job_limits import DEFAULT_QUEUE_LIMIT, FrontDoorLimits, validate
from shared.gpu_messages import Job, JobCancel, JobDone, JobError, Token
from shared.job_messages import (
    CANCELLED,
    CLIENT_QUEUE_FULL,
    COORDINATOR_ACCEPTS_FROM_CLIENTS,
    DUPLICATE_ID,
    MAX_ID_CHARS,
    TOO_LARGE,
    UNKNOWN_JOB,
    WORKER_FAILED,
    Busy,
    CancelJob,
    Done,
    Generate,
    HealthReply,
    HealthRequest,
    JobFailed,
    JobStats,
    ProcessInfo,
    StatsReply,
    StatsRequest,
    TokenEvent,
)
from shared.protocol import BAD_FRAME, BAD_REQUEST, ProtocolError, decode, unpack_map

logger = logging.getLogger(__name__)

HOOK_VIOLATION = "test_hook_violation"  # error code of a job during which a test hook saw a violation
DEFAULT_LIMITS = FrontDoorLimits()


class JobHost(Protocol):
    """What the front door needs from the coordinator."""

    def send_client(self, identity: bytes, message: object) -> bool:
        """False when the client cannot be reached (it disconnected)."""
        ...

    def send_gpu(self, message: object) -> bool: ...

    def ready(self) -> bool: ...

    def health(self, request_id: str) -> HealthReply: ...

    def begin_job(self, job_id: int) -> None: ...

    def job_predicts(self) -> bool:
        """Whether the next job's decode steps are to predict experts for prefetch."""
        ...

    def end_job(self, job_id: int, done: JobDone | None, relayed: int) -> Awaitable[tuple[JobStats, str | None]]:
        """The job's stats, and a failure message when a check (e.g. a test hook) failed."""
        ...

    def between_jobs(self) -> Awaitable[None]:
        """The safe point after a job's answer was sent and before the next job starts."""
        ...

    def cumulative_stats(self) -> JobStats: ...

    def processes(self) -> tuple[ProcessInfo, ...]:
        """Who serves now (the supervisor's process table)."""
        return ()


@dataclass(slots=True)
class _Job:
    job_id: int
    identity: bytes
    request: Generate
    queued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    relayed: int = 0  # tokens delivered to the client
    cancelled: bool = False  # a job_cancel was sent to the GPU worker
    failure: tuple[str, str] | None = None  # why the coordinator failed it (e.g. memory pressure)
    client_gone: bool = False
    shared_with: int = 1  # the most jobs running at once while it ran (itself included)


class JobFrontDoor:
    """FIFO of generate jobs over one GPU worker."""

    def __init__(self, *, host: JobHost, limits: FrontDoorLimits = DEFAULT_LIMITS, max_running: int = 1) -> None:
        self._host = host
        self._limits = limits
        self._max_running = max_running
        self._queue: deque[_Job] = deque()
        self._running: dict[int, _Job] = {}  # by job id, in the order they started
        self._next_id = 0
        self._done = 0
        self._failed = 0
        self._finishing = 0  # jobs whose stats are being gathered: none starts meanwhile

    @property
    def running(self) -> _Job | None:
        """The oldest running job, if any."""
        return next(iter(self._running.values()), None)

    @property
    def active(self) -> tuple[_Job, ...]:
        """Every running job, oldest first."""
        return tuple(self._running.values())

    @property
    def queued(self) -> int:
        return len(self._queue)

    # ------------------------------------------------------------ clients

    async def handle_client(self, frames: list[bytes]) -> None:
        """One ROUTER message: [identity, payload]."""
        if len(frames) < 2:
            logger.warning("dropped a client message of %d frame(s)", len(frames))
            return
        identity, payload = frames[0], frames[1]
        size = sum(len(frame) for frame in frames[1:])
        if size > self._limits.max_request_bytes:
            self._reply_error(
                identity,
                TOO_LARGE,
                f"request of {size} bytes refused unread; at most {self._limits.max_request_bytes} bytes are accepted",
            )
            return
        try:
            fields = unpack_map(payload)
        except ProtocolError as error:
            if error.code == BAD_FRAME:
                logger.warning("dropped a client frame: %s", error.message)
                return
            self._reply_error(identity, error.code, error.message)
            return
        raw_id = fields.get("id")
        request_id = raw_id if isinstance(raw_id, str) and len(raw_id) <= MAX_ID_CHARS else ""
        if len(frames) != 2:
            self._reply_error(
                identity, BAD_REQUEST, f"expected one frame per message, got {len(frames) - 1}", request_id
            )
            return
        try:
            request = decode(payload, COORDINATOR_ACCEPTS_FROM_CLIENTS)
        except ProtocolError as error:
            self._reply_error(identity, error.code, error.message, request_id)
            return
        if isinstance(request, Generate):
            self._generate(identity, request)
        elif isinstance(request, HealthRequest):
            self._host.send_client(identity, self._host.health(request.id))
        elif isinstance(request, StatsRequest):
            self._host.send_client(identity, self.stats(request.id))
        elif isinstance(request, CancelJob):
            self._cancel(identity, request)

    def _generate(self, identity: bytes, request: Generate) -> None:
        refusal = validate(request, self._limits)
        if refusal is None and self._find(identity, request.id) is not None:
            refusal = DUPLICATE_ID, f"job id {request.id!r} is already queued or running for this client"
        if refusal is not None:
            self._reply_error(identity, *refusal, request.id)
            return
        if len(self._queue) >= self._limits.queue_limit:
            logger.info("busy: refused %r with %d jobs queued", request.id, len(self._queue))
            self._send(identity, Busy(id=request.id, queued=len(self._queue)))
            return
        share, held = self._limits.per_client, sum(job.identity == identity for job in self._queue)
        if held >= share:  # one client must not fill the queue others wait in
            message = f"this client has {held} jobs queued; the limit is {share} per client (--max-queued-per-client)"
            self._reply_error(identity, CLIENT_QUEUE_FULL, message, request.id)
            return
        self._next_id += 1
        self._queue.append(_Job(self._next_id, identity, request))
        logger.info("job %d (%r) queued; %d waiting", self._next_id, request.id, len(self._queue))
        self.poke()

    def _cancel(self, identity: bytes, request: CancelJob) -> None:
        job = self._find(identity, request.id)
        if job is None:
            self._reply_error(identity, UNKNOWN_JOB, f"no queued or running job {request.id!r}", request.id)
        elif job.job_id in self._running:
            self._stop_running(job)  # its `error` (cancelled) follows when the GPU worker stops
        else:
            self._queue.remove(job)
            self._failed += 1
            self._reply_error(identity, CANCELLED, f"job {request.id!r} was cancelled before it started", request.id)

    def stats(self, request_id: str) -> StatsReply:
        oldest = self.running
        return StatsReply(
            id=request_id,
            jobs_done=self._done,
            jobs_failed=self._failed,
            queued=len(self._queue),
            running=oldest.request.id if oldest is not None else None,
            stats=replace(self._host.cumulative_stats(), active_sequences=len(self._running)),
            processes=self._host.processes(),
        )

    # ------------------------------------------------------------ the GPU

    def poke(self) -> None:
        """Start queued jobs while fewer than `max_running` run and the system is ready."""
        while len(self._running) < self._max_running and not self._finishing and self._queue and self._host.ready():
            if not self._start(self._queue.popleft()):
                break

    def _start(self, job: _Job) -> bool:
        """Send `job` to the GPU worker; False when it could not be sent (it is back in the queue)."""
        request = job.request
        message = Job(
            job_id=job.job_id,
            prompt=request.prompt,
            prompt_tokens=request.prompt_tokens,
            messages=request.messages,
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            return_logprobs=request.return_logprobs,
            predict=self._host.job_predicts(),
            max_prompt_tokens=self._limits.flag_prompt_limit(),
            fit_context=self._limits.context_tokens is not None,
        )
        self._running[job.job_id] = job
        for running in self._running.values():
            running.shared_with = max(running.shared_with, len(self._running))
        job.started_at = time.monotonic()
        self._host.begin_job(job.job_id)
        if not self._host.send_gpu(message):
            # The worker is gone and its loss not yet handled (the pid watch takes a moment): the
            # job never started, so it waits at the head of the queue for the next worker. Failing
            # it instead, then starting the next, drained the whole queue into failures.
            del self._running[job.job_id]
            job.started_at = None
            self._queue.appendleft(job)
            logger.warning("job %d (%r) not sent: the GPU worker cannot be reached; it waits", job.job_id, request.id)
            return False
        logger.info("job %d (%r) started", job.job_id, request.id)
        return True

    def fail_running(self, code: str, message: str) -> None:
        """Fail the youngest running job (e.g. memory pressure: its KV cache is the newest growth);
        the GPU worker is told to stop it, the client gets `error`."""
        job = next((job for job in reversed(self._running.values()) if job.failure is None), None)
        if job is None:
            return
        logger.error("failing job %d (%r): %s: %s", job.job_id, job.request.id, code, message)
        job.failure = (code, message)
        self._stop_running(job)

    async def on_gpu(self, message: Token | JobDone | JobError) -> None:
        job = self._running.get(message.job_id)
        if job is None:
            logger.warning("ignored %s for job %d: it is not a running job", message.OP, message.job_id)
            return
        if isinstance(message, Token):
            if job.client_gone or job.failure is not None:
                return  # the job is being stopped; nobody should see more of it
            event = TokenEvent(
                id=job.request.id,
                index=message.index,
                token=message.token,
                text=message.text,
                logprobs=message.logprobs,
                prompt_tokens=message.prompt_tokens,
            )
            if self._send(job.identity, event):
                job.relayed += 1
        elif isinstance(message, JobDone):
            await self._finish(job, message, None)
        else:
            await self._finish(job, None, (message.code, message.message))

    async def gpu_lost(self, reason: str, *, code: str = WORKER_FAILED) -> None:
        """The GPU worker is gone (`code` says how): the running jobs fail; queued ones wait for a new worker."""
        for job in list(self._running.values()):
            await self._finish(job, None, (code, f"the GPU worker was lost: {reason}"))

    async def _finish(self, job: _Job, done: JobDone | None, failure: tuple[str, str] | None) -> None:
        # No longer running (late messages for it are ignored), but no job may start while
        # this one's stats are gathered and (when it was the last) the safe point between jobs runs.
        self._running.pop(job.job_id, None)
        self._finishing += 1
        try:
            try:
                stats, problem = await self._host.end_job(job.job_id, done, job.relayed)
            except Exception as error:  # the client still gets an answer
                logger.exception("gathering the stats of job %d failed", job.job_id)
                stats, problem = JobStats(), f"gathering the job's stats failed: {error!r}"
            self._answer(job, done, job.failure or failure, problem, replace(stats, active_sequences=job.shared_with))
            if not self._running:
                try:
                    await self._host.between_jobs()
                except Exception:  # policy upkeep must never stop the queue
                    logger.exception("the safe point after job %d failed", job.job_id)
        finally:
            self._finishing -= 1
        self.poke()

    def _answer(
        self, job: _Job, done: JobDone | None, failure: tuple[str, str] | None, problem: str | None, stats: JobStats
    ) -> None:
        request_id = job.request.id
        if failure is None and problem is not None:
            failure = (HOOK_VIOLATION, problem)
        if failure is None and done is not None and (done.finish_reason == "cancelled" or job.cancelled):
            failure = (CANCELLED, f"job {request_id!r} was cancelled after {len(done.tokens)} tokens")
        if failure is not None or job.client_gone:
            self._failed += 1
        else:
            self._done += 1
        if job.client_gone:
            logger.info(
                "job %d (%r) ended after its client disconnected: %d tokens delivered",
                job.job_id,
                request_id,
                job.relayed,
            )
        elif failure is not None:
            logger.warning("job %d (%r) failed: %s: %s", job.job_id, request_id, *failure)
            self._reply_error(job.identity, failure[0], failure[1], request_id)
        else:
            assert done is not None
            logger.info("job %d (%r) done: %d tokens, %s", job.job_id, request_id, len(done.tokens), stats)
            self._send(
                job.identity,
                Done(id=request_id, tokens=done.tokens, text=done.text, finish_reason=done.finish_reason, stats=stats),
            )

    def shutdown(self, code: str, message: str) -> None:
        """Answer every queued and running job with `error` (the coordinator is stopping)."""
        jobs = list(self._running.values()) + list(self._queue)
        self._running.clear()
        self._queue.clear()
        for job in jobs:
            self._failed += 1
            if not job.client_gone:
                self._host.send_client(job.identity, JobFailed(code=code, message=message, id=job.request.id))

    # ------------------------------------------------------------ helpers

    def _stop_running(self, job: _Job) -> None:
        if not job.cancelled:
            job.cancelled = True
            self._host.send_gpu(JobCancel(job_id=job.job_id))

    def _find(self, identity: bytes, request_id: str) -> _Job | None:
        jobs = list(self._running.values()) + list(self._queue)
        return next(
            (j for j in jobs if j.identity == identity and j.request.id == request_id and not j.client_gone), None
        )

    def _send(self, identity: bytes, message: object) -> bool:
        if self._host.send_client(identity, message):
            return True
        self._client_gone(identity)
        return False

    def _client_gone(self, identity: bytes) -> None:
        """A send to `identity` failed: that client disconnected. Stop its work; never wait for it."""
        for job in self._running.values():
            if job.identity == identity and not job.client_gone:
                job.client_gone = True
                self._stop_running(job)
                logger.warning("the client of job %d (%r) disconnected; cancelling it", job.job_id, job.request.id)
        dropped = [queued for queued in self._queue if queued.identity == identity]
        for queued in dropped:
            self._queue.remove(queued)
        if dropped:
            self._failed += len(dropped)
            logger.warning(
                "dropped %d queued job(s) of a disconnected client: %s",
                len(dropped),
                [queued.request.id for queued in dropped],
            )

    def _reply_error(self, identity: bytes, code: str, message: str, request_id: str = "") -> None:
        self._send(identity, JobFailed(code=code, message=message, id=request_id))


__all__ = ["DEFAULT_QUEUE_LIMIT", "HOOK_VIOLATION", "FrontDoorLimits", "JobFrontDoor", "JobHost", "validate"]
