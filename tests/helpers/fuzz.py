"""Hypothesis strategies of bad frames for the system's sockets (tests/test_fuzz_sockets.py).

- `msgpack_values`: any msgpack value (nil, bools, ints at and past the wire's ranges, floats with
  NaN and infinities, strings, binaries, ext types, arrays, maps with str, binary or int keys).
- `message_maps(classes)`: a map with a valid `op` of one of `classes` whose fields are derived from
  the message dataclass: each present or missing, mostly of the right type (with out-of-range and
  boundary values), sometimes any msgpack value, sometimes an unknown field beside them.
- `near_valid(bases)`: a valid message's map, as it is or with one field replaced (by a value of its
  type, perhaps out of range, or by any msgpack value) or removed; `unknown_ops()`: maps whose op
  is any string.
- `raw_frames(classes)`: what no encoder makes: garbage bytes, truncated messages, invalid UTF-8 in
  a str header (as the op, a key or a field value), headers that claim 4 Gi items, nesting far
  beyond msgpack's own depth limit (alone and as a field's value).
- `messages(classes, bases)`: one multipart message to send: usually one frame (any of the above),
  sometimes zero-length frames or extra frames.
"""

from __future__ import annotations

import dataclasses
import types
import typing

import msgpack
from hypothesis import strategies as st

from shared.gpu_messages import RouteMatrix
from shared.protocol import to_map
from shared.segments import ExpertIOHintSegment, ExpertIOSegment

MIN_INT, MAX_INT = -(2**63), 2**64 - 1  # what msgpack can carry; a wider int cannot be sent at all
BOUNDARY_INTS = (0, 1, -1, 255, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, MAX_INT, MIN_INT)
DEPTHS = (64, 511, 1023, 1024, 1025, 4096, 10_000, 100_000)

ints = st.one_of(st.integers(0, 16), st.sampled_from(BOUNDARY_INTS), st.integers(MIN_INT, MAX_INT))
floats = st.floats(allow_nan=True, allow_infinity=True)
texts = st.text(max_size=24)
binaries = st.binary(max_size=48)
exts = st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=16))  # negative codes: raw_frames
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts, binaries, exts)
keys = st.one_of(texts, st.binary(max_size=8), st.integers(-4, 4))

msgpack_values = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=6), st.dictionaries(keys, children, max_size=6)),
    max_leaves=24,
)


