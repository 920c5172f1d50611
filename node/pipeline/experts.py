"""A mixture-of-experts layer whose experts live on other parties (expert parallelism).

The router's party routes the batch as the one-process layer does (protocol/moe.py: the same
``Router``, the same :class:`~gpuflex.protocol.moe.Routing`), batches the tokens of each host's
experts into one message (expert after expert, with the token counts as its header), and
combines what comes back with the gate weights; its own experts, if it holds any, run where it
is. Backward goes the same way in reverse: each host gets the gradient of its outputs, keeps its
experts' parameter gradients and answers with its tokens' gradients.

A host that does not answer within ``deadline_s`` is lost (node/pipeline/expertrounds.py): in the
same call its experts' tokens go to a live replica (a :class:`Placement` may give an expert
several parties) or to each token's next-best live expert (node/pipeline/reroute.py), and later
calls skip it without waiting until :meth:`DistributedMoE.restore`. Each call's
:class:`~.expertrounds.Rerouting` (``last``) and the running ``total`` count what was re-routed.

A host runs an :class:`ExpertShard` (its experts) under an :class:`ExpertServer`: it refuses a
header that names more tokens than it allows, and the transport refuses tokens or outputs of any
other shape than the counts say, so an answer for tokens that were not sent cannot be applied.

:func:`load_expert_shard` and :func:`load_distributed_moe` build a host and the router's party
from the job's model spec and state, as a stage is built (protocol.pipeline.moe_units): a LoRA
job's experts hold their frozen weights in int8 with per-channel scales (protocol/lora.py) and
train only their adapters, which are all that ``trained_state`` hands back. With a
:class:`~.witness.Witness` a host records, for the micro-batches its caller chose, each
expert's call (tokens, answer, gradients, the hash of the expert's parameters) for the referee.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from gpuflex.protocol.dropout import KeyedDropout
from gpuflex.protocol.errors import SpecError
from gpuflex.protocol.modelspec import ModelSpec
from gpuflex.protocol.moe import Router, Routing
from gpuflex.protocol.piececall import EXPERT, PieceCall, piece_hash
from gpuflex.protocol.pipeline import MoEUnits, Unit, load_unit, moe_units
from gpuflex.protocol.tensors import TensorSpec
from torch import Tensor, nn

from ..errors import PipelineError
from .expertrounds import REROUTE, CallCounts, Piece, Rerouting, Rounds, remote_experts
from .remote import EXPERTS, TIMEOUT_S, Call, Kinds
from .reroute import expert_of
from .transport import Transport, spec_of
from .unitstate import state_from_model
from .witness import Witness, per_expert

__all__ = [
    "DistributedMoE",
    "ExpertServer",
    "ExpertShard",
    "Placement",
    "expert_server",
    "load_distributed_moe",
    "load_expert_shard",
]

#: the most tokens a host takes in one call by default
MAX_TOKENS = 1 << 20
#: how long a router waits for a host's answer by default before it routes around the host
DEADLINE_S = 30.0


@dataclass(frozen=True)
class Placement:
    """Which parties hold each expert of one layer: ``hosts[e]`` is expert e's (its tokens go
    there while it is live), ``replicas[e]`` (none when empty) the parties holding a copy, in the
    order they take over."""

    hosts: tuple[int, ...]
    replicas: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.replicas and len(self.replicas) != len(self.hosts):
            raise PipelineError(
                f"the placement names replicas of {len(self.replicas)} experts; it has "
                f"{len(self.hosts)}"
            )
        for e, holders in enumerate(self.holders()):
            if min(holders) < 0 or len(set(holders)) != len(holders):
                raise PipelineError(
                    f"expert {e}'s parties {list(holders)} must be distinct and >= 0"
                )

    def holders(self) -> tuple[tuple[int, ...], ...]:
        """Each expert's parties, its host first."""
        extra = self.replicas or ((),) * len(self.hosts)
        return tuple((h, *r) for h, r in zip(self.hosts, extra, strict=True))

    def held_by(self, party: int) -> tuple[int, ...]:
        """The experts ``party`` holds (as host or replica), in expert order."""
        return tuple(e for e, holders in enumerate(self.holders()) if party in holders)

    def parties(self) -> tuple[int, ...]:
        return tuple(sorted({p for holders in self.holders() for p in holders}))


