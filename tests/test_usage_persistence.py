"""The usage ledger across runs: auto pins from history, live repin, and when the ledger reaches disk.

Run 1 starts without history (auto pins: none) and leaves its routing counts
in the usage file; run 2, on the same model, budget and prompt, plans its pins
from that file (`supervisor.budget.auto_pins`, what `--pinned-experts auto` does,
with Colibri's thresholds scaled down to a tiny model), the coordinator
preloads them before the first job, and it hits more. Greedy decoding and a serial residency
policy make both hit rates deterministic, so the difference is the pins', not
noise. Then: cold pins are swapped for hot experts between jobs, and the
ledger is flushed periodically while a job runs and at shutdown.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import signal
from pathlib import Path

import pytest

import supervisor.budget as budget
from shared.client import Client, JobFailedError
from shared.job_messages import TokenEvent
from shared.pins import plan_expert_auto_pins
from shared.store import ExpertStore
from shared.usage_profile import default_usage_file, model_fingerprint
from tests.helpers.models import write_tiny_model
from tests.helpers.system import PROMPT, TEST_KV_RESERVE, run_job, start_test_system, wait_for, with_processes

log = logging.getLogger(__name__)

WORKING, PER_LAYER = 2, 8  # 4 sparse layers x 16 experts: half of them fit
AUTO = dict(min_history_selections=100, full_confidence_selections=100, min_pin_budget_bytes=0)  # small model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("persist"), family="qwen3_moe", num_hidden_layers=4, num_experts=16)


def _budget(store: ExpertStore) -> int:
    return store.dense_bytes + TEST_KV_RESERVE + (WORKING + len(store.sparse_layers) * PER_LAYER) * store.slot_bytes


def _auto(store: ExpertStore, usage) -> tuple[tuple[int, int], ...]:
    """The launcher's `auto` pins, with thresholds for a model of a few thousand selections."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(budget, "plan_expert_auto_pins", functools.partial(plan_expert_auto_pins, **AUTO))
        return budget.auto_pins(
            store,
            memory_budget=_budget(store),
            kv_reserve_bytes=TEST_KV_RESERVE,
            working_slots=WORKING,
            usage_file=str(usage),
        )


def _run(model, usage, *, pinned=(), run_config=None, **options):
    store = ExpertStore.open(model)
    return start_test_system(
        model,
        **with_processes(store, _budget(store), working_slots=WORKING, pinned=len(pinned)),
        working_slots=WORKING,
        pinned=pinned,
        usage_file=usage,
        run_config=run_config,
        **options,
    )


def _counts(path) -> dict[tuple[int, int], int]:
    rows = [line.split() for line in Path(path).read_text().splitlines() if line.strip()]
    return {(int(layer), int(expert)): int(count) for layer, expert, count in rows}


@pytest.fixture(scope="module")
def history(model, tmp_path_factory):
    """Run 1: no history yet, so auto plans no pins; one job; its counts reach the usage file."""
    store = ExpertStore.open(model)
    usage = tmp_path_factory.mktemp("usage") / "usage"
    pins = _auto(store, usage)
    assert pins == ()
    with _run(model, usage, pinned=pins) as system:
        assert system.plan.pinned_slots == 0 and system.plan.slots_per_layer == PER_LAYER
        first = run_job(system, max_tokens=32, return_logprobs=False).done
    return dict(store=store, usage=usage, done=first, counts=_counts(usage))


def test_a_second_run_with_auto_pins_hits_more_than_the_first(model, history, record_property, caplog):
    caplog.set_level(logging.INFO)
    store, usage, first = history["store"], history["usage"], history["done"].stats
    selections = sum(history["counts"].values())
    assert selections >= (len(PROMPT) + 32) * store.top_k * len(store.sparse_layers) // 2
    pins = _auto(store, usage)
    assert len(pins) == len(store.sparse_layers) * PER_LAYER // 2  # half the resident tier (pin_share 0.5)
    ranked = sorted(history["counts"].items(), key=lambda item: (-item[1], item[0]))
    assert set(pins) == {pair for pair, _ in ranked[: len(pins)]}  # the most routed experts
    with _run(model, usage, pinned=pins) as system:
        assert system.plan.pinned_slots == len(pins)  # carved out of the same budget
        assert system.plan.planned_bytes <= _budget(store)
        second = run_job(system, max_tokens=32, return_logprobs=False).done.stats
    preloads = [r.getMessage() for r in caplog.records if "preloaded" in r.getMessage()]
    assert any(f"preloaded {len(pins)} pinned experts: {len(pins)} loads" in m for m in preloads), preloads
    figures = dict(
        run1_hit_rate=first.hit_rate,
        run2_hit_rate=second.hit_rate,
        run1_misses=first.misses,
        run2_misses=second.misses,
        pins=len(pins),
        history_selections=selections,
    )
    record_property("figures", figures)
    log.info("usage persistence figures: %s", figures)
    assert second.hits + second.misses == first.hits + first.misses  # the same prompt, the same routing
    assert second.hit_rate >= first.hit_rate + 0.04 and second.misses < 0.75 * first.misses, figures


