"""Settings of the block device that holds a file, from sysfs (Linux)."""

from __future__ import annotations

import os
from pathlib import Path


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
