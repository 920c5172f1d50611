"""What each pipeline unit of a model costs, measured rather than estimated: the bytes of its
parameters, their gradients and the optimizer's state, the bytes it keeps per sample for the
backward pass and sends to the next stage, and its forward and backward FLOPs per sample.

The units (an ordered sequence of torch modules, the cut points a pipeline may choose between)
run on the meta device: shapes and dtypes flow through every op, no memory is allocated and no
arithmetic is done, so a model far larger than this machine is analysed in milliseconds. Each
unit runs forward and backward twice, at two batch sizes, and a per-sample figure is the slope
between them: what does not grow with the batch (a weight an op saves for its backward, a
normalisation's statistics) is not an activation. A unit with an op torch cannot run on the
meta device is measured the same way on a tiny zero-filled batch on the CPU. The planner
(hub/policy/pipeline_plan.py) reads the result as plain numbers; docs/pipeline.md describes
the cost model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from .errors import SpecError

if TYPE_CHECKING:  # torch loads where a model is analysed, not on import (CLI start-up)
    import torch
    from torch import nn

#: the two batch sizes whose difference gives the per-sample figures
_BATCHES: Final = (2, 4)


@dataclass(frozen=True)
class UnitCost:
    """One unit's measured cost. Bytes of state are per replica of the unit; activation bytes
    and FLOPs are per sample (a micro-batch of m samples costs m times as much)."""

    index: int
    name: str  # the unit's class name, for people reading a plan
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    #: what the unit's ops save for the backward pass, per sample (its input included when an op saves it)
    saved_bytes: int
    #: its output, per sample: what a stage ending here sends forward (and gets back as a gradient)
    output_bytes: int
    forward_flops: float
    backward_flops: float

    @property
    def state_bytes(self) -> int:
        """Parameters, gradients and optimizer state: what a stage holding the unit keeps all step."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def flops(self) -> float:
        """Forward and backward FLOPs per sample."""
        return self.forward_flops + self.backward_flops


def optimizer_state_factor(optimizer: str, momentum: float = 0.0) -> int:
    """Optimizer-state bytes per parameter byte for a job's optimizer (protocol/jobspec.py's
    names): plain SGD keeps nothing, SGD with momentum one buffer, Adam and AdamW two moments."""
    if optimizer == "sgd":
        return 1 if momentum > 0.0 else 0
    if optimizer in ("adam", "adamw"):
        return 2
    raise SpecError(f"train.optimizer: {optimizer!r} is not one of sgd, adam, adamw")


