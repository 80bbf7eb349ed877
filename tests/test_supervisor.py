"""The supervisor as users run it: `python scripts/launch.py ...` in a subprocess.

Its one JSON ready line, a job token-exact with mlx-lm, SIGTERM / SIGINT
during a job (exit 0, nothing left: no process, segment, socket file or run
directory), a loopback tcp endpoint and a given run directory, and every
refusal: a bad flag, a model directory that is not a model, a budget too
small, a child that fails at start. `TMPDIR` points at a private directory,
so default run directories and stale-run cleanup stay inside the test.

The helpers here (`launch`, `Launched`, ...) are shared with
test_restarts.py and test_stale.py.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from shared.client import Client
from shared.client import JobError as ClientJobError
from shared.config import check_jobs_endpoint
from shared.job_messages import TokenEvent
from shared.store import ExpertStore
from supervisor.budget import parse_size
from supervisor.rundir import clean_stale_runs
from tests.system_helpers import PROMPT, TEST_KV_RESERVE, io_mode_for, oracle, tight_budget, wait_for
from tests.tiny_models import EOS_TOKEN_ID, write_tiny_model

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "scripts" / "launch.py"
GENERATED = 24
READY_TIMEOUT = 90.0


@dataclass
class Launched:
    """A running supervisor: its Popen, its ready line, its stderr log file."""

    process: subprocess.Popen
    ready: dict | None
    log: Path

    @property
    def endpoint(self) -> str:
        return self.ready["endpoint"]

    @property
    def pids(self) -> dict[str, int]:
        return self.ready["pids"]

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def signal(self, signum: int, *, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signum)
        return self.wait(timeout=timeout)

    def wait(self, *, timeout: float = 60.0) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            self.reap()
            raise AssertionError(f"the supervisor did not exit within {timeout} s:\n{self.stderr()[-4000:]}") from None

    def reap(self) -> None:
        """After a SIGKILL of the supervisor: let the children exit, remove what the run left."""
        wait_for(lambda: not self.children() and all(not psutil.pid_exists(p) for p in self._known), timeout=20)
        clean_stale_runs(self.log.parent / "tmp")

    @property
    def _known(self) -> list[int]:
        return [p for k, p in (self.ready or {}).get("pids", {}).items() if k != "supervisor"]

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def child_pid(self, needle: str) -> int:
        """The pid of the supervisor's child whose command line contains `needle`."""
        for child in self.children():
            try:
                if needle in " ".join(child.cmdline()):
                    return child.pid
            except psutil.NoSuchProcess:
                continue
        raise AssertionError(f"no child matching {needle!r}")


_STARTED: list[Launched] = []


def stop_leftovers() -> None:
    """After a test (a failed one above all): stop any supervisor it left running, so the leak
    check reports the failure, not its consequences."""
    while _STARTED:
        launched = _STARTED.pop()
        if launched.process.poll() is None:
            launched.process.send_signal(signal.SIGTERM)
            try:
                launched.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                launched.process.kill()
                launched.process.wait()
                launched.reap()
        if launched.process.stdout is not None:
            launched.process.stdout.close()


@pytest.fixture(autouse=True)
def _no_leftover_supervisors():
    yield
    stop_leftovers()


def supervisor_env(tmp_path: Path) -> dict[str, str]:
    """The test's environment (the shm tag included) with a private TMPDIR."""
    private = tmp_path / "tmp"
    private.mkdir(exist_ok=True)
    return dict(os.environ, TMPDIR=str(private), PYTHONUNBUFFERED="1")


def model_args(model: Path, *, budget: int | None = None) -> list[str]:
    """The tight plan: top_k working slots, one resident slot per sparse layer, 1 MiB KV reserve."""
    store = ExpertStore.open(model)
    return [
        "--model",
        str(model),
        "--memory-budget",
        str(budget if budget is not None else tight_budget(store)),
        "--kv-reserve",
        str(TEST_KV_RESERVE),
        "--working-slots",
        str(store.top_k),
        "--slots-per-layer",
        "1",
        "--io-mode",
        io_mode_for(model),
    ]


