"""The HTTP front as users run it: `moeslab-launch --http 127.0.0.1:0` on the tiny model, driven with
the official `openai` package (sync and async, streamed and not, completions and chat) and raw HTTP.

One launched system serves most tests (a module fixture: a launch costs seconds on this machine).
It checks that greedy output equals the ZeroMQ client's for the same prompt, usage and finish
reasons, stop strings, eight concurrent clients, a client that disconnects mid-stream (its job is
cancelled), each 400 / 404 with the field or model named, /health and /metrics (parsed with
prometheus_client's parser). A second system (`--api-key`, one queued job per client) is where the
tests that kill or stop things run: 401, 429, 503 while the GPU worker restarts, the front itself
killed and restarted on its port, a stream cut by SIGTERM, and nothing left behind. The request
parsing and stop-string logic are tested without a system in tests/test_http_shapes.py.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import socket
from pathlib import Path
from urllib.parse import urlsplit

import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.client import Client
from tests.helpers.supervisor import assert_all_gone, launch, model_args, run_dirs, tiny_model
from tests.helpers.system import wait_for

PROMPT = "The quick brown fox"
TOKENS = 12
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
KEY = "test-key-7f3a"
LONG = 4000  # a job that runs until it is cancelled (within --max-tokens 4096)
TOO_LONG = "prompt_too_long"


# ------------------------------------------------------------------ helpers


def request(
    url: str, method: str, path: str, body: object = None, *, key: str | None = None, raw: bytes | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request with the standard library: (status, headers, body)."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        payload = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        connection.request(method, path, body=payload, headers=headers)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def error_of(status_body: tuple[int, dict[str, str], bytes]) -> tuple[int, dict]:
    status, _, body = status_body
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return status, error


def sync_client(launched, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{launched.ready['http']}/v1", api_key=key, max_retries=0, timeout=120)


def async_client(launched, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{launched.ready['http']}/v1", api_key=key, max_retries=0, timeout=120)


def open_stream(url: str, body: dict, *, key: str | None = None) -> tuple[socket.socket, bytes]:
    """POST a streamed request on a raw socket and read until the first event; (socket, what was read)."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n{auth}"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    sock = socket.create_connection((parts.hostname, parts.port), timeout=60)
    sock.sendall(head.encode() + payload)
    seen = b""
    while b"data: " not in seen:
        chunk = sock.recv(65536)
        assert chunk, seen
        seen += chunk
    return sock, seen


def door_stats(launched):
    with Client(launched.endpoint, timeout=30) as client:
        return client.stats()


def greedy(launched, **job) -> object:
    """The ZeroMQ client's Done for the same job (greedy: temperature 0)."""
    with Client(launched.endpoint, timeout=60) as client:
        return client.generate(**job).result()


def metrics(url: str, key: str | None = None) -> dict[str, float]:
    status, headers, body = request(url, "GET", "/metrics", key=key)
    assert status == 200 and headers["content-type"].startswith("text/plain"), (status, body[:300])
    return {
        sample.name + ("" if not sample.labels else json.dumps(sample.labels, sort_keys=True)): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def served(model, tmp_path_factory):
    """One system for the tests that leave it as they found it."""
    tmp = tmp_path_factory.mktemp("served")
    args = model_args(model) + ["--http", "127.0.0.1:0", "--max-prompt-tokens", "64", "--max-tokens", "4096"]
    launched = launch(tmp, args, shared=True)
    yield launched
    assert launched.signal(signal.SIGTERM) == 0, launched.stderr()[-4000:]
    assert_all_gone(launched)
    assert "Traceback" not in launched.stderr(), launched.stderr()[-4000:]


# ------------------------------------------------------------------ the shared system


def test_the_ready_line_names_the_http_url_and_the_model(served, model):
    url = served.ready["http"]
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url) and not url.endswith(":0"), url
    assert "http_front" in served.pids and psutil.pid_exists(served.pids["http_front"])
    client = sync_client(served)
    models = client.models.list()
    assert [entry.id for entry in models.data] == [model.name]
    assert client.models.retrieve(model.name).id == model.name
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4")
    assert caught.value.code == "model_not_found"
    status, _, body = request(url, "GET", "/health")
    health = json.loads(body)
    assert status == 200 and health["status"] == "ok" and health["processes"]["http_front"] == served.pids["http_front"]


