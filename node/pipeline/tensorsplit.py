"""Layers split by width across parties (tensor parallelism, Megatron's splits).

- **columns** (:func:`split_columns`): a Linear's output features are cut into contiguous
  slices; every party takes the whole input and the outputs are concatenated. Backward: each
  party gets its slice of the output's gradient; the input's gradients are summed.
- **rows** (:func:`split_rows`): a Linear's input features are cut; each party takes its slice
  of the input and the partial outputs are summed (the bias is added once, by the first slice).
  Backward: every party gets the whole output gradient; the input's gradient slices are joined.
- **heads** (:func:`split_heads`): a causal self-attention's heads are cut; each party computes
  its heads' q, k, v, their attention and its columns' share of the output projection; the
  partial outputs are summed (the projection's bias added once), then the attention's dropout.

:class:`SplitLayer` is the party that holds the layer's input (and the first slice); every
other slice runs on its own party under a ``remote.Server`` serving a :class:`SliceHost`, the
gather / reduce going through a ``Transport`` (node/pipeline/remote.py). The cuts themselves are
protocol/tensorslices.py's, which the referee uses to rebuild a slice. A slice host refuses a
header whose input width is not its slice's, and the transport refuses a slice's output of any
other shape than expected.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from gpuflex.protocol.piececall import piece_hash
from gpuflex.protocol.tensorslices import (
    MODES,
    HeadSlice,
    split_columns,
    split_heads,
    split_rows,
    split_sizes,
)
from torch import Tensor, nn

from ..errors import PipelineError
from .remote import SLICES, TIMEOUT_S, Call, Server, exchange
from .transport import Transport
from .witness import Witness

__all__ = [
    "MODES",
    "HeadSlice",
    "SliceHost",
    "SplitLayer",
    "slice_server",
    "split_columns",
    "split_heads",
    "split_rows",
    "split_sizes",
]

#: the most positions (batch x time) a slice host takes in one call by default
MAX_POSITIONS = 1 << 22


class SliceHost(nn.Module):
    """One slice on its own party: its header is the input's shape (batch, time, features).
    ``mode`` and ``index``: the layer's split and the slice's place in it, what a witness
    records the slice's calls as (None: not said, and its calls cannot be witnessed)."""

    header_len = 3

    def __init__(
        self,
        piece: nn.Module,
        in_features: int,
        *,
        max_positions: int = MAX_POSITIONS,
        mode: str | None = None,
        index: int = 0,
    ) -> None:
        super().__init__()
        if mode is not None and mode not in MODES:
            raise PipelineError(f"a layer splits by one of {', '.join(MODES)}, not {mode!r}")
        self.piece = piece
        self.in_features = in_features
        self.max_positions = max_positions
        self.mode = mode
        self.index = index

    def input_shape(self, header: Tensor) -> tuple[int, ...]:
        b, t, c = (int(v) for v in header.tolist())
        if c != self.in_features or b < 1 or t < 1 or b * t > self.max_positions:
            raise PipelineError(
                f"a slice taking {self.in_features} input features was sent an input of shape "
                f"{[b, t, c]} (at most {self.max_positions} positions); refused"
            )
        return (b, t, c)

    def forward(self, header: Tensor, x: Tensor) -> Tensor:
        out: Tensor = self.piece(x)
        return out

    def witnessed_as(self) -> tuple[str, int, str]:
        if self.mode is None:
            raise PipelineError("a slice host whose mode is not given cannot be witnessed")
        return self.mode, self.index, piece_hash(self.piece.state_dict())


def slice_server(
    transport: Transport,
    party: int,
    host: SliceHost,
    *,
    timeout_s: float = TIMEOUT_S,
    witness: Witness | None = None,
) -> Server:
    """A slice host's side of the exchange; with ``witness``, recording its chosen micro-batches
    (refused for a host whose mode is not given)."""
    if witness is not None:
        host.witnessed_as()
    return Server(transport, SLICES, party, host, timeout_s=timeout_s, witness=witness)


class SplitLayer(nn.Module):
    """The party holding a split layer's input: ``local`` is slice 0 (run here), ``remote`` the
    other slices' parties in slice order; ``in_sizes`` / ``out_sizes`` each slice's input and
    output features (one entry per slice); ``after`` runs on the gathered output (the
    attention's dropout for heads)."""

    def __init__(
        self,
        mode: str,
        local: nn.Module,
        remote: Sequence[int],
        *,
        in_sizes: Sequence[int],
        out_sizes: Sequence[int],
        party: int,
        transport: Transport,
        after: nn.Module | None = None,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise PipelineError(f"a layer splits by one of {', '.join(MODES)}, not {mode!r}")
        if not len(in_sizes) == len(out_sizes) == 1 + len(remote):
            raise PipelineError("a split layer needs one input and one output size per slice")
        self.mode = mode
        self.local = local
        self.remote = tuple(remote)
        self.in_sizes = tuple(in_sizes)
        self.out_sizes = tuple(out_sizes)
        self.party = party
        self.transport = transport
        self.after = after if after is not None else nn.Identity()
        self.timeout_s = timeout_s

    def forward(self, x: Tensor, step: int, micro_batch: int) -> Tensor:
        b, t, _ = x.shape  # (batch, time, features)
        xs = (
            list(x.split(list(self.in_sizes), dim=-1))
            if self.mode == "rows"
            else [x] * len(self.in_sizes)
        )
        calls = [
            Call(self.transport, SLICES, step, micro_batch, self.party, p, self.timeout_s)
            for p in self.remote
        ]
        headers = [torch.tensor(part.shape, dtype=torch.int64) for part in xs[1:]]
        shapes = [(b, t, n) for n in self.out_sizes[1:]]
        remote = exchange(calls, headers, xs[1:], shapes)  # every slice host computes at once
        outs = [self.local(xs[0]), *remote]
        y = torch.cat(outs, dim=-1) if self.mode == "columns" else torch.stack(outs).sum(dim=0)
        out: Tensor = self.after(y)
        return out
