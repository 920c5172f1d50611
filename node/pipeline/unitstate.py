"""A stage's units and their durable state: what a unit-state blob holds, and the stage module and
optimizer made from such blobs.

A unit-state blob (GFT1, protocol/tensors.py) holds the unit's parameters and buffers under the
unit's own state-dict names (``Unit.names``' first elements) and, once its optimizer keeps state,
``optim.<slot>.<name>`` for each trainable parameter (``momentum_buffer`` for SGD with momentum,
``exp_avg`` and ``exp_avg_sq`` for Adam and AdamW) plus ``optim.step`` (int64, shape [1]) for
Adam and AdamW: everything a stage needs to go on from the step the blob was written at.

A tied tensor (a transformer's token embedding, used again by its head) is one parameter of
the model held by two units. Within a stage the units holding it share one ``nn.Parameter``; across
stages each stage holds a copy, and ``cross_stage_ties`` names the groups whose gradients the
stages sum each step (node/pipeline/stage.TiedGroup). Every blob of a unit that holds a tied
tensor carries it, and its optimizer state, whole.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.pipeline import TiedGroup as UnitTies
from gpuflex.protocol.pipeline import Unit, cut_state, load_unit
from gpuflex.protocol.tensors import Buffer, TensorSpec, check_finite, decode_state, manifest_of
from torch import Tensor, nn

from ..errors import PipelineError
from ..optim import Adam, LocalOptimizer
from .stage import TiedGroup

OPTIM = "optim."
STEP = "optim.step"


@dataclass(frozen=True)
class UnitTensors:
    """One unit's tensors as a blob gives them: ``params`` (its state dict) and ``optim`` (the
    ``optim.*`` entries, without the prefix: ``<slot>.<name>`` and ``step``)."""

    params: dict[str, Tensor]
    optim: dict[str, Tensor]


def unit_manifest(unit: Unit) -> dict[str, TensorSpec]:
    """The names, dtypes and shapes of ``unit``'s state dict (from its meta module)."""
    return {spec.name: spec for spec in manifest_of(unit.module.state_dict())}


def _check_params(unit: Unit, params: Mapping[str, Tensor], what: str) -> None:
    want = unit_manifest(unit)
    have = {spec.name: spec for spec in manifest_of(params)}
    if have != want:
        wrong = sorted(set(want) ^ set(have)) or [n for n in want if want[n] != have[n]]
        raise PipelineError(
            f"{what} does not fit unit {unit.name}: {len(have)} tensors for its {len(want)} "
            f"(first difference: {wrong[0]!r})"
        )


def read_unit_state(unit: Unit, data: Buffer, what: str) -> UnitTensors:
    """The state of ``unit`` in the blob ``data``; PipelineError in one line when it is not GFT1,
    lacks or adds a parameter, has another shape or dtype, or holds NaN."""
    try:
        state = decode_state(data)
        check_finite(state)
    except ProtocolError as exc:
        raise PipelineError(f"{what} is refused: {exc}") from None
    params = {k: v for k, v in state.items() if not k.startswith(OPTIM)}
    optim = {k[len(OPTIM) :]: v for k, v in state.items() if k.startswith(OPTIM)}
    _check_params(unit, params, what)
    return UnitTensors(params, optim)


def state_from_model(unit: Unit, model: Mapping[str, Tensor]) -> UnitTensors:
    """``unit``'s share of the whole model's state (a fresh optimizer: no ``optim``)."""
    try:
        params = cut_state(unit, model)
    except KeyError as exc:
        raise PipelineError(f"the job's model has no tensor {exc} of unit {unit.name}") from None
    _check_params(unit, params, "the job's model")
    try:
        check_finite(params)
    except ProtocolError as exc:
        raise PipelineError(f"the job's model is refused: {exc}") from None
    return UnitTensors(params, {})


def _owner(module: nn.Module, path: str) -> tuple[nn.Module, str]:
    *parents, leaf = path.split(".")
    for name in parents:
        module = getattr(module, name)
    return module, leaf


def build_stage(
    units: Sequence[Unit],
    states: Sequence[UnitTensors],
    *,
    first_unit: int,
    ties: Sequence[UnitTies],
    device: torch.device,
) -> nn.Sequential:
    """The stage's module: units ``first_unit`` on, each holding its state on ``device``, in one
    ``nn.Sequential`` (child ``i`` is unit ``first_unit + i``). Units of the stage that hold one
    tied tensor share the first one's parameter."""
    try:
        modules = [
            load_unit(u, s.params, device=device) for u, s in zip(units, states, strict=True)
        ]
    except RuntimeError as exc:
        first = " ".join(str(exc).split())[:200]
        raise PipelineError(f"a unit's state does not load: {first}") from None
    end = first_unit + len(units)
    for group in ties:
        mine = sorted(m for m in group.members if first_unit <= m[0] < end)
        if len(mine) < 2:
            continue
        source, source_name = mine[0]
        shared = modules[source - first_unit].get_parameter(source_name)
        for index, name in mine[1:]:
            parent, leaf = _owner(modules[index - first_unit], name)
            setattr(parent, leaf, shared)
    return nn.Sequential(*modules)


