"""The front door's limits on a real system: each refusal's code names the limit and the value.

One system for the module: a tiny model whose context (max_position_embeddings) is 64, launched
with --max-prompt-tokens 40 and --max-tokens 48 (as `RunConfig` fields), a queue of 4 and the
default per-client share (half of it: 2). Its loads are slowed (the test knob) over a tight plan
so a job runs long enough for others to queue behind it. After each group of refusals a valid job
still gives the tokens it gave before them.
"""

from __future__ import annotations

import pytest

from shared.client import Client, JobFailedError
from shared.job_messages import MAX_REQUEST_BYTES, JobFailed, TokenEvent
from tests.helpers.models import write_tiny_model
from tests.helpers.raw_client import RawClient
from tests.helpers.system import run_job, start_test_system, wait_for

CONTEXT = 64
PROMPT_LIMIT = 40  # --max-prompt-tokens
TOKENS_LIMIT = 48  # --max-tokens
QUEUE = 4  # the default share per client is half of it
SHARE = 2
SHORT = list(range(65, 75))  # 10 byte tokens


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("limits"), family="qwen3_moe", max_position_embeddings=CONTEXT)
    # One job at a time: the jobs after the first one queue (the per-client share is of the queue).
    limits = dict(queue_limit=QUEUE, max_prompt_tokens=PROMPT_LIMIT, max_tokens=TOKENS_LIMIT, max_sequences=1)
    with start_test_system(path, budget="tight", io_read_delay_ms=50.0, run_config=limits) as running:
        yield running


@pytest.fixture(scope="module")
def reference(system) -> list[int]:
    return run_job(system, prompt_tokens=SHORT, max_tokens=4, return_logprobs=False).tokens


def _refused(client: Client, **request) -> JobFailedError:
    with pytest.raises(JobFailedError) as caught:
        client.generate(**request).result()
    return caught.value


# (request, code, pieces of the message: the limit, the value, where the limit comes from)
REFUSALS = [
    (
        dict(prompt_tokens=[65] * (PROMPT_LIMIT + 1), max_tokens=1),
        "prompt_too_long",
        [f"has {PROMPT_LIMIT + 1} tokens", f"limit is {PROMPT_LIMIT}", "--max-prompt-tokens"],
    ),
    (  # a text prompt is counted by the GPU worker, which tokenizes it (one token per byte here)
        dict(prompt="a" * (PROMPT_LIMIT + 5), max_tokens=1),
        "prompt_too_long",
        [f"has {PROMPT_LIMIT + 5} tokens", f"limit is {PROMPT_LIMIT}", "--max-prompt-tokens"],
    ),
    (
        dict(prompt_tokens=SHORT, max_tokens=TOKENS_LIMIT + 1),
        "max_tokens_too_large",
        [f"max_tokens is {TOKENS_LIMIT + 1}", f"limit is {TOKENS_LIMIT}", "--max-tokens"],
    ),
    (
        dict(prompt_tokens=[65] * 30, max_tokens=40),
        "context_exceeded",
        ["30 tokens", "max_tokens 40", "make 70", f"context is {CONTEXT}", "max_position_embeddings"],
    ),
    (
        dict(prompt="b" * 30, max_tokens=40),
        "context_exceeded",
        ["30 tokens", "max_tokens 40", "make 70", f"context is {CONTEXT}", "max_position_embeddings"],
    ),
]


@pytest.mark.parametrize(
    ("request_fields", "code", "pieces"), REFUSALS, ids=[f"{code}-{i}" for i, (_, code, _) in enumerate(REFUSALS)]
)
def test_token_limits_refuse_naming_the_limit_and_the_value(system, reference, request_fields, code, pieces):
    with Client(system.endpoint, timeout=120) as client:
        error = _refused(client, **request_fields)
        assert error.code == code, error
        for piece in pieces:
            assert piece in error.message, (piece, error.message)
    assert run_job(system, prompt_tokens=SHORT, max_tokens=4, return_logprobs=False).tokens == reference


def test_a_request_at_every_limit_exactly_is_served(system):
    with Client(system.endpoint, timeout=120) as client:
        done = client.generate(prompt_tokens=[65] * PROMPT_LIMIT, max_tokens=CONTEXT - PROMPT_LIMIT).result()
        assert done.stats.prompt_tokens == PROMPT_LIMIT and 1 <= len(done.tokens) <= CONTEXT - PROMPT_LIMIT
        done = client.generate(prompt="c" * (CONTEXT - TOKENS_LIMIT), max_tokens=TOKENS_LIMIT).result()
        assert done.stats.prompt_tokens == CONTEXT - TOKENS_LIMIT and 1 <= len(done.tokens) <= TOKENS_LIMIT


def test_one_client_cannot_fill_the_queue(system, reference):
    with Client(system.endpoint, timeout=120) as greedy, Client(system.endpoint, timeout=120) as other:
        running = greedy.generate(prompt_tokens=SHORT, max_tokens=TOKENS_LIMIT)
        assert isinstance(next(running), TokenEvent)
        queued = [greedy.generate(prompt_tokens=SHORT, max_tokens=2) for _ in range(SHARE)]
        assert wait_for(lambda: greedy.stats().queued == SHARE, timeout=30)
        error = _refused(greedy, prompt_tokens=SHORT, max_tokens=2)
        assert error.code == "client_queue_full", error
        for piece in (f"has {SHARE} jobs queued", f"limit is {SHARE} per client", "--max-queued-per-client"):
            assert piece in error.message, (piece, error.message)
        # The queue itself has room: another client is queued.
        theirs = other.generate(prompt_tokens=SHORT, max_tokens=2)
        assert wait_for(lambda: other.stats().queued == SHARE + 1, timeout=30)
        running.close()  # cancels it: the queued ones run
        for stream in [*queued, theirs]:
            assert stream.result().finish_reason in ("length", "stop")
        assert greedy.stats().queued == 0
    assert run_job(system, prompt_tokens=SHORT, max_tokens=4, return_logprobs=False).tokens == reference


