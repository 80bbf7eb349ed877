"""Huge-page staging buffers for direct reads, and when to use them.

The kernel maps an O_DIRECT read onto one DMA segment per physically
contiguous run of the destination, and a block device caps the segments of one
request (`queue/max_segments`). A slab in POSIX shared memory lives on 4 KiB
pages (the tmpfs at /dev/shm gets huge pages only when mounted with `huge=always`
or `huge=within_size`, or when `shmem_enabled` is `force`), so a 2.8 MiB
read into a slot becomes three or more requests of about 1 MiB when the device
allows 4 MiB ones. A disk that serves requests one after another, as a virtio
disk behind a VMM does, moves fewer bytes per second that way (measured here:
about 1.45 GB/s with one request per read, 0.85–1.2 GB/s split). Reading into a
per-thread buffer on transparent huge pages and copying into the slot makes each
read one request, at the cost of one memcpy on the reader thread.

`choose_staging` decides from sysfs and the mount table whether that trade pays
on the disk holding the files (`slab_gets_huge_pages`: a slab already on huge
pages takes whole reads, and staging would only add the copy); `StagingBuffer`
allocates the buffers and reports whether the kernel really backed them with
huge pages.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from native.blockdev import MOUNTS, mount_of, queue_setting

logger = logging.getLogger(__name__)

StagingRequest = Literal["auto", "on", "off"]
STAGING_REQUESTS: tuple[StagingRequest, ...] = ("auto", "on", "off")

HUGE_PAGE = 2 << 20
PAGE = 4096
DEFAULT_STRIDE = 4 << 20  # without a device limit to go by: a few MiB, like an expert


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True, slots=True)
class StagingChoice:
    """Whether direct reads go through staging, and with which sizes."""

    enabled: bool
    reason: str
    stride: int = 0  # staging bytes per reader thread (one request at most)
    stage_above: int = 0  # reads up to this many bytes go straight to the slab


def _setting(path: Path) -> str | None:
    """The bracketed choice of a sysfs setting such as 'always [madvise] never'."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else text.strip()


SHM_DIR = "/dev/shm"  # where glibc's shm_open, and so posix_ipc, puts the slab on Linux


def slab_gets_huge_pages(
    *, sysfs: Path = Path("/sys"), mounts: Path = MOUNTS, directory: str = SHM_DIR
) -> tuple[bool, str]:
    """Whether a slab created in `directory` (a tmpfs) gets transparent huge pages, and why.

    `shmem_enabled` governs the kernel's internal shmem mount (SysV, memfd, shared anonymous
    maps), not a tmpfs mount such as /dev/shm, except its `deny` and `force`; a tmpfs mount's
    own `huge=` option decides. `advise` needs an madvise before the pages are touched, which a
    slab allocated by fallocate never gets, so it counts as no."""
    shmem = _setting(sysfs / "kernel" / "mm" / "transparent_hugepage" / "shmem_enabled")
    if shmem in ("deny", "force"):
        return shmem == "force", f"shmem_enabled={shmem}"
    mount = mount_of(directory, mounts=mounts)
    huge = mount.option("huge") if mount is not None and mount.point == directory else None  # its own mount
    return huge in ("always", "within_size"), f"{directory} mounted with huge={huge or 'never'}"


def _queue_limits(path: str, sysfs: Path) -> tuple[int, int] | None:
    """(max_segments, max request bytes) of the block device holding `path`."""
    segments = queue_setting(path, "max_segments", sysfs=sysfs)
    request_kb = queue_setting(path, "max_sectors_kb", sysfs=sysfs)
    return None if segments is None or request_kb is None else (segments, request_kb * 1024)


