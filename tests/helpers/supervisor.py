"""The supervisor as users run it: `python scripts/launch.py ...` in a subprocess, and its ready line.

What the supervisor tests (test_supervisor, test_restarts, test_stale) share. Every supervisor
started here is remembered until `stop_leftover_supervisors` (tests/conftest.py calls it after
every test) stops it, so a failed test's supervisor never outlives the test. `TMPDIR` points at
a private directory under the test's tmp_path, so default run directories and stale-run
cleanup stay inside the test.

- `spawn_supervisor(tmp_path, args)`: start it, no waiting; `launch(...)`: start it and wait for
  its ready line (or, for a refusal, its exit). Both return a `Launched`; `shared=True` leaves it
  running after the test (a module fixture's system, stopped by the fixture).
- `model_args(model)`: the launch flags of the tight plan over a tiny model.
- `tiny_model(factory)`, `oracle_tokens(model)`: the model every supervisor test runs, and
  mlx-lm's greedy tokens for it.
- `run_tokens(endpoint)`, `check_tokens(got, want)`: one job's tokens, compared with mlx-lm's.
- `run_dirs(tmp_path)`, `assert_all_gone(launched)`: what a stopped run may (not) leave behind.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from shared.client import Client
from shared.demo_model import EOS_TOKEN_ID
from shared.store import ExpertStore
from supervisor.rundir import clean_stale_runs
from tests.helpers.models import write_tiny_model
from tests.helpers.oracle import oracle
from tests.helpers.system import PROCESS_ALLOWANCE, PROMPT, TEST_KV_RESERVE, io_mode_for, tight_budget, wait_for

REPO = Path(__file__).resolve().parents[2]
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


def stop_leftover_supervisors() -> None:
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


def supervisor_env(tmp_path: Path) -> dict[str, str]:
    """The test's environment (the shm tag included) with a private TMPDIR."""
    private = tmp_path / "tmp"
    private.mkdir(exist_ok=True)
    return dict(os.environ, TMPDIR=str(private), PYTHONUNBUFFERED="1")


def model_args(model: Path, *, budget: int | None = None) -> list[str]:
    """The tight plan: top_k working slots, one resident slot per sparse layer, 1 MiB KV reserve; the
    budget has room for the processes (PROCESS_ALLOWANCE) unless `budget` is given."""
    store = ExpertStore.open(model)
    return [
        "--model",
        str(model),
        "--memory-budget",
        str(budget if budget is not None else tight_budget(store) + PROCESS_ALLOWANCE),
        "--kv-reserve",
        str(TEST_KV_RESERVE),
        "--working-slots",
        str(store.top_k),
        "--slots-per-layer",
        "1",
        "--io-mode",
        io_mode_for(model),
    ]


def spawn_supervisor(tmp_path: Path, args: list[str], *, name: str = "supervisor", shared: bool = False) -> Launched:
    """Start `scripts/launch.py ARGS` (stdout a pipe, stderr to `tmp_path/NAME.log`); no waiting.
    `shared`: a module fixture's supervisor, which outlives each test (the fixture stops it)."""
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
    if not shared:
        _STARTED.append(launched)
    return launched


def launch(
    tmp_path: Path,
    args: list[str],
    *,
    expect_ready: bool = True,
    name: str = "supervisor",
    timeout: float = READY_TIMEOUT,
    shared: bool = False,
) -> Launched:
    """Start `scripts/launch.py ARGS`; wait for its ready line (or, if not expected, for its exit).
    `shared`: see `spawn_supervisor`."""
    launched = spawn_supervisor(tmp_path, args, name=name, shared=shared)
    process = launched.process
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
    """mlx-lm's greedy tokens for `PROMPT`, `GENERATED` of them."""
    return oracle(model, PROMPT, GENERATED).tokens


__all__ = [
    "GENERATED",
    "LAUNCH",
    "READY_TIMEOUT",
    "REPO",
    "Launched",
    "assert_all_gone",
    "check_tokens",
    "launch",
    "model_args",
    "oracle_tokens",
    "run_dirs",
    "run_tokens",
    "spawn_supervisor",
    "stop_leftover_supervisors",
    "supervisor_env",
    "tiny_model",
]
