"""The evidence of one call of a remote piece of a layer: one expert of a mixture of experts, or
one tensor slice of a layer split by width, on one micro-batch.

A host that holds such a piece (node/pipeline/experts.py, tensorsplit.py) records, for the
(step, micro-batch) pairs its caller chose (node/pipeline/witness.py), what it computed: the
tokens it was sent, its answer, the gradient of its answer it was sent back and the input's
gradient it answered, and the content hash of the parameters it computed with. The referee
(hub/policy/piece_check.py) rebuilds the piece from the durable parameters it should have held,
re-executes the forward and the backward on the same input and output gradient, and compares,
as it does for a pipeline stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from torch import Tensor

from .tensors import encode_state, sha256_hex

__all__ = ["EXPERT", "PIECE_KINDS", "PieceCall", "piece_hash"]

#: the kind of an expert's call; a slice's is its layer's split ("columns", "rows", "heads")
EXPERT: Final = "expert"
PIECE_KINDS: Final = (EXPERT, "columns", "rows", "heads")


@dataclass(frozen=True)
class PieceCall:
    """What one host computed for one piece on one micro-batch of ``step``, called by party
    ``caller``. ``kind``: ``"expert"`` or the slice's split; ``index``: the expert's index in
    its layer, or the slice's among the layer's slices. ``x``: the input it was sent (an
    expert's tokens (tokens, width); a slice's input (batch, time, features)); ``out``: its
    answer; ``grad_out``: the gradient of its answer it was sent; ``grad_in``: the input's
    gradient it answered (both None before the backward). ``params``: :func:`piece_hash` of the
    piece's parameters when it computed."""

    kind: str
    index: int
    step: int
    micro_batch: int
    caller: int
    x: Tensor
    out: Tensor
    params: str
    grad_out: Tensor | None = None
    grad_in: Tensor | None = None


def piece_hash(state: Mapping[str, Tensor]) -> str:
    """The content hash of one piece's parameters (its own names: ``fc.weight``, ``bias``...):
    sha256 of their GFT1 encoding, names in sorted order, each tensor detached on the CPU."""
    ordered = {k: state[k].detach().to("cpu").contiguous() for k in sorted(state)}
    return sha256_hex(encode_state(ordered))
