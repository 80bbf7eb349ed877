"""The supervisor as users run it: `python scripts/launch.py ...` in a subprocess.

Its one JSON ready line, a job token-exact with mlx-lm, SIGTERM / SIGINT
during a job (exit 0, nothing left: no process, segment, socket file or run
directory), a loopback tcp endpoint and a given run directory, and every
refusal: a bad flag, a model directory that is not a model, a budget too
small, a child that fails at start. `TMPDIR` points at a private directory,
so default run directories and stale-run cleanup stay inside the test.

The launch helpers (`launch`, `Launched`, ...) live in tests/helpers/supervisor.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time
from pathlib import Path

import psutil
import pytest

from shared.client import Client, JobFailedError
from shared.config import check_jobs_endpoint
from shared.job_messages import TokenEvent
from shared.scheduling import resolve_io_workers
from shared.store import ExpertStore
from supervisor.budget import parse_size
from tests.helpers.supervisor import (
    assert_all_gone,
    check_tokens,
    launch,
    model_args,
    oracle_tokens,
    run_dirs,
    run_tokens,
    spawn_supervisor,
    tiny_model,
)
from tests.helpers.system import PROMPT, tight_budget, wait_for


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def want(model) -> list[int]:
    return oracle_tokens(model)


# ---------------------------------------------------------------------------------------------


def test_sizes_and_endpoints_parse_or_are_refused():
    assert parse_size("8GiB") == 8 * 2**30 and parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size("4096") == 4096 and parse_size("1.1gb") == 1_100_000_000
    for bad in ("", "0", "-1GiB", "8 GiBs", "1e9", "GiB", "1.5.2GB"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert check_jobs_endpoint("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5555"
    assert check_jobs_endpoint("ipc:///tmp/x/jobs") == "ipc:///tmp/x/jobs"
    for bad in (
        "tcp://0.0.0.0:5555",
        "tcp://10.0.0.1:80",
        "tcp://*:5555",
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1",
        "ipc://relative/jobs",
        "udp://127.0.0.1:5",
        "inproc://x",
    ):
        with pytest.raises(ValueError):
            check_jobs_endpoint(bad)


def test_ready_line_a_token_exact_job_and_sigterm_mid_job(model, want, tmp_path):
    store = ExpertStore.open(model)
    launched = launch(tmp_path, model_args(model) + ["--io-workers", "2"])
    ready = launched.ready
    assert set(ready) >= {"event", "endpoint", "run_dir", "pids", "plan", "slab"} and ready["event"] == "ready"
    run_dir = ready["run_dir"]
    assert run_dir.startswith(str(tmp_path / "tmp" / "moeslab-")) and ready["endpoint"] == f"ipc://{run_dir}/jobs"
    assert (os.stat(run_dir).st_mode & 0o777) == 0o700
    assert set(ready["pids"]) == {"supervisor", "coordinator", "io_worker_0", "io_worker_1", "gpu_worker"}
    assert ready["pids"]["supervisor"] == launched.process.pid
    assert {c.pid for c in launched.children()} == {p for k, p in ready["pids"].items() if k != "supervisor"}
    plan = ready["plan"]
    assert (plan["working_slots"], plan["slots_per_layer"], plan["pinned_slots"]) == (store.top_k, 1, 0)
    assert plan["total_slots"] == store.top_k + len(store.sparse_layers) and plan["slot_bytes"] == store.slot_bytes
    assert os.path.exists(f"/dev/shm{ready['slab']}")
    record = json.loads(Path(run_dir, "supervisor.json").read_text())
    assert record["pid"] == launched.process.pid and record["slab"] == ready["slab"]

    check_tokens(run_tokens(launched.endpoint), want)

    # SIGTERM while a job runs: the job gets a clear error, the supervisor exits 0, nothing is left.
    with Client(launched.endpoint, timeout=30) as client:
        stream = client.generate(prompt_tokens=list(PROMPT), max_tokens=100_000)
        assert isinstance(next(stream), TokenEvent)
        launched.process.send_signal(signal.SIGTERM)
        with pytest.raises(JobFailedError) as caught:
            for _ in stream:
                pass
    assert caught.value.code in ("shutting_down", "worker_stopping"), caught.value
    assert launched.wait() == 0, launched.stderr()[-4000:]
    assert launched.process.stdout.read() == b"", "exactly one line on stdout"
    assert_all_gone(launched)
    assert not run_dirs(tmp_path)
    stderr = launched.stderr()
    assert "SIGTERM: stopping" in stderr and "Traceback" not in stderr


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_loopback_tcp_endpoint_a_given_run_dir_and_sigint(model, tmp_path):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    run_dir = tmp_path / "run"
    launched = launch(
        tmp_path,
        model_args(model) + ["--endpoint", endpoint, "--run-dir", str(run_dir), "--pinned-experts", "auto"],
    )
    workers, why = resolve_io_workers(None)  # no --io-workers: auto (1 on this 2-core host)
    assert f"{workers} I/O worker(s) ({why})" in launched.stderr()
    assert launched.ready["endpoint"] == endpoint and launched.ready["run_dir"] == str(run_dir)
    assert launched.ready["plan"]["pinned_slots"] == 0 and ("io_worker_1" in launched.pids) == (workers == 2)
    assert not (run_dir / "jobs").exists()  # tcp: no socket file for jobs
    with Client(endpoint, timeout=30) as client:
        health = client.health()
        assert health.ready and health.io_workers == workers and health.gpu_worker
        assert health.liveness == ("pidfd" if hasattr(os, "pidfd_open") else "psutil")  # shared/pid_watch.py
    assert launched.signal(signal.SIGINT) == 0, launched.stderr()[-4000:]
    for pid in launched.pids.values():
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not os.path.exists(f"/dev/shm{launched.ready['slab']}")
    assert run_dir.is_dir() and not list(run_dir.iterdir())  # the given directory stays, emptied


@pytest.mark.parametrize("case", ["not_a_model", "budget_too_small", "remote_endpoint", "bad_size"])
def test_refusals_exit_non_zero_with_the_reason(case, model, tmp_path):
    store = ExpertStore.open(model)
    args, code, needles = {
        "not_a_model": (["--model", str(tmp_path), "--memory-budget", "1GiB"], 1, ["missing config.json"]),
        "budget_too_small": (
            model_args(model, budget=tight_budget(store) - 1),
            1,
            ["cannot start", f"dense weights ({store.dense_bytes} bytes)"],
        ),
        "remote_endpoint": (model_args(model) + ["--endpoint", "tcp://0.0.0.0:5555"], 2, ["only loopback tcp"]),
        "bad_size": (["--model", str(model), "--memory-budget", "lots"], 2, ["'lots' is not a size"]),
    }[case]
    launched = launch(tmp_path, args, expect_ready=False, timeout=60)
    assert launched.process.returncode == code
    for needle in needles:
        assert needle in launched.stderr(), launched.stderr()
    assert not run_dirs(tmp_path)


def test_a_child_that_fails_at_start_fails_the_launch(model, tmp_path):
    # The expert store (all the supervisor reads) is intact; the GPU worker's mlx-lm model is not.
    broken = tmp_path / "wrong-heads"
    shutil.copytree(model, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(dict(config, num_attention_heads=2)))
    started = time.monotonic()
    launched = launch(tmp_path, model_args(broken), expect_ready=False, timeout=90)
    stderr = launched.stderr()
    assert launched.process.returncode == 1, stderr
    assert "the system failed to start" in stderr and "GPU worker (pid" in stderr, stderr
    assert "exited with code 1" in stderr and "Expected shape (32, 64)" in stderr, stderr
    assert time.monotonic() - started < 60
    assert not run_dirs(tmp_path)  # run directory (and with it the record) removed
    assert wait_for(lambda: not launched.children(), timeout=10)


def test_sigterm_while_starting_stops_cleanly(model, tmp_path):
    launched = spawn_supervisor(tmp_path, model_args(model))
    process = launched.process
    assert wait_for(lambda: "coordinator: serving" in launched.stderr() or process.poll() is not None, timeout=60)
    process.send_signal(signal.SIGTERM)
    assert launched.wait() == 0, launched.stderr()[-4000:]
    assert process.stdout.read() == b"" and "stopped by a signal while starting" in launched.stderr()
    process.stdout.close()
    assert not run_dirs(tmp_path) and wait_for(lambda: not launched.children(), timeout=10)


def test_replacement_flag_parses_defaults_and_refuses():
    from shared.config import DEFAULT_REPLACEMENT
    from supervisor.options import parse_args

    base = ["--model", "m", "--memory-budget", "1GiB"]
    assert parse_args(base).replacement == DEFAULT_REPLACEMENT
    assert parse_args([*base, "--replacement", "lru"]).replacement == "lru"
    assert parse_args([*base, "--replacement", "lrfu:32"]).replacement == "lrfu:32"
    for bad in ("mru", "lru:3", "lrfu:0"):
        with pytest.raises(SystemExit) as exited:
            parse_args([*base, "--replacement", bad])
        assert exited.value.code == 2


def test_io_workers_flag_is_a_count_or_auto(capsys):
    from supervisor.options import parse_args

    base = ["--model", "m", "--memory-budget", "1GiB"]
    assert parse_args(base).io_workers is None  # auto: start_system asks resolve_io_workers
    assert parse_args([*base, "--io-workers", "auto"]).io_workers is None
    assert parse_args([*base, "--io-workers", "3"]).io_workers == 3
    for bad, said in (("0", "must be >= 1, got 0"), ("two", "'two' is not an integer")):
        with pytest.raises(SystemExit) as exited:
            parse_args([*base, "--io-workers", bad])
        assert exited.value.code == 2 and said in capsys.readouterr().err


def test_replacement_flag_reaches_the_coordinator(model, want, tmp_path):
    """moeslab-launch --replacement → SupervisorOptions → RunConfig (config.json) → the manager."""
    launched = launch(tmp_path, model_args(model) + ["--replacement", "lrfu:8"])
    config = json.loads(Path(launched.ready["run_dir"], "config.json").read_text())
    assert config["replacement"] == "lrfu:8"
    check_tokens(run_tokens(launched.endpoint), want)
    assert launched.signal(signal.SIGTERM) == 0, launched.stderr()[-4000:]
    assert "replacement lrfu)" in launched.stderr()  # the coordinator's manager, by its name
