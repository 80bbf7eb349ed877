"""Wire machinery: msgpack maps with an `op`, decoded into frozen dataclasses.

A message type is a frozen dataclass with a `OP: ClassVar[str]`; its field
annotations are the schema. `decode(frame, registry)` checks everything a peer
could get wrong (not msgpack, not a map, unknown op, missing/unknown field,
wrong type, out-of-range integer, too many items) and raises `ProtocolError`
with a `code` and a message naming the offending value, so the receiver can
answer `{op: "error", code, message}` and keep serving. No pickle anywhere.

Supported field types: int (non-negative unless `wire(minimum=...)`), float,
bool, str, bytes, `X | None`, `tuple[X, ...]`, nested dataclasses (a map without op),
and any type registered with `register_codec` (e.g. compact segment arrays).
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Protocol, TypeVar

import msgpack

# Default ZMQ_MAXMSGSIZE for sockets that receive from other processes.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_ITEMS = 4096
DEFAULT_MAX_STR = 64 * 1024
DEFAULT_MAX_BYTES = 1 << 22

# Error codes of `{op: "error"}` replies.
BAD_FRAME = "bad_frame"  # not msgpack
BAD_MESSAGE = "bad_message"  # not a map with a string op
UNKNOWN_OP = "unknown_op"
BAD_FIELD = "bad_field"  # missing, unknown, wrongly typed or out-of-range field
BAD_REQUEST = "bad_request"  # well-formed, but its values are refused by the receiver
INTERNAL = "internal"

# An error message quotes the peer's offending value, but never all of it: a value of megabytes
# or thousands of levels deep would make a reply the peer cannot read (or a repr that recurses).
MAX_ERROR_CHARS = 2000
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 3, 80, 80, 60
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 8


def shown(value: object) -> str:
    """A bounded repr of a peer's value for an error message (long or deep values elided with ...)."""
    return _SHOWN.repr(value)


class ProtocolError(ValueError):
    """A frame or message a peer sent that this side refuses; `code` is one of the above."""

    def __init__(self, code: str, message: str) -> None:
        if len(message) > MAX_ERROR_CHARS:
            message = message[: MAX_ERROR_CHARS - 15] + " ... (truncated)"
        super().__init__(message)
        self.code = code
        self.message = message


class WireMessage(Protocol):
    OP: ClassVar[str]


M = TypeVar("M")
Registry = Mapping[str, type]


@dataclasses.dataclass(frozen=True, slots=True)
class ErrorReply:
    """The generic answer to a frame that could not be served."""

    OP: ClassVar[str] = "error"
    code: str
    message: str


def wire(
    *,
    default: Any = dataclasses.MISSING,
    minimum: int | None = 0,
    maximum: int | None = None,
    max_items: int = DEFAULT_MAX_ITEMS,
    max_len: int = DEFAULT_MAX_STR,
) -> Any:
    """A dataclass field with wire limits (integer range, item count, string length)."""
    metadata = {"minimum": minimum, "maximum": maximum, "max_items": max_items, "max_len": max_len}
    return dataclasses.field(default=default, metadata=metadata)


_CODECS: dict[type, tuple[Callable[[Any], Any], Callable[[Any, str], Any]]] = {}


def register_codec(kind: type, encode: Callable[[Any], Any], decode: Callable[[Any, str], Any]) -> None:
    """Teach the machinery a value type; `decode(value, where)` raises ProtocolError."""
    _CODECS[kind] = (encode, decode)


def make_registry(*classes: type) -> dict[str, type]:
    """Map each message class's OP to the class, refusing duplicates."""
    registry: dict[str, type] = {}
    for cls in classes:
        op = cls.OP  # type: ignore[attr-defined]
        if op in registry:
            raise ValueError(f"duplicate op {op!r}: {registry[op].__name__} and {cls.__name__}")
        registry[op] = cls
    return registry


