"""A tiny smoke run of scripts/bench_io.py: it runs and its JSON has the promised keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_io.py"


@pytest.mark.parametrize("extra", [[], ["--disjoint", "--order", "fio,workers,python", "--staging", "on"]])
def test_bench_io_smoke(tmp_path, extra):
    data = tmp_path / "bench.bin"
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--file",
            str(data),
            "--file-size",
            "4M",
            "--block-size",
            "64K",
            "--count",
            "16",
            "--workers",
            "1",
            "--queue-depth",
            "2",
            "--json",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert data.stat().st_size == 4 << 20  # created with the requested size
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("workers_MBps", "python_MBps", "fio_MBps", "p50_ms", "p99_ms"):
        assert key in summary
    assert summary["workers_MBps"] > 0 and summary["python_MBps"] > 0
    assert summary["fio_MBps"] is None or summary["fio_MBps"] > 0
    assert summary["bytes"] == 16 * 64 * 1024
    assert 0 < summary["p50_ms"] <= summary["p99_ms"]
    # CPU a load: the workers' from /proc (clock ticks: 0 is possible for 16 small loads), ours exact
    assert summary["cpu_ms_per_load"] >= 0 and summary["backend_cpu_ms_per_load"] > 0
    assert summary["fio_cpu_ms_per_load"] is None or summary["fio_cpu_ms_per_load"] >= 0
    if "--staging" in extra:  # forced on: every direct read of the workers went through it
        assert summary["staging"] is True and summary["staging_reason"] == "staging on by request"
        if summary["io_modes"] == ["direct"]:  # staging serves O_DIRECT reads only
            assert summary["staged_bytes"] >= summary["bytes"] and summary["staging_copy_ms"] > 0
    else:
        assert isinstance(summary["staging"], bool) and summary["staging_reason"]
