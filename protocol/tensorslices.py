"""How a layer is cut by width into slices (tensor parallelism, Megatron's splits): one rule for
the parties that compute the slices (node/pipeline/tensorsplit.py) and for the referee that
rebuilds one slice from the layer's parameters to re-execute it (hub/policy/piece_check.py).

- **columns** (:func:`split_columns`): a Linear's output features cut into contiguous slices;
  every slice takes the whole input.
- **rows** (:func:`split_rows`): a Linear's input features cut; each slice takes its slice of
  the input, and only the first adds the bias.
- **heads** (:func:`split_heads`): a causal self-attention's heads cut; each slice computes its
  heads' q, k, v, their attention and its columns' share of the output projection (whose bias
  only the first adds). The attention's dropout runs on the summed output, not in a slice.

Sizes are as even as possible, larger ones first (:func:`split_sizes`). :func:`cut_slice` builds
slice ``index`` of ``parties`` from the whole layer's state dict (a Linear's ``weight`` and
``bias``; an attention's ``qkv.*`` and ``proj.*``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import ProtocolError
from .transformer import SelfAttention

__all__ = [
    "MODES",
    "HeadSlice",
    "cut_slice",
    "slice_bounds",
    "split_columns",
    "split_heads",
    "split_rows",
    "split_sizes",
]

MODES: Final = ("columns", "rows", "heads")


def split_sizes(total: int, parties: int) -> list[int]:
    """``total`` cut into ``parties`` contiguous sizes, as even as possible, larger ones first."""
    if not 1 <= parties <= total:
        raise ProtocolError(f"{total} features or heads cannot be split {parties} ways")
    size, extra = divmod(total, parties)
    return [size + (1 if i < extra else 0) for i in range(parties)]


def slice_bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Each size's [start, end) when they are laid end to end."""
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


def _columns(weight: Tensor, bias: Tensor | None, parties: int) -> list[nn.Linear]:
    return [
        _linear(weight[a:b], None if bias is None else bias[a:b])
        for a, b in slice_bounds(split_sizes(int(weight.shape[0]), parties))
    ]


def _rows(weight: Tensor, bias: Tensor | None, parties: int) -> list[nn.Linear]:
    return [
        _linear(weight[:, a:b], bias if i == 0 else None)
        for i, (a, b) in enumerate(slice_bounds(split_sizes(int(weight.shape[1]), parties)))
    ]


def split_columns(linear: nn.Linear, parties: int) -> list[nn.Linear]:
    """``linear`` cut by output features: slice i computes outputs ``bounds[i]``."""
    return _columns(linear.weight, linear.bias, parties)


def split_rows(linear: nn.Linear, parties: int) -> list[nn.Linear]:
    """``linear`` cut by input features: slice i takes inputs ``bounds[i]``; the first adds the bias."""
    return _rows(linear.weight, linear.bias, parties)


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


def _heads(state: Mapping[str, Tensor], heads: int, parties: int) -> list[HeadSlice]:
    w, bias = state["qkv.weight"], state.get("qkv.bias")
    proj_w, proj_b = state["proj.weight"], state.get("proj.bias")
    width = int(proj_w.shape[1])
    if heads < 1 or width % heads or tuple(w.shape) != (3 * width, width):
        raise ProtocolError(
            f"an attention of width {width} with a q, k, v projection of shape {list(w.shape)}"
            f" cannot be cut into {heads} heads"
        )
    hw = width // heads
    slices = []
    for i, (a, b) in enumerate(slice_bounds(split_sizes(heads, parties))):
        rows = torch.cat(
            [torch.arange(part * width + a * hw, part * width + b * hw) for part in range(3)]
        )
        qkv = _linear(w[rows], None if bias is None else bias[rows])
        slices.append(
            HeadSlice(qkv, proj_w[:, a * hw : b * hw], proj_b if i == 0 else None, b - a, hw)
        )
    return slices


def split_heads(attn: SelfAttention, parties: int) -> list[HeadSlice]:
    """``attn`` cut by heads into ``parties`` slices (module docstring)."""
    return _heads(dict(attn.named_parameters()), attn.heads, parties)


def cut_slice(
    mode: str, state: Mapping[str, Tensor], parties: int, index: int, *, heads: int = 0
) -> nn.Module:
    """Slice ``index`` of ``parties`` of the layer whose parameters are ``state`` (a Linear's
    ``weight`` and ``bias``; an attention's ``qkv.*`` and ``proj.*``, with its ``heads``),
    exactly as the parties cut it. ProtocolError for a mode, index or state that cannot be cut."""
    if mode not in MODES:
        raise ProtocolError(f"a layer splits by one of {', '.join(MODES)}, not {mode!r}")
    if not 0 <= index < parties:
        raise ProtocolError(f"slice {index} of a layer cut {parties} ways does not exist")
    wanted = ("weight",) if mode != "heads" else ("qkv.weight", "proj.weight")
    missing = [k for k in wanted if k not in state]
    if missing or any(state[k].dim() != 2 for k in wanted):
        raise ProtocolError(f"a layer cut by {mode} needs 2-d {', '.join(wanted)} in its state")
    if mode == "heads":
        return _heads(state, heads, parties)[index]
    cut = _columns if mode == "columns" else _rows
    return cut(state["weight"], state.get("bias"), parties)[index]
