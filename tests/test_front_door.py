"""The job front door of the real system: concurrency, cancel, busy, bad input, disconnects, stats.

One system for the module (tiny qwen3_moe, every expert resident, a queue of
two). Every refusal is checked for its code and id, and the door keeps
serving after each.
"""

from __future__ import annotations

import logging
import threading
import time

import msgpack
import pytest

from shared.client import Client, JobFailedError, ServerBusy
from shared.demo_model import VOCAB_SIZE
from shared.job_messages import (
    MAX_REQUEST_BYTES,
    Done,
    HealthReply,
    JobFailed,
    TokenEvent,
)
from tests.helpers.models import write_tiny_model
from tests.helpers.raw_client import RawClient
from tests.helpers.system import PROMPT, run_job, start_test_system, wait_for

QUEUE_LIMIT = 2
PROMPT_LIMIT = 2048  # --max-prompt-tokens (the tiny models' context is far longer)
FOREVER = 100_000  # max_tokens of a job that only ends when cancelled


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("front-door"), family="qwen3_moe")
    # One client may fill the queue here (the per-client share is tests/test_limits.py's); one job
    # runs at a time, so that a second one queues (jobs decoded together: tests/test_system_batch.py).
    limits = dict(
        queue_limit=QUEUE_LIMIT, max_queued_per_client=QUEUE_LIMIT, max_prompt_tokens=PROMPT_LIMIT, max_sequences=1
    )
    with start_test_system(path, run_config=limits) as running:
        yield running


def _sums(stats) -> dict[str, int]:
    names = (
        "prompt_tokens",
        "generated_tokens",
        "hits",
        "misses",
        "bytes_read",
        "evictions",
        "pressure_evictions",
        "repin_swaps",
        "bytes_copied",
        "hints_submitted",
        "io_fallback_ops",
    )
    return {name: getattr(stats, name) for name in names}


def _between(value: float, a: float, b: float) -> bool:
    return min(a, b) - 1e-9 <= value <= max(a, b) + 1e-9


def test_cumulative_stats_add_up_over_two_jobs(system):
    with Client(system.endpoint, timeout=60) as client:
        before = client.stats()
        first = client.generate(prompt_tokens=list(PROMPT), max_tokens=16).result().stats
        second = client.generate("Hello, little model", max_tokens=12).result().stats
        after = client.stats()
    assert after.jobs_done - before.jobs_done == 2 and after.running is None and after.queued == 0
    total, start_sums = after.stats, _sums(before.stats)
    for name, value in _sums(total).items():
        assert value - start_sums[name] == getattr(first, name) + getattr(second, name), name
    assert total.hit_rate == pytest.approx(total.hits / (total.hits + total.misses))
    assert first.prompt_tokens == len(PROMPT) and second.prompt_tokens == len("Hello, little model")
    assert first.misses > 0 and first.bytes_read > 0 and first.disk_p99_ms >= first.disk_p50_ms > 0
    for stats in (first, second):
        assert stats.budget_bytes == system.plan.budget_bytes and stats.baseline_bytes > 0
        # the footprint is the whole system's: its processes (measured, more than the baseline's
        # zero) and the slab's resident pages, within the budget
        assert stats.footprint_bytes == stats.processes_bytes + stats.slab_bytes > stats.slab_bytes > 0
        assert stats.budget_bytes >= stats.peak_footprint_bytes >= stats.footprint_bytes
    assert total.peak_footprint_bytes >= max(first.peak_footprint_bytes, second.peak_footprint_bytes)
    assert total.budget_bytes == system.plan.budget_bytes and total.footprint_bytes > 0
    if before.jobs_done + before.jobs_failed == 0:  # rates and percentiles of exactly these two jobs
        for name in (
            "prefill_tok_s",
            "decode_tok_s",
            "all_resident",
            "disk_p50_ms",
            "disk_p99_ms",
            "wait_p50_ms",
            "wait_p99_ms",
            "decode_disk_p50_ms",
            "decode_disk_p99_ms",
            "decode_wait_p50_ms",
            "decode_wait_p99_ms",
        ):
            assert _between(getattr(total, name), getattr(first, name), getattr(second, name)), name
        decode_ms = first.generated_tokens / first.decode_tok_s + second.generated_tokens / second.decode_tok_s
        assert total.decode_tok_s == pytest.approx(total.generated_tokens / decode_ms, rel=1e-6)


