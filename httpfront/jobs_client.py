"""The HTTP front's client of the job front door: one DEALER socket, replies routed by request id.

    client = JobsClient(endpoint, server_key=None)   # in the running loop
    job = client.generate(Generate(id=client.new_id(), prompt="Hello", max_tokens=16))
    reply = await job.next()        # TokenEvent..., then Done, JobFailed or Busy
    await job.cancel()              # the door's `cancel`; later replies are dropped
    health = await client.ask(HealthRequest, timeout=5.0)

One reader task receives every reply and puts it on the queue of the request id it names (each HTTP
request has its own); a reply for an id nobody waits for any more (a job cancelled here, a health
answer after its timeout) is dropped. The front is one client of the door, so the door's per-client
queue share (`--max-queued-per-client`) bounds all HTTP requests together. Every request is checked
with the door's own decoder before it is sent, so a refusal is reported here with the field named.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets

import zmq
import zmq.asyncio

from shared.curve import client_curve
from shared.job_messages import (
    CLIENT_ACCEPTS,
    COORDINATOR_ACCEPTS_FROM_CLIENTS,
    Busy,
    CancelJob,
    Done,
    Generate,
    JobFailed,
    TokenEvent,
)
from shared.protocol import MAX_MESSAGE_BYTES, ProtocolError, decode, encode
from shared.sockets import open_socket

logger = logging.getLogger("httpfront.jobs")

Reply = TokenEvent | Done | JobFailed | Busy


class DoorUnreachable(ConnectionError):
    """The job front door cannot be sent to, or did not answer in time."""


class JobHandle:
    """One generation job's replies, in order; `cancel()` stops it at the door."""

    def __init__(self, client: JobsClient, job_id: str, queue: asyncio.Queue) -> None:
        self._client, self.id, self._queue = client, job_id, queue
        self.finished = False  # its last reply was read, or it was cancelled

    async def next(self) -> Reply:
        """The job's next reply (a TokenEvent, or its last: Done, JobFailed or Busy)."""
        reply = await self._queue.get()
        if not isinstance(reply, TokenEvent):
            self.finished = True
            self._client.forget(self.id)
        return reply

    async def cancel(self) -> None:
        """Ask the door to stop the job unless it has finished; its later replies are dropped (idempotent)."""
        if self.finished:
            return
        self.finished = True
        self._client.forget(self.id)
        self._client.send(CancelJob(id=self.id), quiet=True)


class JobsClient:
    """A DEALER connection to the job front door, shared by every HTTP request (asyncio)."""

    def __init__(self, endpoint: str, *, server_key: str | None = None) -> None:
        self.endpoint = endpoint
        self._context = zmq.asyncio.Context()
        # The front is one of the system's own processes: unbounded queues, nothing dropped unseen.
        self._sock = open_socket(self._context, zmq.DEALER, connect=endpoint, curve=client_curve(server_key))
        self._waiting: dict[str, asyncio.Queue] = {}
        self._jobs: set[str] = set()  # generate ids still open at the door
        self._prefix = f"http-{secrets.token_hex(3)}"
        self._ids = itertools.count(1)
        self._reader = asyncio.get_running_loop().create_task(self._read(), name="jobs-reader")

    def new_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    @property
    def open_jobs(self) -> int:
        return len(self._jobs)

    def generate(self, request: Generate) -> JobHandle:
        """Send a generate; its replies arrive on the handle. ValueError names a field the door would refuse."""
        queue: asyncio.Queue = asyncio.Queue()
        self._waiting[request.id] = queue
        try:
            self.send(request)
        except BaseException:
            self._waiting.pop(request.id, None)
            raise
        self._jobs.add(request.id)
        return JobHandle(self, request.id, queue)

    async def ask(self, request_type: type, *, timeout: float) -> object:
        """A `stats` or `health` request and its reply; DoorUnreachable without one within `timeout` s."""
        request_id = self.new_id()
        queue: asyncio.Queue = asyncio.Queue()
        self._waiting[request_id] = queue
        try:
            self.send(request_type(id=request_id))
            async with asyncio.timeout(timeout):
                return await queue.get()
        except TimeoutError:
            raise DoorUnreachable(f"no {request_type.OP} reply from {self.endpoint} within {timeout:g} s") from None
        finally:
            self._waiting.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)
        self._jobs.discard(request_id)

    def send(self, message: object, *, quiet: bool = False) -> None:
        """Encode, check as the door would, send without blocking. ValueError for a refusal (never sent);
        DoorUnreachable when the socket takes nothing (no door connected). `quiet`: log, do not raise."""
        try:
            frame = encode(message)
            if len(frame) > MAX_MESSAGE_BYTES:  # over the door's ZMQ_MAXMSGSIZE: dropped unanswered
                raise ValueError(f"the request is {len(frame)} bytes; the door accepts at most {MAX_MESSAGE_BYTES}")
            decode(frame, COORDINATOR_ACCEPTS_FROM_CLIENTS)
        except ProtocolError as error:
            raise ValueError(error.message) from None
        try:
            sent = self._sock.send(frame, zmq.NOBLOCK)
            error = sent.exception() if sent.done() else None  # zmq.asyncio reports on the future
            if error is not None:
                raise error
        except zmq.Again:
            if quiet:
                logger.warning("could not send %s to %s: no connection", getattr(message, "OP", "?"), self.endpoint)
                return
            raise DoorUnreachable(f"the job front door at {self.endpoint} is not connected") from None

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                reply = decode(frames[-1], CLIENT_ACCEPTS)
            except ProtocolError as error:
                logger.warning("dropped a reply this front cannot read: %s", error.message)
                continue
            queue = self._waiting.get(reply.id)
            if queue is not None:
                queue.put_nowait(reply)
            elif not reply.id:
                logger.warning("the door could not read a request: %s", reply)
            else:
                logger.debug("dropped %s for %s: nobody waits for it", reply.OP, reply.id)

    async def aclose(self) -> None:
        """Cancel every job still open at the door (its HTTP client is gone with this process), then close."""
        for job_id in sorted(self._jobs):
            logger.info("cancelling job %s: the front is stopping", job_id)
            self.send(CancelJob(id=job_id), quiet=True)
        self._jobs.clear()
        self._waiting.clear()
        self._reader.cancel()
        try:
            await self._reader
        except asyncio.CancelledError:
            pass
        self._sock.close(linger=200)  # long enough for the cancels to leave
        self._context.term()


__all__ = ["DoorUnreachable", "JobHandle", "JobsClient", "Reply"]
