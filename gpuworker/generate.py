"""Generation with mlx-lm's own machinery: `generate_step`, `make_sampler`, `make_prompt_cache`.

A prompt is raw text (tokenized with the model's tokenizer as
`mlx_lm.generate.stream_generate` does it: BOS added unless the text starts
with it; the chat template is NOT applied) or token ids. Tokens stream out
with mlx-lm's streaming detokenizer; like `stream_generate`, EOS stops the
generation and is not emitted, and the last token of a `max_tokens` run
carries the detokenizer's final flush. A stop by EOS or cancel leaves that
flush (a held space or an incomplete UTF-8 sequence) in `Generation.text`
only: the emitted pieces are always a prefix of it.

Forward passes are synchronous here (a streamed switch evaluates its routes
and leases its experts inside the call), so `after_forward` runs after each
model call of `generate_step` (every prefill chunk and every step) - where
the lease client fences what it still holds. One consequence of mlx-lm's
pipelining: `generate_step` computes step n+1 before it yields token n, so
each token is reported one forward pass after it was sampled, and a job runs
one forward pass more than it emits (mlx-lm does the same work in memory).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from shared.commands import DEFAULT_PREFILL_STEP
from shared.gpu_messages import Job, JobDone, Token
from shared.job_messages import CONTEXT_EXCEEDED, ChatMessage

__all__ = [
    "CANCELLED",
    "LENGTH",
    "PROMPT_TOO_LONG",
    "STOP",
    "ForwardHook",
    "GeneratedToken",
    "Generation",
    "JobRefused",
    "chat_prompt_ids",
    "check_limits",
    "check_sampling",
    "context_length",
    "encode_prompt",
    "generate",
    "job_done",
    "job_prompt",
    "prompt_ids",
    "run_job",
    "vocab_size",
]

logger = logging.getLogger(__name__)

LENGTH, STOP, CANCELLED = "length", "stop", "cancelled"
PROMPT_TOO_LONG = "prompt_too_long"
BAD_REQUEST = "bad_request"


class JobRefused(ValueError):
    """A job this worker will not run; `code` goes into the `job_error`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class GeneratedToken:
    index: int
    token: int
    text: str  # the detokenizer's new text for this token
    elapsed_ms: float  # since the previous token (the first: since generation began)
    logprobs: np.ndarray | None  # float32 [vocab], when asked for


@dataclass(frozen=True, slots=True)
class Generation:
    tokens: tuple[int, ...]
    text: str
    prompt_tokens: int
    prefill_ms: float  # time to the first token
    decode_ms: float  # the tokens after the first
    finish_reason: str  # LENGTH | STOP | CANCELLED


def _config_value(config: Mapping[str, Any], key: str) -> Any:
    value = config.get(key)
    if value is None and isinstance(config.get("text_config"), Mapping):
        value = config["text_config"].get(key)
    return value


def context_length(config: Mapping[str, Any]) -> int | None:
    """The model's context (`max_position_embeddings`), if the config says."""
    value = _config_value(config, "max_position_embeddings")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def vocab_size(config: Mapping[str, Any]) -> int | None:
    value = _config_value(config, "vocab_size")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Raw text -> ids, as mlx-lm's `stream_generate` does (no chat template)."""
    bos = tokenizer.bos_token
    return list(tokenizer.encode(text, add_special_tokens=bos is None or not text.startswith(bos)))


def chat_prompt_ids(tokenizer, messages: Sequence[ChatMessage]) -> list[int]:
    """Chat messages -> ids with the tokenizer's own chat template, as `mlx_lm.server` renders them.

    A tokenizer without a template gets mlx_lm.server's fallback (`convert_chat`: role prefixes).
    """
    turns = [{"role": message.role, "content": message.content} for message in messages]
    if not tokenizer.has_chat_template:
        from mlx_lm.server import convert_chat  # the server module is large: only for template-less tokenizers

        return list(tokenizer.encode(convert_chat(turns)))
    try:
        return list(tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True))
    except Exception as error:  # a template may refuse a conversation (e.g. roles out of order)
        raise JobRefused(BAD_REQUEST, f"the chat template refused the messages: {error}") from error


def prompt_ids(
    tokenizer,
    *,
    prompt: str | None,
    prompt_tokens: Sequence[int] | None,
    context: int | None,
    vocab: int | None,
    messages: Sequence[ChatMessage] | None = None,
) -> list[int]:
    """The job's prompt as token ids (`prompt_tokens` wins, then `messages`), checked; JobRefused otherwise."""
    if prompt_tokens is not None:
        ids = [int(token) for token in prompt_tokens]
        if vocab is not None and ids and max(ids) >= vocab:
            raise JobRefused(BAD_REQUEST, f"prompt token {max(ids)} is outside the vocabulary of {vocab}")
    elif messages is not None:
        ids = chat_prompt_ids(tokenizer, messages)
    elif prompt is not None:
        ids = encode_prompt(tokenizer, prompt)
    else:
        raise JobRefused(BAD_REQUEST, "the job has neither prompt nor prompt_tokens")
    if not ids:
        raise JobRefused(BAD_REQUEST, "the prompt is empty")
    if context is not None and len(ids) > context:
        raise JobRefused(
            PROMPT_TOO_LONG,
            f"the prompt has {len(ids)} tokens; the model's context is {context} (max_position_embeddings)",
        )
    return ids


