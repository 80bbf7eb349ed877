"""The GPU worker's DEALER socket to the coordinator, and what arrives out of turn.

The worker is synchronous: it waits for one reply at a time (a `lease`,
`fenced` or `error`, `wait_reply`). Whatever else arrives meanwhile is dealt
with here: a `job_cancel` is remembered (`cancel_requested`, polled between
tokens), a `job` is queued (`backlog`, taken one at a time or into the batch), a frame that
does not decode gets an `error` reply. The parent's death ends any wait
(`ParentGone`); a stop request (SIGTERM) ends it after a grace period.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import zmq

from gpuworker.expert_provider import ExpertProviderError
from shared.gpu_messages import GPU_WORKER_ACCEPTS, GpuWelcome, Job, JobCancel
from shared.process import ProcessLife
from shared.protocol import BAD_FRAME, BAD_REQUEST, ErrorReply, ProtocolError, decode, encode, error_frame

__all__ = ["Channel", "LeaseError", "ParentGone", "WorkerStopping"]

logger = logging.getLogger(__name__)


class LeaseError(ExpertProviderError):
    """The coordinator refused, did not answer, or answered with a lease that does not fit."""


class WorkerStopping(RuntimeError):
    """SIGTERM/SIGINT: the current job is abandoned at the next safe place."""


class ParentGone(RuntimeError):
    """The supervisor died (death pipe closed or re-parented): nobody is left to answer."""


class Channel:
    """The DEALER socket to the coordinator, with its out-of-turn messages.

    Replies the worker waits for (`lease`, `fenced`, `error`) are handed to
    `wait_reply`; a `job_cancel` is remembered (`cancel_requested`), a `job`
    queued (`backlog`), a frame that does not decode is answered with `error`.
    """

    def __init__(self, sock: zmq.Socket, *, life: ProcessLife, stop_grace_s: float = 5.0) -> None:
        self.sock = sock
        self.life = life
        self.stop_grace_s = stop_grace_s
        self.backlog: deque[Job] = deque()
        self.running: set[int] = set()  # jobs started here and not finished (several when batched)
        self.bad_frames = 0
        self._cancelled: set[int] = set()
        self._inbox: deque[object] = deque()
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        life.register(self._poller)

    # -- sending ----------------------------------------------------------------------------------

    def send(self, message: object) -> None:
        self.send_frame(encode(message))  # type: ignore[arg-type]

    def send_frame(self, frame: bytes) -> None:
        try:
            self.sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("message dropped: the coordinator's queue is full")

    def refuse(self, code: str, message: str) -> None:
        self.bad_frames += 1
        logger.warning("refused message: %s", message)
        self.send_frame(error_frame(code, message))

    # -- receiving --------------------------------------------------------------------------------

    def stop_requested(self) -> bool:
        return self.life.stop_requested

    def _pump(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for frames; decode what came into the inbox."""
        events = dict(self._poller.poll(max(0.0, timeout_s) * 1000))
        if self.life.parent_gone(events):
            raise ParentGone("the parent process is gone")
        self.life.drain(events)
        if self.sock not in events:
            return
        for _ in range(1024):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._accept(frames)

    def _accept(self, frames: list[bytes]) -> None:
        if len(frames) != 1:
            self.refuse(BAD_FRAME, f"expected one frame per message, got {len(frames)}")
            return
        try:
            message = decode(frames[0], GPU_WORKER_ACCEPTS)
        except ProtocolError as error:
            self.refuse(error.code, error.message)
            return
        if isinstance(message, JobCancel):
            if message.job_id in self.running or any(job.job_id == message.job_id for job in self.backlog):
                self._cancelled.add(message.job_id)
            else:
                logger.info("job_cancel for job %d, which is not running here: ignored", message.job_id)
        elif isinstance(message, Job):
            self.backlog.append(message)
        elif isinstance(message, GpuWelcome):
            self.refuse(BAD_REQUEST, "unexpected gpu_welcome after the handshake")
        else:  # lease, fenced, error: replies, for whoever waits
            self._inbox.append(message)

    def next_reply(self, timeout_s: float) -> object | None:
        """The next lease/fenced/error, or None after `timeout_s`."""
        if not self._inbox:
            self._pump(timeout_s)
        return self._inbox.popleft() if self._inbox else None

    def wait_reply(self, what: str, *, timeout_s: float) -> object:
        """Block for the reply to `what`; LeaseError on `error` or timeout.

        A stop request does not abandon the wait at once: the reply names a
        lease that must be fenced before exiting; after `stop_grace_s` it does.
        """
        deadline = time.monotonic() + timeout_s
        stopped_at: float | None = None
        while True:
            now = time.monotonic()
            if stopped_at is None and self.stop_requested():
                stopped_at = now
            if stopped_at is not None and now - stopped_at > self.stop_grace_s:
                raise WorkerStopping(f"stopped while waiting for the reply to {what}")
            if now >= deadline:
                raise LeaseError(f"no reply to {what} within {timeout_s:g} s")
            reply = self.next_reply(min(deadline - now, 0.5))
            if reply is None:
                continue
            if isinstance(reply, ErrorReply):
                raise LeaseError(f"the coordinator refused {what}: {reply.code}: {reply.message}")
            return reply

    def idle_messages(self, timeout_s: float) -> list[object]:
        """Between jobs: pump once and return stray replies (to be refused by the caller)."""
        self._pump(timeout_s)
        stray = list(self._inbox)
        self._inbox.clear()
        return stray

    def cancel_requested(self, job_id: int) -> bool:
        """Non-blocking: has the coordinator cancelled `job_id`?"""
        self._pump(0.0)
        return job_id in self._cancelled

    def job_finished(self, job_id: int) -> None:
        self._cancelled.discard(job_id)
        self.running.discard(job_id)