class ExpertShard(nn.Module):
    """The experts one host holds (``experts``: expert index -> module), run on the tokens a
    router sent: ``header`` counts each one's tokens, in expert order; ``x`` holds them.
    ``prefix`` is the model's name of their mixture (``blocks.<b>.mlp.``), for
    :meth:`trained_state`; :func:`load_expert_shard` makes a host from the job's spec."""

    def __init__(
        self,
        experts: Mapping[int, nn.Module],
        width: int,
        *,
        max_tokens: int = MAX_TOKENS,
        prefix: str = "",
    ) -> None:
        super().__init__()
        if not experts:
            raise PipelineError("an expert host needs at least one expert")
        self.index = tuple(sorted(experts))
        self.experts = nn.ModuleList(experts[e] for e in self.index)
        self.width = width
        self.max_tokens = max_tokens
        self.header_len = len(self.index)
        self.prefix = prefix

    def trained_parameters(self) -> dict[str, nn.Parameter]:
        """Its experts' trained parameters under the model's names (a LoRA job's adapters)."""
        return _trained(dict(zip(self.index, self.experts, strict=True)), self.prefix)

    def trained_state(self) -> dict[str, Tensor]:
        """What the host hands back: its trained tensors, copied to the CPU (a LoRA job's
        adapters alone, as a node's update carries them; the frozen weights never travel)."""
        return _copies(self.trained_parameters())

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


@dataclass
class _Round:
    header: Tensor
    x: Tensor
    out: Tensor


class ExpertServer:
    """A host's side of each call of one router (node/pipeline/expertrounds.py): ``forward``
    answers round one, then takes the second round's counts (zeros: nothing more) and answers
    that too; ``backward`` takes the gradient of everything it computed, accumulates its
    experts' parameter gradients and sends the tokens' gradients back. With a ``witness``, the
    calls of its chosen micro-batches are recorded, one per expert that was sent tokens
    (node/pipeline/witness.py)."""

    def __init__(
        self,
        transport: Transport,
        party: int,
        shard: ExpertShard,
        *,
        timeout_s: float = TIMEOUT_S,
        device: torch.device | None = None,
        witness: Witness | None = None,
    ) -> None:
        self.transport = transport
        self.party = party
        self.shard = shard
        self.timeout_s = timeout_s
        self.device = device or torch.device("cpu")
        self.witness = witness
        self._open: dict[tuple[int, int, int], list[_Round]] = {}

    def _call(self, kinds: Kinds, step: int, micro_batch: int, caller: int) -> Call:
        return Call(self.transport, kinds, step, micro_batch, caller, self.party, self.timeout_s)

    def _round(self, call: Call, always: bool) -> _Round | None:
        kinds = call.kinds
        header = self.transport.receive(
            call.out(kinds.header),
            TensorSpec(kinds.header, "int64", (self.shard.header_len,)),
            timeout_s=self.timeout_s,
        )
        shape = self.shard.input_shape(header)
        if not shape[0] and not always:
            return None
        x = self.transport.receive(
            call.out(kinds.tensor_in),
            TensorSpec(kinds.tensor_in, "float32", shape),
            timeout_s=self.timeout_s,
        )
        x = x.to(self.device).requires_grad_(True)
        out = self.shard(header, x)
        self.transport.send(call.back(kinds.tensor_out), out.detach())
        return _Round(header, x, out)

    def forward(self, step: int, micro_batch: int, caller: int) -> None:
        first = self._round(self._call(EXPERTS, step, micro_batch, caller), always=True)
        more = self._round(self._call(REROUTE, step, micro_batch, caller), always=False)
        rounds = [r for r in (first, more) if r is not None]
        self._open[(step, micro_batch, caller)] = rounds
        if self.witness is not None and self.witness.wants(step, micro_batch):
            self._witness(self.witness, rounds, step, micro_batch, caller)

    def _witness(
        self, witness: Witness, rounds: list[_Round], step: int, micro_batch: int, caller: int
    ) -> None:
        """Record each expert's call of this forward (its tokens of every round, joined)."""
        headers, index = [r.header for r in rounds], self.shard.index
        xs = per_expert(index, headers, [r.x.detach() for r in rounds])
        outs = per_expert(index, headers, [r.out.detach() for r in rounds])
        for e, expert in zip(index, self.shard.experts, strict=True):
            if len(xs[e]):
                params = piece_hash(expert.state_dict())
                witness.forward(
                    PieceCall(EXPERT, e, step, micro_batch, caller, xs[e], outs[e], params)
                )

    def backward(self, step: int, micro_batch: int, caller: int) -> None:
        rounds = self._open.pop((step, micro_batch, caller), None)
        if rounds is None:
            raise PipelineError(
                f"party {self.party} has no forward of step {step} micro-batch {micro_batch} "
                f"from party {caller} to take a gradient for"
            )
        call = self._call(EXPERTS, step, micro_batch, caller)
        outs = [r.out for r in rounds]
        whole = torch.cat([o.detach() for o in outs])
        grad = self.transport.receive(
            call.out(EXPERTS.grad), spec_of(whole, EXPERTS.grad), timeout_s=self.timeout_s
        ).to(whole.device)
        grads = list(torch.split(grad, [len(o) for o in outs]))
        torch.autograd.backward(outs, grads)
        x_grads = [r.x.grad if r.x.grad is not None else torch.zeros_like(r.x) for r in rounds]
        self.transport.send(call.back(EXPERTS.grad), torch.cat(x_grads))
        if self.witness is not None and self.witness.wants(step, micro_batch):
            headers, index = [r.header for r in rounds], self.shard.index
            sent, answered = per_expert(index, headers, grads), per_expert(index, headers, x_grads)
            self.witness.backward(
                step, micro_batch, caller, {(EXPERT, e): (sent[e], answered[e]) for e in index}
            )


