"""The job client: send generation jobs to the coordinator's front door over ZeroMQ.

    with Client("ipc:///path/to/run/jobs", timeout=30) as client:
        for event in client.generate("Hello", max_tokens=32):
            if isinstance(event, TokenEvent):
                print(event.text, end="", flush=True)
            else:  # the Done, always last
                print(event.stats.decode_tok_s)

Events are the contract's frozen dataclasses: one `TokenEvent` per token and
finally the `Done`. A failed job raises `JobFailedError` (its `code` is the
coordinator's, e.g. "cancelled", "worker_failed"); a full queue raises
`ServerBusy`; no reply within `timeout` seconds (per reply, not per job)
raises `ClientTimeout`, a `TimeoutError` naming the endpoint. A front door that
is a CURVE server (`moeslab-launch --curve`) needs `server_key`, its public key
(the ready line's `curve_public_key`); without it, or with a wrong one, the
handshake never completes and every request times out. An `ipc://` endpoint
nobody serves (no socket file, nothing listening) raises `ClientError("no
server at ...")` when the Client is made, not a timeout later.

Concurrency: every request carries an id and every reply is routed by it, so
several jobs may be in flight on one Client, iterated in any interleaving and
from several threads (one lock guards the socket and the inbox). A reply for
another id is buffered for its owner, never dropped; replies for a job that
has finished or whose stream was closed are discarded. An `error` without an
id (the coordinator could not read a request at all) is raised in whichever
waiter reads it first.
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import zmq

from shared.curve import client_curve
from shared.job_messages import (
    CANCELLED,
    CLIENT_ACCEPTS,
    COORDINATOR_ACCEPTS_FROM_CLIENTS,
    MAX_ID_CHARS,
    Busy,
    CancelJob,
    Done,
    Generate,
    HealthReply,
    HealthRequest,
    JobFailed,
    StatsReply,
    StatsRequest,
    TokenEvent,
    chat_messages,
)
from shared.protocol import MAX_MESSAGE_BYTES, ProtocolError, decode, encode
from shared.sockets import ipc_server_absent, open_socket

__all__ = [
    "BUSY",
    "Client",
    "ClientError",
    "ClientTimeout",
    "JobFailedError",
    "JobStream",
    "ReplyError",
    "ServerBusy",
    "token_logprobs",
]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 30.0
BUSY = "busy"  # the `code` of ServerBusy
# A waiter holding the socket gives it up this often so other threads can send.
_POLL_SLICE_S = 0.05
# Ids of finished jobs whose stray replies are discarded (bounded, oldest out).
_FINISHED_MEMORY = 4096


def token_logprobs(event: TokenEvent) -> np.ndarray | None:
    """The step's log-probabilities of a `return_logprobs` job (float32, vocabulary-sized)."""
    if event.logprobs is None:
        return None
    return np.frombuffer(event.logprobs, dtype="<f4")


def _check_id(value: object) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS:
        raise ValueError(f"id must be a non-empty string of at most {MAX_ID_CHARS} characters, got {value!r}")
    return value


def _token_tuple(tokens: Any) -> tuple[int, ...]:
    try:
        return tuple(operator.index(token) for token in tokens)  # numpy ints too, never floats
    except TypeError:
        raise ValueError(f"prompt_tokens must be a sequence of integers, got {tokens!r}") from None


def _checked_frame(message: Any) -> bytes:
    """Encode a request, refusing here what the coordinator would refuse or never receive."""
    try:
        frame = encode(message)
    except (TypeError, ValueError) as error:  # msgpack cannot serialize a value
        raise ValueError(f"invalid {message.OP} request: {error}") from None
    if len(frame) > MAX_MESSAGE_BYTES:
        # Over ZMQ_MAXMSGSIZE the coordinator's socket drops the connection without a reply.
        raise ValueError(f"request is {len(frame)} bytes; the coordinator accepts at most {MAX_MESSAGE_BYTES}")
    try:
        decode(frame, COORDINATOR_ACCEPTS_FROM_CLIENTS)  # the same checks the coordinator runs
    except ProtocolError as error:
        raise ValueError(f"invalid {message.OP} request: {error.message}") from None
    return frame


class ClientError(Exception):
    """Base of everything this client raises about the coordinator's answers."""


class JobFailedError(ClientError):
    """The coordinator answered `error` for a request."""

    def __init__(self, code: str, message: str, *, job_id: str = "") -> None:
        super().__init__(f"{code}: {message}" + (f" (job {job_id})" if job_id else ""))
        self.code = code
        self.message = message
        self.job_id = job_id


class ServerBusy(JobFailedError):
    """The coordinator's queue was full; nothing was queued. Retry later."""

    def __init__(self, *, job_id: str, queued: int) -> None:
        super().__init__(BUSY, f"the coordinator is busy ({queued} jobs queued)", job_id=job_id)
        self.queued = queued


class ReplyError(ClientError):
    """A reply this client cannot read or did not expect (a protocol mismatch)."""


