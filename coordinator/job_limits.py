"""The job front door's limits: what a `generate` may ask for, and how much of the queue one client may hold.

Every refusal names the limit, its value and where it comes from (a
`moeslab-launch` flag or the model's config), so a user can tell whether to
shorten the request or raise a flag:

- the prompt's tokens: at most `--max-prompt-tokens` and the model's context
  (`max_position_embeddings`) → `prompt_too_long`;
- `max_tokens`: at most `--max-tokens` and the model's context → `max_tokens_too_large`;
- the prompt's tokens plus `max_tokens` may not exceed the model's context:
  refused (`context_exceeded`), never clamped, because a clamped job would end
  early without the client having asked for that;
- one client (one ROUTER identity) may hold at most `--max-queued-per-client`
  waiting jobs → `client_queue_full` (the whole queue's bound still answers `busy`).

A model whose config names no context gets `DEFAULT_CONTEXT_TOKENS` as the
default of both token limits, and no sum check (only the flags apply). A text
prompt's tokens are counted by the GPU worker, which tokenizes it: the front
door passes the prompt limit and the sum check along in the `job`
(`Job.max_prompt_tokens`, `Job.fit_context`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shared.config import RunConfig
from shared.job_messages import (
    CONTEXT_EXCEEDED,
    MAX_REQUEST_BYTES,
    MAX_TOKENS_TOO_LARGE,
    PROMPT_TOO_LONG,
    Generate,
)
from shared.protocol import BAD_REQUEST

DEFAULT_QUEUE_LIMIT = 16
# The token limits' default for a model whose config names no context (max_position_embeddings).
DEFAULT_CONTEXT_TOKENS = 32768
CONTEXT_SOURCE = "max_position_embeddings"


def default_share(queue_limit: int) -> int:
    """One client's default share of a queue of `queue_limit`: half of it, so no client can fill it
    alone (a queue of one cannot be shared: its one place is the share)."""
    return max(1, queue_limit // 2)


@dataclass(frozen=True, slots=True)
class FrontDoorLimits:
    queue_limit: int = DEFAULT_QUEUE_LIMIT  # jobs waiting behind the running one
    context_tokens: int | None = None  # the model's max_position_embeddings, when known
    vocab_size: int | None = None
    max_request_bytes: int = MAX_REQUEST_BYTES
    # The flags' values (None: not given; the context, or DEFAULT_CONTEXT_TOKENS, applies).
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None
    max_queued_per_client: int | None = None  # None: default_share(queue_limit)

    @classmethod
    def for_model(
        cls,
        config: Mapping[str, Any],
        *,
        queue_limit: int = DEFAULT_QUEUE_LIMIT,
        max_prompt_tokens: int | None = None,
        max_tokens: int | None = None,
        max_queued_per_client: int | None = None,
    ) -> FrontDoorLimits:
        """Limits from a model's config.json (a `text_config` inside it counts too) and the run's flags."""
        return cls(
            queue_limit=queue_limit,
            context_tokens=_positive(config, "max_position_embeddings"),
            vocab_size=_positive(config, "vocab_size"),
            max_prompt_tokens=max_prompt_tokens,
            max_tokens=max_tokens,
            max_queued_per_client=max_queued_per_client,
        )

    @classmethod
    def for_run(cls, config: Mapping[str, Any], run: RunConfig) -> FrontDoorLimits:
        """Limits from a model's config.json and the run's configuration (its flags)."""
        return cls.for_model(
            config,
            queue_limit=run.queue_limit,
            max_prompt_tokens=run.max_prompt_tokens,
            max_tokens=run.max_tokens,
            max_queued_per_client=run.max_queued_per_client,
        )

    @property
    def per_client(self) -> int:
        given = self.max_queued_per_client
        return default_share(self.queue_limit) if given is None else given

    def prompt_limit(self) -> tuple[int, str]:
        """The prompt's token limit and what sets it."""
        return self._bound(self.max_prompt_tokens, "--max-prompt-tokens")

    def tokens_limit(self) -> tuple[int, str]:
        """`max_tokens`'s limit and what sets it."""
        return self._bound(self.max_tokens, "--max-tokens")

    def flag_prompt_limit(self) -> int | None:
        """The prompt limit when a flag (not the context) sets it: the GPU worker checks the context itself."""
        limit, source = self.prompt_limit()
        return limit if source != CONTEXT_SOURCE else None

    def _bound(self, flag: int | None, name: str) -> tuple[int, str]:
        context = self.context_tokens
        if flag is not None and (context is None or flag < context):
            return flag, name
        if context is not None:
            return context, CONTEXT_SOURCE
        return DEFAULT_CONTEXT_TOKENS, f"the default for a model whose config names no context ({name})"


def _positive(config: Mapping[str, Any], key: str) -> int | None:
    value = config.get(key)
    if value is None and isinstance(config.get("text_config"), Mapping):
        value = config["text_config"].get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _tail(limit: int, source: str) -> str:
    if source == CONTEXT_SOURCE:
        return f"the model's context is {limit} ({CONTEXT_SOURCE})"
    return f"the limit is {limit} ({source})"


def validate(request: Generate, limits: FrontDoorLimits) -> tuple[str, str] | None:
    """(code, message) of why a well-typed generate is refused, or None."""
    if not request.id:
        return BAD_REQUEST, "id must not be empty"
    given = [name for name in ("prompt", "prompt_tokens", "messages") if getattr(request, name) is not None]
    if len(given) != 1:
        return BAD_REQUEST, f"give exactly one of prompt, prompt_tokens and messages, got {given or 'none'}"
    if request.prompt is not None and not request.prompt:
        return BAD_REQUEST, "prompt is empty"
    if request.messages is not None and not request.messages:
        return BAD_REQUEST, "messages is empty"
    limit, source = limits.tokens_limit()
    if request.max_tokens > limit:
        return MAX_TOKENS_TOO_LARGE, f"max_tokens is {request.max_tokens}; {_tail(limit, source)}"
    tokens = request.prompt_tokens
    if tokens is not None:
        if not tokens:
            return BAD_REQUEST, "prompt_tokens is empty"
        limit, source = limits.prompt_limit()
        if len(tokens) > limit:
            return PROMPT_TOO_LONG, f"the prompt has {len(tokens)} tokens; {_tail(limit, source)}"
        context = limits.context_tokens
        if context is not None and len(tokens) + request.max_tokens > context:
            return CONTEXT_EXCEEDED, (
                f"the prompt's {len(tokens)} tokens plus max_tokens {request.max_tokens} make "
                f"{len(tokens) + request.max_tokens}; the model's context is {context} ({CONTEXT_SOURCE})"
            )
        if limits.vocab_size is not None and max(tokens) >= limits.vocab_size:
            return BAD_REQUEST, f"prompt token {max(tokens)} is outside the vocabulary of {limits.vocab_size}"
    # A text prompt's token count is the GPU worker's to check (it tokenizes): see the module doc.
    if request.temperature < 0:
        return BAD_REQUEST, f"temperature must be >= 0, got {request.temperature}"
    if not 0 < request.top_p <= 1:
        return BAD_REQUEST, f"top_p must be in (0, 1], got {request.top_p}"
    return None


__all__ = [
    "CONTEXT_SOURCE",
    "DEFAULT_CONTEXT_TOKENS",
    "DEFAULT_QUEUE_LIMIT",
    "FrontDoorLimits",
    "default_share",
    "validate",
]
