"""The helpers' scheduling (shared/scheduling.py): a class or the last CPU applied to a process and
the threads it starts, the default kept on request, and what cannot be had reported, not faked."""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys

import pytest

from shared import scheduling
from shared.scheduling import enter_helper_scheduling

LINUX_ONLY = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling classes")
TWO_CPUS = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs CPU affinity, 2+ CPUs"
)

# A fresh interpreter, so the test process keeps its own class: a thread runs before it enters
# one (as a BLAS pool started by an import would), another is started after.
_PROBE = """
import os, sys, threading
from shared.scheduling import enter_helper_scheduling
go, ids = threading.Event(), []
before = threading.Thread(target=lambda: (ids.append(threading.get_native_id()), go.wait()))
before.start()
while not ids:
    pass
print(enter_helper_scheduling(sys.argv[1]))
seen = []
after = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))
after.start(); after.join()
print(os.sched_getscheduler(0), os.sched_getscheduler(ids[0]), seen[0])
cpus = []
after = threading.Thread(target=lambda: cpus.append(os.sched_getaffinity(0)))
after.start(); after.join()
print(repr([sorted(c) for c in (os.sched_getaffinity(0), os.sched_getaffinity(ids[0]), cpus[0])]))
go.set(); before.join()
"""


def _probe(requested: str, *, cpus: bool = False) -> tuple[str, list]:
    """What `requested` gave: the outcome, and the policies (or CPU sets) of the main thread, a
    thread started before, one after."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, requested], capture_output=True, text=True, timeout=60, check=True
    )
    outcome, policies, affinities = done.stdout.splitlines()
    return outcome, ast.literal_eval(affinities) if cpus else [int(policy) for policy in policies.split()]


@LINUX_ONLY
def test_batch_holds_for_every_thread_of_the_process_and_the_ones_it_starts_later():
    assert _probe("batch") == ("batch", [os.SCHED_BATCH] * 3)


@LINUX_ONLY
def test_normal_keeps_the_default_class():
    assert _probe("normal") == ("normal", [os.SCHED_OTHER] * 3)
    assert _probe("normal", cpus=True) == ("normal", [sorted(os.sched_getaffinity(0))] * 3)


@TWO_CPUS
def test_last_cpu_holds_for_every_thread_of_the_process_and_the_ones_it_starts_later():
    assert _probe("last-cpu", cpus=True) == ("last-cpu", [[max(os.sched_getaffinity(0))]] * 3)
    assert _probe("last-cpu") == ("last-cpu", [os.SCHED_OTHER] * 3)  # the class stays the default


def test_last_cpu_is_the_last_of_the_allowed_ones_not_of_the_machine(monkeypatch, caplog):
    moves: list[tuple[int, set[int]]] = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5}, raising=False)
    monkeypatch.setattr(os, "sched_setaffinity", lambda thread, cpus: moves.append((thread, set(cpus))), raising=False)
    monkeypatch.setattr(scheduling, "process_threads", lambda: [11, 12])
    with caplog.at_level(logging.INFO, logger="shared.scheduling"):
        assert enter_helper_scheduling("last-cpu") == "last-cpu"
    assert moves == [(11, {5}), (12, {5})]
    assert "every thread on CPU 5 of [0, 2, 5]" in caplog.text


def test_last_cpu_without_a_second_cpu_or_affinity_keeps_the_default_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)
    monkeypatch.setattr(os, "sched_setaffinity", lambda thread, cpus: pytest.fail("moved a thread"), raising=False)
    with caplog.at_level(logging.WARNING, logger="shared.scheduling"):
        assert enter_helper_scheduling("last-cpu") == "normal (one usable CPU: [3])"
    monkeypatch.delattr(os, "sched_setaffinity")
    with caplog.at_level(logging.WARNING, logger="shared.scheduling"):
        assert enter_helper_scheduling("last-cpu") == "normal (this platform has no CPU affinity)"
    assert "one usable CPU: [3]" in caplog.text and "no CPU affinity" in caplog.text


def test_a_refused_cpu_move_puts_the_moved_threads_back_and_says_why(monkeypatch, caplog):
    calls: list[tuple[int, set[int]]] = []

    def refuse_the_third(thread, cpus):
        calls.append((thread, set(cpus)))
        if thread == 12:
            raise ProcessLookupError(3, "No such process")  # ended since it was listed: no refusal
        if thread == 13 and cpus == {1}:
            raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "sched_setaffinity", refuse_the_third, raising=False)
    monkeypatch.setattr(scheduling, "process_threads", lambda: [11, 12, 13])
    with caplog.at_level(logging.WARNING, logger="shared.scheduling"):
        outcome = enter_helper_scheduling("last-cpu")
    assert outcome.startswith("normal (CPU affinity refused:") and "not permitted" in outcome
    assert outcome in caplog.text
    assert calls == [(11, {1}), (12, {1}), (13, {1}), (11, {0, 1})]


def test_a_platform_without_batch_keeps_the_default_and_says_so(monkeypatch, caplog):
    monkeypatch.delattr(os, "SCHED_BATCH", raising=False)
    with caplog.at_level(logging.WARNING, logger="shared.scheduling"):
        assert enter_helper_scheduling("batch") == "normal (this platform has no SCHED_BATCH)"
    assert "no SCHED_BATCH" in caplog.text


@LINUX_ONLY
def test_a_refused_class_keeps_the_default_for_every_thread_and_says_why(monkeypatch, caplog):
    """Refused at the second thread: the first one moved goes back, so the outcome holds for all;
    a thread that ended since it was listed is no refusal."""
    calls: list[tuple[int, int]] = []

    def refuse_the_second(thread, policy, param):
        calls.append((thread, policy))
        if thread == 12:
            raise ProcessLookupError(3, "No such process")
        if policy == os.SCHED_BATCH and len(calls) > 2:
            raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(scheduling, "process_threads", lambda: [11, 12, 13])
    monkeypatch.setattr(os, "sched_setscheduler", refuse_the_second)
    with caplog.at_level(logging.WARNING, logger="shared.scheduling"):
        outcome = enter_helper_scheduling("batch")
    assert outcome.startswith("normal (SCHED_BATCH refused:") and "not permitted" in outcome
    assert outcome in caplog.text
    assert calls == [(11, os.SCHED_BATCH), (12, os.SCHED_BATCH), (13, os.SCHED_BATCH), (11, os.SCHED_OTHER)]


def test_auto_is_last_cpu_on_a_linux_host_the_computation_fills_else_normal(monkeypatch, caplog):
    resolve = scheduling.resolve_helper_scheduling
    assert [resolve("auto", cores=n, platform="linux")[0] for n in (1, 2, 3, 8)] == ["last-cpu"] * 2 + ["normal"] * 2
    why = "auto: 2 usable cores, which the computation fills"
    assert resolve("auto", cores=2, platform="linux") == ("last-cpu", why)
    assert resolve("auto", cores=2, platform="darwin") == ("normal", "auto: 2 usable cores on darwin")
    assert resolve("batch", cores=2, platform="linux") == ("batch", "requested")  # a request is kept
    for bad in ("idle", "", None):
        with pytest.raises(ValueError, match=f"got {bad!r}"):
            resolve(bad)
    entered: list[str] = []
    monkeypatch.setattr(scheduling, "_enter_last_cpu", lambda: entered.append("last-cpu") or "last-cpu")
    monkeypatch.setattr(scheduling, "available_cores", lambda: 2)
    monkeypatch.setattr(sys, "platform", "linux")
    with caplog.at_level(logging.INFO, logger="shared.scheduling"):
        assert enter_helper_scheduling("auto") == "last-cpu" and entered == ["last-cpu"]
    assert "scheduling: last-cpu (auto: 2 usable cores, which the computation fills)" in caplog.text
    monkeypatch.setattr(scheduling, "available_cores", lambda: 4)
    assert enter_helper_scheduling("auto") == "normal" and entered == ["last-cpu"]


def test_an_unknown_class_is_refused_by_name():
    with pytest.raises(ValueError, match="'idle'"):
        enter_helper_scheduling("idle")


def test_io_workers_auto_is_one_where_the_computation_fills_the_cores_else_two(monkeypatch):
    assert [scheduling.resolve_io_workers(None, cores=n)[0] for n in (1, 2, 3, 4, 64)] == [1, 1, 2, 2, 2]
    assert scheduling.resolve_io_workers(None, cores=2) == (1, "auto: 2 usable cores, which the computation fills")
    assert scheduling.resolve_io_workers(None, cores=8) == (2, "auto: 8 usable cores")
    monkeypatch.setattr(scheduling, "available_cores", lambda: 3)  # what auto asks when not told
    assert scheduling.resolve_io_workers(None) == (2, "auto: 3 usable cores")
    monkeypatch.setattr(scheduling, "available_cores", lambda: 2)
    assert scheduling.resolve_io_workers(None)[0] == 1
    assert scheduling.resolve_io_workers(3, cores=2) == (3, "requested")  # a request is kept whatever the cores
    for bad in (0, -1, True, 1.0, "2"):
        with pytest.raises(ValueError, match=f"got {bad!r}"):
            scheduling.resolve_io_workers(bad)


def test_available_cores_is_this_process_affinity_where_there_is_one():
    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert scheduling.available_cores() == expected
