"""The router's side of one call of a mixture-of-experts layer whose experts live on other parties:
at most two rounds of messages to the expert hosts, each bounded by a deadline, and the backward.

Round one sends every live host the tokens of the experts it serves (``expert_route`` counts,
``expert_in``) and waits for the answers (``expert_out``) until ``deadline_s`` after the last
send. A host that has not answered by then is lost: the call re-plans the routing without it
(node/pipeline/reroute.py: a live replica of each of its experts takes their tokens, else each
token its next-best live expert), and round two sends every host that answered the counts of the
tokens it gets now (``expert_reroute``: zeros when there are none, so a host always knows whether
more comes) and those tokens (``reroute_in``), and waits for ``reroute_out`` under the same
deadline. A host lost in round two is skipped too; the assignments it was sent are dropped for
the step (as capacity drops them: the residual carries those tokens). The backward sends each
host that answered the gradient of everything it computed (both rounds, ``expert_grad``) and
takes the input's gradient back under the deadline; a host that does not answer then is lost,
and the gradient of its tokens is zero. A late answer is never read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from gpuflex.protocol.moe import Routing
from gpuflex.protocol.tensors import TensorSpec
from torch import Tensor

from ..errors import MessageLate
from .remote import EXPERTS, Call, Kinds
from .reroute import substitute
from .transport import Transport, spec_of

__all__ = ["REROUTE", "CallCounts", "Piece", "Rerouting", "Rounds", "remote_experts"]

#: the second round of a call, after a host was found lost (its gradient travels with round one's)
REROUTE = Kinds("expert_reroute", "reroute_in", "reroute_out", "expert_grad")


@dataclass
class CallCounts:
    """What routing around lost hosts cost: assignments a replica computed (``to_replica``),
    moved to another expert (``to_next_best``), dropped because the host they were re-routed to
    was lost too (``dropped``); deadlines waited out (``deadline_waits``); token rows whose
    gradient a lost host never sent back (``lost_gradients``)."""

    to_replica: int = 0
    to_next_best: int = 0
    dropped: int = 0
    deadline_waits: int = 0
    lost_gradients: int = 0

    @property
    def rerouted(self) -> int:
        return self.to_replica + self.to_next_best

    def add(self, other: CallCounts) -> None:
        self.to_replica += other.to_replica
        self.to_next_best += other.to_next_best
        self.dropped += other.dropped
        self.deadline_waits += other.deadline_waits
        self.lost_gradients += other.lost_gradients


@dataclass
class Rerouting:
    """One call of the layer (``step``, ``micro_batch``): the parties it did without (``lost``:
    known lost before it or found lost during it, ``found_lost``: the latter) and its counts.
    With the router's input and the lost parties, a referee replays the call exactly."""

    step: int
    micro_batch: int
    lost: tuple[int, ...] = ()
    found_lost: tuple[int, ...] = ()
    counts: CallCounts = field(default_factory=CallCounts)


@dataclass(frozen=True)
class Piece:
    """Tokens of one expert computed in one round, by ``party``: rows ``offset ...`` of the
    remote output (a remote piece)."""

    expert: int
    round: int
    party: int
    tokens: Tensor  # (rows,) int64
    offset: int = 0


@dataclass
class _Host:
    """What one host was sent in a call, in the order it was sent (its answers come back so)."""

    pieces: list[Piece] = field(default_factory=list)


