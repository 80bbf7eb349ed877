"""One completion or chat completion: the job at the door, its text through the stop strings, the reply.

The status is decided by the job's first reply, so a refusal the door or the GPU worker makes at the
start (a prompt over the limits, a full queue) is an HTTP error with its own status, streamed or not.
Then a request that does not stream waits for the job's end and answers once; one that streams sends
server-sent events (`data: {chunk}` ... `data: [DONE]`) as tokens arrive. A stop string found in the
text ends the reply there (finish_reason `stop`) and cancels the job at the door; a client that goes
away (before or during its stream) cancels it too. A failure after the stream started is sent as an
`error` event, as OpenAI's API does, and the stream ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from httpfront.jobs_client import JobHandle
from httpfront.openai_shapes import ApiError, ReplyHead, door_error
from httpfront.stops import StopText
from shared.job_messages import Busy, Done, JobFailed, TokenEvent

logger = logging.getLogger("httpfront.completions")

T = TypeVar("T")
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class ClientGone(Exception):
    """The HTTP client disconnected before its reply was sent."""


async def until_disconnect(receive: Receive) -> None:
    """Return when the HTTP client has gone (the request body must have been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_gone(work: Awaitable[T], watcher: asyncio.Task) -> T:
    """`work`'s result, or ClientGone (with `work` cancelled) if `watcher` (until_disconnect) ends first."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise ClientGone()
    return task.result()


class JobRun:
    """One job's replies as the text a client may see: stop strings applied, tokens counted."""

    def __init__(self, handle: JobHandle, stops: StopText, *, prompt_param: str) -> None:
        self._handle, self._stops, self._prompt_param = handle, stops, prompt_param
        self._streamed = ""  # the tokens' text as the door sent it (a prefix of Done.text)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.finish_reason: str | None = None  # set once the run is over

    @property
    def id(self) -> str:
        return self._handle.id

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    async def next(self) -> str:
        """The text released by the job's next reply ("" while held back); ApiError if the job failed."""
        reply = await self._handle.next()
        if isinstance(reply, TokenEvent):
            self.prompt_tokens = reply.prompt_tokens
            self.completion_tokens += 1
            self._streamed += reply.text
            out = self._stops.feed(reply.text)
            if self._stops.stopped:
                self.finish_reason = "stop"
                await self._handle.cancel()  # the rest of the job is not wanted
                logger.info("job %s matched stop string %r after %d tokens", self.id, self._stops.matched, len(self))
            return out
        if isinstance(reply, Done):
            # A stop by EOS or a max_tokens end leaves the detokenizer's last flush in Done.text only.
            rest = reply.text[len(self._streamed) :] if reply.text.startswith(self._streamed) else ""
            out = self._stops.feed(rest)
            out += self._stops.flush()
            self.finish_reason = "stop" if self._stops.stopped else reply.finish_reason
            self.prompt_tokens = reply.stats.prompt_tokens or self.prompt_tokens
            self.completion_tokens = len(reply.tokens)
            return out
        self.finish_reason = "error"
        if isinstance(reply, Busy):
            raise door_error("busy", f"the job queue is full ({reply.queued} jobs waiting); retry later")
        assert isinstance(reply, JobFailed)
        raise door_error(reply.code, reply.message, prompt_param=self._prompt_param)

    def __len__(self) -> int:
        return self.completion_tokens

    async def text(self) -> str:
        """Everything the job generates (the reply of a request that does not stream)."""
        parts = []
        while not self.done:
            parts.append(await self.next())
        return "".join(parts)

    async def cancel(self) -> None:
        """Stop the job at the door unless it is over."""
        if not self._handle.finished:
            await self._handle.cancel()
            logger.info("job %s cancelled: its HTTP client is gone", self.id)


def event(data: Any) -> bytes:
    """One server-sent event carrying JSON (or the literal [DONE])."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


class EventStream:
    """The streamed reply (an ASGI app): chunks as the job's text is released, a client gone cancels the job."""

    def __init__(self, run: JobRun, head: ReplyHead, first: str, *, include_usage: bool) -> None:
        self._run, self._head, self._first, self._usage = run, head, first, include_usage

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),  # a proxy in front must not hold the events back
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        pump = asyncio.ensure_future(self._pump(send))
        gone = asyncio.ensure_future(until_disconnect(receive))
        try:
            await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, gone):
                task.cancel()
            await asyncio.gather(pump, gone, return_exceptions=True)
            await self._run.cancel()  # a no-op once the job is over
        if pump.done() and not pump.cancelled() and pump.exception() is not None:
            logger.error("stream of job %s failed", self._run.id, exc_info=pump.exception())

    async def _pump(self, send: Send) -> None:
        run, head = self._run, self._head

        async def emit(data: Any, *, more: bool = True) -> None:
            await send({"type": "http.response.body", "body": event(data), "more_body": more})

        text, first = self._first, True
        try:
            while True:
                if text or (first and head.chat):  # a chat stream opens with the assistant's role
                    await emit(head.chunk(text, first=first, with_usage=self._usage))
                    first = False
                if run.done:
                    break
                text = await run.next()
            assert run.finish_reason is not None
            await emit(head.chunk("", run.finish_reason, with_usage=self._usage))
            if self._usage:
                await emit(head.usage_chunk(run.prompt_tokens, run.completion_tokens))
        except ApiError as error:
            logger.warning("job %s failed mid-stream: %s", run.id, error.message)
            await emit(error.body())
        await emit("[DONE]", more=False)


__all__ = ["ClientGone", "EventStream", "JobRun", "event", "unless_gone", "until_disconnect"]