def launch(
    tmp_path: Path,
    args: list[str],
    *,
    expect_ready: bool = True,
    name: str = "supervisor",
    timeout: float = READY_TIMEOUT,
) -> Launched:
    """Start `scripts/launch.py ARGS`; wait for its ready line (or, if not expected, for its exit)."""
    log = tmp_path / f"{name}.log"
    with open(log, "wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, str(LAUNCH), *args],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=supervisor_env(tmp_path),
        )
    launched = Launched(process, None, log)
    _STARTED.append(launched)
    if not expect_ready:
        launched.wait(timeout=timeout)
        assert process.stdout.read() == b"", "a failed launch must print nothing on stdout"
        process.stdout.close()
        return launched
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or (process.poll() is not None and not select.select([process.stdout], [], [], 0)[0]):
            process.kill()
            process.wait()
            launched.reap()
            raise AssertionError(f"no ready line (exit {process.returncode}):\n{launched.stderr()[-4000:]}")
        if select.select([process.stdout], [], [], min(left, 0.5))[0]:
            chunk = os.read(process.stdout.fileno(), 65536)
            if not chunk:
                continue
            line += chunk
    launched.ready = json.loads(line)
    return launched


def run_dirs(tmp_path: Path) -> list[Path]:
    """The moeslab run directories under the test's private TMPDIR (mlx keeps a cache there too)."""
    return sorted((tmp_path / "tmp").glob("moeslab-*"))


def assert_all_gone(launched: Launched, pids: list[int] | None = None) -> None:
    """No child process, the ready line's slab, socket files or run directory is left."""
    for pid in pids if pids is not None else launched.pids.values():
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    assert not os.path.exists(f"/dev/shm{launched.ready['slab']}")
    assert not os.path.exists(launched.ready["run_dir"])


def run_tokens(endpoint: str, max_tokens: int = GENERATED, *, timeout: float = 60.0) -> list[int]:
    with Client(endpoint, timeout=timeout) as client:
        return list(client.generate(prompt_tokens=list(PROMPT), max_tokens=max_tokens).result().tokens)


def check_tokens(got: list[int], want: list[int]) -> None:
    """Equal to mlx-lm's greedy tokens, up to an EOS stop (EOS is not emitted)."""
    assert got == want[: len(got)], (got, want)
    assert len(got) == len(want) or want[len(got)] == EOS_TOKEN_ID, (got, want)


def tiny_model(factory) -> Path:
    """The model every supervisor test runs: qwen3_moe, full precision (the quickest to start)."""
    return write_tiny_model(factory.mktemp("qwen3_moe"), family="qwen3_moe", quantized=False)


def oracle_tokens(model: Path) -> list[int]:
    return oracle(model, PROMPT, GENERATED).tokens


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
        "tcp://localhost:5555",
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
    launched = launch(tmp_path, model_args(model))
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
        with pytest.raises(ClientJobError) as caught:
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
        model_args(model)
        + ["--endpoint", endpoint, "--run-dir", str(run_dir), "--pinned-experts", "auto", "--io-workers", "1"],
    )
    assert launched.ready["endpoint"] == endpoint and launched.ready["run_dir"] == str(run_dir)
    assert launched.ready["plan"]["pinned_slots"] == 0 and "io_worker_1" not in launched.pids
    assert not (run_dir / "jobs").exists()  # tcp: no socket file for jobs
    with Client(endpoint, timeout=30) as client:
        health = client.health()
        assert health.ready and health.io_workers == 1 and health.gpu_worker
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
    log = tmp_path / "supervisor.log"
    with open(log, "wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, str(LAUNCH), *model_args(model)],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=supervisor_env(tmp_path),
        )
    launched = Launched(process, None, log)
    _STARTED.append(launched)
    assert wait_for(lambda: "coordinator: serving" in launched.stderr() or process.poll() is not None, timeout=60)
    process.send_signal(signal.SIGTERM)
    assert launched.wait() == 0, launched.stderr()[-4000:]
    assert process.stdout.read() == b"" and "stopped by a signal while starting" in launched.stderr()
    process.stdout.close()
    assert not run_dirs(tmp_path) and wait_for(lambda: not launched.children(), timeout=10)
