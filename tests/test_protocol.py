"""The msgpack wire machinery, the I/O worker messages and the GPU worker's predictions."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared import protocol
from shared.gpu_messages import COORDINATOR_ACCEPTS_FROM_GPU, MAX_PREFETCH, Prefetch, RouteMatrix, Routes
from shared.io_messages import (
    MAX_SEGMENTS,
    WORKER_COMMANDS,
    WORKER_REPLIES,
    Cancel,
    Hello,
    Hint,
    HintStatus,
    Load,
    Loaded,
    Ready,
    Shutdown,
    TelemetryRequest,
    Welcome,
    WorkerTelemetry,
)
from shared.protocol import ErrorReply, ProtocolError, decode, encode, make_registry, wire
from shared.segments import ExpertIOHintSegment, ExpertIOSegment

COMMANDS = [
    Welcome(index=1),
    Load(slot=3, generation=9, segments=(ExpertIOSegment(0, 5, 10, 5), ExpertIOSegment(2, 2**40, 7, 4096))),
    Cancel(slot=3, generation=9),
    Hint(segments=(ExpertIOHintSegment(1, 0, 4096),)),
    TelemetryRequest(),
    Shutdown(),
]
REPLIES = [
    Hello(index=0, pid=1234),
    Ready(index=0, pid=1234, block_size=4096, modes=("direct", "dontneed")),
    Loaded(slot=1, generation=2, ok=True, bytes=100, service_ms=1.5, queued_ms=0.25),
    Loaded(slot=1, generation=2, ok=False, error="short read", code="short_read", file=0, offset=77),
    HintStatus(submitted=3, completed=2, dropped=1, operations=5, bytes=4096),
    WorkerTelemetry(index=1, pid=2, loads=4, service_ms=3.0, hints=HintStatus(dropped=7)),
    ErrorReply(code="bad_frame", message="nope"),
]


@pytest.mark.parametrize("message", COMMANDS, ids=lambda m: m.OP)
def test_commands_round_trip(message):
    assert decode(encode(message), WORKER_COMMANDS) == message


@pytest.mark.parametrize("message", REPLIES, ids=lambda m: m.OP)
def test_replies_round_trip(message):
    assert decode(encode(message), WORKER_REPLIES) == message


def test_segments_travel_as_compact_arrays():
    raw = msgpack.unpackb(encode(COMMANDS[1]))
    assert raw == {"op": "load", "slot": 3, "generation": 9, "segments": [[0, 5, 10, 5], [2, 2**40, 7, 4096]]}


def _frame(**fields) -> bytes:
    return msgpack.packb(fields)


@pytest.mark.parametrize(
    ("frame", "code", "fragment"),
    [
        (b"\xc1", "bad_frame", "not msgpack"),
        (msgpack.packb({"op": "load"}) + b"\x00", "bad_frame", "not msgpack"),
        (msgpack.packb([1, 2]), "bad_message", "must be a map"),
        (msgpack.packb({"slot": 1}), "bad_message", "string 'op'"),
        (msgpack.packb({"op": 5}), "bad_message", "string 'op'"),
        (_frame(op="explode"), "unknown_op", "'explode'"),
        (_frame(op="cancel", slot=1), "bad_field", "missing field 'generation'"),
        (_frame(op="cancel", slot=1, generation=2, extra=3), "bad_field", "unknown field(s) ['extra']"),
        (_frame(op="cancel", slot=-1, generation=2), "bad_field", "cancel.slot must be >= 0, got -1"),
        (_frame(op="cancel", slot=True, generation=2), "bad_field", "must be an integer, got True"),
        (_frame(op="cancel", slot="1", generation=2), "bad_field", "must be an integer, got '1'"),
        (_frame(op="load", slot=1, generation=2, segments=[[1, 2, 3]]), "bad_field", "segments[0]"),
        (_frame(op="load", slot=1, generation=2, segments=[[1, 2, 3, 4.5]]), "bad_field", "segments[0]"),
        (_frame(op="load", slot=1, generation=2, segments={"a": 1}), "bad_field", "must be an array"),
        (_frame(op="load", slot=1, generation=2, segments=[[0, 0, 1, 0]] * (MAX_SEGMENTS + 1)), "bad_field", "at most"),
        (_frame(op="hint", segments=[[0, 0]]), "bad_field", "segments[0]"),
    ],
)
def test_bad_frames_are_refused_with_a_code(frame, code, fragment):
    with pytest.raises(ProtocolError) as caught:
        decode(frame, WORKER_COMMANDS)
    assert caught.value.code == code
    assert fragment in caught.value.message


def test_segment_values_are_left_to_the_receiver():
    # A negative length is well-formed on the wire; the worker refuses it naming the value.
    load = decode(_frame(op="load", slot=1, generation=2, segments=[[0, 0, -5, 0]]), WORKER_COMMANDS)
    assert load.segments[0].length == -5


def test_reply_field_types_are_checked():
    for fields, fragment in (
        (dict(op="loaded", slot=1, generation=2, ok=1), "must be a boolean"),
        (dict(op="loaded", slot=1, generation=2, ok=True, service_ms=math.nan), "finite number"),
        (dict(op="loaded", slot=1, generation=2, ok=True, error=3), "must be a string"),
        (dict(op="telemetry", index=0, pid=1, hints=[1]), "must be a map"),
        (dict(op="telemetry", index=0, pid=1, hints={"nope": 1}), "unknown field"),
        (dict(op="ready", index=0, pid=1, block_size=4096, modes="direct"), "must be an array"),
    ):
        with pytest.raises(ProtocolError, match=fragment):
            decode(msgpack.packb(fields), WORKER_REPLIES)


def test_commands_are_not_replies():
    with pytest.raises(ProtocolError) as caught:
        decode(encode(Loaded(slot=1, generation=1, ok=True)), WORKER_COMMANDS)
    assert caught.value.code == "unknown_op"


def test_error_frame_and_registry_machinery():
    reply = decode(protocol.error_frame("bad_field", "x is wrong"), WORKER_REPLIES)
    assert reply == ErrorReply(code="bad_field", message="x is wrong")

    @dataclass(frozen=True, slots=True)
    class Ping:
        OP: ClassVar[str] = "ping"
        count: int = wire(default=0, minimum=-3, maximum=3)
        tags: tuple[str, ...] = wire(default=(), max_items=2, max_len=4)

    registry = make_registry(Ping)
    assert decode(encode(Ping(count=-3, tags=("ab",))), registry) == Ping(count=-3, tags=("ab",))
    assert decode(_frame(op="ping"), registry) == Ping()
    for fields, fragment in (
        (dict(count=4), "<= 3"),
        (dict(count=-4), ">= -3"),
        (dict(tags=["a"] * 3), "at most 2"),
        (dict(tags=["abcde"]), "at most 4"),
    ):
        with pytest.raises(ProtocolError, match=fragment):
            decode(_frame(op="ping", **fields), registry)
    with pytest.raises(ValueError, match="duplicate op"):
        make_registry(Ping, Ping)


segments = st.lists(st.builds(ExpertIOSegment, *(st.integers(-(2**62), 2**62) for _ in range(4))), max_size=20).map(
    tuple
)


@given(slot=st.integers(0, 2**31), generation=st.integers(0, 2**63), segments=segments)
def test_any_load_round_trips(slot, generation, segments):
    message = Load(slot=slot, generation=generation, segments=segments)
    assert decode(encode(message), WORKER_COMMANDS) == message


@given(st.binary(max_size=64))
def test_garbage_never_escapes_as_another_exception(data):
    try:
        decode(data, WORKER_COMMANDS)
    except ProtocolError:
        pass


def test_predictions_travel_with_routes_and_as_prefetch_messages():
    """The GPU worker's predictions: on `routes` (prefetch_layer + prefetch) and as `prefetch`."""
    message = Prefetch(layer=3, experts=(7, 1, 4))
    assert decode(encode(message), COORDINATOR_ACCEPTS_FROM_GPU) == message
    assert msgpack.unpackb(encode(message)) == {"op": "prefetch", "layer": 3, "experts": [7, 1, 4]}
    routes = Routes(layer=2, routes=RouteMatrix(np.array([[1, 5]], dtype=np.int32)), prefetch_layer=3, prefetch=(4, 0))
    back = decode(encode(routes), COORDINATOR_ACCEPTS_FROM_GPU)
    assert (back.layer, back.prefetch_layer, back.prefetch) == (2, 3, (4, 0))
    assert np.array_equal(back.routes.array, routes.routes.array)
    for frame, fragment in (
        (_frame(op="prefetch", layer=3, experts=[1, "2"]), "must be an integer, got '2'"),
        (_frame(op="prefetch", layer=-1, experts=[1]), "prefetch.layer must be >= 0, got -1"),
        (_frame(op="prefetch", layer=3, experts=list(range(MAX_PREFETCH + 1))), "at most"),
        (_frame(op="prefetch", experts=[1]), "missing field 'layer'"),
    ):
        with pytest.raises(ProtocolError) as caught:
            decode(frame, COORDINATOR_ACCEPTS_FROM_GPU)
        assert caught.value.code == "bad_field" and fragment in caught.value.message, caught.value.message
