"""The machine's memory while the bench runs: used memory sampled to a peak, and processes' RSS.

The shared-memory slab is not in any process's RSS, so the machine's used memory (total minus
available, shared memory included) is what shows the whole system's footprint next to mlx-lm's.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import psutil


class MemoryWatch:
    """Samples the machine's used memory (shared memory included) every `interval` s; keeps the peak."""

    def __init__(self, interval: float = 0.25) -> None:
        self._interval = interval
        self.peak_used = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-watch", daemon=True)

    def _used(self) -> int:
        vm = psutil.virtual_memory()
        return int(vm.total - vm.available)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_used = max(self.peak_used, self._used())
            self._stop.wait(self._interval)

    def __enter__(self) -> MemoryWatch:
        self.baseline_used = self._used()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def process_rss(pids: Sequence[int]) -> int:
    """The summed resident set size of `pids` (a process gone meanwhile counts 0)."""
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return total


def total_memory() -> int:
    """The machine's physical memory in bytes."""
    return int(psutil.virtual_memory().total)