class ClientTimeout(ClientError, TimeoutError):
    """No reply within the timeout."""


class JobStream:
    """The events of one generation job; iterate it, or call `result()`.

    Yields each `TokenEvent`, then the `Done`, then stops; raises `JobFailedError` /
    `ServerBusy` when the job fails or is refused. `ClientTimeout` leaves the
    stream usable: read on to keep waiting, or close it. `close()` (also on
    leaving a `with` block) cancels a job that has not finished and discards
    its later replies; a stream abandoned without `close()` keeps buffering.
    """

    def __init__(self, client: Client, job_id: str, timeout: float) -> None:
        self._client = client
        self.id = job_id
        self._timeout = timeout
        self.done: Done | None = None  # set once the Done has been read
        self.finished = False

    def __iter__(self) -> JobStream:
        return self

    def __next__(self) -> TokenEvent | Done:
        if self.finished:
            raise StopIteration
        reply = self._client._next_reply(self.id, self._timeout, f"job {self.id}")
        if isinstance(reply, TokenEvent):
            return reply
        self.finished = True
        self._client._finish(self.id)
        if isinstance(reply, Done):
            self.done = reply
            return reply
        if isinstance(reply, JobFailed):
            raise JobFailedError(reply.code, reply.message, job_id=self.id)
        if isinstance(reply, Busy):
            raise ServerBusy(job_id=self.id, queued=reply.queued)
        raise ReplyError(f"{self._client.endpoint} answered job {self.id} with {type(reply).__name__}")

    def result(self) -> Done:
        """Read the remaining events and return the Done."""
        for _ in self:
            pass
        assert self.done is not None  # a stream ends with a Done or raises
        return self.done

    def close(self) -> None:
        """Cancel the job if it is still running and forget its replies (idempotent)."""
        if self.finished:
            return
        self.finished = True
        self._client._abandon(self.id)

    def __enter__(self) -> JobStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Client:
    """A DEALER connection to the coordinator's job front door (a context manager).

    `server_key`: the front door's CURVE public key (40 z85 characters) when it is a CURVE server."""

    def __init__(
        self, endpoint: str, *, timeout: float = DEFAULT_TIMEOUT, server_key: str | bytes | None = None
    ) -> None:
        if not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        curve = client_curve(server_key)  # CurveError (a ValueError) names a bad key
        self.endpoint = endpoint
        self.timeout = float(timeout)
        # A CURVE server never answers a plain client: say so where the silence is reported.
        tcp_plain = curve is None and endpoint.startswith("tcp://")
        self._hint = " (a CURVE server answers only a client given its server key)" if tcp_plain else ""
        self._lock = threading.Lock()
        self._inbox: dict[str, deque[Any]] = {}
        self._streams: set[str] = set()
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._ids = itertools.count(1)
        self._prefix = secrets.token_hex(4)  # ids stay distinct across clients in logs
        self._closed = False
        absent = ipc_server_absent(endpoint)  # ZeroMQ would wait for it forever: say so now
        if absent is not None:
            raise ClientError(f"no server at {endpoint} ({absent})")
        # An own context, so closing this client never touches anyone else's sockets.
        self._context = zmq.Context()
        try:
            self._sock = open_socket(self._context, zmq.DEALER, connect=endpoint, unbounded=False, curve=curve)
        except zmq.ZMQError as error:
            self._context.term()
            raise ValueError(f"cannot connect to {endpoint!r}: {error}") from None

    # ------------------------------------------------------------ requests

    def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_tokens: list[int] | tuple[int, ...] | None = None,
        messages: Sequence[Mapping[str, str]] | None = None,
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        return_logprobs: bool = False,
        id: str | None = None,
        timeout: float | None = None,
    ) -> JobStream:
        """Send a job now and return its event stream; exactly one of prompt / prompt_tokens / messages.

        `messages` ({"role", "content"} maps) are rendered by the GPU worker with the model's chat template.
        """
        if sum(given is not None for given in (prompt, prompt_tokens, messages)) != 1:
            raise ValueError("give exactly one of prompt, prompt_tokens and messages")
        reply_timeout = self._timeout(timeout)
        job_id = self._new_id() if id is None else _check_id(id)
        tokens = None if prompt_tokens is None else _token_tuple(prompt_tokens)
        frame = _checked_frame(
            Generate(
                id=job_id,
                prompt=prompt,
                prompt_tokens=tokens,
                messages=None if messages is None else chat_messages(messages),
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=seed,
                return_logprobs=return_logprobs,
            )
        )
        with self._lock:
            if job_id in self._streams:
                raise ValueError(f"job id {job_id!r} is already in flight on this client")
            self._finished.pop(job_id, None)  # a reused id's replies are wanted again
            self._streams.add(job_id)
        try:
            self._send(frame)
        except BaseException:
            with self._lock:
                self._streams.discard(job_id)
            raise
        return JobStream(self, job_id, reply_timeout)

    def cancel(self, id: str, *, timeout: float | None = None) -> None:
        """Cancel job `id`.

        For a job streaming on this client, returns at once: its stream then
        ends with JobFailedError(code="cancelled"), or with its Done if it finished
        first. For any other id, waits for the answer and raises JobFailedError
        (e.g. code "unknown_job") unless the coordinator confirms "cancelled".
        """
        job_id = _check_id(id)
        frame = _checked_frame(CancelJob(id=job_id))
        reply_timeout = self._timeout(timeout)
        with self._lock:
            streaming = job_id in self._streams
            if not streaming:
                self._finished.pop(job_id, None)  # e.g. a job this client saw finish: its answer is wanted
        self._send(frame)
        if streaming:
            return
        try:
            reply = self._next_reply(job_id, reply_timeout, f"cancel of {job_id}")
        finally:
            self._finish(job_id)  # an answer arriving after a timeout is discarded
        if isinstance(reply, JobFailed) and reply.code == CANCELLED:
            return
        if isinstance(reply, JobFailed):
            raise JobFailedError(reply.code, reply.message, job_id=job_id)
        raise ReplyError(f"{self.endpoint} answered cancel {job_id} with {type(reply).__name__}")

    def stats(self, *, timeout: float | None = None) -> StatsReply:
        """The coordinator's cumulative statistics."""
        return self._ask(StatsRequest, StatsReply, timeout)

    def health(self, *, timeout: float | None = None) -> HealthReply:
        """Whether the coordinator and its workers are up and accepting jobs."""
        return self._ask(HealthRequest, HealthReply, timeout)

    def _ask(self, request: type, expected: type, timeout: float | None) -> Any:
        request_id, reply_timeout = self._new_id(), self._timeout(timeout)
        self._send(_checked_frame(request(id=request_id)))
        try:
            reply = self._next_reply(request_id, reply_timeout, f"{request.OP} request")
        finally:
            self._finish(request_id)  # an answer arriving after a timeout is discarded
        if isinstance(reply, expected):
            return reply
        if isinstance(reply, JobFailed):
            raise JobFailedError(reply.code, reply.message, job_id=request_id)
        raise ReplyError(f"{self.endpoint} answered {request.OP} with {type(reply).__name__}")

    # ------------------------------------------------------------- plumbing

    def _new_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def _timeout(self, timeout: float | None) -> float:
        if timeout is None:
            return self.timeout
        if not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        return float(timeout)

    def _check_open(self) -> None:
        if self._closed:
            raise ClientError(f"the client of {self.endpoint} is closed")

    def _send(self, frame: bytes) -> None:
        with self._lock:
            self._check_open()
            try:
                self._sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                raise ClientError(f"cannot send to {self.endpoint}: its send queue is full") from None

    def _next_reply(self, request_id: str, timeout: float, what: str) -> Any:
        """The next reply for `request_id`, reading (and routing) the socket until it comes."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                self._check_open()
                for key in (request_id, ""):
                    queue = self._inbox.get(key)
                    if queue:
                        reply = queue.popleft()
                        if not queue:
                            del self._inbox[key]
                        return reply
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ClientTimeout(
                        f"no reply from {self.endpoint} within {timeout:g} s (waiting for {what}){self._hint}"
                    )
                # Bounded slices: the lock is released between them for other threads.
                if self._sock.poll(max(1, math.ceil(min(remaining, _POLL_SLICE_S) * 1000)), zmq.POLLIN):
                    self._route(self._sock.recv_multipart(zmq.NOBLOCK))

    def _route(self, frames: list[bytes]) -> None:
        """Decode one reply and put it in its id's inbox (lock held)."""
        payload = frames[-1]  # tolerate a REQ-style empty delimiter before the message
        try:
            reply = decode(payload, CLIENT_ACCEPTS)
        except ProtocolError as error:
            raise ReplyError(f"{self.endpoint} sent a reply this client cannot read: {error.message}") from None
        reply_id = reply.id
        if reply_id in self._finished:
            logger.debug("discarding %s for finished job %s", type(reply).__name__, reply_id)
            return
        self._inbox.setdefault(reply_id, deque()).append(reply)

    def _finish(self, job_id: str) -> None:
        """A stream read its last reply: later ones for the id (a late cancel answer) are discarded."""
        with self._lock:
            self._streams.discard(job_id)
            self._finished[job_id] = None
            while len(self._finished) > _FINISHED_MEMORY:
                self._finished.popitem(last=False)

    def _abandon(self, job_id: str) -> None:
        self._finish(job_id)
        with self._lock:
            self._inbox.pop(job_id, None)
            if self._closed:
                return
        try:
            self._send(_checked_frame(CancelJob(id=job_id)))
        except ClientError as error:
            logger.warning("could not cancel abandoned job %s: %s", job_id, error)

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close the socket, then the context (idempotent); pending streams fail."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._sock.close(linger=0)
            self._context.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._streams)} jobs in flight"
        return f"Client({self.endpoint!r}, {state})"
