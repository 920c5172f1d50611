"""Declarative model specs: a named architecture or a whitelisted layer list.

A volunteer never runs code that came over the network: the hub ships a
:class:`ModelSpec` (plain data), and hub and node each build the identical
module from it. Every argument is validated (type, range); shapes are checked
at validation time with the module on the meta device, so a spec that
validates also builds and produces ``(batch, outputs)`` (``(batch, context,
vocab)`` for a transformer).

Canonical dict forms (``to_dict``; ``from_dict`` accepts exactly these keys):

- mlp: ``{kind, input, hidden, outputs, activation, dropout, task}``
- cnn: ``{kind, image, channels, kernel, pool, hidden, outputs, activation, dropout, task}``
- sequential: ``{kind, input_shape, layers, outputs, task}``; each layer is
  ``{"type": "Linear", "in_features": 64, ...}`` (arguments flat, or under
  ``"args"`` as a table or a positional list; see :mod:`.layerspec`).
- transformer: ``{kind, vocab, context, layers, width, heads, mlp_ratio, dropout,
  tied_embeddings, task}``: a decoder-only transformer (:mod:`.transformer`) whose task is
  always ``language_model`` (next-token cross-entropy at every position). With ``experts`` > 0
  its MLPs are mixtures of experts (:mod:`.moe`) and the dict also holds ``experts, top_k,
  capacity_factor, router_jitter, aux_loss_weight, moe_every``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, cast

from .errors import SpecError
from .finetune import LoraConfig
from .layerspec import LAYERS, MAX_WIDTH, LayerSpec, Reader, layer_shape, parse_layer, short

if TYPE_CHECKING:  # torch is imported where a module is built, not on import (CLI start-up)
    import torch
    from torch import nn

    from .tensors import Manifest

MAX_PARAMS: Final = 200_000_000
MAX_INPUT_ELEMS: Final = 1 << 24
MAX_ACTIVATION_ELEMS: Final = 1 << 26  # per sample, any layer
MAX_LAYERS: Final = 128
MAX_OUTPUTS: Final = 1 << 20
MAX_CONTEXT: Final = 1 << 16
MAX_HEADS: Final = 1024
MAX_EXPERTS: Final = 256
#: the mixture-of-experts keys of a transformer, allowed only with experts > 0
MOE_KEYS: Final = ("top_k", "capacity_factor", "router_jitter", "aux_loss_weight", "moe_every")

KINDS: Final = ("mlp", "cnn", "sequential", "transformer")
TASKS: Final = ("classification", "regression", "language_model")
#: the tasks of the stacks (mlp, cnn, sequential): one output row per sample
STACK_TASKS: Final = ("classification", "regression")
ACTIVATIONS: Final = ("relu", "gelu", "tanh", "sigmoid")
POOLS: Final = ("max", "avg", "none")


@dataclass(frozen=True)
class TransformerConfig:
    """A decoder-only transformer's shape (nanoGPT's ``GPTConfig``): ``vocab`` tokens,
    ``context`` positions, ``layers`` blocks of ``width`` features split into ``heads``, an MLP
    ``mlp_ratio`` times as wide, and the output projection sharing the token embedding when
    ``tied_embeddings``.

    ``experts`` > 0 makes the MLP of every ``moe_every``-th block (blocks ``moe_every - 1``,
    ``2 x moe_every - 1``, ...) a mixture of that many experts, each token visiting ``top_k`` of
    them, with the capacity, router jitter and load-balancing loss weight of :mod:`.moe`;
    ``experts`` 0 is the dense MLP everywhere."""

    vocab: int
    context: int
    layers: int
    width: int
    heads: int
    mlp_ratio: int = 4
    dropout: float = 0.0
    tied_embeddings: bool = True
    experts: int = 0
    top_k: int = 1
    capacity_factor: float = 1.25
    router_jitter: float = 0.0
    aux_loss_weight: float = 0.01
    moe_every: int = 1

    def is_moe(self, block: int) -> bool:
        """Whether block ``block``'s MLP is a mixture of experts."""
        return self.experts > 0 and block % self.moe_every == self.moe_every - 1


