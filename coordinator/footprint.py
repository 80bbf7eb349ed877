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

Where the full reads run (`background_reads`): the coordinator samples between two tokens, in its
event loop, so a full read there stalls the loop for the walk, and the GPU worker's next lease
request (the first layer's, a miss in a streaming system) waits for it: 34-87 ms, every 5 s of
decode, measured here. With `background_reads` a stale process is re-read on a thread of its own
(`FullReads`; the read is a system call, so the loop runs meanwhile) and its estimate stands until
the reading arrives. The first reading of a process and a `full` sample (the baseline) are read
at once, in the caller's thread, as they must be.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import psutil

from shared.slab import Slab
from shared.system_memory import ProcessMemory, descendant_pids, private_bytes, process_memory

DEFAULT_FULL_INTERVAL_S = 5.0

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Anchor:
    """A process's last full reading: its own bytes, its anonymous bytes then, and when."""

    own: int
    private: int
    at: float


class FullReads:
    """Full reads of the processes asked for, on a thread of their own (see the module docstring)."""

    def __init__(
        self,
        *,
        read: Callable[[int], ProcessMemory],
        probe: Callable[[int], int | None],
        clock: Callable[[], float],
    ) -> None:
        self._read, self._probe, self._clock = read, probe, clock
        self._lock = threading.Lock()
        self._wanted: dict[int, None] = {}  # pids to read, in the order asked
        self._done: dict[int, _Anchor] = {}
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="footprint-reads", daemon=True)
        self._thread.start()

    def request(self, pid: int) -> None:
        """Read `pid` in full soon (once, however often it is asked for before the read)."""
        with self._lock:
            self._wanted[pid] = None
        self._wake.set()

    def take(self) -> dict[int, _Anchor]:
        """The readings done since the last call."""
        with self._lock:
            done, self._done = self._done, {}
        return done

    def close(self, timeout_s: float = 1.0) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            with self._lock:
                wanted, self._wanted = list(self._wanted), {}
            for pid in wanted:
                try:
                    private = self._probe(pid)  # first: the anchor's move starts at the walk
                    own = self._read(pid).own
                except (psutil.Error, OSError):  # gone: the sampler finds that out itself
                    continue
                except Exception:  # a bug must not end the thread silently
                    logger.exception("full read of pid %d failed", pid)
                    continue
                if private is None:
                    continue
                anchor = _Anchor(own, private, self._clock())
                with self._lock:
                    self._done[pid] = anchor


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
        background_reads: bool = False,
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
        self._reads = FullReads(read=read, probe=probe, clock=clock) if background_reads else None

    def close(self) -> None:
        """End the background reads' thread, if any."""
        if self._reads is not None:
            self._reads.close()

    def sample(self, *, force: bool = False, full: bool = False) -> bool:
        """Measure every process now, unless the last sample is more recent than the interval
        (`force`: regardless). `full`: read every process in full (see the module)."""
        now = self._clock()
        if not force and self._last is not None and now - self._last < self._interval:
            return False
        self._last = now
        if self._reads is not None:
            for pid, anchor in self._reads.take().items():
                if pid not in self._anchors or self._anchors[pid].at < anchor.at:
                    self._anchors[pid] = anchor
                    self.full_reads += 1
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
        if not full and private is not None and anchor is not None:
            if now - anchor.at >= self._full_interval:
                if self._reads is None:
                    return self._read_in_full(pid, now, private)
                self._reads.request(pid)  # the estimate stands until the reading arrives
            return max(0, anchor.own + private - anchor.private)
        return self._read_in_full(pid, now, private)

    def _read_in_full(self, pid: int, now: float, private: int | None) -> int:
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
