"""Children that die: the backend's re-submission, and the supervisor's restarts.

In process: an I/O worker killed with loads in flight has them re-submitted
to a live worker at once (same slot and generation; the bytes land), or,
with none left, parked until a restarted worker with the same index says
hello (or failed when none comes within the grace period). Through the real
supervisor (`scripts/launch.py`): SIGKILL of an I/O worker mid-job (the job
completes token-exact), of the GPU worker mid-job (a clear error, then the
next job succeeds), of the coordinator mid-run (the usage ledger is a whole
file, every child restarts, jobs run again), and a child that keeps dying
(the supervisor gives up, exit 1, nothing left).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from coordinator.io_pool import IOWorkerPool
from coordinator.io_results import ExpertLoadError
from coordinator.io_sessions import TURN_LOADS
from coordinator.usage import ExpertUsageLedger
from shared.children import spawn_child, stop_children
from shared.client import Client, JobFailedError
from shared.commands import IO_WORKER_MODULE, IOWorkerArgs, child_command, io_worker_argv
from shared.job_messages import TokenEvent
from shared.segments import ExpertIOSegment
from shared.slab import Slab
from shared.store import ExpertStore
from tests.helpers.supervisor import (
    GENERATED,
    assert_all_gone,
    check_tokens,
    launch,
    model_args,
    oracle_tokens,
    run_tokens,
    tiny_model,
)
from tests.helpers.system import PROMPT, wait_for

SLOT = 16384


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def want(model):
    return oracle_tokens(model)


def _file(tmp_path):
    data = np.random.default_rng(7).integers(0, 256, size=4 * SLOT, dtype=np.uint8)
    path = tmp_path / "experts.bin"
    path.write_bytes(data.tobytes())
    return path, data


def _slot(slab: Slab, slot: int, length: int) -> np.ndarray:
    view = slab.slot_view(slot)
    try:
        return np.frombuffer(view, dtype=np.uint8)[:length].copy()
    finally:
        view.release()


def test_a_lost_workers_loads_are_resubmitted_to_a_live_one(tmp_path):
    path, data = _file(tmp_path)

    async def scenario() -> None:
        with Slab.create(total_slots=2, slot_bytes=SLOT) as slab:
            async with IOWorkerPool(
                slab=slab, manifest=[path], workers=2, io_mode="buffered", test_read_delay_ms=1000
            ) as pool:
                backend = pool.backend
                backend.submit_segments(0, 1, (ExpertIOSegment(0, 0, SLOT, 0),))
                await asyncio.sleep(0.05)  # a turn's loads go to one worker; the next turn's to the other
                backend.submit_segments(1, 1, (ExpertIOSegment(0, SLOT, SLOT, 0),))
                await asyncio.sleep(0.2)
                pool.processes[0].process.kill()
                await asyncio.wait_for(asyncio.gather(backend.wait(0, 1), backend.wait(1, 1)), 20)
                telemetry = backend.telemetry()
                assert (telemetry.workers_lost, telemetry.resubmitted, telemetry.failed) == (1, 1, 0)
                assert (_slot(slab, 0, SLOT) == data[:SLOT]).all() and (
                    _slot(slab, 1, SLOT) == data[SLOT : 2 * SLOT]
                ).all()
                assert backend.worker_modes() == {1: ("buffered",)}  # the lost one no longer counts

    asyncio.run(scenario())


def test_a_worker_dead_before_the_watchdog_looks_is_skipped_not_fatal(tmp_path, caplog):
    """A submit can reach a worker that died since the watchdog's last look: host unreachable."""
    path, data = _file(tmp_path)
    caplog.set_level(logging.WARNING, logger="coordinator.backend")

    async def scenario() -> None:
        slots = TURN_LOADS + 1  # more than one worker takes in a turn: both get some
        with Slab.create(total_slots=slots, slot_bytes=SLOT) as slab:
            async with IOWorkerPool(slab=slab, manifest=[path], workers=2, io_mode="buffered") as pool:
                backend = pool.backend
                pool.processes[0].process.kill()
                pool.processes[0].process.wait()  # blocking: neither watchdog runs meanwhile
                time.sleep(0.2)  # but ZeroMQ's I/O thread sees the connection close
                for slot in range(slots):  # one turn: sent when this task next waits
                    backend.submit_segments(slot, 1, (ExpertIOSegment(0, slot % 4 * SLOT, SLOT, 0),))
                waits = (backend.wait(slot, 1) for slot in range(slots))
                await asyncio.wait_for(asyncio.gather(*waits), 20)
                assert backend.telemetry().failed == 0 and backend.telemetry().workers_lost == 1
                for slot in range(slots):
                    assert (_slot(slab, slot, SLOT) == data[slot % 4 * SLOT : (slot % 4 + 1) * SLOT]).all()

    asyncio.run(scenario())
    assert "I/O worker 0" in caplog.text and "unreachable" in caplog.text


