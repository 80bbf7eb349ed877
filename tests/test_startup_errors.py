"""The first errors a user meets read as one line (issue 15, item 9).

`python -m supervisor` (what `moeslab-launch` runs) refused at startup: a missing model, a
truncated safetensors file, a budget too small, a bad flag, an endpoint or a run directory in
use. Each exits non-zero with exactly one stderr line that names the file or value, and no
traceback; `--log-level debug` shows the traceback too. A child that dies while starting ends
the launch with the refusal as the last line. `moeslab-send` to an ipc endpoint nobody serves
says so at once.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shared.client import Client, ClientError
from shared.slab import new_slab_name
from shared.store import ExpertStore
from supervisor.rundir import write_run_record
from tests.helpers.supervisor import REPO, model_args, run_dirs, supervisor_env, tiny_model
from tests.helpers.system import tight_budget

PROG = "moeslab-launch: error: "


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory)


def launch_refused(tmp_path: Path, args: list[str], *, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run the launcher to its exit; stdout (the ready line's channel) must stay empty."""
    done = subprocess.run(
        [sys.executable, "-m", "supervisor", *args],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=supervisor_env(tmp_path),
        timeout=timeout,
    )
    assert done.stdout == "", done.stdout
    assert not run_dirs(tmp_path), "a refused launch leaves no run directory"
    return done


def the_one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(PROG), lines[0]
    return lines[0]


def test_a_missing_model_directory(tmp_path):
    missing = tmp_path / "nonexistent"
    done = launch_refused(tmp_path, ["--model", str(missing), "--memory-budget", "1GiB"])
    assert done.returncode == 1
    assert the_one_line(done) == f"{PROG}{missing}: not a model directory"


@pytest.mark.parametrize("keep", ["header", "data"])
def test_a_truncated_safetensors_file(model, tmp_path, keep):
    broken = tmp_path / "model"
    shutil.copytree(model, broken)
    weights = sorted(broken.glob("*.safetensors"))[0]
    size = weights.stat().st_size
    with open(weights, "r+b") as file:
        file.truncate(1000 if keep == "header" else size // 2)  # cut into the header, or into the data
    done = launch_refused(tmp_path, model_args(model)[2:] + ["--model", str(broken)])
    assert done.returncode == 1
    line = the_one_line(done)
    assert f"{weights}: " in line, line
    assert ("corrupt safetensors header length" if keep == "header" else "truncated file") in line, line


def test_a_budget_that_cannot_hold_the_plan(model, tmp_path):
    budget = tight_budget(ExpertStore.open(model)) - 1
    done = launch_refused(tmp_path, model_args(model, budget=budget))
    assert done.returncode == 1
    line = the_one_line(done)
    assert f"memory budget {budget} bytes cannot start" in line and str(model) in line, line


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--memory-budget", "lots"], "'lots' is not a size"),
        (["--memory-budget", "1GiB", "--io-workers", "zero"], "'zero' is not an integer"),
        (["--memory-budget", "1GiB", "--bogus"], "unrecognized arguments: --bogus"),
        ([], "the following arguments are required: --memory-budget"),
    ],
)
def test_a_bad_flag(model, tmp_path, flags, named):
    done = launch_refused(tmp_path, ["--model", str(model), *flags])
    assert done.returncode == 2
    line = the_one_line(done)
    assert named in line, line


def test_an_endpoint_in_use(model, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        done = launch_refused(tmp_path, model_args(model) + ["--endpoint", endpoint])
    assert done.returncode == 1
    assert the_one_line(done) == f"{PROG}{endpoint}: address already in use (another server listens there)"


def test_a_run_directory_in_use(model, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_run_record(run_dir, new_slab_name())  # this test's own (live) process owns it
    done = launch_refused(tmp_path, model_args(model) + ["--run-dir", str(run_dir)])
    assert done.returncode == 1
    line = the_one_line(done)
    assert f"run directory {run_dir} belongs to a live run" in line, line


def test_debug_shows_the_traceback_and_ends_with_the_refusal(tmp_path):
    missing = tmp_path / "nonexistent"
    done = launch_refused(tmp_path, ["--model", str(missing), "--memory-budget", "1GiB", "--log-level", "Debug"])
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr and "StoreError" in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1] == f"{PROG}{missing}: not a model directory"


def test_a_child_that_dies_while_starting_ends_with_one_refusal_line(model, tmp_path):
    # The expert store (all the supervisor reads) is intact; the GPU worker's mlx-lm model is not.
    broken = tmp_path / "wrong-heads"
    shutil.copytree(model, broken)
    config = (broken / "config.json").read_text()
    assert '"num_attention_heads": 4' in config
    (broken / "config.json").write_text(config.replace('"num_attention_heads": 4', '"num_attention_heads": 2'))
    done = launch_refused(tmp_path, model_args(broken), timeout=90)
    assert done.returncode == 1
    last = done.stderr.splitlines()[-1]
    assert last.startswith(f"{PROG}the system failed to start: GPU worker (pid "), done.stderr[-3000:]
    assert "exited with code 1: setup failed loading the tokenizer and model" in last, last
    assert "Expected shape (32, 64)" in last, last
    assert "supervisor/main.py" not in done.stderr, done.stderr[-3000:]  # no traceback of the supervisor's own


def send(endpoint: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "send.py"), "--endpoint", endpoint, "--prompt", "hi"],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=10,  # the client's own reply timeout is 30 s: it must not be what ends this
    )


def test_send_to_an_ipc_endpoint_without_a_server_fails_at_once(tmp_path):
    missing = tmp_path / "jobs"
    done = send(f"ipc://{missing}")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == f"moeslab-send: no server at ipc://{missing} (no socket file {missing})\n"
    # A socket file its server left behind (bound, closed, never removed) serves nobody either.
    stale = tmp_path / "stale"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as left:
        left.bind(str(stale))
    done = send(f"ipc://{stale}")
    assert done.returncode == 1
    assert done.stderr == f"moeslab-send: no server at ipc://{stale} (nothing listens on {stale})\n"
    # Python users get the client's own error type.
    with pytest.raises(ClientError, match=f"no server at ipc://{missing}"):
        Client(f"ipc://{missing}", timeout=30)