def choose_staging(
    paths: Sequence[str],
    *,
    largest_read: int,
    requested: StagingRequest = "auto",
    sysfs: Path = Path("/sys"),
    mounts: Path = MOUNTS,
    platform: str = sys.platform,
) -> StagingChoice:
    """Decide staging for direct reads of `paths` of up to `largest_read` bytes.

    `auto` stages only on Linux, for a slab that does not get huge pages itself
    (`slab_gets_huge_pages`), with anonymous transparent huge pages available, and a
    device whose segment limit (not its request size limit) is what splits such a read.
    `on` stages every direct read (tests, experiments); `off` never does."""
    if requested not in STAGING_REQUESTS:
        raise ValueError(f"staging must be one of {STAGING_REQUESTS}, got {requested!r}")
    if largest_read <= 0:
        raise ValueError(f"largest_read must be positive, got {largest_read}")
    if requested == "off":
        return StagingChoice(False, "staging off by request")
    if requested == "on":
        stride = _round_up(min(largest_read + PAGE, 64 << 20), HUGE_PAGE)
        return StagingChoice(True, "staging on by request", stride, 0)
    if not platform.startswith("linux"):
        return StagingChoice(False, f"no O_DIRECT request splitting to avoid on {platform}")
    huge, why = slab_gets_huge_pages(sysfs=sysfs, mounts=mounts)
    if huge:
        return StagingChoice(False, f"the slab gets huge pages itself ({why})")
    anon = _setting(sysfs / "kernel" / "mm" / "transparent_hugepage" / "enabled")
    if anon not in ("always", "madvise"):
        return StagingChoice(False, f"anonymous transparent huge pages unavailable (enabled={anon})")
    limits = [(path, _queue_limits(path, sysfs)) for path in paths]
    unknown = [path for path, limit in limits if limit is None]
    if unknown:
        return StagingChoice(False, f"no block device queue limits for {unknown[0]}")
    segment_bytes = min(segments for _, (segments, _) in limits) * PAGE  # type: ignore[misc]
    request_bytes = min(request for _, (_, request) in limits)  # type: ignore[misc]
    if segment_bytes >= min(request_bytes, largest_read):
        reason = (
            f"reads of {largest_read} bytes are not split by the segment limit ({segment_bytes} bytes of "
            f"4 KiB pages, requests up to {request_bytes})"
        )
        return StagingChoice(False, reason)
    stride = _round_up(min(largest_read + PAGE, request_bytes), HUGE_PAGE)
    return StagingChoice(
        True,
        f"segment limit splits reads above {segment_bytes} bytes; the device takes requests up to {request_bytes}",
        stride,
        segment_bytes,
    )


def _anon_huge_bytes(address: int, smaps: Path = Path("/proc/self/smaps")) -> int:
    """AnonHugePages of the mapping that holds `address` (0 where unknown)."""
    try:
        lines = smaps.read_text().splitlines()
    except OSError:
        return 0
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and ":" not in head:
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


class StagingBuffer:
    """`threads` strides of anonymous memory, 2 MiB aligned, advised onto huge pages
    and touched so the pages exist before the first read."""

    def __init__(self, *, threads: int, stride: int) -> None:
        if threads < 1 or stride <= 0 or stride % HUGE_PAGE:
            raise ValueError(
                f"need threads >= 1 and a positive multiple of {HUGE_PAGE} as stride, got {threads} and {stride}"
            )
        self.threads, self.stride, self.size = threads, stride, threads * stride
        self._map = mmap.mmap(-1, self.size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        anchor = ctypes.c_char.from_buffer(self._map)
        base = ctypes.addressof(anchor)
        del anchor  # an export would keep the map from closing
        self._skip = -base % HUGE_PAGE
        self.address = base + self._skip
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE, self._skip, self.size)
        self.view: memoryview | None = memoryview(self._map)[self._skip : self._skip + self.size]
        for start in range(0, self.size, PAGE):
            self.view[start] = 0
        self.huge_bytes = _anon_huge_bytes(self.address)

    def close(self) -> None:
        """Release the memory; the pool using it must be closed and gone first."""
        if self.view is not None:
            self.view.release()
            self.view = None
            self._map.close()
