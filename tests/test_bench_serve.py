"""Smoke test of scripts/bench_serve.py at tiny sizes: concurrent streams run end to end and
every promised figure is reported. Speed is the script's business, never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIGURES = (
    "aggregate_tok_s",
    "per_stream_tok_s",
    "summed_tok_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "hit_rate",
    "bytes_read_per_token",
    "rounds",
)


def _bench(cache, *flags: str) -> dict:
    """bench_serve.py on a tiny model (built once in `cache`): its --json report."""
    command = [
        sys.executable,
        str(ROOT / "scripts" / "bench_serve.py"),
        *("--layers", "2", "--experts", "8", "--hidden", "128", "--moe-intermediate", "64", "--top-k", "2"),
        *("--tokens", "5", "--prompt-tokens", "6", "--cache-dir", str(cache), "--json", *flags),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_bench_serve_reports_every_stream_count(tmp_path):
    report = _bench(tmp_path, "--streams", "1,3", "--repeats", "1", "--resident-fraction", "0.25")
    assert report["max_sequences"] == 3 and report["slots_per_layer"] == 2
    assert set(report["streams"]) == {"1", "3"}
    for figures in report["streams"].values():
        assert set(FIGURES) <= set(figures)
        assert figures["aggregate_tok_s"] > 0 and figures["per_stream_tok_s"] > 0
        assert 0 <= figures["hit_rate"] <= 1 and figures["bytes_read_per_token"] > 0  # 2 of 8 resident: reads
        assert 0 < figures["decode_bytes_read_per_token"] <= figures["bytes_read_per_token"]
    assert report["streams"]["3"]["rounds"][0]["generated"] == 3 * 5
    assert report["vs_one_stream"]["1"]["aggregate"] == 1.0


def test_all_resident_rounds_decode_from_hits_only(tmp_path):
    """With every expert resident the warm-up decodes the rounds' (new) prompts once first."""
    report = _bench(tmp_path, "--streams", "1,2", "--repeats", "2", "--resident-fraction", "1")
    rounds = [r for figures in report["streams"].values() for r in figures["rounds"]]
    assert len(rounds) == 4 and all(r["hit_rate"] == 1.0 and r["bytes_read_per_token"] == 0 for r in rounds)