def test_live_repin_swaps_cold_pins_for_hot_experts_between_jobs(model, history, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    store, counts = history["store"], history["counts"]
    usage = tmp_path / "usage"
    shutil.copy(history["usage"], usage)
    everything = [(layer, expert) for layer in store.sparse_layers for expert in range(store.experts_per_layer)]
    cold = sorted(everything, key=lambda pair: (counts.get(pair, 0), pair))[: len(store.sparse_layers)]
    # The LFRU live repin moves fixed pins (the seed's `lru`); adaptive pins (`lrfu`) move themselves.
    with _run(model, usage, pinned=cold, replacement="lru") as system:
        first = run_job(system, max_tokens=32, return_logprobs=False).done.stats
        second = run_job(system, max_tokens=32, return_logprobs=False).done.stats
        with Client(system.endpoint, timeout=30) as client:
            total = client.stats().stats
    # the first job heated the experts it routed to; the pass after it swapped at most 4 pins
    assert first.repin_swaps == 0 and 0 < second.repin_swaps <= 4, (first.repin_swaps, second.repin_swaps)
    assert total.repin_swaps >= second.repin_swaps
    swaps = [re.search(r"live repin: layer (\d+) pin (\d+) -> (\d+)", r.getMessage()) for r in caplog.records]
    swaps = [tuple(int(g) for g in match.groups()) for match in swaps if match]
    assert swaps and all((layer, old) in cold and (layer, new) not in cold for layer, old, new in swaps)


def test_the_ledger_is_flushed_periodically_while_a_job_runs(model, tmp_path):
    usage = tmp_path / "usage"
    with (
        _run(model, usage, run_config=dict(usage_flush_s=0.2)) as system,
        Client(system.endpoint, timeout=60) as client,
    ):
        stream = client.generate(prompt_tokens=list(PROMPT), max_tokens=100_000)
        seen = []

        def changed() -> bool:
            if usage.exists():
                total = sum(_counts(usage).values())
                if not seen or total > seen[-1]:
                    seen.append(total)
            return len(seen) >= 3

        assert wait_for(changed, timeout=20, interval=0.05), seen  # three growing versions, mid-job
        assert isinstance(next(stream), TokenEvent)  # still running: no job end flushed those
        client.cancel(stream.id)
        with pytest.raises(JobFailedError):
            stream.result()


def test_the_ledger_is_flushed_at_shutdown(model, tmp_path):
    usage = tmp_path / "usage"
    with _run(model, usage, run_config=dict(usage_flush_s=3600.0)) as system:
        run_job(system, max_tokens=4, return_logprobs=False)
        assert wait_for(usage.exists)  # flushed right after the job's answer
        after_job = sum(_counts(usage).values())
        with Client(system.endpoint, timeout=60) as client:
            stream = client.generate(prompt_tokens=list(PROMPT), max_tokens=100_000)
            for _ in range(20):
                assert isinstance(next(stream), TokenEvent)
            assert sum(_counts(usage).values()) == after_job  # no periodic flush within the hour
            coordinator = next(child for child in system.children if child.name == "coordinator")
            os.kill(coordinator.pid, signal.SIGTERM)  # only the coordinator: its job never ends normally
            assert wait_for(lambda: coordinator.exit_code is not None, timeout=20)
            with pytest.raises(JobFailedError) as caught:
                stream.result()
            assert caught.value.code == "shutting_down"
        assert coordinator.exit_code == 0
        per_token = system.store.top_k * len(system.store.sparse_layers)  # selections of one decode step
        assert sum(_counts(usage).values()) >= after_job + 20 * per_token


def test_the_default_usage_file_is_per_checkpoint_and_created_on_first_flush(model, tmp_path):
    store = ExpertStore.open(model)
    path = default_usage_file(store, cache_home=tmp_path)
    assert path == os.path.join(str(tmp_path), "moeslab", model_fingerprint(store), "usage")
    with _run(model, path) as system:
        run_job(system, max_tokens=2, return_logprobs=False)
    assert os.path.getsize(path) > 0 and (os.stat(os.path.dirname(path)).st_mode & 0o777) == 0o700
    assert model_fingerprint(ExpertStore.open(shutil.copytree(model, tmp_path / "moved"))) == model_fingerprint(store)
    other = write_tiny_model(tmp_path / "other", family="qwen3_moe", num_hidden_layers=4, num_experts=16, seed=1)
    assert model_fingerprint(ExpertStore.open(other)) != model_fingerprint(store)  # same shapes, other weights
