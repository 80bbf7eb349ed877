"""How the helpers share the CPU with the computation: the scheduling class of the coordinator and
the I/O workers (Linux), and how many I/O workers there are (`resolve_io_workers`).

Their work is many short wake-ups: a read completes, a message arrives, a reply goes out; more
than a dozen per expert read (its 9 O_DIRECT reads on pool threads, the load, its reply). Under
the default class each wake-up of a thread that slept preempts whatever runs on its core, and on
a machine whose cores compute (MLX on the CPU) that is the GPU worker: at 25% residency (the
default benchmark) its compute thread waited 1.2 s in 15 s runnable but not running, against
0.04 s with every expert resident.

`batch` (SCHED_BATCH) takes those wake-ups out of preemption: the helper runs on a free core at
once, or when the running thread's slice ends, and keeps its fair share of CPU (nothing starves,
unlike SCHED_IDLE). It needs no privilege. Elsewhere (macOS, where the GPU computes) there is no
such class: the process keeps the default and says so.

It is not the default (`normal`): it halved the compute thread's preemptions (involuntary
switches 4072 -> 2018, run-queue wait 1.2 -> 0.8 s in 15 s), but the coordinator, no longer
preempting either, answered misses later (lease wait 9.8-10.0 -> 11.4-12.2 ms per token), and
decode moved less than this host's noise: 0.896 of the resident system (median of 9 rounds)
against 0.877 (12 rounds) under the default class.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

HELPER_SCHEDULING = ("batch", "normal")

# Auto picks one I/O worker on a host of at most this many usable cores (`resolve_io_workers`).
SINGLE_IO_WORKER_CORES = 2


def available_cores() -> int:
    """CPUs this process may run on (its affinity where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity call
        return os.cpu_count() or 1


def resolve_io_workers(requested: int | None, *, cores: int | None = None) -> tuple[int, str]:
    """(I/O worker processes, why): `requested` when given, else auto: one on a host of at most
    SINGLE_IO_WORKER_CORES usable cores (`cores`, default `available_cores()`), two otherwise.

    Two let a hung or dead worker's loads go to the other at once while it is replaced; with one
    they wait for the restarted worker (the backend's replacement grace). On a 2-core host the
    computation fills both cores (two compute lanes), and a second worker's wake-ups (its reader
    threads, its ZeroMQ thread, a layer's loads split into two messages) preempt it. At the default
    benchmark one worker decoded at 1.010, 1.007 and 1.002 of two's speed (three bench_ab runs of
    12 rounds; 5 of their 6 pass medians above 1): within this host's noise, but every run cut the
    lease waits (4.2 -> 3.2, 4.9 -> 3.5, 6.9 -> 3.7 ms a token) and the helpers' CPU."""
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"io_workers must be a positive integer or None (auto), got {requested!r}")
        return requested, "requested"
    cores = available_cores() if cores is None else cores
    if cores <= SINGLE_IO_WORKER_CORES:
        return 1, f"auto: {cores} usable cores, which the computation fills"
    return 2, f"auto: {cores} usable cores"


def enter_helper_scheduling(requested: str) -> str:
    """Put this process's threads, and every thread they start from now on, in `requested`'s class.

    Call it early in a process's entry: threads inherit the class of the thread that starts them
    (ZeroMQ's I/O thread, the readers), and the ones already running (a BLAS pool started when
    numpy was imported) are moved one by one. Returns what the process runs under, logged:
    "batch", "normal", or "normal (<why batch was not applied>)" (a warning)."""
    if requested not in HELPER_SCHEDULING:
        raise ValueError(f"helper scheduling must be one of {HELPER_SCHEDULING}, got {requested!r}")
    batch = getattr(os, "SCHED_BATCH", None)
    if requested == "normal":
        outcome = "normal"
    elif batch is None or not hasattr(os, "sched_setscheduler"):
        outcome = "normal (this platform has no SCHED_BATCH)"
    else:
        moved: list[int] = []
        try:
            for thread in process_threads():
                try:
                    os.sched_setscheduler(thread, batch, os.sched_param(0))
                except ProcessLookupError:  # the thread ended since it was listed
                    continue
                moved.append(thread)
            outcome = "batch"
        except OSError as error:  # e.g. a seccomp profile that forbids it
            _restore(moved)  # all or nothing: the outcome says what every thread runs under
            outcome = f"normal (SCHED_BATCH refused: {error})"
    logger.log(logging.INFO if outcome == requested else logging.WARNING, "scheduling: %s", outcome)
    return outcome


def _restore(threads: list[int]) -> None:
    for thread in threads:
        try:
            os.sched_setscheduler(thread, os.SCHED_OTHER, os.sched_param(0))
        except OSError:  # ended, or refused too: nothing more to do
            pass


def process_threads(pid: int | None = None) -> list[int]:
    """The thread ids of `pid` (None: this process; then 0, the calling thread, where /proc cannot
    list them). Any of them may end before the caller acts on it (ProcessLookupError)."""
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{'self' if pid is None else pid}/task")]
    except OSError:
        if pid is None:
            return [0]
        raise


__all__ = [
    "HELPER_SCHEDULING",
    "SINGLE_IO_WORKER_CORES",
    "available_cores",
    "enter_helper_scheduling",
    "process_threads",
    "resolve_io_workers",
]
