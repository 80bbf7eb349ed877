"""The HTTP front's logic without a system: stop strings, request parsing, error mapping, reply shapes,
the `--http` / `--api-key` flags and the front's command line.

The HTTP front itself, launched with a system and driven with the `openai` package, is tested in
tests/test_http_front.py.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from httpfront.openai_shapes import (
    DEFAULT_MAX_TOKENS,
    ApiError,
    ReplyHead,
    door_error,
    parse_completion,
)
from httpfront.stops import StopText
from shared.commands import HttpFrontArgs, http_front_argv, parse_http_front_argv, split_host_port
from shared.job_messages import ChatMessage
from supervisor.http_child import check_http
from supervisor.options import parse_args

# ------------------------------------------------------------------ stop strings


def run_stops(pieces: list[str], stops: tuple[str, ...]) -> tuple[str, StopText, list[str]]:
    matcher = StopText(stops)
    shown = [matcher.feed(piece) for piece in pieces]
    shown.append(matcher.flush())
    return "".join(shown), matcher, shown


def test_a_stop_string_across_pieces_cuts_the_text_before_it():
    text, matcher, shown = run_stops(["Hello #", "#", "# more", " text"], ("###",))
    assert text == "Hello " and matcher.stopped and matcher.matched == "###" and matcher.text == "Hello "
    assert shown[:3] == ["Hello ", "", ""]  # "#" and "##" were held back: they may begin "###"


def test_held_back_text_is_released_when_it_turns_out_not_to_be_a_stop():
    text, matcher, shown = run_stops(["ab#", "#c", "d"], ("###",))
    assert not matcher.stopped and text == "ab##cd"
    assert shown == ["ab", "##c", "d", ""]
    text, matcher, shown = run_stops(["ab#"], ("###",))
    assert shown == ["ab", "#"] and text == "ab#"  # the end releases what was held


def test_the_stop_completed_first_wins_and_nothing_follows_a_match():
    text, matcher, _ = run_stops(["one two three"], ("three", "two"))
    assert text == "one " and matcher.matched == "two"
    assert matcher.feed("more") == "" and matcher.flush() == ""
    # "a" is complete before "#aa" is, whatever the pieces: the text stops before the "a".
    for pieces in (["#aa"], ["#a", "a"], ["#", "a", "a"]):
        assert run_stops(pieces, ("#aa", "a"))[0] == "#", pieces


def test_without_stops_every_piece_passes_at_once_and_empty_stops_are_refused():
    matcher = StopText(())
    assert [matcher.feed(p) for p in ("a", "", "b")] == ["a", "", "b"] and not matcher.stopped
    with pytest.raises(ValueError):
        StopText(("",))


@given(
    st.text(alphabet="ab#\n", max_size=40),
    st.lists(st.text(alphabet="ab#\n", min_size=1, max_size=4), min_size=1, max_size=3),
    st.randoms(use_true_random=False),
)
def test_stops_match_a_plain_search_however_the_text_is_cut(text: str, stops: list[str], rng: random.Random):
    """Released text is always a prefix of the answer, and the answer is the text before the first stop."""
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    found = [(index + len(stop), index) for stop in stops if (index := text.find(stop)) >= 0]
    want = text[: min(found)[1]] if found else text  # cut before the stop completed first
    matcher = StopText(tuple(stops))
    released = ""
    for piece in pieces:
        released += matcher.feed(piece)
        assert want.startswith(released)
    released += matcher.flush()
    assert released == want and matcher.stopped == bool(found)


# ------------------------------------------------------------------ requests


def refused(body: object, *, chat: bool = False) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_completion(body, chat=chat)
    assert caught.value.status == 400
    return caught.value


def test_a_completion_request_with_mlx_lm_server_defaults():
    asked = parse_completion({"prompt": "Hi"}, chat=False)
    assert (asked.prompt, asked.prompt_tokens, asked.messages) == ("Hi", None, None)
    assert asked.max_tokens == DEFAULT_MAX_TOKENS and asked.temperature == 0.0 and asked.top_p == 1.0
    assert not asked.stream and not asked.include_usage and asked.stop == () and asked.model is None
    full = parse_completion(
        {
            "prompt": ["Hi"],
            "max_tokens": 5,
            "max_completion_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 3,
            "stop": "\n",
            "stream": True,
            "stream_options": {"include_usage": True},
            "model": "m",
            "n": 1,
            "user": "someone",
        },
        chat=False,
    )
    assert full.prompt == "Hi" and full.max_tokens == 7 and (full.temperature, full.top_p, full.seed) == (0.5, 0.9, 3)
    assert full.stop == ("\n",) and full.stream and full.include_usage and full.model == "m"
    assert parse_completion({"prompt": [1, 2, 3]}, chat=False).prompt_tokens == (1, 2, 3)


def test_chat_content_may_be_text_parts_joined():
    asked = parse_completion(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]},
                {"role": "assistant", "content": None},
            ]
        },
        chat=True,
    )
    assert asked.messages == (
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Hello"),
        ChatMessage("assistant", ""),
    )
    assert asked.prompt_param == "messages"


@pytest.mark.parametrize(
    ("body", "chat", "param", "needle"),
    [
        ({}, False, "prompt", "prompt is required"),
        ({"prompt": 5}, False, "prompt", "prompt must be a string"),
        ({"prompt": ["a", "b"]}, False, "prompt", "one prompt per request"),
        ({"prompt": [1, -2]}, False, "prompt", "non-negative"),
        ({"prompt": "x", "max_tokens": 0}, False, "max_tokens", "max_tokens must be in [1, "),
        ({"prompt": "x", "max_tokens": "8"}, False, "max_tokens", "max_tokens must be an integer"),
        ({"prompt": "x", "max_tokens": True}, False, "max_tokens", "max_tokens must be an integer"),
        ({"prompt": "x", "max_completion_tokens": 1.5}, False, "max_completion_tokens", "an integer"),
        ({"prompt": "x", "temperature": -1}, False, "temperature", "temperature must be in [0, 2]"),
        ({"prompt": "x", "temperature": "hot"}, False, "temperature", "temperature must be a number"),
        ({"prompt": "x", "top_p": 0}, False, "top_p", "top_p must be in (0, 1]"),
        ({"prompt": "x", "seed": -1}, False, "seed", "seed must be in [0, "),
        ({"prompt": "x", "stop": ["ok", ""]}, False, "stop", "stop[1] must be a non-empty string"),
        ({"prompt": "x", "stop": 3}, False, "stop", "stop must be a string or a list"),
        ({"prompt": "x", "stream": "yes"}, False, "stream", "stream must be true or false"),
        ({"prompt": "x", "stream_options": []}, False, "stream_options", "must be an object"),
        ({"prompt": "x", "n": 2}, False, "n", "n=2 is not supported"),
        ({"prompt": "x", "logprobs": 3}, False, "logprobs", "not supported"),
        ({"prompt": "x", "model": 7}, False, "model", "model must be a string"),
        ({}, True, "messages", "messages is required"),
        ({"messages": []}, True, "messages", "messages must be a non-empty array"),
        ({"messages": ["hi"]}, True, "messages", "messages[0] must be an object"),
        ({"messages": [{"role": "robot", "content": "x"}]}, True, "messages", "messages[0].role must be one of"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            True,
            "messages",
            "messages[0].content[0] must be a text part",
        ),
        ({"messages": [{"role": "user", "content": 5}]}, True, "messages", "messages[0].content must be a string"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, True, "tools", "not supported"),
    ],
)
def test_a_bad_request_is_refused_naming_the_field(body, chat, param, needle):
    error = refused(body, chat=chat)
    assert error.param == param and needle in error.message, error.message
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}


def test_a_body_that_is_not_an_object_is_refused():
    assert "must be a JSON object" in refused([1, 2]).message


def test_door_refusals_map_to_http_statuses():
    cases = {
        "prompt_too_long": (400, "messages"),
        "max_tokens_too_large": (400, "max_tokens"),
        "context_exceeded": (400, "max_tokens"),
        "bad_field": (400, None),
        "busy": (429, None),
        "client_queue_full": (429, None),
        "shutting_down": (503, None),
        "worker_stopping": (503, None),
        "not_ready": (503, None),
        "worker_failed": (500, None),
        "worker_hung": (500, None),
        "memory_pressure": (500, None),
    }
    for code, (status, param) in cases.items():
        error = door_error(code, "why", prompt_param="messages")
        assert (error.status, error.param, error.message) == (status, param, "why"), code
        assert error.code == code


def test_reply_shapes_follow_openai():
    text = ReplyHead(id="cmpl-1", created=1, model="m", chat=False)
    reply = text.completion("hi", "length", 3, 2)
    assert reply["object"] == "text_completion" and reply["choices"][0]["text"] == "hi"
    assert reply["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    chat = ReplyHead(id="chatcmpl-1", created=1, model="m", chat=True)
    assert chat.completion("hi", "stop", 1, 1)["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    first, middle, last = chat.chunk("a", first=True), chat.chunk("b"), chat.chunk("", "stop", with_usage=True)
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "a",
    }
    assert middle["choices"][0]["delta"] == {"content": "b"} and "usage" not in middle
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert last["usage"] is None and chat.usage_chunk(4, 2)["choices"] == []


# ------------------------------------------------------------------ flags and command line


def test_http_flags_refuse_an_exposed_host_without_a_key():
    base = ["--model", "m", "--memory-budget", "1GiB"]
    options = parse_args([*base, "--http", "127.0.0.1:0"])
    assert options.http == "127.0.0.1:0" and options.api_key is None
    assert parse_args([*base, "--http", "0.0.0.0:8080", "--api-key", "k3y"]).api_key == "k3y"
    assert "k3y" not in repr(parse_args([*base, "--http", "[::1]:80", "--api-key", "k3y"]))
    for bad in (["--http", "0.0.0.0:8080"], ["--http", "example.com:80"], ["--api-key", "k"], ["--http", "h"]):
        with pytest.raises(SystemExit) as caught:
            parse_args([*base, *bad])
        assert caught.value.code == 2, bad
    with pytest.raises(ValueError, match="--api-key KEY"):
        check_http("0.0.0.0:8080")
    assert check_http("localhost:0").port == 0 and check_http("[::1]:9").listen == "[::1]:9"


def test_the_front_command_line_round_trips():
    args = HttpFrontArgs(
        listen="[::1]:0",
        jobs_endpoint="ipc:///tmp/x/jobs",
        model_id="tiny",
        ready_file="/tmp/x/http.json",
        server_key="k" * 40,
        api_key_file="/tmp/x/key",
        death_fd=7,
        log_level="DEBUG",
    )
    assert parse_http_front_argv(http_front_argv(args)) == args
    assert split_host_port("127.0.0.1:8080") == ("127.0.0.1", 8080) and split_host_port("[::1]:0") == ("::1", 0)
    for bad in ("8080", ":80", "::1:80", "h:70000", "h:x"):
        with pytest.raises(ValueError):
            split_host_port(bad)
