"""The whole system, as launched by `supervisor.system.start_system`, against mlx-lm.

Real processes: the coordinator, two I/O workers (O_DIRECT unless the model
lives on tmpfs) and the GPU worker, over a slab of a working bank of top_k
slots and one resident slot per sparse layer, so every token misses and
evicts. Test hooks on: fenced slots are scribbled with NaN bytes until they
are leased again, and leased slots are hashed at load and at fence. Greedy
tokens must equal mlx-lm's `generate_step` on the fully loaded model, and
log-probabilities match within 1e-4 relative. Then the launcher's failure
reporting and cleanup, the run configuration, bad input on both endpoints, a
GPU worker that dies mid-job, and another process writing leased slots.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import psutil
import pytest
import zmq

from shared.client import Client, JobFailedError
from shared.config import REPLACEMENT_POLICIES
from shared.demo_model import EOS_TOKEN_ID
from shared.gpu_messages import GpuHello, RouteMatrix, Routes
from shared.job_messages import CLIENT_ACCEPTS, HealthReply, JobFailed, TokenEvent
from shared.protocol import ErrorReply, decode, encode
from shared.slab import Slab
from shared.store import ExpertStore
from supervisor.budget import BudgetError
from supervisor.readiness import LaunchError
from supervisor.system import start_system
from tests.helpers.models import FAMILIES
from tests.helpers.oracle import oracle, relative_difference
from tests.helpers.system import (
    PROCESS_ALLOWANCE,
    PROMPT,
    TEST_KV_RESERVE,
    hook_counts,
    run_job,
    start_test_system,
    tight_budget,
    wait_for,
    with_processes,
)

GENERATED = 32
RTOL = 1e-4
HOOKS = ("scribble_fenced", "verify_fenced")
log = logging.getLogger(__name__)


# This module's system: the tight budget (every token misses and evicts), test hooks on.
_start = functools.partial(start_test_system, budget="tight", test_hooks=HOOKS)


def _check_against(result, want) -> float:
    """Tokens equal the oracle's (up to an EOS stop); returns the largest logprob difference."""
    got = result.tokens
    assert list(result.done.tokens) == got
    if result.done.finish_reason == "stop":  # EOS ends the job and is not emitted
        assert want.tokens[len(got)] == EOS_TOKEN_ID, (got, want.tokens)
    else:
        assert result.done.finish_reason == "length" and len(got) == GENERATED
    assert got == want.tokens[: len(got)]
    return max(relative_difference(w, g) for w, g in zip(want.logprobs, result.logprobs))


# ---------------------------------------------------------------------------------------------
# Token-exact against mlx-lm, every family, full precision and 4-bit


def _telemetry_of_jobs(records) -> list[dict]:
    """Each job's GPU worker telemetry line (its stderr is forwarded)."""
    found = []
    for record in records:
        match = re.search(r"lease telemetry: (\{.*\})", record.getMessage())
        if match:
            found.append(json.loads(match.group(1)))
    return found


def _lanes_of_jobs(records) -> list[tuple[int, list[int]]]:
    """(compute lanes, decode parts per lane) of each job's GPU worker telemetry."""
    return [(telemetry["compute_lanes"], telemetry["lane_parts"]) for telemetry in _telemetry_of_jobs(records)]


# Two compute lanes (what auto picks on a 2-core CPU) everywhere, stated so that a machine with
# one core tests them too; one lane for one family, full precision and 4-bit.
LANES = [
    pytest.param(family, quantized, lanes, id=f"{family}-{'q4' if quantized else 'fp32'}-{lanes}lanes")
    for family, lanes in [*((family, 2) for family in FAMILIES), (FAMILIES[0], 1)]
    for quantized in (False, True)
]


@pytest.mark.parametrize(("family", "quantized", "lanes"), LANES)
def test_generation_equals_mlx_lm(family, quantized, lanes, models, caplog, record_property):
    _tight_run(family, quantized, lanes, "shared", models, caplog, record_property)


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "q4"])
def test_generation_on_the_message_path_equals_mlx_lm(quantized, models, caplog, record_property):
    """`--lease-path messages`: every visit a round trip, and fenced slots scribbled at the fence."""
    _tight_run(FAMILIES[0], quantized, 2, "messages", models, caplog, record_property)


