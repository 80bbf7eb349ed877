"""The one place ZeroMQ sockets are made: linger, message size, high-water marks, ipc permissions.

Every process talks through sockets from `open_socket`, so the rules hold
everywhere: linger 0 (a closing process never blocks on a dead peer), a
bounded `MAXMSGSIZE` (a frame over it is not refused but drops the peer's
connection, so each socket's bound is its largest legal frame), unbounded
high-water marks between the system's own processes (nothing may be dropped
silently; backpressure is the protocol's job), ROUTER_MANDATORY on routers
(a reply to a gone peer fails loudly instead of vanishing), and an ipc
socket file readable by its owner only.
"""

from __future__ import annotations

import os
from typing import TypeVar

import zmq

from shared.protocol import MAX_MESSAGE_BYTES

S = TypeVar("S", bound=zmq.Socket)


def ipc_path(endpoint: str) -> str | None:
    """The filesystem path of an `ipc://` endpoint (None for other transports and abstract sockets)."""
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return None
    return endpoint[len("ipc://") :]


def open_socket(
    context: zmq.Context,
    kind: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    unbounded: bool = True,
    routing_id: str | None = None,
) -> zmq.Socket:
    """A socket of `kind` (zmq.ROUTER, zmq.DEALER, ...) with the system's options, bound or connected.

    `unbounded`: high-water marks 0 (the system's own links); False keeps ZeroMQ's defaults
    (a client's link to the front door). A bound ipc endpoint's socket file is made 0600.
    On any failure the socket is closed before the error propagates."""
    sock = context.socket(kind)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        if unbounded:
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        if kind == zmq.ROUTER:
            # No ROUTER_HANDOVER: a second peer reusing a live peer's identity is refused.
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if routing_id is not None:
            sock.setsockopt(zmq.ROUTING_ID, routing_id.encode())
        if bind is not None:
            sock.bind(bind)
            path = ipc_path(bound_endpoint(sock))  # the resolved name (an `ipc://*` bind picks one)
            if path is not None:
                os.chmod(path, 0o600)
        if connect is not None:
            sock.connect(connect)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def bound_endpoint(sock: zmq.Socket) -> str:
    """The endpoint a socket is bound to (a `tcp://...:0` bind resolved to its port)."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def remove_ipc_file(endpoint: str) -> None:
    """Remove a bound ipc endpoint's socket file: libzmq leaves it behind when the socket closes."""
    path = ipc_path(endpoint)
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


__all__ = ["bound_endpoint", "ipc_path", "open_socket", "remove_ipc_file"]
