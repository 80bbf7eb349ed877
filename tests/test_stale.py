"""Stale-run cleanup: a dead launcher's segment and run directory go, nothing else does.

In process, over fabricated runs: a record whose pid is gone, a zombie, or
reused by another process is dead (its segment and directory are removed);
a live record, a directory without a readable record, a record naming a
segment that is not a moeslab slab, and a segment no record names are left
alone; a given run directory of a dead run is cleared of the launch's files
only, and one of a live run is refused. End to end: a second supervisor
leaves a live one alone; SIGKILL of the supervisor stops its children
(death pipes) and the next supervisor's start removes what it left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import posix_ipc
import psutil
import pytest

from shared.client import Client
from shared.slab import Slab
from shared.store import ExpertStore
from supervisor.rundir import (
    RUN_RECORD,
    RunDirInUse,
    claim_run_dir,
    clean_stale_runs,
    process_start,
    read_run_record,
    write_run_record,
)
from tests.helpers.supervisor import launch, model_args, tiny_model
from tests.helpers.system import tight_budget, wait_for


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory)


def _segment() -> str:
    slab = Slab.create(total_slots=1, slot_bytes=16384)
    slab.close()
    return slab.name


def _exists(name: str) -> bool:
    try:
        posix_ipc.SharedMemory(name).close_fd()
        return True
    except posix_ipc.ExistentialError:
        return False


def _unlink(*names: str) -> None:
    for name in names:
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            pass


def _run(parent, name: str, *, pid: int, start: str | None, slab: str) -> str:
    path = parent / name
    path.mkdir(mode=0o700)
    (path / "jobs").write_text("")  # stands in for a socket file
    record = dict(pid=pid, start=start, slab=slab, created=time.time(), version=1)
    (path / RUN_RECORD).write_text(json.dumps(record))
    return str(path)


def test_only_dead_runs_are_removed(tmp_path):
    parent = tmp_path / "parent"
    parent.mkdir()
    sleeper = subprocess.Popen(["sleep", "30"])
    zombie_start = process_start(sleeper.pid)
    gone = subprocess.Popen(["true"])
    gone.wait()
    names = {key: _segment() for key in ("gone", "zombie", "reused", "live", "orphan")}
    foreign = f"/moeslabx-{os.getpid()}"  # not a slab name: never unlinked, whatever a record says
    posix_ipc.SharedMemory(foreign, posix_ipc.O_CREX, size=4096).close_fd()
    try:
        sleeper.kill()
        assert wait_for(lambda: psutil.Process(sleeper.pid).status() == psutil.STATUS_ZOMBIE)  # not reaped yet
        dead = {
            "gone": _run(parent, "moeslab-gone", pid=gone.pid, start="x:1", slab=names["gone"]),
            "zombie": _run(parent, "moeslab-zombie", pid=sleeper.pid, start=zombie_start, slab=names["zombie"]),
            "reused": _run(parent, "moeslab-reused", pid=os.getpid(), start="not-this-process", slab=names["reused"]),
        }
        live = parent / "moeslab-live"
        live.mkdir()
        write_run_record(live, names["live"])
        kept = [str(live)]
        for name in ("moeslab-norecord", "moeslab-garbage", "moeslab-foreign"):
            (parent / name).mkdir()
            kept.append(str(parent / name))
        (parent / "moeslab-garbage" / RUN_RECORD).write_text("{not json")
        (parent / "moeslab-foreign" / RUN_RECORD).write_text(
            json.dumps(dict(pid=gone.pid, start="x:1", slab=foreign, created=0.0, version=1))
        )
        (parent / "moeslab-file").write_text("not a directory")
        (parent / "other-run").mkdir()
        (parent / "other-run" / RUN_RECORD).write_text(
            json.dumps(dict(pid=gone.pid, start="x:1", slab=names["orphan"], created=0.0, version=1))
        )  # not our prefix

        report = clean_stale_runs(parent)

        assert sorted(report.removed_dirs) == sorted(dead.values())
        assert sorted(report.removed_segments) == sorted(names[key] for key in dead)
        assert report.live == (str(live),)
        assert sorted(report.unattributed) == sorted(kept[1:])
        for key, path in dead.items():
            assert not os.path.exists(path) and not _exists(names[key]), key
        for path in kept + [str(parent / "moeslab-file"), str(parent / "other-run")]:
            assert os.path.exists(path), path
        assert _exists(names["live"]) and _exists(names["orphan"]) and _exists(foreign)
        assert read_run_record(live).pid == os.getpid()
    finally:
        sleeper.wait()
        _unlink(foreign, *names.values())


def test_a_given_run_dir_of_a_dead_run_is_cleared_and_a_live_ones_refused(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    segment, live_segment = _segment(), _segment()
    try:
        run = tmp_path / "given"
        run.mkdir()
        (run / RUN_RECORD).write_text(json.dumps(dict(pid=gone.pid, start="x:1", slab=segment, created=0.0)))
        for name in ("config.json", "manifest.json", "io", "gpu", "jobs"):
            (run / name).write_text("")
        (run / "notes.txt").write_text("the user's")
        claim_run_dir(run)
        assert not _exists(segment)
        assert [p.name for p in run.iterdir()] == ["notes.txt"]
        write_run_record(run, live_segment)
        with pytest.raises(RunDirInUse, match=f"live run \\(pid {os.getpid()}"):
            claim_run_dir(run)
        assert _exists(live_segment)
        claim_run_dir(tmp_path / "nothing-here")  # no directory, no record: nothing to do
    finally:
        _unlink(segment, live_segment)


def test_a_killed_supervisor_stops_its_children_and_the_next_start_cleans_up(model, tmp_path):
    store = ExpertStore.open(model)
    too_small = model_args(model, budget=tight_budget(store) - 1)  # runs the cleanup, then refuses
    first = launch(tmp_path, model_args(model))
    slab, run_dir = first.ready["slab"], first.ready["run_dir"]
    children = [pid for key, pid in first.pids.items() if key != "supervisor"]

    second = launch(tmp_path, too_small, expect_ready=False, name="second")
    assert second.process.returncode == 1 and "removed the run" not in second.stderr()
    assert os.path.exists(f"/dev/shm{slab}") and os.path.isdir(run_dir)
    with Client(first.endpoint, timeout=30) as client:
        assert client.health().ready  # the live run is untouched

    first.process.send_signal(signal.SIGKILL)
    first.process.wait()

    def stopped() -> bool:
        for pid in children:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    return False
            except psutil.NoSuchProcess:
                pass
        return True

    assert wait_for(stopped, timeout=30), "children outlived their supervisor"
    assert os.path.exists(f"/dev/shm{slab}") and os.path.isdir(run_dir)  # nobody cleaned up: it was killed

    third = launch(tmp_path, too_small, expect_ready=False, name="third")
    assert third.process.returncode == 1
    assert f"removed the run of dead process {first.process.pid}: {run_dir} (slab {slab})" in third.stderr()
    assert not os.path.exists(f"/dev/shm{slab}") and not os.path.exists(run_dir)