def test_three_concurrent_clients_are_all_served(system):
    prompts = [list(PROMPT), list(PROMPT[:24]), list(b"Three clients, one GPU worker.")]
    results: dict[int, Done] = {}
    errors: list[BaseException] = []

    def serve(index: int) -> None:
        try:
            with Client(system.endpoint, timeout=60) as client:
                results[index] = client.generate(prompt_tokens=prompts[index], max_tokens=8).result()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=serve, args=(index,)) for index in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and sorted(results) == [0, 1, 2]
    for index, done in results.items():
        assert done.finish_reason in ("length", "stop") and done.stats.prompt_tokens == len(prompts[index])
    again = run_job(system, prompt_tokens=prompts[0], max_tokens=8, return_logprobs=False)
    assert tuple(again.tokens) == results[0].tokens  # served FIFO, one at a time: same as alone


def test_cancel_a_queued_and_a_running_job(system):
    with Client(system.endpoint, timeout=60) as client:
        running = client.generate(prompt_tokens=list(PROMPT), max_tokens=FOREVER)
        assert isinstance(next(running), TokenEvent)
        queued = client.generate(prompt_tokens=list(PROMPT), max_tokens=4)
        assert wait_for(lambda: client.stats().queued == 1)
        client.cancel(queued.id)
        with pytest.raises(JobFailedError) as caught:
            queued.result()
        assert caught.value.code == "cancelled" and "before it started" in caught.value.message
        client.cancel(running.id)
        with pytest.raises(JobFailedError) as caught:
            running.result()
        assert caught.value.code == "cancelled" and "after" in caught.value.message
        with pytest.raises(JobFailedError) as caught:
            client.cancel("no-such-job")
        assert caught.value.code == "unknown_job"
        stats = client.stats()
        assert stats.running is None and stats.queued == 0
    assert run_job(system, max_tokens=4, return_logprobs=False).done.finish_reason in ("length", "stop")


def test_a_full_queue_answers_busy(system):
    with Client(system.endpoint, timeout=60) as client:
        running = client.generate(prompt_tokens=list(PROMPT), max_tokens=FOREVER)
        assert isinstance(next(running), TokenEvent)
        waiting = [client.generate(prompt_tokens=list(PROMPT), max_tokens=2) for _ in range(QUEUE_LIMIT)]
        with pytest.raises(ServerBusy) as caught:
            client.generate(prompt_tokens=list(PROMPT), max_tokens=2).result()
        assert caught.value.queued == QUEUE_LIMIT
        assert client.stats().queued == QUEUE_LIMIT  # the busy one was not queued
        client.cancel(running.id)
        with pytest.raises(JobFailedError):
            running.result()
        for stream in waiting:  # the queued ones are served once the running job is gone
            assert stream.result().finish_reason in ("length", "stop")


def _generate(**fields) -> dict:
    return {"op": "generate", "id": "g", "prompt_tokens": [1, 2, 3], "max_tokens": 2, **fields}


