"""Expert loads through real I/O workers vs plain Python reads vs fio O_DIRECT.

    python scripts/bench_io.py --file /path/big.bin --block-size 1M --count 512 --workers 2 --json

Loads `--count` blocks of `--block-size` at random offsets aligned to `--align`
(4 KiB) of `--file` (created with random bytes if missing) through `--workers`
I/O worker processes into a slab, keeping workers x queue-depth reads
outstanding; then the same reads with os.preadv on a thread pool of that size
(page cache for the file dropped first; kernel readahead still applies), then
fio --direct=1 --rw=randread at the same block size, depth and --blockalign
(offset alignment changes throughput on some disks, so both sides share it).
A virtual disk may cache below the guest, so a range read twice is faster the
second time and the later measurements gain: `--order` sets the order, and
`--disjoint` gives each method its own third of the file. With --model DIR it loads random experts of that model instead
(via shared.store.ExpertStore), and fio reads the largest manifest file.
With --json the last line is one JSON object.

The workers' staging (native/staging.py: direct reads through huge-page
buffers, one device request per read where the slab's 4 KiB pages would split
it) follows `--staging`, `auto` by default; the summary says whether it ran and
what it copied, so a run with `--staging off` shows what it is worth.

CPU a load: the workers' processes (all threads, from /proc) and this process (the
coordinator's side of the protocol) over the measured loads, and fio's jobs (their own
usr + sys, start-up excluded). On a host whose cores all compute, this is what each read
takes from decode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil

from coordinator.io_pool import IOWorkerPool
from coordinator.residency_types import summarize_expert_latencies
from instruments.fio import bench_fio
from native import DEFAULT_BLOCK_SIZE, advise_dontneed
from shared.checks import align_up
from shared.segments import ExpertIOSegment
from shared.slab import SLOT_ALIGNMENT, Slab

MB = 1e6


def parse_size(text: str) -> int:
    """'4096', '1M', '2.65M', '2G' (binary multiples) -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def make_file(path: Path, size: int) -> None:
    """Write `size` random bytes and fsync, so the page cache can be dropped."""
    rng = np.random.default_rng()
    chunk = 64 << 20
    with open(path, "wb") as handle:
        for start in range(0, size, chunk):
            handle.write(rng.bytes(min(chunk, size - start)))
        handle.flush()
        os.fsync(handle.fileno())


