"""The whole system's memory footprint: what is compared with the budget, and how it is measured.

    footprint = sum over the system's processes of (Pss - Pss_Shmem)
              + slab resident bytes                  (tmpfs st_blocks: every touched page, once)
              + test_footprint_offset_bytes          (a test knob; 0 in real runs)

(shared/system_memory.py says why PSS, and why the slab is taken out of each
process and counted once.) The processes are the coordinator, its I/O
workers, the ready GPU worker (its dense weights, KV cache, MLX buffers and
copies of leased slots are all in its PSS) and the run's `counted_pids`
(the supervisor, when `moeslab-launch` started the system; a program that
embeds the system, such as a test, is not counted). A process one of them
started counts as part of it: MLX's CPU backend compiles each new fused kernel
by running g++ (~108 MiB here), and the GPU worker asks the budget to keep room
for it (gpuworker/lanes.py).

The budget covers all of it. The plan the supervisor makes before anything
runs can only bound the slab by the dense weights; once every process is
ready, the coordinator measures what they use (the *baseline*) and sizes the
slab's usable slots to what the budget leaves after the baseline and the KV
reserve (`shared.plan.plan_after_baseline`). Growth after that (KV cache, MLX
buffers, Python heap) is what the KV reserve is for; pressure correction
(coordinator.safepoint) acts on this figure when it is exceeded anyway.

How often each process is read in full: PSS comes from a walk of the process's page tables
(`/proc/PID/smaps_rollup`: 37 ms of kernel time for a GPU worker of 3.3 GB here, under its
memory-map lock), which at every 500 ms sample cost a tenth of a core that decode computes on.
So a process is read in full once every `full_interval_s` (and at the baseline); at the
samples in between, its own share is its last full reading plus the move of its anonymous
memory since (`/proc/PID/status`: RssAnon + VmSwap, counters the kernel keeps). The move is
exact for private anonymous memory, swapped or not (the heap, MLX's buffers, the KV cache:
what grows, and what the copy path churns by 100+ MiB between two samples); only a change in
file pages waits for the next full read. Off Linux every sample is a full read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import psutil

from shared.slab import Slab
from shared.system_memory import ProcessMemory, descendant_pids, private_bytes, process_memory

DEFAULT_FULL_INTERVAL_S = 5.0


@dataclass(frozen=True, slots=True)
class _Anchor:
    """A process's last full reading: its own bytes, its anonymous bytes then, and when."""

    own: int
    private: int
    at: float


class FootprintMeter:
    """The footprint of the module docstring, sampled at most every `interval_s`."""

    def __init__(
        self,
        *,
        slab: Slab,
        pids: Callable[[], Mapping[str, int]],
        interval_s: float,
        offset: int = 0,
        read: Callable[[int], ProcessMemory] = process_memory,
        probe: Callable[[int], int | None] = private_bytes,
        below: Callable[..., Iterable[int]] = descendant_pids,
        clock: Callable[[], float] = time.monotonic,
        full_interval_s: float = DEFAULT_FULL_INTERVAL_S,
    ) -> None:
        self._slab, self._pids, self._read, self._below, self._clock = slab, pids, read, below, clock
        self._probe, self._full_interval = probe, full_interval_s
        self._anchors: dict[int, _Anchor] = {}  # pid -> its last full reading
        self.full_reads = 0
        self._interval = interval_s
        self._offset = offset
        self._now: dict[str, tuple[int, int]] = {}  # role -> (pid, own bytes at the last sample)
        self._last: float | None = None
        self.samples = 0
        self.job_peak = 0
        self.run_peak = 0
        self.baseline = 0  # the processes' bytes when the slab was sized (mark_baseline)

    def sample(self, *, force: bool = False, full: bool = False) -> bool:
        """Measure every process now, unless the last sample is more recent than the interval
        (`force`: regardless). `full`: read every process in full (see the module)."""
        now = self._clock()
        if not force and self._last is not None and now - self._last < self._interval:
            return False
        self._last = now
        current: dict[str, tuple[int, int]] = {}
        roles = self._pids()
        seen: set[int] = set()
        for role, pid in roles.items():
            try:
                own = self._own(pid, now, full, seen)
            except (psutil.Error, OSError):  # exiting (it leaves the listing soon): its last reading stands
                if role in self._now and self._now[role][0] == pid:
                    current[role] = self._now[role]
                continue
            # A process it started (MLX's kernel compiler) counts as its own; one of the roles (the
            # supervisor's children) counts in its own right.
            for child in self._below(pid, skip=roles.values()):
                try:
                    own += self._own(child, now, full, seen)
                except (psutil.Error, OSError):
                    continue
            current[role] = (pid, own)
        self._now = current
        self._anchors = {pid: anchor for pid, anchor in self._anchors.items() if pid in seen}
        self.samples += 1
        footprint = self.footprint()
        self.job_peak, self.run_peak = max(self.job_peak, footprint), max(self.run_peak, footprint)
        return True

    def _own(self, pid: int, now: float, full: bool, seen: set[int]) -> int:
        """`pid`'s own bytes: its last full reading plus its anonymous move since, or a full read."""
        seen.add(pid)
        private = self._probe(pid)
        anchor = self._anchors.get(pid)
        if not full and private is not None and anchor is not None and now - anchor.at < self._full_interval:
            return max(0, anchor.own + private - anchor.private)
        own = self._read(pid).own
        self.full_reads += 1
        if private is not None:
            self._anchors[pid] = _Anchor(own, private, now)
        return own

    def readings(self) -> dict[str, tuple[int, int]]:
        """Role -> (pid, own bytes) at the last sample."""
        return dict(self._now)

    def parts(self) -> dict[str, int]:
        """Each process's own bytes at the last sample, by role."""
        return {role: own for role, (_, own) in self._now.items()}

    def processes_bytes(self) -> int:
        return sum(own for _, own in self._now.values())

    def slab_bytes(self) -> int:
        return self._slab.resident_bytes()

    def footprint(self) -> int:
        """Processes (last sample) + slab resident (live) + the test offset."""
        return self.processes_bytes() + self.slab_bytes() + self._offset

    def mark_baseline(self) -> int:
        """Sample now (every process read in full) and keep the processes' bytes as the baseline
        the slab is sized after."""
        self.sample(force=True, full=True)
        self.baseline = self.processes_bytes()  # the test offset stands for growth, not for the baseline
        return self.baseline

    def begin_job(self) -> None:
        self.job_peak = self.footprint()

    def describe(self) -> str:
        parts = " + ".join(f"{role} {own}" for role, own in self.parts().items())
        offset = f" + test offset {self._offset}" if self._offset else ""
        return f"processes ({parts or 'none'}) + slab resident {self.slab_bytes()}{offset}"


__all__ = ["FootprintMeter"]
