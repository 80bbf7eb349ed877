"""Smoke test of scripts/bench_generate.py at tiny sizes: it runs end to end and
reports what it promises. Speed is the script's business, never asserted here."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from instruments.bench_report import report_lines
from shared.scheduling import resolve_io_workers
from shared.slab import SLAB_NAME_PREFIX, SLAB_TAG_ENV

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("bench-cache")  # the tiny model is built once for both orders


def _command(cache, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "scripts" / "bench_generate.py"),
        "--layers",
        "2",
        "--experts",
        "8",
        "--hidden",
        "128",
        "--moe-intermediate",
        "64",
        "--top-k",
        "2",
        "--tokens",
        "6",
        "--prompt-tokens",
        "6",
        "--repeats",
        "1",
        "--disk-experts",
        "8",
        "--cache-dir",
        str(cache),
        "--json",
        *extra,
    ]


CPUS = sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize("order", ["interleaved", "sequential"])
def test_bench_generate_reports_both_comparisons(cache, order):
    # The sequential run also pins the helpers away from the GPU worker (where there are 2 CPUs).
    pin = order == "sequential" and len(CPUS) >= 2
    command = _command(cache, *(["--sequential"] if order == "sequential" else []), *(["--pin-helpers"] if pin else []))
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["order"] == order
    # Every job's tokens equal mlx-lm's (the script exits 1 otherwise).
    assert report["tokens_match"] is True and report["mlx_lm"]["repeat_tokens_equal"] is True
    assert report["resident"]["tokens_match"] and report["streaming"]["tokens_match"]
    assert report["expected_tokens"] == len(report["tokens"]) > 0
    model = report["model"]
    assert model["sparse_layers"] == 2 and model["experts_per_layer"] == 8 and model["top_k"] == 2
    assert model["scale_dtypes"] == ["F32"] and model["expert_bytes"] > 0
    resident, streaming = report["resident"], report["streaming"]
    assert resident["hit_rate"] == 1.0 and resident["misses_per_job"] == [0]  # every expert resident
    assert resident["slots_per_layer"] == 8 and streaming["slots_per_layer"] == 2
    assert streaming["resident_fraction"] == 0.25 and streaming["misses_per_job"][0] > 0
    for part in (resident, streaming):
        for key in (
            "decode_tok_s",
            "ipc_wait_ms_per_layer",
            "copy_ms_per_layer",
            "end_step_fence_ms_per_token",
            "copied_MB_per_token",
        ):
            assert part[key] > 0, key
        # This model's decode waves are far below decode_parts_min_bytes: copied whole, and the
        # second sparse layer's from a set copied ahead while the first computed (only what the
        # prediction missed is copied, exposed, once its routes are known).
        assert 0 < part["exposed_copy_ms_per_token"] < part["copy_ms_per_token"]
        # The first sparse layer is not predicted; streaming, a prediction may find nothing resident.
        assert (0.4 if part is resident else 0) < part["copy_ahead_visit_fraction"] <= 0.5
        assert 0 < part["copy_ahead_found_fraction"] <= 1 and 0 < part["copy_ahead_precision"] <= 1
        assert set(part["per_layer"]) == {"0", "1"}
        warmups = part["warmup_jobs"]
        assert [job["warmup"] for job in part["jobs"]] == [True] * warmups + [False]
        # A warm-up job follows another only while auto prefetch's trial has no verdict.
        assert all(job["prefetch"]["trialling"] for job in part["jobs"][: warmups - 1])
        cpu, decode = part["cpu_ms_per_token"], part["decode_cpu_ms_per_token"]
        # Process CPU times come in clock ticks (10 ms): this tiny model's decode of a few tokens may
        # catch none of them (0.0); the compute thread's figures below count nanoseconds.
        assert set(cpu) == set(decode) == {"gpu_worker", "coordinator", "io_workers"} and cpu["gpu_worker"] > 0
        assert all(value >= 0 for value in [*cpu.values(), *decode.values()])
        compute = part["compute_thread"]  # the GPU worker's busiest thread in decode (Linux: schedstat)
        if sys.platform.startswith("linux"):
            assert compute["run_ms_per_token"] > 0  # decode measured: the compute thread ran
            assert compute["threads_wait_ms_per_token"] >= compute["wait_ms_per_token"] >= 0
            assert compute["preempted_per_token"] >= 0
            assert all(job["compute_thread"] for job in part["jobs"])
        # Decode alone leaves the prefill out: never more CPU than the whole job's (equal when the
        # prefill caught no clock tick).
        job = part["jobs"][-1]
        assert (
            job["decode_cpu_ms_per_token"]["gpu_worker"] * (job["generated"] - 1)
            <= job["cpu_ms_per_token"]["gpu_worker"] * job["generated"] + 1e-9
        )
    # Every expert resident: nothing is predicted, so there is no trial to wait for. Streaming's
    # trial needs 40+ decode steps, far more than jobs of 6 tokens hold: the warm-up stops at
    # bench_generate's MAX_WARMUP_JOBS (4) and the measured job is still on trial.
    assert resident["warmup_jobs"] == 1 and not resident["jobs"][0]["prefetch"]["trialling"]
    for part in (resident, streaming):  # what the threads' affinity held, read back
        assert part["io_workers"] == resolve_io_workers(None)[0]  # no --io-workers: the system's auto choice
        want = {"GPU worker": CPUS[:-1], "coordinator": CPUS[-1:]}
        want |= {f"I/O worker {index}": CPUS[-1:] for index in range(part["io_workers"])}
        assert part["pinning"] == (want if pin else None)
    assert streaming["warmup_jobs"] == 4 and streaming["prefetch"]["trialling_jobs"] == 1
    assert streaming["prefetch"]["distance"] == 1  # the system's default: the next sparse layer
    assert resident["vs_mlx_lm"] > 0 and resident["miss_bytes_per_token"] == 0
    # Every expert resident: the decode visits lease through the lease words, no round trip.
    assert resident["shared_visit_fraction"] > 0.9
    assert 0 < resident["lease_wait_p50_ms"] <= resident["lease_wait_p99_ms"]
    roofline = streaming["roofline"]
    for key in (
        "t_compute_resident_s",
        "t_compute_mlx_lm_s",
        "miss_bytes_per_token",
        "disk_MBps",
        "roofline_tok_s",
        "ratio",
        "roofline_tok_s_mlx_lm",
        "ratio_mlx_lm",
    ):
        assert roofline[key] > 0, key
    disk = report["disk"]
    assert disk["MBps"] > 0 and disk["single_expert_ms"] > 0 and disk["batch"] >= 1
    assert report["mlx_lm"]["decode_tok_s"] > 0 and report["mlx_lm"]["moe_layer_ms"] > 0
    assert report["memory"]["machine_peak_used_bytes"] > 0
    text = "\n".join(report_lines(report))  # what the script prints without --json
    assert text.count("(the whole job, prefill included): GPU worker") == 2 and "prefetch (auto)" in text
    if sys.platform.startswith("linux"):
        assert text.count("GPU worker's compute thread per decode token: ran") == 2


def test_pinning_refuses_a_single_cpu(cache):
    result = subprocess.run(
        _command(cache, "--pin-helpers"),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        preexec_fn=lambda: os.sched_setaffinity(0, CPUS[:1]),
    )
    assert result.returncode == 2
    assert (
        f"--pin-helpers: pinning needs at least 2 CPUs to split, this process may run on [{CPUS[0]}]" in result.stderr
    )


def _slabs() -> set[str]:
    """This session's slabs (the bench inherits its tag): another run on the machine is not ours."""
    prefix = f"{SLAB_NAME_PREFIX[1:]}{os.environ[SLAB_TAG_ENV]}-"
    return {path.name for path in Path("/dev/shm").glob(f"{prefix}*")} if Path("/dev/shm").is_dir() else set()


