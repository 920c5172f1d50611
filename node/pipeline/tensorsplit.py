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
gather / reduce going through a ``Transport`` (node/pipeline/remote.py). A slice host refuses a
header whose input width is not its slice's, and the transport refuses a slice's output of any
other shape than expected.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import torch
import torch.nn.functional as F
from gpuflex.protocol.transformer import SelfAttention
from torch import Tensor, nn

from ..errors import PipelineError
from .remote import SLICES, TIMEOUT_S, Call, Server, exchange
from .transport import Transport

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

MODES: Final = ("columns", "rows", "heads")
#: the most positions (batch x time) a slice host takes in one call by default
MAX_POSITIONS = 1 << 22


def split_sizes(total: int, parties: int) -> list[int]:
    """``total`` cut into ``parties`` contiguous sizes, as even as possible, larger ones first."""
    if not 1 <= parties <= total:
        raise PipelineError(f"{total} features or heads cannot be split {parties} ways")
    size, extra = divmod(total, parties)
    return [size + (1 if i < extra else 0) for i in range(parties)]


def _bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for n in sizes:
        out.append((start, start + n))
        start += n
    return out


def _linear(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    layer = nn.Linear(
        int(weight.shape[1]), int(weight.shape[0]), bias=bias is not None, device="meta"
    )
    state = {"weight": weight.detach().clone()}
    if bias is not None:
        state["bias"] = bias.detach().clone()
    layer.load_state_dict(state, assign=True)
    return layer


def split_columns(linear: nn.Linear, parties: int) -> list[nn.Linear]:
    """``linear`` cut by output features: slice i computes outputs ``bounds[i]``."""
    bias = linear.bias
    return [
        _linear(linear.weight[a:b], None if bias is None else bias[a:b])
        for a, b in _bounds(split_sizes(linear.out_features, parties))
    ]


def split_rows(linear: nn.Linear, parties: int) -> list[nn.Linear]:
    """``linear`` cut by input features: slice i takes inputs ``bounds[i]``; the first adds the bias."""
    return [
        _linear(linear.weight[:, a:b], linear.bias if i == 0 else None)
        for i, (a, b) in enumerate(_bounds(split_sizes(linear.in_features, parties)))
    ]


class HeadSlice(nn.Module):
    """Heads [first, first + heads) of a causal self-attention: their rows of the q, k, v
    projection and their columns of the output projection (whose bias only slice 0 holds)."""

    def __init__(
        self,
        qkv: nn.Linear,
        proj_weight: Tensor,
        proj_bias: Tensor | None,
        heads: int,
        head_width: int,
    ) -> None:
        super().__init__()
        self.qkv = qkv
        self.proj = _linear(proj_weight, proj_bias)
        self.heads = heads
        self.head_width = head_width

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape  # (batch, time, width)
        h, hw = self.heads, self.head_width
        q, k, v = self.qkv(x).split(h * hw, dim=2)  # each (batch, time, heads x head_width)
        q = q.view(b, t, h, hw).transpose(1, 2)  # (batch, heads, time, head_width)
        k = k.view(b, t, h, hw).transpose(1, 2)
        v = v.view(b, t, h, hw).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, h * hw)
        out: Tensor = self.proj(y)  # (batch, time, width): this slice's share
        return out


def split_heads(attn: SelfAttention, parties: int) -> list[HeadSlice]:
    """``attn`` cut by heads into ``parties`` slices (module docstring)."""
    width = attn.proj.in_features
    hw = width // attn.heads
    w, bias = attn.qkv.weight, attn.qkv.bias
    slices = []
    for i, (a, b) in enumerate(_bounds(split_sizes(attn.heads, parties))):
        rows = torch.cat(
            [torch.arange(part * width + a * hw, part * width + b * hw) for part in range(3)]
        )
        qkv = _linear(w[rows], None if bias is None else bias[rows])
        proj_bias = attn.proj.bias if i == 0 else None
        slices.append(HeadSlice(qkv, attn.proj.weight[:, a * hw : b * hw], proj_bias, b - a, hw))
    return slices


class SliceHost(nn.Module):
    """One slice on its own party: its header is the input's shape (batch, time, features)."""

    header_len = 3

    def __init__(
        self, piece: nn.Module, in_features: int, *, max_positions: int = MAX_POSITIONS
    ) -> None:
        super().__init__()
        self.piece = piece
        self.in_features = in_features
        self.max_positions = max_positions

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


def slice_server(
    transport: Transport, party: int, host: SliceHost, *, timeout_s: float = TIMEOUT_S
) -> Server:
    """A slice host's side of the exchange."""
    return Server(transport, SLICES, party, host, timeout_s=timeout_s)


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
