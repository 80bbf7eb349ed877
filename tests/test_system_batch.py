"""Jobs decoded together (`--max-sequences`): the real processes, several clients at once.

Every row's greedy tokens must equal mlx-lm's single-sequence generation and mlx-lm's own
batched generation (`BatchGenerator`) of the same prompts; rows join and leave at step
boundaries without disturbing the others; the fence checks (scribble/verify) stay on.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from shared.client import Client, JobFailedError
from shared.demo_model import EOS_TOKEN_ID
from shared.job_messages import CANCELLED, TokenEvent
from tests.helpers.oracle import oracle
from tests.helpers.system import start_test_system, wait_for

HOOKS = ("scribble_fenced", "verify_fenced")
TOKENS = 20
# Different lengths: the batch's prefill pads them, its decode masks the padding.
PROMPTS = (
    tuple(b"The quick brown fox"),
    tuple(b"jumps"),
    tuple(b"over the lazy dog, again and again and again."),
    tuple(b"Q"),
    tuple(b"Mixture of experts"),
    tuple(b"streams from disk"),
)


def mlx_lm_batched(model_dir, prompts, max_tokens: int) -> list[list[int]]:
    """mlx-lm's own batched greedy generation of `prompts` (EOS stops a row and is not kept)."""
    model, _ = load_model(model_dir)
    generator = BatchGenerator(model, max_tokens=max_tokens, stop_tokens=[[EOS_TOKEN_ID]])
    uids = generator.insert([list(p) for p in prompts], caches=[make_prompt_cache(model) for _ in prompts])
    out: dict[int, list[int]] = {uid: [] for uid in uids}
    open_rows = set(uids)
    while open_rows:
        for response in generator.next_generated():
            if response.token != EOS_TOKEN_ID:
                out[response.uid].append(response.token)
            if response.finish_reason is not None:
                open_rows.discard(response.uid)
    generator.close()
    mx.clear_cache()
    return [out[uid] for uid in uids]


def run_together(endpoint: str, prompts, max_tokens: int) -> list:
    """Each prompt from its own client thread, all sent at once; their `done`s in prompt order."""
    results: list = [None] * len(prompts)

    def run(index: int) -> None:
        with Client(endpoint, timeout=120) as client:
            results[index] = client.generate(prompt_tokens=list(prompts[index]), max_tokens=max_tokens).result()

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert all(result is not None for result in results)
    return results


_start = functools.partial(start_test_system, test_hooks=HOOKS)


@pytest.mark.parametrize(
    ("family", "quantized", "budget"),
    [("qwen3_moe", False, "tight"), ("gpt_oss", True, "tight"), ("mixtral", False, "all_resident")],
    ids=["qwen3_moe-fp32-tight", "gpt_oss-q4-tight", "mixtral-fp32-resident"],
)
def test_jobs_decoded_together_equal_mlx_lm(family, quantized, budget, models, caplog):
    caplog.set_level(logging.INFO)
    path = models(family, quantized)
    single = [list(oracle(path, prompt, TOKENS).tokens) for prompt in PROMPTS]
    batched = mlx_lm_batched(path, PROMPTS, TOKENS)
    with _start(path, budget=budget, run_config={"max_sequences": 4}) as system:
        results = run_together(system.endpoint, PROMPTS, TOKENS)
        with Client(system.endpoint) as client:
            cumulative = client.stats()
    for prompt, result, want, want_batched in zip(PROMPTS, results, single, batched):
        got = list(result.tokens)
        assert got == want_batched, (prompt, got, want_batched)
        if result.finish_reason == "stop":
            assert want[len(got)] == EOS_TOKEN_ID
        else:
            assert result.finish_reason == "length" and len(got) == TOKENS
        assert got == want[: len(got)], (prompt, got, want)
        assert result.stats.prompt_tokens == len(prompt)
    # Six jobs over four rows: some ran beside others, and the two queued ones joined mid-decode.
    assert max(result.stats.active_sequences for result in results) >= 2
    assert cumulative.jobs_done == len(PROMPTS) and cumulative.stats.active_sequences == 0
    assert sum(result.stats.hits + result.stats.misses for result in results) == (
        cumulative.stats.hits + cumulative.stats.misses
    )  # overlapping jobs split their windows: the run's totals still add up
    found = (re.search(r"lease telemetry: (\{.*\})", record.getMessage()) for record in caplog.records)
    telemetry = [json.loads(match.group(1)) for match in found if match]
    assert len(telemetry) == len(PROMPTS)  # one line per job, as bench_generate reads them


def test_rows_join_and_leave_without_disturbing_the_others(models, caplog):
    """The first job decodes alone (generate_step) and hands over to the batch mid-decode when the
    second arrives; a third joins; one is cancelled; the others' tokens stay mlx-lm's."""
    caplog.set_level(logging.INFO)
    path = models("qwen3_moe", False)
    long_prompt, joiner, cancelled = PROMPTS[0], PROMPTS[2], PROMPTS[4]
    want_long = list(oracle(path, long_prompt, 40).tokens)
    want_joiner = list(oracle(path, joiner, TOKENS).tokens)
    with (
        _start(path, budget="tight", run_config={"max_sequences": 3}) as system,
        Client(system.endpoint, timeout=120) as client,
    ):
        first = client.generate(prompt_tokens=list(long_prompt), max_tokens=40, id="long")
        assert isinstance(next(first), TokenEvent)
        doomed = client.generate(prompt_tokens=list(cancelled), max_tokens=10_000, id="doomed")
        assert isinstance(next(doomed), TokenEvent)  # it decodes beside the first
        second = client.generate(prompt_tokens=list(joiner), max_tokens=TOKENS, id="joiner")
        assert isinstance(next(second), TokenEvent)
        assert wait_for(lambda: client.stats().stats.active_sequences == 3, timeout=30)
        client.cancel("doomed")
        with pytest.raises(JobFailedError) as failure:
            doomed.result()
        assert failure.value.code == CANCELLED
        long_done, joiner_done = first.result(), second.result()
        assert client.stats().stats.active_sequences == 0
    assert list(long_done.tokens) == want_long[: len(long_done.tokens)]
    assert list(joiner_done.tokens) == want_joiner[: len(joiner_done.tokens)]
    assert long_done.stats.active_sequences == 3 and joiner_done.stats.active_sequences == 3
    pattern = r"joins the batch \(\d+ rows\) after (\d+) tokens alone"
    joined = (re.search(pattern, record.getMessage()) for record in caplog.records)
    assert any(match and int(match.group(1)) > 0 for match in joined)  # the long job handed over mid-decode


def test_one_sequence_runs_the_jobs_one_after_another(models):
    path = models("qwen3_moe", False)
    with _start(path, budget="tight", run_config={"max_sequences": 1}) as system:
        results = run_together(system.endpoint, PROMPTS[:3], 6)
    assert [result.stats.active_sequences for result in results] == [1, 1, 1]
    for prompt, result in zip(PROMPTS[:3], results):
        assert list(result.tokens) == list(oracle(path, prompt, 6).tokens)[: len(result.tokens)]
