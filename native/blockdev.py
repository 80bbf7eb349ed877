"""What holds a file (Linux): its mount, from the mount table, and its block device's settings, from sysfs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MOUNTS = Path("/proc/self/mounts")


@dataclass(frozen=True, slots=True)
class Mount:
    point: str
    type: str
    options: tuple[str, ...]

    def option(self, name: str) -> str | None:
        """The value of option `name=` (None: not given)."""
        return next((o[len(name) + 1 :] for o in self.options if o.startswith(f"{name}=")), None)


def mount_of(path: str | os.PathLike[str], *, mounts: Path = MOUNTS) -> Mount | None:
    """The mount holding `path`: the longest mount point containing it, and of mounts on the same
    point the last listed (a later mount hides the earlier); None when the table cannot be read."""
    target, found = os.path.realpath(path), None
    try:
        lines = mounts.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    for fields in (line.split() for line in lines):  # device, point, type, options, ...
        if len(fields) < 4:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (found is None or len(point) >= len(found.point)):
            found = Mount(point, fields[2], tuple(fields[3].split(",")))
    return found


def queue_setting(path: str | os.PathLike[str], name: str, *, sysfs: Path = Path("/sys")) -> int | None:
    """The integer `queue/<name>` of the block device holding `path`; None where unknown."""
    st = os.stat(path)
    device = sysfs / "dev" / "block" / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    # A partition has no queue/ of its own; its parent directory does.
    for queue in (device / "queue", device.resolve().parent / "queue"):
        try:
            return int((queue / name).read_text().strip())
        except (OSError, ValueError):
            continue
    return None