def expert_server(
    transport: Transport,
    party: int,
    shard: ExpertShard,
    *,
    timeout_s: float = TIMEOUT_S,
    placement: Placement | None = None,
    witness: Witness | None = None,
) -> ExpertServer:
    """A host's side of the expert exchange for ``shard``; with ``placement``, refused unless
    the shard holds exactly the experts the placement gives ``party`` (a host's answers are
    taken as its experts' outputs); with ``witness``, recording its chosen micro-batches."""
    if placement is not None and shard.index != placement.held_by(party):
        raise PipelineError(
            f"party {party} holds experts {list(shard.index)}; the placement gives it "
            f"{list(placement.held_by(party))}; refused"
        )
    return ExpertServer(transport, party, shard, timeout_s=timeout_s, witness=witness)


class DistributedMoE(nn.Module):
    """The router's side of a mixture-of-experts layer placed by ``placement``: ``router`` (as
    in the one-process layer), ``local`` (the experts this ``party`` holds itself), dropout on
    the combined output (keyed ``slot``, as the one-process layer's). ``deadline_s``: how long
    it waits for a host's answers, counted from its last send of a round (module docstring);
    ``lost``: the set of lost parties, shared with the model's other such layers."""

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
        deadline_s: float = DEADLINE_S,
        lost: set[int] | None = None,
        prefix: str = "",
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
        if not deadline_s > 0:
            raise PipelineError(f"a deadline of {deadline_s} s cannot be met; it must be > 0")
        self.router = router
        self.local = nn.ModuleDict({str(e): m for e, m in local.items()})
        self.placement = placement
        self.party = party
        self.transport = transport
        self.drop = KeyedDropout(dropout, slot=slot)
        self.deadline_s = deadline_s
        #: the parties this layer does without (found lost, or told so), until ``restore``; the
        #: layers of one model share one set (``lost``), so a host one found lost costs the
        #: others no wait
        self.lost: set[int] = set() if lost is None else lost
        #: the last call's re-routing, and every call's counts added up
        self.last: Rerouting | None = None
        self.total = CallCounts()
        self.prefix = prefix

    def trained_parameters(self) -> dict[str, nn.Parameter]:
        """The trained parameters of its router and its own experts under the model's names
        (``prefix``: the mixture's); a LoRA job's: the experts' adapters (the router is frozen)."""
        local = {int(e): m for e, m in self.local.items()}
        return {**_trained({"router": self.router}, self.prefix), **_trained(local, self.prefix)}

    def trained_state(self) -> dict[str, Tensor]:
        """What the router's party hands back for this layer: its trained tensors on the CPU."""
        return _copies(self.trained_parameters())

    def remote_parties(self) -> tuple[int, ...]:
        return tuple(p for p in self.placement.parties() if p != self.party)

    def mark_lost(self, party: int) -> None:
        """Do without ``party`` from the next call on (it is known to be gone)."""
        if party == self.party or party not in self.placement.parties():
            raise PipelineError(f"party {party} is not one of this layer's expert hosts")
        self.lost.add(party)

    def restore(self, party: int) -> None:
        """Send ``party`` its experts' tokens again from the next call on."""
        self.lost.discard(party)

    def _check(self, routing: Routing, tokens: int) -> None:
        experts = len(self.placement.hosts)
        kept = int(routing.tokens.numel())
        if (
            len(routing.counts) != experts
            or sum(routing.counts) != kept
            or (kept and not 0 <= int(routing.tokens.min()) <= int(routing.tokens.max()) < tokens)
        ):
            raise PipelineError(
                f"the gate routed {kept} assignments of {tokens} tokens to {len(routing.counts)} "
                f"experts (counts {list(routing.counts)[:8]}); the layer has {experts}; refused"
            )

    def forward(self, x: Tensor, step: int, micro_batch: int) -> Tensor:
        b, t, c = x.shape  # (batch, time, width)
        flat = x.reshape(b * t, c)
        routing = self.router(flat)
        self._check(routing, b * t)
        rounds = Rounds(
            transport=self.transport,
            hosts=self.placement.holders(),
            party=self.party,
            step=step,
            micro_batch=micro_batch,
            deadline_s=self.deadline_s,
            routing=routing,
            top_k=self.router.top_k,
            lost=self.lost,
            total=self.total,
        )
        remote = remote_experts(rounds, flat)  # every host computes at once
        self.last = rounds.report
        outs = [remote[pc.offset : pc.offset + len(pc.tokens)] for pc in rounds.pieces]
        pieces = list(rounds.pieces)
        for pc in rounds.local_pieces():
            pieces.append(pc)
            outs.append(self.local[str(pc.expert)](flat.index_select(0, pc.tokens)))
        order = sorted(range(len(pieces)), key=lambda i: (pieces[i].expert, pieces[i].round))
        y = self._combine([pieces[i] for i in order], [outs[i] for i in order], rounds, flat)
        out: Tensor = self.drop(y.to(x.dtype).view(b, t, c))
        return out

    @staticmethod
    def _combine(pieces: list[Piece], outs: list[Tensor], rounds: Rounds, flat: Tensor) -> Tensor:
        """(tokens, width): each piece's outputs times its tokens' gates in the final routing,
        summed per token (protocol.moe.combine's order when nothing was re-routed)."""
        final = rounds.final
        tokens, width = int(flat.shape[0]), int(flat.shape[1])
        if not pieces:  # no expert left to any token: the residual carries them all
            return flat.new_zeros(tokens, width)
        gate = final.gates.new_zeros(tokens, len(final.counts)).index_put(
            (final.tokens, expert_of(final)), final.gates
        )  # (tokens, experts)
        out = torch.cat(outs)
        idx = torch.cat([pc.tokens for pc in pieces])
        gates = torch.cat([gate[pc.tokens, pc.expert] for pc in pieces])
        weighted = out * gates.unsqueeze(1).to(out.dtype)
        return weighted.new_zeros(tokens, width).index_add(0, idx, weighted)