def cross_stage_ties(ties: Sequence[UnitTies], starts: Sequence[int]) -> tuple[TiedGroup, ...]:
    """The model's tied groups that span several stages of the cut ``starts``, in the model's
    order (a group's index is its number in the relay's tied messages): for each stage holding
    the tensor, the name of its first holder in that stage's module (``<child>.<unit name>``)."""
    out = []
    for group in ties:
        by_stage: dict[int, str] = {}
        for index, name in sorted(group.members):
            stage = max(s for s, start in enumerate(starts) if start <= index)
            by_stage.setdefault(stage, f"{index - starts[stage]}.{name}")
        if len(by_stage) > 1:
            out.append(TiedGroup(tuple(sorted(by_stage.items()))))
    return tuple(out)


def stage_starts_ok(starts: Sequence[int], units: int) -> bool:
    """Whether ``starts`` cuts ``units`` units into non-empty contiguous stages from unit 0."""
    bounds = [*starts, units]
    return bool(starts) and starts[0] == 0 and all(b > a for a, b in itertools.pairwise(bounds))


def _trainable_index(optimizer: LocalOptimizer) -> dict[int, int]:
    return {id(p): i for i, p in enumerate(optimizer.params)}


def unit_blob_state(
    module: nn.Module, optimizer: LocalOptimizer, slots: Mapping[str, list[Tensor]]
) -> dict[str, Tensor]:
    """What a unit-state blob of ``module`` (one child of the stage) holds now, on the CPU:
    ``slots`` is ``optimizer.state_slots()``, taken once for all the stage's units."""
    state = {k: v.detach().to("cpu") for k, v in module.state_dict().items()}
    index = _trainable_index(optimizer)
    for slot, values in slots.items():
        for name, p in module.named_parameters():
            if id(p) in index:
                state[f"{OPTIM}{slot}.{name}"] = values[index[id(p)]].detach().to("cpu")
    if isinstance(optimizer, Adam):
        state[STEP] = torch.tensor([optimizer.steps], dtype=torch.int64)
    return state


def _step_of(optim: Mapping[str, Tensor]) -> int:
    """A blob's ``optim.step`` (0 when it has none: SGD keeps no count)."""
    step = optim.get(STEP[len(OPTIM) :])
    if step is None:
        return 0
    if step.dtype != torch.int64 or tuple(step.shape) != (1,) or int(step[0]) < 0:
        raise PipelineError(f"{STEP} is {step.dtype} {list(step.shape)}, expected int64 [1], >= 0")
    return int(step[0])


def load_optimizer_state(
    optimizer: LocalOptimizer,
    stage: nn.Sequential,
    states: Sequence[UnitTensors],
    *,
    first_unit: int = 0,
) -> None:
    """Give ``optimizer`` (over ``stage``'s trainable parameters) the state the units' blobs carry;
    a fresh optimizer when none carries any. PipelineError when some carry it and some do not,
    or it does not fit."""
    carried = [s.optim for s in states if s.optim]
    if not carried:
        return
    if len(carried) != len(states):
        raise PipelineError("some of the stage's unit states carry optimizer state and some do not")
    steps = {_step_of(s) for s in carried}
    if len(steps) > 1:
        raise PipelineError(
            f"the stage's unit states were written at different steps {sorted(steps)}"
        )
    slot_names = sorted({k.split(".", 1)[0] for s in carried for k in s if "." in k})
    holder: dict[int, tuple[int, str]] = {}
    index = _trainable_index(optimizer)
    for u, child in enumerate(stage):
        for name, p in child.named_parameters():
            if id(p) in index:
                holder.setdefault(index[id(p)], (u, name))
    slots: dict[str, list[Tensor]] = {}
    for slot in slot_names:
        values = []
        for i in range(len(optimizer.params)):
            u, name = holder[i]
            value = states[u].optim.get(f"{slot}.{name}")
            if value is None:
                raise PipelineError(f"the state of unit {first_unit + u} lacks optim.{slot}.{name}")
            values.append(value)
        slots[slot] = values
    try:
        optimizer.load_state_slots(slots, steps.pop())
    except ValueError as exc:
        raise PipelineError(f"the units' optimizer state does not fit: {exc}") from None


__all__ = [
    "UnitTensors",
    "build_stage",
    "cross_stage_ties",
    "load_optimizer_state",
    "read_unit_state",
    "stage_starts_ok",
    "state_from_model",
    "unit_blob_state",
    "unit_manifest",
]
