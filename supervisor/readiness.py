"""Is the system serving? The coordinator's `health`, asked by the supervisor.

`wait_until_ready` is the startup handshake seen from the top: it asks
`health` twice a second while watching every child's exit, and fails fast
with the dead child's exit code and last stderr lines (`LaunchError`), or
names what is still missing when the deadline passes. `ask_health` is one
request with a timeout.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence

import zmq

from shared.children import ChildProcess
from shared.curve import client_curve
from shared.job_messages import CLIENT_ACCEPTS, HealthReply, HealthRequest
from shared.protocol import ProtocolError, decode, encode
from shared.sockets import open_socket

COORDINATOR, GPU_WORKER = "coordinator", "GPU worker"
ASK_INTERVAL_S = 0.5
# A child's log line starts 'DATE TIME NAME[PID] LEVEL LOGGER: '; the summary names the child already.
_LOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d [\d:,.]+ \S+\[\d+\] [A-Z]+ \S+: ")


class LaunchError(RuntimeError):
    """A child died or stalled while the system started; the message says which and why.

    `summary` is the same on one line (`moeslab-launch` prints it; the message's stderr tails
    repeat lines the children's own output already showed)."""

    def __init__(self, message: str, *, summary: str | None = None) -> None:
        super().__init__(message)
        self.summary = summary if summary is not None else " ".join(message.split())


class LaunchCancelled(LaunchError):
    """The `cancel` callback asked to stop while the system was starting."""


def io_worker_name(index: int) -> str:
    return f"I/O worker {index}"


def ask_health(endpoint: str, *, timeout: float, server_key: str | None = None) -> HealthReply | None:
    """One `health` request to the jobs endpoint; None when no (good) reply came within `timeout` s.
    `server_key`: the endpoint's CURVE server key (z85), if it is a CURVE server."""
    context = zmq.Context()
    sock = None
    try:
        sock = open_socket(context, zmq.DEALER, connect=endpoint, unbounded=False, curve=client_curve(server_key))
        sock.send(encode(HealthRequest(id="health")))
        if sock.poll(timeout * 1000):
            reply = decode(sock.recv(), CLIENT_ACCEPTS)
            return reply if isinstance(reply, HealthReply) else None
        return None
    finally:
        if sock is not None:
            sock.close(linger=0)
        context.term()


def wait_until_ready(
    endpoint: str,
    children: Sequence[ChildProcess],
    *,
    io_workers: int,
    timeout: float,
    cancel: Callable[[], bool] | None = None,
    server_key: str | None = None,
) -> None:
    """Return once health says ready with all `io_workers`; LaunchError when a child exits or time runs out."""
    deadline = time.monotonic() + timeout
    context = zmq.Context()
    sock = None
    last: HealthReply | None = None
    try:
        sock = open_socket(context, zmq.DEALER, connect=endpoint, unbounded=False, curve=client_curve(server_key))
        asked = 0
        next_ask = 0.0
        while True:
            if cancel is not None and cancel():
                raise LaunchCancelled("stopped while the system was starting")
            dead = [child for child in children if child.exit_code is not None]
            if dead:
                time.sleep(0.3)  # let the others' last words and exits arrive too
                dead = [child for child in children if child.exit_code is not None]
                raise LaunchError(
                    "the system failed to start:\n" + "\n".join(c.describe() for c in dead),
                    summary="the system failed to start: " + "; ".join(_last_words(c) for c in dead),
                )
            now = time.monotonic()
            if now > deadline:
                message = _stalled(children, io_workers, timeout, last)
                raise LaunchError(message, summary=message.split(":\n", 1)[0])
            if now >= next_ask:
                asked += 1
                sock.send(encode(HealthRequest(id=f"launch-{asked}")))
                next_ask = now + ASK_INTERVAL_S
            if sock.poll(100):
                try:
                    reply = decode(sock.recv(), CLIENT_ACCEPTS)
                except ProtocolError as error:
                    raise LaunchError(f"the coordinator answered health with a bad frame: {error}") from None
                if isinstance(reply, HealthReply):
                    last = reply
                    if reply.ready and reply.io_workers == io_workers:
                        return
    finally:
        if sock is not None:
            sock.close(linger=0)
        context.term()


def _last_words(child: ChildProcess) -> str:
    """'NAME (pid P) exited with code C: its last stderr line', on one line."""
    code = child.exit_code
    if code is None:
        state = "is still running"
    elif code < 0:
        state = f"was killed by signal {-code}"
    else:
        state = f"exited with code {code}"
    said = [_LOG_PREFIX.sub("", line.strip()) for line in child.stderr_tail() if line.strip()]
    return f"{child.name} (pid {child.pid}) {state}: " + (said[-1] if said else "(no stderr output)")


def _stalled(children: Sequence[ChildProcess], io_workers: int, timeout: float, last: HealthReply | None) -> str:
    if last is None:
        waiting = [COORDINATOR]  # it never answered health
        state = "no health reply"
    else:
        waiting = [io_worker_name(i) for i in range(last.io_workers, io_workers)]
        waiting += [] if last.gpu_worker else [GPU_WORKER]
        gpu = "ready" if last.gpu_worker else "not ready"
        state = f"health: {last.io_workers} of {io_workers} I/O workers ready, GPU worker {gpu}"
    # Which I/O worker is missing is not known by index; show the tails of every unready kind.
    kinds = {name.split(" ")[0] for name in waiting}
    shown = [c.describe() for c in children if c.name.split(" ")[0] in kinds]
    return f"the system was not ready after {timeout} s ({state}); waiting for {', '.join(waiting)}:\n" + "\n".join(
        shown
    )


__all__ = [
    "COORDINATOR",
    "GPU_WORKER",
    "LaunchCancelled",
    "LaunchError",
    "ask_health",
    "io_worker_name",
    "wait_until_ready",
]
