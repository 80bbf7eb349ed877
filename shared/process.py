"""The skeleton every child process stands on: stop signals, a wake pipe, the parent's death, the handshake.

The supervisor starts each child (coordinator, I/O worker, GPU worker) with
`--death-fd N`: the read end of a pipe only the supervisor holds the write
end of. End of file on it, or being re-parented, means the supervisor is gone
and the child must exit (nobody is left to clean up after it otherwise).
SIGTERM/SIGINT ask for a clean stop; the handler only records the signal and
writes a byte to a wake pipe, so a loop blocked in `poll` wakes at once and
does the stopping itself, outside signal context.

    with ProcessLife(death_fd=config.death_fd) as life:   # handlers installed
        poller = zmq.Poller(); life.register(poller); ...
        while not life.stop_requested:
            events = dict(poller.poll(1000))
            if life.parent_gone(events): break
            life.drain(events)

An asyncio process (the coordinator) uses `watch_loop` instead of the
handlers. `handshake` is the DEALER side of the startup exchange (hello, then
the peer's welcome) that the two workers share, and `report_setup_failure`
how either tells the coordinator it cannot start.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from typing import TypeVar

import zmq

from shared.protocol import error_frame

T = TypeVar("T")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
SETUP_FAILED = "setup_failed"  # the `error` code a worker sends when it cannot start


class HandshakeError(RuntimeError):
    """The peer refused this process, answered nonsense, or never answered (`answered` False)."""

    def __init__(self, message: str, *, answered: bool = True) -> None:
        super().__init__(message)
        self.answered = answered


def _nonblocking_pipe() -> tuple[int, int]:
    read_end, write_end = os.pipe()  # non-inheritable by default
    os.set_blocking(read_end, False)
    os.set_blocking(write_end, False)
    return read_end, write_end


def _drain_fd(fd: int) -> bytes:
    """Everything readable on a non-blocking descriptor now (b"" at end of file or when empty)."""
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


class ProcessLife:
    """A child's stop signals, wake pipe and parent-death watch (a context manager that installs them)."""

    def __init__(self, *, death_fd: int | None, watch_parent: bool = True) -> None:
        self.death_fd = death_fd
        self.parent_pid = os.getppid() if watch_parent else None
        self.wake_fd, self._wake_w = _nonblocking_pipe()
        self.stop_signal: int | None = None
        self._previous: dict[int, object] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        if death_fd is not None:
            os.set_blocking(death_fd, False)

    # -- lifetime ---------------------------------------------------------------------------------

    def __enter__(self) -> ProcessLife:
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Restore the signal handlers (or loop readers) and close the wake pipe."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()
        if self._loop is not None:
            for signum in STOP_SIGNALS:
                self._loop.remove_signal_handler(signum)
            if self.death_fd is not None:
                self._loop.remove_reader(self.death_fd)
            self._loop = None
        for fd in (self.wake_fd, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self.wake_fd = self._wake_w = -1

    # -- stop requests ----------------------------------------------------------------------------

    @property
    def stop_requested(self) -> bool:
        return self.stop_signal is not None

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
        self.wake()

    def wake(self) -> None:
        """Wake a loop blocked in poll (from a signal handler or another thread)."""
        try:
            os.write(self._wake_w, b"\0")
        except OSError:
            pass  # a full pipe already wakes the loop

    # -- polling ----------------------------------------------------------------------------------

    def register(self, poller: zmq.Poller) -> None:
        """Poll the wake pipe and the death pipe along with the process's own sockets."""
        for fd in (self.wake_fd, self.death_fd):
            if fd is not None:
                poller.register(fd, zmq.POLLIN)

    def parent_gone(self, events: dict | None = None) -> bool:
        """True once the supervisor is gone: its death pipe at end of file, or this process re-parented.

        `events` (from `poll`): look at the death pipe only when it is readable; None looks anyway."""
        if self.death_fd is not None and (events is None or self.death_fd in events):
            try:
                if os.read(self.death_fd, 64) == b"":
                    return True
            except BlockingIOError:
                pass
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def drain(self, events: dict | None = None) -> None:
        """Empty the wake pipe once it has woken a poll."""
        if events is None or self.wake_fd in events:
            _drain_fd(self.wake_fd)

    # -- asyncio ----------------------------------------------------------------------------------

    def watch_loop(self, loop: asyncio.AbstractEventLoop, on_stop: Callable[[str], None]) -> None:
        """For an asyncio process: stop signals and the parent's death call `on_stop(reason)` in the loop."""
        self._loop = loop

        def signalled(signum: int) -> None:
            if self.stop_signal is None:
                self.stop_signal = signum
            on_stop(f"signal {signum}")

        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, signalled, signum)
        if self.death_fd is not None:

            def readable() -> None:
                try:
                    data = os.read(self.death_fd, 64)  # type: ignore[arg-type]
                except BlockingIOError:
                    return
                except OSError:
                    data = b""
                if not data:
                    loop.remove_reader(self.death_fd)  # type: ignore[arg-type]
                    on_stop("parent process is gone")

            loop.add_reader(self.death_fd, readable)


def handshake(
    sock: zmq.Socket,
    hello: bytes,
    *,
    life: ProcessLife,
    timeout: float,
    waiting_for: str,
    answer: Callable[[list[bytes]], T | None],
) -> T | None:
    """Send `hello` and wait for the peer's answer; None when told to stop meanwhile.

    `answer(frames)` turns the reply into the welcome (returned), None (the peer
    said stop), or raises HandshakeError. A stop signal or the parent's death
    ends the wait with None; no reply within `timeout` s raises HandshakeError
    with `answered` False (nobody to tell)."""
    sock.send(hello)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    life.register(poller)
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        events = dict(poller.poll(min(left, 0.5) * 1000))
        if life.stop_requested or life.parent_gone(events):
            return None
        life.drain(events)
        if sock in events:
            return answer(sock.recv_multipart())
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT) or "the coordinator"
    raise HandshakeError(f"no {waiting_for} from {endpoint} within {timeout:g} s", answered=False)


def report_setup_failure(sock: zmq.Socket | None, error: Exception) -> int:
    """Tell the peer why this worker cannot start (`error` with code `setup_failed`), unless nobody
    answered its hello; the linger (ms) its socket should close with so the message leaves."""
    if sock is None or not getattr(error, "answered", True):
        return 0
    try:
        sock.send(error_frame(SETUP_FAILED, str(error)), zmq.NOBLOCK)
    except zmq.ZMQError:
        return 0
    return 1000


__all__ = ["SETUP_FAILED", "STOP_SIGNALS", "HandshakeError", "ProcessLife", "handshake", "report_setup_failure"]
