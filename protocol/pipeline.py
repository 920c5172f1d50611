"""A model as an ordered list of units: the pieces a pipeline's stages are cut from.

``pipeline_units(spec)`` splits the module ``build_model(spec, seed)`` builds into units whose
composition ``units[-1](... units[0](x))`` is its forward, operation for operation (the same
results bit for bit, and the same draws from the RNG in training mode):

- transformer: ``embed`` (token + position, dropout), ``block_0`` ... ``block_<L-1>``,
  ``head`` (final LayerNorm and the projection to the vocabulary);
- mlp, cnn, sequential: a unit starts at each layer with weights (Linear, Conv, Embedding) and
  takes the layers up to the next one (its activation, pooling, normalisation, dropout,
  flatten); layers before the first weighted layer join the first unit.

Each unit names the model's state-dict entry of each of its own (``Unit.names``), so a stage's
state is cut from the whole model's (:func:`cut_state`) and put back (:func:`put_state`).
Tied embeddings are one tensor of the model held by two units (``embed`` and ``head``):
:attr:`Units.tied` reports each such group so a pipeline sums the members' gradients.

The units' modules are on the meta device (shapes, nothing allocated); :func:`load_unit`
materialises one with its state. Torch is imported where a module is built, not on import.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from .modelspec import ModelSpec, construct_meta

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

__all__ = [
    "LanePlace",
    "MoEUnits",
    "TiedGroup",
    "Unit",
    "Units",
    "cut_state",
    "lane_counts",
    "lane_place",
    "lane_slices",
    "load_unit",
    "micro_batch_slices",
    "moe_units",
    "pipeline_units",
    "put_state",
    "step_samples",
]

#: layers that start a unit of a stack: the ones with weights (a LoRA job's Linear layers are
#: LoraLinear: protocol/lora.py)
WEIGHTED: Final = ("Linear", "LoraLinear", "Conv1d", "Conv2d", "Embedding")


@dataclass(frozen=True)
class Unit:
    """One piece of the model: ``module`` (meta device) and, for each entry of its state
    dict, the whole model's name for it: ``names`` is ((unit name, model name), ...)."""

    name: str
    module: nn.Module
    names: tuple[tuple[str, str], ...]

    def model_name(self, unit_name: str) -> str:
        return dict(self.names)[unit_name]


@dataclass(frozen=True)
class TiedGroup:
    """One tensor of the model (``model_name``) held by several units: ``members`` are
    (unit index, the unit's name for it). Their gradients add up to the model's."""

    model_name: str
    members: tuple[tuple[int, str], ...]


@dataclass(frozen=True)
class Units:
    units: tuple[Unit, ...]
    tied: tuple[TiedGroup, ...]

    def __len__(self) -> int:
        return len(self.units)

    def __getitem__(self, index: int) -> Unit:
        return self.units[index]


def pipeline_units(spec: ModelSpec) -> Units:
    """The units of ``spec``'s model, in forward order (see the module docstring)."""
    model = construct_meta(spec)
    if spec.transformer is not None:
        parts = _transformer_parts(model)
    else:
        parts = _stack_parts(model)
    owner = {id(t): name for name, t in model.state_dict(keep_vars=True).items()}
    units = tuple(
        Unit(
            name,
            module,
            tuple((k, owner[id(t)]) for k, t in module.state_dict(keep_vars=True).items()),
        )
        for name, module in parts
    )
    holders: dict[str, list[tuple[int, str]]] = {}
    for index, unit in enumerate(units):
        for unit_name, model_name in unit.names:
            holders.setdefault(model_name, []).append((index, unit_name))
    tied = tuple(
        TiedGroup(name, tuple(members)) for name, members in holders.items() if len(members) > 1
    )
    return Units(units, tied)


@dataclass(frozen=True)
class MoEUnits:
    """One block's mixture of experts as units named as the whole model names their tensors
    (``blocks.<b>.mlp.router.weight``, ``blocks.<b>.mlp.experts.<e>.fc.weight_q``, ...): what an
    expert host and the router's party load their share from (node/pipeline/experts.py), built
    like a stage's units, so a LoRA job's experts come with their frozen weights in int8 and
    their adapters. ``prefix`` is the block's mixture (``blocks.<b>.mlp.``), ``width`` the
    tokens' width, ``dropout`` and ``slot`` its output dropout's."""

    prefix: str
    width: int
    router: Unit
    experts: tuple[Unit, ...]
    dropout: float
    slot: int


