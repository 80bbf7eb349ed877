"""The job client and the send CLI against a scripted fake coordinator (a ROUTER in a thread)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import zmq

from shared import cli_send
from shared.client import Client, ClientError, ClientTimeout, JobFailedError, ReplyError, ServerBusy, token_logprobs
from shared.job_messages import (
    CANCELLED,
    COORDINATOR_ACCEPTS_FROM_CLIENTS,
    UNKNOWN_JOB,
    WORKER_FAILED,
    Busy,
    CancelJob,
    Done,
    Generate,
    HealthReply,
    HealthRequest,
    JobFailed,
    JobStats,
    StatsReply,
    StatsRequest,
    TokenEvent,
)
from shared.protocol import MAX_MESSAGE_BYTES, decode, encode

REPO = Path(__file__).resolve().parents[1]
STATS = JobStats(
    prompt_tokens=3,
    generated_tokens=2,
    prefill_tok_s=120.5,
    decode_tok_s=33.25,
    hits=6,
    misses=2,
    hit_rate=0.75,
    bytes_read=3 << 20,
    footprint_bytes=150 << 20,
    peak_footprint_bytes=160 << 20,
    budget_bytes=192 << 20,
)

# A handler gets each decoded request and returns what to send back: messages
# (encoded for the requester), raw bytes (sent as they are), or floats (sleep).
Handler = Callable[[object], Iterable[object]]


class FakeCoordinator:
    """Replays scripted replies; `requests` records every decoded request."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[object] = []
        self._context = zmq.Context()
        self._sock = self._context.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        # Unpacking [identity, frame] also checks the client sends one frame per message.
        try:
            while not self._stop.is_set():
                if not self._sock.poll(20):
                    continue
                identity, frame = self._sock.recv_multipart()
                request = decode(frame, COORDINATOR_ACCEPTS_FROM_CLIENTS)
                self.requests.append(request)
                for item in self.handler(request):
                    if isinstance(item, float):
                        time.sleep(item)
                    else:
                        payload = item if isinstance(item, bytes) else encode(item)
                        self._sock.send_multipart([identity, payload])
        except BaseException as error:  # surfaced by close()
            self._error = error

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(linger=0)
        self._context.term()
        if self._error is not None:
            raise self._error


@pytest.fixture
def fake():
    servers: list[FakeCoordinator] = []

    def start(handler: Handler) -> FakeCoordinator:
        server = FakeCoordinator(handler)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def _tokens_then_done(request: Generate, pieces=("Hel", "lo")) -> list[object]:
    replies: list[object] = [
        TokenEvent(id=request.id, index=i, token=100 + i, text=text) for i, text in enumerate(pieces)
    ]
    replies.append(
        Done(id=request.id, tokens=tuple(100 + i for i in range(len(pieces))), text="".join(pieces), stats=STATS)
    )
    return replies


def streaming(request):
    if isinstance(request, Generate):
        return _tokens_then_done(request)
    return []


# ----------------------------------------------------------------- client


def test_generate_streams_tokens_then_done(fake):
    server = fake(streaming)
    with Client(server.endpoint, timeout=5) as client:
        events = list(client.generate("hi", max_tokens=2, temperature=0.5, top_p=0.9, seed=7))
    assert [type(e) for e in events] == [TokenEvent, TokenEvent, Done]
    assert "".join(e.text for e in events[:-1]) == "Hello" and events[-1].stats == STATS
    (request,) = server.requests
    assert (request.prompt, request.prompt_tokens, request.max_tokens) == ("hi", None, 2)
    assert (request.temperature, request.top_p, request.seed) == (0.5, 0.9, 7)
    assert events[-1].id == request.id


def test_prompt_tokens_logprobs_and_result(fake):
    def handler(request):
        yield TokenEvent(id=request.id, index=0, token=5, logprobs=bytes(4 * 3))
        yield Done(id=request.id, tokens=(5,))

    server = fake(handler)
    with Client(server.endpoint, timeout=5) as client:
        stream = client.generate(prompt_tokens=[1, 2, 3], return_logprobs=True, id="mine")
        first = next(stream)
        assert token_logprobs(first).tolist() == [0.0, 0.0, 0.0]
        done = stream.result()
    assert done.tokens == (5,) and stream.done is done and stream.id == "mine"
    assert server.requests[0].prompt_tokens == (1, 2, 3) and server.requests[0].return_logprobs


