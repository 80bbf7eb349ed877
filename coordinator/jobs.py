"""The job front door: clients' `generate` / `health` / `stats` / `cancel` on the jobs ROUTER.

Minimal but correct: a FIFO of generate requests, one running at a time.
The running job is forwarded to the GPU worker as a `job`; each `token` is
relayed to the client that asked (its ROUTER identity) as a `token` event,
then `done` with the job's stats, or `error`. A frame that is not msgpack is
dropped (there is nothing to answer); any other bad request gets `error`
with its id, and the door keeps serving.

The door talks to the rest of the coordinator only through `JobHost`, so
queue limits, busy replies, client-disconnect handling and richer stats
are additions to this class, not a rewrite.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Protocol

from coordinator.leases import LeaseStats
from shared.gpu_messages import Job, JobCancel, JobDone, JobError, Token
from shared.job_messages import (
    CANCELLED,
    COORDINATOR_ACCEPTS_FROM_CLIENTS,
    MAX_ID_CHARS,
    UNKNOWN_JOB,
    WORKER_FAILED,
    CancelJob,
    Done,
    Generate,
    HealthReply,
    HealthRequest,
    JobFailed,
    JobStats,
    StatsReply,
    StatsRequest,
    TokenEvent,
)
from shared.protocol import BAD_FRAME, BAD_REQUEST, ProtocolError, decode, unpack_map

logger = logging.getLogger(__name__)

HOOK_VIOLATION = "test_hook_violation"  # error code of a job during which a test hook saw a violation


class JobHost(Protocol):
    """What the front door needs from the coordinator."""

    def send_client(self, identity: bytes, message: object) -> None: ...

    def send_gpu(self, message: object) -> bool: ...

    def ready(self) -> bool: ...

    def health(self, request_id: str) -> HealthReply: ...

    def begin_job(self, job_id: int) -> None: ...

    def end_job(self, job_id: int, done: JobDone | None) -> Awaitable[tuple[JobStats, str | None]]:
        """The job's stats, and a failure message when a check (e.g. a test hook) failed."""
        ...


@dataclass(slots=True)
class _Job:
    job_id: int
    identity: bytes
    request: Generate
    queued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    tokens: int = 0
    cancelled: bool = False


@dataclass(slots=True)
class _Totals:
    jobs_done: int = 0
    jobs_failed: int = 0
    last: JobStats = field(default_factory=JobStats)


def job_stats(lease: LeaseStats, done: JobDone | None, *, wrap_path: str, footprint: int, peak: int, budget: int,
              io_fallback_ops: int) -> JobStats:  # fmt: skip
    """A job's `JobStats`: the lease service's figures and the GPU worker's `job_done`.

    `footprint` is the slab's resident bytes plus the GPU worker's dense bytes."""
    prompt = done.prompt_tokens if done else 0
    generated = len(done.tokens) if done else 0
    prefill_s = done.prefill_ms / 1e3 if done else 0.0
    decode_s = done.decode_ms / 1e3 if done else 0.0
    served = lease.hits + lease.misses
    return JobStats(
        prompt_tokens=prompt, generated_tokens=generated,
        prefill_tok_s=prompt / prefill_s if prefill_s > 0 else 0.0,
        decode_tok_s=generated / decode_s if decode_s > 0 else 0.0,
        hits=lease.hits, misses=lease.misses, hit_rate=lease.hits / served if served else 0.0,
        all_resident=lease.all_resident, bytes_read=lease.bytes_read,
        disk_p50_ms=lease.disk_p50_ms, disk_p99_ms=lease.disk_p99_ms,
        wait_p50_ms=lease.wait_p50_ms, wait_p99_ms=lease.wait_p99_ms,
        evictions=lease.evictions, pressure_evictions=lease.pressure_evictions, repin_swaps=lease.repin_swaps,
        wrap_path=done.wrap_path if done else wrap_path, bytes_copied=done.bytes_copied if done else 0,
        footprint_bytes=footprint, peak_footprint_bytes=peak, budget_bytes=budget, io_fallback_ops=io_fallback_ops,
    )  # fmt: skip


def _validate(request: Generate) -> str | None:
    """Why a generate request is refused, or None."""
    if (request.prompt is None) == (request.prompt_tokens is None):
        return "give exactly one of prompt and prompt_tokens"
    if request.prompt_tokens is not None and not request.prompt_tokens:
        return "prompt_tokens is empty"
    if request.prompt is not None and not request.prompt:
        return "prompt is empty"
    if request.temperature < 0:
        return f"temperature must be >= 0, got {request.temperature}"
    if not 0 < request.top_p <= 1:
        return f"top_p must be in (0, 1], got {request.top_p}"
    if not request.id:
        return "id must not be empty"
    return None