class Rounds:
    """The plan and outcome of one call; see the module docstring."""

    def __init__(
        self,
        *,
        transport: Transport,
        hosts: tuple[tuple[int, ...], ...],
        party: int,
        step: int,
        micro_batch: int,
        deadline_s: float,
        routing: Routing,
        top_k: int,
        lost: set[int],
        total: CallCounts,
    ) -> None:
        self.transport = transport
        self.holders = hosts  # holders[e]: expert e's parties, the primary first
        self.party = party
        self.deadline_s = deadline_s
        self.routing = routing
        self.top_k = top_k
        self.layer_lost = lost  # the layer's: what this call finds is told to every later one
        self.total = total
        self.known = frozenset(lost)
        self.lost = set(lost)
        self.step = step
        self.micro_batch = micro_batch
        self.report = Rerouting(step, micro_batch)
        self.pieces: list[Piece] = []  # the remote ones, in output order once run
        self.sent: dict[int, _Host] = {}
        self.final, self.serving = self._plan()

    def _call(self, kinds: Kinds, callee: int) -> Call:
        return Call(
            self.transport, kinds, self.step, self.micro_batch, self.party, callee, self.deadline_s
        )

    # -- planning ----------------------------------------------------------------------------------

    def _plan(self) -> tuple[Routing, tuple[int | None, ...]]:
        serving = tuple(next((p for p in h if p not in self.lost), None) for h in self.holders)
        live = torch.tensor([s is not None for s in serving], dtype=torch.bool)
        final, moved = substitute(self.routing, self.top_k, live)
        counts = self.report.counts
        counts.to_next_best = moved
        counts.to_replica = sum(
            c for e, c in enumerate(final.counts) if serving[e] not in (None, self.holders[e][0])
        )
        return final, serving

    def by_expert(self) -> list[Tensor]:
        """The final routing's tokens of each expert."""
        return list(torch.split(self.final.tokens, list(self.final.counts)))

    def remote_parties(self) -> list[int]:
        parties = {p for h in self.holders for p in h}
        return sorted(p for p in parties if p != self.party and p not in self.lost)

    def held_by(self, party: int) -> list[int]:
        return [e for e, h in enumerate(self.holders) if party in h]

    def local_pieces(self) -> list[Piece]:
        """The tokens the router's party computes itself (every token of every expert it serves
        after the last round)."""
        tokens = self.by_expert()
        return [
            Piece(e, 0, self.party, tokens[e])
            for e, s in enumerate(self.serving)
            if s == self.party
        ]

    # -- forward ------------------------------------------------------------------------------------

    def _send(self, kinds: Kinds, flat: Tensor, want: dict[int, list[Piece]], always: bool) -> None:
        for p, pieces in want.items():
            call = self._call(kinds, p)
            by_e = {piece.expert: piece.tokens for piece in pieces}
            header = torch.tensor(
                [len(by_e[e]) if e in by_e else 0 for e in self.held_by(p)], dtype=torch.int64
            )
            self.transport.send(call.out(kinds.header), header)
            rows = int(header.sum())
            if rows or always:
                order = [by_e[e] for e in self.held_by(p) if e in by_e]
                tokens = torch.cat(order) if order else torch.zeros(0, dtype=torch.int64)
                self.transport.send(call.out(kinds.tensor_in), flat.index_select(0, tokens))

    def _gather(
        self, kinds: Kinds, flat: Tensor, want: dict[int, list[Piece]]
    ) -> dict[int, Tensor]:
        """The answers of the hosts in ``want`` that came within the deadline; the others are
        added to ``lost``."""
        give_up = time.monotonic() + self.deadline_s
        got: dict[int, Tensor] = {}
        waited = False
        for p, pieces in want.items():
            rows = sum(len(piece.tokens) for piece in pieces)
            if not rows and kinds is not EXPERTS:
                continue
            call = self._call(kinds, p)
            expected = TensorSpec(kinds.tensor_out, spec_of(flat, "x").dtype, (rows, flat.shape[1]))
            try:
                got[p] = self.transport.receive(
                    call.back(kinds.tensor_out),
                    expected,
                    timeout_s=max(0.0, give_up - time.monotonic()),
                )
            except MessageLate:
                self.lost.add(p)
                waited = True
        self.report.counts.deadline_waits += waited
        return got

    def _want(self, round_: int, done: dict[int, Tensor]) -> dict[int, list[Piece]]:
        """Per live remote host, the pieces it computes in ``round_`` (``done``: tokens of each
        expert an earlier round already has)."""
        want: dict[int, list[Piece]] = {p: [] for p in self.remote_parties()}
        for e, tokens in enumerate(self.by_expert()):
            p = self.serving[e]
            if p is None or p == self.party:
                continue
            if e in done:
                tokens = tokens[~torch.isin(tokens, done[e])]
            if round_ == 0 or len(tokens):
                want[p].append(Piece(e, round_, p, tokens))
        return want

    def run(self, flat: Tensor) -> Tensor:
        """(rows, width): every remote piece's output, pieces in (expert, round) order."""
        first = self._want(0, {})
        self._send(EXPERTS, flat, first, always=True)
        got = {p: (first[p], out) for p, out in self._gather(EXPERTS, flat, first).items()}
        if len(got) < len(first):
            with torch.enable_grad():  # the new gates are the router's, differentiable
                self.final, self.serving = self._plan()  # without the hosts just found lost
        done = {pc.expert: pc.tokens for pieces, _ in got.values() for pc in pieces}
        second = {p: v for p, v in self._want(1, done).items() if p in got}
        self._send(REROUTE, flat, second, always=False)
        more = self._gather(REROUTE, flat, second)
        for p, pieces in second.items():
            if p in more:
                got[p] = (got[p][0] + pieces, torch.cat([got[p][1], more[p]]))
            elif p in self.lost:
                self.report.counts.dropped += sum(len(pc.tokens) for pc in pieces)
        out = self._assemble(got, flat)
        # the call went through: what it found holds for the calls after it
        self.report.lost = tuple(sorted(self.lost))
        self.report.found_lost = tuple(sorted(self.lost - self.known))
        self.layer_lost.update(self.lost)
        self.total.add(self.report.counts)
        return out

    def _assemble(self, got: dict[int, tuple[list[Piece], Tensor]], flat: Tensor) -> Tensor:
        parts: list[tuple[Piece, Tensor]] = []
        for pieces, out in got.values():
            rows = torch.split(out, [len(pc.tokens) for pc in pieces])
            parts.extend(zip(pieces, rows, strict=True))
        parts.sort(key=lambda item: (item[0].expert, item[0].round))
        for p in got:  # a host sent no tokens still takes part in the backward
            self.sent.setdefault(p, _Host())
        offset = 0
        for piece, _rows in parts:
            placed = Piece(piece.expert, piece.round, piece.party, piece.tokens, offset)
            self.pieces.append(placed)
            self.sent.setdefault(piece.party, _Host()).pieces.append(placed)
            offset += len(piece.tokens)
        if not parts:
            return flat.new_zeros(0, flat.shape[1])
        return torch.cat([rows for _, rows in parts])

    # -- backward -----------------------------------------------------------------------------------

    def backward(self, grad: Tensor, like: Tensor) -> Tensor:
        """The gradient of the layer's input (``like``'s shape) from the remote output's."""
        out = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
        width = int(like.shape[1])
        answering = [p for p in self.sent if p not in self.lost | self.layer_lost]
        for p in answering:
            g = [grad[pc.offset : pc.offset + len(pc.tokens)] for pc in self._in_sent_order(p)]
            g_all = torch.cat(g) if g else grad.new_zeros(0, width)
            self.transport.send(self._call(EXPERTS, p).out(EXPERTS.grad), g_all.contiguous())
        give_up = time.monotonic() + self.deadline_s
        counts = CallCounts()
        for p in self.sent:
            pieces = self._in_sent_order(p)
            tokens = torch.cat([pc.tokens for pc in pieces]) if pieces else torch.zeros(0).long()
            if p not in answering:
                counts.lost_gradients += len(tokens)
                continue
            shape = (len(tokens), width)
            try:
                x_grad = self.transport.receive(
                    self._call(EXPERTS, p).back(EXPERTS.grad),
                    TensorSpec(EXPERTS.grad, spec_of(like, "x").dtype, shape),
                    timeout_s=max(0.0, give_up - time.monotonic()),
                )
            except MessageLate:
                self.lost.add(p)
                self.layer_lost.add(p)
                counts.deadline_waits = 1
                counts.lost_gradients += len(tokens)
                continue
            out.index_add_(0, tokens, x_grad.to(out.device, out.dtype))
        self.report.counts.add(counts)
        self.total.add(counts)
        return out

    def _in_sent_order(self, party: int) -> list[Piece]:
        """A host's pieces as it computed them: round one's, then round two's, each in the
        order of the experts it holds (its answer's row order)."""
        return sorted(self.sent[party].pieces, key=lambda pc: (pc.round, pc.expert))


class _RemoteExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rounds: Rounds, flat: Tensor) -> Tensor:
        ctx.rounds = rounds
        ctx.like = flat.new_zeros(()).expand(flat.shape)  # the input's shape, no memory
        return rounds.run(flat.detach())

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        rounds: Rounds = ctx.rounds
        return None, rounds.backward(grad, ctx.like)


def remote_experts(rounds: Rounds, flat: Tensor) -> Tensor:
    """``rounds.run(flat)`` as a differentiable function of ``flat`` (the token rows)."""
    out: Tensor = _RemoteExperts.apply(rounds, flat)
    return out