def check_int(value: object, where: str, *, minimum: int | None = 0, maximum: int | None = None) -> int:
    """An int (never a bool) within bounds, else ProtocolError naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(BAD_FIELD, f"{where} must be an integer, got {shown(value)}")
    if minimum is not None and value < minimum:
        raise ProtocolError(BAD_FIELD, f"{where} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ProtocolError(BAD_FIELD, f"{where} must be <= {maximum}, got {value}")
    return value


# Decoders and encoders are compiled once per message class from its type
# hints: decoding a frame is then a few dict lookups and isinstance checks per
# field. Paths for error messages ("load.segments[3]") are built only when a
# value is refused.

_Decoder = Callable[[Any, str], Any]
_Encoder = Callable[[Any], Any]


def _identity(value: Any) -> Any:
    return value


def _optional_args(kind: Any, where: str) -> Any:
    options = typing.get_args(kind)
    rest = [option for option in options if option is not type(None)]
    if len(rest) != 1 or len(options) != 2:
        raise TypeError(f"{where}: unions other than X | None are not supported")
    return rest[0]


def _tuple_arg(kind: Any, where: str) -> Any:
    args = typing.get_args(kind)
    if len(args) != 2 or args[1] is not Ellipsis:
        raise TypeError(f"{where}: only tuple[X, ...] is supported")
    return args[0]


def _decoder(kind: Any, meta: Mapping[str, Any], where: str) -> _Decoder:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        inner = _decoder(_optional_args(kind, where), meta, where)
        return lambda value, at: None if value is None else inner(value, at)
    if origin is tuple:
        item = _decoder(_tuple_arg(kind, where), meta, where)
        limit = meta.get("max_items", DEFAULT_MAX_ITEMS)

        def sequence(value: Any, at: str) -> tuple[Any, ...]:
            if not isinstance(value, (list, tuple)):
                raise ProtocolError(BAD_FIELD, f"{at} must be an array, got {shown(value)}")
            if len(value) > limit:
                raise ProtocolError(BAD_FIELD, f"{at} has {len(value)} items; at most {limit} are allowed")
            try:
                return tuple([item(entry, at) for entry in value])
            except ProtocolError:
                for index, entry in enumerate(value):  # again, to name the item that failed
                    item(entry, f"{at}[{index}]")
                raise

        return sequence
    if kind in _CODECS:
        return _CODECS[kind][1]
    if kind is bool:

        def boolean(value: Any, at: str) -> bool:
            if value is True or value is False:
                return value
            raise ProtocolError(BAD_FIELD, f"{at} must be a boolean, got {shown(value)}")

        return boolean
    if kind is int:
        minimum, maximum = meta.get("minimum", 0), meta.get("maximum")
        return lambda value, at: check_int(value, at, minimum=minimum, maximum=maximum)
    if kind is float:

        def number(value: Any, at: str) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ProtocolError(BAD_FIELD, f"{at} must be a finite number, got {shown(value)}")
            return float(value)

        return number
    if kind is bytes or kind is str:
        binary = kind is bytes
        limit = meta.get("max_len", DEFAULT_MAX_BYTES if binary else DEFAULT_MAX_STR)

        def text(value: Any, at: str) -> Any:
            if type(value) is not kind:
                got = type(value).__name__ if binary else shown(value)
                raise ProtocolError(BAD_FIELD, f"{at} must be {'binary' if binary else 'a string'}, got {got}")
            if len(value) > limit:
                unit = "bytes" if binary else "characters"
                raise ProtocolError(BAD_FIELD, f"{at} is {len(value)} {unit}; at most {limit} are allowed")
            return value

        return text
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):

        def nested(value: Any, at: str) -> Any:
            if not isinstance(value, dict):
                raise ProtocolError(BAD_FIELD, f"{at} must be a map, got {shown(value)}")
            return _build(kind, value, at, skip=())

        return nested
    raise TypeError(f"{where}: unsupported wire type {kind!r}")


def _encoder(kind: Any, where: str) -> _Encoder | None:
    """None means the value goes to msgpack as it is."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        inner = _encoder(_optional_args(kind, where), where)
        return None if inner is None else (lambda value: None if value is None else inner(value))
    if origin is tuple:
        item = _encoder(_tuple_arg(kind, where), where)
        return None if item is None else (lambda value: [item(entry) for entry in value])
    if kind in _CODECS:
        return _CODECS[kind][0]
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return lambda value: _fields_map(value)
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class _Schema:
    names: frozenset[str]
    fields: tuple[tuple[str, _Decoder, bool], ...]  # name, decoder, required
    encoders: tuple[tuple[str, _Encoder | None], ...]


