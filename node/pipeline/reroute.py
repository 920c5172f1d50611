"""Routing a mixture-of-experts layer's tokens around experts that no live party holds.

:func:`substitute` is the whole rule, a pure function of the router's :class:`Routing` and which
experts are live, so a referee who knows which hosts were lost replays it exactly: a token whose
top-k held a lost expert takes its next-best live expert instead (the highest probability among
the live experts outside its top-k), and its gates are the rule ``route`` uses, over the experts it
actually uses (top-k > 1: their probabilities renormalised to sum to one; top-k 1: the expert's
probability). With top-k > 1 that is exactly the routing the router would give with the lost
experts' logits masked out, capacity aside: a re-routed assignment is not limited by capacity, and
an assignment capacity dropped stays dropped. Tokens no lost expert touched keep their gates.
"""

from __future__ import annotations

import torch
from gpuflex.protocol.moe import Routing
from torch import Tensor

__all__ = ["expert_of", "substitute"]


def expert_of(routing: Routing) -> Tensor:
    """(kept,) int64: the expert of each of ``routing``'s assignments."""
    counts = torch.tensor(routing.counts, dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(len(routing.counts)), counts)


def substitute(routing: Routing, top_k: int, live: Tensor) -> tuple[Routing, int]:
    """``routing`` with every assignment to an expert that is not ``live`` (bool, (experts,))
    moved to the token's next-best live expert (module docstring), grouped by expert as a
    ``Routing`` is (within an expert: its kept assignments in their order, then the moved ones,
    choice-major); and how many assignments moved. ``routing`` itself when nothing is lost."""
    experts = len(routing.counts)
    owner = expert_of(routing)
    gone = ~live[owner]
    if not bool(gone.any()):
        return routing, 0
    probs = routing.probs  # (tokens, experts), differentiable
    hit = torch.zeros(int(probs.shape[0]), dtype=torch.bool)
    hit[routing.tokens[gone]] = True
    touched = hit.nonzero().squeeze(1)  # (m,) the tokens with a lost expert, in token order
    p = probs.detach()[touched]  # (m, experts)
    chosen = p.topk(top_k, dim=-1).indices  # each token's top-k, as route() chose it
    usable = min(top_k, int(live.sum()))
    used = p.masked_fill(~live, float("-inf")).topk(usable, dim=-1).indices  # (m, usable)
    added = ~(used.unsqueeze(2) == chosen.unsqueeze(1)).any(dim=2)  # (m, usable)

    # the gates of a touched token: over the experts it uses
    denom = torch.ones(int(probs.shape[0]), dtype=probs.dtype)
    if top_k > 1:
        denom = denom.index_put((touched,), probs[touched].gather(1, used).sum(dim=1))

    def gate(tokens: Tensor, of: Tensor) -> Tensor:
        return probs[tokens, of] / denom[tokens]

    stay = ~gone
    tok, own = routing.tokens[stay], owner[stay]
    kept_gates = torch.where(hit[tok], gate(tok, own), routing.gates[stay])
    # choice-major, token order within a choice (as route() orders a choice's assignments)
    rows, cols = added.t().nonzero(as_tuple=True)  # cols: the touched token's row
    new_tok, new_own = touched[cols], used[cols, rows]
    tokens = torch.cat([tok, new_tok])
    owners = torch.cat([own, new_own])
    gates = torch.cat([kept_gates, gate(new_tok, new_own)])
    order = torch.argsort(owners, stable=True)
    counts = torch.bincount(owners, minlength=experts)
    moved = Routing(
        tokens=tokens[order],
        gates=gates[order],
        counts=tuple(int(c) for c in counts.tolist()),
        routed=routing.routed,
        aux=routing.aux,
        probs=probs,
    )
    return moved, int(new_tok.shape[0])
