"""A piece of one layer computed by another party, through a ``Transport``: forward and backward.

The caller (a mixture-of-experts layer's router, or the party that holds a layer split by
width) sends each callee a small int64 header (what the callee needs to know the input's shape:
its experts' token counts, or the input's shape) and the input; the callee runs its piece with
autograd and sends the output back. In the backward pass the caller sends the output's gradient
and the callee answers with the input's gradient (its parameters' gradients stay with it).

On the caller's side :func:`exchange` is one autograd function over every callee of a layer: it
sends to all of them before it waits for any, so the callees compute at the same time; the
caller's own share of the layer runs as ordinary autograd around it (a mixture of experts' router
runs its calls in rounds of its own, node/pipeline/expertrounds.py, to route around a host that
does not answer; it keeps these keys and kinds). On a callee's side a
:class:`Server` answers one call at a time (``forward``, later ``backward``) and keeps the graph
in between. Every received tensor is checked against the shape and dtype its receiver expects
(transport.check_received); a header that asks for more than the callee allows is refused in one
line before any tensor is taken.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from gpuflex.protocol.piececall import PieceCall
from gpuflex.protocol.tensors import TensorSpec
from torch import Tensor

from ..errors import PipelineError
from .transport import MessageKey, Transport, spec_of
from .witness import Witness

__all__ = [
    "EXPERTS",
    "SLICES",
    "Call",
    "Hosted",
    "Kinds",
    "Server",
    "exchange",
]

#: how long a party waits for one message by default
TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Kinds:
    """The relay kinds one sort of remote piece uses (protocol.messages.RELAY_KINDS)."""

    header: str
    tensor_in: str
    tensor_out: str
    grad: str


EXPERTS = Kinds("expert_route", "expert_in", "expert_out", "expert_grad")
SLICES = Kinds("slice_shape", "slice_in", "slice_out", "slice_grad")


@dataclass(frozen=True)
class Call:
    """One caller's call of one callee's piece, for ``micro_batch`` of ``step``: its messages go
    through ``transport`` under keys (step, micro_batch, kind, caller -> callee) and back."""

    transport: Transport
    kinds: Kinds
    step: int
    micro_batch: int
    caller: int
    callee: int
    timeout_s: float = TIMEOUT_S

    def out(self, carries: str) -> MessageKey:
        """Caller -> callee."""
        return MessageKey(self.step, self.micro_batch, carries, self.caller, self.callee)

    def back(self, carries: str) -> MessageKey:
        """Callee -> caller."""
        return MessageKey(self.step, self.micro_batch, carries, self.callee, self.caller)


@dataclass(frozen=True)
class _Plan:
    calls: tuple[Call, ...]
    headers: tuple[Tensor, ...]
    out_shapes: tuple[tuple[int, ...], ...]


class _Exchange(torch.autograd.Function):
    """Inputs (one per call) -> the callees' outputs; backward: the outputs' gradients -> the
    inputs' gradients, both through the transport."""

    @staticmethod
    def forward(ctx: Any, plan: _Plan, *xs: Tensor) -> tuple[Tensor, ...]:
        for call, header, x in zip(plan.calls, plan.headers, xs, strict=True):
            call.transport.send(call.out(call.kinds.header), header)
            call.transport.send(call.out(call.kinds.tensor_in), x)
        outs = []
        for call, shape, x in zip(plan.calls, plan.out_shapes, xs, strict=True):
            expected = TensorSpec(call.kinds.tensor_out, spec_of(x, "x").dtype, shape)
            got = call.transport.receive(
                call.back(call.kinds.tensor_out), expected, timeout_s=call.timeout_s
            )
            outs.append(got.to(x.device))
        ctx.plan = plan
        ctx.inputs = [(spec_of(x, "x"), x.device) for x in xs]
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        plan: _Plan = ctx.plan
        for call, grad in zip(plan.calls, grads, strict=True):
            call.transport.send(call.out(call.kinds.grad), grad.contiguous())
        out: list[Tensor] = []
        for call, (spec, device) in zip(plan.calls, ctx.inputs, strict=True):
            expected = TensorSpec(call.kinds.grad, spec.dtype, spec.shape)
            got = call.transport.receive(
                call.back(call.kinds.grad), expected, timeout_s=call.timeout_s
            )
            out.append(got.to(device))
        return (None, *out)


