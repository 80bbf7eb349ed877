"""scripts/bench_ab.py at tiny sizes: two sides run side by side with alternating jobs, each with
its own options (and code root), and the report says what ran; a side that cannot start, and
SIGTERM, stop everything started (conftest's no_leaks checks processes and slabs). Speed is
the script's business, never asserted here."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from instruments.ab_side import Side
from instruments.read_throttle import groups_left, unavailable
from scripts.bench_ab import parse_side
from tests.helpers.system import wait_for

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--layers", "2", "--experts", "8", "--hidden", "128", "--moe-intermediate", "64", "--top-k", "2"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("ab-cache")


def _command(cache, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "scripts" / "bench_ab.py"),
        *TINY,
        "--tokens",
        "6",
        "--prompt-tokens",
        "6",
        "--cache-dir",
        str(cache),
        *extra,
    ]


def test_two_sides_alternate_and_report_what_ran(cache):
    sides = ["--a", "prefetch=off", "--b", f"root={ROOT} prefetch=on prefetch_margin=1"]
    command = _command(cache, "--rounds", "2", "--passes", "2", *sides)
    result = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["tokens_match"] is True and report["passes"] == 2 and report["rounds"] == 4
    a, b = report["A"], report["B"]
    assert a["options"]["prefetch"] == "off" and b["options"]["prefetch"] == "on"
    assert b["options"]["prefetch_margin"] == 1 and a["root"] == b["root"] == str(ROOT)
    for side in (a, b):
        assert len(side["decode_tok_s_rounds"]) == 4 and all(tok_s > 0 for tok_s in side["decode_tok_s_rounds"])
        assert side["warmup_jobs"] >= 2  # at least one a pass
        assert set(side["decode_cpu_ms_per_token"]) == {"gpu_worker", "coordinator", "io_workers"}
    ratios = [rb / ra for ra, rb in zip(a["decode_tok_s_rounds"], b["decode_tok_s_rounds"])]
    assert report["b_over_a_rounds"] == pytest.approx(ratios)
    assert report["b_faster_rounds"] == sum(ratio > 1 for ratio in ratios)
    assert report["b_over_a_pass_medians"] == [
        pytest.approx((ratios[0] + ratios[1]) / 2),
        pytest.approx((ratios[2] + ratios[3]) / 2),
    ]
    # Pass 1 started A first and its rounds ran A,B then B,A; pass 2 starts B first (the progress
    # lines say so).
    for line in ("pass 1, round 1 (A,B)", "pass 1, round 2 (B,A)", "pass 2, round 1 (B,A)", "pass 2, round 2 (A,B)"):
        assert line in result.stderr


@pytest.mark.skipif(unavailable() is not None, reason=f"read limit unavailable: {unavailable()}")
def test_a_read_limit_holds_both_sides_and_goes_away_after(cache):
    command = _command(cache, "--rounds", "1", "--passes", "1", "--b", "prefetch=off", "--throttle-read-mbps", "800")
    result = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["throttle"]["read_MBps"] == 800 and report["throttle"]["bytes_read"] > 0  # the sides' reads
    assert "limited to 800 MB/s" in result.stderr
    assert not groups_left()


@pytest.mark.parametrize(("rate", "said"), [("0", "0.0"), ("inf", "inf"), ("nan", "nan")])
def test_a_read_limit_that_is_no_rate_is_refused(cache, rate, said):
    result = subprocess.run(_command(cache, "--throttle-read-mbps", rate), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and f"--throttle-read-mbps must be a positive rate, got {said}" in result.stderr


def test_a_side_that_cannot_start_is_named_and_the_other_is_stopped(cache):
    result = subprocess.run(
        _command(cache, "--rounds", "1", "--passes", "1", "--b", "no_such_option=3"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert "side B could not start" in result.stderr and "no_such_option" in result.stderr


def test_side_options_parse_as_json_or_text_and_a_root_must_be_a_checkout(tmp_path):
    root, options = parse_side("prefetch=on prefetch_margin=4 helper_scheduling=batch compute_lanes=null")
    assert root == ROOT
    assert options == {"prefetch": "on", "prefetch_margin": 4, "helper_scheduling": "batch", "compute_lanes": None}
    assert parse_side(f"root={ROOT}")[0] == ROOT
    with pytest.raises(ValueError, match="no moeslab checkout there"):
        parse_side(f"root={tmp_path}")
    with pytest.raises(ValueError, match="expected key=value, got 'prefetch'"):
        parse_side("prefetch")


def _long_bench(cache, **popen) -> subprocess.Popen:
    """A bench of 200 rounds, its progress lines on stdout."""
    command = _command(cache, "--rounds", "200")
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def _until_round_one(bench: subprocess.Popen, deadline: float) -> None:
    """Read the bench's progress until its first measured round has run (asserted)."""
    line = ""
    while time.monotonic() < deadline:
        line = bench.stdout.readline()
        if not line or line.startswith("pass 1, round 1 "):
            break
    assert line.startswith("pass 1, round 1 "), bench.stderr.read()[-4000:] if bench.poll() is not None else line


def test_sigterm_stops_both_sides(cache):
    bench = _long_bench(cache)
    try:
        _until_round_one(bench, time.monotonic() + 240)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()


def _run_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "moeslab-*")))


def _has_coordinator(process: psutil.Process) -> bool:
    for child in process.children(recursive=True):
        try:
            if "coordinator" in " ".join(child.cmdline()):
                return True
        except psutil.Error:  # gone since it was listed
            continue
    return False


@pytest.mark.parametrize("phase", ["starting", "serving"])
def test_sigterm_to_the_process_group_stops_every_side_and_leaves_nothing(cache, phase):
    """As `timeout` or a shell's job control sends it: the sides get SIGTERM too, at the same time
    as the driver, and each stops its system (starting: once a side has a coordinator; serving: in
    round 1). conftest's no_leaks checks the slabs; the run directories are checked here."""
    dirs_before = _run_dirs()
    bench = _long_bench(cache, process_group=0)
    try:
        deadline = time.monotonic() + 240
        if phase == "starting":
            while time.monotonic() < deadline and not _has_coordinator(psutil.Process(bench.pid)):
                time.sleep(0.01)
            assert time.monotonic() < deadline, "no side had a coordinator"
        else:
            _until_round_one(bench, deadline)
        os.killpg(bench.pid, signal.SIGTERM)
        assert bench.wait(timeout=120) == 128 + signal.SIGTERM
        assert wait_for(lambda: _run_dirs() <= dirs_before, timeout=30), sorted(_run_dirs() - dirs_before)
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()


def test_a_sides_stray_output_is_skipped_and_its_exit_is_an_error():
    side = Side.__new__(Side)  # the reading alone, over a process that prints noise around its line
    side.name = "A"
    script = "print('a library warning'); print('[1, 2]'); print('{\"ready\": true}')"
    side.process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert side._line() == {"ready": True}
    with pytest.raises(RuntimeError, match=r"side A exited \(code 0\)"):
        side._line()
