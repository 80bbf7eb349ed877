"""The machine's memory while the bench runs: used memory sampled to a peak, and processes' RSS.

The shared-memory slab is not in any process's RSS, so the machine's used memory (total minus
available, shared memory included) is what shows the whole system's footprint next to mlx-lm's.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence

import psutil

from shared.scheduling import process_threads


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


def process_cpu_s(pids: dict[str, int]) -> dict[str, float]:
    """Each named process's CPU time so far (user + system, seconds); a process gone counts 0."""
    seconds: dict[str, float] = {}
    for name, pid in pids.items():
        try:
            times = psutil.Process(pid).cpu_times()
            seconds[name] = times.user + times.system
        except psutil.Error:
            seconds[name] = 0.0
    return seconds


CPU_ROLES = ("gpu_worker", "coordinator", "io_workers")


def cpu_ms_per_token(before: dict[str, float], after: dict[str, float], tokens: int) -> dict[str, float]:
    """CPU milliseconds per token each role spent between two `process_cpu_s` readings: the GPU
    worker, the coordinator, the I/O workers together. Read from a job's start it includes the
    prefill; read from its first token, decode alone (what the helpers take while a token computes)."""
    roles = dict.fromkeys(CPU_ROLES, 0.0)
    for name, end in after.items():
        role = "gpu_worker" if name == "GPU worker" else "coordinator" if name == "coordinator" else "io_workers"
        roles[role] += max(0.0, end - before.get(name, end))
    return {role: 1e3 * spent / max(1, tokens) for role, spent in roles.items()}


def thread_schedstats(pid: int) -> dict[int, tuple[int, int, int]]:
    """Each thread of `pid` and its (ns run on a CPU, ns runnable but waiting for one, times it was
    preempted) so far.

    From /proc/<pid>/task/<tid>/schedstat and the `nonvoluntary_ctxt_switches` of its status
    (Linux); a thread that ended meanwhile is left out. Empty where the kernel keeps no such
    figures (macOS, a kernel without schedstats) or `pid` is gone."""
    stats: dict[int, tuple[int, int, int]] = {}
    try:
        threads = process_threads(pid)
    except OSError:
        return stats
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/schedstat") as file:
                ran, waited, _slices = file.read().split()
            with open(f"/proc/{pid}/task/{thread}/status") as file:
                preempted = _status_field(file.read(), "nonvoluntary_ctxt_switches")
        except (OSError, ValueError):  # ended, or this kernel keeps no such figures
            continue
        stats[thread] = (int(ran), int(waited), preempted)
    return stats


def _status_field(status: str, name: str) -> int:
    """An integer field of /proc/<pid>/status; ValueError when it is missing."""
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key == name:
            return int(value)
    raise ValueError(f"no {name} in the status")


def compute_thread_ms_per_token(
    before: Mapping[int, tuple[int, int, int]], after: Mapping[int, tuple[int, int, int]], tokens: int
) -> dict[str, float] | None:
    """What the GPU worker's compute thread got between two `thread_schedstats` readings, per token.

    The compute thread is the one that ran longest in between (MLX's CPU stream of the first
    lane: the others run a fraction of its time). Its `wait_ms_per_token` is time it could have
    computed but found every core taken, by the helpers or by the worker's own threads
    (`threads_wait_ms_per_token`: all its threads' waits together); `preempted_per_token`, how
    often the scheduler took its core from it for another thread (a helper's or the worker's own
    that woke and found no idle core). None without readings, or when they share no thread
    (another process: the worker was restarted in between)."""
    if not before.keys() & after.keys():
        return None
    deltas: dict[int, tuple[int, int, int]] = {}
    for thread, (ran, waited, preempted) in after.items():
        # A thread started in between counts from zero.
        ran_before, waited_before, preempted_before = before.get(thread, (0, 0, 0))
        deltas[thread] = (ran - ran_before, waited - waited_before, preempted - preempted_before)
    ran, waited, preempted = max(deltas.values())
    per = 1e-6 / max(1, tokens)
    return {
        "run_ms_per_token": ran * per,
        "wait_ms_per_token": waited * per,
        "threads_wait_ms_per_token": sum(wait for _, wait, _ in deltas.values()) * per,
        "preempted_per_token": preempted / max(1, tokens),
    }


def total_memory() -> int:
    """The machine's physical memory in bytes."""
    return int(psutil.virtual_memory().total)


def split_cpus() -> tuple[list[int], list[int]]:
    """(GPU worker's CPUs, helpers' CPUs): the last CPU this process may run on for the helpers,
    the others for the GPU worker. ValueError naming what is missing (no affinity call, one CPU)."""
    if not hasattr(os, "sched_getaffinity"):
        raise ValueError("pinning needs sched_getaffinity and sched_setaffinity (Linux); this platform has neither")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise ValueError(f"pinning needs at least 2 CPUs to split, this process may run on {cpus}")
    return cpus[:-1], cpus[-1:]


def pin_processes(
    pids: Mapping[str, int], *, gpu_worker: Sequence[int], helpers: Sequence[int]
) -> dict[str, list[int]]:
    """Every thread of the GPU worker on `gpu_worker`'s CPUs, every other process's on `helpers`'.

    Threads started later inherit their creator's CPUs. Returns each process's CPUs as read back
    from its threads (their union), so that a report says what held, not what was asked."""
    applied: dict[str, list[int]] = {}
    for name, pid in pids.items():
        cpus = set(gpu_worker if name == "GPU worker" else helpers)
        held: set[int] = set()
        for thread in process_threads(pid):
            try:
                os.sched_setaffinity(thread, cpus)
                held |= os.sched_getaffinity(thread)
            except ProcessLookupError:  # the thread ended since it was listed
                continue
        applied[name] = sorted(held)
    return applied
