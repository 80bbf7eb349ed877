"""shared/pid_watch.py: a process watched from its pid on, through a pidfd where the kernel has one and
through psutil (logged) where it has not; both say the same thing at each step of a process's life."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest

from coordinator.liveness import kill_hung
from shared import pid_watch
from shared.pid_watch import PIDFD, PSUTIL, PidWatch, platform_liveness

HAS_PIDFD = hasattr(os, "pidfd_open")
KINDS = [pytest.param(True, id="pidfd", marks=pytest.mark.skipif(not HAS_PIDFD, reason="no pidfd here")), False]


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("use_pidfd", KINDS)
def test_a_watch_sees_its_process_run_then_exit_before_it_is_reaped(use_pidfd):
    child = _sleeper()
    watch = PidWatch(child.pid, use_pidfd=use_pidfd)
    try:
        assert watch.kind == (PIDFD if use_pidfd else PSUTIL)
        assert watch.alive()
        assert watch.kill()
        assert _until(lambda: not watch.alive())  # a zombie: exited, not yet reaped
        assert child.poll() is None or child.returncode == -9
        child.wait(timeout=5)
        assert child.returncode == -9  # the watch's SIGKILL
        assert not watch.alive() and not watch.kill()  # gone: nothing to kill
    finally:
        watch.close()
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.mark.parametrize("use_pidfd", KINDS)
def test_a_closed_watch_says_dead_and_kills_nothing(use_pidfd):
    child = _sleeper()
    try:
        watch = PidWatch(child.pid, use_pidfd=use_pidfd)
        watch.close()
        watch.close()  # idempotent
        assert not watch.alive() and not watch.kill()
        assert child.poll() is None  # the process itself was left alone
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("use_pidfd", KINDS)
def test_a_pid_that_names_no_process_is_dead_from_the_start(use_pidfd):
    child = _sleeper()
    child.kill()
    child.wait()  # reaped: the pid names nothing (until the kernel reuses it, which a watch never follows)
    watch = PidWatch(child.pid, use_pidfd=use_pidfd)
    assert not watch.alive() and not watch.kill()
    watch.close()


@pytest.mark.skipif(not HAS_PIDFD, reason="no pidfd here")
def test_a_pidfd_watch_holds_one_descriptor_until_closed():
    child = _sleeper()
    try:
        before = len(os.listdir("/proc/self/fd"))
        watch = PidWatch(child.pid)
        assert len(os.listdir("/proc/self/fd")) == before + 1
        watch.close()
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        child.kill()
        child.wait()


def test_the_psutil_fallback_is_logged_once(caplog, monkeypatch):
    monkeypatch.setattr(pid_watch, "_fallback_logged", False)
    caplog.set_level(logging.WARNING, logger="shared.pid_watch")
    watches = [PidWatch(os.getpid(), use_pidfd=False) for _ in range(3)]
    assert all(w.kind == PSUTIL and w.alive() for w in watches)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["process liveness falls back to psutil (disabled): each look reads the process table"]
    for watch in watches:
        watch.close()


def test_a_platform_without_pidfd_falls_back_and_says_so(caplog, monkeypatch):
    monkeypatch.setattr(pid_watch, "_fallback_logged", False)
    monkeypatch.setattr(pid_watch, "_platform_kind", None)
    monkeypatch.delattr(pid_watch.os, "pidfd_open", raising=False)
    caplog.set_level(logging.WARNING, logger="shared.pid_watch")
    watch = PidWatch(os.getpid())
    assert watch.kind == PSUTIL and watch.alive()
    assert "falls back to psutil (no pidfd on this platform)" in caplog.text
    assert platform_liveness() == PSUTIL
    watch.close()


def test_the_platform_liveness_is_what_a_watch_uses():
    watch = PidWatch(os.getpid())
    assert platform_liveness() == watch.kind == (PIDFD if HAS_PIDFD else PSUTIL)
    watch.close()


@pytest.mark.parametrize("pid", [0, -1, True, 1.5, "12"])
def test_bad_pids_are_refused(pid):
    with pytest.raises(ValueError, match="pid must be a positive int"):
        PidWatch(pid)


@pytest.mark.parametrize("use_pidfd", KINDS)
def test_kill_hung_kills_through_the_watch_and_says_when_it_was_already_gone(caplog, use_pidfd):
    caplog.set_level(logging.INFO, logger="coordinator.liveness")
    child = _sleeper()
    watch = PidWatch(child.pid, use_pidfd=use_pidfd)
    try:
        kill_hung(watch, child.pid, "I/O worker 0", "silent")
        child.wait(timeout=5)
        assert child.returncode == -9
        kill_hung(watch, child.pid, "I/O worker 0", "silent")
        assert f"I/O worker 0 (pid {child.pid}) could not be killed: it had already exited" in caplog.text
        kill_hung(None, 4242, "GPU worker", "silent")  # no watch (no hello): nothing is signalled
        assert "GPU worker (pid 4242) could not be killed" in caplog.text
    finally:
        watch.close()
        if child.poll() is None:
            child.kill()
            child.wait()
