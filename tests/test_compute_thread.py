"""The bench's figures of the GPU worker's compute thread: per-thread scheduler times from /proc."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from instruments.machine import compute_thread_ms_per_token, thread_schedstats

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/<pid>/task/<tid>/schedstat")


def _spin(until: float) -> None:
    while time.perf_counter() < until:
        pass


@linux_only
def test_a_thread_that_spins_between_the_readings_is_the_one_that_ran_longest():
    holder: dict[str, dict[int, tuple[int, int, int]]] = {}

    def spin_and_read() -> None:
        holder["start"] = thread_schedstats(os.getpid())
        _spin(time.perf_counter() + 0.3)
        holder["end"] = thread_schedstats(os.getpid())

    spinner = threading.Thread(target=spin_and_read)
    spinner.start()
    spinner.join()
    assert spinner.native_id in holder["start"] and spinner.native_id in holder["end"]
    assert threading.get_native_id() in holder["end"]  # this thread (waiting on the join) is read too
    figures = compute_thread_ms_per_token(holder["start"], holder["end"], 10)
    # 0.3 s of spinning over 10 tokens; a busy host may take some of it away as waiting.
    assert figures is not None and 15 <= figures["run_ms_per_token"] + figures["wait_ms_per_token"] <= 60
    assert figures["run_ms_per_token"] > 5
    assert figures["threads_wait_ms_per_token"] >= figures["wait_ms_per_token"] >= 0
    # A count of the kernel's, never smaller at the later reading (how often depends on the host).
    assert figures["preempted_per_token"] >= 0
    assert all(holder["end"][t][2] >= holder["start"][t][2] for t in holder["start"].keys() & holder["end"].keys())


def _involuntary_switches() -> int:
    with open(f"/proc/self/task/{threading.get_native_id()}/status") as file:
        return next(int(line.split()[1]) for line in file if line.startswith("nonvoluntary_ctxt_switches:"))


@linux_only
def test_the_preemptions_are_the_threads_own_involuntary_switches():
    # The kernel's count only grows: read between two readings of it, it lies between them.
    before = _involuntary_switches()
    stats = thread_schedstats(os.getpid())
    after = _involuntary_switches()
    assert before <= stats[threading.get_native_id()][2] <= after


def test_the_thread_that_ran_longest_is_picked_and_a_thread_started_in_between_counts_from_zero():
    before = {1: (100_000_000, 5_000_000, 10), 2: (50_000_000, 0, 3)}
    after = {1: (150_000_000, 25_000_000, 30), 2: (60_000_000, 1_000_000, 90), 3: (80_000_000, 4_000_000, 8)}
    # Thread 3 (new) ran 80 ms, thread 1 50 ms, thread 2 10 ms: thread 3 is the compute thread (its
    # preemptions are its own 8, not thread 2's 87).
    figures = compute_thread_ms_per_token(before, after, 4)
    assert figures == pytest.approx(
        {
            "run_ms_per_token": 20.0,
            "wait_ms_per_token": 1.0,
            "threads_wait_ms_per_token": (20 + 1 + 4) / 4,
            "preempted_per_token": 2.0,
        }
    )
    # A thread gone by the second reading is not in it and counts nothing.
    assert compute_thread_ms_per_token(before, {1: after[1]}, 1) == pytest.approx(
        {
            "run_ms_per_token": 50.0,
            "wait_ms_per_token": 20.0,
            "threads_wait_ms_per_token": 20.0,
            "preempted_per_token": 20.0,
        }
    )


def test_no_figures_without_both_readings_of_one_process():
    assert compute_thread_ms_per_token({}, {1: (1, 1, 1)}, 3) is None
    assert compute_thread_ms_per_token({1: (1, 1, 1)}, {}, 3) is None
    # No thread in common: a restarted worker's threads would count their whole lives.
    assert compute_thread_ms_per_token({1: (1, 1, 1)}, {7: (9_000_000, 1, 1)}, 3) is None


def test_a_process_that_is_gone_has_no_threads_to_read():
    assert thread_schedstats(2**22 + 12345) == {}