def _tight_run(family, quantized, lanes, lease_path, models, caplog, record_property):
    caplog.set_level(logging.INFO)
    path = models(family, quantized)
    store = ExpertStore.open(path)
    want = oracle(path, PROMPT, GENERATED)
    # Decode waves in parts over the lanes, however small (these models' waves are far below the
    # default decode_parts_min_bytes, under which a wave is copied and computed whole).
    parts_always = dict(decode_parts_min_bytes=0)
    with _start(path, compute_lanes=lanes, lease_path=lease_path, run_config=parts_always) as system:
        plan = system.plan
        assert (plan.working_slots, plan.slots_per_layer, plan.pinned_slots) == (store.top_k, 1, 0)
        assert plan.planned_bytes == tight_budget(store)
        first = run_job(system, max_tokens=GENERATED)
        second = run_job(system, max_tokens=GENERATED)  # from the residency the first job left
        hooks = wait_for(lambda: (counts := hook_counts(caplog.records)) and counts["job"] == 2 and counts)
        job_lanes = wait_for(lambda: len(found := _lanes_of_jobs(caplog.records)) == 2 and found)
    assert [count for count, _ in job_lanes] == [lanes, lanes]
    # Every lane got decode parts (top-k >= 2 experts per decode step are cut into parts).
    assert all(len(parts) == lanes and min(parts) > 0 for _, parts in job_lanes), job_lanes
    differences = [_check_against(result, want) for result in (first, second)]
    assert max(differences) <= RTOL
    stats = first.done.stats
    assert stats.generated_tokens == len(first.tokens) and stats.prompt_tokens == len(PROMPT)
    assert stats.misses > 0 and stats.evictions > 0 and stats.bytes_read > 0
    assert stats.hits + stats.misses >= len(first.tokens) * len(store.sparse_layers) * store.top_k // 2
    assert stats.budget_bytes == tight_budget(store) + PROCESS_ALLOWANCE and stats.wrap_path in ("copy", "zero_copy")
    assert second.done.stats.misses > 0 and second.done.stats.evictions > 0
    assert hooks, "the coordinator never reported its test hooks"
    assert hooks["violations"] == 0 and hooks["scribbled"] > 0 and hooks["verified"] > 0
    # The message path scribbles at each fence and restores at the next lease; the shared path
    # scribbles a slot when it is withdrawn, and a withdrawn slot is only ever reloaded.
    assert (hooks["restored"] > 0) == (lease_path == "messages"), hooks
    figures = dict(
        family=family,
        quantized=quantized,
        lanes=lanes,
        max_rel_logprob_diff=max(differences),
        hits=stats.hits,
        misses=stats.misses,
        evictions=stats.evictions,
        all_resident=stats.all_resident,
        bytes_read=stats.bytes_read,
        finish=first.done.finish_reason,
        hooks=hooks,
    )
    record_property("figures", json.dumps(figures))
    log.info("system figures: %s", json.dumps(figures))


def _all_but_one_resident(path, lanes, caplog, *, run_config=None):
    """Two jobs of PROMPT with all but one expert of each layer resident (LRU), each checked
    against mlx-lm: (first, second, the coordinator's test hooks, the jobs' GPU telemetry)."""
    caplog.set_level(logging.INFO)
    store = ExpertStore.open(path)
    want = oracle(path, PROMPT, GENERATED)
    with _start(
        path,
        budget="all_resident",
        slots_per_layer=store.experts_per_layer - 1,
        compute_lanes=lanes,
        replacement="lru",
        run_config=run_config,
    ) as system:
        first = run_job(system, max_tokens=GENERATED)
        second = run_job(system, max_tokens=GENERATED)
        hooks = wait_for(lambda: (counts := hook_counts(caplog.records)) and counts["job"] == 2 and counts)
        jobs = wait_for(lambda: len(found := _telemetry_of_jobs(caplog.records)) == 2 and found)
    assert max(_check_against(result, want) for result in (first, second)) <= RTOL
    return first, second, hooks, jobs


