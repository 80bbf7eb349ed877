"""Helpers for the coordinator's whole-system tests (front door, pressure, usage persistence).

- `start(path, config={...}, **options)`: `start_system` with extra run-config fields (the
  coordinator's knobs: queue_limit, footprint_interval_ms, pressure_tolerance_bytes,
  usage_flush_s, test_footprint_offset_bytes), passed as its `run_config`.
- `RawClient`: a bare DEALER for frames the real Client refuses to send.
- `FootprintProbe`: the footprint measured from outside with psutil, in a thread.
"""

from __future__ import annotations

import os
import threading
import time

import msgpack
import psutil
import zmq

from shared.job_messages import CLIENT_ACCEPTS
from shared.protocol import decode
from shared.store import ExpertStore
from supervisor.system import RunningSystem, start_system
from tests.system_helpers import TEST_KV_RESERVE, io_mode_for


def start(path, *, config: dict | None = None, **options) -> RunningSystem:
    """A system over the model at `path`: working bank of top_k, every expert resident by default."""
    store = ExpertStore.open(path)
    slots = store.top_k + len(store.sparse_layers) * store.experts_per_layer
    defaults = dict(
        model_dir=path,
        working_slots=store.top_k,
        kv_reserve_bytes=TEST_KV_RESERVE,
        memory_budget=store.dense_bytes + TEST_KV_RESERVE + slots * store.slot_bytes,
        io_mode=io_mode_for(path),
    )
    return start_system(**{**defaults, **options}, run_config=config or {})


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


def slab_resident(system: RunningSystem) -> int:
    return os.stat(f"/dev/shm{system.slab_name}").st_blocks * 512


def anonymous_bytes(pid: int) -> int:
    """psutil's view of a process's private anonymous memory (independent of the coordinator's code)."""
    info = psutil.Process(pid).memory_info()
    return info.rss - info.shared


class FootprintProbe:
    """The coordinator's footprint, measured from the test: dense + slab + every process's growth.

    Baselines are taken at construction (the system is ready and idle); `peak` is the
    largest value seen by the sampling thread while it runs.
    """

    def __init__(self, system: RunningSystem, *, dense_bytes: int, interval_s: float = 0.01) -> None:
        self.system, self.dense, self.interval = system, dense_bytes, interval_s
        self.base = {pid: anonymous_bytes(pid) for pid in system.pids.values()}
        self.peak = self.last = self.measure()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def measure(self) -> int:
        growth = sum(anonymous_bytes(pid) - base for pid, base in self.base.items())
        return self.dense + slab_resident(self.system) + growth

    def _run(self) -> None:
        while not self._stop.is_set():
            self.last = self.measure()
            self.peak = max(self.peak, self.last)
            self.samples += 1
            time.sleep(self.interval)

    def __enter__(self) -> FootprintProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


__all__ = ["FootprintProbe", "RawClient", "anonymous_bytes", "slab_resident", "start"]