# -- a host's and the router's party's share of a job's model --------------------------------


def _units(spec: ModelSpec, block: int) -> MoEUnits:
    try:
        return moe_units(spec, block)
    except SpecError as exc:
        raise PipelineError(str(exc)) from None


def _load(unit: Unit, state: Mapping[str, Tensor], device: torch.device | None) -> nn.Module:
    """``unit`` holding its tensors of the model's ``state`` on ``device`` (a copy), checked
    and loaded as a stage's unit is (names, dtypes, shapes, finite: PipelineError)."""
    params = state_from_model(unit, state).params
    try:
        return load_unit(unit, params, device=device)
    except RuntimeError as exc:
        first = " ".join(str(exc).split())[:200]
        raise PipelineError(f"{unit.name}'s state does not load: {first}") from None


def load_expert_shard(
    spec: ModelSpec,
    block: int,
    experts: Sequence[int],
    state: Mapping[str, Tensor],
    *,
    device: torch.device | None = None,
    max_tokens: int = MAX_TOKENS,
) -> ExpertShard:
    """The host of ``experts`` of block ``block``'s mixture in ``spec``'s model, holding their
    tensors of the model's ``state`` (the whole model's names; only theirs are read) on
    ``device``. The spec says how a job trains, as it tells a stage: for a LoRA job each
    targeted Linear of an expert is a ``LoraLinear`` (protocol/lora.py), its frozen weight in
    int8 with per-channel scales when ``frozen = "int8"``, and only the adapters train."""
    units = _units(spec, block)
    wrong = [e for e in experts if not 0 <= e < len(units.experts)]
    if wrong or len(set(experts)) != len(experts):
        raise PipelineError(
            f"experts {list(experts)[:8]} are not distinct experts of block {block}, which has "
            f"{len(units.experts)}; refused"
        )
    modules = {e: _load(units.experts[e], state, device) for e in experts}
    return ExpertShard(modules, units.width, max_tokens=max_tokens, prefix=units.prefix)


