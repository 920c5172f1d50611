"""Declarative model specs: a named architecture or a whitelisted layer list.

A volunteer never runs code that came over the network: the hub ships a
:class:`ModelSpec` (plain data), and hub and node each build the identical
module from it. Every argument is validated (type, range); shapes are checked
at validation time by running the module on the meta device, so a spec that
validates also builds and produces ``(batch, outputs)``.

Canonical dict forms (``to_dict``; ``from_dict`` accepts exactly these keys):

- mlp: ``{kind, input, hidden, outputs, activation, dropout, task}``
- cnn: ``{kind, image, channels, kernel, pool, hidden, outputs, activation, dropout, task}``
- sequential: ``{kind, input_shape, layers, outputs, task}``; each layer is
  ``{"type": "Linear", "in_features": 64, ...}`` (arguments flat, or under
  ``"args"`` as a table or a positional list).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from .errors import SpecError

if TYPE_CHECKING:  # torch is imported where a module is built, not on import (CLI start-up)
    import torch
    from torch import nn

    from .tensors import Manifest

MAX_PARAMS: Final = 200_000_000
MAX_INPUT_ELEMS: Final = 1 << 24
MAX_ACTIVATION_ELEMS: Final = 1 << 26  # per sample, any layer
MAX_WIDTH: Final = 1 << 20
MAX_LAYERS: Final = 128
MAX_OUTPUTS: Final = 1 << 20

KINDS: Final = ("mlp", "cnn", "sequential")
TASKS: Final = ("classification", "regression")
ACTIVATIONS: Final = ("relu", "gelu", "tanh", "sigmoid")
POOLS: Final = ("max", "avg", "none")

ArgValue = int | float | bool | str | tuple[int, ...]


@dataclass(frozen=True)
class LayerSpec:
    """One whitelisted layer: its type name and validated keyword arguments."""

    type: str
    args: tuple[tuple[str, ArgValue], ...] = ()

    def kwargs(self) -> dict[str, ArgValue]:
        return dict(self.args)


@dataclass(frozen=True)
class ModelSpec:
    """A validated model description. Build with :func:`build_model`."""

    kind: str
    task: str
    input_shape: tuple[int, ...]
    outputs: int
    hidden: tuple[int, ...] = ()
    activation: str = "relu"
    dropout: float = 0.0
    channels: tuple[int, ...] = ()
    kernel: int = 3
    pool: str = "max"
    layers: tuple[LayerSpec, ...] = ()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "model") -> ModelSpec:
        """Validate ``d``; SpecError names ``where.key`` and the allowed values."""
        if not isinstance(d, Mapping):
            raise SpecError(f"{where}: expected a table, got {type(d).__name__}")
        kind = d.get("kind")
        if kind not in KINDS:
            raise SpecError(f"{where}.kind: expected one of {', '.join(KINDS)}, got {kind!r:.40}")
        r = _Reader(d, where)
        if kind == "mlp":
            spec = cls(
                kind="mlp",
                input_shape=(r.get_int("input", 1, MAX_INPUT_ELEMS),),
                hidden=r.get_int_list("hidden", 1, MAX_WIDTH, default=(), max_len=32),
                outputs=r.get_int("outputs", 1, MAX_OUTPUTS),
                activation=r.get_choice("activation", ACTIVATIONS, default="relu"),
                dropout=r.get_float("dropout", 0.0, 0.9, default=0.0),
                task=r.get_choice("task", TASKS, default="classification"),
            )
        elif kind == "cnn":
            image = r.get_int_list("image", 1, 1 << 16, min_len=3, max_len=3)
            channels = r.get_int_list("channels", 1, 1 << 14, min_len=1, max_len=16)
            kernel = r.get_int("kernel", 1, 15, default=3)
            if kernel % 2 == 0:
                raise SpecError(f"{where}.kernel: must be odd (1, 3, 5, ...), got {kernel}")
            spec = cls(
                kind="cnn",
                input_shape=image,
                channels=channels,
                kernel=kernel,
                pool=r.get_choice("pool", POOLS, default="max"),
                hidden=r.get_int_list("hidden", 1, MAX_WIDTH, default=(), max_len=32),
                outputs=r.get_int("outputs", 1, MAX_OUTPUTS),
                activation=r.get_choice("activation", ACTIVATIONS, default="relu"),
                dropout=r.get_float("dropout", 0.0, 0.9, default=0.0),
                task=r.get_choice("task", TASKS, default="classification"),
            )
        else:
            input_shape = r.get_int_list("input_shape", 1, 1 << 20, min_len=1, max_len=4)
            raw_layers = r.get_list("layers", min_len=1, max_len=MAX_LAYERS)
            layers = tuple(
                _parse_layer(raw, f"{where}.layers[{i}]", first=i == 0)
                for i, raw in enumerate(raw_layers)
            )
            spec = cls(
                kind="sequential",
                input_shape=input_shape,
                layers=layers,
                outputs=r.get_int("outputs", 1, MAX_OUTPUTS),
                task=r.get_choice("task", TASKS, default="classification"),
            )
        r.finish()
        if math.prod(spec.input_shape) > MAX_INPUT_ELEMS:
            raise SpecError(f"{where}: input of {math.prod(spec.input_shape)} values exceeds {MAX_INPUT_ELEMS}")
        _check_shapes(spec, where)
        return spec

    def to_dict(self) -> dict[str, Any]:
        """Canonical plain-data form (msgpack/TOML friendly); ``from_dict`` inverts it."""
        if self.kind == "mlp":
            return {
                "kind": "mlp",
                "input": self.input_shape[0],
                "hidden": list(self.hidden),
                "outputs": self.outputs,
                "activation": self.activation,
                "dropout": self.dropout,
                "task": self.task,
            }
        if self.kind == "cnn":
            return {
                "kind": "cnn",
                "image": list(self.input_shape),
                "channels": list(self.channels),
                "kernel": self.kernel,
                "pool": self.pool,
                "hidden": list(self.hidden),
                "outputs": self.outputs,
                "activation": self.activation,
                "dropout": self.dropout,
                "task": self.task,
            }
        return {
            "kind": "sequential",
            "input_shape": list(self.input_shape),
            "layers": [
                {"type": layer.type, **{k: list(v) if isinstance(v, tuple) else v for k, v in layer.args}}
                for layer in self.layers
            ],
            "outputs": self.outputs,
            "task": self.task,
        }

    @property
    def input_dtype(self) -> torch.dtype:
        """int64 when the first layer is an Embedding (token ids), else float32."""
        import torch

        if self.kind == "sequential" and self.layers and self.layers[0].type == "Embedding":
            return torch.int64
        return torch.float32


# ---------------------------------------------------------------------------
# Argument reading.


class _Reader:
    """Reads keys of one table, recording which were used so leftovers are refused."""

    def __init__(self, d: Mapping[str, Any], where: str, ignore: Sequence[str] = ("kind",)) -> None:
        self.d = d
        self.where = where
        self.used: set[str] = set(ignore)

    def _get(self, key: str, default: object) -> object:
        self.used.add(key)
        if key in self.d:
            return self.d[key]
        if default is _REQUIRED:
            raise SpecError(f"{self.where}.{key}: required")
        return default

    def get_int(self, key: str, lo: int, hi: int, default: object = None) -> int:
        value = self._get(key, _REQUIRED if default is None else default)
        return _as_int(value, f"{self.where}.{key}", lo, hi)

    def get_float(self, key: str, lo: float, hi: float, default: object = None) -> float:
        value = self._get(key, _REQUIRED if default is None else default)
        return _as_float(value, f"{self.where}.{key}", lo, hi)

    def get_choice(self, key: str, allowed: Sequence[str], default: object = None) -> str:
        value = self._get(key, _REQUIRED if default is None else default)
        return _as_choice(value, f"{self.where}.{key}", allowed)

    def get_list(self, key: str, *, min_len: int = 0, max_len: int) -> list[object]:
        value = self._get(key, _REQUIRED)
        if not isinstance(value, (list, tuple)) or not min_len <= len(value) <= max_len:
            raise SpecError(
                f"{self.where}.{key}: expected a list of {min_len}..{max_len} entries, got {_short(value)}"
            )
        return list(value)

    def get_int_list(
        self, key: str, lo: int, hi: int, *, default: object = None, min_len: int = 0, max_len: int = 32
    ) -> tuple[int, ...]:
        value = self._get(key, _REQUIRED if default is None else default)
        return _as_int_list(value, f"{self.where}.{key}", lo, hi, min_len, max_len)

    def finish(self) -> None:
        for key in self.d:
            if key not in self.used:
                allowed = ", ".join(sorted(k for k in self.used))
                raise SpecError(f"{self.where}.{_short(key)}: unknown key; allowed: {allowed}")


_REQUIRED: Final = object()


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _as_int(value: object, where: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{where}: expected an integer {lo}..{hi}, got {_short(value)}")
    if not lo <= value <= hi:
        raise SpecError(f"{where}: expected an integer {lo}..{hi}, got {value}")
    return value


def _as_float(value: object, where: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{where}: expected a number {lo}..{hi}, got {_short(value)}")
    result = float(value)
    if not (math.isfinite(result) and lo <= result <= hi):
        raise SpecError(f"{where}: expected a number {lo}..{hi}, got {result}")
    return result


def _as_choice(value: object, where: str, allowed: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise SpecError(f"{where}: expected one of {', '.join(allowed)}, got {_short(value)}")
    return value


def _as_bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise SpecError(f"{where}: expected true or false, got {_short(value)}")
    return value


def _as_int_list(
    value: object, where: str, lo: int, hi: int, min_len: int, max_len: int
) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not min_len <= len(value) <= max_len:
        raise SpecError(
            f"{where}: expected a list of {min_len}..{max_len} integers {lo}..{hi}, got {_short(value)}"
        )
    return tuple(_as_int(v, f"{where}[{i}]", lo, hi) for i, v in enumerate(value))


# ---------------------------------------------------------------------------
# The layer whitelist: type -> ordered (name, parser, default) triples.

_Parser = Callable[[object, str], ArgValue]


def _int(lo: int, hi: int) -> _Parser:
    return lambda v, w: _as_int(v, w, lo, hi)


def _float(lo: float, hi: float) -> _Parser:
    return lambda v, w: _as_float(v, w, lo, hi)


def _choice(*allowed: str) -> _Parser:
    return lambda v, w: _as_choice(v, w, allowed)


def _bool(v: object, w: str) -> ArgValue:
    return _as_bool(v, w)


def _size(dims: int, lo: int, hi: int) -> _Parser:
    """An int, or a list of ``dims`` ints (kernel sizes, strides, paddings)."""

    def parse(v: object, w: str) -> ArgValue:
        if isinstance(v, (list, tuple)):
            return _as_int_list(v, w, lo, hi, dims, dims)
        return _as_int(v, w, lo, hi)

    return parse


def _shape(v: object, w: str) -> ArgValue:
    if isinstance(v, (list, tuple)):
        return _as_int_list(v, w, 1, MAX_WIDTH, 1, 4)
    return _as_int(v, w, 1, MAX_WIDTH)


_NONE: Final = object()  # "no default: omit unless given" (e.g. pool stride, padding_idx)


def _conv(dims: int) -> tuple[tuple[str, _Parser, object], ...]:
    return (
        ("in_channels", _int(1, 1 << 14), _REQUIRED),
        ("out_channels", _int(1, 1 << 14), _REQUIRED),
        ("kernel_size", _size(dims, 1, 64), _REQUIRED),
        ("stride", _size(dims, 1, 64), 1),
        ("padding", _size(dims, 0, 64), 0),
        ("dilation", _size(dims, 1, 64), 1),
        ("groups", _int(1, 1 << 14), 1),
        ("bias", _bool, True),
    )


def _pool(dims: int) -> tuple[tuple[str, _Parser, object], ...]:
    return (
        ("kernel_size", _size(dims, 1, 64), _REQUIRED),
        ("stride", _size(dims, 1, 64), _NONE),
        ("padding", _size(dims, 0, 32), 0),
    )


def _batchnorm() -> tuple[tuple[str, _Parser, object], ...]:
    return (
        ("num_features", _int(1, MAX_WIDTH), _REQUIRED),
        ("eps", _float(1e-12, 1.0), 1e-5),
        ("momentum", _float(0.0, 1.0), 0.1),
        ("affine", _bool, True),
        ("track_running_stats", _bool, True),
    )


LAYERS: Final[dict[str, tuple[tuple[str, _Parser, object], ...]]] = {
    "Linear": (
        ("in_features", _int(1, MAX_WIDTH), _REQUIRED),
        ("out_features", _int(1, MAX_WIDTH), _REQUIRED),
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
        ("normalized_shape", _shape, _REQUIRED),
        ("eps", _float(1e-12, 1.0), 1e-5),
        ("elementwise_affine", _bool, True),
    ),
    "BatchNorm1d": _batchnorm(),
    "BatchNorm2d": _batchnorm(),
    "Flatten": (("start_dim", _int(1, 8), 1), ("end_dim", _int(-8, 8), -1)),
    "Embedding": (
        ("num_embeddings", _int(1, 1 << 24), _REQUIRED),
        ("embedding_dim", _int(1, MAX_WIDTH), _REQUIRED),
        ("padding_idx", _int(0, (1 << 24) - 1), _NONE),
    ),
}


def _parse_layer(raw: object, where: str, *, first: bool) -> LayerSpec:
    if not isinstance(raw, Mapping):
        raise SpecError(f"{where}: expected a table like {{type = \"Linear\", ...}}, got {_short(raw)}")
    layer_type = raw.get("type")
    if not isinstance(layer_type, str) or layer_type not in LAYERS:
        raise SpecError(f"{where}.type: expected one of {', '.join(LAYERS)}, got {_short(layer_type)}")
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
                    raise SpecError(f"{where}.args: {layer_type} takes at most {len(names)} arguments")
                given.update(zip(names, value, strict=False))
            else:
                raise SpecError(f"{where}.args: expected a table or a list, got {_short(value)}")
            continue
        if key in given:
            raise SpecError(f"{where}.{key}: given twice")
        given[key] = value
    for key in given:
        if key not in names:
            allowed = ", ".join(names) if names else "none"
            raise SpecError(f"{where}.{_short(key)}: not an argument of {layer_type}; allowed: {allowed}")
    args: list[tuple[str, ArgValue]] = []
    for name, parse, default in table:
        if name in given:
            args.append((name, parse(given[name], f"{where}.{name}")))
        elif default is _REQUIRED:
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
# Construction.

def _activation(name: str) -> Callable[[], nn.Module]:
    from torch import nn

    acts: dict[str, Callable[[], nn.Module]] = {
        "relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid,
    }
    return acts[name]


def _make_layer(layer: LayerSpec, factory: dict[str, Any], slot: int) -> nn.Module:
    import torch
    from torch import nn

    kw: dict[str, Any] = {k: v for k, v in layer.args}
    t = layer.type
    if t == "Dropout":  # masks every device draws alike, so the referee replays them
        from .dropout import KeyedDropout

        return KeyedDropout(float(kw.get("p", 0.5)), slot=slot)
    if t in ("Linear", "Conv1d", "Conv2d", "LayerNorm", "BatchNorm1d", "BatchNorm2d", "Embedding"):
        kw.update(factory)
    if t == "Embedding" and factory["device"].type == "meta":
        # A given _weight skips reset_parameters: normal_ on meta loads torch's
        # Python meta kernels (seconds). Shapes are all the meta module is for.
        kw["_weight"] = torch.empty(kw["num_embeddings"], kw["embedding_dim"], **factory)
    cls: Callable[..., nn.Module] = getattr(nn, t)
    return cls(**kw)


def _construct(spec: ModelSpec, device: torch.device) -> nn.Sequential:
    """The module for ``spec``; parameters created on ``device`` as float32."""
    import torch
    from torch import nn

    factory: dict[str, Any] = {"device": device, "dtype": torch.float32}
    if spec.kind == "sequential":
        return nn.Sequential(*(_make_layer(layer, factory, slot) for slot, layer in enumerate(spec.layers)))
    act = _activation(spec.activation)
    modules: list[nn.Module] = []
    if spec.kind == "cnn":
        channels = spec.input_shape[0]
        for width in spec.channels:
            modules.append(nn.Conv2d(channels, width, spec.kernel, padding=spec.kernel // 2, **factory))
            modules.append(act())
            if spec.pool == "max":
                modules.append(nn.MaxPool2d(2))
            elif spec.pool == "avg":
                modules.append(nn.AvgPool2d(2))
            channels = width
        modules.append(nn.Flatten())
        # (batch, C, H, W) -> (batch, C*H*W); H, W after pooling
        features = channels * math.prod(_spatial_after_pools(spec))
    else:
        features = spec.input_shape[0]
    for width in spec.hidden:
        modules.append(nn.Linear(features, width, **factory))
        modules.append(act())
        if spec.dropout > 0:
            from .dropout import KeyedDropout

            modules.append(KeyedDropout(spec.dropout, slot=len(modules)))
        features = width
    modules.append(nn.Linear(features, spec.outputs, **factory))
    return nn.Sequential(*modules)


def _spatial_after_pools(spec: ModelSpec) -> tuple[int, int]:
    h, w = spec.input_shape[1], spec.input_shape[2]
    if spec.pool != "none":
        for _ in spec.channels:
            h, w = h // 2, w // 2
    return h, w


def _tuple(value: object, n: int) -> tuple[int, ...]:
    if isinstance(value, tuple):
        return tuple(int(v) for v in value)
    return (int(value),) * n  # type: ignore[call-overload]


def _window(length: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (length + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _layer_shape(layer: nn.Module, shape: tuple[int, ...]) -> tuple[int, ...]:
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


def infer_shapes(spec: ModelSpec, module: nn.Sequential | None = None) -> list[tuple[int, ...]]:
    """Per-sample output shape after each layer; SpecError naming the layer that cannot run."""
    import torch

    if module is None:
        with torch.device("meta"):
            module = _construct(spec, torch.device("meta"))
    shape = spec.input_shape
    shapes: list[tuple[int, ...]] = []
    for index, layer in enumerate(module):
        try:
            shape = _layer_shape(layer, shape)
        except ValueError as exc:
            raise SpecError(
                f"layer {index} ({type(layer).__name__}) cannot take input of shape "
                f"{list(shape)} per sample: it {exc}"
            ) from None
        if any(d < 1 for d in shape):
            raise SpecError(
                f"layer {index} ({type(layer).__name__}) shrinks the input to shape {list(shape)}; "
                "use a smaller kernel/stride or more padding"
            )
        if math.prod(shape) > MAX_ACTIVATION_ELEMS:
            raise SpecError(
                f"layer {index} ({type(layer).__name__}) outputs {math.prod(shape)} values per sample, "
                f"more than {MAX_ACTIVATION_ELEMS}"
            )
        shapes.append(shape)
    return shapes


def meta_forward_shape(spec: ModelSpec) -> tuple[int, ...]:
    """Per-sample output shape from a real forward on the meta device (slow first call).

    The strongest check that ``spec`` runs; tests use it to cross-check :func:`infer_shapes`.
    """
    import torch

    meta = torch.device("meta")
    with torch.device(meta):
        module = _construct(spec, meta)
    module.eval()
    batch = 2
    x = torch.zeros((batch, *spec.input_shape), dtype=spec.input_dtype, device=meta)
    with torch.no_grad():
        y = module(x)
    if y.dim() == 0 or y.shape[0] != batch:
        # torch's conv and pool layers take an input without a batch dim as "unbatched":
        # the batch was then consumed as channels, which no real batch size would survive.
        raise ValueError(f"the batch dimension did not survive the forward (output {list(y.shape)})")
    return tuple(int(d) for d in y.shape[1:])


@functools.lru_cache(maxsize=256)
def _meta_check(spec: ModelSpec) -> tuple[int, Manifest]:
    """Shape inference and parameter count with the module on the meta device (no allocation).

    Raises SpecError (without the ``where`` prefix; the caller adds it).
    """
    import torch

    from .tensors import TensorSpec, dtype_name

    if spec.kind == "cnn":
        h, w = _spatial_after_pools(spec)
        if h < 1 or w < 1:
            raise SpecError(
                f"channels: {len(spec.channels)} pooling stages shrink the "
                f"{spec.input_shape[1]}x{spec.input_shape[2]} image to nothing; use fewer or pool = \"none\""
            )
    meta = torch.device("meta")
    with torch.device(meta):
        module = _construct(spec, meta)
    params = sum(p.numel() for p in module.parameters())
    if params > MAX_PARAMS:
        raise SpecError(f"model has {params} parameters, more than the limit of {MAX_PARAMS}")
    shapes = infer_shapes(spec, module)
    if shapes[-1] != (spec.outputs,):
        raise SpecError(
            f"output shape per sample is {list(shapes[-1])}, expected [{spec.outputs}] "
            "(end with Flatten/Linear producing `outputs` features)"
        )
    manifest = tuple(
        TensorSpec(name, dtype_name(t.dtype), tuple(int(d) for d in t.shape))
        for name, t in module.state_dict().items()
    )
    return params, manifest


def _check_shapes(spec: ModelSpec, where: str) -> None:
    try:
        _meta_check(spec)
    except SpecError as exc:
        raise SpecError(f"{where}: {exc}") from None


def param_count(spec: ModelSpec) -> int:
    """Number of trainable parameters (computed on the meta device)."""
    return _meta_check(spec)[0]


def manifest(spec: ModelSpec) -> Manifest:
    """The state-dict manifest of ``build_model(spec, seed)``, without allocating."""
    return _meta_check(spec)[1]


def build_model(spec: ModelSpec, seed: int) -> nn.Module:
    """Build ``spec`` on the CPU with parameters drawn from ``seed``.

    The same spec and seed give bit-identical parameters (float32) on any
    machine with the same torch version. The global CPU RNG is saved and
    restored, so callers' random streams are not disturbed; CUDA RNGs are never
    touched.
    """
    import torch

    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < (1 << 63):
        raise SpecError(f"seed: expected an integer 0..2**63-1, got {_short(seed)}")
    _meta_check(spec)
    cpu = torch.device("cpu")
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        with torch.device(cpu):
            module = _construct(spec, cpu)
    return module


def build_for_state(spec: ModelSpec, state: Mapping[str, torch.Tensor], *, device: torch.device | None = None,
                    share: bool = False) -> nn.Module:
    """The module for ``spec`` holding ``state`` (strict: every name and shape must match).

    Nothing is initialised at random first: the modules are built on the meta device
    and then take either ``state``'s tensors as they are (``share=True``: no copy, for
    read-only use such as evaluation) or a copy of them on ``device`` (for training,
    which must not write into ``state``). For a 25M-parameter model this saves the
    random initialisation that ``build_model`` would do only to overwrite it.

    Raises ValueError/RuntimeError from ``load_state_dict`` when ``state`` does not fit.
    """
    import torch

    _meta_check(spec)
    meta = torch.device("meta")
    with torch.device(meta):
        module = _construct(spec, meta)
    if not share:
        # One copy straight onto the device (module.to_empty would allocate first, and its
        # meta-device path costs ~0.4 s of imports on first use).
        target = device or torch.device("cpu")
        state = {k: v.detach().to(target, copy=True) for k, v in state.items()}
    module.load_state_dict(dict(state), strict=True, assign=True)
    leftover = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if leftover:  # a buffer outside the state dict: not expected for any whitelisted layer
        raise ValueError(f"state leaves {leftover[0]!r} without a value")
    return module


__all__ = [
    "ACTIVATIONS",
    "KINDS",
    "LAYERS",
    "MAX_PARAMS",
    "POOLS",
    "TASKS",
    "LayerSpec",
    "ModelSpec",
    "build_for_state",
    "build_model",
    "infer_shapes",
    "manifest",
    "meta_forward_shape",
    "param_count",
]
