"""A read-rate limit on the model's disk for the systems a benchmark starts (Linux cgroups, as root).

Users' machines are mostly I/O-bound (an Apple GPU computes a layer in 0.2-0.5 ms, an expert read
takes longer); this host's CPU is the bottleneck instead. Limiting the disk's read rate for the
processes under test gives the bandwidth-bound regime here: at 300 MB/s the default benchmark
decoded 1.19x as fast with `--prefetch on` reading top-k only as with its margin, and auto paused
prefetch altogether (README, bench_ab).

`ReadThrottle(path, bytes_per_s)` makes a cgroup that limits reads from the disk holding `path`
(cgroup v1 `blkio.throttle.read_bps_device`, or v2 `io.max` `rbps`) and moves the calling process
into it, so every process it starts from then on inherits the limit; leaving moves it back and
removes the group. A group left by a benchmark that was killed is removed by the next one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
GROUP_PREFIX = "moeslab-throttle-"


class ThrottleError(RuntimeError):
    """The limit cannot be had here (no cgroup controller for it, not root, an unknown disk)."""


def whole_disk(path: str | os.PathLike[str]) -> str:
    """`MAJOR:MINOR` of the disk (not the partition) that holds `path`: the device the limit names."""
    device = os.stat(path).st_dev
    sysfs = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}")
    if not sysfs.exists():
        raise ThrottleError(f"{path} is not on a block device ({os.major(device)}:{os.minor(device)})")
    if (sysfs / "partition").exists():
        sysfs = sysfs.resolve().parent  # a partition's directory sits in its disk's
    return (sysfs / "dev").read_text().strip()


def hierarchy() -> tuple[Path, str]:
    """(where groups are made, "v1" | "v2"); ThrottleError where no controller limits reads."""
    v1 = CGROUP_ROOT / "blkio"
    if (v1 / "blkio.throttle.read_bps_device").exists():
        return v1, "v1"
    controllers = CGROUP_ROOT / "cgroup.controllers"  # a v2-only host mounts the unified hierarchy here
    if controllers.exists() and "io" in controllers.read_text().split():
        return CGROUP_ROOT, "v2"
    raise ThrottleError("no cgroup controller limits reads here (neither v1 blkio nor v2 io)")


def unavailable() -> str | None:
    """Why a read limit cannot be had on this machine (None: it can): it takes root and a cgroup
    controller that limits reads."""
    if os.geteuid() != 0:
        return "a read limit needs root (cgroups)"
    try:
        hierarchy()
    except (ThrottleError, OSError) as error:
        return str(error)
    return None


def groups_left() -> list[Path]:
    """The groups of read limits that exist now (a benchmark's while it runs; a killed one's, stale)."""
    return sorted(hierarchy()[0].glob(f"{GROUP_PREFIX}*"))


def _remove_stale(base: Path) -> None:
    for group in base.glob(f"{GROUP_PREFIX}*"):
        pid = group.name.removeprefix(GROUP_PREFIX)
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _rmdir(group)  # fails (EBUSY) while a process is still in it: then it stays


@dataclass
class ReadThrottle:
    """Reads from the disk holding `path` limited to `bytes_per_s` for this process and its future children."""

    path: str | os.PathLike[str]
    bytes_per_s: int
    group: Path | None = field(default=None, init=False)
    device: str = field(default="", init=False)
    _home: Path | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if isinstance(self.bytes_per_s, bool) or not isinstance(self.bytes_per_s, int) or self.bytes_per_s < 1:
            raise ValueError(f"a read limit must be a positive number of bytes a second, got {self.bytes_per_s!r}")

    def __enter__(self) -> ReadThrottle:
        self.device = whole_disk(self.path)
        base, version = hierarchy()
        _remove_stale(base)
        home = self._current(base, version)
        group = base / f"{GROUP_PREFIX}{os.getpid()}"
        try:
            group.mkdir(exist_ok=True)
            if version == "v1":
                (group / "blkio.throttle.read_bps_device").write_text(f"{self.device} {self.bytes_per_s}\n")
            else:
                (base / "cgroup.subtree_control").write_text("+io\n")
                (group / "io.max").write_text(f"{self.device} rbps={self.bytes_per_s}\n")
            (group / "cgroup.procs").write_text(f"{os.getpid()}\n")
        except OSError as error:
            _rmdir(group)
            raise ThrottleError(f"cannot limit reads of {self.device} to {self.bytes_per_s} B/s: {error}") from error
        self.group, self._home = group, home
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if self.group is None:
            return
        group, self.group = self.group, None
        try:
            (self._home / "cgroup.procs").write_text(f"{os.getpid()}\n")  # type: ignore[operator]
        finally:
            # Children that were stopped may take a moment to leave the group (their exit).
            deadline = time.monotonic() + 5.0
            while not (removed := _rmdir(group)) and time.monotonic() < deadline:
                time.sleep(0.05)
        if not removed and kind is None:
            raise ThrottleError(f"{group} still holds processes 5 s on: remove it (rmdir) once they have exited")

    def bytes_read(self) -> int:
        """Bytes the group's processes read from the disk so far (what the limit applied to)."""
        if self.group is None:
            return 0
        if (self.group / "blkio.throttle.io_service_bytes").exists():
            for line in (self.group / "blkio.throttle.io_service_bytes").read_text().splitlines():
                words = line.split()
                if len(words) == 3 and words[0] == self.device and words[1] == "Read":
                    return int(words[2])
            return 0
        for line in (self.group / "io.stat").read_text().splitlines():
            if line.startswith(f"{self.device} "):
                return int(dict(word.split("=", 1) for word in line.split()[1:] if "=" in word).get("rbytes", 0))
        return 0

    @staticmethod
    def _current(base: Path, version: str) -> Path:
        """The group this process is in now, in the hierarchy the limit uses (where it goes back to)."""
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            number, controllers, where = line.split(":", 2)
            if (version == "v1" and "blkio" in controllers.split(",")) or (version == "v2" and number == "0"):
                return base / where.lstrip("/")
        return base


def _rmdir(group: Path) -> bool:
    try:
        group.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


__all__ = ["ReadThrottle", "ThrottleError", "groups_left", "hierarchy", "unavailable", "whole_disk"]