@dataclass(frozen=True)
class ModelSpec:
    """A validated model description. Build with :func:`build_model`.

    For a transformer, ``transformer`` holds its shape, ``input_shape`` is ``(context,)``
    and ``outputs`` is ``vocab`` (the logits per position)."""

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
    transformer: TransformerConfig | None = None
    #: a LoRA job's adapters and frozen weights (protocol/finetune.py); None: every tensor trains
    lora: LoraConfig | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "model") -> ModelSpec:
        """Validate ``d``; SpecError names ``where.key`` and the allowed values."""
        if not isinstance(d, Mapping):
            raise SpecError(f"{where}: expected a table, got {type(d).__name__}")
        kind = d.get("kind")
        if kind not in KINDS:
            raise SpecError(f"{where}.kind: expected one of {', '.join(KINDS)}, got {kind!r:.40}")
        if kind != "transformer" and d.get("task") == "language_model":
            raise SpecError(f'{where}.task: language_model needs kind = "transformer"')
        r = Reader({k: v for k, v in d.items() if k != "lora"}, where)
        spec = _READERS[kind](r)
        r.finish()
        if "lora" in d:
            spec = dataclasses.replace(spec, lora=LoraConfig.from_dict(d["lora"], f"{where}.lora"))
        if math.prod(spec.input_shape) > MAX_INPUT_ELEMS:
            raise SpecError(
                f"{where}: input of {math.prod(spec.input_shape)} values exceeds {MAX_INPUT_ELEMS}"
            )
        _check_shapes(spec, where)
        return spec

    def to_dict(self) -> dict[str, Any]:
        """Canonical plain-data form (msgpack/TOML friendly); ``from_dict`` inverts it."""
        plain = self._plain_dict()
        return plain if self.lora is None else {**plain, "lora": self.lora.to_dict()}

    def _plain_dict(self) -> dict[str, Any]:
        if self.transformer is not None:
            return {"kind": "transformer", **_transformer_dict(self.transformer), "task": self.task}
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
                {
                    "type": layer.type,
                    **{k: list(v) if isinstance(v, tuple) else v for k, v in layer.args},
                }
                for layer in self.layers
            ],
            "outputs": self.outputs,
            "task": self.task,
        }

    @property
    def input_dtype(self) -> torch.dtype:
        """int64 for token ids (a transformer, or an Embedding first layer), else float32."""
        import torch

        return torch.int64 if self.takes_tokens else torch.float32

    @property
    def takes_tokens(self) -> bool:
        """Whether a sample's x holds token ids (int64) rather than float32 features."""
        return self.kind == "transformer" or (
            self.kind == "sequential" and bool(self.layers) and self.layers[0].type == "Embedding"
        )

    @property
    def vocab(self) -> int:
        """How many token ids x may hold (0 when x holds features)."""
        if self.transformer is not None:
            return self.transformer.vocab
        if self.takes_tokens:
            return int(self.layers[0].kwargs()["num_embeddings"])  # type: ignore[arg-type]
        return 0

    @property
    def target_shape(self) -> tuple[int, ...]:
        """A sample's y: () for a class label, (outputs,) for regression targets, (context,)
        next tokens for a language model."""
        if self.task == "classification":
            return ()
        if self.task == "language_model":
            return self.input_shape
        return (self.outputs,)

    @property
    def sample_bytes(self) -> int:
        """The bytes one sample (x and y) takes in a chunk: int64 tokens and labels, float32
        features and targets."""
        x_item = 8 if self.takes_tokens else 4
        y_item = 4 if self.task == "regression" else 8
        return math.prod(self.input_shape) * x_item + math.prod(self.target_shape) * y_item


