"""Cache-bypassing batched reads of file ranges into a shared-memory region.

A thin typed layer over the C extension `native._bypassio`:

- `BypassFile.open(path)` opens with O_DIRECT (Linux) or F_NOCACHE (macOS) and
  falls back to buffered reads + posix_fadvise(DONTNEED) where the filesystem
  refuses O_DIRECT. `BypassFile.mode` says which one is in use, never silently.
- `ReadPool(threads=N).read(region, ops)` runs a batch of reads on a native
  pthread pool with the GIL released; each op is a `ReadOp`. With `aio` (Linux)
  the direct reads of a call are submitted together from the caller's thread
  (kernel AIO) instead; `ReadPool.aio_stats()` says whether and how often.
- `advise_willneed` / `advise_dontneed` are advisory readahead calls.

Alignment contract (checked in every mode so a slot layout that works buffered
also works direct): the region's address is a multiple of `block_size`, every
`region_offset` is congruent to its `file_offset` modulo `block_size`, and the
range rounded out to whole blocks lies inside the region. A direct read writes
that whole rounded range; the slack bytes before and after the requested ones
hold neighbouring file bytes.
"""

from __future__ import annotations

import errno as errno_module
import os
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from native import _bypassio
from native.blockdev import queue_setting
from native.staging import StagingBuffer

DEFAULT_BLOCK_SIZE = 4096
MIN_BLOCK_SIZE: int = _bypassio.MIN_BLOCK
MAX_BLOCK_SIZE: int = _bypassio.MAX_BLOCK
STATUS_SHORT_READ: int = _bypassio.STATUS_SHORT_READ
HAVE_O_DIRECT = bool(_bypassio.HAVE_O_DIRECT)
HAVE_AIO = bool(_bypassio.HAVE_AIO)  # Linux kernel AIO built in (io_setup may still be refused)

OpenMode = Literal["auto", "direct", "dontneed", "buffered"]
"""What a caller asks for: `auto` bypasses the cache and falls back when refused;
`direct` bypasses or fails; `dontneed` forces the fallback; `buffered` is plain."""

IOMode = Literal["direct", "nocache", "dontneed", "buffered"]
"""What is in use: O_DIRECT, F_NOCACHE, buffered + DONTNEED, or plain buffered."""

MODES: tuple[IOMode, ...] = tuple(_bypassio.MODES)
BYPASS_MODES: frozenset[IOMode] = frozenset({"direct", "nocache"})


def check_block_size(block_size: int) -> int:
    """Return `block_size` if it is a power of two in [512, 1 MiB], else raise."""
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an integer, got {block_size!r}")
    if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], got {block_size}")
    return block_size


def block_sizes(fd: int) -> dict[str, int]:
    """The sizes the kernel reports for an open file: st_blksize, f_bsize, f_frsize,
    and device_logical (BLKSSZGET, block devices only; -1 otherwise)."""
    return _bypassio.block_sizes(fd)


def device_logical_block_size(path: str | os.PathLike[str]) -> int | None:
    """The logical block size of the device holding `path` (what O_DIRECT needs),
    from BLKSSZGET for a block device or sysfs for a file on Linux; None if unknown.

    st_blksize and f_bsize are the filesystem's preferred I/O size (often 4096),
    not the device's requirement, so they are not used here.
    """
    st = os.stat(path)
    if stat.S_ISBLK(st.st_mode):
        fd = os.open(path, os.O_RDONLY)
        try:
            size = block_sizes(fd)["device_logical"]
        finally:
            os.close(fd)
        return size if size > 0 else None
    if not sys.platform.startswith("linux"):
        return None
    return queue_setting(path, "logical_block_size")


@dataclass(frozen=True, slots=True)
class ReadOp:
    """Read `length` bytes at `file_offset` of `fd` into `region[region_offset:]`."""

    fd: int
    file_offset: int
    length: int
    region_offset: int
    mode: IOMode | None = None  # None: O_DIRECT if the fd has it, else exact buffered

    def as_tuple(self) -> tuple[int, ...]:
        base = (self.fd, self.file_offset, self.length, self.region_offset)
        return base if self.mode is None else (*base, MODES.index(self.mode))


@dataclass(frozen=True, slots=True)
class ReadResult:
    """Outcome of one `ReadOp`: `status` 0, an errno, or STATUS_SHORT_READ."""

    status: int
    delivered: int  # requested bytes now in the region
    transferred: int  # bytes the kernel returned, alignment slack included
    service_ns: int

    @property
    def ok(self) -> bool:
        return self.status == 0

    def describe(self) -> str:
        """A human reason for a failed status ('ok' for success)."""
        if self.status == 0:
            return "ok"
        if self.status == STATUS_SHORT_READ:
            return f"short read at end of file after {self.delivered} requested bytes"
        name = errno_module.errorcode.get(self.status, str(self.status))
        return f"{name}: {os.strerror(self.status)}"


class BypassFile:
    """A read-only file descriptor opened for cache-bypassing reads."""

    def __init__(self, fd: int, path: str, mode: IOMode, requested: OpenMode, size: int) -> None:
        self.fd = fd
        self.path = path
        self.mode: IOMode = mode
        self.requested: OpenMode = requested
        self.size = size

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        mode: OpenMode = "auto",
        block_size: int = DEFAULT_BLOCK_SIZE,
        refuse_direct: bool = False,
    ) -> BypassFile:
        """Open `path`; `refuse_direct` simulates a filesystem that rejects O_DIRECT (tests)."""
        check_block_size(block_size)
        text = os.fspath(path)
        fd, used = _bypassio.open_file(text, mode, block_size, refuse_direct)
        try:
            size = os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, text, used, mode, size)

    @property
    def fell_back(self) -> bool:
        """True when a bypass was asked for and the kernel refused it."""
        return self.requested in ("auto", "direct") and self.mode not in BYPASS_MODES

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def op(self, file_offset: int, length: int, region_offset: int) -> ReadOp:
        return ReadOp(self.fd, file_offset, length, region_offset, self.mode)

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def __enter__(self) -> BypassFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"BypassFile({self.path!r}, mode={self.mode!r}, fd={self.fd})"


