"""Smoke test of scripts/bench_generate.py at tiny sizes: it runs end to end and
reports what it promises. Speed is the script's business, never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_generate_reports_both_comparisons(tmp_path):
    command = [
        sys.executable, str(ROOT / "scripts" / "bench_generate.py"),
        "--layers", "2", "--experts", "8", "--hidden", "128", "--moe-intermediate", "64",
        "--top-k", "2", "--tokens", "6", "--prompt-tokens", "6", "--repeats", "1",
        "--cache-dir", str(tmp_path), "--json",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["tokens_match"] is True
    assert report["resident"]["tokens_match"] and report["streaming"]["tokens_match"]
    assert report["resident"]["hit_rate"] == 1.0  # every expert resident after warm-up
    assert report["streaming"]["resident_fraction"] == 0.25
    assert report["streaming"]["misses_per_job"][0] > 0
    for key in ("vs_mlx_lm", "ipc_wait_ms_per_layer", "copy_ms_per_layer"):
        assert key in report["resident"]
    roofline = report["streaming"]["roofline"]
    for key in ("t_compute_resident_s", "miss_bytes_per_token", "disk_MBps", "roofline_tok_s", "ratio"):
        assert roofline[key] > 0, key
    assert report["mlx_lm"]["decode_tok_s"] > 0
