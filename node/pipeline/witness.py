"""What a host of experts or slices keeps of its calls for the referee (protocol/piececall.py).

The caller chooses the (step, micro-batch) pairs (``picks``: the referee's secret sample, as for
pipeline stages); the host's server records, for each of them, one :class:`PieceCall` per piece
it computed: at the forward the input it was sent, its answer and the hash of its parameters, at
the backward the gradient it was sent and the input's gradient it answered. Recording copies the
tensors and changes nothing the host computes or sends.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

import torch
from gpuflex.protocol.piececall import PieceCall
from torch import Tensor

__all__ = ["Witness", "per_expert"]

#: (step, micro-batch, caller, kind, index)
_Key = tuple[int, int, int, str, int]


class Witness:
    """The chosen (step, micro-batch) pairs of one host, and its calls recorded for them."""

    def __init__(self, picks: Iterable[tuple[int, int]]) -> None:
        self.picks = frozenset((int(s), int(m)) for s, m in picks)
        self._calls: dict[_Key, PieceCall] = {}

    def wants(self, step: int, micro_batch: int) -> bool:
        return (step, micro_batch) in self.picks

    @property
    def calls(self) -> list[PieceCall]:
        """Every recorded call, in the order they were first recorded."""
        return list(self._calls.values())

    def forward(self, call: PieceCall) -> None:
        """A piece's forward on a chosen micro-batch (its tensors are copied)."""
        key = (call.step, call.micro_batch, call.caller, call.kind, call.index)
        self._calls[key] = replace(call, x=_copy(call.x), out=_copy(call.out))

    def recorded(self, step: int, micro_batch: int, caller: int) -> list[tuple[str, int]]:
        """The (kind, index) of each piece recorded at the forward of this call."""
        return [(k[3], k[4]) for k in self._calls if k[:3] == (step, micro_batch, caller)]

    def backward(
        self,
        step: int,
        micro_batch: int,
        caller: int,
        grads: dict[tuple[str, int], tuple[Tensor, Tensor]],
    ) -> None:
        """The backward of the pieces recorded at the forward: ``grads[(kind, index)]`` is the
        gradient a piece was sent and the input's gradient it answered."""
        for (kind, index), (grad_out, grad_in) in grads.items():
            key = (step, micro_batch, caller, kind, index)
            if key in self._calls:
                self._calls[key] = replace(
                    self._calls[key], grad_out=_copy(grad_out), grad_in=_copy(grad_in)
                )


def _copy(t: Tensor) -> Tensor:
    return t.detach().to("cpu", copy=True)


def per_expert(
    index: Sequence[int], headers: Sequence[Tensor], tensors: Sequence[Tensor]
) -> dict[int, Tensor]:
    """Each expert's rows of ``tensors`` (one per round, each round's rows expert after expert,
    ``headers[r]`` counting them in ``index`` order), the rounds' rows joined."""
    parts: dict[int, list[Tensor]] = {e: [] for e in index}
    for header, t in zip(headers, tensors, strict=True):
        split = torch.split(t, [int(c) for c in header.tolist()])
        for e, rows in zip(index, split, strict=True):
            parts[e].append(rows)
    return {e: torch.cat(rows) for e, rows in parts.items()}
