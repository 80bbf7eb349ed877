"""Refusals at startup read as one line: `moeslab-launch: error: WHAT: PROBLEM`.

A user's first errors are a wrong path, a truncated download, a budget too
small, a bad flag, a port already taken. Each is an expected refusal, not a
bug, so `moeslab-launch` prints one line naming the file or value and the
problem and exits 1 (argparse's usage errors: 2); the traceback is logged
only at `--log-level debug`. An exception that is not a refusal (a bug) still
propagates with its traceback.

So that the refusal really is the only line when nothing has started yet,
`StartupLogHandler` holds the supervisor's own INFO and DEBUG lines (the
store summary, where the usage history lives, stale runs removed) until the
system has started or the first child speaks; a refusal before that drops
them. Warnings and errors pass at once. At debug level nothing is held.
Once children have started, their lines stream as they come and the refusal
is the last line (a dead child's own words are among the lines above it;
the refusal names the child and its last stderr line).

`check_endpoint_free` refuses a jobs endpoint another process already serves
before any child is spawned, so the coordinator's bind error (a child's
traceback) is not the first thing a user sees.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import sys

import zmq

from shared.children import CHILD_LOGGER
from shared.sockets import ipc_path
from supervisor.budget import BudgetError
from supervisor.readiness import LaunchError
from supervisor.rundir import RunDirInUse

PROG = "moeslab-launch"
logger = logging.getLogger("moeslab.supervisor")


class EndpointInUse(RuntimeError):
    """The jobs endpoint is already served by another process; the message names it."""


# What a refusal at startup may raise: the store's and the plan's ValueErrors (StoreError,
# BudgetError, ConfigError), OSErrors naming a file, a child that died or stalled, a run
# directory or an endpoint in use. Anything else is a bug and keeps its traceback.
REFUSALS: tuple[type[BaseException], ...] = (
    LaunchError,
    BudgetError,
    RunDirInUse,
    EndpointInUse,
    ValueError,
    OSError,
    zmq.ZMQError,
)


class StartupLogHandler(logging.StreamHandler):
    """stderr, with the supervisor's INFO/DEBUG lines held until `show_held` (or dropped by `drop_held`).

    A child's line releases what is held first, so the order on stderr stays the order of events."""

    def __init__(self, *, hold: bool) -> None:
        super().__init__(sys.stderr)
        self._held: list[logging.LogRecord] | None = [] if hold else None

    def emit(self, record: logging.LogRecord) -> None:
        if self._held is not None:
            if record.name.startswith(CHILD_LOGGER):
                self._release_locked()
            elif record.levelno < logging.WARNING:
                self._held.append(record)
                return
        super().emit(record)

    # Not `release`/`discard`: logging.Handler.release() releases the handler's lock.
    def show_held(self) -> None:
        """Write what is held and stop holding."""
        with self.lock:  # type: ignore[union-attr]  # created by logging.Handler.__init__
            self._release_locked()

    def drop_held(self) -> None:
        """Drop what is held (a refusal is about to be the only line) and stop holding."""
        with self.lock:  # type: ignore[union-attr]
            self._held = None

    def _release_locked(self) -> None:
        held, self._held = self._held or [], None
        for record in held:
            super().emit(record)


def _startup_handlers() -> list[StartupLogHandler]:
    return [h for h in logging.getLogger().handlers if isinstance(h, StartupLogHandler)]


def release_startup_lines() -> None:
    """The system has started (or stops for another reason): show the held lines."""
    for handler in _startup_handlers():
        handler.show_held()


def one_line(error: BaseException) -> str:
    """The refusal's text on one line: a launch error's summary, any other message's lines joined."""
    text = error.summary if isinstance(error, LaunchError) else str(error)
    if isinstance(error, OSError) and error.filename is not None and not text:
        text = f"{error.filename}: {error.strerror}"
    return " ".join(part.strip() for part in text.splitlines() if part.strip()) or type(error).__name__


def refuse(error: BaseException, *, debug: bool) -> None:
    """Print the one refusal line (after the traceback and the full text, at debug level)."""
    for handler in _startup_handlers():
        handler.drop_held()
    if debug:
        logger.debug("startup refused: %s", error, exc_info=error)
    sys.stderr.write(f"{PROG}: error: {one_line(error)}\n")
    sys.stderr.flush()


def check_endpoint_free(endpoint: str) -> None:
    """Refuse (EndpointInUse) a tcp endpoint someone listens on, or an ipc socket someone serves.

    A stale ipc socket file (nobody accepts) is free: ZeroMQ binds over it. The probe binds the
    way ZeroMQ does (SO_REUSEADDR), so a port whose last connection is in TIME_WAIT counts as
    free. Another process can still take the endpoint before the coordinator binds it: that
    rare race ends as a dead coordinator, named by the launch error."""
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        host = "0.0.0.0" if host == "*" else host.strip("[]")
        try:
            family, kind, proto, _, address = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
        except (OSError, ValueError):
            return  # a form only ZeroMQ knows (an interface name): its bind decides
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    raise EndpointInUse(f"{endpoint}: address already in use (another server listens there)") from None
                raise EndpointInUse(f"{endpoint}: cannot bind: {error.strerror}") from None
        return
    path = ipc_path(endpoint)
    if path is None:
        return
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        raise ValueError(f"{endpoint}: directory {directory} does not exist")
    if not os.path.lexists(path):
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return  # not a live socket (a stale file): nobody serves it
    raise EndpointInUse(f"{endpoint}: another server is already listening on {path}")


__all__ = [
    "PROG",
    "REFUSALS",
    "EndpointInUse",
    "StartupLogHandler",
    "check_endpoint_free",
    "one_line",
    "refuse",
    "release_startup_lines",
]
