"""The short soak: `scripts/soak.py` against the real system on a tiny model whose experts stream.

50 jobs from 4 clients with cancels, disconnects and malformed frames, one I/O worker killed
(when job 10 starts), the GPU worker killed (when job 25 starts) and then stopped with SIGSTOP
(when job 40 starts; the launcher's `--hang-timeout 3` keeps the wait short): job-count
triggers, not timers, so the faults happen whatever the machine's speed. No job may be lost, no
greedy job's tokens may differ from mlx-lm's, and the stopped run must leave nothing behind.
"""

from __future__ import annotations

import json
import subprocess
import sys

from instruments.soak_load import LoadOptions, check_tokens, disconnect_outcomes, plan_job
from shared.job_messages import Done
from shared.store import ExpertStore
from tests.helpers.supervisor import REPO, supervisor_env, tiny_model
from tests.helpers.system import TEST_KV_RESERVE, io_mode_for

JOBS = 50
WARMUP_AND_SOAK_TIMEOUT_S = 240


def _soak(tmp_path, model, *flags: str) -> tuple[int, dict]:
    # The soak's default budget (the plan's slots plus room for the processes); after `--`, launcher
    # flags that win over the soak's defaults: one resident slot per layer, so experts stream.
    launcher = ["--slots-per-layer", "1", "--kv-reserve", str(TEST_KV_RESERVE), "--io-mode", io_mode_for(model)]
    launcher += ["--hang-timeout", "3"]
    command = [sys.executable, str(REPO / "scripts" / "soak.py"), "--model", str(model), "--json"]
    command += ["--log", str(tmp_path / "supervisor.log"), *flags, "--", *launcher]
    result = subprocess.run(
        command,
        cwd=REPO,
        env=supervisor_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=WARMUP_AND_SOAK_TIMEOUT_S,
    )
    assert result.stdout.strip(), result.stderr[-4000:]
    return result.returncode, json.loads(result.stdout.strip().splitlines()[-1])


def test_a_short_soak_loses_no_job_computes_no_wrong_token_and_leaks_nothing(tmp_path_factory, tmp_path):
    model = tiny_model(tmp_path_factory)
    code, report = _soak(
        tmp_path,
        model,
        *("--jobs", str(JOBS), "--clients", "4", "--cancel-rate", "0.15", "--disconnect-rate", "0.15"),
        *("--malformed-every", "7", "--kill-io-at-job", "10", "--kill-gpu-at-job", "25", "--seed", "3"),
        *("--hang-at-job", "40", "--hang-role", "gpu"),
    )
    summary = {k: v for k, v in report.items() if k not in ("rss_start", "rss_end")}
    assert code == 0, summary
    assert report["lost"] == 0 and report["wrong"] == 0 and report["wrong_partial"] == 0, summary
    assert report["warmup_wrong"] == 0 and report["leaks"] == 0, summary
    assert report["done"] > 0 and report["greedy_checked"] > 0, summary
    assert report["plan"]["slots_per_layer"] == 1 < ExpertStore.open(model).experts_per_layer  # experts stream
    # every job has exactly one outcome; a killed GPU worker fails its job clearly
    outcomes = report["done"] + report["cancelled"] + report["disconnected"] + sum(report["failed"].values())
    assert outcomes == report["jobs"] == JOBS, summary
    assert set(report["failed"]) <= {"worker_failed", "worker_hung"}, summary
    # the faults happened and the system replaced what was killed
    assert report["faults"]["injected"]["kill_io"] == 1 and report["faults"]["injected"]["kill_gpu"] == 1, summary
    # the stopped GPU worker was found hung, killed and replaced (a second restart)
    assert report["faults"]["injected"]["hang"] == 1 and report["faults"]["hang_not_detected"] == 0, summary
    assert [hang["role"] for hang in report["faults"]["hangs"] if hang["detected"]] == ["gpu_worker"], summary
    assert report["restarts"]["gpu_worker"] >= 2, summary
    assert sum(n for role, n in report["restarts"].items() if role.startswith("io_worker_")) >= 1, summary
    # bad frames were answered as expected; vanished clients' jobs were all ended by the coordinator
    assert report["malformed"]["sent"] == JOBS // 7 == report["malformed"]["answered"], summary
    assert report["disconnected"] > 0 and report["disconnects"]["unaccounted"] == 0, summary
    # the coordinator's own count agrees: the warm-up's and ours, plus jobs done after their client left
    finished_unread = report["disconnects"]["finished"]
    assert report["coordinator"]["jobs_done"] == report["warmup_jobs"] + report["done"] + finished_unread, summary
    assert report["supervisor_exit"] == 0, summary


# ---------------------------------------------------------------------------------------------
# The soak's judgement, without processes


def test_a_done_job_must_equal_the_reference_up_to_its_length_or_stop_before_eos():
    want = [5, 6, 7]  # the reference, cut before EOS: the model stops after three tokens
    assert check_tokens([5, 6], Done(id="a", tokens=(5, 6), finish_reason="length"), want, 2)
    assert check_tokens([5, 6, 7], Done(id="a", tokens=(5, 6, 7), finish_reason="stop"), want, 8)
    assert check_tokens([5], None, want, 8)  # a cancelled job's prefix
    assert not check_tokens([5, 9], None, want, 8)
    assert not check_tokens([5, 6], Done(id="a", tokens=(5, 6), finish_reason="stop"), want, 8)  # stopped early
    assert not check_tokens([5, 6, 7], Done(id="a", tokens=(5, 6, 7), finish_reason="length"), want, 8)
    assert not check_tokens([5, 6], Done(id="a", tokens=(5, 7), finish_reason="length"), want, 2)  # done != streamed


def test_each_vanished_clients_job_is_accounted_for_from_the_coordinators_log():
    log = "\n".join(
        [
            "coordinator.jobs: job 3 ('c-1') ended after its client disconnected: 4 tokens delivered",
            "coordinator.jobs: dropped 2 queued job(s) of a disconnected client: ['c-2', 'c-3']",
            "coordinator.jobs: job 9 ('c-4') done: 7 tokens, JobStats()",
            "coordinator.jobs: job 11 ('c-6') failed: worker_failed: the GPU worker was lost: exited",
            "coordinator.jobs: job 12 ('c-7') failed: cancelled: job 'c-7' was cancelled after 2 tokens",
        ]
    )
    outcome = disconnect_outcomes(log, {"c-1": 3, "c-2": 0, "c-4": 5, "c-5": 1, "c-6": 2, "c-7": 2})
    assert outcome == {
        "stopped_running": 1,
        "dropped_queued": 1,
        "finished": 1,
        "failed": 1,
        "unaccounted": 2,
        "max_tokens_relayed_after_close": 1,
    }


def test_a_jobs_choices_depend_on_the_seed_and_its_index_only():
    options = LoadOptions(jobs=100, clients=4, max_tokens=24, cancel_rate=0.3, disconnect_rate=0.3, seed=5)
    plans = [plan_job(options, index, 4) for index in range(100)]
    assert plans == [plan_job(options, index, 4) for index in range(100)]
    assert {plan.action for plan in plans} == {"", "cancel", "disconnect"}
    assert all(12 <= plan.max_tokens <= 24 and 1 <= plan.after < plan.max_tokens for plan in plans)