def moe_units(spec: ModelSpec, block: int) -> MoEUnits:
    """Block ``block``'s mixture of experts in ``spec``'s model; SpecError when the model has
    no such block or that block's MLP is dense."""
    from .errors import SpecError
    from .moe import MoE

    model = construct_meta(spec)
    blocks = getattr(model, "blocks", ())
    moe = blocks[block].mlp if 0 <= block < len(blocks) else None
    if not isinstance(moe, MoE):
        raise SpecError(
            f"block {block} of this {spec.kind} model is not a mixture of experts "
            f"(it has {len(blocks)} blocks; experts = {getattr(spec.transformer, 'experts', 0)})"
        )
    prefix = f"blocks.{block}.mlp."

    def unit(name: str, module: nn.Module) -> Unit:
        keys = module.state_dict(keep_vars=True)
        return Unit(name, module, tuple((k, f"{prefix}{name}.{k}") for k in keys))

    return MoEUnits(
        prefix=prefix,
        width=int(moe.router.weight.shape[1]),
        router=unit("router", moe.router),
        experts=tuple(unit(f"experts.{e}", m) for e, m in enumerate(moe.experts)),
        dropout=float(moe.drop.p),
        slot=moe.drop.slot,
    )


def _transformer_parts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from .transformer import Head, Transformer

    if not isinstance(model, Transformer):
        raise TypeError(f"expected a Transformer, got {type(model).__name__}")
    head = model.head
    if head.weight is None:  # tied: the head unit holds the token embedding itself
        head = Head(model.head.ln, model.embed.tok)
    return [
        ("embed", model.embed),
        *((f"block_{i}", b) for i, b in enumerate(model.blocks)),
        ("head", head),
    ]


def _stack_parts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from torch import nn

    layers = list(model.children())
    starts = [i for i, layer in enumerate(layers) if type(layer).__name__ in WEIGHTED][1:]
    bounds = list(zip([0, *starts], [*starts, len(layers)], strict=True))
    return [(f"layers_{a}_{b - 1}", nn.Sequential(*layers[a:b])) for a, b in bounds]


def cut_state(unit: Unit, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``unit``'s state (its own names) out of the whole model's ``state``; KeyError naming a
    missing entry. The tensors are ``state``'s (no copy)."""
    return {unit_name: state[model_name] for unit_name, model_name in unit.names}


def put_state(
    unit: Unit, unit_state: Mapping[str, Tensor], state: MutableMapping[str, Tensor]
) -> None:
    """Write ``unit_state`` (the unit's names) into the whole model's ``state``. A tied tensor
    is written by each unit that holds it: put the units' states back after summing."""
    missing = [k for k, _ in unit.names if k not in unit_state]
    if missing or len(unit_state) != len(unit.names):
        extra = sorted(set(unit_state) - {k for k, _ in unit.names})
        raise KeyError(
            f"unit {unit.name}: state must hold exactly its entries (missing {missing[:3]}, "
            f"unexpected {extra[:3]})"
        )
    for unit_name, model_name in unit.names:
        state[model_name] = unit_state[unit_name]


def load_unit(
    unit: Unit,
    unit_state: Mapping[str, Tensor],
    *,
    device: torch.device | None = None,
    share: bool = False,
) -> nn.Module:
    """A module for ``unit`` holding ``unit_state`` (strict: every name and shape must match),
    with nothing initialised at random: a copy on ``device`` (CPU by default), or ``unit_state``'s
    own tensors when ``share`` (read-only use). ``unit.module`` stays on the meta device.
    Raises RuntimeError from ``load_state_dict`` when ``unit_state`` does not fit."""
    import torch

    module = copy.deepcopy(unit.module)
    if not share:
        target = device or torch.device("cpu")
        unit_state = {k: v.detach().to(target, copy=True) for k, v in unit_state.items()}
    module.load_state_dict(dict(unit_state), strict=True, assign=True)
    return module


# -- which samples a pipelined job's step trains on ---------------------------------------------


def step_samples(seed: int, step: int, batch_size: int, total: int) -> list[int]:
    """The dataset indices step ``step`` of a pipelined job trains on: the data in epochs of a
    fresh permutation each (keyed by ``seed`` and the epoch, torch's CPU generator, the same on
    every machine), ``batch_size`` consecutive indices of it per step, a step that crosses an
    epoch's end continuing into the next permutation. Every stage that reads data (the first
    and the last) and a single process replaying the job draw the same indices."""
    import torch

    if total < 1 or batch_size < 1 or step < 0:
        raise ValueError(
            f"step_samples needs total >= 1, batch_size >= 1, step >= 0; got "
            f"{total}, {batch_size}, {step}"
        )
    out: list[int] = []
    position = step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(position, total)
        gen = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % (1 << 63))
        perm = torch.randperm(total, generator=gen)
        take = min(batch_size - len(out), total - offset)
        out.extend(int(i) for i in perm[offset : offset + take])
        position += take
    return out


