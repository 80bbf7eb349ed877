"""A bare DEALER for the front door: the frames the real `shared.client.Client` refuses to send.

- `RawClient(endpoint)`: send any object (msgpack-packed), raw bytes or several frames; read a
  reply decoded as the client would, or check that none comes.
"""

from __future__ import annotations

import msgpack
import zmq

from shared.job_messages import CLIENT_ACCEPTS
from shared.protocol import decode


class RawClient:
    """A DEALER socket speaking raw frames to the front door."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, message: object) -> None:
        self.sock.send(message if isinstance(message, bytes) else msgpack.packb(message))

    def send_frames(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def reply(self, timeout: float = 20.0):
        assert self.sock.poll(timeout * 1000), "no reply"
        return decode(self.sock.recv(), CLIENT_ACCEPTS)

    def quiet(self, timeout: float = 0.5) -> bool:
        """True when nothing arrives within `timeout`."""
        return not self.sock.poll(timeout * 1000)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.context.term()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["RawClient"]