# (frame or message, expected code, expected id, a piece of the message)
MALFORMED = [
    ([1, 2, 3], "bad_message", "", "must be a map"),
    ({"op": 7}, "bad_message", "", "string 'op'"),
    ({"op": "launch_missiles", "id": "u"}, "unknown_op", "u", "launch_missiles"),
    (_generate(id="t1", max_tokens="many"), "bad_field", "t1", "max_tokens"),
    (_generate(id="t2", prompt_tokens=[1, "a"]), "bad_field", "t2", "prompt_tokens[1]"),
    (_generate(id="t3", temperature="hot"), "bad_field", "t3", "temperature"),
    (_generate(id="t4", top_p=float("nan")), "bad_field", "t4", "finite"),
    (_generate(id="t5", seed=-1), "bad_field", "t5", "seed"),
    (_generate(id="t6", return_logprobs=1), "bad_field", "t6", "boolean"),
    (_generate(id="t7", prompt=5, prompt_tokens=None), "bad_field", "t7", "prompt"),
    (_generate(id="t8", surprise=1), "bad_field", "t8", "surprise"),
    (_generate(id=9), "bad_field", "", "id"),
    (_generate(id="x" * 200), "bad_field", "", "at most 128"),
    ({"op": "cancel"}, "bad_field", "", "missing field 'id'"),
    (_generate(id="r1", max_tokens=0), "bad_field", "r1", ">= 1"),
    (_generate(id="r2", max_tokens=(1 << 20) + 1), "bad_field", "r2", "<="),
    (_generate(id="r3", prompt_tokens=[-1]), "bad_field", "r3", ">= 0"),
    (_generate(id="r4", temperature=-0.5), "bad_request", "r4", "temperature"),
    (_generate(id="r5", top_p=0.0), "bad_request", "r5", "top_p"),
    (_generate(id="r6", top_p=1.5), "bad_request", "r6", "top_p"),
    (_generate(id="r7", prompt_tokens=[VOCAB_SIZE]), "bad_request", "r7", "vocabulary"),
    (_generate(id="r8", prompt_tokens=[1] * (PROMPT_LIMIT + 1)), "prompt_too_long", "r8", f"limit is {PROMPT_LIMIT}"),
    (
        _generate(id="r9", prompt="a" * (PROMPT_LIMIT + 100), prompt_tokens=None),
        "prompt_too_long",
        "r9",
        "--max-prompt-tokens",
    ),  # tokenized and refused by the GPU worker
    (_generate(id="b1", prompt="hi"), "bad_request", "b1", "exactly one"),
    ({"op": "generate", "id": "b2"}, "bad_request", "b2", "exactly one"),
    (_generate(id="b3", prompt_tokens=[]), "bad_request", "b3", "empty"),
    (_generate(id="b4", prompt="", prompt_tokens=None), "bad_request", "b4", "empty"),
    (_generate(id=""), "bad_request", "", "id must not be empty"),
]


def _health_is_next(raw: RawClient) -> None:
    """Nothing was answered before: the next reply is the health we ask for now."""
    raw.send({"op": "health", "id": "h"})
    reply = raw.reply()
    assert isinstance(reply, HealthReply) and reply.id == "h" and reply.ready


def test_every_malformed_input_gets_its_error_and_the_door_keeps_serving(system):
    with RawClient(system.endpoint) as raw:
        raw.send(b"\xc1 not msgpack")  # cannot be parsed: dropped, nothing to answer
        _health_is_next(raw)
        for message, code, request_id, needle in MALFORMED:
            raw.send(msgpack.packb(message))
            reply = raw.reply()
            assert isinstance(reply, JobFailed), (message, reply)
            assert (reply.code, reply.id) == (code, request_id), (str(message)[:80], reply)
            assert needle in reply.message, (needle, reply.message)
        raw.send_frames([msgpack.packb({"op": "health", "id": "m"})] * 2)
        reply = raw.reply()
        assert (reply.code, reply.id) == ("bad_request", "m") and "one frame" in reply.message
        raw.send(b"\x00" * (MAX_REQUEST_BYTES + 1))  # oversized: refused unread
        reply = raw.reply()
        assert (reply.code, reply.id) == ("message_too_large", "") and str(MAX_REQUEST_BYTES) in reply.message
        _health_is_next(raw)
        # Beyond the socket's own limit the frame cannot even be received: ZMQ drops that
        # connection. Nothing is answered, and everyone else is still served.
        with RawClient(system.endpoint) as giant:
            giant.send(b"\x00" * (3 * MAX_REQUEST_BYTES))
            assert giant.quiet(1.0)
        _health_is_next(raw)
        # a duplicate id while the first job of that id runs
        raw.send(_generate(id="dup", prompt_tokens=list(PROMPT), max_tokens=FOREVER))
        assert isinstance(raw.reply(), TokenEvent)
        raw.send(_generate(id="dup"))
        reply = raw.reply()
        while isinstance(reply, TokenEvent):
            reply = raw.reply()
        assert (reply.code, reply.id) == ("duplicate_id", "dup"), reply
        raw.send({"op": "cancel", "id": "dup"})
        reply = raw.reply()
        while isinstance(reply, TokenEvent):
            reply = raw.reply()
        assert (reply.code, reply.id) == ("cancelled", "dup"), reply
    result = run_job(system, max_tokens=4, return_logprobs=False)
    assert result.done.finish_reason in ("length", "stop") and result.tokens


