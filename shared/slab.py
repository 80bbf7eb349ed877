"""The expert slab: one POSIX shared-memory segment of fixed-size slots.

The supervisor creates it (`Slab.create`), every worker attaches by name
(`Slab.attach`), and the creator unlinks it. posix_ipc rather than
`multiprocessing.shared_memory`, whose resource tracker unlinks a segment
while other processes still use it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import secrets
import sys

import posix_ipc

from shared.checks import require_int

# Every run's segment name starts with this, so stale ones of dead runs can be found.
SLAB_NAME_PREFIX = "/moeslab-"
# macOS limits POSIX shm names to 31 bytes including the terminator.
MAX_NAME_LENGTH = 30
# Metal wraps host memory without copying only at page granularity (16 KiB on Apple silicon).
SLOT_ALIGNMENT = 16 * 1024
_PAGE = mmap.PAGESIZE


# A short tag (e.g. a test session's) that every name this process tree creates carries,
# so a leak check can tell its own segments from those of concurrent runs.
SLAB_TAG_ENV = "MOESLAB_SHM_TAG"


def new_slab_name() -> str:
    """A random per-run segment name: `/moeslab-`, an optional tag, 12 hex digits."""
    tag = os.environ.get(SLAB_TAG_ENV, "")
    if tag and not (tag.isascii() and tag.isalnum() and len(tag) <= 8):  # no tag (unset or empty) is fine
        raise ValueError(f"{SLAB_TAG_ENV} must be at most 8 ASCII letters or digits, got {tag!r}")
    return f"{SLAB_NAME_PREFIX}{tag + '-' if tag else ''}{secrets.token_hex(6)}"


def check_slab_name(name: str) -> str:
    """Return `name` if it is a valid slab segment name, else raise naming it."""
    if not isinstance(name, str) or not name.startswith(SLAB_NAME_PREFIX):
        raise ValueError(f"slab name must start with {SLAB_NAME_PREFIX!r}, got {name!r}")
    if len(name) > MAX_NAME_LENGTH or "/" in name[1:]:
        raise ValueError(f"slab name must be at most {MAX_NAME_LENGTH} characters with one leading '/', got {name!r}")
    return name


def check_slot_bytes(slot_bytes: int) -> int:
    """Return `slot_bytes` if it is a positive multiple of 16 KiB, else raise."""
    value = require_int(slot_bytes, "slot_bytes", minimum=1)
    if value % SLOT_ALIGNMENT:
        raise ValueError(f"slot_bytes must be a multiple of {SLOT_ALIGNMENT} (16 KiB), got {value}")
    return value


def _mincore_bytes(buffer: mmap.mmap, size: int) -> int:
    """Resident bytes of a mapping by mincore(2), for systems without tmpfs st_blocks."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    pages = (size + _PAGE - 1) // _PAGE
    vector = (ctypes.c_ubyte * pages)()
    anchor = ctypes.c_char.from_buffer(buffer)
    try:
        rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vector)
    finally:
        del anchor  # release the buffer export so the mmap can close
    if rc != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"mincore failed: {os.strerror(error)}")
    return sum(byte & 1 for byte in vector) * _PAGE