def drop_cache(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            advise_dontneed(fd)
        finally:
            os.close(fd)


def raw_loads(
    block: int, count: int, seed: int, align: int, region: tuple[int, int]
) -> list[tuple[ExpertIOSegment, ...]]:
    """`count` reads at random `align`-ed offsets with the whole block inside [start, end)."""
    start, end = region
    if end - start < block + align:
        raise SystemExit(f"a region of {end - start} bytes is too small for blocks of {block}")
    rng = random.Random(seed)
    first, last = -(-start // align), (end - block) // align
    return [(ExpertIOSegment(0, rng.randint(first, last) * align, block, 0),) for _ in range(count)]


def regions(size: int, disjoint: bool) -> dict[str, tuple[int, int]]:
    """Byte range of the file each method reads: the whole file, or one third each.

    Disks with a cache below the guest make a range read twice faster the second
    time, so whoever runs later would gain from the earlier runs' reads."""
    if not disjoint:
        return dict.fromkeys(("workers", "python", "fio"), (0, size))
    third = size // 3 // (1 << 20) * (1 << 20)
    return {"workers": (0, third), "python": (third, 2 * third), "fio": (2 * third, 3 * third)}


def model_loads(model: str, count: int, seed: int) -> tuple[list[str], int, list[tuple[ExpertIOSegment, ...]]]:
    from shared.store import ExpertStore  # written separately; only needed here

    store = ExpertStore.open(model, block_size=DEFAULT_BLOCK_SIZE)
    rng = random.Random(seed)
    loads = []
    for _ in range(count):
        layer = rng.choice(store.sparse_layers)
        location = store.locate(layer, rng.randrange(store.experts_per_layer))
        loads.append(tuple(location.segments))
    return list(store.manifest), store.slot_bytes, loads


async def bench_workers(
    manifest: list[str],
    slot_bytes: int,
    loads: list[tuple[ExpertIOSegment, ...]],
    *,
    workers: int,
    queue_depth: int,
    io_mode: str,
    staging: str,
) -> dict:
    """Pipelined loads: every slot busy, so workers x depth reads are outstanding."""
    slots = min(len(loads), max(2 * workers * queue_depth, 4))
    service, latency = [], []
    with Slab.create(total_slots=slots, slot_bytes=slot_bytes, prefault=True) as slab:
        async with IOWorkerPool(
            slab=slab,
            manifest=manifest,
            workers=workers,
            queue_depth=queue_depth,
            io_mode=io_mode,
            staging=staging,  # type: ignore[arg-type]
            log_level="WARNING",
        ) as pool:
            backend = pool.backend
            modes = sorted({m for per_worker in backend.worker_modes().values() for m in per_worker})

            finished: asyncio.Queue[tuple[int, int, BaseException | None]] = asyncio.Queue()

            async def one(slot: int, generation: int) -> None:
                try:
                    await backend.wait(slot, generation)
                    finished.put_nowait((slot, generation, None))
                except Exception as error:  # reported by the loop below
                    finished.put_nowait((slot, generation, error))

            free, tasks, generation, submitted, total = list(range(slots)), set(), 0, 0, 0
            children = [psutil.Process(process.pid) for process in pool.processes]
            workers_cpu, own_cpu = _cpu_seconds(children), time.process_time()
            started = time.perf_counter()
            for _ in range(len(loads)):
                while free and submitted < len(loads):
                    slot, generation = free.pop(), generation + 1
                    backend.submit_segments(slot, generation, loads[submitted])
                    task = asyncio.ensure_future(one(slot, generation))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    submitted += 1
                slot, gen, error = await finished.get()
                if error is not None:
                    raise error
                completion = backend.completion(slot)
                assert completion is not None
                service.append(completion.service_ms)
                latency.append(completion.latency_ms)
                total += completion.bytes
                backend.discard(slot, gen)
                free.append(slot)
            elapsed = time.perf_counter() - started
            workers_cpu, own_cpu = _cpu_seconds(children) - workers_cpu, time.process_time() - own_cpu
            telemetry = await backend.request_telemetry(timeout=5.0)
            if len(telemetry) != workers:
                raise RuntimeError(f"telemetry from {len(telemetry)} of {workers} workers")
    staged = dict(
        staging=all(t.staging for t in telemetry),
        staging_reason=telemetry[0].staging_reason,
        staged_bytes=sum(t.staged_bytes for t in telemetry),
        staging_copy_ms=sum(t.staging_copy_ms for t in telemetry),
        staging_bytes=sum(t.staging_bytes for t in telemetry),
        staging_huge_bytes=sum(t.staging_huge_bytes for t in telemetry),
    )
    svc, lat = summarize_expert_latencies(service), summarize_expert_latencies(latency)
    return dict(
        MBps=total / elapsed / MB,
        seconds=elapsed,
        bytes=total,
        p50_ms=svc.p50_ms,
        p99_ms=svc.p99_ms,
        latency_p50_ms=lat.p50_ms,
        latency_p99_ms=lat.p99_ms,
        io_modes=modes,
        slots=slots,
        cpu_ms_per_load=workers_cpu * 1e3 / len(loads),
        backend_cpu_ms_per_load=own_cpu * 1e3 / len(loads),
        **staged,
    )


def _cpu_seconds(processes: list[psutil.Process]) -> float:
    """User + system CPU of `processes` (all their threads) so far."""
    return sum(sum(process.cpu_times()[:2]) for process in processes)


def bench_python(manifest: list[str], loads: list[tuple[ExpertIOSegment, ...]], threads: int) -> dict:
    """The same reads with os.preadv on a thread pool, page cache dropped first."""
    drop_cache(manifest)
    fds = [os.open(path, os.O_RDONLY) for path in manifest]
    largest = max(sum(s.length for s in load) for load in loads)
    buffers = [bytearray(largest) for _ in range(threads)]
    free = list(range(threads))

    def read(load: tuple[ExpertIOSegment, ...]) -> tuple[int, float]:
        index = free.pop()  # list.pop/append are atomic under the GIL
        view, got, started = memoryview(buffers[index]), 0, time.perf_counter()
        for segment in load:
            got += os.preadv(fds[segment.file], [view[: segment.length]], segment.offset)
        free.append(index)
        return got, (time.perf_counter() - started) * 1e3

    try:
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=threads) as executor:
            results = list(executor.map(read, loads))
        elapsed = time.perf_counter() - started
    finally:
        for fd in fds:
            os.close(fd)
    summary = summarize_expert_latencies(ms for _, ms in results)
    total = sum(got for got, _ in results)
    return dict(MBps=total / elapsed / MB, p50_ms=summary.p50_ms, p99_ms=summary.p99_ms, threads=threads)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", help="raw file to read (created if missing)")
    parser.add_argument("--file-size", type=parse_size, default=2 << 30, help="size of a created file")
    parser.add_argument("--block-size", type=parse_size, default=1 << 20, help="bytes per load (raw mode)")
    parser.add_argument("--count", type=int, default=512)
    parser.add_argument(
        "--align",
        type=parse_size,
        default=DEFAULT_BLOCK_SIZE,
        help="alignment of the random offsets, for the workers and fio alike "
        "(4 KiB, like tensors in a checkpoint; fio's own default would be the block size)",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--queue-depth", type=int, default=8, help="concurrent reads per worker")
    parser.add_argument("--model", help="model directory: load its experts instead of raw blocks")
    parser.add_argument("--io-mode", default="auto", choices=["auto", "direct", "dontneed", "buffered"])
    parser.add_argument(
        "--staging",
        default="auto",
        choices=["auto", "on", "off"],
        help="workers' direct reads through huge-page buffers (native/staging.py)",
    )
    parser.add_argument("--fio-engine", default="libaio", choices=["libaio", "psync", "io_uring"])
    parser.add_argument("--skip-python", action="store_true")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--order", default="workers,python,fio", help="order of the measurements")
    parser.add_argument(
        "--disjoint",
        action="store_true",
        help="each method reads its own third of --file (no help from a cache below the guest)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    if args.count < 1 or args.workers < 1 or args.queue_depth < 1:
        parser.error("--count, --workers and --queue-depth must be positive")
    if args.align < DEFAULT_BLOCK_SIZE or args.align % DEFAULT_BLOCK_SIZE:
        parser.error(f"--align must be a positive multiple of {DEFAULT_BLOCK_SIZE}, got {args.align}")
    if sorted(args.order.split(",")) != ["fio", "python", "workers"]:
        parser.error(f"--order must list workers, python and fio once each, got {args.order!r}")
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)

    if args.model:
        manifest, slot_bytes, loads = model_loads(args.model, args.count, seed)
        lengths = sorted(sum(s.length for s in load) for load in loads)
        fio_file = max(manifest, key=os.path.getsize)
        fio_block = align_up(lengths[len(lengths) // 2], DEFAULT_BLOCK_SIZE)
        python_loads, fio_region = loads, None
    else:
        if not args.file:
            parser.error("--file or --model is required")
        path = Path(args.file).absolute()
        if not path.exists():
            print(f"creating {path} with {args.file_size} random bytes", file=sys.stderr)
            make_file(path, args.file_size)
        block = align_up(args.block_size, DEFAULT_BLOCK_SIZE)
        manifest, slot_bytes = [str(path)], align_up(block, SLOT_ALIGNMENT)
        ranges = regions(path.stat().st_size, args.disjoint)
        loads = raw_loads(block, args.count, seed, args.align, ranges["workers"])
        python_loads = raw_loads(block, args.count, seed + 1, args.align, ranges["python"])
        fio_file, fio_block, fio_region = str(path), block, ranges["fio"]

    total_bytes = sum(s.length for load in loads for s in load)
    results: dict[str, dict | None] = {"python": None, "fio": None}
    for method in args.order.split(","):
        if method == "workers":
            drop_cache(manifest)
            measured = bench_workers(
                manifest,
                slot_bytes,
                loads,
                workers=args.workers,
                queue_depth=args.queue_depth,
                io_mode=args.io_mode,
                staging=args.staging,
            )
            results["workers"] = asyncio.run(measured)
        elif method == "python" and not args.skip_python:
            results["python"] = bench_python(manifest, python_loads, args.workers * args.queue_depth)
        elif method == "fio":
            results["fio"] = bench_fio(
                fio_file,
                fio_block,
                total_bytes,
                workers=args.workers,
                queue_depth=args.queue_depth,
                engine=args.fio_engine,
                align=args.align,
                region=fio_region,
            )
    workers, python, fio = results["workers"], results["python"], results["fio"]
    segments = sum(len(load) for load in loads) / len(loads)  # an expert's tensors: one read each unless adjacent
    assert workers is not None

    print(
        f"{len(loads)} loads of {workers['bytes'] / len(loads) / 2**20:.2f} MiB, {args.workers} workers x "
        f"depth {args.queue_depth}, modes {','.join(workers['io_modes'])}"
    )
    if workers["staging"]:
        print(
            f"  staging : on ({workers['staging_reason']}); {workers['staged_bytes'] / MB:.0f} MB copied in "
            f"{workers['staging_copy_ms']:.0f} ms, buffers {workers['staging_bytes'] / 2**20:.0f} MiB "
            f"({workers['staging_huge_bytes'] / 2**20:.0f} MiB huge pages)"
        )
    else:
        print(f"  staging : off ({workers['staging_reason']})")
    print(
        f"  workers : {workers['MBps']:8.1f} MB/s  service p50 {workers['p50_ms']:.2f} ms  p99 "
        f"{workers['p99_ms']:.2f} ms  (submit-to-done p50 {workers['latency_p50_ms']:.2f} ms)"
    )
    print(
        f"  CPU     : workers {workers['cpu_ms_per_load']:.3f} ms a load ({segments:.1f} reads), this process "
        f"(the backend) {workers['backend_cpu_ms_per_load']:.3f}"
        + (f", fio {fio['cpu_ms_per_load']:.3f} a read" if fio else "")
    )
    if python:
        print(
            f"  python  : {python['MBps']:8.1f} MB/s  p50 {python['p50_ms']:.2f} ms  p99 {python['p99_ms']:.2f} ms"
            f"  (buffered preadv, {python['threads']} threads)"
        )
    if fio:
        print(
            f"  fio     : {fio['MBps']:8.1f} MB/s  clat p50 {fio['p50_ms']:.2f} ms  p99 {fio['p99_ms']:.2f} ms"
            f"  (O_DIRECT randread bs={fio_block}, {args.fio_engine}, blockalign={args.align})"
        )
        print(f"  workers / fio = {workers['MBps'] / fio['MBps']:.3f}")
    else:
        print("  fio     : not installed")
    if args.json:
        summary = dict(
            workers_MBps=workers["MBps"],
            python_MBps=python["MBps"] if python else None,
            fio_MBps=fio["MBps"] if fio else None,
            p50_ms=workers["p50_ms"],
            p99_ms=workers["p99_ms"],
            latency_p50_ms=workers["latency_p50_ms"],
            latency_p99_ms=workers["latency_p99_ms"],
            python_p50_ms=python["p50_ms"] if python else None,
            python_p99_ms=python["p99_ms"] if python else None,
            fio_p50_ms=fio["p50_ms"] if fio else None,
            fio_p99_ms=fio["p99_ms"] if fio else None,
            ratio_to_fio=workers["MBps"] / fio["MBps"] if fio else None,
            cpu_ms_per_load=workers["cpu_ms_per_load"],
            backend_cpu_ms_per_load=workers["backend_cpu_ms_per_load"],
            segments_per_load=segments,
            fio_cpu_ms_per_load=fio["cpu_ms_per_load"] if fio else None,
            block_size=fio_block,
            bytes=workers["bytes"],
            count=len(loads),
            workers=args.workers,
            queue_depth=args.queue_depth,
            io_modes=workers["io_modes"],
            fio_engine=args.fio_engine,
            fio_file=fio_file,
            seed=seed,
            model=args.model,
            order=args.order,
            align=args.align,
            disjoint=args.disjoint,
            staging=workers["staging"],
            staging_reason=workers["staging_reason"],
            staged_bytes=workers["staged_bytes"],
            staging_copy_ms=workers["staging_copy_ms"],
        )
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