_SCHEMAS: dict[type, _Schema] = {}
_PATHS: dict[tuple[type, str], tuple[str, ...]] = {}


def _schema(cls: type) -> _Schema:
    schema = _SCHEMAS.get(cls)
    if schema is None:
        hints = typing.get_type_hints(cls)
        entries = dataclasses.fields(cls)  # type: ignore[arg-type]
        where = cls.__name__
        schema = _SCHEMAS[cls] = _Schema(
            names=frozenset(f.name for f in entries),
            fields=tuple(
                (
                    f.name,
                    _decoder(hints[f.name], f.metadata, f"{where}.{f.name}"),
                    f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                )
                for f in entries
            ),
            encoders=tuple((f.name, _encoder(hints[f.name], f"{where}.{f.name}")) for f in entries),
        )
    return schema


def _fields_map(value: Any) -> dict[str, Any]:
    out = {}
    for name, encoder in _schema(type(value)).encoders:
        field_value = getattr(value, name)
        out[name] = field_value if encoder is None else encoder(field_value)
    return out


def _build(cls: type[M], fields_map: Mapping[str, Any], where: str, *, skip: tuple[str, ...]) -> M:
    schema = _schema(cls)
    paths = _PATHS.get((cls, where))
    if paths is None:
        paths = _PATHS[(cls, where)] = tuple(f"{where}.{name}" for name, _, _ in schema.fields)
    extra = fields_map.keys() - schema.names
    if extra and extra.difference(skip):
        unknown = sorted(str(key) for key in extra.difference(skip))
        raise ProtocolError(BAD_FIELD, f"{where}: unknown field(s) {shown(unknown)}")
    values: dict[str, Any] = {}
    for (name, decoder, required), path in zip(schema.fields, paths):
        if name in fields_map:
            values[name] = decoder(fields_map[name], path)
        elif required:
            raise ProtocolError(BAD_FIELD, f"{where}: missing field {name!r}")
    return cls(**values)


def to_map(message: WireMessage) -> dict[str, Any]:
    """The msgpack-ready map of a message, `op` first."""
    return {"op": message.OP, **_fields_map(message)}


def encode(message: WireMessage) -> bytes:
    """One frame for one message."""
    return msgpack.packb(to_map(message), use_bin_type=True)


def unpack_map(frame: bytes) -> dict[str, Any]:
    """A frame as a map with a string `op`, or ProtocolError (bad_frame / bad_message)."""
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True)
    except Exception as error:  # msgpack raises many types for garbage input
        reason = f"{type(error).__name__}: {error}"
        raise ProtocolError(BAD_FRAME, f"frame of {len(frame)} bytes is not msgpack: {reason}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(BAD_MESSAGE, f"message must be a map, got {type(obj).__name__}")
    op = obj.get("op")
    if not isinstance(op, str):
        raise ProtocolError(BAD_MESSAGE, f"message must have a string 'op', got {shown(op)}")
    return obj


def decode(frame: bytes, registry: Registry) -> Any:
    """Decode and validate one frame against the ops this receiver accepts."""
    obj = unpack_map(frame)
    op = obj["op"]
    cls = registry.get(op)
    if cls is None:
        raise ProtocolError(UNKNOWN_OP, f"unknown op {shown(op)}; expected one of {sorted(registry)}")
    return _build(cls, obj, op, skip=("op",))


def error_frame(code: str, message: str) -> bytes:
    """An encoded `{op: "error", code, message}`."""
    return encode(ErrorReply(code=code, message=message))


__all__ = [
    "BAD_FIELD",
    "BAD_FRAME",
    "BAD_MESSAGE",
    "BAD_REQUEST",
    "INTERNAL",
    "MAX_ERROR_CHARS",
    "MAX_MESSAGE_BYTES",
    "UNKNOWN_OP",
    "ErrorReply",
    "ProtocolError",
    "Registry",
    "WireMessage",
    "check_int",
    "decode",
    "encode",
    "error_frame",
    "make_registry",
    "register_codec",
    "shown",
    "to_map",
    "unpack_map",
    "wire",
]
