"""Hung workers (coordinator/liveness.py, supervisor/watch.py): stopped, not dead.

A process stopped with SIGSTOP keeps its pid and answers nothing. Through the
real supervisor: a GPU worker stopped mid-job fails that job with
`worker_hung`, is killed and replaced, and the next job is token-exact; an
I/O worker stopped with loads in flight is killed and its loads re-submitted,
so the job completes token-exact; a stopped coordinator is killed by the
supervisor's health probe and everything restarts; a slow disk (every read
held by the test knob) is not a hang. The deadlines are short here
(`--hang-timeout 2`) so the suite stays quick; a missed detection shows as a
client timeout, never as a timed assert. The deadline arithmetic is tested
on its own.
"""

from __future__ import annotations

import os
import signal

import pytest

from coordinator.liveness import GpuProgress, ProgressDeadline
from shared.client import Client, JobFailedError
from shared.job_messages import WORKER_HUNG, TokenEvent
from tests.helpers.supervisor import (
    GENERATED,
    assert_all_gone,
    check_tokens,
    launch,
    model_args,
    oracle_tokens,
    tiny_model,
)
from tests.helpers.system import PROMPT, wait_for

HANG = ["--hang-timeout", "2"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def want(model):
    return oracle_tokens(model)


def _processes(endpoint: str) -> dict[str, tuple[int, int]]:
    with Client(endpoint, timeout=30) as client:
        return {p.name: (p.pid, p.restarts) for p in client.health().processes}


# ------------------------------------------------------------ the deadline arithmetic


def test_a_deadline_grows_with_the_bytes_loads_and_rows_owed():
    deadline = ProgressDeadline(timeout_s=2.0, min_bytes_per_s=1_000_000, per_load_s=0.5, per_row_s=0.01)
    assert deadline.io_allowance(owed_bytes=0, owed_loads=0) == 2.0
    assert deadline.io_allowance(owed_bytes=3_000_000, owed_loads=4) == pytest.approx(2.0 + 3.0 + 2.0)
    assert deadline.gpu_allowance(rows=1) == pytest.approx(2.01)
    assert deadline.gpu_allowance(rows=2048) == pytest.approx(2.0 + 20.48)


@pytest.mark.parametrize(
    "field, value",
    [("timeout_s", 0), ("timeout_s", -1.0), ("min_bytes_per_s", 0), ("per_load_s", -0.1), ("timeout_s", True)],
)
def test_a_deadline_refuses_a_nonsense_value_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        ProgressDeadline(**{field: value})


def test_the_gpu_worker_is_overdue_only_when_silent_past_its_allowance_and_not_waiting_on_us():
    progress = GpuProgress(ProgressDeadline(timeout_s=2.0, per_row_s=0.5), at=100.0, rows=4)
    assert progress.overdue(103.9) is None  # allowed 2 + 4 * 0.5
    assert "no message for 4.1 s" in progress.overdue(104.1)
    progress.serving = True  # its routes are being served: it waits on the coordinator
    assert progress.overdue(1000.0) is None


# ------------------------------------------------------------ through the real supervisor


def test_a_hung_gpu_worker_fails_its_job_as_hung_is_replaced_and_the_next_job_is_exact(model, want, tmp_path):
    launched = launch(tmp_path, model_args(model) + HANG)
    victim = launched.pids["gpu_worker"]
    with Client(launched.endpoint, timeout=30) as client:
        stream = client.generate(prompt_tokens=list(PROMPT), max_tokens=100_000)
        assert isinstance(next(stream), TokenEvent)
        os.kill(victim, signal.SIGSTOP)
        with pytest.raises(JobFailedError) as caught:  # a missed hang would time out instead
            for _ in stream:
                pass
        assert caught.value.code == WORKER_HUNG and "hung: no message for" in caught.value.message
        done = client.generate(prompt_tokens=list(PROMPT), max_tokens=GENERATED).result()  # waits for the new one
    check_tokens(list(done.tokens), want)
    table = _processes(launched.endpoint)
    replacement, restarts = table["gpu_worker"]
    assert replacement != victim and restarts == 1
    assert f"GPU worker (pid {victim}) is hung" in launched.stderr()
    assert launched.signal(signal.SIGTERM) == 0
    assert_all_gone(launched, [*launched.pids.values(), replacement])


def test_a_hung_io_worker_is_replaced_and_its_loads_resubmitted_so_the_job_is_exact(model, want, tmp_path):
    launched = launch(tmp_path, model_args(model) + HANG + ["--test-io-read-delay-ms", "60"])
    victim = launched.pids["io_worker_0"]
    with Client(launched.endpoint, timeout=60) as client:
        tokens = []
        for event in client.generate(prompt_tokens=list(PROMPT), max_tokens=GENERATED):
            if isinstance(event, TokenEvent):
                tokens.append(event.token)
                if len(tokens) == 2:
                    os.kill(victim, signal.SIGSTOP)
    check_tokens(tokens, want)
    stderr = launched.stderr()
    assert f"I/O worker 0 (pid {victim}) is hung" in stderr
    assert "lost with" in stderr and "hung: no message for" in stderr
    assert wait_for(lambda: _processes(launched.endpoint)["io_worker_0"][1] == 1, timeout=30)
    replacement = _processes(launched.endpoint)["io_worker_0"][0]
    assert replacement != victim
    with Client(launched.endpoint, timeout=60) as client:  # the replacement serves
        check_tokens(list(client.generate(prompt_tokens=list(PROMPT), max_tokens=GENERATED).result().tokens), want)
    assert launched.signal(signal.SIGTERM) == 0
    assert_all_gone(launched, [*launched.pids.values(), replacement])


def test_a_slow_disk_is_not_a_hang(model, want, tmp_path):
    # Each read is held 400 ms, longer than a third of the 1 s timeout: the allowance per load owed
    # (and per byte) keeps a worker that owes a queue of slow reads from being called hung.
    launched = launch(tmp_path, model_args(model) + ["--hang-timeout", "1", "--test-io-read-delay-ms", "400"])
    with Client(launched.endpoint, timeout=120) as client:
        done = client.generate(prompt_tokens=list(PROMPT), max_tokens=4).result()
    check_tokens(list(done.tokens), want[: len(done.tokens)])
    assert "is hung" not in launched.stderr()
    assert all(restarts == 0 for _, restarts in _processes(launched.endpoint).values())
    assert launched.signal(signal.SIGTERM) == 0
    assert_all_gone(launched)


def test_a_hung_coordinator_is_killed_by_the_supervisors_probe_and_everything_restarts(model, want, tmp_path):
    launched = launch(tmp_path, model_args(model) + HANG)
    victim = launched.pids["coordinator"]
    os.kill(victim, signal.SIGSTOP)
    assert wait_for(lambda: "system restarted" in launched.stderr(), timeout=60)
    assert f"the coordinator (pid {victim}) answered no health probe" in launched.stderr()
    table = _processes(launched.endpoint)
    assert table["coordinator"][0] != victim and table["coordinator"][1] == 1
    with Client(launched.endpoint, timeout=60) as client:
        check_tokens(list(client.generate(prompt_tokens=list(PROMPT), max_tokens=GENERATED).result().tokens), want)
    seen = [*launched.pids.values(), *(pid for pid, _ in table.values())]
    assert launched.signal(signal.SIGTERM) == 0
    assert_all_gone(launched, seen)