def test_job_failed_raises_job_error_with_code(fake):
    def handler(request):
        yield TokenEvent(id=request.id, index=0, token=1, text="a")
        yield JobFailed(code=WORKER_FAILED, message="GPU worker exited with -9", id=request.id)

    with Client(fake(handler).endpoint, timeout=5) as client:
        stream = client.generate("x")
        assert next(stream).token == 1
        with pytest.raises(JobFailedError, match="GPU worker exited") as caught:
            next(stream)
    assert caught.value.code == WORKER_FAILED and caught.value.job_id == stream.id
    assert list(stream) == []  # a finished stream stays finished


def test_busy_raises_server_busy(fake):
    with (
        Client(fake(lambda r: [Busy(id=r.id, queued=8)]).endpoint, timeout=5) as client,
        pytest.raises(ServerBusy) as caught,
    ):
        list(client.generate("x"))
    assert caught.value.queued == 8 and caught.value.code == "busy"
    assert isinstance(caught.value, JobFailedError)


def test_stats_and_health(fake):
    def handler(request):
        if isinstance(request, StatsRequest):
            yield StatsReply(id=request.id, jobs_done=3, running="j1", stats=STATS)
        elif isinstance(request, HealthRequest):
            yield HealthReply(id=request.id, ready=True, pid=42, io_workers=2, gpu_worker=True)

    with Client(fake(handler).endpoint, timeout=5) as client:
        stats = client.stats()
        health = client.health()
    assert isinstance(stats, StatsReply) and stats.jobs_done == 3 and stats.stats == STATS
    assert isinstance(health, HealthReply) and health.ready and health.io_workers == 2


def test_error_reply_to_stats_raises(fake):
    server = fake(lambda r: [JobFailed(code="internal", message="boom", id=r.id)])
    with Client(server.endpoint, timeout=5) as client, pytest.raises(JobFailedError, match="boom"):
        client.stats()


def test_timeouts_name_the_endpoint(fake):
    server = fake(lambda request: [])
    with Client(server.endpoint, timeout=0.2) as client:
        started = time.monotonic()
        with pytest.raises(ClientTimeout, match=server.endpoint.replace(".", r"\.")) as caught:
            next(client.generate("x"))
        assert isinstance(caught.value, TimeoutError)
        assert 0.15 < time.monotonic() - started < 3
        with pytest.raises(TimeoutError, match="stats"):
            client.stats(timeout=0.1)


def test_interleaved_replies_for_two_ids_are_routed(fake):
    held: list[Generate] = []

    def handler(request):
        if not isinstance(request, Generate):
            return []
        held.append(request)
        if len(held) < 2:
            return []
        a, b = held
        return [
            TokenEvent(id=a.id, index=0, token=1, text="a0"),
            TokenEvent(id=b.id, index=0, token=2, text="b0"),
            TokenEvent(id=a.id, index=1, token=3, text="a1"),
            Done(id=b.id, tokens=(2,), text="b0"),
            TokenEvent(id=a.id, index=2, token=4, text="a2"),
            Done(id=a.id, tokens=(1, 3, 4), text="a0a1a2"),
        ]

    with Client(fake(handler).endpoint, timeout=5) as client:
        first = client.generate("a")
        second = client.generate("b")
        # Read b to its end first: a's three tokens arrive meanwhile and wait buffered.
        assert [e.text for e in second] == ["b0", "b0"]
        assert [e.token for e in first if isinstance(e, TokenEvent)] == [1, 3, 4]
        assert first.done is not None and first.done.text == "a0a1a2"


