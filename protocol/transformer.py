"""A decoder-only transformer in nanoGPT's shape, built from a :class:`TransformerConfig`.

Pre-LayerNorm blocks (causal self-attention through ``scaled_dot_product_attention``, a GELU
MLP), learned token and position embeddings, a final LayerNorm and a bias-free projection to
the vocabulary that shares the token embedding when the embeddings are tied. The pieces are
the pipeline's units (:mod:`.pipeline`): ``embed``, each of ``blocks``, ``head``.

A block's MLP may be a mixture of experts instead (``TransformerConfig.experts``, :mod:`.moe`):
its routers' load-balancing loss rides on the logits to :class:`NextTokenLoss`.

Tied embeddings hold the weight once (``embed.tok``): the head takes it as an argument in the
whole model, so the state dict names every tensor exactly once.

Initialisation (nanoGPT's): every weight from N(0, 0.02), the residual projections from
N(0, 0.02 / sqrt(2 * layers)), biases zero, LayerNorms one and zero, drawn in module order
from the global CPU generator (``build_model`` seeds and restores it). A module built on the
meta device is not initialised: it only carries shapes.

Imports torch: the modules that only read specs import this one where a module is built.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .dropout import KeyedDropout
from .modelspec import TransformerConfig
from .moe import JITTER_SLOT, ExpertMLP, MoE, Router, attach_aux_loss, aux_loss_of, routers_aux_loss

__all__ = ["MLP", "Block", "Embed", "Head", "NextTokenLoss", "SelfAttention", "Transformer"]

_STD = 0.02


class Embed(nn.Module):
    """Token plus position embeddings, then dropout (slot 0)."""

    def __init__(self, c: TransformerConfig, factory: dict[str, Any]) -> None:
        super().__init__()
        self.tok = nn.Parameter(torch.empty(c.vocab, c.width, **factory))
        self.pos = nn.Parameter(torch.empty(c.context, c.width, **factory))
        self.drop = KeyedDropout(c.dropout, slot=0)

    def forward(self, idx: Tensor) -> Tensor:
        # idx: (batch, time) int64 token ids
        x = F.embedding(idx, self.tok) + self.pos[: idx.shape[1]]  # (batch, time, width)
        out: Tensor = self.drop(x)
        return out


class SelfAttention(nn.Module):
    """Multi-head causal self-attention. Dropout acts on its output (keyed, ``slot``), not on
    the attention weights: ``scaled_dot_product_attention``'s own dropout draws from the
    device's generator, which the hub's CPU referee cannot replay (protocol/dropout.py)."""

    def __init__(self, c: TransformerConfig, factory: dict[str, Any], slot: int) -> None:
        super().__init__()
        self.heads = c.heads
        self.qkv = nn.Linear(c.width, 3 * c.width, **factory)
        self.proj = nn.Linear(c.width, c.width, **factory)
        self.drop = KeyedDropout(c.dropout, slot=slot)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape  # (batch, time, width)
        q, k, v = self.qkv(x).split(c, dim=2)  # each (batch, time, width)
        h = self.heads
        # (batch, time, width) -> (batch, heads, time, head_width)
        q = q.view(b, t, h, c // h).transpose(1, 2)
        k = k.view(b, t, h, c // h).transpose(1, 2)
        v = v.view(b, t, h, c // h).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (batch, heads, time, head_width)
        y = y.transpose(1, 2).contiguous().view(b, t, c)  # (batch, time, width)
        out: Tensor = self.drop(self.proj(y))
        return out


class MLP(nn.Module):
    """Width -> mlp_ratio x width -> GELU -> width."""

    def __init__(self, c: TransformerConfig, factory: dict[str, Any], slot: int) -> None:
        super().__init__()
        self.fc = nn.Linear(c.width, c.mlp_ratio * c.width, **factory)
        self.act = nn.GELU()
        self.proj = nn.Linear(c.mlp_ratio * c.width, c.width, **factory)
        self.drop = KeyedDropout(c.dropout, slot=slot)

    def forward(self, x: Tensor) -> Tensor:
        # x: (batch, time, width)
        out: Tensor = self.drop(self.proj(self.act(self.fc(x))))  # (batch, time, width)
        return out


def moe_mlp(c: TransformerConfig, factory: dict[str, Any], index: int) -> MoE:
    """Block ``index``'s mixture of experts: the dropout slot of its MLP, jitter slot
    ``JITTER_SLOT + index``."""
    router = Router(c.width, c.experts, top_k=c.top_k, capacity_factor=c.capacity_factor,
                    jitter=c.router_jitter, aux_loss_weight=c.aux_loss_weight,
                    slot=JITTER_SLOT + index, factory=factory)
    experts = [ExpertMLP(c.width, c.mlp_ratio * c.width, factory) for _ in range(c.experts)]
    return MoE(router, experts, c.dropout, slot=2 + 2 * index)


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x)). Block ``index``
    owns the dropout slots 1 + 2 x index (attention) and 2 + 2 x index (MLP, or mixture of
    experts when the config makes this block one)."""

    def __init__(self, c: TransformerConfig, factory: dict[str, Any], index: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(c.width, **factory)
        self.attn = SelfAttention(c, factory, slot=1 + 2 * index)
        self.ln2 = nn.LayerNorm(c.width, **factory)
        self.mlp: nn.Module = (
            moe_mlp(c, factory, index) if c.is_moe(index) else MLP(c, factory, slot=2 + 2 * index)
        )

    def forward(self, x: Tensor) -> Tensor:
        # x: (batch, time, width)
        x = x + self.attn(self.ln1(x))
        out: Tensor = x + self.mlp(self.ln2(x))  # (batch, time, width)
        return out


class Head(nn.Module):
    """Final LayerNorm and the projection to the vocabulary. ``weight`` is None when the
    embeddings are tied: the caller passes the token embedding in."""

    def __init__(self, ln: nn.LayerNorm, weight: nn.Parameter | None) -> None:
        super().__init__()
        self.ln = ln
        self.weight = weight

    @classmethod
    def new(cls, c: TransformerConfig, factory: dict[str, Any]) -> Head:
        weight = (
            None if c.tied_embeddings else nn.Parameter(torch.empty(c.vocab, c.width, **factory))
        )
        return cls(nn.LayerNorm(c.width, **factory), weight)

    def forward(self, x: Tensor, tied: Tensor | None = None) -> Tensor:
        # x: (batch, time, width)
        weight = self.weight if self.weight is not None else tied
        if weight is None:
            raise ValueError("a head with tied embeddings needs the token embedding")
        return F.linear(self.ln(x), weight)  # (batch, time, vocab)


class Transformer(nn.Module):
    """(batch, context) token ids -> (batch, context, vocab) next-token logits, carrying the
    routers' load-balancing loss when the model has experts (:func:`.moe.aux_loss_of`)."""

    def __init__(self, c: TransformerConfig, *, device: torch.device) -> None:
        super().__init__()
        factory: dict[str, Any] = {"device": device, "dtype": torch.float32}
        self.config = c
        self.embed = Embed(c, factory)
        self.blocks = nn.ModuleList(Block(c, factory, i) for i in range(c.layers))
        self.head = Head.new(c, factory)
        if device.type != "meta":
            self._init_weights()

    def _init_weights(self) -> None:
        residual_std = _STD / math.sqrt(2 * self.config.layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif ".ln" in name:  # blocks.<i>.ln1, blocks.<i>.ln2, head.ln
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, residual_std if name.endswith("proj.weight") else _STD)

    def forward(self, idx: Tensor) -> Tensor:
        # idx: (batch, time) int64
        x = self.embed(idx)  # (batch, time, width)
        for block in self.blocks:
            x = block(x)
        out: Tensor = self.head(x, self.embed.tok)  # (batch, time, vocab)
        return attach_aux_loss(out, self.aux_loss())

    def aux_loss(self) -> Tensor | None:
        """The weighted load-balancing loss of the last forward, summed over the routers (taken
        from them: asked again, None); None for a dense model."""
        return routers_aux_loss(self)


class NextTokenLoss(nn.Module):
    """Mean cross-entropy of every position's logits against its next token, plus the auxiliary
    loss the model attached to the logits (a mixture of experts' load balancing)."""

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        # logits: (batch, time, vocab); targets: (batch, time)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        aux = aux_loss_of(logits)
        return loss if aux is None else loss + aux.to(loss.dtype)
