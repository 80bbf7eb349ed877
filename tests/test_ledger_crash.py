"""The usage ledger survives a kill at any instant (issue 15, item 6).

A process flushes the ledger in a loop, every flush a new version (version v: every expert's
count is v), and is SIGKILLed after a random 0-30 ms, over 200 times. After each kill the
profile on disk is exactly the last version the process reported flushed or the one after it
(killed between the rename and the report), read with the real loader and compared byte for
byte: never torn, never empty, never missing once it existed. A killed flush's temp file is
removed by the next ledger that opens the profile. Finally a real system, launched on the
surviving file, loads it (its counts carry on from it).

The flushing processes are forked by one long-lived helper (`ZYGOTE`, a plain `python -c`)
that has already imported the ledger, so a round costs a fork, not an interpreter start.
"""

from __future__ import annotations

import contextlib
import os
import random
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from coordinator.usage import ExpertUsageLedger
from shared.store import ExpertStore
from shared.usage_profile import UsageProfile
from tests.helpers.supervisor import REPO, assert_all_gone, launch, model_args, run_tokens, tiny_model
from tests.helpers.system import PROMPT

ROUNDS = 200
EXTRA_ROUNDS = 100  # at most, until a kill leaves a temp file for the launched coordinator to remove
MAX_DELAY_S = 0.03