def test_completions_sync_async_streamed_or_not_equal_the_zeromq_client(served, model):
    want = greedy(served, prompt=PROMPT, max_tokens=TOKENS)
    finish = "length" if len(want.tokens) == TOKENS else "stop"
    client = sync_client(served)
    ask = dict(model=model.name, prompt=PROMPT, max_tokens=TOKENS, temperature=0)
    reply = client.completions.create(**ask)
    assert reply.object == "text_completion" and reply.choices[0].text == want.text
    assert reply.choices[0].finish_reason == finish
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (want.stats.prompt_tokens, len(want.tokens))
    assert reply.usage.total_tokens == want.stats.prompt_tokens + len(want.tokens)
    chunks = list(client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == want.text
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == finish
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.tokens)

    async def asynchronously() -> tuple[str, str]:
        async with async_client(served) as aclient:
            whole = await aclient.completions.create(**ask)
            stream = await aclient.completions.create(**ask, stream=True)
            parts = [chunk.choices[0].text async for chunk in stream if chunk.choices]
        return whole.choices[0].text, "".join(parts)

    assert asyncio.run(asynchronously()) == (want.text, want.text)


def test_chat_renders_the_template_in_the_gpu_worker_and_equals_the_zeromq_client(served, model):
    want = greedy(served, messages=CHAT, max_tokens=TOKENS)
    client = sync_client(served)
    parts = [
        CHAT[0],
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
    ]
    reply = client.chat.completions.create(model=model.name, messages=parts, max_completion_tokens=TOKENS)
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == want.text and reply.usage.prompt_tokens == want.stats.prompt_tokens

    async def streamed() -> list:
        async with async_client(served) as aclient:
            stream = await aclient.chat.completions.create(
                model=model.name, messages=CHAT, max_tokens=TOKENS, stream=True, stream_options={"include_usage": True}
            )
            return [chunk async for chunk in stream]

    chunks = asyncio.run(streamed())
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == want.text
    assert chunks[-1].usage.prompt_tokens == want.stats.prompt_tokens and chunks[-1].choices == []


def test_a_stop_string_cuts_the_text_and_cancels_the_job(served, model):
    want = greedy(served, prompt=PROMPT, max_tokens=24).text
    # The first two characters whose first occurrence is after the start (else the very start).
    start = next((k for k in range(1, len(want) - 1) if want.find(want[k : k + 2]) == k), 0)
    stop = want[start : start + 2]
    client = sync_client(served)
    ask = dict(model=model.name, prompt=PROMPT, max_tokens=24, temperature=0)
    reply = client.completions.create(**ask, stop=[stop, "never seen \x00"])
    assert reply.choices[0].text == want[:start] and reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens <= 24
    chunks = list(client.completions.create(**ask, stop=stop, stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == want[:start]
    assert chunks[-1].choices[0].finish_reason == "stop"
    unmatched = client.completions.create(**ask, stop="never seen \x00")
    assert unmatched.choices[0].text == want and unmatched.choices[0].finish_reason in ("length", "stop")
    assert wait_for(lambda: door_stats(served).queued == 0 and door_stats(served).running is None, timeout=30)


def test_eight_concurrent_clients_all_succeed(served, model):
    before = door_stats(served).jobs_done

    async def one(index: int, aclient: openai.AsyncOpenAI) -> tuple[str, int, str]:
        ask = dict(model=model.name, max_tokens=6, temperature=0)
        if index % 2:
            stream = await aclient.chat.completions.create(
                **ask, messages=[{"role": "user", "content": f"client {index}"}], stream=True
            )
            chunks = [chunk async for chunk in stream]
            return "".join(c.choices[0].delta.content or "" for c in chunks), -1, chunks[-1].choices[0].finish_reason
        reply = await aclient.completions.create(**ask, prompt=f"client {index} says")
        return reply.choices[0].text, reply.usage.completion_tokens, reply.choices[0].finish_reason

    async def together() -> list:
        async with async_client(served) as aclient:
            return await asyncio.gather(*(one(index, aclient) for index in range(8)))

    results = asyncio.run(together())
    assert len(results) == 8
    for _, tokens, finish in results:
        assert finish in ("length", "stop") and (tokens == -1 or (finish == "stop") == (tokens < 6))
    assert door_stats(served).jobs_done == before + 8


def test_a_client_that_disconnects_mid_stream_cancels_its_job(served):
    url = served.ready["http"]
    before = door_stats(served).jobs_failed
    sock, seen = open_stream(url, {"prompt": PROMPT, "max_tokens": LONG, "stream": True})
    assert seen.startswith(b"HTTP/1.1 200") and b"text/event-stream" in seen
    sock.close()
    # Cancelled at the door (a failed job there), long before its 4000 tokens.
    assert wait_for(lambda: door_stats(served).jobs_failed == before + 1, timeout=20)
    stats = door_stats(served)
    assert stats.running is None and stats.queued == 0
    assert "cancelled: its HTTP client is gone" in served.stderr()
    assert metrics(url)["moeslab_http_open_jobs"] == 0


@pytest.mark.parametrize(
    ("path", "body", "param", "code", "needle"),
    [
        ("/v1/completions", {"max_tokens": 4}, "prompt", "missing_required_parameter", "prompt is required"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "4"}, "max_tokens", "invalid_type", "an integer"),
        ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p", "invalid_value", "top_p must be in (0, 1]"),
        ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop", "invalid_value", "stop[0]"),
        ("/v1/chat/completions", {"messages": []}, "messages", "invalid_type", "non-empty array"),
        # Refused by the job front door and the GPU worker (--max-prompt-tokens 64, --max-tokens 4096).
        ("/v1/completions", {"prompt": "y" * 200, "max_tokens": 4}, "prompt", TOO_LONG, "64"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "y" * 200}]},
            "messages",
            "prompt_too_long",
            "64",
        ),
        ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, "max_tokens", "max_tokens_too_large", "4096"),
    ],
)
def test_a_bad_request_is_a_400_naming_the_field(served, path, body, param, code, needle):
    status, error = error_of(request(served.ready["http"], "POST", path, body))
    assert status == 400 and error["param"] == param and error["code"] == code, error
    assert needle in error["message"] and error["type"] == "invalid_request_error", error


