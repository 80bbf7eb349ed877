"""The HTTP front's routes (Starlette): the OpenAI API, /health, /metrics; bearer auth; OpenAI-shaped errors.

    GET  /v1/models, /v1/models/{id}      the one model served (its id: the model directory's name)
    POST /v1/completions                   prompt -> text (stream: server-sent events)
    POST /v1/chat/completions              messages -> the assistant's message (the chat template is
                                           applied by the GPU worker, with the tokenizer's own)
    GET  /health                           the coordinator's health: 200 when ready, else 503
    GET  /metrics                          Prometheus text format

With an API key every request needs `Authorization: Bearer KEY` (401 otherwise, compared in constant
time). Every error, an unknown path included, is `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from httpfront.completions import ClientGone, EventStream, JobRun, unless_gone, until_disconnect
from httpfront.jobs_client import DoorUnreachable, JobsClient
from httpfront.metrics import CONTENT_TYPE, render
from httpfront.openai_shapes import (
    AUTH,
    SERVER,
    ApiError,
    ReplyHead,
    model_not_found,
    parse_completion,
)
from httpfront.stops import StopText
from shared.job_messages import Generate, HealthReply, HealthRequest, StatsReply, StatsRequest

logger = logging.getLogger("httpfront.app")

MAX_BODY_BYTES = 16 * 1024 * 1024  # a request over this is refused unread (the door takes 4 MiB frames)
ASK_TIMEOUT_S = 5.0  # for the door's health and stats
ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")


@dataclass
class Front:
    """What the routes share: the door's client, the model's id, the request counts."""

    jobs: JobsClient
    model_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    requests: Counter[tuple[str, int]] = field(default_factory=Counter)

    async def health(self) -> HealthReply | None:
        try:
            reply = await self.jobs.ask(HealthRequest, timeout=ASK_TIMEOUT_S)
        except DoorUnreachable as error:
            logger.warning("%s", error)
            return None
        return reply if isinstance(reply, HealthReply) else None

    async def check_ready(self) -> None:
        """ApiError 503 unless the system serves jobs now (the door would hold them until it does)."""
        reply = await self.health()
        if reply is None:
            raise ApiError(503, "the job front door does not answer", type=SERVER, code="not_ready")
        if not reply.accepting:
            raise ApiError(503, "the system is shutting down", type=SERVER, code="shutting_down")
        if not reply.ready:
            gpu = "ready" if reply.gpu_worker else "not ready"
            message = f"the system is not ready (GPU worker {gpu}, {reply.io_workers} I/O workers); retry shortly"
            raise ApiError(503, message, type=SERVER, code="not_ready")


def _error_response(error: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status in (429, 503) else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def _read_json(request: Request) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is {declared} bytes; at most {MAX_BODY_BYTES}", code="too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="too_large")
            chunks.append(chunk)
    except ClientDisconnect:  # nobody reads the answer; said so that it is not logged as a failure
        raise ApiError(400, "the client went away while sending its request", code="client_gone") from None

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    try:
        return json.loads(b"".join(chunks), parse_constant=refuse)
    except (ValueError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the request body is not JSON: {error}", code="invalid_json") from None


def _model_entry(front: Front) -> dict[str, Any]:
    return {"id": front.model_id, "object": "model", "created": front.created, "owned_by": "moeslab"}


async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_entry(request.app.state.front)]})


async def get_model(request: Request) -> Response:
    front: Front = request.app.state.front
    asked = request.path_params["model"]
    if asked != front.model_id:
        raise model_not_found(asked, front.model_id)
    return JSONResponse(_model_entry(front))


async def health(request: Request) -> Response:
    reply = await request.app.state.front.health()
    if reply is None:
        return JSONResponse({"status": "unavailable", "reason": "the job front door does not answer"}, 503)
    ready = reply.ready and reply.accepting
    body = {
        "status": "ok" if ready else "unavailable",
        "ready": reply.ready,
        "accepting": reply.accepting,
        "gpu_worker": reply.gpu_worker,
        "io_workers": reply.io_workers,
        "processes": {info.name: info.pid for info in reply.processes},
    }
    return JSONResponse(body, 200 if ready else 503)


async def metrics(request: Request) -> Response:
    front: Front = request.app.state.front
    try:
        reply = await front.jobs.ask(StatsRequest, timeout=ASK_TIMEOUT_S)
    except DoorUnreachable as error:
        raise ApiError(503, str(error), type=SERVER, code="not_ready") from None
    if not isinstance(reply, StatsReply):
        raise ApiError(502, f"the job front door answered stats with {reply!r}", type=SERVER, code="bad_reply")
    return Response(render(reply, front.requests, front.jobs.open_jobs), media_type=CONTENT_TYPE)


async def _complete(request: Request, *, chat: bool) -> Response:
    front: Front = request.app.state.front
    asked = parse_completion(await _read_json(request), chat=chat)
    if asked.model is not None and asked.model != front.model_id:
        raise model_not_found(asked.model, front.model_id)
    await front.check_ready()
    job = Generate(
        id=front.jobs.new_id(),
        prompt=asked.prompt,
        prompt_tokens=asked.prompt_tokens,
        messages=asked.messages,
        max_tokens=asked.max_tokens,
        temperature=asked.temperature,
        top_p=asked.top_p,
        seed=asked.seed,
    )
    try:
        handle = front.jobs.generate(job)
    except ValueError as error:  # what the door's decoder refuses (e.g. a frame over its size)
        raise ApiError(400, str(error), param=asked.prompt_param, code="invalid_value") from None
    except DoorUnreachable as error:
        raise ApiError(503, str(error), type=SERVER, code="not_ready") from None
    run = JobRun(handle, StopText(asked.stop), prompt_param=asked.prompt_param)
    prefix = "chatcmpl-" if chat else "cmpl-"
    head = ReplyHead(id=prefix + uuid.uuid4().hex, created=int(time.time()), model=front.model_id, chat=chat)
    watcher = asyncio.ensure_future(until_disconnect(request.receive))
    try:
        if asked.stream:
            first = await unless_gone(run.next(), watcher)  # the status waits for the job's first reply
            return EventStream(run, head, first, include_usage=asked.include_usage)  # type: ignore[return-value]
        text = await unless_gone(run.text(), watcher)
        assert run.finish_reason is not None
        return JSONResponse(head.completion(text, run.finish_reason, run.prompt_tokens, run.completion_tokens))
    except ClientGone:
        await run.cancel()
        return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
    except BaseException:
        await run.cancel()
        raise
    finally:
        watcher.cancel()


async def completions(request: Request) -> Response:
    return await _complete(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _complete(request, chat=True)


async def _api_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, ApiError)
    if error.status >= 500:
        logger.warning("%s %s: %d %s", request.method, request.url.path, error.status, error.message)
    return _error_response(error)


async def _http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    if error.status_code == 404:
        message = f"no such endpoint: {request.method} {request.url.path}"
    elif error.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = str(error.detail)
    return _error_response(ApiError(error.status_code, message, code=None))


async def _internal_error(request: Request, error: Exception) -> Response:
    logger.error("%s %s failed", request.method, request.url.path, exc_info=error)
    return _error_response(ApiError(500, f"internal error: {error!r}", type=SERVER, code="internal"))


class Guard:
    """ASGI wrapper: the bearer token on every request (when a key is set), and requests counted by status."""

    def __init__(self, app: Starlette, *, api_key: str | None, front: Front) -> None:
        self._app, self._front = app, front
        self._expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = next((known for known in ROUTES if path == known or path.startswith(known + "/")), "other")
        status = 500

        async def counting(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if self._expected is not None and not self._authorized(scope):
                error = ApiError(401, "a valid API key is required (Authorization: Bearer KEY)", type=AUTH)
                error.code = "invalid_api_key"
                response = JSONResponse(error.body(), 401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, counting)
                return
            await self._app(scope, receive, counting)
        finally:
            self._front.requests[(route, status)] += 1

    def _authorized(self, scope: dict[str, Any]) -> bool:
        given = next((value for name, value in scope.get("headers", ()) if name == b"authorization"), b"")
        assert self._expected is not None
        return hmac.compare_digest(given, self._expected)


def build_app(front: Front, *, api_key: str | None = None) -> Guard:
    """The front's ASGI application."""
    app = Starlette(
        routes=[
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", get_model, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error},
    )
    app.state.front = front
    return Guard(app, api_key=api_key, front=front)


__all__ = ["MAX_BODY_BYTES", "Front", "Guard", "build_app"]