@pytest.mark.parametrize(("family", "quantized", "lanes"), LANES)
def test_the_shared_lease_path_serves_resident_experts_token_exact(family, quantized, lanes, models, caplog):
    """All but one expert of each layer resident: most decode visits lease through the lease
    words, the rest take messages, evictions withdraw slots (scribbled and verified there).
    LRU admits every miss, so the second job (the same prompt, the same routes) still misses;
    `nextuse` may learn to keep out the one expert that job never uses, and with prefetch paused
    serve it every visit from the lease words, leaving the message path untested."""
    _, second, hooks, jobs = _all_but_one_resident(models(family, quantized), lanes, caplog)
    # Small waves (under decode_parts_min_bytes) are copied and computed whole: no parts.
    assert all(sum(job["lane_parts"]) == 0 for job in jobs), jobs
    # ... and copied ahead from the next layer's prediction while the layer before computed
    # (gpuworker.copy_ahead): visits found experts there, and the tokens are still exact.
    log.info("copy ahead: %s", [{k: job[k] for k in job if "ahead" in k} for job in jobs])
    assert jobs[0]["copy_ahead"] in ("on", "stopped") and jobs[0]["copied_ahead"] > 0, jobs[0]
    assert 0 < jobs[0]["found_ahead"] <= jobs[0]["routed_ahead"], jobs[0]
    stats = second.done.stats
    assert stats.shared_leases > 0.3 and stats.misses > 0, stats  # both paths served the job
    # Decode steps loaded experts on demand: their own load timings are there, apart from the prompt's.
    assert stats.decode_disk_p99_ms >= stats.decode_disk_p50_ms > 0 and stats.decode_wait_p50_ms > 0, stats
    assert stats.shared_leases <= stats.all_resident
    assert hooks and hooks["violations"] == 0 and hooks["verified"] > 0, hooks


@pytest.mark.parametrize("lanes", [1, 2], ids=["1lane", "2lanes"])
def test_split_visits_compute_resident_experts_while_the_misses_load(lanes, models, caplog):
    """All but one expert of each layer resident and decode waves in parts: a visit routed to the
    missing expert sends its `routes` and computes its resident experts' parts before the lease
    comes (gpuworker.split_visit), from copies taken under reader counts; withdrawn slots are
    scribbled and verified, and the tokens stay mlx-lm's."""
    path = models(FAMILIES[0], True)
    store = ExpertStore.open(path)
    _, _, hooks, jobs = _all_but_one_resident(path, lanes, caplog, run_config=dict(decode_parts_min_bytes=0))
    log.info("split visits: %s", [(job["split_visits"], job["split_early_experts"]) for job in jobs])
    assert sum(job["split_visits"] for job in jobs) > 0, jobs
    # Each computed at least one resident expert early, and never all of its experts.
    assert all(
        job["split_visits"] <= job["split_early_experts"] <= job["split_visits"] * (store.top_k - 1) for job in jobs
    ), jobs
    assert hooks and hooks["violations"] == 0 and hooks["verified"] > 0, hooks


# ---------------------------------------------------------------------------------------------
# The launcher: refusals, failures, cleanup


def test_budget_that_cannot_start_names_every_part(models, monkeypatch):
    path = models("qwen3_moe", False)
    store = ExpertStore.open(path)

    def refuse(*args, **kwargs):
        raise AssertionError("nothing may be created before the budget is checked")

    monkeypatch.setattr("supervisor.system.tempfile.mkdtemp", refuse)
    monkeypatch.setattr("supervisor.system.Slab.create", refuse)
    monkeypatch.setattr("supervisor.system.spawn_child", refuse)
    with pytest.raises(BudgetError) as caught:
        start_system(
            model_dir=path,
            memory_budget=tight_budget(store) - 1,
            working_slots=store.top_k,
            kv_reserve_bytes=TEST_KV_RESERVE,
        )
    message = str(caught.value)
    for part in (
        f"dense weights ({store.dense_bytes} bytes)",
        f"KV reserve ({TEST_KV_RESERVE} bytes)",
        f"{store.top_k} working slots",
        "each of 2 sparse layers",
        f"{store.slot_bytes} bytes per slot",
    ):
        assert part in message, message
    assert message.endswith(f": {tight_budget(store)} bytes")
    assert not psutil.Process().children()


