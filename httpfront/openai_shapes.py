"""The OpenAI API's shapes: a completion request read and checked, the replies and chunks built, errors.

`parse_completion(body, chat=...)` turns a decoded JSON body into a frozen `CompletionRequest` or
raises `ApiError` (400) naming the offending field and value, as OpenAI's API does
(`{"error": {"message", "type", "param", "code"}}`). Where the API leaves room this follows
`mlx_lm.server`: `max_completion_tokens` before `max_tokens`, defaults of 512 tokens and temperature
0 (greedy), message content as a string or a list of text parts joined. What this server cannot honour (several
choices, logprobs, tools, penalties) is refused by name rather than silently ignored.

`door_error(code, message)` maps the job front door's refusal codes to HTTP statuses: a request the
door or the GPU worker refused is 400, a full queue 429, a system not ready or stopping 503, a failed
job 500.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shared.job_messages import (
    CANCELLED,
    CLIENT_QUEUE_FULL,
    CONTEXT_EXCEEDED,
    DUPLICATE_ID,
    MAX_CHAT_MESSAGES,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKENS,
    MAX_TOKENS_TOO_LARGE,
    PROMPT_TOO_LONG,
    SHUTTING_DOWN,
    TOO_LARGE,
    ChatMessage,
)
from shared.protocol import BAD_FIELD, BAD_MESSAGE, BAD_REQUEST, UNKNOWN_OP, shown

DEFAULT_MAX_TOKENS = 512  # mlx_lm.server's --max-tokens default
DEFAULT_TEMPERATURE = 0.0  # mlx_lm.server's --temp default: greedy unless asked (OpenAI's is 1.0)
MAX_TOKENS_LIMIT = 1 << 20  # the wire's bound (shared.job_messages.Generate.max_tokens)
MAX_STOPS = 16
MAX_STOP_CHARS = 1024
MAX_SEED = (1 << 64) - 1  # mx.random.seed takes an unsigned 64-bit seed
ROLES = ("system", "developer", "user", "assistant", "tool")
BUSY = "busy"  # the door answered `busy`: its queue is full
# Codes other processes send that this one cannot import (a process package imports no other):
# the GPU worker's stopping job (gpuworker/serve.py), the coordinator's not-ready refusal.
WORKER_STOPPING, NOT_READY = "worker_stopping", "not_ready"

INVALID, AUTH, RATE_LIMIT, SERVER = "invalid_request_error", "authentication_error", "rate_limit_error", "server_error"
REQUEST_REFUSALS = (BAD_FIELD, BAD_REQUEST, BAD_MESSAGE, UNKNOWN_OP, TOO_LARGE, DUPLICATE_ID)


class ApiError(Exception):
    """An error reply: HTTP status and OpenAI's error object."""

    def __init__(
        self, status: int, message: str, *, type: str = INVALID, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str, *, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """One completion or chat completion, checked; exactly one of prompt, prompt_tokens, messages."""

    chat: bool
    prompt: str | None = None
    prompt_tokens: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    model: str | None = None

    @property
    def prompt_param(self) -> str:
        return "messages" if self.chat else "prompt"


# ------------------------------------------------------------------ reading a request


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float, *, open_low: bool) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(name, f"{name} must be a number, got {shown(value)}", code="invalid_type")
    if value > high or value < low or (open_low and value == low):
        interval = f"({low:g}, {high:g}]" if open_low else f"[{low:g}, {high:g}]"
        raise bad(name, f"{name} must be in {interval}, got {value!r}")
    return float(value)


def _integer(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"{name} must be an integer, got {shown(value)}", code="invalid_type")
    if not low <= value <= high:
        raise bad(name, f"{name} must be in [{low}, {high}], got {value}")
    return value


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(name, f"{name} must be true or false, got {shown(value)}", code="invalid_type")
    return value


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOPS:
        raise bad("stop", f"stop must be a string or a list of at most {MAX_STOPS} strings, got {shown(value)}")
    for index, stop in enumerate(stops):
        if not isinstance(stop, str) or not 0 < len(stop) <= MAX_STOP_CHARS:
            where = "stop" if isinstance(value, str) else f"stop[{index}]"
            limit = f"a non-empty string of at most {MAX_STOP_CHARS} characters"
            raise bad("stop", f"{where} must be {limit}, got {shown(stop)}")
    return tuple(stops)


