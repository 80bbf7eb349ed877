"""fio's O_DIRECT random reads: the kernel's and the disk's share of an expert read, for comparison.

`bench_fio` runs fio at a block size, depth and offset alignment of the caller's and reports its
bandwidth, completion latency percentiles and the jobs' own CPU a read (fio's usr + sys of their
summed run time; its start-up, about 0.2 s here, left out), or None without fio.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from instruments.figures import MB
from shared.checks import align_up


def bench_fio(
    path: str,
    block: int,
    total_bytes: int,
    *,
    workers: int,
    queue_depth: int,
    engine: str,
    align: int,
    region: tuple[int, int] | None = None,
) -> dict | None:
    fio = shutil.which("fio")
    if fio is None:
        return None
    start, end = region or (0, os.path.getsize(path))
    size = (end - start) // block * block
    per_job = max(block, align_up(total_bytes // workers, block))
    command = [
        fio,
        "--name=bench_io",
        f"--filename={path}",
        "--readonly",
        "--direct=1",
        "--rw=randread",
        f"--bs={block}",
        f"--ioengine={engine}",
        f"--iodepth={queue_depth}",
        f"--numjobs={workers}",
        f"--offset={start}",
        f"--size={size}",
        f"--io_size={per_job}",
        f"--blockalign={align}",
        "--group_reporting",
        "--randrepeat=0",
        "--norandommap",
        "--output-format=json",
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        print(f"fio failed ({result.returncode}): {result.stderr.strip()}", file=sys.stderr)
        return None
    job = json.loads(result.stdout[result.stdout.index("{") :])["jobs"][0]
    read = job["read"]
    # The jobs' own CPU (percent of their summed run time), not fio's start-up (about 0.2 s here)
    cpu_s = (job["usr_cpu"] + job["sys_cpu"]) / 100 * job["job_runtime"] / 1e3
    percentiles = read.get("clat_ns", {}).get("percentile", {})
    return dict(
        MBps=read["bw_bytes"] / MB,
        p50_ms=percentiles.get("50.000000", 0) / 1e6,
        p99_ms=percentiles.get("99.000000", 0) / 1e6,
        cpu_ms_per_load=cpu_s * 1e3 / max(1, read["total_ios"]),
        command=" ".join(command),
    )