@pytest.mark.parametrize("mode", ["dies", "stalls"])
def test_a_gpu_worker_that_dies_or_stalls_fails_the_launch(mode, models, tmp_path):
    path = models("qwen3_moe", False)
    script = {
        "dies": "import sys; print('boom: no accelerator here', file=sys.stderr); sys.exit(3)",
        "stalls": "import sys, time; print('thinking...', file=sys.stderr, flush=True); time.sleep(600)",
    }[mode]
    run_dir = tmp_path / "run"
    started = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        _start(path, gpu_command=[sys.executable, "-c", script], start_timeout=8.0, run_dir=run_dir)
    message = str(caught.value)
    assert "GPU worker (pid" in message, message
    if mode == "dies":
        assert "exited with code 3" in message and "boom: no accelerator here" in message
    else:
        assert "not ready after 8.0 s" in message and "waiting for GPU worker" in message
        assert "thinking..." in message and "is still running" in message
        assert time.monotonic() - started < 30
    # what the launch created is gone; the given run directory itself stays
    assert run_dir.is_dir() and not list(run_dir.iterdir())


@pytest.mark.parametrize("replacement", REPLACEMENT_POLICIES)
def test_every_replacement_policy_is_token_exact(replacement, models, caplog):
    """Two resident slots per layer and two pins, so the policy chooses victims (and, adaptive,
    moves pins); the fence checks stay on: a victim is never a slot the GPU worker still reads."""
    caplog.set_level(logging.INFO)
    path = models(FAMILIES[0], False)
    store = ExpertStore.open(path)
    want = oracle(path, PROMPT, GENERATED)
    budget = tight_budget(store) + (2 + len(store.sparse_layers)) * store.slot_bytes
    with _start(path, pinned=2, **with_processes(store, budget, pinned=2), replacement=replacement) as system:
        assert (system.plan.slots_per_layer, system.plan.pinned_slots) == (2, 2)
        assert system.config.replacement == replacement
        results = [run_job(system, max_tokens=GENERATED) for _ in range(2)]
        assert wait_for(lambda: (counts := hook_counts(caplog.records)) and counts["job"] == 2)
    assert any(f"replacement {replacement})" in record.getMessage() for record in caplog.records)
    assert max(_check_against(result, want) for result in results) <= RTOL


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs CPU affinity, 2+ CPUs"
)
def test_helpers_on_the_last_cpu_leave_the_gpu_worker_every_cpu_and_stay_token_exact(models, caplog):
    """`last-cpu`: every thread of the coordinator and the I/O workers, the ones started after the
    launch too (ZeroMQ's, the readers, the footprint's), on the last allowed CPU; the GPU worker's
    untouched; a job with misses (the tight budget) still equals mlx-lm."""
    caplog.set_level(logging.INFO)
    path = models(FAMILIES[0], False)
    store = ExpertStore.open(path)
    want = oracle(path, PROMPT, GENERATED)
    allowed = sorted(os.sched_getaffinity(0))
    with _start(
        path, run_config={"helper_scheduling": "last-cpu"}, **with_processes(store, tight_budget(store))
    ) as system:
        result = run_job(system, max_tokens=GENERATED)
        cpus = {
            role: {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir(f"/proc/{pid}/task")}
            for role, pid in system.pids.items()
        }
        assert wait_for(lambda: (counts := hook_counts(caplog.records)) and counts["job"] == 1)
    helpers = {role: cpu_sets for role, cpu_sets in cpus.items() if role != "GPU worker"}
    assert helpers and all(cpu_sets == {(allowed[-1],)} for cpu_sets in helpers.values()), cpus
    assert cpus["GPU worker"] == {tuple(allowed)}
    assert _check_against(result, want) <= RTOL
    assert any(f"every thread on CPU {allowed[-1]} of {allowed}" in r.getMessage() for r in caplog.records)