def test_other_errors_are_openai_shaped_and_the_front_keeps_serving(served, model):
    url = served.ready["http"]
    status, error = error_of(request(url, "POST", "/v1/completions", raw=b"{not json"))
    assert status == 400 and error["code"] == "invalid_json"
    status, error = error_of(request(url, "POST", "/v1/completions", raw=b'{"prompt": "x", "temperature": NaN}'))
    assert status == 400 and "NaN" in error["message"]
    status, error = error_of(request(url, "POST", "/v1/completions", {"prompt": "x", "model": "other"}))
    assert status == 404 and error["code"] == "model_not_found" and error["param"] == "model"
    assert error_of(request(url, "GET", "/v1/nothing-here"))[0] == 404
    assert error_of(request(url, "GET", "/v1/completions"))[0] == 405
    with pytest.raises(openai.BadRequestError) as caught:
        sync_client(served).completions.create(model=model.name, prompt="x", max_tokens=0)
    assert caught.value.param == "max_tokens"
    assert sync_client(served).completions.create(model=model.name, prompt="x", max_tokens=2).choices[0].text


def test_metrics_and_health(served):
    url = served.ready["http"]
    request(url, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
    found = metrics(url)
    stats = door_stats(served)
    assert found["moeslab_generated_tokens_total"] == stats.stats.generated_tokens > 0
    assert (
        found["moeslab_jobs_done_total"] == stats.jobs_done and found["moeslab_jobs_failed_total"] == stats.jobs_failed
    )
    assert found["moeslab_budget_bytes"] == served.ready["plan"]["budget_bytes"]
    assert 0 < found["moeslab_footprint_bytes"] <= found["moeslab_budget_bytes"]
    assert 0 <= found["moeslab_expert_hit_rate"] <= 1 and found["moeslab_expert_bytes_read_total"] > 0
    assert found["moeslab_decode_tokens_per_second"] > 0 and found["moeslab_prefill_tokens_per_second"] > 0
    assert found["moeslab_queue_depth"] == 0 and found["moeslab_active_sequences"] >= 0
    ok = found['moeslab_http_requests_total{"route": "/v1/completions", "status": "200"}']
    assert ok >= 1


# ------------------------------------------------------------------ a system the tests kill and stop


def test_an_exposed_host_without_an_api_key_is_refused_at_launch(model, tmp_path):
    launched = launch(tmp_path, model_args(model) + ["--http", "0.0.0.0:0"], expect_ready=False, timeout=60)
    assert launched.process.returncode == 2
    assert "--http 0.0.0.0:0 refused" in launched.stderr() and "--api-key" in launched.stderr()
    assert not run_dirs(tmp_path)


def test_api_key_full_queue_not_ready_front_restart_and_a_clean_stop(model, tmp_path):
    args = model_args(model) + ["--http", "127.0.0.1:0", "--api-key", KEY, "--max-queued-per-client", "1"]
    launched = launch(tmp_path, args)
    url = launched.ready["http"]
    assert KEY not in " ".join(" ".join(p.cmdline()) for p in launched.children())  # never on a command line

    # 401 without the key or with a wrong one, on every path; the key opens them.
    for path in ("/v1/models", "/health", "/metrics"):
        status, error = error_of(request(url, "GET", path))
        assert status == 401 and error["code"] == "invalid_api_key", path
    with pytest.raises(openai.AuthenticationError):
        sync_client(launched, key="wrong").models.list()
    assert [m.id for m in sync_client(launched, key=KEY).models.list().data] == [model.name]

    # 429: one client (the front) may hold one queued job; the jobs past it are refused at once.
    async def crowd() -> list:
        async with async_client(launched, key=KEY) as aclient:

            async def one(index: int):
                stream = await aclient.completions.create(
                    model=model.name, prompt=f"{index}", max_tokens=LONG, stream=True
                )
                async for _ in stream:
                    break
                return stream

            tasks = [asyncio.ensure_future(one(index)) for index in range(8)]
            await asyncio.wait(tasks, timeout=20)
            outcomes = []
            for task in tasks:
                if not task.done():
                    task.cancel()  # the queued one: its connection closes, its job is dropped
                    outcomes.append("waiting")
                elif isinstance(task.exception(), openai.RateLimitError):
                    outcomes.append(task.exception().code)
                else:
                    await task.result().close()  # a running one: closing cancels its job
                    outcomes.append("streaming")
            await asyncio.gather(*tasks, return_exceptions=True)
            return outcomes

    outcomes = asyncio.run(crowd())
    assert "streaming" in outcomes and outcomes.count("client_queue_full") >= 3, outcomes
    assert wait_for(lambda: door_stats(launched).running is None and door_stats(launched).queued == 0, timeout=30)

    # 503 while the GPU worker restarts: /health says so, and a completion is refused at once.
    os.kill(launched.pids["gpu_worker"], signal.SIGKILL)
    assert wait_for(lambda: request(url, "GET", "/health", key=KEY)[0] == 503, timeout=20)
    with pytest.raises(openai.InternalServerError) as caught:
        sync_client(launched, key=KEY).completions.create(model=model.name, prompt="x", max_tokens=2)
    assert caught.value.status_code == 503 and caught.value.code == "not_ready"
    assert wait_for(lambda: request(url, "GET", "/health", key=KEY)[0] == 200, timeout=60)
    assert sync_client(launched, key=KEY).completions.create(model=model.name, prompt="x", max_tokens=2).choices

    # The front killed: the supervisor restarts it on the same port.
    front = launched.pids["http_front"]
    os.kill(front, signal.SIGKILL)

    def serving_again() -> bool:
        try:
            status, _, body = request(url, "GET", "/health", key=KEY)
        except OSError:
            return False
        return status == 200 and json.loads(body)["processes"]["http_front"] != front

    assert wait_for(serving_again, timeout=30), launched.stderr()[-3000:]
    assert sync_client(launched, key=KEY).completions.create(model=model.name, prompt="x", max_tokens=2).choices
    pids = list(json.loads(request(url, "GET", "/health", key=KEY)[2])["processes"].values())

    # SIGTERM mid-stream: the stream ends with an error event, then everything stops cleanly.
    sock, seen = open_stream(url, {"prompt": PROMPT, "max_tokens": LONG, "stream": True}, key=KEY)
    launched.process.send_signal(signal.SIGTERM)
    sock.settimeout(30)
    while b"data: [DONE]" not in seen:
        chunk = sock.recv(65536)
        if not chunk:
            break
        seen += chunk
    sock.close()
    errors = [json.loads(line[6:])["error"] for line in seen.split(b"\n") if line.startswith(b'data: {"error"')]
    assert errors and errors[0]["code"] in ("worker_stopping", "shutting_down"), seen[-600:]
    assert launched.wait() == 0, launched.stderr()[-4000:]
    assert_all_gone(launched, pids=[pid for pid in pids if pid != launched.process.pid])
    with pytest.raises(OSError):
        request(url, "GET", "/health", key=KEY)
    assert not run_dirs(tmp_path)
    assert "restarting HTTP front" in launched.stderr()