def load_distributed_moe(
    spec: ModelSpec,
    block: int,
    state: Mapping[str, Tensor],
    placement: Placement,
    party: int,
    transport: Transport,
    *,
    device: torch.device | None = None,
    deadline_s: float = DEADLINE_S,
    lost: set[int] | None = None,
) -> DistributedMoE:
    """The router's party of block ``block``'s mixture in ``spec``'s model: its router and the
    experts ``placement`` gives ``party``, loaded from the model's ``state`` as
    :func:`load_expert_shard` loads a host's (a LoRA job's: int8 frozen weights, trained
    adapters), with the block's own output dropout."""
    units = _units(spec, block)
    if len(placement.hosts) != len(units.experts):
        raise PipelineError(
            f"the placement names {len(placement.hosts)} experts; block {block} has "
            f"{len(units.experts)}"
        )
    router = _load(units.router, state, device)
    if not isinstance(router, Router):
        raise PipelineError(f"block {block}'s router is a {type(router).__name__}")
    local = {e: _load(units.experts[e], state, device) for e in placement.held_by(party)}
    return DistributedMoE(
        router,
        local,
        placement,
        party,
        transport,
        dropout=units.dropout,
        slot=units.slot,
        deadline_s=deadline_s,
        lost=lost,
        prefix=units.prefix,
    )


def _trained(
    modules: Mapping[int, nn.Module] | Mapping[str, nn.Module], prefix: str
) -> dict[str, nn.Parameter]:
    """Each module's trainable parameters, named ``prefix`` + ``experts.<e>.`` (an int key) or
    ``<key>.`` + their own name."""
    out: dict[str, nn.Parameter] = {}
    for key, module in modules.items():
        head = f"{prefix}experts.{key}." if isinstance(key, int) else f"{prefix}{key}."
        out.update({head + n: p for n, p in module.named_parameters() if p.requires_grad})
    return out


def _copies(params: Mapping[str, nn.Parameter]) -> dict[str, Tensor]:
    return {n: p.detach().to("cpu", copy=True) for n, p in params.items()}