def _transformer_dict(c: TransformerConfig) -> dict[str, Any]:
    return {
        "vocab": c.vocab,
        "context": c.context,
        "layers": c.layers,
        "width": c.width,
        "heads": c.heads,
        "mlp_ratio": c.mlp_ratio,
        "dropout": c.dropout,
        "tied_embeddings": c.tied_embeddings,
        **({} if not c.experts else {
            "experts": c.experts,
            "top_k": c.top_k,
            "capacity_factor": c.capacity_factor,
            "router_jitter": c.router_jitter,
            "aux_loss_weight": c.aux_loss_weight,
            "moe_every": c.moe_every,
        }),
    }


def _read_mlp(r: Reader) -> ModelSpec:
    return ModelSpec(
        kind="mlp",
        input_shape=(r.get_int("input", 1, MAX_INPUT_ELEMS),),
        hidden=r.get_int_list("hidden", 1, MAX_WIDTH, default=(), max_len=32),
        outputs=r.get_int("outputs", 1, MAX_OUTPUTS),
        activation=r.get_choice("activation", ACTIVATIONS, default="relu"),
        dropout=r.get_float("dropout", 0.0, 0.9, default=0.0),
        task=r.get_choice("task", STACK_TASKS, default="classification"),
    )


def _read_cnn(r: Reader) -> ModelSpec:
    image = r.get_int_list("image", 1, 1 << 16, min_len=3, max_len=3)
    channels = r.get_int_list("channels", 1, 1 << 14, min_len=1, max_len=16)
    kernel = r.get_int("kernel", 1, 15, default=3)
    if kernel % 2 == 0:
        raise SpecError(f"{r.where}.kernel: must be odd (1, 3, 5, ...), got {kernel}")
    return ModelSpec(
        kind="cnn",
        input_shape=image,
        channels=channels,
        kernel=kernel,
        pool=r.get_choice("pool", POOLS, default="max"),
        hidden=r.get_int_list("hidden", 1, MAX_WIDTH, default=(), max_len=32),
        outputs=r.get_int("outputs", 1, MAX_OUTPUTS),
        activation=r.get_choice("activation", ACTIVATIONS, default="relu"),
        dropout=r.get_float("dropout", 0.0, 0.9, default=0.0),
        task=r.get_choice("task", STACK_TASKS, default="classification"),
    )


def _read_sequential(r: Reader) -> ModelSpec:
    input_shape = r.get_int_list("input_shape", 1, 1 << 20, min_len=1, max_len=4)
    raw_layers = r.get_list("layers", min_len=1, max_len=MAX_LAYERS)
    layers = tuple(
        parse_layer(raw, f"{r.where}.layers[{i}]", first=i == 0) for i, raw in enumerate(raw_layers)
    )
    return ModelSpec(
        kind="sequential",
        input_shape=input_shape,
        layers=layers,
        outputs=r.get_int("outputs", 1, MAX_OUTPUTS),
        task=r.get_choice("task", STACK_TASKS, default="classification"),
    )


def _read_transformer(r: Reader) -> ModelSpec:
    config = TransformerConfig(
        vocab=r.get_int("vocab", 2, MAX_OUTPUTS),
        context=r.get_int("context", 1, MAX_CONTEXT),
        layers=r.get_int("layers", 1, MAX_LAYERS),
        width=r.get_int("width", 1, 1 << 16),
        heads=r.get_int("heads", 1, MAX_HEADS),
        mlp_ratio=r.get_int("mlp_ratio", 1, 16, default=4),
        dropout=r.get_float("dropout", 0.0, 0.9, default=0.0),
        tied_embeddings=r.get_bool("tied_embeddings", default=True),
    )
    config = _read_experts(r, config)
    task = r.get_choice("task", ("language_model",), default="language_model")
    if config.width % config.heads:
        raise SpecError(
            f"{r.where}.width: must be divisible by heads ({config.heads}), got {config.width}"
        )
    return ModelSpec(
        kind="transformer",
        task=task,
        input_shape=(config.context,),
        outputs=config.vocab,
        transformer=config,
    )


