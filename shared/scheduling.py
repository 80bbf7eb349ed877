"""How the helpers share the CPU with the computation: the scheduling class or the CPU of the
coordinator and the I/O workers (Linux), and how many I/O workers there are (`resolve_io_workers`).

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

`last-cpu` keeps the default class and puts every helper thread on the last CPU the process may
use (`auto`, the default, picks it on a Linux host of at most 2 usable cores: there the two compute
lanes fill both, and the helpers then preempt the computation on one core only, and wake one
another on the core they share instead of across cores). Default benchmark at 25%, bench_ab
against `normal`, 12 rounds of 2 passes: 1.014 (pass medians 1.014, 1.018; faster in 9), lease
and IPC wait 3.20 -> 2.32 ms a token, I/O-worker CPU 16.0 -> 14.7 ms a token; deep bench shape
1.018 (pass medians 1.024, 1.016; faster in 10). SCHED_IDLE,
measured the same way, moved less than the noise (1.006; pass medians 1.013, 1.006), starves the
helpers whenever anything else wants the CPU, and an unprivileged process cannot leave it: it is
not offered.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

logger = logging.getLogger(__name__)

HELPER_SCHEDULING = ("auto", "batch", "last-cpu", "normal")

# A host of at most this many usable cores is one the computation fills (two compute lanes on a CPU
# backend): auto then picks one I/O worker (`resolve_io_workers`) and last-cpu (`resolve_helper_scheduling`).
FILLED_BY_COMPUTE_CORES = 2


def available_cores() -> int:
    """CPUs this process may run on (its affinity where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity call
        return os.cpu_count() or 1


def resolve_io_workers(requested: int | None, *, cores: int | None = None) -> tuple[int, str]:
    """(I/O worker processes, why): `requested` when given, else auto: one on a host of at most
    FILLED_BY_COMPUTE_CORES usable cores (`cores`, default `available_cores()`), two otherwise.

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
    if cores <= FILLED_BY_COMPUTE_CORES:
        return 1, f"auto: {cores} usable cores, which the computation fills"
    return 2, f"auto: {cores} usable cores"


def resolve_helper_scheduling(
    requested: str, *, cores: int | None = None, platform: str | None = None
) -> tuple[str, str]:
    """(what the helpers run under, why): `requested` unless it is `auto`, which is `last-cpu` on a
    Linux host of at most FILLED_BY_COMPUTE_CORES usable cores (`cores`, default `available_cores()`)
    and `normal` elsewhere (more cores leave the helpers some; macOS has no CPU affinity)."""
    if requested not in HELPER_SCHEDULING:
        raise ValueError(f"helper scheduling must be one of {HELPER_SCHEDULING}, got {requested!r}")
    if requested != "auto":
        return requested, "requested"
    cores = available_cores() if cores is None else cores
    platform = sys.platform if platform is None else platform
    if platform.startswith("linux") and cores <= FILLED_BY_COMPUTE_CORES:
        return "last-cpu", f"auto: {cores} usable cores, which the computation fills"
    return "normal", f"auto: {cores} usable cores on {platform}"


def enter_helper_scheduling(requested: str) -> str:
    """Put this process's threads, and every thread they start from now on, in `requested`'s class
    (`batch`), or on the last CPU this process may use (`last-cpu`); `normal` changes nothing,
    `auto` is `resolve_helper_scheduling`'s choice.

    Call it early in a process's entry: threads inherit the class and the CPUs of the thread that
    starts them (ZeroMQ's I/O thread, the readers), and the ones already running (a BLAS pool
    started when numpy was imported) are moved one by one. Returns what the process runs under,
    logged: the request, or "normal (<why it was not applied>)" (a warning)."""
    requested, why = resolve_helper_scheduling(requested)
    if why != "requested":
        logger.info("scheduling: %s (%s)", requested, why)
    if requested == "normal":
        outcome = "normal"
    elif requested == "last-cpu":
        outcome = _enter_last_cpu()
    elif (batch := getattr(os, "SCHED_BATCH", None)) is None or not hasattr(os, "sched_setscheduler"):
        outcome = "normal (this platform has no SCHED_BATCH)"
    else:
        refused = _move_every_thread(
            lambda thread: os.sched_setscheduler(thread, batch, os.sched_param(0)),
            back=lambda thread: os.sched_setscheduler(thread, os.SCHED_OTHER, os.sched_param(0)),
        )
        outcome = "batch" if refused is None else f"normal (SCHED_BATCH refused: {refused})"
    logger.log(logging.INFO if outcome == requested else logging.WARNING, "scheduling: %s", outcome)
    return outcome


def _enter_last_cpu() -> str:
    """Every thread of this process on the last CPU it may use: "last-cpu", or why not."""
    if not hasattr(os, "sched_setaffinity"):  # macOS
        return "normal (this platform has no CPU affinity)"
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        return f"normal (one usable CPU: {sorted(cpus)})"
    last = max(cpus)
    refused = _move_every_thread(
        lambda thread: os.sched_setaffinity(thread, {last}), back=lambda thread: os.sched_setaffinity(thread, cpus)
    )
    if refused is not None:
        return f"normal (CPU affinity refused: {refused})"
    logger.info("scheduling: every thread on CPU %d of %s", last, sorted(cpus))
    return "last-cpu"


def _move_every_thread(move: Callable[[int], None], *, back: Callable[[int], None]) -> OSError | None:
    """`move` each thread of this process; all or nothing (so that the outcome says what every
    thread runs under): at a refusal (e.g. a seccomp profile) the ones moved go `back`, and the
    refusal is returned. A thread that ended since it was listed is no refusal."""
    moved: list[int] = []
    try:
        for thread in process_threads():
            try:
                move(thread)
            except ProcessLookupError:
                continue
            moved.append(thread)
    except OSError as error:
        for thread in moved:
            try:
                back(thread)
            except OSError:  # ended, or refused too: nothing more to do
                pass
        return error
    return None


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
    "FILLED_BY_COMPUTE_CORES",
    "HELPER_SCHEDULING",
    "available_cores",
    "enter_helper_scheduling",
    "process_threads",
    "resolve_helper_scheduling",
    "resolve_io_workers",
]
