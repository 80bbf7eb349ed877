"""The one place ZeroMQ sockets are made: linger, message size, high-water marks, ipc permissions.

Every process talks through sockets from `open_socket`, so the rules hold
everywhere: linger 0 (a closing process never blocks on a dead peer), a
bounded `MAXMSGSIZE` (a frame over it is not refused but drops the peer's
connection, so each socket's bound is its largest legal frame), unbounded
high-water marks between the system's own processes (nothing may be dropped
silently; backpressure is the protocol's job), ROUTER_MANDATORY on routers
(a reply to a gone peer fails loudly instead of vanishing), an ipc
socket file readable by its owner only, and CURVE where it is asked for
(`shared.curve`: the job front door on an exposed tcp endpoint and its clients).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import TypeVar

import zmq

from shared.curve import WIRE_OVERHEAD_BYTES, CurveKeys
from shared.protocol import MAX_MESSAGE_BYTES, encode

logger = logging.getLogger(__name__)

S = TypeVar("S", bound=zmq.Socket)


def ipc_path(endpoint: str) -> str | None:
    """The filesystem path of an `ipc://` endpoint (None for other transports and abstract sockets)."""
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return None
    return endpoint[len("ipc://") :]


def ipc_server_absent(endpoint: str) -> str | None:
    """Why nobody can be serving an `ipc://` endpoint (no socket file, nothing listening), else None.

    A connecting ZeroMQ socket waits for such a server without end. Tcp and cases it cannot tell
    (a full accept backlog, a long path) give None."""
    path = ipc_path(endpoint)
    if path is None:
        return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)  # a full accept backlog is a busy server, not a missing one
        try:
            probe.connect(path)
        except (FileNotFoundError, NotADirectoryError):
            return f"no socket file {path}"
        except ConnectionRefusedError:  # a file its server left behind, or not a socket
            return f"nothing listens on {path}"
        except OSError:
            return None
    return None


def open_socket(
    context: zmq.Context,
    kind: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    unbounded: bool = True,
    routing_id: str | None = None,
    curve: CurveKeys | None = None,
) -> zmq.Socket:
    """A socket of `kind` (zmq.ROUTER, zmq.DEALER, ...) with the system's options, bound or connected.

    `unbounded`: high-water marks 0 (the system's own links); False keeps ZeroMQ's defaults
    (a client's link to the front door). A bound ipc endpoint's socket file is made 0600.
    `curve`: a CURVE server (its secret key given) or a client of that server (an ephemeral key pair).
    On any failure the socket is closed before the error propagates."""
    sock = context.socket(kind)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        # libzmq bounds the frame as it travels: under CURVE, encrypted and a little larger.
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + (WIRE_OVERHEAD_BYTES if curve else 0))
        if unbounded:
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        if kind == zmq.ROUTER:
            # No ROUTER_HANDOVER: a second peer reusing a live peer's identity is refused.
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if routing_id is not None:
            sock.setsockopt(zmq.ROUTING_ID, routing_id.encode())
        if curve is not None:
            _set_curve(sock, curve)
        if any(_ipv6(endpoint) for endpoint in (bind, connect)):
            sock.setsockopt(zmq.IPV6, 1)  # libzmq refuses an IPv6 address (tcp://[::1]:PORT) without it
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


def _set_curve(sock: zmq.Socket, curve: CurveKeys) -> None:
    if curve.server_secret is not None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.server_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.server_public)
        return
    public, secret = zmq.curve_keypair()  # a client is known by the server key, not by its own
    sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


def _ipv6(endpoint: str | None) -> bool:
    return endpoint is not None and endpoint.startswith("tcp://[")


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


def send_routed(sock, identity: bytes, message: object) -> bool:
    """Send `message` to the peer `identity` of a ROUTER (a `zmq.asyncio` socket, or a
    `shared.loop_socket.LoopSocket`) without blocking; False (logged) when ZeroMQ refuses it: a
    peer that is gone or not keeping up."""
    try:
        sent = sock.send_multipart([identity, encode(message)], flags=zmq.DONTWAIT)
    except zmq.ZMQError as error:
        logger.warning("%s to %r dropped: %s", getattr(message, "OP", "?"), identity, error)
        return False
    # A zmq.asyncio send answers with a future, which DONTWAIT resolves at once; a LoopSocket's raises.
    error = sent.exception() if sent is not None and sent.done() else None
    if error is not None:
        logger.warning("%s to %r dropped: %s", getattr(message, "OP", "?"), identity, error)
        return False
    return True


__all__ = ["bound_endpoint", "ipc_path", "open_socket", "remove_ipc_file", "send_routed"]