@pytest.mark.parametrize("replaced", [True, False], ids=["replaced", "none_comes_back"])
def test_with_no_live_worker_loads_wait_for_a_restarted_one(replaced, tmp_path):
    path, data = _file(tmp_path)

    async def scenario() -> None:
        with Slab.create(total_slots=2, slot_bytes=SLOT) as slab:
            async with IOWorkerPool(
                slab=slab,
                manifest=[path],
                workers=1,
                io_mode="buffered",
                test_read_delay_ms=500,
                replacement_grace_s=20 if replaced else 1,
            ) as pool:
                backend = pool.backend
                backend.submit_segments(0, 1, (ExpertIOSegment(0, 0, SLOT, 0),))
                await asyncio.sleep(0.1)
                pool.processes[0].process.kill()
                assert await asyncio.to_thread(wait_for, lambda: backend.telemetry().workers_lost == 1)
                backend.submit_segments(1, 1, (ExpertIOSegment(0, SLOT, SLOT, 0),))  # parked, not refused
                if not replaced:
                    with pytest.raises(ExpertLoadError, match="none came back within 1 s") as caught:
                        await asyncio.wait_for(backend.wait(0, 1), 10)
                    assert caught.value.code == "worker_lost"
                    return
                config = IOWorkerArgs(
                    index=0,
                    endpoint=backend.endpoint,
                    manifest=os.path.join(pool.run_dir, "manifest.json"),
                    slab_name=slab.name,
                    total_slots=2,
                    slot_bytes=SLOT,
                    io_mode="buffered",
                )
                replacement = spawn_child("I/O worker 0", child_command(IO_WORKER_MODULE, io_worker_argv(config)))
                try:
                    await asyncio.wait_for(asyncio.gather(backend.wait(0, 1), backend.wait(1, 1)), 20)
                    # slot 0 was re-submitted; slot 1, parked at submit, was only sent late
                    assert backend.telemetry().resubmitted == 1 and backend.worker_modes() == {0: ("buffered",)}
                    assert (_slot(slab, 1, SLOT) == data[SLOT : 2 * SLOT]).all()
                finally:
                    backend.shutdown_workers()
                    await asyncio.to_thread(stop_children, [replacement], timeout=5.0)

    asyncio.run(scenario())


# ---------------------------------------------------------------------------------------------
# Through the supervisor


def _lost_with(stderr: str, pid: int) -> int | None:
    found = re.search(rf"I/O worker 0 \(pid {pid}\) lost with (\d+) loads in flight", stderr)
    return None if found is None else int(found.group(1))


@pytest.mark.parametrize("workers", [1, 2], ids=["alone", "beside_another"])
def test_an_io_worker_killed_mid_job_is_restarted_and_the_job_completes_unchanged(workers, model, want, tmp_path):
    """Beside another worker its loads go there at once; alone (auto's choice on 2 cores) they wait
    for its restarted self."""
    args = ["--test-io-read-delay-ms", "60", "--io-workers", str(workers)]
    launched = launch(tmp_path, model_args(model) + args)
    seen = [*launched.pids.values()]
    in_flight = []
    for attempt in range(3):  # until the kill lands while worker 0 has a load (almost always the first)
        victim = launched.child_pid("--index 0 ")
        with Client(launched.endpoint, timeout=60) as client:
            tokens = []
            for event in client.generate(prompt_tokens=list(PROMPT), max_tokens=GENERATED):
                if isinstance(event, TokenEvent):
                    tokens.append(event.token)
                    if len(tokens) == 2:
                        os.kill(victim, signal.SIGKILL)
                else:
                    assert list(event.tokens) == tokens
        check_tokens(tokens, want)
        assert wait_for(lambda n=attempt + 1: launched.stderr().count("I/O worker 0 is ready again") == n, timeout=30)
        in_flight.append(_lost_with(launched.stderr(), victim))
        seen.append(launched.child_pid("--index 0 "))
        if in_flight[-1]:
            break
    stderr = launched.stderr()
    assert in_flight[-1], f"no kill landed while I/O worker 0 had loads in flight: {in_flight}"
    went = "waiting for a restarted worker" if workers == 1 else "to I/O worker 1"
    assert re.search(rf"re-submitted the in-flight loads of lost I/O worker 0: \d+ {went}", stderr), stderr[-4000:]
    assert seen[-1] != victim
    with Client(launched.endpoint, timeout=30) as client:
        assert client.health().io_workers == workers
    assert launched.signal(signal.SIGTERM) == 0
    assert_all_gone(launched, seen)