def check_limits(job: Job, prompt: int, context: int | None) -> None:
    """The front door's limits on a prompt only this worker can count (coordinator/job_limits.py)."""
    if job.max_prompt_tokens is not None and prompt > job.max_prompt_tokens:
        raise JobRefused(
            PROMPT_TOO_LONG,
            f"the prompt has {prompt} tokens; the limit is {job.max_prompt_tokens} (--max-prompt-tokens)",
        )
    if job.fit_context and context is not None and prompt + job.max_tokens > context:
        raise JobRefused(
            CONTEXT_EXCEEDED,
            f"the prompt's {prompt} tokens plus max_tokens {job.max_tokens} make {prompt + job.max_tokens}; "
            f"the model's context is {context} (max_position_embeddings)",
        )


def check_sampling(temperature: float, top_p: float) -> None:
    """JobRefused for sampling options mlx-lm's sampler cannot take."""
    if not temperature >= 0:
        raise JobRefused(BAD_REQUEST, f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise JobRefused(BAD_REQUEST, f"top_p must be in (0, 1], got {top_p}")


class ForwardHook:
    """The model as `generate_step` calls it, with `after` run once each call returned."""

    def __init__(self, model, after: Callable[[], None]) -> None:
        self.model, self.after = model, after

    def __call__(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        self.after()
        return out


def generate(
    model,
    tokenizer,
    prompt: Sequence[int],
    *,
    max_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    return_logprobs: bool = False,
    prefill_step_size: int = DEFAULT_PREFILL_STEP,
    after_forward: Callable[[], None] | None = None,
    on_token: Callable[[GeneratedToken], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Generation:
    """Generate up to `max_tokens` tokens after `prompt` (ids); greedy when temperature is 0.

    `on_token` sees every token as it is produced; `should_stop` is asked
    between tokens (True: finish as "cancelled"; raising aborts).
    """
    check_sampling(temperature, top_p)
    if seed is not None:
        mx.random.seed(seed)
    sampler = make_sampler(temperature, top_p=top_p)  # temp 0: argmax (generate_step's default)
    cache = make_prompt_cache(model)  # the model itself: the wrapper below only forwards calls
    forward = ForwardHook(model, after_forward) if after_forward is not None else model
    eos = set(tokenizer.eos_token_ids)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    tokens: list[int] = []
    finish = LENGTH
    started = previous = time.perf_counter()
    prefill_ms = decode_ms = 0.0
    steps = generate_step(
        mx.array(list(prompt)),
        forward,
        max_tokens=max_tokens,
        sampler=sampler,
        prompt_cache=cache,
        prefill_step_size=prefill_step_size,
    )
    try:
        for token, logprobs in steps:
            now = time.perf_counter()
            elapsed, previous = (now - previous) * 1e3, now
            if tokens:
                decode_ms += elapsed
            else:
                prefill_ms = elapsed
            if token in eos:
                finish = STOP
                break
            detokenizer.add_token(token)
            tokens.append(token)
            if len(tokens) == max_tokens:
                detokenizer.finalize()
            values = np.array(logprobs.astype(mx.float32)) if return_logprobs else None
            if on_token is not None:
                on_token(GeneratedToken(len(tokens) - 1, token, detokenizer.last_segment, elapsed, values))
            if len(tokens) == max_tokens:
                break
            if should_stop is not None and should_stop():
                finish = CANCELLED
                break
    finally:
        steps.close()  # no step runs after this; its arrays are dropped with the generator
    if finish != LENGTH:
        detokenizer.finalize()
    logger.debug("generated %d tokens (%s) in %.1f ms", len(tokens), finish, (time.perf_counter() - started) * 1e3)
    return Generation(tuple(tokens), detokenizer.text, len(prompt), prefill_ms, decode_ms, finish)


def job_prompt(job: Job, tokenizer, config: Mapping[str, Any]) -> list[int]:
    """The job's prompt as ids, within the model's vocabulary, context and the front door's limits."""
    context = context_length(config)
    ids = prompt_ids(
        tokenizer,
        prompt=job.prompt,
        prompt_tokens=job.prompt_tokens,
        messages=job.messages,
        context=context,
        vocab=vocab_size(config),
    )
    check_limits(job, len(ids), context)
    return ids


def run_job(
    job: Job,
    *,
    model,
    tokenizer,
    config: Mapping[str, Any],
    send: Callable[[Token], None],
    should_stop: Callable[[], bool] | None = None,
    after_forward: Callable[[], None] | None = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP,
) -> Generation:
    """Run one `job`, sending a `Token` per token; JobRefused for a prompt it cannot take."""
    ids = job_prompt(job, tokenizer, config)

    def emit(step: GeneratedToken) -> None:
        raw = None if step.logprobs is None else step.logprobs.astype("<f4").tobytes()
        send(
            Token(
                job_id=job.job_id,
                index=step.index,
                token=step.token,
                text=step.text,
                elapsed_ms=step.elapsed_ms,
                logprobs=raw,
                prompt_tokens=len(ids),
            )
        )

    return generate(
        model,
        tokenizer,
        ids,
        max_tokens=job.max_tokens,
        temperature=job.temperature,
        top_p=job.top_p,
        seed=job.seed,
        return_logprobs=job.return_logprobs,
        prefill_step_size=prefill_step_size,
        after_forward=after_forward,
        on_token=emit,
        should_stop=should_stop,
    )


def job_done(job: Job, generation: Generation, **stats: Any) -> JobDone:
    """The `job_done` of a finished generation, with the lease client's telemetry."""
    return JobDone(
        job_id=job.job_id,
        tokens=generation.tokens,
        text=generation.text,
        prompt_tokens=generation.prompt_tokens,
        prefill_ms=generation.prefill_ms,
        decode_ms=generation.decode_ms,
        finish_reason=generation.finish_reason,
        **stats,
    )
