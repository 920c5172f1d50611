"""A mixture-of-experts layer: a router sends each token to its ``top_k`` experts (GELU MLPs), and
the experts' outputs come back weighted by the router's gate.

Routing (Switch Transformer / GShard):

- the router's logits are computed in float32 (outside any autocast), softmaxed over the experts;
  each token picks its ``top_k`` most probable experts. With ``top_k`` 1 the gate is that
  probability (Switch: the router learns through it); with more, the chosen probabilities are
  renormalised to sum to one (GShard's top-2).
- each expert takes at most ``capacity = ceil(capacity_factor x tokens x top_k / experts)``
  assignments: first choices before second choices, and within a choice in token order. An
  assignment past an expert's capacity is dropped: that token gets nothing from that expert (its
  residual carries it), and it still counts in the loss like every other position.
- router jitter multiplies the router's input by uniform noise in [1 - jitter, 1 + jitter]
  while training, drawn from the step's key (protocol/dropout.py), never from a device's
  generator, so the referee's CPU replays a GPU node's routing; outside a ``dropout_step`` block
  (and in evaluation) there is no jitter.
- the load-balancing loss (Switch's ``experts x sum_e f_e x P_e``: ``f_e`` the share of the
  assignments the router gave expert e before capacity, ``P_e`` its mean probability) times
  ``aux_loss_weight`` is recorded on the router each forward (``Router.aux_loss``); the
  transformer attaches the sum over its routers to its logits (:func:`attach_aux_loss`) and
  :class:`~.transformer.NextTokenLoss` adds it, so every trainer that uses that loss (the
  node's, the referee's replay) trains with it. A pipeline stage holds only some of the blocks:
  it adds its own routers' loss (:func:`routers_aux_loss`), weighted by the micro-batch's share
  of the step, to what it differentiates. Evaluation reports the language-model loss alone.

The router also records, each forward, how many assignments each expert was given
(``routed``) and how many it kept (``kept``): the tokens dropped by capacity are
``routed.sum() - kept.sum()``.

A :class:`Routing` is plain tensors, so the same routing drives the experts in one process
(:class:`MoE`) or on other hosts (node/pipeline/experts.py), and :func:`combine` puts their
outputs back together the same way.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .dropout import KeyedDropout, keyed_uniform, step_key

__all__ = [
    "JITTER_SLOT",
    "ExpertMLP",
    "MoE",
    "Router",
    "Routing",
    "attach_aux_loss",
    "aux_loss_of",
    "combine",
    "route",
    "routers_aux_loss",
]

#: router jitter of MoE block i draws from keyed slot JITTER_SLOT + i (dropout uses small slots)
JITTER_SLOT: Final = 1 << 24
_AUX_ATTR: Final = "gpuflex_aux_loss"


@dataclass(frozen=True)
class Routing:
    """Where one batch's tokens go. The kept assignments are grouped by expert (expert 0's
    first): ``tokens[i]`` is the token (row of the flattened batch) of assignment i and
    ``gates[i]`` its weight; ``counts[e]`` of them are expert e's. ``routed`` (experts,) counts
    each expert's assignments before capacity; ``aux`` is the unweighted balancing loss; ``probs``
    (tokens, experts) the router's probabilities the gates come from (a router that routes around
    a lost expert picks each token's next-best expert from them)."""

    tokens: Tensor  # (kept,) int64
    gates: Tensor  # (kept,) float32
    counts: tuple[int, ...]
    routed: Tensor  # (experts,) int64
    aux: Tensor  # () float32
    probs: Tensor  # (tokens, experts) float32

    @property
    def kept(self) -> int:
        return sum(self.counts)


def route(logits: Tensor, top_k: int, capacity: int) -> Routing:
    """The routing of ``logits`` (tokens, experts), float32 (module docstring)."""
    n, experts = int(logits.shape[0]), int(logits.shape[1])
    probs = logits.softmax(dim=-1)  # (tokens, experts)
    top_p, top_e = probs.topk(top_k, dim=-1)  # (tokens, top_k)
    gates = top_p / top_p.sum(dim=-1, keepdim=True) if top_k > 1 else top_p
    # choice-major: every token's first choice, then every token's second, ...
    expert = top_e.t().reshape(-1)  # (top_k * tokens,)
    gate = gates.t().reshape(-1)
    token = torch.arange(n, device=logits.device).repeat(top_k)
    one_hot = F.one_hot(expert, experts)  # (top_k * tokens, experts)
    position = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1  # place in its expert's queue
    keep = position < capacity
    routed = one_hot.sum(dim=0)  # (experts,)
    expert, gate, token = expert[keep], gate[keep], token[keep]
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=experts)
    share = routed.to(torch.float32) / max(1, n * top_k)
    aux = experts * (share * probs.mean(dim=0)).sum()
    return Routing(
        tokens=token[order],
        gates=gate[order],
        counts=tuple(int(c) for c in counts.tolist()),
        routed=routed,
        aux=aux,
        probs=probs,
    )


def combine(outputs: Sequence[Tensor], routing: Routing, tokens: int) -> Tensor:
    """(tokens, width): each token's expert outputs (``outputs[e]`` for expert e's assignments,
    in ``routing``'s order) times their gates, summed; zero for a token every expert dropped."""
    out = torch.cat(list(outputs), dim=0)  # (kept, width)
    weighted = out * routing.gates.unsqueeze(1).to(out.dtype)
    y = weighted.new_zeros(tokens, int(out.shape[1]))
    return y.index_add(0, routing.tokens, weighted)