def test_stop_removes_everything_and_the_config_is_complete(models, tmp_path):
    path = models("mixtral", False)
    store = ExpertStore.open(path)
    usage = tmp_path / "usage.coli"
    # two pinned experts (preloaded at startup) on top of the tight budget; a usage ledger
    with _start(
        path,
        test_hooks=(),
        pinned=2,
        usage_file=usage,
        io_workers=2,
        run_config={"helper_scheduling": "batch"},
        **with_processes(store, tight_budget(store) + 2 * store.slot_bytes, pinned=2),
    ) as system:
        run_dir, slab = system.run_dir, system.slab_name
        assert (os.stat(run_dir).st_mode & 0o777) == 0o700
        config = json.loads(Path(run_dir, "config.json").read_text())
        assert config["slab"]["name"] == slab and config["endpoints"]["jobs"] == system.endpoint
        assert config["endpoints"]["io"] == f"ipc://{run_dir}/io" and config["test_hooks"] == []
        assert config["plan"]["total_slots"] == system.plan.total_slots and config["model_dir"] == str(path)
        assert config["pinned"] == [[0, 0], [1, 0]] and config["usage_file"] == str(usage)
        assert json.loads(Path(config["manifest"]).read_text()) == list(store.manifest)
        assert os.path.exists(f"/dev/shm{slab}")
        children = list(system.children)
        assert set(system.pids) == {"coordinator", "I/O worker 0", "I/O worker 1", "GPU worker"}
        assert config["helper_scheduling"] == "batch"  # the helpers', never the GPU worker's (shared/scheduling.py)
        policies = {
            role: {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")}
            for role, pid in system.pids.items()
        }
        batch = {os.SCHED_BATCH}
        assert policies == {
            "coordinator": batch,
            "I/O worker 0": batch,
            "I/O worker 1": batch,
            "GPU worker": {os.SCHED_OTHER},
        }
        health = system.health()
        assert health.ready and health.io_workers == 2 and health.gpu_worker
        result = run_job(system, max_tokens=4, return_logprobs=False)
        assert len(result.tokens) <= 4 and result.events[0].logprobs is None
    assert not os.path.exists(run_dir) and not os.path.exists(f"/dev/shm{slab}")
    assert [child.process.returncode for child in children] == [0, 0, 0, 0]  # a clean SIGTERM shutdown
    # the ledger was flushed at shutdown: every routed selection of the job was counted
    rows = [line.split() for line in usage.read_text().splitlines() if line.strip()]
    assert rows and sum(int(count) for _, _, count in rows) >= len(PROMPT) * store.top_k * len(store.sparse_layers)


def test_children_exit_when_the_launcher_goes_away(models):
    """Closing the death pipes (what the kernel does when the launcher dies) stops every child."""
    path = models("qwen3_moe", True)
    with _start(path, test_hooks=()) as system:
        for child in system.children:
            child.close_death_pipe()
        exited = wait_for(lambda: all(c.exit_code is not None for c in system.children), timeout=20)
        assert exited, [c.describe() for c in system.children if c.exit_code is None]
        assert [c.exit_code for c in system.children] == [0] * (2 + system.io_workers)
        assert any("parent process is gone" in line for line in system.children[0].stderr_tail())


def test_config_round_trip_and_refusals(tmp_path):
    from shared.config import ConfigError, read_config, run_endpoints, write_config
    from shared.plan import plan_expert_residency
    from tests.helpers.run_config import small_run_config

    plan = plan_expert_residency(
        budget_bytes=10**7, fixed_bytes=0, slot_bytes=16384, sparse_layers=2, working_slots=2, pinned_experts=1
    )
    config = small_run_config(tmp_path, plan=plan, io_workers=2, pinned=((1, 3),), test_hooks=("verify_fenced",))
    write_config(config, tmp_path / "config.json")
    assert (os.stat(tmp_path / "config.json").st_mode & 0o777) == 0o600
    assert read_config(tmp_path / "config.json") == config
    no_grace = dataclasses.replace(config, io_replacement_grace_s=0.0)  # lost loads fail at once: allowed
    write_config(no_grace, tmp_path / "no-grace.json")
    assert read_config(tmp_path / "no-grace.json") == no_grace
    data = json.loads((tmp_path / "config.json").read_text())
    for change, needle in (
        (lambda d: d["plan"].update(total_slots=1), "does not match the plan"),
        (lambda d: d.update(io_mode="fast"), "io_mode"),
        (lambda d: d.update(test_hooks=["break_things"]), "unknown test hook"),
        (lambda d: d.update(pinned=[]), "pinned must hold 1"),
        (lambda d: d["slab"].update(slot_bytes=-1), "config.slab.slot_bytes"),
        (lambda d: d.update(surprise=1), "unknown field(s) ['surprise']"),
        (lambda d: d.update(usage_flush_s=0), "usage_flush_s must be a positive number, got 0.0"),
        (lambda d: d.update(io_replacement_grace_s=-1), "config.io_replacement_grace_s must be a non-negative"),
        (lambda d: d.update(start_timeout_s=float("nan")), "config.start_timeout_s must be a non-negative number"),
        (lambda d: d.update(compute_lanes=17), "compute_lanes must be in [1, 16]"),
        (
            lambda d: d.update(helper_scheduling="idle"),
            "helper_scheduling must be one of ('auto', 'batch', 'last-cpu', 'normal'), got 'idle'",
        ),
        (lambda d: d.pop("plan"), "missing field 'plan'"),  # last: the coordinator is run on it below
    ):
        broken = json.loads(json.dumps(data))
        change(broken)
        (tmp_path / "bad.json").write_text(json.dumps(broken))
        with pytest.raises(ConfigError, match=re.escape(needle)):
            read_config(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="too long for ipc socket paths"):
        run_endpoints("/" + "x" * 120)
    # the process refuses a bad configuration with one clear line and exit code 1
    done = subprocess.run(
        [sys.executable, "-m", "coordinator", "--config", str(tmp_path / "bad.json")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "missing field 'plan'" in done.stderr


# ---------------------------------------------------------------------------------------------
# Bad input on both endpoints, and a GPU worker lost mid-job


def _dealer(context, endpoint):
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def _reply(sock, registry, timeout=10.0):
    assert sock.poll(timeout * 1000), "no reply"
    return decode(sock.recv(), registry)


def test_bad_input_gets_errors_and_the_system_keeps_serving(models):
    path = models("qwen3_moe", False)
    with _start(path) as system:
        context = zmq.Context()
        jobs = _dealer(context, system.endpoint)
        gpu = _dealer(context, system.config.endpoints.gpu)
        try:
            jobs.send(b"\xc1 not msgpack")  # dropped: nothing to answer
            jobs.send(msgpack.packb([1, 2, 3]))
            assert isinstance(reply := _reply(jobs, CLIENT_ACCEPTS), JobFailed) and reply.code == "bad_message"
            jobs.send(msgpack.packb({"op": "launch_missiles", "id": "a"}))
            assert (reply := _reply(jobs, CLIENT_ACCEPTS)).code == "unknown_op" and reply.id == "a"
            jobs.send(msgpack.packb({"op": "generate", "id": "b", "prompt_tokens": [1], "max_tokens": "many"}))
            assert (reply := _reply(jobs, CLIENT_ACCEPTS)).code == "bad_field" and reply.id == "b"
            jobs.send(msgpack.packb({"op": "generate", "id": "c"}))
            reply = _reply(jobs, CLIENT_ACCEPTS)
            assert reply.code == "bad_request" and reply.id == "c" and "exactly one of" in reply.message
            jobs.send(msgpack.packb({"op": "health", "id": "d"}))
            assert isinstance(reply := _reply(jobs, CLIENT_ACCEPTS), HealthReply) and reply.ready
            # the GPU endpoint: garbage, a lease request before hello, a hello while the worker lives
            gpu.send(b"\xc1")
            assert isinstance(_reply(gpu, {"error": ErrorReply}), ErrorReply)
            gpu.send(encode(Routes(layer=0, routes=RouteMatrix([[0, 1]]))))
            assert "before gpu_hello" in _reply(gpu, {"error": ErrorReply}).message
            gpu.send(encode(GpuHello(pid=os.getpid())))
            assert "is connected and alive" in _reply(gpu, {"error": ErrorReply}).message
        finally:
            jobs.close()
            gpu.close()
            context.term()
        result = run_job(system, max_tokens=8)
        assert result.done.finish_reason in ("length", "stop")
        with Client(system.endpoint, timeout=30) as client:
            # two jobs at once: the second waits in the FIFO, both are served, identically
            streams = [client.generate(prompt_tokens=list(PROMPT), max_tokens=8) for _ in range(2)]
            done = [stream.result() for stream in streams]
            assert done[0].tokens == done[1].tokens == tuple(result.tokens)
            stats = client.stats()
            assert stats.jobs_done == 3 and stats.running is None and stats.queued == 0


def _signal_gpu_worker_mid_job(system, client: Client, signum: int):
    """Start a long job, signal the GPU worker after its first token; the job's error."""
    stream = client.generate(prompt_tokens=list(PROMPT), max_tokens=100_000)
    assert isinstance(next(stream), TokenEvent)
    os.kill(system.pids["GPU worker"], signum)
    with pytest.raises(JobFailedError) as caught:
        for _ in stream:
            pass
    return caught


def test_a_lost_gpu_worker_fails_its_job_and_leaves_no_lease(models, caplog):
    caplog.set_level(logging.INFO)
    path = models("qwen3_moe", False)
    with _start(path) as system:
        with Client(system.endpoint, timeout=30) as client:
            caught = _signal_gpu_worker_mid_job(system, client, signal.SIGKILL)
            assert caught.value.code == "worker_failed" and "GPU worker was lost" in str(caught.value)
            health = client.health()
            assert not health.ready and not health.gpu_worker and health.io_workers == system.io_workers
        assert wait_for(lambda: any("GPU worker lost" in r.getMessage() for r in caplog.records))
        # The coordinator may see the loss (its socket) before the launcher reaps the child: wait for both.
        assert wait_for(lambda: [d for d in system.dead_children() if "GPU worker" in d and "signal 9" in d])


def test_a_gpu_worker_stopped_by_signal_says_goodbye_and_is_not_reported_lost(models, caplog):
    caplog.set_level(logging.INFO)
    path = models("qwen3_moe", False)
    with _start(path) as system:
        with Client(system.endpoint, timeout=30) as client:
            caught = _signal_gpu_worker_mid_job(system, client, signal.SIGTERM)  # the launcher's stop does this first
            assert caught.value.code == "worker_stopping"
        assert wait_for(lambda: any("after its goodbye" in r.getMessage() for r in caplog.records))
        assert not [r for r in caplog.records if "GPU worker lost" in r.getMessage()]


def test_a_write_into_a_leased_slot_fails_the_job(models):
    """verify_fenced in the real system: another process writing the slab is caught at the fence."""
    path = models("qwen3_moe", False)
    with _start(path) as system:
        slab = Slab.attach(system.slab_name, total_slots=system.plan.total_slots, slot_bytes=system.plan.slot_bytes)
        stop = threading.Event()

        def vandal():
            view = np.frombuffer(slab.buffer, dtype=np.uint8)
            try:
                while not stop.is_set():
                    view[::4096] += 1  # one byte of every page of every slot
                    time.sleep(0.0005)
            finally:
                del view

        writer = threading.Thread(target=vandal, daemon=True)
        writer.start()
        try:
            with pytest.raises(JobFailedError) as caught:
                run_job(system, max_tokens=GENERATED, timeout=60)
        finally:
            stop.set()
            writer.join()
            slab.close()
        assert caught.value.code == "test_hook_violation", caught.value
        assert "changed while it was leased" in str(caught.value)
        assert system.health().ready  # the system itself keeps serving