def _read_experts(r: Reader, config: TransformerConfig) -> TransformerConfig:
    """``config`` with the mixture-of-experts keys read (module docstring); their keys are
    refused when ``experts`` is 0."""
    experts = r.get_int("experts", 0, MAX_EXPERTS, default=0)
    if not experts:
        given = [k for k in MOE_KEYS if k in r.d]
        if given:
            raise SpecError(f"{r.where}.{given[0]}: only for a mixture of experts (experts > 0)")
        return config
    d = TransformerConfig(1, 1, 1, 1, 1)  # the defaults live in the dataclass only
    top_k = r.get_int("top_k", 1, MAX_EXPERTS, default=d.top_k)
    if top_k > experts:
        raise SpecError(f"{r.where}.top_k: at most experts ({experts}), got {top_k}")
    capacity_factor = r.get_float("capacity_factor", 0.0, 64.0, default=d.capacity_factor)
    if capacity_factor <= 0:
        raise SpecError(f"{r.where}.capacity_factor: must be > 0 (1.0: room for an even share), "
                        f"got {capacity_factor}")
    moe_every = r.get_int("moe_every", 1, MAX_LAYERS, default=d.moe_every)
    if moe_every > config.layers:
        raise SpecError(f"{r.where}.moe_every: at most layers ({config.layers}), got {moe_every}")
    return dataclasses.replace(
        config,
        experts=experts,
        top_k=top_k,
        capacity_factor=capacity_factor,
        router_jitter=r.get_float("router_jitter", 0.0, 0.5, default=d.router_jitter),
        aux_loss_weight=r.get_float("aux_loss_weight", 0.0, 10.0, default=d.aux_loss_weight),
        moe_every=moe_every,
    )


_READERS: Final[dict[str, Callable[[Reader], ModelSpec]]] = {
    "mlp": _read_mlp,
    "cnn": _read_cnn,
    "sequential": _read_sequential,
    "transformer": _read_transformer,
}


# ---------------------------------------------------------------------------
# Construction.