def test_a_client_that_disconnects_mid_job_does_not_stall_the_queue(system, caplog):
    caplog.set_level(logging.INFO)
    gone = Client(system.endpoint, timeout=60)
    stream = gone.generate(prompt_tokens=list(PROMPT), max_tokens=FOREVER)
    assert isinstance(next(stream), TokenEvent)
    gone.generate(prompt_tokens=list(PROMPT), max_tokens=4)  # queued behind it, never read
    with Client(system.endpoint, timeout=60) as other:
        assert wait_for(lambda: other.stats().queued == 1)
        before = other.stats()
        gone.close()  # the socket goes away without a cancel
        started = time.monotonic()
        done = other.generate(prompt_tokens=list(PROMPT[:16]), max_tokens=4).result()
        assert done.finish_reason in ("length", "stop") and time.monotonic() - started < 30
        after = other.stats()
    assert after.jobs_failed - before.jobs_failed == 2  # the cancelled one and the dropped one
    assert after.running is None and after.queued == 0
    messages = [record.getMessage() for record in caplog.records]
    assert any("disconnected; cancelling it" in m for m in messages), messages[-20:]
    assert any("dropped 1 queued job(s) of a disconnected client" in m for m in messages)


# ---------------------------------------------------------------------------------------------
# The pieces, without processes


def test_validate_names_the_context_and_the_vocabulary_from_the_model_config():
    from coordinator.jobs import FrontDoorLimits, validate
    from shared.job_messages import Generate

    limits = FrontDoorLimits.for_model({"text_config": {"max_position_embeddings": 8, "vocab_size": 100}})
    assert (limits.context_tokens, limits.vocab_size) == (8, 100)
    assert validate(Generate(id="a", prompt_tokens=(1,) * 7, max_tokens=1), limits) is None
    assert validate(Generate(id="a", prompt_tokens=(1,) * 9, max_tokens=1), limits)[0] == "prompt_too_long"
    assert validate(Generate(id="a", prompt_tokens=(99, 100), max_tokens=1), limits)[0] == "bad_request"
    assert validate(Generate(id="a", prompt="x" * 100, max_tokens=1), limits) is None  # the GPU worker counts
    assert FrontDoorLimits.for_model({"max_position_embeddings": True}).context_tokens is None


def test_cumulative_percentiles_come_from_a_bounded_reservoir():
    from coordinator.stats import Reservoir

    exact = Reservoir(size=100)
    exact.extend(float(i) for i in range(1, 101))
    assert exact.percentiles(0.5, 0.99) == (50.0, 99.0)  # exact until the reservoir is full
    bounded = Reservoir(size=1000, seed=3)
    bounded.extend(float(i % 1000) for i in range(200_000))
    p50, p99 = bounded.percentiles(0.5, 0.99)
    assert bounded.seen == 200_000 and 430 <= p50 <= 570 and 960 <= p99 <= 999  # uniform: an estimate