# argv: PROFILE LAYERS(comma-separated) EXPERTS. Per line on stdin: fork a child that opens the
# ledger ("loaded V"), then flushes versions V+1, V+2, ... ("flushed V") until it is killed;
# report its pid, reap it, report its wait status.
ZYGOTE = r"""
import os, sys
from coordinator.usage import ExpertUsageLedger

path, layers, experts = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])

def say(text):
    os.write(1, (text + "\n").encode())

def flush_forever():
    ledger = ExpertUsageLedger.open(path, layers=layers, experts_per_layer=experts)
    version = ledger.snapshot().total_count // (len(layers) * experts)
    say(f"loaded {version}")
    every_expert = [list(range(experts))]
    while True:
        for layer in layers:
            ledger.record_routes(layer, every_expert)
        ledger.flush()
        version += 1
        say(f"flushed {version}")

for _ in sys.stdin:
    pid = os.fork()
    if pid == 0:
        try:
            flush_forever()
        finally:
            os._exit(3)
    say(f"pid {pid}")
    say(f"reaped {pid} {os.waitpid(pid, 0)[1]}")
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory)


class Lines:
    """Lines from a pipe, each waited for with a deadline (a stuck helper fails the test, not hangs it)."""

    def __init__(self, fd: int) -> None:
        self._fd, self._buffer = fd, b""

    def next(self, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            assert left > 0 and select.select([self._fd], [], [], left)[0], "the flushing helper went silent"
            chunk = os.read(self._fd, 65536)
            assert chunk, "the flushing helper exited"
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()


def expected_bytes(layers: tuple[int, ...], experts: int, version: int) -> bytes:
    return "".join(f"{layer} {expert} {version}\n" for layer in layers for expert in range(experts)).encode()


def version_on_disk(path: Path, layers: tuple[int, ...], experts: int) -> int | None:
    """The complete version the profile holds (None: no file); fails on anything torn or empty."""
    if not path.exists():
        return None
    data = path.read_bytes()
    warnings: list[str] = []
    profile = UsageProfile.open(str(path), layers=layers, experts_per_layer=experts, on_warning=warnings.append)
    assert not warnings, warnings
    counts = np.concatenate([profile.counts[layer] for layer in layers])
    version = int(counts[0])
    assert version > 0 and (counts == version).all(), f"a torn profile: {data!r}"
    assert data == expected_bytes(layers, experts, version), data
    return version


def temp_pids(path: Path) -> set[int]:
    return {int(temp.name[len(path.name) + 5 :].split("-")[0]) for temp in path.parent.glob(f"{path.name}.tmp-*")}


@dataclass
class Crashes:
    """What the kill rounds did: the version the profile held at the end, flushes reported, and
    how many kills caught a flush between creating its temp file and renaming it."""

    version: int | None = None
    rounds: int = 0
    flushes: int = 0
    left_temps: int = 0
    last_pid: int = 0


def kill_flushes(usage: Path, layers: tuple[int, ...], experts: int, log: Path) -> Crashes:
    """ROUNDS (or more, until the last kill leaves a temp file) forked flush loops, each SIGKILLed at a
    random instant; after each kill the profile is checked whole and the temp files accounted for."""
    rng = random.Random(15)
    with open(log, "wb") as stderr:
        zygote = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE, str(usage), ",".join(map(str, layers)), str(experts)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
    lines = Lines(zygote.stdout.fileno())
    seen = Crashes()
    try:
        # The last round must leave a temp file: the coordinator launched afterwards has to remove it.
        while seen.rounds < ROUNDS or seen.last_pid not in temp_pids(usage):
            assert seen.rounds < ROUNDS + EXTRA_ROUNDS, f"no kill of {seen.rounds} left a temp file"
            seen.rounds += 1
            zygote.stdin.write(b"go\n")
            zygote.stdin.flush()
            said: list[str] = []  # the child may speak before the helper names it
            while not (line := lines.next()).startswith("pid "):
                said.append(line)
            pid = seen.last_pid = int(line.split()[1])
            time.sleep(rng.uniform(0, MAX_DELAY_S))
            os.kill(pid, signal.SIGKILL)
            while not (line := lines.next()).startswith("reaped "):
                said.append(line)
            status = int(line.split()[2])
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (status, log.read_text())
            loaded = next((int(text.split()[1]) for text in said if text.startswith("loaded ")), None)
            flushed = [int(text.split()[1]) for text in said if text.startswith("flushed ")]
            if loaded is not None:
                assert loaded == (seen.version or 0), (loaded, seen.version)  # it read what the last check saw
            last = flushed[-1] if flushed else (seen.version or 0)
            on_disk = version_on_disk(usage, layers, experts)
            if on_disk is None:
                assert seen.version is None and last == 0, "the profile vanished"
            else:
                assert on_disk in (last, last + 1), (on_disk, last)  # the old or the new, whole
            seen.version = on_disk
            seen.flushes += len(flushed)
            stray = temp_pids(usage)
            if loaded is not None:  # opening the ledger removed the temps of every earlier (dead) writer
                assert stray <= {pid}, (stray, pid)
            seen.left_temps += pid in stray
    finally:
        if seen.last_pid:  # a failed check may leave the round's child flushing: the helper waits for it
            with contextlib.suppress(ProcessLookupError):
                os.kill(seen.last_pid, signal.SIGKILL)
        zygote.stdin.close()
        try:
            zygote.wait(timeout=20)
        except subprocess.TimeoutExpired:
            zygote.kill()
            zygote.wait()
        zygote.stdout.close()
    assert zygote.returncode == 0, log.read_text()
    return seen


def test_a_ledger_killed_at_any_instant_leaves_a_whole_profile_that_a_coordinator_loads(model, tmp_path):
    store = ExpertStore.open(model)
    layers, experts = tuple(store.sparse_layers), store.experts_per_layer
    usage = tmp_path / "usage" / "profile"
    usage.parent.mkdir()
    seen = kill_flushes(usage, layers, experts, tmp_path / "zygote.log")
    version = seen.version
    # The kills landed all over the flush loop: many flushes completed, and some kills caught a flush
    # between creating its temp file and renaming it (the last one did).
    assert version is not None and seen.flushes > seen.rounds and seen.left_temps > 0, seen
    assert seen.last_pid in temp_pids(usage)

    # A real system starts on the surviving profile; its coordinator loads it and removes the temp.
    launched = launch(tmp_path, model_args(model) + ["--usage-file", str(usage)])
    coordinator = launched.pids["coordinator"]
    assert temp_pids(usage) <= {coordinator}, temp_pids(usage)
    run_tokens(launched.endpoint)
    assert launched.signal(signal.SIGTERM) == 0, launched.stderr()[-3000:]
    assert_all_gone(launched)
    assert "ignoring invalid expert usage profile" not in launched.stderr()
    assert not temp_pids(usage)
    ledger = ExpertUsageLedger.open(usage, layers=layers, experts_per_layer=experts)  # flushed at shutdown
    # Every count carried on from the surviving version; the job's prompt alone adds top-k per token per layer.
    assert all(ledger.entry(layer, e).count >= version for layer in layers for e in range(experts))
    assert ledger.total_count >= version * len(layers) * experts + len(PROMPT) * store.top_k * len(layers)


def test_only_temp_files_of_dead_writers_are_removed(tmp_path):
    profile = tmp_path / "usage"
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(done.stdout)  # exited and reaped: no process has this pid now (reuse is not this quick)
    names = {
        f"usage.tmp-{dead}-1-00ff00ff": False,  # a killed flush's: removed
        f"usage.tmp-{os.getpid()}-2-00ff00ff": True,  # a live writer's (a flush in progress): kept
        "usage.tmp-0-3-00ff00ff": True,  # no writer's name: kept
        "usage.tmp-junk": True,
        f"other.tmp-{dead}-4-00ff00ff": True,  # another profile's
    }
    for name in names:
        (tmp_path / name).write_bytes(b"0 1 ")
    ledger = ExpertUsageLedger.open(profile, layers=[0], experts_per_layer=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(name for name, kept in names.items() if kept)
    ledger.record_routes(0, [[1, 2]])
    ledger.flush()
    assert profile.read_bytes() == b"0 1 1\n0 2 1\n"
