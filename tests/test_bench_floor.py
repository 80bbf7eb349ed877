"""scripts/bench_floor.py and instruments/paced_reads.py at tiny sizes: the resident system's jobs
alone and with paced reads, in alternating order, and the report says what ran; the reader keeps
to its rate, stops on SIGTERM and when its parent is gone. Speed is the script's business, never
asserted here (conftest's no_leaks checks processes and slabs after each test)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from instruments.figures import MB, median
from scripts.bench_floor import PacedReads, summarize, uniform_bytes_per_token
from shared.store import ExpertStore

ROOT = Path(__file__).resolve().parent.parent
READER = ROOT / "instruments" / "paced_reads.py"
TINY = ["--layers", "2", "--experts", "8", "--hidden", "128", "--moe-intermediate", "64", "--top-k", "2"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("floor-cache")


def _bench(cache, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "scripts" / "bench_floor.py"), *TINY, "--tokens", "6"]
    command += ["--prompt-tokens", "6", "--cache-dir", str(cache), "--json", *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)


def _model(cache) -> Path:
    (model,) = [path for path in Path(cache).iterdir() if path.is_dir()]
    return model


def test_rounds_alternate_and_the_rate_is_the_modelled_one(cache):
    result = _bench(cache, "--rounds", "2", "--resident-fraction", "0.5", "--target", "0.9")
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["rounds"] == 2 and len(report["floor_ratio_rounds"]) == 2 and report["tokens_match"] is True
    for line in ("round 1 (alone,with)", "round 2 (with,alone)"):
        assert line in result.stderr
    modelled = report["modelled"]
    assert modelled["resident_fraction"] == 0.5 and modelled["target"] == 0.9
    store = ExpertStore.open(_model(cache))
    expert_bytes = sum(seg.length for seg in store.locate(store.sparse_layers[0], 0).segments)
    by_hand = 2 * 2 * 0.5 * expert_bytes  # 2 layers, top-2, half of them missed
    assert modelled["bytes_per_token"] == uniform_bytes_per_token(store, 0.5) == by_hand
    assert modelled["bytes_per_token_from"] == "uniform routing"
    assert report["rate_mbps"] == pytest.approx(0.9 * modelled["resident_tok_s"] * by_hand / MB)
    assert "1 experts at a time" in result.stderr and report["batch"] == 1  # one of top-2 missed at half resident
    assert report["reads_MBps"] > 0 and report["reads_cpu_ms_per_s"] > 0
    assert report["floor_ratio"] == pytest.approx(median(report["floor_ratio_rounds"]))
    assert set(report["decode_cpu_ms_per_token"]) == {"alone", "with"}


def test_a_given_rate_or_bytes_per_token_is_read_and_bad_values_are_named(cache):
    result = _bench(cache, "--rounds", "1", "--rate-mbps", "3")
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["rate_mbps"] == 3 and report["modelled"] is None
    store = ExpertStore.open(_model(cache))
    per_token = 6 * sum(seg.length for seg in store.locate(store.sparse_layers[0], 0).segments)
    result = _bench(cache, "--rounds", "1", "--bytes-per-token", str(per_token))
    assert result.returncode == 0, result.stderr[-4000:]
    modelled = json.loads(result.stdout.strip().splitlines()[-1])["modelled"]
    assert modelled["bytes_per_token"] == per_token and modelled["bytes_per_token_from"] == "given"
    assert "3 experts at a time" in result.stderr  # 6 experts a token over 2 sparse layers
    result = _bench(cache, "--rounds", "1", "--bytes-per-token", str(per_token), "--batch", "2")
    assert result.returncode == 0 and "2 experts at a time" in result.stderr, result.stderr[-4000:]
    for flag, value, message in (
        ("--rate-mbps", "0", "--rate-mbps must be > 0, got 0.0"),
        ("--resident-fraction", "1", "--resident-fraction must be in (0, 1), got 1.0"),
        ("--target", "1.5", "--target must be in (0, 1], got 1.5"),
        ("--bytes-per-token", "-1", "--bytes-per-token must be > 0, got -1.0"),
        ("--batch", "0", "--batch must be >= 1, got 0"),
    ):
        refused = _bench(cache, flag, value)
        assert refused.returncode == 2 and message in refused.stderr
    both = _bench(cache, "--bytes-per-token", "5", "--rate-mbps", "3")
    assert both.returncode == 2 and "give --bytes-per-token or --rate-mbps, not both" in both.stderr


def test_sigterm_stops_the_system_and_the_reader(cache):
    command = [sys.executable, str(ROOT / "scripts" / "bench_floor.py"), *TINY, "--tokens", "6", "--prompt-tokens"]
    command += ["6", "--cache-dir", str(cache), "--rounds", "200"]
    bench = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = bench.stdout.readline()
        while line and not line.startswith("round 1 "):
            line = bench.stdout.readline()
        assert line.startswith("round 1 "), bench.stderr.read()[-4000:]

        def reading() -> bool:
            for child in psutil.Process(bench.pid).children():
                try:
                    if "paced_reads.py" in " ".join(child.cmdline()):
                        return True
                except psutil.Error:  # gone (or a zombie) between the listing and the look
                    continue
            return False

        deadline = time.monotonic() + 60
        while not reading() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reading(), "no paced reader seen after round 1"
        bench.send_signal(signal.SIGTERM)  # with a paced reader running
        assert bench.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()


def _reader(model: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, str(READER), str(model), *extra]
    reader = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert json.loads(reader.stdout.readline())["reading"] is True
    return reader


def test_paced_reads_keep_to_their_rate_and_stop_on_sigterm(cache):
    _bench(cache, "--rounds", "1", "--rate-mbps", "1")  # builds the tiny model if no test did
    model = _model(cache)
    store = ExpertStore.open(model)
    expert_bytes = sum(seg.length for seg in store.locate(store.sparse_layers[0], 0).segments)
    rate_mbps = 20 * expert_bytes / MB  # 20 experts a second, 2 a read
    reader = _reader(model, f"--rate-mbps={rate_mbps}", "--batch=2")
    time.sleep(1.0)
    reader.send_signal(signal.SIGTERM)
    out, err = reader.communicate(timeout=30)
    assert reader.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["loads"] % 2 == 0 and report["loads"] >= 2
    assert report["bytes"] == report["loads"] * expert_bytes
    # Paced: never ahead of the rate by more than the read that started on time.
    assert report["bytes"] <= rate_mbps * MB * report["seconds"] + 2 * expert_bytes


def test_paced_reads_stop_when_their_parent_is_gone(cache):
    _bench(cache, "--rounds", "1", "--rate-mbps", "1")
    parent = (
        "import subprocess, sys, os\n"
        f"p = subprocess.Popen([sys.executable, {str(READER)!r}, {str(_model(cache))!r}, '--rate-mbps=1'],"
        " stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)\n"
        "p.stdout.readline()\n"
        "print(p.pid, flush=True)\n"
        "os._exit(0)\n"
    )
    done = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=60)
    pid = int(done.stdout)
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except AssertionError:
        psutil.Process(pid).kill()  # not this test's child: no_leaks would not see it
        raise


def test_a_reader_that_cannot_start_is_an_error(cache, tmp_path):
    with pytest.raises(RuntimeError, match=r"paced reads did not start \(exit code 2\)"):
        PacedReads(tmp_path, rate_mbps=1.0, batch=1, io_mode="direct", seed=0)
    _bench(cache, "--rounds", "1", "--rate-mbps", "1")
    refused = subprocess.run(
        [sys.executable, str(READER), str(_model(cache)), "--rate-mbps=1", "--batch=17"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2  # 2 layers x 8 experts: at most 16 at once
    assert "batch must be in [1, 16] (the checkpoint's routed experts), got 17" in refused.stderr


def test_the_report_pairs_each_round_and_sees_tokens_that_differ():
    def job(tok_s: float, tokens: list[int]) -> dict:
        return {"decode_tok_s": tok_s, "tokens": tokens, "decode_cpu_ms_per_token": {"gpu_worker": tok_s}}

    reads = {"MBps": 10.0, "cpu_user_s": 0.1, "cpu_system_s": 0.3, "seconds": 2.0}
    rows = [
        {"alone": job(4.0, [1, 2]), "with": job(3.0, [1, 2]), "reads": reads, "ratio": 0.75},
        {"alone": job(2.0, [1, 2]), "with": job(2.0, [1, 2]), "reads": reads, "ratio": 1.0},
    ]
    report = summarize(rows, rate_mbps=10.0, batch=3, modelled=None)
    assert report["floor_ratio"] == pytest.approx(0.875) and report["floor_ratio_rounds"] == [0.75, 1.0]
    assert report["tokens_match"] is True and report["batch"] == 3
    assert report["reads_cpu_ms_per_s"] == pytest.approx(200.0) and report["reads_system_share"] == pytest.approx(0.75)
    assert report["decode_cpu_ms_per_token"] == {"alone": {"gpu_worker": 3.0}, "with": {"gpu_worker": 2.5}}
    rows[1]["with"] = job(2.0, [1, 3])
    assert summarize(rows, rate_mbps=10.0, batch=3, modelled=None)["tokens_match"] is False