def _activation(name: str) -> Callable[[], nn.Module]:
    from torch import nn

    acts: dict[str, Callable[[], nn.Module]] = {
        "relu": nn.ReLU,
        "gelu": nn.GELU,
        "tanh": nn.Tanh,
        "sigmoid": nn.Sigmoid,
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


def _construct(spec: ModelSpec, device: torch.device) -> nn.Module:
    """The module for ``spec``; parameters created on ``device`` as float32 (a LoRA job's
    frozen weights in int8 when it says so: protocol/lora.py)."""
    module = _construct_plain(spec, device)
    if spec.lora is None:
        return module
    from .lora import attach_adapters

    return attach_adapters(module, spec.lora)


def _construct_plain(spec: ModelSpec, device: torch.device) -> nn.Module:
    import torch
    from torch import nn

    if spec.transformer is not None:
        from .transformer import Transformer

        return Transformer(spec.transformer, device=device)
    factory: dict[str, Any] = {"device": device, "dtype": torch.float32}
    if spec.kind == "sequential":
        return nn.Sequential(*(_make_layer(layer, factory, slot) for slot, layer in enumerate(spec.layers)))
    act = _activation(spec.activation)
    modules: list[nn.Module] = []
    if spec.kind == "cnn":
        channels = spec.input_shape[0]
        for width in spec.channels:
            modules.append(
                nn.Conv2d(channels, width, spec.kernel, padding=spec.kernel // 2, **factory)
            )
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


def _transformer_shapes(c: TransformerConfig) -> list[tuple[int, ...]]:
    """Per-sample output shape of each unit (embed, blocks, head), checking the largest
    tensors a block and the head make per sample against the activation bound."""
    largest = {
        "attention scores (heads x context x context)": c.heads * c.context * c.context,
        "MLP hidden (context x mlp_ratio x width)": c.context * c.mlp_ratio * c.width,
        "logits (context x vocab)": c.context * c.vocab,
    }
    if c.experts:
        largest["expert hidden (context x top_k x mlp_ratio x width)"] = (
            c.context * c.top_k * c.mlp_ratio * c.width
        )
    for what, elems in largest.items():
        if elems > MAX_ACTIVATION_ELEMS:
            raise SpecError(
                f"the {what} hold {elems} values per sample, more than {MAX_ACTIVATION_ELEMS}; "
                "use a shorter context or a smaller model"
            )
    hidden: tuple[int, ...] = (c.context, c.width)
    return [hidden] * (1 + c.layers) + [(c.context, c.vocab)]


def infer_shapes(spec: ModelSpec, module: nn.Module | None = None) -> list[tuple[int, ...]]:
    """Per-sample output shape after each layer (each pipeline unit for a transformer);
    SpecError naming the layer that cannot run."""
    import torch

    if spec.transformer is not None:
        return _transformer_shapes(spec.transformer)
    if spec.lora is not None:  # adapters keep every layer's shape
        spec, module = dataclasses.replace(spec, lora=None), None
    if module is None:
        with torch.device("meta"):
            module = _construct(spec, torch.device("meta"))
    shape = spec.input_shape
    shapes: list[tuple[int, ...]] = []
    for index, layer in enumerate(cast("nn.Sequential", module)):
        try:
            shape = layer_shape(layer, shape)
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
        raise ValueError(
            f"the batch dimension did not survive the forward (output {list(y.shape)})"
        )
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
                f'{spec.input_shape[1]}x{spec.input_shape[2]} image to nothing; use fewer or pool = "none"'
            )
    meta = torch.device("meta")
    with torch.device(meta):
        module = _construct(spec, meta)
    params = sum(p.numel() for p in module.parameters())
    if params > MAX_PARAMS:
        raise SpecError(f"model has {params} parameters, more than the limit of {MAX_PARAMS}")
    shapes = infer_shapes(spec, module)
    if spec.transformer is None and shapes[-1] != (spec.outputs,):
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


def update_manifest(spec: ModelSpec) -> Manifest:
    """The tensors an update of ``spec`` carries (dense): the whole manifest, or a LoRA
    job's adapters only (protocol/lora.py)."""
    full = manifest(spec)
    if spec.lora is None:
        return full
    from .lora import update_names

    keep = set(update_names([t.name for t in full]))
    return tuple(t for t in full if t.name in keep)


def param_count(spec: ModelSpec) -> int:
    """Number of trainable parameters (computed on the meta device)."""
    return _meta_check(spec)[0]


def manifest(spec: ModelSpec) -> Manifest:
    """The state-dict manifest of ``build_model(spec, seed)``, without allocating."""
    return _meta_check(spec)[1]


def construct_meta(spec: ModelSpec) -> nn.Module:
    """``spec``'s module on the meta device: its structure and shapes, nothing allocated."""
    import torch

    _meta_check(spec)
    meta = torch.device("meta")
    with torch.device(meta):
        return _construct(spec, meta)


def build_model(spec: ModelSpec, seed: int) -> nn.Module:
    """Build ``spec`` on the CPU with parameters drawn from ``seed``.

    The same spec and seed give bit-identical parameters (float32) on any
    machine with the same torch version. The global CPU RNG is saved and
    restored, so callers' random streams are not disturbed; CUDA RNGs are never
    touched.
    """
    import torch

    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < (1 << 63):
        raise SpecError(f"seed: expected an integer 0..2**63-1, got {short(seed)}")
    _meta_check(spec)
    cpu = torch.device("cpu")
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        with torch.device(cpu):
            module = _construct(spec, cpu)
    return module


def build_for_state(
    spec: ModelSpec,
    state: Mapping[str, torch.Tensor],
    *,
    device: torch.device | None = None,
    share: bool = False,
) -> nn.Module:
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
    if spec.lora is not None:
        from .lora import freeze_base

        freeze_base(module)  # assign=True may bring the state's own requires_grad flags
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
    "STACK_TASKS",
    "TASKS",
    "LayerSpec",
    "ModelSpec",
    "TransformerConfig",
    "build_for_state",
    "build_model",
    "construct_meta",
    "infer_shapes",
    "manifest",
    "meta_forward_shape",
    "param_count",
    "update_manifest",
]