def analyse_units(
    units: Sequence[nn.Module],
    sample_shape: Sequence[int],
    sample_dtype: torch.dtype,
    *,
    optimizer: str = "sgd",
    momentum: float = 0.0,
) -> tuple[UnitCost, ...]:
    """The cost of each unit of ``units``, in order. ``sample_shape`` and ``sample_dtype``: one
    sample of the first unit's input (no batch dimension); each later unit gets the output of
    the one before. The units are read, not changed (their train/eval flags are restored).

    SpecError when there are no units, the sample shape is not positive, the optimizer is not
    known, or a unit cannot run on what the one before it outputs (one line, naming the unit)."""
    if not units:
        raise SpecError("the model has no pipeline units to analyse")
    shape = tuple(int(s) for s in sample_shape)
    if any(s <= 0 for s in shape):
        raise SpecError(f"sample shape {shape}: every dimension must be > 0")
    factor = optimizer_state_factor(optimizer, momentum)
    costs: list[UnitCost] = []
    for index, unit in enumerate(units):
        name = type(unit).__name__
        with _training(unit):
            try:
                runs = [
                    _measure(unit, index, name, shape, sample_dtype, b, "meta") for b in _BATCHES
                ]
            except _NoMetaKernel:  # an op torch cannot run on meta: a tiny real batch on the CPU
                runs = [
                    _measure(unit, index, name, shape, sample_dtype, b, "cpu") for b in _BATCHES
                ]
        small, large = runs
        extra = _BATCHES[1] - _BATCHES[0]
        output = large.output
        trainable = sum(_nbytes(p) for p in unit.parameters() if p.requires_grad)
        costs.append(
            UnitCost(
                index=index,
                name=name,
                param_bytes=sum(_nbytes(p) for p in unit.parameters())
                + sum(_nbytes(b) for b in unit.buffers()),
                grad_bytes=trainable,
                optimizer_bytes=factor * trainable,
                saved_bytes=max(0, (large.saved - small.saved) // extra),
                output_bytes=max(0, (large.output_bytes - small.output_bytes) // extra),
                forward_flops=max(0.0, (large.forward - small.forward) / extra),
                backward_flops=max(0.0, (large.backward - small.backward) / extra),
            )
        )
        shape, sample_dtype = tuple(output.shape[1:]), output.dtype
    return tuple(costs)


@dataclass(frozen=True)
class _Run:
    saved: int
    output_bytes: int
    forward: float
    backward: float
    output: torch.Tensor


class _NoMetaKernel(Exception):
    """An op of the unit has no meta implementation."""


def _measure(
    unit: nn.Module,
    index: int,
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    batch: int,
    where: str,
) -> _Run:
    """One forward and backward of ``unit`` on a batch of ``batch`` samples, on the meta device
    (``where`` "meta") or, zero-filled, on the CPU ("cpu"); the unit's own tensors are not used."""
    import torch
    from torch.func import functional_call
    from torch.utils.flop_counter import FlopCounterMode

    device = torch.device(where)
    state: dict[str, torch.Tensor] = {
        n: torch.zeros_like(p, device=device).requires_grad_(p.requires_grad)
        for n, p in unit.named_parameters()
    }
    state.update({n: torch.zeros_like(b, device=device) for n, b in unit.named_buffers()})
    # the input of any unit but the first is another stage's output: its gradient is sent back
    needs_grad = index > 0 and dtype.is_floating_point
    x = torch.zeros((batch, *shape), dtype=dtype, device=device, requires_grad=needs_grad)
    saved: dict[int, torch.Tensor] = {}
    try:
        with torch.autograd.graph.saved_tensors_hooks(_keeper(saved), lambda t: t):
            with FlopCounterMode(display=False) as forward:
                out = functional_call(unit, state, (x,))
        if not isinstance(out, torch.Tensor):
            raise SpecError(
                f"pipeline unit {index} ({name}) returns {type(out).__name__}, not one tensor"
            )
        with FlopCounterMode(display=False) as backward:
            if out.requires_grad:
                torch.autograd.backward(out, torch.ones_like(out))
    except NotImplementedError as exc:
        if where == "meta":
            raise _NoMetaKernel from exc
        raise SpecError(f"pipeline unit {index} ({name}) cannot run: {_first_line(exc)}") from None
    except (RuntimeError, TypeError, ValueError) as exc:
        line = _first_line(exc)
        raise SpecError(
            f"pipeline unit {index} ({name}) cannot run on input {(batch, *shape)} {dtype}: {line}"
        ) from None
    return _Run(
        saved=sum(_nbytes(t) for t in saved.values()),
        output_bytes=_nbytes(out),
        forward=float(forward.get_total_flops()),
        backward=float(backward.get_total_flops()),
        output=out.detach(),
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else type(exc).__name__


def _keeper(saved: dict[int, torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A pack hook that notes each tensor saved for backward once: a view counts as its base
    (the memory it keeps alive), and a tensor saved by two ops counts once."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        saved.setdefault(id(base), base)  # the dict holds a reference, so no id is reused meanwhile
        return t

    return pack


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel()) * int(t.element_size())


@contextmanager
def _training(unit: nn.Module) -> Iterator[None]:
    """``unit`` in training mode (dropout saves its mask), its modules' flags restored after."""
    flags = [(m, m.training) for m in unit.modules()]
    unit.train()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


__all__ = ["UnitCost", "analyse_units", "optimizer_state_factor"]