class Slab:
    """A mapped slab of `total_slots` slots of `slot_bytes` each.

    `buffer` is the writable mmap; `slot_view(slot)` a memoryview of one slot.
    `tail_bytes` after the slots hold the lease words (`shared.lease_words`, at `tail_offset`):
    one segment to create, unlink and check for leaks. As a context manager it closes the
    mapping on exit and, for the creator, also unlinks the segment.
    """

    def __init__(
        self,
        *,
        name: str,
        total_slots: int,
        slot_bytes: int,
        memory: posix_ipc.SharedMemory,
        owner: bool,
        tail_bytes: int = 0,
    ) -> None:
        self.name = name
        self.total_slots = total_slots
        self.slot_bytes = slot_bytes
        self.tail_offset = total_slots * slot_bytes
        self.tail_bytes = tail_bytes
        self.size = self.tail_offset + tail_bytes
        self.owner = owner
        self._memory = memory
        self._fd: int | None = memory.fd
        self.buffer: mmap.mmap | None = mmap.mmap(memory.fd, self.size)
        self._unlinked = False

    @classmethod
    def create(
        cls,
        *,
        total_slots: int,
        slot_bytes: int,
        name: str | None = None,
        prefault: bool = False,
        tail_bytes: int = 0,
    ) -> Slab:
        """Create a new segment (O_CREX, mode 0600) of the slots and `tail_bytes`, and map it.

        `prefault` allocates every page up front so the first loads do not pay
        for page allocation and the footprint is the whole slab from the start.
        """
        slots = require_int(total_slots, "total_slots", minimum=1)
        stride = check_slot_bytes(slot_bytes)
        segment = check_slab_name(name) if name is not None else new_slab_name()
        tail = require_int(tail_bytes, "tail_bytes")
        memory = posix_ipc.SharedMemory(segment, posix_ipc.O_CREX, mode=0o600, size=slots * stride + tail)
        try:
            slab = cls(name=segment, total_slots=slots, slot_bytes=stride, memory=memory, owner=True, tail_bytes=tail)
        except BaseException:
            memory.close_fd()
            memory.unlink()
            raise
        if prefault:
            try:
                slab.prefault()
            except BaseException:
                slab.close()
                slab.unlink()
                raise
        return slab

    @classmethod
    def attach(cls, name: str, *, total_slots: int, slot_bytes: int, tail_bytes: int = 0) -> Slab:
        """Map an existing segment (its slots and `tail_bytes`); refuse one smaller than that."""
        slots = require_int(total_slots, "total_slots", minimum=1)
        stride = check_slot_bytes(slot_bytes)
        tail = require_int(tail_bytes, "tail_bytes")
        memory = posix_ipc.SharedMemory(check_slab_name(name))
        try:
            actual = os.fstat(memory.fd).st_size
            if actual < slots * stride + tail:
                raise ValueError(
                    f"slab {name} has {actual} bytes; {slots} slots of {stride} bytes and {tail} bytes of "
                    f"lease words need {slots * stride + tail}"
                )
            return cls(name=name, total_slots=slots, slot_bytes=stride, memory=memory, owner=False, tail_bytes=tail)
        except BaseException:
            memory.close_fd()
            raise

    def _mapped(self) -> mmap.mmap:
        if self.buffer is None:
            raise ValueError(f"slab {self.name} is closed")
        return self.buffer

    def slot_offset(self, slot: int) -> int:
        """Byte offset of `slot` in the segment."""
        index = require_int(slot, "slot")
        if index >= self.total_slots:
            raise ValueError(f"slot {index} is outside the slab's {self.total_slots} slots")
        return index * self.slot_bytes

    def slot_view(self, slot: int) -> memoryview:
        """A writable memoryview of one slot; release it before `close()`."""
        return self.slots_view(slot, 1)

    def slots_view(self, first: int, count: int) -> memoryview:
        """A writable memoryview of `count` consecutive slots from `first`; release it before `close()`."""
        offset = self.slot_offset(first)
        if count < 1 or first + count > self.total_slots:
            raise ValueError(f"slots [{first}, {first + count}) are not within the slab's {self.total_slots} slots")
        return memoryview(self._mapped())[offset : offset + count * self.slot_bytes]

    def prefault(self) -> None:
        """Allocate every page of the segment now."""
        if self._fd is not None and hasattr(os, "posix_fallocate"):
            os.posix_fallocate(self._fd, 0, self.size)
            return
        view = memoryview(self._mapped())
        try:
            for offset in range(0, self.size, _PAGE):
                view[offset] = 0
        finally:
            view.release()

    def resident_bytes(self) -> int:
        """Physically allocated bytes of the segment (the slab's real footprint)."""
        if sys.platform.startswith("linux") and self._fd is not None:
            # tmpfs counts allocated pages in st_blocks, whoever touched them.
            return os.fstat(self._fd).st_blocks * 512
        return _mincore_bytes(self._mapped(), self.size)

    def close(self) -> None:
        """Release the mapping and the descriptor (idempotent). Views must be released first."""
        if self.buffer is not None:
            self.buffer.close()  # BufferError while a view is still exported: stays open
            self.buffer = None
        if self._fd is not None:
            self._fd = None
            self._memory.close_fd()

    def unlink(self) -> None:
        """Remove the segment name (idempotent); mappings stay valid until closed."""
        if self._unlinked:
            return
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            pass
        self._unlinked = True

    @property
    def closed(self) -> bool:
        return self.buffer is None

    def __enter__(self) -> Slab:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.close()
        finally:
            if self.owner:
                self.unlink()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"Slab({self.name!r}, {self.total_slots} x {self.slot_bytes} bytes, {state})"


__all__ = [
    "MAX_NAME_LENGTH",
    "SLAB_NAME_PREFIX",
    "SLOT_ALIGNMENT",
    "Slab",
    "check_slab_name",
    "check_slot_bytes",
    "new_slab_name",
]