def test_concurrent_jobs_from_threads_share_one_client(fake):
    def handler(request):
        if isinstance(request, Generate):
            return [0.01, *_tokens_then_done(request, pieces=tuple(request.prompt))]
        return []

    results: dict[str, str] = {}
    with Client(fake(handler).endpoint, timeout=5) as client:

        def run(prompt: str) -> None:
            results[prompt] = client.generate(prompt).result().text

        threads = [threading.Thread(target=run, args=(p,)) for p in ("abc", "defg", "hi")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
    assert results == {"abc": "abc", "defg": "defg", "hi": "hi"}


def test_cancel_ends_a_streaming_job(fake):
    def handler(request):
        if isinstance(request, Generate):
            return [TokenEvent(id=request.id, index=0, token=1)]
        if isinstance(request, CancelJob):
            return [JobFailed(code=CANCELLED, message="cancelled by the client", id=request.id)]
        return []

    with Client(fake(handler).endpoint, timeout=5) as client:
        stream = client.generate("x")
        next(stream)
        client.cancel(stream.id)
        with pytest.raises(JobFailedError) as caught:
            next(stream)
    assert caught.value.code == CANCELLED


def test_cancel_of_unknown_job_raises(fake):
    def handler(request):
        if isinstance(request, CancelJob):
            yield JobFailed(code=UNKNOWN_JOB, message=f"no job {request.id}", id=request.id)

    with Client(fake(handler).endpoint, timeout=5) as client, pytest.raises(JobFailedError) as caught:
        client.cancel("nope")
    assert caught.value.code == UNKNOWN_JOB


def test_cancel_after_the_job_finished_gets_its_answer(fake):
    def handler(request):
        if isinstance(request, Generate):
            return _tokens_then_done(request)
        if isinstance(request, CancelJob):
            return [JobFailed(code=UNKNOWN_JOB, message="finished", id=request.id)]
        return []

    with Client(fake(handler).endpoint, timeout=5) as client:
        stream = client.generate("x")
        stream.result()
        with pytest.raises(JobFailedError) as caught:
            client.cancel(stream.id)
    assert caught.value.code == UNKNOWN_JOB


def test_a_reply_after_a_timeout_is_discarded(fake):
    def handler(request):
        if isinstance(request, StatsRequest):
            return [0.4, StatsReply(id=request.id)]
        return [HealthReply(id=request.id, ready=True)]

    with Client(fake(handler).endpoint, timeout=5) as client:
        with pytest.raises(ClientTimeout):
            client.stats(timeout=0.1)
        assert client.health().ready  # read after the late stats reply
        assert not client._inbox


def test_closing_a_stream_cancels_it_and_drops_its_late_replies(fake):
    def handler(request):
        if isinstance(request, Generate):
            return [TokenEvent(id=request.id, index=0, token=1)]
        if isinstance(request, CancelJob):
            return [TokenEvent(id=request.id, index=1, token=2), JobFailed(code=CANCELLED, message="", id=request.id)]
        if isinstance(request, StatsRequest):
            return [StatsReply(id=request.id)]
        return []

    server = fake(handler)
    with Client(server.endpoint, timeout=5) as client:
        with client.generate("x") as stream:
            next(stream)
        assert isinstance(client.stats(), StatsReply)  # read past the dropped replies
        assert isinstance(server.requests[1], CancelJob) and server.requests[1].id == stream.id
        assert not client._inbox


def test_unreadable_or_id_less_replies(fake):
    def handler(request):
        if isinstance(request, StatsRequest):
            return [b"\xc1 not msgpack"]
        return [JobFailed(code="bad_field", message="generate: missing field 'id'")]

    with Client(fake(handler).endpoint, timeout=5) as client:
        with pytest.raises(ReplyError, match="cannot read"):
            client.stats()
        with pytest.raises(JobFailedError, match="missing field"):
            client.health()


def test_requests_are_checked_before_sending(fake):
    server = fake(streaming)
    with Client(server.endpoint, timeout=5) as client:
        with pytest.raises(ValueError, match="exactly one"):
            client.generate("x", prompt_tokens=[1])
        with pytest.raises(ValueError, match="exactly one"):
            client.generate()
        with pytest.raises(ValueError, match="integers"):
            client.generate(prompt_tokens=[1.5])
        with pytest.raises(ValueError, match="max_tokens"):
            client.generate("x", max_tokens=0)
        with pytest.raises(ValueError, match="at most"):
            client.generate(prompt_tokens=[0xFFFFFFFF] * (MAX_MESSAGE_BYTES // 5 + 1))
        stream = client.generate("x", id="same")
        with pytest.raises(ValueError, match="already in flight"):
            client.generate("y", id="same")
        stream.result()
    assert len(server.requests) == 1
    with pytest.raises(ClientError, match="closed"):
        client.stats()
    with pytest.raises(ValueError, match="timeout"):
        Client(server.endpoint, timeout=0)
    with pytest.raises(ValueError, match="cannot connect"):
        Client("nowhere")


# -------------------------------------------------------------------- CLI


def test_cli_json(fake, capsys):
    server = fake(streaming)
    code = cli_send.main(
        ["--endpoint", server.endpoint, "--prompt-tokens", "1, 2,3", "--json", "--max-tokens", "2", "--seed", "3"]
    )
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    result = json.loads(out)
    assert result["tokens"] == [100, 101] and result["text"] == "Hello"
    assert result["stats"] == {name: getattr(STATS, name) for name in JobStats.__dataclass_fields__}
    assert server.requests[0].prompt_tokens == (1, 2, 3) and server.requests[0].seed == 3


def test_cli_streams_text_then_stats(fake, capsys):
    server = fake(streaming)
    assert cli_send.main(["--endpoint", server.endpoint, "--prompt", "hi"]) == 0
    out, err = capsys.readouterr()
    assert out == "Hello\n"
    assert "2 tokens" in err and "hit rate 75.0%" in err and "decode 33.2 tok/s" in err
    assert "read 3.0 MiB" in err and "150.0 MiB" in err and "budget 192.0 MiB" in err


def test_the_summary_line_says_what_prefetch_read_and_where_auto_stopped_it():
    plain = cli_send.format_stats(Done(id="a", tokens=(1,), stats=STATS))
    assert "prefetch" not in plain  # nothing prefetched: nothing said
    for stopped, tail in ((0, "precision 50%"), (1, "stopped on 1 layer (auto)"), (3, "stopped on 3 layers (auto)")):
        stats = dataclasses.replace(
            STATS,
            prefetch_issued=8,
            prefetch_bytes=4 << 20,
            prefetch_recall=0.25,
            prefetch_precision=0.5,
            prefetch_disabled_layers=stopped,
        )
        line = cli_send.format_stats(Done(id="a", tokens=(1,), stats=stats))
        assert "prefetch 4.0 MiB: recall 25%, precision 50%" in line and tail in line, line
        assert ("stopped" in line) is bool(stopped)
    paused = cli_send.format_stats(Done(id="a", tokens=(1,), stats=dataclasses.replace(STATS, prefetch_paused=True)))
    assert "prefetch paused (auto: decode steps were faster without it)" in paused
    trial = cli_send.format_stats(Done(id="a", tokens=(1,), stats=dataclasses.replace(STATS, prefetch_trialling=True)))
    assert "prefetch on trial (auto: timing decode steps with it and without)" in trial
    assert "on trial" not in cli_send.format_stats(Done(id="a", tokens=(1,), stats=STATS))


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (lambda r: [JobFailed(code=WORKER_FAILED, message="it died", id=r.id)], "job failed (worker_failed): it died"),
        (lambda r: [Busy(id=r.id, queued=4)], "busy: 4 jobs queued"),
        (lambda r: [TokenEvent(id=r.id, index=0, token=1, text="par")], "no reply from tcp://"),
    ],
    ids=["failed", "busy", "timeout"],
)
def test_cli_job_errors_exit_1(fake, capsys, reply, message):
    server = fake(reply)
    assert cli_send.main(["--endpoint", server.endpoint, "--prompt", "x", "--timeout", "0.3"]) == 1
    out, err = capsys.readouterr()
    assert message in err
    assert out in ("", "par\n")  # partial text, then the line is ended


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt", "x", "--prompt-tokens", "1,2"], "not allowed with"),
        (["--prompt-tokens", "1,x,3"], "comma-separated"),
        (["--prompt-tokens", "1,,3"], "comma-separated"),
        (["--prompt-tokens", "-1"], "comma-separated"),
        ([], "one of the arguments --prompt --prompt-tokens --health is required"),
        (["--prompt", "x", "--max-tokens", "0"], "must be >= 1"),
        (["--prompt", "x", "--temperature", "-1"], "--temperature must be >= 0"),
        (["--prompt", "x", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--prompt", "x", "--timeout", "nan"], "must be finite"),
    ],
)
def test_cli_usage_errors_exit_2(capsys, argv, message):
    assert cli_send.main(["--endpoint", "tcp://127.0.0.1:9", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_needs_an_endpoint(capsys, monkeypatch):
    monkeypatch.delenv(cli_send.ENDPOINT_ENV, raising=False)
    assert cli_send.main(["--prompt", "x"]) == 2
    assert "--endpoint is required" in capsys.readouterr().err
    assert cli_send.main(["--endpoint", "bogus", "--prompt", "x"]) == 2
    assert "cannot connect" in capsys.readouterr().err


def test_send_script_as_subprocess(fake):
    server = fake(streaming)
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "send.py"), "--endpoint", server.endpoint, "--prompt", "hi", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["text"] == "Hello"
    usage = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "send.py"), "--prompt-tokens", "a"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert usage.returncode == 2 and "comma-separated" in usage.stderr
