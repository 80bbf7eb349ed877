"""Next-layer prefetch through the whole system: token-exact against mlx-lm with the fence checks on.

Every family, a budget with a few slots per layer (so predictions have
somewhere to go and evict), prefetch forced on: the GPU worker predicts with
the family's own router, the coordinator reads the predictions while layers
compute, demand waits for reads in flight; the tokens stay mlx-lm's and the
scribble/verify hooks see no slot touched under a lease. The job's stats say
what prefetch did.
"""

from __future__ import annotations

import logging

import pytest

from shared.store import ExpertStore
from tests.helpers.models import FAMILIES, write_tiny_model
from tests.helpers.oracle import oracle
from tests.helpers.system import (
    PROMPT,
    TEST_KV_RESERVE,
    hook_counts,
    run_job,
    start_test_system,
    wait_for,
    with_processes,
)

GENERATED = 24
HOOKS = ("scribble_fenced", "verify_fenced")


def _budget(store: ExpertStore) -> int:
    """A working bank of top-k and a quarter of each layer's experts (at least 2) resident."""
    per_layer = max(2, store.experts_per_layer // 4)
    slots = store.top_k + len(store.sparse_layers) * per_layer
    return store.dense_bytes + TEST_KV_RESERVE + slots * store.slot_bytes


@pytest.mark.parametrize("family", FAMILIES)
def test_prefetch_on_is_token_exact_and_accounted(family, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    path = write_tiny_model(tmp_path / family, family=family)
    store = ExpertStore.open(path)
    want = oracle(path, PROMPT, GENERATED)
    with start_test_system(path, **with_processes(store, _budget(store)), prefetch="on", test_hooks=HOOKS) as system:
        first = run_job(system, max_tokens=GENERATED, return_logprobs=False)
        second = run_job(system, max_tokens=GENERATED, return_logprobs=False)
        hooks = wait_for(lambda: (counts := hook_counts(caplog.records)) and counts["job"] == 2 and counts)
    for result in (first, second):
        assert result.tokens == want.tokens[: len(result.tokens)] and len(result.tokens) == GENERATED
    assert hooks["violations"] == 0 and hooks["verified"] > 0
    for stats in (first.done.stats, second.done.stats):
        # Every decode step predicts every sparse layer but the first: top-k plus a margin each.
        decode_steps = GENERATED - 1
        assert stats.prefetch_predicted >= decode_steps * (len(store.sparse_layers) - 1) * store.top_k
        assert stats.prefetch_issued > 0 and stats.prefetch_bytes > 0
        assert stats.prefetch_useful + stats.prefetch_wasted <= stats.prefetch_issued
        assert 0.0 <= stats.prefetch_precision <= 1.0 and 0.0 <= stats.prefetch_recall <= 1.0
        assert stats.prefetch_disabled_layers == 0  # on: never stops


def test_prefetch_two_layers_ahead_is_token_exact_and_reads_what_it_predicts(tmp_path, caplog):
    """`prefetch_distance` 2: the GPU worker predicts the first two sparse layers from the token and
    every other from the layer two before it; the tokens stay mlx-lm's, no slot is touched under a
    lease, and the predictions are read and used."""
    caplog.set_level(logging.INFO)
    path = write_tiny_model(tmp_path / "m", family=FAMILIES[0], num_hidden_layers=4)
    store = ExpertStore.open(path)
    want = oracle(path, PROMPT, GENERATED)
    options = dict(prefetch="on", test_hooks=HOOKS, run_config={"prefetch_distance": 2})
    with start_test_system(path, **with_processes(store, _budget(store)), **options) as system:
        result = run_job(system, max_tokens=GENERATED, return_logprobs=False)
        hooks = wait_for(lambda: (counts := hook_counts(caplog.records)) and counts["job"] == 1 and counts)
    assert result.tokens == want.tokens[: len(result.tokens)] and len(result.tokens) == GENERATED
    assert hooks["violations"] == 0 and hooks["verified"] > 0
    assert any("of the sparse layer 2 ahead" in record.getMessage() for record in caplog.records)
    stats = result.done.stats
    # Every decode step predicts every sparse layer: the first two from the token, the rest two layers on.
    assert stats.prefetch_predicted >= (GENERATED - 1) * len(store.sparse_layers) * store.top_k
    assert stats.prefetch_issued > 0 and stats.prefetch_useful > 0 and 0.0 < stats.prefetch_recall <= 1.0


def test_prefetch_off_predicts_and_reads_nothing(tmp_path):
    path = write_tiny_model(tmp_path / "m", family=FAMILIES[0])
    store = ExpertStore.open(path)
    want = oracle(path, PROMPT, GENERATED)
    with start_test_system(path, **with_processes(store, _budget(store)), prefetch="off") as system:
        result = run_job(system, max_tokens=GENERATED, return_logprobs=False)
    assert result.tokens == want.tokens[: len(result.tokens)]
    stats = result.done.stats
    assert (stats.prefetch_predicted, stats.prefetch_issued, stats.prefetch_bytes) == (0, 0, 0)


def test_auto_predicts_nothing_when_every_expert_is_resident(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    path = write_tiny_model(tmp_path / "m", family=FAMILIES[0])
    want = oracle(path, PROMPT, GENERATED)
    with start_test_system(path, budget="all_resident") as system:  # prefetch: auto, the default
        result = run_job(system, max_tokens=GENERATED, return_logprobs=False)
    assert result.tokens == want.tokens[: len(result.tokens)]
    assert result.done.stats.prefetch_predicted == 0 and not result.done.stats.prefetch_trialling
    assert "prefetch off: every expert of every layer fits its layer's slots" in caplog.text


def test_auto_times_its_decode_steps_without_prefetch_in_alternate_epochs(tmp_path):
    """auto's trial (coordinator/prefetch_trial.py), after a warm-up epoch of 8 decode steps, runs
    the first epoch with prefetch and the next without: the job's stats count those steps, no
    verdict has been reached yet (the stats say it is still on trial), the tokens stay mlx-lm's."""
    from coordinator.prefetch_trial import EPOCH_STEPS

    path = write_tiny_model(tmp_path / "m", family=FAMILIES[0])
    store = ExpertStore.open(path)
    tokens = 3 * EPOCH_STEPS + 4  # one-token forwards: warm-up and an epoch on, one off, a few on
    want = oracle(path, PROMPT, tokens)
    with start_test_system(path, **with_processes(store, _budget(store))) as system:  # prefetch: auto, the default
        result = run_job(system, max_tokens=tokens, return_logprobs=False)
    assert result.tokens == want.tokens[:tokens] and len(result.tokens) == tokens
    stats = result.done.stats
    assert stats.prefetch_steps_without == EPOCH_STEPS and not stats.prefetch_paused and stats.prefetch_trialling
    assert stats.prefetch_predicted > 0
