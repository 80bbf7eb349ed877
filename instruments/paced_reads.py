"""Expert reads at a fixed rate, in a process of their own: the I/O a streaming run must do, without it.

    python -m instruments.paced_reads MODEL_DIR --rate-mbps R [--batch N] [--io-mode direct|buffered] [--seed S]

Random experts of the checkpoint (every sparse layer alike, as random weights route) are read
`--batch` at a time (one layer visit's misses) with the native reader the I/O workers use (kernel
AIO on Linux, all of a batch's ranges in flight at once) into a private page-aligned region,
paced so that the bytes read never run ahead of `--rate-mbps` (MB = 1e6). No slab, no messages,
no Python between the reads but the pacing: `scripts/bench_floor.py` runs this beside a resident
system to measure what the reads alone cost its decode.

Prints `{"reading": true}` once the files are open, then, on SIGTERM or SIGINT (or when its
parent is gone), one JSON line: bytes, loads, seconds, MB/s and the process's CPU while reading (user and system).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import resource
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run by path: the checkout's packages first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from instruments.figures import MB
from native import BypassFile, ReadPool
from shared.store import ExpertStore


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--rate-mbps", type=float, required=True, help="bytes read per second, in MB (1e6)")
    parser.add_argument("--batch", type=int, default=1, help="experts read together (a layer visit's misses)")
    parser.add_argument("--io-mode", choices=("direct", "buffered"), default="direct")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.rate_mbps > 0:
        parser.error(f"--rate-mbps must be > 0, got {args.rate_mbps}")
    if args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")
    return args


def read_paced(store: ExpertStore, *, rate_bps: float, batch: int, io_mode: str, seed: int, stop) -> dict:
    """Read random experts, `batch` at a time, at most `rate_bps` bytes a second, until `stop()`."""
    rng = random.Random(seed)
    # Every expert's ranges looked up once: per read, only the ops are built (a small model's reads
    # come hundreds a second, and this process's own CPU is part of what it measures).
    ranges = [
        [(seg.file, seg.offset, seg.length, seg.destination) for seg in store.locate(layer, expert).segments]
        for layer in store.sparse_layers
        for expert in range(store.experts_per_layer)
    ]
    if not 1 <= batch <= len(ranges):
        raise ValueError(f"batch must be in [1, {len(ranges)}] (the checkpoint's routed experts), got {batch}")
    region = mmap.mmap(-1, batch * store.slot_bytes)
    files: list[BypassFile] = []
    loads = total = 0
    try:
        files.extend(BypassFile.open(path, mode=io_mode, block_size=store.block_size) for path in store.manifest)
        with ReadPool(threads=1) as pool:
            print(json.dumps({"reading": True, "mode": files[0].mode}), flush=True)
            started, before = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
            while not stop():
                # Pacing: a batch starts only once the bytes already read are due at the rate.
                due = started + total / rate_bps
                if (wait := due - time.monotonic()) > 0:
                    time.sleep(min(wait, 0.05))  # a signal's stop is seen within 50 ms at any rate
                    continue
                ops = [
                    files[file].op(offset, length, k * store.slot_bytes + destination)
                    for k, expert in enumerate(rng.sample(ranges, batch))
                    for file, offset, length, destination in expert
                ]
                results = pool.read(region, ops, block_size=store.block_size)
                bad = [r.describe() for r in results if not r.ok]
                if bad:
                    raise OSError(f"paced read failed: {bad[0]}")
                total += sum(r.delivered for r in results)
                loads += batch
            seconds, after = time.monotonic() - started, resource.getrusage(resource.RUSAGE_SELF)
    finally:
        for handle in files:
            handle.close()
        region.close()
    return {
        "bytes": total,
        "loads": loads,
        "seconds": seconds,
        "MBps": total / seconds / MB if seconds > 0 else 0.0,
        "cpu_user_s": after.ru_utime - before.ru_utime,  # while reading: start-up's imports left out
        "cpu_system_s": after.ru_stime - before.ru_stime,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    stopping: list[int] = []
    parent = os.getppid()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda number, _frame: stopping.append(number))
    try:
        report = read_paced(
            ExpertStore.open(args.model),
            rate_bps=args.rate_mbps * MB,
            batch=args.batch,
            io_mode=args.io_mode,
            seed=args.seed,
            stop=lambda: bool(stopping) or os.getppid() != parent,  # a parent gone leaves no reader behind
        )
    except (OSError, ValueError) as error:  # an unknown model, a file it cannot open or read, a bad batch
        print(f"paced_reads: error: {args.model}: {error}", file=sys.stderr, flush=True)
        return 2
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
