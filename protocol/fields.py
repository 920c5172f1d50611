"""The strict msgpack form every control message shares: the field rules and the codec.

Every rule lives next to its field as ``Annotated[type, Rule]`` (protocol/messages.py), so the
encoder and the decoder apply the same checks: a message's map carries exactly the declared
fields, every value has the declared type and lies inside its bounds, floats are finite,
``bool`` is never accepted as an ``int``, and nothing may follow the map.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Final, TypeVar

import msgpack

from .errors import DecodeError, EncodeError, ProtocolError
from .modelspec import ModelSpec

MAX_MESSAGE_BYTES: Final = 1 << 20
MAX_TEXT: Final = 256
MAX_LIST: Final = 4096
MAX_MAP: Final = 64
MAX_DEPTH: Final = 8
MAX_INT: Final = (1 << 63) - 1
MAX_CHECKPOINTS: Final = 40  # a Commitment's hashes; keeps the update header under 8 KiB

ID_RE: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")
BLOB_ID_RE: Final = re.compile(r"[0-9a-f]{64}")
METRIC_KEY_RE: Final = re.compile(r"[A-Za-z0-9_.:/-]{1,64}")
ISA_FLAG_RE: Final = re.compile(r"[a-z0-9_]{1,32}")
#: the precisions a job may ask for and a node may train in ("auto" resolves per device: protocol/compute.py)
PRECISIONS: Final = ("fp32", "tf32", "bf16", "fp16")

_UNPACK_LIMITS: Final[dict[str, int]] = {
    "max_str_len": 4 * MAX_TEXT * 4,  # bytes; per-field char limits are checked afterwards
    "max_bin_len": 1024,
    "max_array_len": MAX_LIST,
    "max_map_len": MAX_MAP,
    "max_ext_len": 0,
}


class _Fail(Exception):
    """Internal: a rule failed; carries the text, the caller adds where and direction."""


def _describe(value: object) -> str:
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"


# ---------------------------------------------------------------------------
# Field rules. Each rule turns a wire value into the Python value (decode) and a
# Python value into a wire value (encode), raising _Fail with a short reason.


class Rule:
    def decode(self, value: object) -> object:
        raise NotImplementedError

    def encode(self, value: object) -> object:
        return self.decode(value)


class Text(Rule):
    def __init__(
        self,
        max_len: int = MAX_TEXT,
        *,
        pattern: re.Pattern[str] | None = None,
        choices: tuple[str, ...] = (),
        allow_empty_pattern: bool = False,
    ) -> None:
        self.max_len = max_len
        self.pattern = pattern
        self.choices = choices
        self.allow_empty_pattern = allow_empty_pattern

    def decode(self, value: object) -> str:
        if not isinstance(value, str):
            raise _Fail(f"expected a string, got {_describe(value)}")
        if len(value) > self.max_len:
            raise _Fail(f"string longer than {self.max_len} characters")
        if self.choices and value not in self.choices:
            raise _Fail(f"expected one of {', '.join(self.choices)}, got {value[:40]!r}")
        if self.pattern is not None and not (self.allow_empty_pattern and value == ""):
            if self.pattern.fullmatch(value) is None:
                raise _Fail(f"{value[:40]!r} does not match {self.pattern.pattern}")
        return value


class Int(Rule):
    def __init__(self, lo: int = 0, hi: int = MAX_INT) -> None:
        self.lo = lo
        self.hi = hi

    def decode(self, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Fail(f"expected an integer, got {_describe(value)}")
        if not self.lo <= value <= self.hi:
            raise _Fail(f"integer {value} outside {self.lo}..{self.hi}")
        return value


class Float(Rule):
    def __init__(self, lo: float = 0.0, hi: float = 1e300, *, optional: bool = False) -> None:
        self.lo = lo
        self.hi = hi
        self.optional = optional

    def decode(self, value: object) -> float | None:
        if value is None and self.optional:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            kind = "a float or nil" if self.optional else "a float"
            raise _Fail(f"expected {kind}, got {_describe(value)}")
        result = float(value)
        if not math.isfinite(result):
            raise _Fail(f"expected a finite float, got {result}")
        if not self.lo <= result <= self.hi:
            raise _Fail(f"{result} outside {self.lo}..{self.hi}")
        return result


class Bool(Rule):
    def decode(self, value: object) -> bool:
        if not isinstance(value, bool):
            raise _Fail(f"expected true or false, got {_describe(value)}")
        return value


class Blob(Rule):
    """Bytes of an exact length."""

    def __init__(self, size: int) -> None:
        self.size = size

    def decode(self, value: object) -> bytes:
        if not isinstance(value, bytes):
            raise _Fail(f"expected {self.size} bytes, got {_describe(value)}")
        if len(value) != self.size:
            raise _Fail(f"expected {self.size} bytes, got {len(value)}")
        return value


class Bytes(Rule):
    """Bytes of at most ``max_len`` (at least ``min_len``)."""

    def __init__(self, max_len: int, min_len: int = 0) -> None:
        self.max_len = max_len
        self.min_len = min_len

    def decode(self, value: object) -> bytes:
        if not isinstance(value, bytes):
            raise _Fail(f"expected bytes, got {_describe(value)}")
        if not self.min_len <= len(value) <= self.max_len:
            raise _Fail(f"expected {self.min_len}..{self.max_len} bytes, got {len(value)}")
        return value


class Seq(Rule):
    def __init__(self, item: Rule, max_len: int = MAX_LIST) -> None:
        self.item = item
        self.max_len = max_len

    def _walk(self, value: object, encode: bool) -> tuple[object, ...] | list[object]:
        if not isinstance(value, (list, tuple)):
            raise _Fail(f"expected a list, got {_describe(value)}")
        if len(value) > self.max_len:
            raise _Fail(f"list longer than {self.max_len} items")
        out: list[object] = []
        for index, item in enumerate(value):
            try:
                out.append(self.item.encode(item) if encode else self.item.decode(item))
            except _Fail as exc:
                raise _Fail(f"[{index}]: {exc}") from None
        return out if encode else tuple(out)

    def decode(self, value: object) -> tuple[object, ...] | list[object]:
        return self._walk(value, encode=False)

    def encode(self, value: object) -> tuple[object, ...] | list[object]:
        return self._walk(value, encode=True)


class FloatMap(Rule):
    """``dict[str, float]`` with bounded size, key charset and required keys."""

    def __init__(self, max_keys: int = 32, *, required: tuple[str, ...] = ()) -> None:
        self.max_keys = max_keys
        self.required = required

    def decode(self, value: object) -> dict[str, float]:
        if not isinstance(value, dict):
            raise _Fail(f"expected a map of name to float, got {_describe(value)}")
        if len(value) > self.max_keys:
            raise _Fail(f"more than {self.max_keys} entries")
        out: dict[str, float] = {}
        for key, item in value.items():
            if not isinstance(key, str) or METRIC_KEY_RE.fullmatch(key) is None:
                raise _Fail(f"key {key!r:.40} does not match {METRIC_KEY_RE.pattern}")
            if isinstance(item, bool) or not isinstance(item, (int, float)):
                raise _Fail(f"[{key!r}]: expected a float, got {_describe(item)}")
            number = float(item)
            if not math.isfinite(number):
                raise _Fail(f"[{key!r}]: expected a finite float, got {number}")
            out[key] = number
        for key in self.required:
            if key not in out:
                raise _Fail(f"required key {key!r} is missing")
        return out


def _check_plain(value: object, depth: int) -> None:
    """A free-form msgpack value: str/int/float/bool/nil/list/map only, bounded depth."""
    if depth > MAX_DEPTH:
        raise _Fail(f"nested deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _Fail(f"expected a finite float, got {value}")
        return
    if isinstance(value, (list, tuple)):
        for item in value:
            _check_plain(item, depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise _Fail(f"map key {key!r:.40} is not a string")
            _check_plain(item, depth + 1)
        return
    raise _Fail(f"unsupported value {_describe(value)}")


class ModelSpecDict(Rule):
    """A ``ModelSpec.to_dict()``; validated with ``ModelSpec.from_dict``."""

    def decode(self, value: object) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise _Fail(f"expected a model spec map, got {_describe(value)}")
        _check_plain(value, 1)
        try:
            ModelSpec.from_dict(value)
        except ProtocolError as exc:
            raise _Fail(str(exc)) from None
        return value

    def encode(self, value: object) -> dict[str, Any]:
        if isinstance(value, ModelSpec):
            return value.to_dict()
        if isinstance(value, Mapping):
            return self.decode(dict(value))
        raise _Fail(f"expected a model spec map, got {_describe(value)}")


class Nested(Rule):
    def __init__(self, cls: type[Any], *, optional: bool = False) -> None:
        self.cls = cls
        self.optional = optional

    def decode(self, value: object) -> object:
        if value is None and self.optional:
            return None
        if not isinstance(value, dict):
            name = self.cls.__name__
            raise _Fail(f"expected {'an' if name[:1] in 'AEIOU' else 'a'} {name} map, got {_describe(value)}")
        return _from_wire(self.cls, value)

    def encode(self, value: object) -> dict[str, object] | None:
        if value is None and self.optional:
            return None
        if not isinstance(value, self.cls):
            raise _Fail(f"expected {self.cls.__name__}, got {_describe(value)}")
        return _to_wire(value)


# Shorthands used in the field declarations below.
IdStr = Annotated[str, Text(64, pattern=ID_RE)]
BlobIdStr = Annotated[str, Text(64, pattern=BLOB_ID_RE)]
ShortText = Annotated[str, Text()]
Timestamp = Annotated[float, Float(0.0, 1e11)]
Nonce = Annotated[bytes, Blob(16)]
Count = Annotated[int, Int()]
NonNegFloat = Annotated[float, Float()]
OptFloat = Annotated[float | None, Float(optional=True)]


M = TypeVar("M")


# ---------------------------------------------------------------------------
# Schema plumbing.

_SCHEMAS: dict[type[Any], tuple[tuple[str, Rule], ...]] = {}
_OPTIONAL: dict[type[Any], dict[str, object]] = {}  # message type -> its fields with a default


def _schema(cls: type[Any]) -> tuple[tuple[str, Rule], ...]:
    cached = _SCHEMAS.get(cls)
    if cached is not None:
        return cached
    hints = typing.get_type_hints(cls, include_extras=True)
    fields: list[tuple[str, Rule]] = []
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        rules = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Rule)]
        if len(rules) != 1:
            raise TypeError(f"{cls.__name__}.{field.name} needs exactly one Rule annotation")
        fields.append((field.name, rules[0]))
    result = tuple(fields)
    _SCHEMAS[cls] = result
    return result


def _from_wire(cls: type[M], data: Mapping[object, object]) -> M:
    schema = _schema(cls)
    names = {name for name, _ in schema}
    for key in data:
        if key not in names and key not in ("v", "kind"):
            raise _Fail(f"unknown field {key!r:.40} in {cls.__name__}")
    values: dict[str, object] = {}
    optional = _optional(cls)
    for name, rule in schema:
        if name not in data:
            if name in optional:  # a later addition with a default: absent means the default
                continue
            raise _Fail(f"missing field {name!r} in {cls.__name__}")
        try:
            values[name] = rule.decode(data[name])
        except _Fail as exc:
            raise _Fail(f"{name}: {exc}") from None
    return cls(**values)


def _optional(cls: type[Any]) -> dict[str, object]:
    """Fields added after a message type first shipped carry a default: a peer that does not know
    them leaves them out, and a sender leaves them out while they hold the default, so old and
    new peers of one protocol version understand each other."""
    found = _OPTIONAL.get(cls)
    if found is None:
        found = _OPTIONAL[cls] = {f.name: f.default for f in dataclasses.fields(cls)
                                  if f.default is not dataclasses.MISSING}
    return found


def _to_wire(msg: object) -> dict[str, object]:
    out: dict[str, object] = {}
    optional = _optional(type(msg))
    for name, rule in _schema(type(msg)):
        if name in optional and getattr(msg, name) == optional[name]:
            continue
        try:
            out[name] = rule.encode(getattr(msg, name))
        except _Fail as exc:
            raise _Fail(f"{name}: {exc}") from None
    return out


def _unpack(data: object, what: str, limits: Mapping[str, int], max_bytes: int) -> object:
    """msgpack-decode ``data`` with hard limits; any failure becomes DecodeError."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"{what}: expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise DecodeError(f"{what}: {len(data)} bytes exceeds the {max_bytes}-byte limit")
    if len(data) == 0:
        raise DecodeError(f"{what}: empty input")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            timestamp=0,
            **limits,
        )
    except msgpack.ExtraData:
        raise DecodeError(f"{what}: trailing bytes after the msgpack value") from None
    except (ValueError, TypeError, RecursionError, OverflowError, MemoryError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DecodeError(f"{what}: malformed msgpack ({reason[:80]})") from None
    except Exception as exc:  # msgpack's C unpacker may raise other types on garbage
        raise DecodeError(f"{what}: malformed msgpack ({type(exc).__name__})") from None


def unpack_strict(data: object, what: str = "message", *, max_bytes: int = MAX_MESSAGE_BYTES,
                  max_bin_len: int = 1024) -> object:
    """Strictly decode one msgpack value (helper shared with ``signing``)."""
    limits = dict(_UNPACK_LIMITS)
    limits["max_bin_len"] = max_bin_len
    return _unpack(data, what, limits, max_bytes)


# ---------------------------------------------------------------------------
# Public API.


def nested_to_dict(value: object) -> dict[str, object]:
    """A nested message part (e.g. ComputeClass) as its checked plain map (to store it as JSON)."""
    try:
        return _to_wire(value)
    except _Fail as exc:
        raise EncodeError(f"{type(value).__name__}.{exc}") from None


def nested_from_dict(cls: type[M], data: object) -> M:
    """The inverse of ``nested_to_dict``, with the decoder's checks (lists are taken for tuples)."""
    if not isinstance(data, dict):
        raise DecodeError(f"{cls.__name__}: expected a map, got {type(data).__name__}")
    try:
        return _from_wire(cls, data)
    except _Fail as exc:
        raise DecodeError(f"{cls.__name__}.{exc}") from None
