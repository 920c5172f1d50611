"""A mixture-of-experts layer whose experts live on other parties (expert parallelism).

The router's party routes the batch as the one-process layer does (protocol/moe.py: the same
``Router``, the same :class:`~gpuflex.protocol.moe.Routing`), batches the tokens of each host's
experts into one message (expert after expert, with the token counts as its header), and
combines what comes back with the gate weights; its own experts, if it holds any, run where it
is. Backward goes the same way in reverse (node/pipeline/remote.py): each host gets the gradient
of its outputs, keeps its experts' parameter gradients and answers with its tokens' gradients.

A host runs an :class:`ExpertShard` (its experts) under a ``remote.Server``: it refuses a header
that names more tokens than it allows, and the transport refuses tokens or outputs of any other
shape than the counts say, so an answer for tokens that were not sent cannot be applied.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from gpuflex.protocol.dropout import KeyedDropout
from gpuflex.protocol.moe import Router, combine
from torch import Tensor, nn

from ..errors import PipelineError
from .remote import EXPERTS, TIMEOUT_S, Call, Server, exchange
from .transport import Transport

__all__ = ["DistributedMoE", "ExpertShard", "Placement", "expert_server"]

#: the most tokens a host takes in one call by default
MAX_TOKENS = 1 << 20


@dataclass(frozen=True)
class Placement:
    """Which party holds each expert of one layer: ``hosts[e]`` is expert e's."""

    hosts: tuple[int, ...]

    def held_by(self, party: int) -> tuple[int, ...]:
        """The experts ``party`` holds, in expert order."""
        return tuple(e for e, host in enumerate(self.hosts) if host == party)

    def parties(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.hosts)))


class ExpertShard(nn.Module):
    """The experts one host holds (``experts``: expert index -> module), run on the tokens a
    router sent: ``header`` counts each one's tokens, in expert order; ``x`` holds them."""

    def __init__(
        self, experts: Mapping[int, nn.Module], width: int, *, max_tokens: int = MAX_TOKENS
    ) -> None:
        super().__init__()
        if not experts:
            raise PipelineError("an expert host needs at least one expert")
        self.index = tuple(sorted(experts))
        self.experts = nn.ModuleList(experts[e] for e in self.index)
        self.width = width
        self.max_tokens = max_tokens
        self.header_len = len(self.index)

    def input_shape(self, header: Tensor) -> tuple[int, ...]:
        counts = [int(c) for c in header.tolist()]
        if any(c < 0 for c in counts) or sum(counts) > self.max_tokens:
            raise PipelineError(
                f"experts {list(self.index)} were sent token counts {counts[:8]}: each must be >= 0 "
                f"and their sum at most {self.max_tokens}; refused"
            )
        return (sum(counts), self.width)

    def forward(self, header: Tensor, x: Tensor) -> Tensor:
        # x: (tokens of every expert here, width), expert after expert
        parts = torch.split(x, [int(c) for c in header.tolist()])
        return torch.cat([expert(part) for expert, part in zip(self.experts, parts, strict=True)])


def expert_server(
    transport: Transport, party: int, shard: ExpertShard, *, timeout_s: float = TIMEOUT_S
) -> Server:
    """A host's side of the expert exchange for ``shard``."""
    return Server(transport, EXPERTS, party, shard, timeout_s=timeout_s)


class DistributedMoE(nn.Module):
    """The router's side of a mixture-of-experts layer placed by ``placement``: ``router`` (as
    in the one-process layer), ``local`` (the experts this ``party`` holds itself), dropout on
    the combined output (keyed ``slot``, as the one-process layer's)."""

    def __init__(
        self,
        router: Router,
        local: Mapping[int, nn.Module],
        placement: Placement,
        party: int,
        transport: Transport,
        *,
        dropout: float = 0.0,
        slot: int = 0,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        super().__init__()
        if len(placement.hosts) != router.experts:
            raise PipelineError(
                f"the placement names {len(placement.hosts)} experts; the router has {router.experts}"
            )
        if tuple(sorted(local)) != placement.held_by(party):
            raise PipelineError(
                f"party {party} holds experts {sorted(local)}; the placement gives it "
                f"{list(placement.held_by(party))}"
            )
        self.router = router
        self.local = nn.ModuleDict({str(e): m for e, m in local.items()})
        self.placement = placement
        self.party = party
        self.transport = transport
        self.drop = KeyedDropout(dropout, slot=slot)
        self.timeout_s = timeout_s

    def remote_parties(self) -> tuple[int, ...]:
        return tuple(p for p in self.placement.parties() if p != self.party)

    def forward(self, x: Tensor, step: int, micro_batch: int) -> Tensor:
        b, t, c = x.shape  # (batch, time, width)
        flat = x.reshape(b * t, c)
        routing = self.router(flat)
        inputs = torch.split(flat.index_select(0, routing.tokens), list(routing.counts))
        calls, headers, sent, shapes = [], [], [], []
        for party in self.remote_parties():
            held = self.placement.held_by(party)
            calls.append(
                Call(self.transport, EXPERTS, step, micro_batch, self.party, party, self.timeout_s)
            )
            headers.append(torch.tensor([routing.counts[e] for e in held], dtype=torch.int64))
            sent.append(torch.cat([inputs[e] for e in held]))
            shapes.append((sum(routing.counts[e] for e in held), c))
        remote = exchange(calls, headers, sent, shapes)  # every host computes at once
        outputs: list[Tensor | None] = [None] * self.router.experts
        for e in self.placement.held_by(self.party):
            outputs[e] = self.local[str(e)](inputs[e])
        for party, out in zip(self.remote_parties(), remote, strict=True):
            held = self.placement.held_by(party)
            for e, part in zip(
                held, torch.split(out, [routing.counts[e] for e in held]), strict=True
            ):
                outputs[e] = part
        y = combine([o for o in outputs if o is not None], routing, b * t).to(x.dtype)
        out: Tensor = self.drop(y.view(b, t, c))
        return out
