"""A plain ZeroMQ socket served from an asyncio loop: each message handed on as the loop sees it.

Why not `zmq.asyncio`: its sockets make futures for every receive and send,
and wake a task per message. Echoing a 200-byte message over ipc here cost a
server 85 us of CPU with `zmq.asyncio` and 31 us with this (median round trip
145 against 100 us); the coordinator handles tens of messages a decode token
(a lease round trip is two receives and two sends), on cores the decode computes on.

ZeroMQ's descriptor (`ZMQ_FD`) is edge-triggered: it signals that the socket's
state may have changed, `ZMQ_EVENTS` says what it is, and any send or receive
may consume the signal of a message that arrived meanwhile. So the reader
drains until `ZMQ_EVENTS` says no message is left, and every send ends by
looking again (and scheduling a drain when one waits).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence

import zmq
import zmq.asyncio

logger = logging.getLogger(__name__)

DRAIN_BATCH = 256  # messages a drain hands on before the loop's other callbacks get a turn


def plain_context(context: zmq.Context) -> zmq.Context:
    """A plain context on `context`'s libzmq context (a `zmq.asyncio` one too), for plain sockets; it
    is terminated with `context`, never on its own."""
    return zmq.Context.shadow(context.underlying)


class LoopSocket:
    """`sock` served from an asyncio loop between `start()` and `close()`: each message received goes,
    in order, to `on_frames(frames)` (which owns its errors; one it raises is logged), or, without
    one, to an inbox `await recv_multipart()` takes from."""

    def __init__(self, sock: zmq.Socket, on_frames: Callable[[list[bytes]], None] | None = None) -> None:
        if isinstance(sock, zmq.asyncio.Socket):
            raise TypeError("LoopSocket serves a plain zmq.Socket, not a zmq.asyncio one")
        self.sock = sock
        self._on_frames = on_frames if on_frames is not None else self._inbox_put
        self._fd: int = sock.getsockopt(zmq.FD)
        self._loop: asyncio.AbstractEventLoop | None = None  # set while serving
        self._scheduled = False  # a drain is queued on the loop
        self._inbox: deque[list[bytes]] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def start(self) -> None:
        """Watch the descriptor from the running loop and drain what is already queued."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._fd, self._drain)
            self._schedule()

    async def recv_multipart(self) -> list[bytes]:
        """The next message of the inbox (a socket made without `on_frames`), waiting for one."""
        while not self._inbox:
            if self._loop is None:
                raise RuntimeError("the socket is not being served: start() it first")
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._inbox.popleft()

    def send_multipart(self, frames: Sequence[bytes], flags: int = zmq.DONTWAIT) -> None:
        """Send at once (never blocks by default); zmq.ZMQError as libzmq raises it (zmq.Again: the
        peer's queue is full, EHOSTUNREACH: a ROUTER's peer is gone)."""
        try:
            self.sock.send_multipart(frames, flags)
        finally:
            self._look()

    def close(self) -> None:
        """Stop watching and close the socket (linger 0); idempotent."""
        if self._loop is not None:
            if not self._loop.is_closed():
                self._loop.remove_reader(self._fd)
            self._loop = None
        if not self.sock.closed:
            self.sock.close(linger=0)

    def _inbox_put(self, frames: list[bytes]) -> None:
        self._inbox.append(frames)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _look(self) -> None:
        # A send (or a receive) may have taken the descriptor's signal of a message that arrived.
        if self._loop is not None and not self._scheduled and self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._schedule()

    def _schedule(self) -> None:
        assert self._loop is not None
        self._scheduled = True
        self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._scheduled = False
        for _ in range(DRAIN_BATCH):
            if self._loop is None or not self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as error:
                logger.error("receive failed: %s", error)
                return
            try:
                self._on_frames(frames)
            except Exception:  # the owner's bug must not stop the socket: the next messages still come
                logger.exception("a received message's handler failed")
        self._look()  # more than a batch waits: the rest after the loop's other callbacks


__all__ = ["DRAIN_BATCH", "LoopSocket", "plain_context"]