def _content(content: Any, where: str) -> str:
    """A message's content: a string, null, or a list of text parts (joined, as mlx_lm.server does)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(
            "messages", f"{where} must be a string or a list of text parts, got {shown(content)}", code="invalid_type"
        )
    texts = []
    for index, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            part_shape = "{'type': 'text', 'text': ...}"
            raise bad("messages", f"{where}[{index}] must be a text part {part_shape}, got {shown(part)}")
        texts.append(part["text"])
    return "".join(texts)


def _messages(value: Any) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise bad("messages", f"messages must be a non-empty array, got {shown(value)}", code="invalid_type")
    if len(value) > MAX_CHAT_MESSAGES:
        raise bad("messages", f"messages holds {len(value)} messages; at most {MAX_CHAT_MESSAGES} are served")
    out = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad("messages", f"{where} must be an object, got {shown(message)}", code="invalid_type")
        role = message.get("role")
        if role not in ROLES:
            raise bad("messages", f"{where}.role must be one of {', '.join(ROLES)}, got {shown(role)}")
        text = _content(message.get("content"), f"{where}.content")
        if len(text) > MAX_PROMPT_CHARS:
            raise bad("messages", f"{where}.content has {len(text)} characters; at most {MAX_PROMPT_CHARS}")
        out.append(ChatMessage(role=role, content=text))
    return tuple(out)


def _prompt(value: Any) -> tuple[str | None, tuple[int, ...] | None]:
    """A completion's prompt: a string, a list holding one string, or token ids (one prompt per request)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # one prompt in a batch of one
    if isinstance(value, str):
        if len(value) > MAX_PROMPT_CHARS:
            raise bad("prompt", f"prompt has {len(value)} characters; at most {MAX_PROMPT_CHARS}")
        return value, None
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if len(value) > MAX_PROMPT_TOKENS or min(value) < 0:
            raise bad("prompt", f"prompt token ids must be at most {MAX_PROMPT_TOKENS} non-negative integers")
        return None, tuple(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise bad("prompt", f"one prompt per request is served, got {len(value)}")
    raise bad("prompt", f"prompt must be a string or an array of token ids, got {shown(value)}", code="invalid_type")


# What cannot be honoured: refused when given a value other than "not asked for".
_UNSUPPORTED = {
    "n": lambda v: v in (None, 1),
    "best_of": lambda v: v in (None, 1),
    "echo": lambda v: v in (None, False),
    "logprobs": lambda v: v in (None, False),
    "top_logprobs": lambda v: v in (None, 0),
    "suffix": lambda v: v in (None, ""),
    "tools": lambda v: v in (None, []),
    "logit_bias": lambda v: v in (None, {}),
    "presence_penalty": lambda v: v in (None, 0),
    "frequency_penalty": lambda v: v in (None, 0),
}


def parse_completion(body: Any, *, chat: bool) -> CompletionRequest:
    """The request a JSON body asks for; ApiError (400) naming the first bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {shown(body)}", code="invalid_json")
    for name, fine in _UNSUPPORTED.items():
        if name in body and not fine(body[name]):
            raise bad(name, f"{name}={shown(body[name])} is not supported by this server", code="unsupported")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"model must be a string, got {shown(model)}", code="invalid_type")
    prompt = tokens = messages = None
    if chat:
        if "messages" not in body:
            raise bad("messages", "messages is required", code="missing_required_parameter")
        messages = _messages(body["messages"])
    else:
        if body.get("prompt") is None:
            raise bad("prompt", "prompt is required", code="missing_required_parameter")
        prompt, tokens = _prompt(body["prompt"])
    limit = _integer(body, "max_completion_tokens", 1, MAX_TOKENS_LIMIT)
    if limit is None:
        limit = _integer(body, "max_tokens", 1, MAX_TOKENS_LIMIT)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options", f"stream_options must be an object, got {shown(options)}", code="invalid_type")
    return CompletionRequest(
        chat=chat,
        prompt=prompt,
        prompt_tokens=tokens,
        messages=messages,
        max_tokens=DEFAULT_MAX_TOKENS if limit is None else limit,
        temperature=_number(body, "temperature", DEFAULT_TEMPERATURE, 0.0, 2.0, open_low=False),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
        seed=_integer(body, "seed", 0, MAX_SEED),
        stop=_stops(body.get("stop")),
        stream=_flag(body, "stream"),
        include_usage=_flag(options or {}, "include_usage"),
        model=model,
    )


# ------------------------------------------------------------------ errors


def door_error(code: str, message: str, *, prompt_param: str = "prompt") -> ApiError:
    """The HTTP error for the job front door's `error` (or `busy`) reply with this code."""
    if code == PROMPT_TOO_LONG:
        return ApiError(400, message, param=prompt_param, code=code)
    if code in (MAX_TOKENS_TOO_LARGE, CONTEXT_EXCEEDED):
        return ApiError(400, message, param="max_tokens", code=code)
    if code in REQUEST_REFUSALS:
        return ApiError(400, message, code=code)
    if code in (BUSY, CLIENT_QUEUE_FULL):
        return ApiError(429, message, type=RATE_LIMIT, code=code)
    if code in (SHUTTING_DOWN, WORKER_STOPPING, NOT_READY):
        return ApiError(503, message, type=SERVER, code=code)
    return ApiError(500, message, type=SERVER, code=code if code != CANCELLED else "job_cancelled")


def model_not_found(asked: str, served: str) -> ApiError:
    return ApiError(
        404, f"the model {asked!r} does not exist; this server serves {served!r}", param="model", code="model_not_found"
    )


# ------------------------------------------------------------------ replies


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _choice(chat: bool, text: str, finish_reason: str | None, *, stream: bool, first: bool = False) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0}
    if not chat:
        choice["text"] = text
    elif not stream:
        choice["message"] = {"role": "assistant", "content": text}
    else:  # a chat stream's first delta names the role; the last carries only the finish reason
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
        if text and not first:
            delta["content"] = text
        choice["delta"] = delta
    choice["logprobs"] = None
    choice["finish_reason"] = finish_reason
    return choice