def _typed(kind: typing.Any) -> st.SearchStrategy:
    """Values of a wire type as its decoder expects them (ranges unchecked: that is the point)."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [arg for arg in typing.get_args(kind) if arg is not type(None)]
        return st.one_of(st.none(), _typed(inner))
    if origin is tuple:
        return st.lists(_typed(typing.get_args(kind)[0]), max_size=6)
    if kind is bool:
        return st.booleans()
    if kind is int:
        return ints
    if kind is float:
        return floats
    if kind is str:
        return texts
    if kind is bytes:
        return binaries
    if kind is RouteMatrix:  # [rows, top_k, int32 bytes], the sizes agreeing or not
        return st.one_of(
            st.tuples(st.integers(1, 3), st.integers(1, 3)).flatmap(
                lambda shape: st.tuples(
                    st.just(shape[0]), st.just(shape[1]), st.binary(min_size=shape[0] * shape[1] * 4, max_size=48)
                ).map(list)
            ),
            st.lists(st.one_of(ints, binaries), max_size=4),
        )
    if kind is ExpertIOSegment:
        return st.lists(ints, min_size=3, max_size=5)
    if kind is ExpertIOHintSegment:
        return st.lists(ints, min_size=2, max_size=4)
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return _fields(kind)
    return msgpack_values


def _fields(cls: type) -> st.SearchStrategy:
    hints = typing.get_type_hints(cls)
    optional = {
        f.name: st.one_of(_typed(hints[f.name]), _typed(hints[f.name]), msgpack_values)
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
    }
    return st.fixed_dictionaries({}, optional=optional)


def message_maps(classes: typing.Sequence[type]) -> st.SearchStrategy:
    """A map with a valid op of one of `classes` and fields derived from its dataclass."""

    def one(cls: type) -> st.SearchStrategy:
        extra = st.dictionaries(texts, msgpack_values, max_size=2)
        return st.tuples(_fields(cls), extra, st.booleans()).map(
            lambda parts: {**(parts[1] if parts[2] else {}), **parts[0], "op": cls.OP}  # type: ignore[attr-defined]
        )

    return st.one_of([one(cls) for cls in classes])


def near_valid(bases: typing.Sequence[object]) -> st.SearchStrategy:
    """A valid message's map (one of `bases`) as it is, or with one field replaced by a value of
    its type (out of range, perhaps), by any msgpack value, or removed."""

    def mutate(base: object) -> st.SearchStrategy:
        fields = to_map(base)  # type: ignore[arg-type]
        hints = typing.get_type_hints(type(base))
        names = [name for name in fields if name != "op"]
        if not names:
            return st.just(fields)

        def change(name: str) -> st.SearchStrategy:
            value = st.one_of(_typed(hints[name]), msgpack_values, st.just(_REMOVE))
            return value.map(
                lambda new: (
                    {k: v for k, v in fields.items() if k != name or new is not _REMOVE}
                    | ({} if new is _REMOVE else {name: new})
                )
            )

        return st.one_of(st.just(fields), st.sampled_from(names).flatmap(change))

    return st.one_of([mutate(base) for base in bases])


_REMOVE = object()


def unknown_ops() -> st.SearchStrategy:
    return st.fixed_dictionaries({"op": texts}, optional={"id": texts, "x": msgpack_values})


def pack(value: object) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _deep(kind: str, depth: int) -> bytes:
    if kind == "array":
        return b"\x91" * depth + b"\xc0"  # [[[...nil...]]]
    return b"\x81\xa1k" * depth + b"\xc0"  # {"k": {"k": ...nil}}


def _with_field(op: str, name: str, raw_value: bytes) -> bytes:
    """A map {op, id, name: <raw bytes>}: a hand-made value inside an otherwise plausible message."""
    return b"\x83" + pack("op") + pack(op) + pack("id") + pack("fuzz") + pack(name) + raw_value


def _field_names(classes: typing.Sequence[type]) -> list[tuple[str, str]]:
    return [(cls.OP, f.name) for cls in classes for f in dataclasses.fields(cls)] or [  # type: ignore[attr-defined]
        (cls.OP, "id")
        for cls in classes  # type: ignore[attr-defined]
    ]


INVALID_UTF8 = (b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"a\x80b")
HUGE_HEADERS = (
    b"\xdd\xff\xff\xff\xff",  # array32 of 4 Gi items
    b"\xdf\xff\xff\xff\xff",  # map32
    b"\xdb\xff\xff\xff\xff",  # str32
    b"\xc6\xff\xff\xff\xff",  # bin32
    b"\xc9\xff\xff\xff\xff\x05",  # ext32
    b"\xcf",  # a uint64 with no bytes
    b"\xd6\xff\x00\x00\x00\x01",  # a timestamp (ext -1): decodes to a Timestamp, not a wire type
    b"\xc7\x03\xff\x00\x00\x01",  # a timestamp of a length msgpack refuses
    b"\xd4\x80\x00",  # ext -128, reserved
)


def _str_header(payload: bytes) -> bytes:
    return bytes([0xA0 | len(payload)]) + payload


def raw_frames(classes: typing.Sequence[type]) -> st.SearchStrategy:
    ops = [cls.OP for cls in classes]  # type: ignore[attr-defined]
    fields = _field_names(classes)
    invalid = st.sampled_from(INVALID_UTF8).map(_str_header)
    return st.one_of(
        st.binary(max_size=64),
        st.sampled_from(HUGE_HEADERS),
        st.tuples(message_maps(classes).map(pack), st.floats(0, 1)).map(lambda t: t[0][: int(len(t[0]) * t[1])]),
        invalid.map(lambda bad: b"\x81" + pack("op") + bad),  # the op
        invalid.map(lambda bad: b"\x82" + pack("op") + pack(ops[0]) + bad + b"\xc0"),  # a key
        st.tuples(st.sampled_from(fields), invalid).map(lambda t: _with_field(t[0][0], t[0][1], t[1])),  # a value
        st.tuples(st.sampled_from(("array", "map")), st.sampled_from(DEPTHS)).map(lambda t: _deep(*t)),
        st.tuples(st.sampled_from(fields), st.sampled_from(("array", "map")), st.sampled_from(DEPTHS)).map(
            lambda t: _with_field(t[0][0], t[0][1], _deep(t[1], t[2]))
        ),
    )


def frames(classes: typing.Sequence[type], bases: typing.Sequence[object]) -> st.SearchStrategy:
    """One frame: a packed message map (near a valid one, or derived from its class, or of an
    unknown op) or value, or a raw frame."""
    return st.one_of(
        near_valid(bases).map(pack),
        near_valid(bases).map(pack),
        message_maps(classes).map(pack),
        unknown_ops().map(pack),
        msgpack_values.map(pack),
        raw_frames(classes),
    )


def messages(classes: typing.Sequence[type], bases: typing.Sequence[object]) -> st.SearchStrategy:
    """One multipart message of `classes` (`bases`: a valid message of each, or of some, to start
    mutations from): mostly one frame; sometimes an empty frame, or extra frames."""
    one = frames(classes, bases)
    return st.one_of(
        one.map(lambda frame: [frame]),
        one.map(lambda frame: [frame]),
        one.map(lambda frame: [frame]),
        st.just([b""]),
        st.lists(st.one_of(one, st.just(b"")), min_size=2, max_size=3),
    )


__all__ = ["message_maps", "messages", "msgpack_values", "near_valid", "pack", "raw_frames", "unknown_ops"]