class JobFrontDoor:
    """FIFO of generate jobs over one GPU worker."""

    def __init__(self, *, host: JobHost) -> None:
        self._host = host
        self._queue: deque[_Job] = deque()
        self._running: _Job | None = None
        self._next_id = 0
        self._totals = _Totals()
        self._finishing = False

    @property
    def running(self) -> _Job | None:
        return self._running

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
        try:
            fields = unpack_map(payload)
        except ProtocolError as error:
            if error.code == BAD_FRAME:
                logger.warning("dropped a client frame: %s", error.message)
                return
            self._host.send_client(identity, JobFailed(code=error.code, message=error.message))
            return
        raw_id = fields.get("id")
        request_id = raw_id if isinstance(raw_id, str) and len(raw_id) <= MAX_ID_CHARS else ""
        if len(frames) != 2:
            self._reply_error(identity, BAD_REQUEST, f"expected one frame per message, got {len(frames) - 1}",
                              request_id)  # fmt: skip
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
        problem = _validate(request)
        if problem is None and self._find(identity, request.id) is not None:
            problem = f"job id {request.id!r} is already queued or running"
        if problem is not None:
            self._reply_error(identity, BAD_REQUEST, problem, request.id)
            return
        self._next_id += 1
        self._queue.append(_Job(self._next_id, identity, request))
        logger.info("job %d (%r) queued; %d waiting", self._next_id, request.id, len(self._queue))
        self.poke()

    def _cancel(self, identity: bytes, request: CancelJob) -> None:
        job = self._find(identity, request.id)
        if job is None:
            self._reply_error(identity, UNKNOWN_JOB, f"no queued or running job {request.id!r}", request.id)
        elif job is self._running:
            if not job.cancelled:
                job.cancelled = True
                self._host.send_gpu(JobCancel(job_id=job.job_id))
        else:
            self._queue.remove(job)
            self._totals.jobs_failed += 1
            self._reply_error(identity, CANCELLED, f"job {request.id!r} was cancelled before it started", request.id)

    def stats(self, request_id: str) -> StatsReply:
        running = self._running.request.id if self._running is not None else None
        return StatsReply(id=request_id, jobs_done=self._totals.jobs_done, jobs_failed=self._totals.jobs_failed,
                          queued=len(self._queue), running=running, stats=self._totals.last)  # fmt: skip

    # ------------------------------------------------------------ the GPU

    def poke(self) -> None:
        """Start the next job if none runs and the system is ready."""
        if self._running is not None or self._finishing or not self._queue or not self._host.ready():
            return
        job = self._queue.popleft()
        request = job.request
        message = Job(job_id=job.job_id, prompt=request.prompt, prompt_tokens=request.prompt_tokens,
                      max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
                      seed=request.seed, return_logprobs=request.return_logprobs)  # fmt: skip
        self._running = job
        job.started_at = time.monotonic()
        self._host.begin_job(job.job_id)
        if not self._host.send_gpu(message):
            self._running = None
            self._totals.jobs_failed += 1
            self._reply_error(job.identity, WORKER_FAILED, "the GPU worker cannot be reached", request.id)
            return
        logger.info("job %d (%r) started", job.job_id, request.id)

    async def on_gpu(self, message: Token | JobDone | JobError) -> None:
        job = self._running
        if job is None or message.job_id != job.job_id:
            logger.warning("ignored %s for job %d: it is not the running job", message.OP, message.job_id)
            return
        if isinstance(message, Token):
            job.tokens += 1
            self._host.send_client(job.identity, TokenEvent(id=job.request.id, index=message.index,
                                   token=message.token, text=message.text, logprobs=message.logprobs))  # fmt: skip
        elif isinstance(message, JobDone):
            await self._finish(job, message, None)
        else:
            await self._finish(job, None, (message.code, message.message))

    async def gpu_lost(self, reason: str) -> None:
        """The GPU worker is gone: the running job fails; queued ones wait for a new worker."""
        if self._running is not None:
            await self._finish(self._running, None, (WORKER_FAILED, f"the GPU worker was lost: {reason}"))

    async def _finish(self, job: _Job, done: JobDone | None, failure: tuple[str, str] | None) -> None:
        # No longer running (late messages for it are ignored), but the next job must not
        # start while this one's stats are gathered.
        self._running, self._finishing = None, True
        try:
            stats, problem = await self._host.end_job(job.job_id, done)
        except Exception as error:  # the client still gets an answer
            logger.exception("gathering the stats of job %d failed", job.job_id)
            stats, problem = JobStats(), f"gathering the job's stats failed: {error!r}"
        finally:
            self._finishing = False
        request_id = job.request.id
        if failure is None and problem is not None:
            failure = (HOOK_VIOLATION, problem)
        if failure is None and done is not None and (done.finish_reason == "cancelled" or job.cancelled):
            failure = (CANCELLED, f"job {request_id!r} was cancelled after {len(done.tokens)} tokens")
        if failure is not None:
            self._totals.jobs_failed += 1
            logger.warning("job %d (%r) failed: %s: %s", job.job_id, request_id, *failure)
            self._reply_error(job.identity, failure[0], failure[1], request_id)
        else:
            assert done is not None
            self._totals.jobs_done += 1
            self._totals.last = stats
            logger.info("job %d (%r) done: %d tokens, %s", job.job_id, request_id, len(done.tokens), stats)
            self._host.send_client(job.identity, Done(id=request_id, tokens=done.tokens, text=done.text,
                                                      finish_reason=done.finish_reason, stats=stats))  # fmt: skip
        self.poke()

    def shutdown(self, code: str, message: str) -> None:
        """Answer every queued and running job with `error` (the coordinator is stopping)."""
        jobs = ([self._running] if self._running is not None else []) + list(self._queue)
        self._running = None
        self._queue.clear()
        for job in jobs:
            self._totals.jobs_failed += 1
            self._reply_error(job.identity, code, message, job.request.id)

    # ------------------------------------------------------------ helpers

    def _find(self, identity: bytes, request_id: str) -> _Job | None:
        jobs = ([self._running] if self._running is not None else []) + list(self._queue)
        return next((j for j in jobs if j.identity == identity and j.request.id == request_id), None)

    def _reply_error(self, identity: bytes, code: str, message: str, request_id: str = "") -> None:
        self._host.send_client(identity, JobFailed(code=code, message=message, id=request_id))

__all__ = ["HOOK_VIOLATION", "JobFrontDoor", "JobHost", "job_stats"]
