"""The coordinator's memory footprint: what is compared with the plan's budget, and how it is measured.

The footprint is compared with the plan's `budget_bytes`, which covers the
dense weights, the KV reserve and the slab (the safe-point policy,
coordinator.safepoint, corrects it when it is over):

    footprint = dense_bytes                      (as the GPU worker reports them)
              + slab resident bytes              (tmpfs st_blocks: every touched page, once)
              + sum over the coordinator, the I/O workers and the GPU worker of
                (private(p) now - private(p) when p started serving)
              + test_footprint_offset_bytes      (a test knob; 0 in real runs)

private(p) is the process's anonymous memory, resident or swapped out: RssAnon +
VmSwap of /proc/PID/status on Linux (RssAnon is psutil's `rss - shared`; one
small read, cheap): unlike USS it excludes the slab's shared-memory pages,
which USS counts for a page only one process has mapped (counting them twice),
and clean file pages such as library code, which the kernel drops without
swapping. Elsewhere it is psutil's USS (which may count slab pages twice). The processes'
private memory when they started serving (the GPU worker's at `gpu_ready`,
minus the dense weights it holds; the others' when the I/O workers were
ready) is Python, the libraries and the tokenizer: the plan never budgeted it,
so it is reported as `overhead_bytes` and not compared. Growth after that (KV
cache, MLX's buffers and copies of leased slots, Python heap) is what the KV
reserve is for, and counts.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence

import psutil

from shared.slab import Slab


def process_private_bytes(pid: int) -> int:
    """Private anonymous bytes of `pid`, resident or swapped out (module docstring); psutil.Error if gone."""
    if sys.platform.startswith("linux"):
        try:
            with open(f"/proc/{pid}/status", "rb") as status:  # one small read: cheap enough for every token
                fields = dict(line.split(b":", 1) for line in status.read().splitlines() if b":" in line)
        except (FileNotFoundError, ProcessLookupError):
            raise psutil.NoSuchProcess(pid) from None
        if b"RssAnon" in fields:  # kB; swapped-out pages count too, or swapping would hide pressure
            return sum(int(fields.get(key, b"0 kB").split()[0]) for key in (b"RssAnon", b"VmSwap")) * 1024
        info = psutil.Process(pid).memory_info()  # kernels before 4.5: RssAnon is rss - shared
        return max(0, info.rss - info.shared)
    return psutil.Process(pid).memory_full_info().uss


class FootprintMeter:
    """The footprint of the module docstring, sampled at most every `interval_s`."""

    def __init__(
        self,
        *,
        slab: Slab,
        pids: Callable[[], Sequence[int]],
        dense_bytes: Callable[[], int],
        interval_s: float,
        offset: int = 0,
        read: Callable[[int], int] = process_private_bytes,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._slab, self._pids, self._dense, self._read, self._clock = slab, pids, dense_bytes, read, clock
        self._interval = interval_s
        self._offset = offset
        self._base: dict[int, int] = {}  # pid -> private bytes at its first sample
        self._now: dict[int, int] = {}
        self._last: float | None = None
        self.samples = 0
        self.job_peak = 0
        self.run_peak = 0

    def sample(self, *, force: bool = False) -> bool:
        """Measure every process now, unless the last sample is more recent than the interval."""
        now = self._clock()
        if not force and self._last is not None and now - self._last < self._interval:
            return False
        self._last = now
        current: dict[int, int] = {}
        for pid in dict.fromkeys(self._pids()):
            try:
                current[pid] = self._read(pid)
            except (psutil.Error, OSError):  # exiting (it leaves the listing soon): its last reading stands
                if pid not in self._now:
                    continue
                current[pid] = self._now[pid]
            self._base.setdefault(pid, current[pid])
        self._base = {pid: base for pid, base in self._base.items() if pid in current}
        self._now = current
        self.samples += 1
        footprint = self.footprint()
        self.job_peak, self.run_peak = max(self.job_peak, footprint), max(self.run_peak, footprint)
        return True

    def growth(self) -> int:
        return sum(self._now[pid] - self._base[pid] for pid in self._now)

    def slab_bytes(self) -> int:
        return self._slab.resident_bytes()

    def footprint(self) -> int:
        """Dense + slab resident (live) + growth (last sample) + the test offset."""
        return self._dense() + self.slab_bytes() + self.growth() + self._offset

    def overhead(self) -> int:
        """The processes' private memory at start, less the dense weights: not compared."""
        return max(0, sum(self._base.values()) - self._dense())

    def begin_job(self) -> None:
        self.job_peak = self.footprint()

    def describe(self) -> str:
        offset = f" + test offset {self._offset}" if self._offset else ""
        return (
            f"dense weights {self._dense()} + slab resident {self.slab_bytes()} + process growth "
            f"{self.growth()}{offset}"
        )


__all__ = ["FootprintMeter", "process_private_bytes"]