def test_an_oversize_frame_is_refused_unread_naming_both_sizes(system, reference):
    size = MAX_REQUEST_BYTES + 1
    with RawClient(system.endpoint) as raw:
        raw.send(b"\x92" + b"\x00" * (size - 1))  # would be msgpack's [0, 0] and trailing bytes
        reply = raw.reply()
        assert isinstance(reply, JobFailed) and reply.code == "message_too_large", reply
        assert f"request of {size} bytes" in reply.message and f"at most {MAX_REQUEST_BYTES}" in reply.message
    assert run_job(system, prompt_tokens=SHORT, max_tokens=4, return_logprobs=False).tokens == reference


# ---------------------------------------------------------------------------------------------
# The pieces, without processes


def test_the_launch_flags_become_run_config_fields():
    from supervisor.options import job_limits, parse_args

    base = ["--model", "/m", "--memory-budget", "1GiB"]
    flags = ["--max-prompt-tokens", "100", "--max-tokens", "20", "--max-queued-per-client", "3", "--max-sequences", "2"]
    options = parse_args([*base, *flags])
    assert job_limits(options) == dict(max_prompt_tokens=100, max_tokens=20, max_queued_per_client=3, max_sequences=2)
    assert job_limits(parse_args(base)) == {}  # the model's context, half the queue, 4 sequences apply
    for flag in ("--max-prompt-tokens", "--max-tokens", "--max-queued-per-client", "--max-sequences"):
        with pytest.raises(SystemExit):
            parse_args([*base, flag, "0"])


def test_the_prediction_flags_become_run_config_fields():
    from supervisor.options import parse_args, prediction_fields

    base = ["--model", "/m", "--memory-budget", "1GiB"]
    defaults = {"copy_ahead": "on", "helper_scheduling": "auto", "prefetch_distance": 1}  # RunConfig's margin
    assert prediction_fields(parse_args(base)) == defaults
    flags = ["--prefetch-margin", "0", "--copy-ahead", "off", "--helper-scheduling", "batch"]
    flags += ["--prefetch-distance", "3"]
    set_ = {"copy_ahead": "off", "prefetch_margin": 0, "helper_scheduling": "batch", "prefetch_distance": 3}
    assert prediction_fields(parse_args([*base, *flags])) == set_
    bads = (["--prefetch-margin", "-1"], ["--helper-scheduling", "idle"], *(["--prefetch-distance", t] for t in "09x"))
    for bad in bads:
        with pytest.raises(SystemExit):
            parse_args([*base, *bad])


@pytest.mark.parametrize("distance", [0, 9, True, 2.0, "2"])
def test_a_prefetch_distance_out_of_range_is_refused_naming_it(distance, tmp_path, capsys):
    """The run's config and the GPU worker's flag take 1..MAX_PREFETCH_DISTANCE and say what they
    got; the run's distance reaches the GPU worker's flags."""
    import dataclasses

    from shared.commands import GpuWorkerArgs, gpu_worker_args_for, gpu_worker_argv, parse_gpu_worker_argv
    from shared.config import ConfigError, check_config, check_prefetch_distance
    from tests.helpers.run_config import small_run_config

    with pytest.raises(ValueError, match=f"prefetch_distance must be in \\[1, 8\\].*got {distance!r}"):
        check_prefetch_distance(distance)
    config = GpuWorkerArgs(model=str(tmp_path), endpoint="ipc:///tmp/x", prefetch_distance=4)
    assert parse_gpu_worker_argv(gpu_worker_argv(config)) == config
    if isinstance(distance, int) and not isinstance(distance, bool):
        with pytest.raises(SystemExit):
            parse_gpu_worker_argv([*gpu_worker_argv(config), "--prefetch-distance", str(distance)])
        assert "--prefetch-distance must be in [1, 8]" in capsys.readouterr().err
    run = small_run_config(tmp_path, prefetch_distance=3)
    assert check_config(run) is run and gpu_worker_args_for(run).prefetch_distance == 3
    with pytest.raises(ConfigError, match=f"got {distance!r}"):
        check_config(dataclasses.replace(run, prefetch_distance=distance))


def test_limits_resolve_from_the_flags_the_context_and_a_default():
    from coordinator.job_limits import DEFAULT_CONTEXT_TOKENS, FrontDoorLimits, validate
    from shared.job_messages import Generate

    flagged = FrontDoorLimits.for_model({"max_position_embeddings": 100}, max_prompt_tokens=500, max_tokens=10)
    assert flagged.prompt_limit() == (100, "max_position_embeddings")  # a flag above the context: the context
    assert flagged.tokens_limit() == (10, "--max-tokens") and flagged.flag_prompt_limit() is None
    unknown = FrontDoorLimits.for_model({}, queue_limit=9)
    assert unknown.prompt_limit()[0] == unknown.tokens_limit()[0] == DEFAULT_CONTEXT_TOKENS
    assert unknown.per_client == 4 and FrontDoorLimits(queue_limit=1).per_client == 1
    # No context known: only the limits apply, no sum check.
    assert validate(Generate(id="a", prompt_tokens=(1,) * 10, max_tokens=DEFAULT_CONTEXT_TOKENS), unknown) is None
    code, message = validate(Generate(id="a", prompt_tokens=(1,), max_tokens=DEFAULT_CONTEXT_TOKENS + 1), unknown)
    assert code == "max_tokens_too_large" and str(DEFAULT_CONTEXT_TOKENS) in message and "no context" in message
