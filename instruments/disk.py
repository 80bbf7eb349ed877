"""The checkpoint's read bandwidth with the I/O workers' native reader, and the mount a path is on.

`disk_bandwidth` reads random experts as the I/O workers read a layer visit's misses (every
segment of a batch in flight on the native pool), which gives the disk term of the streaming
roofline; `resolve_io_mode` picks buffered reads where the model is on tmpfs (which refuses
O_DIRECT) and direct reads on a real disk.
"""

from __future__ import annotations

import mmap
import os
import random
import time
from typing import Any

from instruments.figures import MB, median
from native.blockdev import mount_of


def mount_type(path: str | os.PathLike[str]) -> str:
    """The file system type of the mount holding `path` (`native.blockdev.mount_of`), or "unknown"."""
    mount = mount_of(path)
    return "unknown" if mount is None else mount.type


def resolve_io_mode(requested: str, path: str | os.PathLike[str]) -> str:
    """`requested` unless "auto": then buffered where `path` is on tmpfs or ramfs (no O_DIRECT), else direct."""
    if requested != "auto":
        return requested
    return "buffered" if mount_type(path) in ("tmpfs", "ramfs") else "direct"


def disk_bandwidth(store, *, experts: int, batch: int, threads: int, io_mode: str, seed: int = 7) -> dict[str, Any]:
    """Random experts of the checkpoint read with the native reader into a page-aligned region.

    `batch` experts at a time with all their segments in flight on `threads` native threads (a
    layer visit's misses, as the I/O workers read them), then one expert at a time (a lone miss).
    Reported MB/s count the experts' own bytes (alignment slack excluded), as `miss_bytes` does.
    """
    from native import BypassFile, ReadPool

    rng = random.Random(seed)
    pairs = [(layer, expert) for layer in store.sparse_layers for expert in range(store.experts_per_layer)]
    rng.shuffle(pairs)
    batched, single = pairs[:experts], pairs[experts : experts + max(4, experts // 4)]
    region = mmap.mmap(-1, max(batch, 1) * store.slot_bytes)
    mode = "direct" if io_mode == "direct" else "buffered"
    files = [BypassFile.open(path, mode=mode, block_size=store.block_size) for path in store.manifest]
    try:
        with ReadPool(threads=threads) as pool:

            def read(group) -> tuple[int, float]:
                ops = [
                    files[seg.file].op(seg.offset, seg.length, k * store.slot_bytes + seg.destination)
                    for k, (layer, expert) in enumerate(group)
                    for seg in store.locate(layer, expert).segments
                ]
                t0 = time.perf_counter()
                results = pool.read(region, ops, block_size=store.block_size)
                elapsed = time.perf_counter() - t0
                bad = [r.describe() for r in results if not r.ok]
                if bad:
                    raise OSError(f"disk benchmark read failed: {bad[0]}")
                return sum(r.delivered for r in results), elapsed

            read(batched[:1])  # open/first-touch costs out of the figures
            total = seconds = 0.0
            for start in range(0, len(batched), batch):
                got, elapsed = read(batched[start : start + batch])
                total, seconds = total + got, seconds + elapsed
            lone = [read([pair]) for pair in single]
    finally:
        for handle in files:
            handle.close()
        region.close()
    lone_bytes, lone_s = sum(b for b, _ in lone), sum(s for _, s in lone)
    return {
        "mode": files[0].mode if files else mode,
        "experts": len(batched),
        "batch": batch,
        "threads": threads,
        "MBps": total / seconds / MB if seconds else 0.0,
        "single_expert_ms": median([s * 1e3 for _, s in lone]),
        "single_MBps": lone_bytes / lone_s / MB if lone_s else 0.0,
    }
