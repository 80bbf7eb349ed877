"""instruments/read_throttle.py: a cgroup that limits reads from the model's disk for a benchmark's
processes, entered and left cleanly (the process back where it was, the group gone)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from instruments.read_throttle import (
    GROUP_PREFIX,
    ReadThrottle,
    ThrottleError,
    groups_left,
    hierarchy,
    unavailable,
    whole_disk,
)

NEEDS_CGROUPS = pytest.mark.skipif(unavailable() is not None, reason=f"read limit unavailable: {unavailable()}")


def _group_lines() -> list[str]:
    return Path("/proc/self/cgroup").read_text().splitlines()


def test_the_device_is_the_whole_disk_holding_the_path(tmp_path):
    disk = Path(f"/sys/dev/block/{whole_disk(tmp_path)}").resolve()
    assert disk.is_dir() and not (disk / "partition").exists()  # a disk, not one of its partitions
    held = os.stat(tmp_path).st_dev
    holder = Path(f"/sys/dev/block/{os.major(held)}:{os.minor(held)}").resolve()
    assert holder == disk or holder.parent == disk  # the path's own device, or the disk it is a partition of


def test_a_path_on_no_block_device_and_a_bad_rate_are_refused_by_value():
    with pytest.raises(ThrottleError, match="/proc is not on a block device"):
        whole_disk("/proc")
    for bad in (0, -5, 1.5, True, "100"):
        with pytest.raises(ValueError, match=f"got {bad!r}"):
            ReadThrottle("/", bad)


@NEEDS_CGROUPS
def test_reads_of_a_child_go_through_the_limit_and_leaving_removes_the_group(tmp_path):
    data = tmp_path / "data"
    data.write_bytes(os.urandom(4 << 20))
    before = _group_lines()
    with ReadThrottle(data, 500_000_000) as throttle:
        group = throttle.group
        assert group is not None and group.name == f"{GROUP_PREFIX}{os.getpid()}" and group.is_dir()
        assert str(os.getpid()) in (group / "cgroup.procs").read_text().split()
        # A process started now inherits the group: its direct reads are counted (and limited) there.
        subprocess.run(["dd", f"if={data}", "of=/dev/null", "iflag=direct", "bs=1M"], check=True, capture_output=True)
        assert throttle.bytes_read() >= 4 << 20
    assert throttle.group is None and not group.exists() and not groups_left()
    assert _group_lines() == before  # back where it was


@NEEDS_CGROUPS
def test_a_group_left_by_a_killed_benchmark_is_removed_by_the_next(tmp_path):
    stale = hierarchy()[0] / f"{GROUP_PREFIX}999999999"  # no such process: its benchmark is gone
    stale.mkdir()
    try:
        with ReadThrottle(tmp_path, 500_000_000):
            assert not stale.exists()
    finally:
        if stale.exists():
            stale.rmdir()
