"""The arithmetic of the bench's figures: the MB unit, medians and the serial streaming roofline.

Every module of the decode benchmark reports MB/s and medians over repeats; one definition keeps
the figures comparable.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

MB = 1e6


def median(values: Sequence[float]) -> float:
    """The median, 0.0 for no values (a part that did not run reports zeros, not an error)."""
    return float(statistics.median(values)) if values else 0.0


def roofline(t_compute_s: float, miss_bytes: float, disk_MBps: float) -> float:
    """Serial roofline tok/s: compute, then the token's misses read at the disk's bandwidth."""
    seconds = t_compute_s + (miss_bytes / (disk_MBps * MB) if disk_MBps > 0 else 0.0)
    return 1.0 / seconds if seconds > 0 else 0.0