@dataclass(frozen=True, slots=True)
class ReplyHead:
    """What every reply and chunk of one request repeats."""

    id: str
    created: int
    model: str
    chat: bool

    def _object(self, *, stream: bool) -> str:
        if not self.chat:
            return "text_completion"
        return "chat.completion.chunk" if stream else "chat.completion"

    def completion(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """The whole reply of a request that did not stream."""
        return {
            "id": self.id,
            "object": self._object(stream=False),
            "created": self.created,
            "model": self.model,
            "choices": [_choice(self.chat, text, finish_reason, stream=False)],
            "usage": usage(prompt_tokens, completion_tokens),
        }

    def chunk(
        self, text: str, finish_reason: str | None = None, *, first: bool = False, with_usage: bool = False
    ) -> dict[str, Any]:
        """One streamed chunk (with `"usage": null` when the stream ends with a usage chunk, as OpenAI's do)."""
        out: dict[str, Any] = {
            "id": self.id,
            "object": self._object(stream=True),
            "created": self.created,
            "model": self.model,
            "choices": [_choice(self.chat, text, finish_reason, stream=True, first=first)],
        }
        if with_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """`stream_options.include_usage`: the last chunk, with usage and no choices."""
        return {
            "id": self.id,
            "object": self._object(stream=True),
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage(prompt_tokens, completion_tokens),
        }


__all__ = [
    "AUTH",
    "DEFAULT_MAX_TOKENS",
    "INVALID",
    "SERVER",
    "ApiError",
    "CompletionRequest",
    "ReplyHead",
    "bad",
    "door_error",
    "model_not_found",
    "parse_completion",
    "usage",
]