def test_a_gpu_worker_killed_mid_job_fails_it_clearly_and_the_next_job_succeeds(model, want, tmp_path):
    launched = launch(tmp_path, model_args(model))
    with Client(launched.endpoint, timeout=60) as client:
        stream = client.generate(prompt_tokens=list(PROMPT), max_tokens=100_000)
        assert isinstance(next(stream), TokenEvent)
        os.kill(launched.pids["gpu_worker"], signal.SIGKILL)
        with pytest.raises(JobFailedError) as caught:
            for _ in stream:
                pass
        assert caught.value.code == "worker_failed" and "GPU worker was lost" in str(caught.value)
        # queued until the restarted GPU worker is ready
        done = client.generate(prompt_tokens=list(PROMPT), max_tokens=GENERATED).result()
    check_tokens(list(done.tokens), want)
    replacement = launched.child_pid("-m gpuworker")
    assert replacement != launched.pids["gpu_worker"]
    assert "restarting GPU worker" in launched.stderr()
    # health and stats tell who serves now: the replacement's pid, restarted once; the others as launched
    with Client(launched.endpoint, timeout=30) as client:
        health, stats = client.health(), client.stats()
    table = {p.name: (p.pid, p.restarts) for p in health.processes}
    assert table == {name: (pid, 0) for name, pid in launched.pids.items()} | {"gpu_worker": (replacement, 1)}
    assert stats.processes == health.processes
    shown = subprocess.run(
        [sys.executable, "scripts/send.py", "--endpoint", launched.endpoint, "--health"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert f"gpu_worker     pid {replacement:<8} restarts 1" in shown.stdout
    assert launched.signal(signal.SIGTERM) == 0
    assert_all_gone(launched, [*launched.pids.values(), replacement])


def _ledger(path, store: ExpertStore) -> tuple[int, list[str]]:
    warnings: list[str] = []
    ledger = ExpertUsageLedger.open(
        path, layers=store.sparse_layers, experts_per_layer=store.experts_per_layer, on_warning=warnings.append
    )
    return ledger.snapshot().total_count, warnings


def test_a_coordinator_killed_mid_run_leaves_a_whole_ledger_and_everything_restarts(model, want, tmp_path):
    store = ExpertStore.open(model)
    usage = tmp_path / "usage"
    old = ExpertUsageLedger.open(usage, layers=store.sparse_layers, experts_per_layer=store.experts_per_layer)
    old.record_routes(store.sparse_layers[0], [[0, 1]])
    old.flush()
    launched = launch(tmp_path, model_args(model) + ["--usage-file", str(usage)])
    with Client(launched.endpoint, timeout=60) as client:
        stream = client.generate(prompt_tokens=list(PROMPT), max_tokens=100_000)
        for _ in range(3):
            assert isinstance(next(stream), TokenEvent)
        os.kill(launched.pids["coordinator"], signal.SIGKILL)
        stream.close()
    total, warnings = _ledger(usage, store)  # the old file or a new one, never a torn one
    assert not warnings and total >= 2
    assert wait_for(lambda: "system restarted" in launched.stderr(), timeout=60), launched.stderr()[-3000:]
    check_tokens(run_tokens(launched.endpoint), want)
    coordinator = launched.child_pid("-m coordinator")
    workers = [f"--index {name.rpartition('_')[2]} " for name in launched.pids if name.startswith("io_worker_")]
    others = [launched.child_pid(needle) for needle in (*workers, "-m gpuworker")]
    assert coordinator != launched.pids["coordinator"] and not set(others) & set(launched.pids.values())
    assert launched.signal(signal.SIGTERM) == 0
    assert_all_gone(launched, [*launched.pids.values(), coordinator, *others])
    after, warnings = _ledger(usage, store)  # flushed at shutdown: the restarted run's job is counted
    assert not warnings and after >= total + len(PROMPT) * store.top_k * len(store.sparse_layers)


def test_a_child_that_keeps_dying_stops_the_whole_system(model, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(model, copy)
    launched = launch(tmp_path, model_args(copy) + ["--max-restarts", "2", "--restart-window", "60"])
    # Every restarted I/O worker now fails at setup: a crash loop.
    for weights in copy.glob("*.safetensors"):
        weights.rename(tmp_path / weights.name)
    os.kill(launched.pids["io_worker_0"], signal.SIGKILL)
    assert launched.wait(timeout=90) == 1
    stderr = launched.stderr()
    assert "I/O worker 0 died 3 times within 60 s (at most 2 restarts allowed); stopping the system" in stderr, stderr
    assert stderr.count("restarting I/O worker 0") == 2 and "setup failed" in stderr
    assert not launched.children()
    assert_all_gone(launched)