def _wait_for_line(stream, needle: str, timeout: float) -> str | None:
    """The first line of `stream` holding `needle`, or None at its end or after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], 0.5)
        if ready:
            line = stream.readline()
            if not line:
                return None
            if needle in line:
                return line
    return None


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm to see the slab")
def test_sigterm_stops_the_started_systems_and_unlinks_their_slabs(cache):
    """SIGTERM once a system has started and warmed up (its jobs are running): the bench stops
    every system it started on the way out."""
    before = _slabs()
    command = [arg for arg in _command(cache, "--repeats", "50") if arg != "--json"]  # progress lines
    bench = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        started = _wait_for_line(bench.stdout, "started in", timeout=240)
        assert started, "no system was started"
        assert _slabs() - before
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 128 + signal.SIGTERM, err[-4000:]
    assert _slabs() == before  # and the conftest's leak check finds no child process left


def test_passes_start_both_systems_afresh_and_pool_their_rounds(cache):
    result = subprocess.run(_command(cache, "--passes", "2"), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["passes"] == 2 and report["tokens_match"] is True
    resident, streaming = report["resident"], report["streaming"]
    for part in (resident, streaming):
        assert len(part["decode_tok_s_runs"]) == 2  # one round a pass
        assert part["warmup_jobs"] >= 2  # each pass's new system warmed up
    rounds = streaming["vs_resident_rounds"]
    assert rounds == pytest.approx(
        [s / r for s, r in zip(streaming["decode_tok_s_runs"], resident["decode_tok_s_runs"])]
    )
    assert streaming["vs_resident_pass_medians"] == pytest.approx(rounds)  # a pass of one round is its own median
    text = "\n".join(report_lines(report))  # what the script prints without --json
    assert "x resident (per round " in text and "(per pass, medians " in text
    refused = subprocess.run(
        _command(cache, "--passes", "2", "--sequential"), capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert refused.returncode == 2 and "--passes needs the interleaved order (not --sequential)" in refused.stderr
