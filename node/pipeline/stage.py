"""One pipeline stage: its contiguous share of a model's units, and its part of a training step.

A model that pipelines is an ordered list of ``nn.Module`` units; ``cut`` makes contiguous stages
of it. Each step, ``StageRunner.run_step`` runs this stage's forwards and backwards over the
step's micro-batches in the schedule's order (node/pipeline/schedule.py): stage 0 reads the inputs,
the others receive activations from the stage before; each forward's output goes on to the next
stage; the last stage computes the loss, each micro-batch's loss weighted by its share of the
step's samples (the step's mean loss); a backward receives its output gradient from the next
stage and sends its input gradient back. At the step's end every stage sums the gradients of
its tied parameters with the other stages of their groups and applies its optimizer (the
optimizer node/trainer.py builds from the job's TrainConfig) to its own parameters. With
deterministic units (no dropout), a step's result equals single-process training with gradient
accumulation over the same micro-batches.

What crosses a cut may travel encoded (the job's ``[pipeline] boundary``): a ``BoundaryCode``
for each of the stage's cuts encodes what it sends and decodes what it receives, after the
transport has checked the encoded form. At the steps the hub may check (``sketched``) each
activation and gradient also carries the stage's sketch of the raw tensor before it is encoded
(protocol/stagesketch.py), which the hub's referee compares with its own recomputation.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
from gpuflex.protocol.boundarycodec import BoundaryCode
from gpuflex.protocol.dropout import dropout_step
from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.moe import routers_aux_loss
from gpuflex.protocol.stagesketch import encode_sketch
from gpuflex.protocol.tensors import TensorSpec
from torch import Tensor, nn

from ..computeshare import ComputeShare
from ..errors import PipelineError
from ..optim import LocalOptimizer
from .schedule import stage_actions
from .transport import MessageKey, Transport, spec_of

#: a mean-reduced loss of (output, target)
LossFn = Callable[[Tensor, Tensor], Tensor]


def cut(units: Sequence[nn.Module], starts: Sequence[int]) -> list[nn.Sequential]:
    """The stages of ``units``: stage i holds units ``starts[i]`` up to ``starts[i + 1]`` (the last
    up to the end). ``starts`` begins at 0 and rises; each stage is a private copy, so that two
    stages never share a parameter (a tied one is summed by ``TiedGroup`` instead)."""
    bounds = [*starts, len(units)]
    if not starts or starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(bounds)):
        raise PipelineError(
            f"stage starts {list(starts)} do not cut {len(units)} units into non-empty "
            "contiguous stages (they begin at 0 and rise)"
        )
    return [copy.deepcopy(nn.Sequential(*units[a:b])) for a, b in itertools.pairwise(bounds)]


@dataclass(frozen=True)
class TiedGroup:
    """One parameter held by several stages (an embedding tied to the output layer): ``members``
    are (stage, parameter name in that stage's module). Their gradients are summed, in stage
    order, before the step, so every copy takes the same update."""

    members: tuple[tuple[int, str], ...]

    def stages(self) -> tuple[int, ...]:
        return tuple(sorted(stage for stage, _ in self.members))


def boundary_specs(stages: Sequence[nn.Module], example: Tensor) -> list[TensorSpec]:
    """What passes between stage i and i+1 for one micro-batch like ``example``: found by running
    the stages on the meta device (no memory, no compute); a unit with an op torch cannot run
    there (a mixture of experts' routing picks tokens by value) runs on zeros on the CPU."""
    specs: list[TensorSpec] = []
    x = example.to("meta")
    with torch.no_grad():
        for module in stages[:-1]:
            units = list(module.children()) if isinstance(module, nn.Sequential) else [module]
            for unit in units:
                x = _output_of(unit, x)
            if not isinstance(x, Tensor) or not x.is_floating_point():
                raise PipelineError(
                    "a stage must hand the next one a floating-point tensor (a gradient flows back)"
                )
            specs.append(spec_of(x, "activation"))
    return specs


def _output_of(unit: nn.Module, x: Tensor) -> Tensor:
    """``unit``'s output for the meta tensor ``x``, as a meta tensor: run on the meta device, or
    when an op has no meta kernel, on zeros of its tensors and of ``x`` on the CPU (one unit's
    worth of memory, for a moment)."""
    try:
        out = copy.deepcopy(unit).to("meta")(x)
    except NotImplementedError:
        state = {n: torch.zeros_like(t, device="cpu") for n, t in unit.state_dict().items()}
        out = torch.func.functional_call(unit, state, (torch.zeros_like(x, device="cpu"),))
    if not isinstance(out, Tensor):
        raise PipelineError(f"a pipeline unit returns {type(out).__name__}, not one tensor")
    return out.to("meta")


@dataclass
class StageRunner:
    """Stage ``stage`` of ``stages``: runs its share of each step and steps its own parameters.

    ``inbound``: the activation it receives per micro-batch (stage > 0); ``outbound``: the one it
    sends (stage < last), whose gradient comes back; ``loss_fn`` on the last stage only.
    ``inbound_code``/``outbound_code``: how the tensors of those two cuts travel (None: as they
    are); each must describe its cut's raw tensor.
    """

    module: nn.Module
    stage: int
    stages: int
    transport: Transport
    optimizer: LocalOptimizer
    inbound: TensorSpec | None = None
    outbound: TensorSpec | None = None
    loss_fn: LossFn | None = None
    schedule: str = "1f1b"
    tied: Sequence[TiedGroup] = ()
    timeout_s: float = 60.0
    #: the training seed: dropout masks are keyed by (seed, step, micro-batch) (protocol/dropout.py),
    #: so every stage draws what one process training the whole model would
    seed: int = 0
    inbound_code: BoundaryCode | None = None
    outbound_code: BoundaryCode | None = None
    #: hybrid parallelism: this stage is stage ``stage`` of pipeline ``lane`` of ``lanes``, which
    #: share each step's micro-batches (``lane``'s are ``lane * micro_batches`` onwards) and sum
    #: their stage's gradients before the optimizer steps; messages name stages across every
    #: pipeline (stage ``s`` of pipeline ``p`` is ``p * stages + s``)
    lane: int = 0
    lanes: int = 1
    #: the samples of the whole step (every pipeline's), which weigh each micro-batch's loss;
    #: 0: the last stage's own targets (one pipeline)
    batch_samples: int = 0
    #: this pipeline's first micro-batch of the step when pipelines run different counts
    #: (None: ``lane * micro_batches``)
    first_micro_batch: int | None = None
    #: the node's ``--compute-share``: each forward, backward and optimizer step is followed by
    #: its rest (None or a share of 1: none)
    pace: ComputeShare | None = None
    #: the steps whose activations and gradients carry a sketch of the raw tensor (the steps the
    #: hub may check, node/stagelinks.checked_step; None: none)
    sketched: Callable[[int], bool] | None = None
    #: the last step's end, in seconds: summing the gradients shared with other stages and
    #: pipelines and the optimizer step, less the transport's waits (work that does not grow
    #: with the step's micro-batches; the hub's planner keeps it apart from the per-sample work)
    update_s: float = field(default=0.0, init=False)
    _first: int = field(default=0, repr=False)  # this lane's first micro-batch of the step
    #: per micro-batch in flight: its input (None on stage 0), what its backward starts from (the
    #: output, or the last stage's weighted loss) and this stage's routers' weighted balancing loss
    _held: dict[int, tuple[Tensor | None, Tensor, Tensor | None]] = field(
        default_factory=dict, repr=False
    )

    def __post_init__(self) -> None:
        last = self.stage == self.stages - 1
        if (self.stage > 0) != (self.inbound is not None) or (not last) != (
            self.outbound is not None
        ):
            raise PipelineError(
                f"stage {self.stage} of {self.stages} needs an inbound spec exactly when it is not "
                "the first and an outbound spec exactly when it is not the last"
            )
        if not 0 <= self.lane < self.lanes:
            raise PipelineError(f"pipeline {self.lane} is not one of {self.lanes}")
        if last != (self.loss_fn is not None):
            raise PipelineError("the last stage, and only it, computes the loss")
        for spec, code in ((self.inbound, self.inbound_code), (self.outbound, self.outbound_code)):
            if code is not None and (spec is None or code.raw != spec):
                raise PipelineError(
                    f"stage {self.stage}'s boundary code is for {code.raw}, its cut carries {spec}"
                )

    def run_step(
        self,
        step: int,
        micro_batches: int,
        *,
        inputs: Sequence[Tensor] = (),
        targets: Sequence[Tensor] = (),
    ) -> float | None:
        """Run step ``step`` over ``micro_batches``: ``inputs`` on stage 0, ``targets`` on the last.
        Returns the step's mean loss on the last stage, None elsewhere."""
        first, last = self.stage == 0, self.stage == self.stages - 1
        if (first and len(inputs) != micro_batches) or (last and len(targets) != micro_batches):
            raise PipelineError(
                f"stage {self.stage} needs {micro_batches} micro-batches of its data"
            )
        samples = self.batch_samples or sum(int(t.shape[0]) for t in targets)
        self._first = self._first_of(micro_batches)
        self.optimizer.zero_grad()
        self._held.clear()
        ahead = getattr(self.transport, "expect", None)
        if ahead is not None:  # a transport that asks for the step's tensors before they are due
            ahead(self.receives(step, micro_batches))
        loss_sum = 0.0
        for action in stage_actions(
            self.schedule, stage=self.stage, stages=self.stages, micro_batches=micro_batches
        ):
            i = action.micro_batch
            if action.op == "F":
                loss = self._forward(
                    step, i, inputs[i] if first else None, targets[i] if last else None, samples
                )
                if loss is not None:
                    loss_sum += float(loss.detach())
            else:
                self._backward(step, i)
        started, waited = time.perf_counter(), getattr(self.transport, "waited", 0.0)
        self._sum_tied(step)
        self._sum_lanes(step)
        with self._computing():
            self.optimizer.step()
        waits = getattr(self.transport, "waited", 0.0) - waited
        self.update_s = max(time.perf_counter() - started - waits, 0.0)
        return loss_sum if last else None

    def receives(self, step: int, micro_batches: int) -> list[MessageKey]:
        """What this stage receives in step ``step``, in the order ``run_step`` receives it: per
        forward the activation from the stage before, per backward the gradient from the stage
        after (the schedule's order), then each tied group's gradients from the other stages, then
        the other pipelines' gradients of this stage's units."""
        keys: list[MessageKey] = []
        first = self._first_of(micro_batches)
        for action in stage_actions(
            self.schedule, stage=self.stage, stages=self.stages, micro_batches=micro_batches
        ):
            i = first + action.micro_batch
            if action.op == "F" and self.stage > 0:
                keys.append(self._from(step, i, "activation", self.stage - 1))
            elif action.op == "B" and self.stage < self.stages - 1:
                keys.append(self._from(step, i, "gradient", self.stage + 1))
        for g, group in self._trained_ties():
            keys += [self._from(step, g, "tied", s) for s in group.stages() if s != self.stage]
        for lane in range(self.lanes):
            if lane != self.lane:
                keys += [
                    self._replica_key(step, u, lane, self.lane)
                    for u in range(len(self._lane_units()))
                ]
        return keys

    def _computing(self) -> AbstractContextManager[None]:
        """A piece of this stage's compute, rested for under the node's compute share."""
        return contextlib.nullcontext() if self.pace is None else self.pace.computing()

    def _device(self) -> torch.device:
        first = next(self.module.parameters(), None)
        return first.device if first is not None else torch.device("cpu")

    def _first_of(self, micro_batches: int) -> int:
        """This pipeline's first micro-batch of a step."""
        if self.first_micro_batch is not None:
            return self.first_micro_batch
        return self.lane * micro_batches

    def _at(self, stage: int, lane: int | None = None) -> int:
        """Stage ``stage`` of pipeline ``lane`` (this one's by default) as messages name it."""
        return (self.lane if lane is None else lane) * self.stages + stage

    def _key(self, step: int, micro_batch: int, carries: str, to_stage: int) -> MessageKey:
        """A message from this stage to stage ``to_stage`` of this pipeline."""
        return MessageKey(step, micro_batch, carries, self._at(self.stage), self._at(to_stage))

    def _from(self, step: int, micro_batch: int, carries: str, stage: int) -> MessageKey:
        """A message to this stage from stage ``stage`` of this pipeline."""
        return MessageKey(step, micro_batch, carries, self._at(stage), self._at(self.stage))

    def _replica_key(self, step: int, unit: int, lane: int, to_lane: int) -> MessageKey:
        return MessageKey(
            step, unit, "replica", self._at(self.stage, lane), self._at(self.stage, to_lane)
        )

    def _send(self, key: MessageKey, tensor: Tensor, code: BoundaryCode | None) -> None:
        wire = tensor if code is None else code.encode(tensor)
        if self.sketched is None or not self.sketched(key.step):
            self.transport.send(key, wire)
            return
        try:
            sketch = encode_sketch(tensor)
        except ProtocolError as exc:
            raise PipelineError(f"{key.describe()} cannot be sketched: {exc}") from None
        self.transport.send(key, wire, sketch)

    def _receive(self, key: MessageKey, raw: TensorSpec, code: BoundaryCode | None) -> Tensor:
        """The tensor sent under ``key``, checked in its encoded form, decoded, on this device."""
        expected = raw if code is None else code.wire
        received = self.transport.receive(key, expected, timeout_s=self.timeout_s)
        # a transport hands over CPU tensors (they crossed a wire): onto this stage's device
        received = received.to(self._device())
        if code is None:
            return received
        try:
            return code.decode(received)
        except ProtocolError as exc:
            raise PipelineError(f"{key.describe()} is refused: {exc}") from None

    def _forward(
        self, step: int, i: int, x: Tensor | None, y: Tensor | None, samples: int
    ) -> Tensor | None:
        if x is None:
            if self.inbound is None:
                raise PipelineError("stage 0 needs its inputs")
            key = self._from(step, self._first + i, "activation", self.stage - 1)
            received = self._receive(key, self.inbound, self.inbound_code)
            x_in: Tensor | None = received.requires_grad_(True)
            with self._computing(), dropout_step(self.seed, step, part=self._first + i):
                out = self.module(x_in)
        else:
            x_in = None  # stage 0's inputs need no gradient
            with self._computing(), dropout_step(self.seed, step, part=self._first + i):
                out = self.module(x)
        aux = self._aux_loss(out, samples)
        if y is None:
            key = self._key(step, self._first + i, "activation", self.stage + 1)
            self._send(key, out, self.outbound_code)
            self._held[i] = (x_in, out, aux)
            return None
        if self.loss_fn is None:
            raise PipelineError("the last stage needs its loss")
        # (micro-batch's mean loss) x (its share of the step's samples): the step's mean, summed
        with self._computing():
            loss = self.loss_fn(out, y) * (int(y.shape[0]) / samples)
        self._held[i] = (x_in, loss, aux)
        return loss

    def _aux_loss(self, out: Tensor, samples: int) -> Tensor | None:
        """This stage's routers' balancing loss of the forward just run (a mixture of experts'
        blocks), weighted as one process weighs it: by the micro-batch's share of the step."""
        aux = routers_aux_loss(self.module)
        if aux is None:
            return None
        if samples <= 0:
            raise PipelineError(
                f"stage {self.stage} holds experts' routers and needs the step's sample count"
            )
        return aux * (int(out.shape[0]) / samples)

    def _backward(self, step: int, i: int) -> None:
        x_in, out, aux = self._held.pop(i)
        roots: list[Tensor] = []
        grads: list[Tensor] = []
        if self.outbound is None:  # the last stage: ``out`` is the weighted loss
            roots.append(out)
            grads.append(torch.ones_like(out))
        else:
            key = self._from(step, self._first + i, "gradient", self.stage + 1)
            grad = self._receive(key, self.outbound, self.outbound_code)
            if out.requires_grad:  # else nothing before it trains (a LoRA job's frozen embedding)
                roots.append(out)
                grads.append(grad.to(out.device))
        if aux is not None and aux.requires_grad:
            roots.append(aux)
            grads.append(torch.ones_like(aux))
        if roots:
            with self._computing():
                torch.autograd.backward(roots, grads)
        if x_in is not None:
            if x_in.grad is None:
                raise PipelineError(f"stage {self.stage}'s input received no gradient")
            key = self._key(step, self._first + i, "gradient", self.stage - 1)
            self._send(key, x_in.grad, self.inbound_code)

    def _trained_ties(self) -> list[tuple[int, TiedGroup]]:
        """The tied groups this stage holds a member of, with their index, when that member
        trains (a LoRA job's frozen embedding is tied and frozen on every stage alike: its
        stages sum nothing)."""
        params = dict(self.module.named_parameters())
        out = []
        for g, group in enumerate(self.tied):
            mine = [name for stage, name in group.members if stage == self.stage]
            param = params.get(mine[0]) if mine else None
            if mine and (param is None or param.requires_grad):
                out.append((g, group))
        return out

    def _sum_tied(self, step: int) -> None:
        params = dict(self.module.named_parameters())
        for g, group in self._trained_ties():
            mine = [name for stage, name in group.members if stage == self.stage]
            param = params.get(mine[0])
            if param is None or param.grad is None:
                raise PipelineError(
                    f"stage {self.stage} has no gradient for tied parameter {mine[0]!r}"
                )
            own = param.grad.detach().clone()
            expected = spec_of(own, "tied")
            others = [s for s in group.stages() if s != self.stage]
            for other in others:
                self.transport.send(self._key(step, g, "tied", other), own)
            total: Tensor | None = None
            for s in group.stages():  # the same order on every stage: identical sums
                part = (
                    own
                    if s == self.stage
                    else self.transport.receive(
                        self._from(step, g, "tied", s),
                        expected,
                        timeout_s=self.timeout_s,
                    ).to(own.device)
                )
                total = part.clone() if total is None else total.add_(part)
            param.grad = total

    def _lane_units(self) -> list[list[nn.Parameter]]:
        """Each of the stage's units' trainable parameters, in the unit's order: what the
        pipelines of a step sum, one message per unit."""
        return [unit_parameters(unit) for unit in self.module.children()]

    def _sum_lanes(self, step: int) -> None:
        """Every pipeline's gradients of this stage's units, summed in pipeline order (the same
        sum, bit for bit, on every pipeline), in place of this pipeline's own. Each unit's own
        gradients are read before any is replaced (a parameter tied across two units of the
        stage appears in both)."""
        if self.lanes == 1:
            return
        units = self._lane_units()
        owns = [
            torch.cat(
                [
                    (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
                    for p in params
                ]
            ).float()
            if params
            else None
            for params in units
        ]
        for u, own in enumerate(owns):
            for lane in range(self.lanes):
                if own is not None and lane != self.lane:
                    self.transport.send(self._replica_key(step, u, self.lane, lane), own)
        for u, (params, own) in enumerate(zip(units, owns, strict=True)):
            if own is None:
                continue
            total: Tensor | None = None
            for lane in range(self.lanes):  # the same order on every pipeline: identical sums
                part = (
                    own
                    if lane == self.lane
                    else self.transport.receive(
                        self._replica_key(step, u, lane, self.lane),
                        spec_of(own, "replica"),
                        timeout_s=self.timeout_s,
                    ).to(own.device)
                )
                if total is None:  # a received tensor is this stage's own; its own was sent
                    total = part.clone() if part is own else part
                else:
                    total.add_(part)
            if total is None:
                continue
            offset = 0
            for p in params:  # views of the sum: one pass over the gradients, no copies
                p.grad = total[offset : offset + p.numel()].view_as(p).to(p.dtype)
                offset += p.numel()


def unit_parameters(unit: nn.Module) -> list[nn.Parameter]:
    """A unit's trainable parameters in its state's order (a parameter registered twice, twice):
    what pipelines sharing a step sum for it, flattened into one "replica" message."""
    return [p for _, p in unit.named_parameters(remove_duplicate=False) if p.requires_grad]


def replica_length(unit: nn.Module) -> int:
    """The length of a unit's "replica" message: its trainable parameters' elements."""
    return sum(p.numel() for p in unit_parameters(unit))


__all__ = [
    "LossFn",
    "StageRunner",
    "TiedGroup",
    "boundary_specs",
    "cut",
    "replica_length",
    "unit_parameters",
]
