"""gpuworker.generate in process, on a fully loaded tiny mlx-lm model: mlx-lm's generation, our wrapping."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_model, load_tokenizer

from gpuworker.generate import (
    CANCELLED,
    LENGTH,
    PROMPT_TOO_LONG,
    STOP,
    JobRefused,
    context_length,
    encode_prompt,
    generate,
    job_done,
    prompt_ids,
    run_job,
    vocab_size,
)
from shared.demo_model import EOS_TOKEN_ID, VOCAB_SIZE
from shared.gpu_messages import COORDINATOR_ACCEPTS_FROM_GPU, Job, JobDone, Token
from shared.protocol import decode, encode
from tests.helpers.models import write_tiny_model
from tests.helpers.oracle import generate_steps

PROMPT = list(b"Once upon a time, in a land far away,")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("gen") / "model", family="qwen3_moe")
    model, config = load_model(path)
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer, config


def test_greedy_is_generate_step_and_after_forward_runs_per_model_call(loaded):
    model, tokenizer, _ = loaded
    tokenizer.eos_token_ids = {EOS_TOKEN_ID}
    want = generate_steps(model, PROMPT, 8, prefill_step_size=16).tokens
    calls, seen = [], []
    result = generate(
        model,
        tokenizer,
        PROMPT,
        max_tokens=8,
        prefill_step_size=16,
        after_forward=lambda: calls.append(1),
        on_token=seen.append,
    )
    expected = want[: want.index(EOS_TOKEN_ID)] if EOS_TOKEN_ID in want else want
    assert list(result.tokens) == expected and [s.token for s in seen] == expected
    assert [s.index for s in seen] == list(range(len(expected)))
    # prefill chunks of 16 for all but the last prompt token, then one call per step; mlx-lm
    # computes the step after the last token it yields too.
    prefill = math.ceil((len(PROMPT) - 1) / 16)
    yielded = len(expected) + (0 if len(expected) == 8 else 1)  # an EOS is yielded, not emitted
    assert len(calls) == prefill + 1 + yielded
    assert result.finish_reason == (LENGTH if len(expected) == 8 else STOP)
    assert result.prompt_tokens == len(PROMPT) and result.prefill_ms > 0 and result.decode_ms >= 0
    # The streamed pieces are the text, which is the tokenizer's decoding of the tokens.
    assert "".join(s.text for s in seen) == result.text == tokenizer.decode(list(result.tokens))
    assert all(s.logprobs is None for s in seen)


def test_eos_stops_and_is_not_emitted(loaded):
    model, tokenizer, _ = loaded
    want = generate_steps(model, PROMPT, 6).tokens
    stop_at = next(i for i in range(1, 6) if want[i] not in want[:i])
    tokenizer.eos_token_ids = {want[stop_at]}
    try:
        result = generate(model, tokenizer, PROMPT, max_tokens=6)
    finally:
        tokenizer.eos_token_ids = {EOS_TOKEN_ID}
    assert list(result.tokens) == want[:stop_at] and result.finish_reason == STOP


def test_should_stop_cancels_between_tokens(loaded):
    model, tokenizer, _ = loaded
    asked = []
    result = generate(model, tokenizer, PROMPT, max_tokens=20, should_stop=lambda: asked.append(1) or len(asked) >= 2)
    assert result.finish_reason == CANCELLED and len(result.tokens) == 2 and len(asked) == 2


def test_sampling_is_mlx_lm_with_the_seed(loaded):
    model, tokenizer, _ = loaded
    tokenizer.eos_token_ids = set()  # compare whole runs
    try:
        first = generate(model, tokenizer, PROMPT, max_tokens=8, temperature=1.5, top_p=0.9, seed=7)
        again = generate(model, tokenizer, PROMPT, max_tokens=8, temperature=1.5, top_p=0.9, seed=7)
        other = generate(model, tokenizer, PROMPT, max_tokens=8, temperature=1.5, top_p=0.9, seed=8)
    finally:
        tokenizer.eos_token_ids = {EOS_TOKEN_ID}
    mx.random.seed(7)
    want = generate_steps(model, PROMPT, 8, sampler=make_sampler(1.5, top_p=0.9)).tokens
    assert list(first.tokens) == list(again.tokens) == want
    assert list(other.tokens) != want


def test_logprobs_are_the_steps_log_softmax(loaded):
    model, tokenizer, config = loaded
    sent: list[Token] = []
    job = Job(job_id=3, prompt_tokens=tuple(PROMPT), max_tokens=3, return_logprobs=True)
    result = run_job(job, model=model, tokenizer=tokenizer, config=config, send=sent.append)
    want = [np.array(lp) for lp in generate_steps(model, PROMPT, 3).logprobs]
    assert len(sent) == len(result.tokens)
    for token, lp in zip(sent, want):
        got = np.frombuffer(token.logprobs, dtype="<f4")
        assert got.shape == (VOCAB_SIZE,) and np.array_equal(got, lp.astype(np.float32))
        assert abs(float(np.exp(got).sum()) - 1) < 1e-4
    # Both messages survive the wire.
    done = job_done(job, result, bytes_copied=5)
    for message in (*sent, done):
        assert decode(encode(message), COORDINATOR_ACCEPTS_FROM_GPU) == message
    assert isinstance(done, JobDone) and done.tokens == result.tokens and done.bytes_copied == 5


def test_prompts_raw_text_or_ids_and_their_limits(loaded):
    _, tokenizer, config = loaded
    assert context_length(config) == 131072 and vocab_size(config) == VOCAB_SIZE
    assert context_length({"text_config": {"max_position_embeddings": 7}}) == 7
    assert context_length({}) is None
    # Raw text: bytes, no chat template (which would add <|im_start|> tokens).
    assert encode_prompt(tokenizer, "hi there") == list(b"hi there")
    limits = {"context": 10, "vocab": VOCAB_SIZE}
    assert prompt_ids(tokenizer, prompt="abc", prompt_tokens=None, **limits) == list(b"abc")
    assert prompt_ids(tokenizer, prompt="abc", prompt_tokens=(1, 2), **limits) == [1, 2]  # ids win
    for kwargs, code in (
        ({"prompt": None, "prompt_tokens": None}, "bad_request"),
        ({"prompt": "", "prompt_tokens": None}, "bad_request"),
        ({"prompt": None, "prompt_tokens": (VOCAB_SIZE,)}, "bad_request"),
        ({"prompt": None, "prompt_tokens": (1,) * 11}, PROMPT_TOO_LONG),
    ):
        with pytest.raises(JobRefused) as refused:
            prompt_ids(tokenizer, **kwargs, **limits)
        assert refused.value.code == code
    with pytest.raises(JobRefused, match=r"11 tokens.*context is 10"):
        prompt_ids(tokenizer, prompt=None, prompt_tokens=(1,) * 11, **limits)


def test_bad_sampling_options_are_refused(loaded):
    model, tokenizer, _ = loaded
    for options in ({"temperature": -0.5}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(JobRefused):
            generate(model, tokenizer, PROMPT, max_tokens=2, **options)