def micro_batch_slices(batch_size: int, micro_batches: int) -> list[tuple[int, int]]:
    """How a step's ``batch_size`` samples split into ``micro_batches`` contiguous micro-batches,
    as (start, end): as even as possible, the larger ones first. ValueError when a micro-batch
    would be empty."""
    if micro_batches < 1 or batch_size < micro_batches:
        raise ValueError(
            f"{batch_size} samples cannot make {micro_batches} non-empty micro-batches"
        )
    size, extra = divmod(batch_size, micro_batches)
    bounds: list[tuple[int, int]] = []
    start = 0
    for i in range(micro_batches):
        end = start + size + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def lane_slices(batch_size: int, counts: Sequence[int], lane: int) -> list[tuple[int, int]]:
    """The micro-batches pipeline ``lane`` trains in a step (hybrid parallelism): the step's
    ``batch_size`` samples cut into ``sum(counts)`` micro-batches, pipeline ``p`` taking
    ``counts[p]`` consecutive ones after those of the pipelines before it. One pipeline
    (``counts`` of one) trains them all. ValueError for a lane outside ``counts``, a count below
    1, or a micro-batch that would be empty."""
    if not 0 <= lane < len(counts) or min(counts) < 1:
        raise ValueError(f"pipeline {lane} is not one of {list(counts)} (each at least 1)")
    first = sum(counts[:lane])
    return micro_batch_slices(batch_size, sum(counts))[first : first + counts[lane]]


def lane_counts(micro_batches: int, lanes: int, given: Sequence[int] = ()) -> tuple[int, ...]:
    """Each pipeline's micro-batch count in a step: ``given`` (a StageAssignment's
    ``lane_micro_batches``), or ``micro_batches`` for each of ``lanes`` when it says none."""
    return tuple(given) if given else (micro_batches,) * lanes


@dataclass(frozen=True)
class LanePlace:
    """Where a stage sits among a step's pipelines: ``starts`` is one pipeline's stage starts
    (every pipeline cuts the model the same), and the stage is stage ``stage`` of pipeline
    ``lane``."""

    starts: tuple[int, ...]
    lane: int
    stage: int

    @property
    def stages(self) -> int:
        return len(self.starts)


def lane_place(stage_starts: Sequence[int], lanes: int, stage: int) -> LanePlace:
    """Stage ``stage`` of ``stage_starts``, every pipeline's stages one pipeline after another
    (a StageAssignment's), as a `LanePlace`; ValueError when the list does not make ``lanes``
    pipelines cut the same, or ``stage`` is not in it."""
    if lanes < 1 or not stage_starts or len(stage_starts) % lanes:
        raise ValueError(f"{len(stage_starts)} stages do not make {lanes} equal pipelines")
    per = len(stage_starts) // lanes
    starts = tuple(stage_starts[:per])
    for lane in range(1, lanes):
        if tuple(stage_starts[lane * per : (lane + 1) * per]) != starts:
            raise ValueError(
                f"pipeline {lane} is cut at {list(stage_starts[lane * per : (lane + 1) * per])},"
                f" pipeline 0 at {list(starts)}: every pipeline must cut the model the same"
            )
    if not 0 <= stage < len(stage_starts):
        raise ValueError(f"stage {stage} is not one of the {len(stage_starts)}")
    return LanePlace(starts, stage // per, stage % per)
