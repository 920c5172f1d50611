"""The sequential kind's layer whitelist, and the argument reading every model kind shares.

A layer is a type name from :data:`LAYERS` and keyword arguments, each parsed (type, range)
by the table's parser; :func:`layer_shape` mirrors torch's shape rules for those layers, so a
spec is checked without running a forward pass. Errors are one-line :class:`SpecError` naming
``where.key`` and what is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from .errors import SpecError

if TYPE_CHECKING:  # torch is imported where a module is built, not on import (CLI start-up)
    from torch import nn

MAX_WIDTH: Final = 1 << 20

ArgValue = int | float | bool | str | tuple[int, ...]


@dataclass(frozen=True)
class LayerSpec:
    """One whitelisted layer: its type name and validated keyword arguments."""

    type: str
    args: tuple[tuple[str, ArgValue], ...] = ()

    def kwargs(self) -> dict[str, ArgValue]:
        return dict(self.args)


# ---------------------------------------------------------------------------
# Argument reading.


class Reader:
    """Reads keys of one table, recording which were used so leftovers are refused."""

    def __init__(self, d: Mapping[str, Any], where: str, ignore: Sequence[str] = ("kind",)) -> None:
        self.d = d
        self.where = where
        self.used: set[str] = set(ignore)

    def _get(self, key: str, default: object) -> object:
        self.used.add(key)
        if key in self.d:
            return self.d[key]
        if default is REQUIRED:
            raise SpecError(f"{self.where}.{key}: required")
        return default

    def get_int(self, key: str, lo: int, hi: int, default: object = None) -> int:
        value = self._get(key, REQUIRED if default is None else default)
        return as_int(value, f"{self.where}.{key}", lo, hi)

    def get_float(self, key: str, lo: float, hi: float, default: object = None) -> float:
        value = self._get(key, REQUIRED if default is None else default)
        return as_float(value, f"{self.where}.{key}", lo, hi)

    def get_choice(self, key: str, allowed: Sequence[str], default: object = None) -> str:
        value = self._get(key, REQUIRED if default is None else default)
        return as_choice(value, f"{self.where}.{key}", allowed)

    def get_bool(self, key: str, default: object = None) -> bool:
        value = self._get(key, REQUIRED if default is None else default)
        return as_bool(value, f"{self.where}.{key}")

    def get_list(self, key: str, *, min_len: int = 0, max_len: int) -> list[object]:
        value = self._get(key, REQUIRED)
        if not isinstance(value, (list, tuple)) or not min_len <= len(value) <= max_len:
            raise SpecError(
                f"{self.where}.{key}: expected a list of {min_len}..{max_len} entries, got {short(value)}"
            )
        return list(value)

    def get_int_list(
        self,
        key: str,
        lo: int,
        hi: int,
        *,
        default: object = None,
        min_len: int = 0,
        max_len: int = 32,
    ) -> tuple[int, ...]:
        value = self._get(key, REQUIRED if default is None else default)
        return as_int_list(value, f"{self.where}.{key}", lo, hi, min_len, max_len)

    def finish(self) -> None:
        for key in self.d:
            if key not in self.used:
                allowed = ", ".join(sorted(k for k in self.used))
                raise SpecError(f"{self.where}.{short(key)}: unknown key; allowed: {allowed}")


REQUIRED: Final = object()


def short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def as_int(value: object, where: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{where}: expected an integer {lo}..{hi}, got {short(value)}")
    if not lo <= value <= hi:
        raise SpecError(f"{where}: expected an integer {lo}..{hi}, got {value}")
    return value


def as_float(value: object, where: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{where}: expected a number {lo}..{hi}, got {short(value)}")
    result = float(value)
    if not (math.isfinite(result) and lo <= result <= hi):
        raise SpecError(f"{where}: expected a number {lo}..{hi}, got {result}")
    return result


def as_choice(value: object, where: str, allowed: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise SpecError(f"{where}: expected one of {', '.join(allowed)}, got {short(value)}")
    return value


def as_bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise SpecError(f"{where}: expected true or false, got {short(value)}")
    return value


def as_int_list(
    value: object, where: str, lo: int, hi: int, min_len: int, max_len: int
) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not min_len <= len(value) <= max_len:
        raise SpecError(
            f"{where}: expected a list of {min_len}..{max_len} integers {lo}..{hi}, got {short(value)}"
        )
    return tuple(as_int(v, f"{where}[{i}]", lo, hi) for i, v in enumerate(value))


# ---------------------------------------------------------------------------
# The layer whitelist: type -> ordered (name, parser, default) triples.

_Parser = Callable[[object, str], ArgValue]


def _int(lo: int, hi: int) -> _Parser:
    return lambda v, w: as_int(v, w, lo, hi)


def _float(lo: float, hi: float) -> _Parser:
    return lambda v, w: as_float(v, w, lo, hi)


def _choice(*allowed: str) -> _Parser:
    return lambda v, w: as_choice(v, w, allowed)


def _bool(v: object, w: str) -> ArgValue:
    return as_bool(v, w)


def _size(dims: int, lo: int, hi: int) -> _Parser:
    """An int, or a list of ``dims`` ints (kernel sizes, strides, paddings)."""

    def parse(v: object, w: str) -> ArgValue:
        if isinstance(v, (list, tuple)):
            return as_int_list(v, w, lo, hi, dims, dims)
        return as_int(v, w, lo, hi)

    return parse


def _shape(v: object, w: str) -> ArgValue:
    if isinstance(v, (list, tuple)):
        return as_int_list(v, w, 1, MAX_WIDTH, 1, 4)
    return as_int(v, w, 1, MAX_WIDTH)


_NONE: Final = object()  # "no default: omit unless given" (e.g. pool stride, padding_idx)


def _conv(dims: int) -> tuple[tuple[str, _Parser, object], ...]:
    return (
        ("in_channels", _int(1, 1 << 14), REQUIRED),
        ("out_channels", _int(1, 1 << 14), REQUIRED),
        ("kernel_size", _size(dims, 1, 64), REQUIRED),
        ("stride", _size(dims, 1, 64), 1),
        ("padding", _size(dims, 0, 64), 0),
        ("dilation", _size(dims, 1, 64), 1),
        ("groups", _int(1, 1 << 14), 1),
        ("bias", _bool, True),
    )


def _pool(dims: int) -> tuple[tuple[str, _Parser, object], ...]:
    return (
        ("kernel_size", _size(dims, 1, 64), REQUIRED),
        ("stride", _size(dims, 1, 64), _NONE),
        ("padding", _size(dims, 0, 32), 0),
    )


def _batchnorm() -> tuple[tuple[str, _Parser, object], ...]:
    return (
        ("num_features", _int(1, MAX_WIDTH), REQUIRED),
        ("eps", _float(1e-12, 1.0), 1e-5),
        ("momentum", _float(0.0, 1.0), 0.1),
        ("affine", _bool, True),
        ("track_running_stats", _bool, True),
    )


LAYERS: Final[dict[str, tuple[tuple[str, _Parser, object], ...]]] = {
    "Linear": (
        ("in_features", _int(1, MAX_WIDTH), REQUIRED),
        ("out_features", _int(1, MAX_WIDTH), REQUIRED),
        ("bias", _bool, True),
    ),
    "Conv1d": _conv(1),
    "Conv2d": _conv(2),
    "MaxPool1d": _pool(1),
    "MaxPool2d": _pool(2),
    "AvgPool1d": _pool(1),
    "AvgPool2d": _pool(2),
    "ReLU": (),
    "GELU": (("approximate", _choice("none", "tanh"), "none"),),
    "Tanh": (),
    "Sigmoid": (),
    "Dropout": (("p", _float(0.0, 0.9), 0.5),),
    "LayerNorm": (
        ("normalized_shape", _shape, REQUIRED),
        ("eps", _float(1e-12, 1.0), 1e-5),
        ("elementwise_affine", _bool, True),
    ),
    "BatchNorm1d": _batchnorm(),
    "BatchNorm2d": _batchnorm(),
    "Flatten": (("start_dim", _int(1, 8), 1), ("end_dim", _int(-8, 8), -1)),
    "Embedding": (
        ("num_embeddings", _int(1, 1 << 24), REQUIRED),
        ("embedding_dim", _int(1, MAX_WIDTH), REQUIRED),
        ("padding_idx", _int(0, (1 << 24) - 1), _NONE),
    ),
}


def parse_layer(raw: object, where: str, *, first: bool) -> LayerSpec:
    if not isinstance(raw, Mapping):
        raise SpecError(
            f'{where}: expected a table like {{type = "Linear", ...}}, got {short(raw)}'
        )
    layer_type = raw.get("type")
    if not isinstance(layer_type, str) or layer_type not in LAYERS:
        raise SpecError(
            f"{where}.type: expected one of {', '.join(LAYERS)}, got {short(layer_type)}"
        )
    if layer_type == "Embedding" and not first:
        raise SpecError(f"{where}.type: Embedding is only allowed as the first layer")
    table = LAYERS[layer_type]
    names = [name for name, _, _ in table]
    given: dict[str, object] = {}
    for key, value in raw.items():
        if key == "type":
            continue
        if key == "args":
            if isinstance(value, Mapping):
                given.update(value)
            elif isinstance(value, (list, tuple)):
                if len(value) > len(names):
                    raise SpecError(
                        f"{where}.args: {layer_type} takes at most {len(names)} arguments"
                    )
                given.update(zip(names, value, strict=False))
            else:
                raise SpecError(f"{where}.args: expected a table or a list, got {short(value)}")
            continue
        if key in given:
            raise SpecError(f"{where}.{key}: given twice")
        given[key] = value
    for key in given:
        if key not in names:
            allowed = ", ".join(names) if names else "none"
            raise SpecError(
                f"{where}.{short(key)}: not an argument of {layer_type}; allowed: {allowed}"
            )
    args: list[tuple[str, ArgValue]] = []
    for name, parse, default in table:
        if name in given:
            args.append((name, parse(given[name], f"{where}.{name}")))
        elif default is REQUIRED:
            raise SpecError(f"{where}.{name}: required for {layer_type}")
        elif default is not _NONE:
            args.append((name, default))  # type: ignore[arg-type]  # defaults are ArgValues
    kwargs = dict(args)
    if layer_type in ("Conv1d", "Conv2d"):
        groups = kwargs["groups"]
        if kwargs["in_channels"] % groups or kwargs["out_channels"] % groups:  # type: ignore[operator]
            raise SpecError(f"{where}.groups: must divide in_channels and out_channels")
    if layer_type == "Embedding" and "padding_idx" in kwargs:
        if kwargs["padding_idx"] >= kwargs["num_embeddings"]:  # type: ignore[operator]
            raise SpecError(f"{where}.padding_idx: must be below num_embeddings")
    if layer_type in ("MaxPool1d", "MaxPool2d", "AvgPool1d", "AvgPool2d"):
        k, p = kwargs["kernel_size"], kwargs["padding"]
        ks = k if isinstance(k, tuple) else (k,)
        ps = p if isinstance(p, tuple) else (p,) * len(ks)
        if any(2 * int(pp) > int(kk) for pp, kk in zip(ps, ks, strict=False)):
            raise SpecError(f"{where}.padding: must be at most half of kernel_size")
    return LayerSpec(layer_type, tuple(args))


# ---------------------------------------------------------------------------
# Shapes.


def _tuple(value: object, n: int) -> tuple[int, ...]:
    if isinstance(value, tuple):
        return tuple(int(v) for v in value)
    return (int(value),) * n  # type: ignore[call-overload]


def _window(length: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (length + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def layer_shape(layer: nn.Module, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Per-sample output shape of ``layer`` (batch dim excluded); ValueError if it cannot run.

    Mirrors torch's shape rules for the whitelisted layers so validation does not
    need a meta-device forward (whose first call costs seconds of imports).
    """
    from torch import nn

    if isinstance(layer, (nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.Dropout)):
        return shape
    if isinstance(layer, nn.Linear):
        if not shape or shape[-1] != layer.in_features:
            raise ValueError(f"needs last dim {layer.in_features}")
        return (*shape[:-1], layer.out_features)
    if isinstance(layer, nn.Embedding):
        return (*shape, layer.embedding_dim)
    if isinstance(layer, (nn.Conv1d, nn.Conv2d)):
        dims = 1 if isinstance(layer, nn.Conv1d) else 2
        if len(shape) != dims + 1 or shape[0] != layer.in_channels:
            spatial_names = ", ".join(["L"] * dims)
            raise ValueError(f"needs [C, {spatial_names}] with C = {layer.in_channels}")
        k, st, pd, dl = (
            _tuple(layer.kernel_size, dims),
            _tuple(layer.stride, dims),
            _tuple(layer.padding, dims),
            _tuple(layer.dilation, dims),
        )
        spatial = tuple(_window(shape[1 + i], k[i], st[i], pd[i], dl[i]) for i in range(dims))
        return (layer.out_channels, *spatial)
    if isinstance(layer, (nn.MaxPool1d, nn.AvgPool1d, nn.MaxPool2d, nn.AvgPool2d)):
        dims = 1 if isinstance(layer, (nn.MaxPool1d, nn.AvgPool1d)) else 2
        if len(shape) != dims + 1:
            raise ValueError(f"needs [C, {', '.join(['L'] * dims)}]")
        k = _tuple(layer.kernel_size, dims)
        st = _tuple(layer.stride if layer.stride is not None else layer.kernel_size, dims)
        pd = _tuple(layer.padding, dims)
        dl = _tuple(getattr(layer, "dilation", 1), dims)
        spatial = tuple(_window(shape[1 + i], k[i], st[i], pd[i], dl[i]) for i in range(dims))
        return (shape[0], *spatial)
    if isinstance(layer, nn.BatchNorm2d):
        if len(shape) != 3 or shape[0] != layer.num_features:
            raise ValueError(f"needs [{layer.num_features}, H, W]")
        return shape
    if isinstance(layer, nn.BatchNorm1d):
        if len(shape) not in (1, 2) or shape[0] != layer.num_features:
            raise ValueError(f"needs [{layer.num_features}] or [{layer.num_features}, L]")
        return shape
    if isinstance(layer, nn.LayerNorm):
        norm = tuple(layer.normalized_shape)
        if len(shape) < len(norm) or shape[len(shape) - len(norm) :] != norm:
            raise ValueError(f"needs trailing dims {list(norm)}")
        return shape
    if isinstance(layer, nn.Flatten):
        full = len(shape) + 1  # with the batch dim
        start = layer.start_dim % full if -full <= layer.start_dim < full else None
        end = layer.end_dim % full if -full <= layer.end_dim < full else None
        if start is None or end is None or start == 0 or start > end:
            raise ValueError(f"start_dim/end_dim out of range for {full} dims")
        batched = (0, *shape)
        return (*batched[1:start], math.prod(batched[start : end + 1]), *batched[end + 1 :])
    raise ValueError(f"{type(layer).__name__} is not a whitelisted layer")


__all__ = [
    "LAYERS",
    "MAX_WIDTH",
    "REQUIRED",
    "ArgValue",
    "LayerSpec",
    "Reader",
    "as_bool",
    "as_choice",
    "as_float",
    "as_int",
    "as_int_list",
    "layer_shape",
    "parse_layer",
    "short",
]
