"""A running system's memory footprint, measured from the test with psutil, not by its own code.

- `slab_resident(system)`: the slab's resident bytes (its /dev/shm file's allocated blocks).
- `anonymous_bytes(pid)`: a process's private anonymous memory (rss - shared).
- `FootprintProbe(system, dense_bytes=...)`: dense + slab + every process's growth since the
  probe started, sampled in a thread; its peak is what the budget must hold.
"""

from __future__ import annotations

import os
import threading
import time

import psutil

from supervisor.system import RunningSystem


def slab_resident(system: RunningSystem) -> int:
    """The slab's resident bytes: the blocks its /dev/shm file has allocated."""
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


__all__ = ["FootprintProbe", "anonymous_bytes", "slab_resident"]