def exchange(
    calls: Sequence[Call],
    headers: Sequence[Tensor],
    xs: Sequence[Tensor],
    out_shapes: Sequence[tuple[int, ...]],
) -> list[Tensor]:
    """Each callee's output for its input ``xs[i]`` (header ``headers[i]``, int64), of shape
    ``out_shapes[i]`` and the input's dtype, differentiable with respect to ``xs``."""
    if not calls:
        return []
    plan = _Plan(tuple(calls), tuple(h.to(torch.int64) for h in headers), tuple(out_shapes))
    outs = _Exchange.apply(plan, *xs)
    return list(outs)


class Hosted(Protocol):
    """What a callee runs: how long its header is, the input shape (and checks) a header means,
    and the piece itself."""

    header_len: int

    def input_shape(self, header: Tensor) -> tuple[int, ...]:
        """The input's shape for ``header``; PipelineError when the header is refused."""

    def __call__(self, header: Tensor, x: Tensor) -> Tensor:
        """The piece's output for ``x`` (autograd on)."""

    def witnessed_as(self) -> tuple[str, int, str]:
        """What a witness records the piece as: its kind, its index and the hash of its
        parameters now (protocol/piececall.py); PipelineError when it cannot say."""


class Server:
    """One callee's side of the calls of one caller: ``forward`` takes a call's header and input,
    runs ``hosted`` and sends its output; ``backward`` takes the output's gradient, accumulates
    the piece's parameter gradients and sends the input's gradient back. With a ``witness``,
    the calls of its chosen micro-batches are recorded (node/pipeline/witness.py)."""

    def __init__(
        self,
        transport: Transport,
        kinds: Kinds,
        party: int,
        hosted: Hosted,
        *,
        dtype: torch.dtype = torch.float32,
        timeout_s: float = TIMEOUT_S,
        device: torch.device | None = None,
        witness: Witness | None = None,
    ) -> None:
        self.transport = transport
        self.kinds = kinds
        self.party = party
        self.hosted = hosted
        self.dtype = dtype
        self.timeout_s = timeout_s
        self.device = device or torch.device("cpu")
        self.witness = witness
        self._open: dict[tuple[int, int, int], tuple[Tensor, Tensor]] = {}

    def _call(self, step: int, micro_batch: int, caller: int) -> Call:
        return Call(
            self.transport, self.kinds, step, micro_batch, caller, self.party, self.timeout_s
        )

    def forward(self, step: int, micro_batch: int, caller: int) -> None:
        call = self._call(step, micro_batch, caller)
        n = self.hosted.header_len
        header = self.transport.receive(
            call.out(self.kinds.header),
            TensorSpec(self.kinds.header, "int64", (n,)),
            timeout_s=self.timeout_s,
        )
        shape = self.hosted.input_shape(header)
        dtype = spec_of(torch.empty(0, dtype=self.dtype), "x").dtype
        x = self.transport.receive(
            call.out(self.kinds.tensor_in),
            TensorSpec(self.kinds.tensor_in, dtype, shape),
            timeout_s=self.timeout_s,
        )
        x = x.to(self.device).requires_grad_(True)
        out = self.hosted(header, x)
        self._open[(step, micro_batch, caller)] = (x, out)
        self.transport.send(call.back(self.kinds.tensor_out), out.detach())
        if self.witness is not None and self.witness.wants(step, micro_batch):
            kind, index, params = self.hosted.witnessed_as()
            self.witness.forward(
                PieceCall(kind, index, step, micro_batch, caller, x.detach(), out.detach(), params)
            )

    def backward(self, step: int, micro_batch: int, caller: int) -> None:
        opened = self._open.pop((step, micro_batch, caller), None)
        if opened is None:
            raise PipelineError(
                f"party {self.party} has no forward of step {step} micro-batch {micro_batch} "
                f"from party {caller} to take a gradient for"
            )
        x, out = opened
        call = self._call(step, micro_batch, caller)
        grad = self.transport.receive(
            call.out(self.kinds.grad), spec_of(out, self.kinds.grad), timeout_s=self.timeout_s
        )
        out.backward(grad.to(out.device))
        x_grad = x.grad if x.grad is not None else torch.zeros_like(x)
        self.transport.send(call.back(self.kinds.grad), x_grad)
        if self.witness is not None:
            pieces = self.witness.recorded(step, micro_batch, caller)
            self.witness.backward(step, micro_batch, caller, {p: (grad, x_grad) for p in pieces})
