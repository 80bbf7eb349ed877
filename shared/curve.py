"""ZeroMQ CURVE for the job front door: the server's key pair on disk, a client's server key.

A tcp jobs endpoint that other machines can reach (`shared.config.endpoint_exposed`) is served
only with CURVE: the coordinator's jobs ROUTER is a CURVE server, and a client must know the
server's public key to complete the handshake (a client without it, or with a wrong one, gets no
service at all). Traffic is encrypted. There is no ZAP handler: the server admits any client that
knows its public key, so that key is what a user hands to whoever may send jobs. Each client
socket makes its own ephemeral key pair.

The key files have libzmq's certificate layout (`zmq.auth.create_certificates` writes the same,
`zmq.auth.load_certificate` reads them): DIR/server.key holds the public key, DIR/server.key_secret
both keys; both 0600 in a 0700 directory (RUN_DIR/curve for a run). Only the internal ipc sockets'
file permissions protect the other links, as before.
"""

from __future__ import annotations

import os
import shutil
import stat
import struct
from dataclasses import dataclass, field

import zmq
import zmq.auth
from zmq.utils import z85

CURVE_DIR = "curve"  # in the run directory
SERVER_PUBLIC_FILE = "server.key"
SERVER_SECRET_FILE = "server.key_secret"
KEY_CHARS = 40  # a z85-encoded 32-byte key
# A CURVE MESSAGE on the wire is the frame plus "\x07MESSAGE" (8), a nonce (8), a MAC (16) and the
# flags (1); libzmq applies ZMQ_MAXMSGSIZE to that, so a CURVE socket's bound grows by exactly this.
WIRE_OVERHEAD_BYTES = 33

_BANNER = "#   ZeroMQ CURVE {} Certificate (moeslab job front door)\n\n"


class CurveError(ValueError):
    """A CURVE key, key file or libzmq build that cannot be used; the message names it."""


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """CURVE for one socket: the server's public key and, on the server's own socket, its secret key
    (None: a client of that server, with an ephemeral key pair of its own)."""

    server_public: bytes
    server_secret: bytes | None = field(default=None, repr=False)


def require_curve() -> None:
    """CurveError unless this libzmq was built with CURVE."""
    if not zmq.has("curve"):
        raise CurveError(f"libzmq {zmq.zmq_version()} was built without CURVE support; it cannot serve or use keys")


def check_key(key: str | bytes, *, what: str = "server key") -> bytes:
    """A z85 CURVE key (40 characters) as bytes; CurveError naming `what` otherwise."""
    raw = key.encode("ascii", "replace") if isinstance(key, str) else bytes(key)
    try:
        valid = len(raw) == KEY_CHARS and len(z85.decode(raw)) == 32
    except (ValueError, KeyError, TypeError, struct.error):  # what z85.decode raises on bad text
        valid = False
    if not valid:
        raise CurveError(f"{what} {key!r} is not a CURVE key ({KEY_CHARS} z85 characters)")
    return raw


def client_curve(server_key: str | bytes | None) -> CurveKeys | None:
    """The client side of a CURVE link to the server with this public key (None: no CURVE)."""
    if server_key is None:
        return None
    require_curve()
    return CurveKeys(server_public=check_key(server_key))


def read_server_key(key_or_file: str) -> bytes:
    """A server's public key given as its 40 z85 characters, or as a file holding it (the bare key,
    or a certificate such as RUN_DIR/curve/server.key); CurveError naming the value otherwise."""
    if len(key_or_file) == KEY_CHARS and not os.path.exists(key_or_file):
        return check_key(key_or_file)
    try:
        with open(key_or_file, "rb") as handle:
            text = handle.read(64 * 1024)  # a key file is tiny; never read a huge one whole
    except OSError as error:
        raise CurveError(f"server key {key_or_file!r} is neither a key nor a readable file: {error}") from None
    if b"public-key" in text:
        public, _ = zmq.auth.load_certificate(key_or_file)
        return check_key(public, what=f"public key in {key_or_file}")
    return check_key(text.strip(), what=f"contents of {key_or_file}")


def new_server_keys() -> CurveKeys:
    """A fresh server key pair."""
    require_curve()
    public, secret = zmq.curve_keypair()
    return CurveKeys(server_public=public, server_secret=secret)


def load_server_keys(directory: str | os.PathLike[str]) -> CurveKeys:
    """The server key pair in DIR/server.key_secret; CurveError if the file is missing, readable by
    anyone but its owner (naming the file and its mode) or holds no valid pair."""
    require_curve()
    path = os.path.join(os.fspath(directory), SERVER_SECRET_FILE)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError as error:
        raise CurveError(f"cannot read the CURVE secret key file {path}: {error}") from None
    if mode & 0o077:
        raise CurveError(f"CURVE secret key file {path} has mode {mode:04o}; it must be 0600 (chmod 600 {path})")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as error:
        raise CurveError(f"cannot read the CURVE secret key file {path}: {error}") from None
    if secret is None:
        raise CurveError(f"CURVE secret key file {path} holds no secret-key")
    keys = CurveKeys(
        server_public=check_key(public, what=f"public key in {path}"),
        server_secret=check_key(secret, what=f"secret key in {path}"),
    )
    if zmq.curve_public(keys.server_secret) != keys.server_public:
        raise CurveError(f"CURVE secret key file {path}: its public-key does not belong to its secret-key")
    return keys


def _write(path: str, text: str) -> None:
    if os.path.lexists(path):  # a dead run's leftover: replaced, never written through
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as handle:
        handle.write(text)


def write_server_keys(directory: str | os.PathLike[str], keys: CurveKeys) -> list[str]:
    """Write the pair into `directory` (made 0700; files 0600); the paths created, in removal order
    (the files, then the directory)."""
    if keys.server_secret is None:
        raise CurveError("a server key pair needs its secret key")
    root = os.fspath(directory)
    secret_file = os.path.join(root, SERVER_SECRET_FILE)
    public_file = os.path.join(root, SERVER_PUBLIC_FILE)
    body = f'metadata\ncurve\n    public-key = "{keys.server_public.decode("ascii")}"\n'
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        os.chmod(root, 0o700)
        _write(secret_file, _BANNER.format("**Secret**") + body + f'    secret-key = "{keys.server_secret.decode()}"\n')
        _write(public_file, _BANNER.format("Public") + body)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)  # never half a pair, nor a secret nobody removes
        raise
    return [secret_file, public_file, root]


__all__ = [
    "CURVE_DIR",
    "KEY_CHARS",
    "SERVER_PUBLIC_FILE",
    "SERVER_SECRET_FILE",
    "WIRE_OVERHEAD_BYTES",
    "CurveError",
    "CurveKeys",
    "check_key",
    "client_curve",
    "load_server_keys",
    "new_server_keys",
    "read_server_key",
    "require_curve",
    "write_server_keys",
]