def attach_aux_loss(logits: Tensor, aux: Tensor | None) -> Tensor:
    """``logits``, carrying ``aux`` for the loss (:func:`aux_loss_of`)."""
    if aux is not None:
        setattr(logits, _AUX_ATTR, aux)
    return logits


def aux_loss_of(logits: Tensor) -> Tensor | None:
    """The auxiliary loss the model attached to ``logits``; None when it attached none."""
    aux = getattr(logits, _AUX_ATTR, None)
    return aux if isinstance(aux, Tensor) else None


def routers_aux_loss(module: nn.Module) -> Tensor | None:
    """The weighted balancing loss of ``module``'s last forward, summed over the routers it holds
    (taken from them: asked again, None); None when it holds no router. A whole transformer
    attaches it to its logits; a pipeline stage, which holds some of the blocks, adds its own
    routers' share to what it differentiates (node/pipeline/stage.py, the referee's replay)."""
    taken = [m.take_aux_loss() for m in module.modules() if isinstance(m, Router)]
    losses = [aux for aux in taken if aux is not None]
    return torch.stack(losses).sum() if losses else None


def _no_autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if device.type in ("cpu", "cuda", "mps", "xpu") and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


class Router(nn.Module):
    """The gate of one MoE layer: ``weight`` (experts, width), no bias."""

    def __init__(
        self,
        width: int,
        experts: int,
        *,
        top_k: int,
        capacity_factor: float,
        jitter: float,
        aux_loss_weight: float,
        slot: int,
        factory: dict[str, Any],
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, width, **factory))
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.jitter = jitter
        self.aux_loss_weight = aux_loss_weight
        self.slot = slot
        #: the last forward's weighted balancing loss, assignments per expert, and kept per expert
        self.aux_loss: Tensor | None = None
        self.routed: Tensor | None = None
        self.kept: Tensor | None = None

    @property
    def experts(self) -> int:
        return int(self.weight.shape[0])

    def __getstate__(self) -> dict[str, Any]:
        # a copy (deepcopy, pickle-free state copies) leaves the last forward's graph behind
        state = dict(self.__dict__)
        state["aux_loss"] = None
        return state

    def take_aux_loss(self) -> Tensor | None:
        """The last forward's weighted balancing loss, handed over once (the router keeps no
        graph after it)."""
        aux, self.aux_loss = self.aux_loss, None
        return aux

    def capacity(self, tokens: int) -> int:
        return max(1, math.ceil(self.capacity_factor * tokens * self.top_k / self.experts))

    def forward(self, flat: Tensor) -> Routing:
        # flat: (tokens, width)
        key = step_key()
        if self.training and self.jitter > 0 and key is not None:
            noise = keyed_uniform(flat.shape, *key, self.slot, flat.device)
            flat = flat * (1.0 - self.jitter + 2.0 * self.jitter * noise).to(flat.dtype)
        with _no_autocast(flat.device):
            logits = F.linear(flat.float(), self.weight.float())  # (tokens, experts)
        routing = route(logits, self.top_k, self.capacity(int(flat.shape[0])))
        self.aux_loss = routing.aux * self.aux_loss_weight
        self.routed = routing.routed.detach()
        self.kept = torch.tensor(routing.counts, dtype=torch.int64)
        return routing

    def extra_repr(self) -> str:
        return (
            f"experts={self.experts}, top_k={self.top_k}, capacity_factor={self.capacity_factor}, "
            f"jitter={self.jitter}, aux_loss_weight={self.aux_loss_weight}"
        )


class ExpertMLP(nn.Module):
    """One expert: width -> hidden -> GELU -> width (the dense MLP's shape, no dropout)."""

    def __init__(self, width: int, hidden: int, factory: dict[str, Any]) -> None:
        super().__init__()
        self.fc = nn.Linear(width, hidden, **factory)
        self.act = nn.GELU()
        self.proj = nn.Linear(hidden, width, **factory)

    def forward(self, x: Tensor) -> Tensor:
        # x: (tokens, width)
        out: Tensor = self.proj(self.act(self.fc(x)))
        return out


class MoE(nn.Module):
    """A mixture-of-experts MLP for (batch, time, width) input: ``router``, ``experts``, then
    dropout (keyed ``slot``) on the combined output."""

    def __init__(
        self, router: Router, experts: Sequence[nn.Module], dropout: float, slot: int
    ) -> None:
        super().__init__()
        self.router = router
        self.experts = nn.ModuleList(experts)
        self.drop = KeyedDropout(dropout, slot=slot)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape  # (batch, time, width)
        flat = x.reshape(b * t, c)
        routing = self.router(flat)
        inputs = torch.split(
            flat.index_select(0, routing.tokens), list(routing.counts)
        )  # per expert
        outputs = [expert(part) for expert, part in zip(self.experts, inputs, strict=True)]
        y = combine(outputs, routing, b * t).to(x.dtype)  # (batch * time, width)
        out: Tensor = self.drop(y.view(b, t, c))
        return out
