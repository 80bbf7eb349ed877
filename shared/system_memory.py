"""The whole system's memory: each process's proportional set size, the slab counted once.

PSS splits every shared page among the processes that map it, so summing it
over the system's processes counts a shared library's pages once, not once
per process. The slab is the exception: its pages live in a tmpfs file and
count in PSS only while some process has them mapped and touched. So the
slab's share (`Pss_Shmem`) is taken out of each process and the slab file's
allocated blocks are added once instead, whoever touched them (and pages no
process maps right now still count, as they still take memory).

    footprint = sum over processes of (Pss - Pss_Shmem) + slab resident bytes

On Linux this reads `/proc/PID/smaps_rollup` (one small read per process;
kernel ≥ 4.14, `Pss_Shmem` since 5.x: without it the slab's share stays in,
which can only overstate). Elsewhere PSS is not available: psutil's USS is
used (private pages only: shared library pages are then not counted at all).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import psutil

PSS_SOURCE = "smaps_rollup" if sys.platform.startswith("linux") else "uss"


@dataclass(frozen=True, slots=True)
class ProcessMemory:
    """One process's share of memory: `pss` less its share of shared-memory files (the slab)."""

    pss: int
    shmem: int

    @property
    def own(self) -> int:
        return max(0, self.pss - self.shmem)


def process_memory(pid: int) -> ProcessMemory:
    """PSS and its shared-memory part for `pid`; psutil.NoSuchProcess if it is gone."""
    if not sys.platform.startswith("linux"):
        return ProcessMemory(pss=psutil.Process(pid).memory_full_info().uss, shmem=0)
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as rollup:
            text = rollup.read()
    except (FileNotFoundError, ProcessLookupError):
        raise psutil.NoSuchProcess(pid) from None
    except PermissionError:
        raise psutil.AccessDenied(pid) from None
    fields: dict[bytes, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(b":")
        if name in (b"Pss", b"Pss_Shmem", b"SwapPss"):
            fields[name] = int(rest.split()[0]) * 1024  # kB
    if b"Pss" not in fields:  # a zombie's rollup is empty
        raise psutil.NoSuchProcess(pid)
    # Swapped-out private pages still belong to the process: swapping must not hide pressure.
    return ProcessMemory(pss=fields[b"Pss"] + fields.get(b"SwapPss", 0), shmem=fields.get(b"Pss_Shmem", 0))


def private_bytes(pid: int) -> int | None:
    """`pid`'s anonymous memory, resident or swapped (`RssAnon` + `VmSwap` of /proc/PID/status,
    counters the kernel keeps: a constant-time read, against `process_memory`'s walk of every
    mapped page, 37 ms of kernel time for a GPU worker of 3.3 GB here). None off Linux, or when
    `pid` is gone. The heap, MLX's buffers and the KV cache are anonymous: what this moves by is
    what the process's own share moves by, save its file pages."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            text = status.read()
    except OSError:
        return None
    fields = dict(line.split(b":", 1) for line in text.splitlines() if line.startswith((b"RssAnon:", b"VmSwap:")))
    if b"RssAnon" not in fields:  # a kernel thread, or a zombie
        return None
    return sum(int(value.split()[0]) * 1024 for value in fields.values())  # kB


def child_pids(pid: int) -> list[int]:
    """`pid`'s children now (a process the system's processes started, such as MLX's kernel
    compiler, is part of the system); [] when `pid` is gone."""
    if sys.platform.startswith("linux"):
        children: list[int] = []
        try:  # one small file per thread: cheaper than psutil's scan of every process
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children", "rb") as listing:
                    children += (int(child) for child in listing.read().split())
        except OSError:
            pass
        else:
            return children
    try:
        return [child.pid for child in psutil.Process(pid).children()]
    except psutil.Error:
        return []


def descendant_pids(pid: int, *, skip: Collection[int] = ()) -> list[int]:
    """Every process below `pid` (MLX's compiler is g++, which runs cc1plus: a grandchild), except
    those in `skip` and theirs (the system's own processes, counted each in its own right)."""
    found, pending = [], child_pids(pid)
    while pending:
        child = pending.pop()
        if child in skip:
            continue
        found.append(child)
        pending += child_pids(child)
    return found


def processes_memory(pids: Iterable[int]) -> dict[int, ProcessMemory]:
    """`process_memory` of each pid still there (a process that is gone is left out)."""
    readings: dict[int, ProcessMemory] = {}
    for pid in dict.fromkeys(pids):
        try:
            readings[pid] = process_memory(pid)
        except (psutil.Error, OSError):
            continue
    return readings


def system_footprint(readings: Mapping[int, ProcessMemory], slab_resident_bytes: int) -> int:
    """The module docstring's sum: every process's own share plus the slab once."""
    return sum(reading.own for reading in readings.values()) + slab_resident_bytes


__all__ = [
    "PSS_SOURCE",
    "ProcessMemory",
    "child_pids",
    "descendant_pids",
    "private_bytes",
    "process_memory",
    "processes_memory",
    "system_footprint",
]