@dataclass(frozen=True, slots=True)
class StagingStats:
    """What staging did so far: reads and bytes that went through it, copy time."""

    enabled: bool
    stride: int
    stage_above: int
    staged_reads: int
    staged_bytes: int
    copy_ms: float


@dataclass(frozen=True, slots=True)
class AioStats:
    """The kernel-AIO path of a pool: whether it runs (or why not) and what it did so far."""

    enabled: bool
    reason: str  # why it does not run ("" when it does, or when it was not asked for)
    calls: int  # reads whose direct ranges went through AIO
    ranges: int
    reread: int  # ranges the kernel returned short or failed, read again with pread
    refused: int  # ranges the kernel would not queue, read with pread instead
    busy: int  # reads that found every context in use and ran on the threads


class ReadPool:
    """A native pthread pool of `threads` readers; `read` may be called from many
    Python threads at once, and at most `threads` reads run at any moment.

    With `staging` (a `native.staging.StagingBuffer` of `threads` strides),
    direct reads longer than `stage_above` bytes go through the reader thread's
    stride and are copied into place (see native/staging.py for why). With
    `aio` (Linux) a call's other direct reads are submitted at once from the
    caller's thread through one of `threads` kernel AIO contexts of
    `aio_depth` ranges each (see native/bypassio.c for why); without kernel AIO
    they run on the threads and `aio_stats()` says why."""

    def __init__(
        self,
        *,
        threads: int = 4,
        staging: StagingBuffer | None = None,
        stage_above: int = 0,
        aio: bool = True,
        aio_depth: int = 256,
    ) -> None:
        if staging is None:
            self._pool = _bypassio.Pool(threads, aio=aio, aio_depth=aio_depth)
        else:
            if staging.threads < threads:
                raise ValueError(f"staging holds {staging.threads} strides for {threads} threads")
            self._pool = _bypassio.Pool(threads, staging.view, staging.stride, stage_above, aio, aio_depth)

    def aio_stats(self) -> AioStats:
        asked, setup_errno, contexts, calls, ranges, reread, refused, busy = self._pool.aio
        if not asked:
            reason = "not asked for"
        elif setup_errno:
            name = errno_module.errorcode.get(setup_errno, str(setup_errno))
            reason = f"io_setup failed: {name} ({os.strerror(setup_errno)})"
        else:
            reason = ""
        return AioStats(bool(contexts), reason, calls, ranges, reread, refused, busy)

    @property
    def threads(self) -> int:
        return self._pool.threads

    def staging_stats(self) -> StagingStats:
        enabled, stride, above, reads, staged, copy_ns = self._pool.staging
        return StagingStats(bool(enabled), stride, above, reads, staged, copy_ns / 1e6)

    @property
    def closed(self) -> bool:
        return self._pool.closed

    def read(self, region: object, ops: Sequence[ReadOp], *, block_size: int = DEFAULT_BLOCK_SIZE) -> list[ReadResult]:
        """Fill `region` (a writable buffer, e.g. a slab mmap or a memoryview slice
        of it) with every op, blocking the caller with the GIL released.

        Raises ValueError, before any read, for an op outside the region, a
        misaligned region or destination, or ops whose rounded ranges would
        overwrite each other's requested bytes. Per-op failures are results.
        """
        raw = self._pool.read(region, [op.as_tuple() for op in ops], block_size)
        return [ReadResult(*entry) for entry in raw]

    def close(self) -> None:
        """Finish queued reads and join the threads (idempotent)."""
        self._pool.close()

    def __enter__(self) -> ReadPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_batch(
    region: object,
    ops: Sequence[ReadOp],
    *,
    threads: int = 4,
    block_size: int = DEFAULT_BLOCK_SIZE,
    aio: bool = True,
) -> list[ReadResult]:
    """One-shot `ReadPool.read` on a pool that lives for this call only."""
    with ReadPool(threads=max(1, min(threads, len(ops) or 1)), aio=aio) as pool:
        return pool.read(region, ops, block_size=block_size)


def advise_willneed(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start reading a range into the page cache (advisory)."""
    _bypassio.advise(fd, offset, length, "willneed")


def advise_dontneed(fd: int, offset: int = 0, length: int = 0) -> None:
    """Drop a range (length 0: to the end) of a file from the page cache; dirty
    pages are kept, so fsync first to drop freshly written data (no-op on macOS)."""
    _bypassio.advise(fd, offset, length, "dontneed")


__all__ = [
    "BYPASS_MODES",
    "DEFAULT_BLOCK_SIZE",
    "HAVE_AIO",
    "HAVE_O_DIRECT",
    "MAX_BLOCK_SIZE",
    "MIN_BLOCK_SIZE",
    "MODES",
    "STATUS_SHORT_READ",
    "AioStats",
    "BypassFile",
    "IOMode",
    "OpenMode",
    "ReadOp",
    "ReadPool",
    "ReadResult",
    "StagingStats",
    "advise_dontneed",
    "advise_willneed",
    "block_sizes",
    "check_block_size",
    "device_logical_block_size",
    "read_batch",
]
