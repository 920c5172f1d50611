"""The referee re-executes one expert or one tensor slice on one micro-batch
(hub/policy/piece_check.py): hosts record their chosen calls (node/pipeline/witness.py) while
serving real layers in threads over a MemoryNetwork; honest work reproduces, a perturbed answer,
a perturbed input gradient and other parameters are caught, and evidence that cannot be judged
is refused in one line."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping

import pytest
import torch
from gpuflex.hub.base.errors import Unprocessable
from gpuflex.hub.policy.piece_check import judge_expert, judge_slice
from gpuflex.node.errors import PipelineError
from gpuflex.node.pipeline.experts import DistributedMoE, ExpertShard, Placement, expert_server
from gpuflex.node.pipeline.tensorsplit import (
    SliceHost,
    SplitLayer,
    slice_server,
    split_columns,
    split_heads,
    split_rows,
    split_sizes,
)
from gpuflex.node.pipeline.transport import MemoryNetwork
from gpuflex.node.pipeline.witness import Witness
from gpuflex.protocol import ModelSpec, build_model
from gpuflex.protocol.moe import MoE
from gpuflex.protocol.piececall import PieceCall
from gpuflex.protocol.transformer import SelfAttention
from torch import Tensor, nn

from tests.test_pipeline_experts import in_threads

torch.set_num_threads(1)
TOL = 1e-4  # the job's default [verification] tolerance, as for an fp32 stage
SPEC = ModelSpec.from_dict(
    {
        "kind": "transformer",
        "vocab": 64,
        "context": 16,
        "layers": 1,
        "width": 32,
        "heads": 4,
        "experts": 4,
        "top_k": 2,
        "capacity_factor": 4.0,
    }
)
STEP, PICKED = 5, 1  # the hosts record micro-batch 1 of step 5; micro-batch 0 runs unrecorded


class _LoudShard(ExpertShard):
    """Answers 1e-3 more than its experts compute."""

    def forward(self, header: Tensor, x: Tensor) -> Tensor:
        return super().forward(header, x) * (1 + 1e-3)


class _SkewedShard(ExpertShard):
    """Answers its tokens' gradients 1% too large."""

    def forward(self, header: Tensor, x: Tensor) -> Tensor:
        x.register_hook(lambda g: g * 1.01)
        return super().forward(header, x)


def _expert_calls(
    shard: type[ExpertShard] = ExpertShard, stale: bool = False
) -> tuple[dict[str, Tensor], list[PieceCall]]:
    """A mixture of 4 experts (top-2) routed at party 0, experts 1 and 2 on party 1 (``shard``;
    ``stale``: their parameters perturbed by 1e-3), expert 3 on party 2; two micro-batches
    forward and backward. The MoE's durable state and the hosts' recorded calls."""
    moe = build_model(SPEC, seed=1).blocks[0].mlp
    assert isinstance(moe, MoE)
    durable = {k: v.detach().clone() for k, v in moe.state_dict().items()}
    placement = Placement((0, 1, 1, 2))
    experts: dict[int, nn.Module] = {e: moe.experts[e] for e in range(4)}
    if stale:
        for e in (1, 2):
            experts[e] = copy.deepcopy(experts[e])
            with torch.no_grad():
                for p in experts[e].parameters():
                    p.mul_(1 + 1e-3)
    net = MemoryNetwork()
    witnesses = {1: Witness([(STEP, PICKED)]), 2: Witness([(STEP, PICKED)])}
    servers = [
        expert_server(
            net.transport(),
            p,
            (shard if p == 1 else ExpertShard)({e: experts[e] for e in placement.held_by(p)}, 32),
            placement=placement,
            witness=witnesses[p],
        )
        for p in (1, 2)
    ]

    def serve(s: object) -> None:
        for mb in (0, 1):
            s.forward(STEP, mb, 0)  # type: ignore[attr-defined]
            s.backward(STEP, mb, 0)  # type: ignore[attr-defined]

    join = in_threads(*[lambda s=s: serve(s) for s in servers])
    layer = DistributedMoE(moe.router, {0: experts[0]}, placement, 0, net.transport())
    for mb in (0, 1):
        x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(mb), requires_grad=True)
        g = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(10 + mb))
        (layer(x, step=STEP, micro_batch=mb) * g).sum().backward()
    join()
    return durable, witnesses[1].calls + witnesses[2].calls


def _slice_calls(mode: str, parties: int) -> tuple[dict[str, Tensor], list[PieceCall]]:
    """A Linear (columns, rows) or an attention (heads) split ``parties`` ways, every slice but
    the first on a host that records micro-batch ``PICKED``: the layer's state and the calls."""
    torch.manual_seed(0)
    layer: nn.Module
    if mode == "heads":
        attn = build_model(SPEC, seed=3).blocks[0].attn
        assert isinstance(attn, SelfAttention)
        layer, pieces = attn, list(split_heads(attn, parties))
        in_sizes, out_sizes = [32] * parties, [32] * parties
    else:
        linear = nn.Linear(40, 24)
        layer = linear
        cols = mode == "columns"
        pieces = list(split_columns(linear, parties) if cols else split_rows(linear, parties))
        in_sizes = [40] * parties if cols else split_sizes(40, parties)
        out_sizes = split_sizes(24, parties) if cols else [24] * parties
    net = MemoryNetwork()
    witnesses = [Witness([(STEP, PICKED)]) for _ in range(1, parties)]
    servers = [
        slice_server(
            net.transport(),
            i,
            SliceHost(pieces[i], in_sizes[i], mode=mode, index=i),
            witness=witnesses[i - 1],
        )
        for i in range(1, parties)
    ]
    join = in_threads(
        *[lambda s=s: (s.forward(STEP, PICKED, 0), s.backward(STEP, PICKED, 0)) for s in servers]
    )
    split = SplitLayer(
        mode,
        pieces[0],
        list(range(1, parties)),
        in_sizes=in_sizes,
        out_sizes=out_sizes,
        party=0,
        transport=net.transport(),
    )
    x = torch.randn(
        2,
        8,
        40 if mode != "heads" else 32,
        generator=torch.Generator().manual_seed(4),
        requires_grad=True,
    )
    y = split(x, step=STEP, micro_batch=PICKED)
    (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(5))).sum().backward()
    join()
    state = {k: v.detach().clone() for k, v in layer.state_dict().items()}
    return state, [c for w in witnesses for c in w.calls]


def _judge_experts(durable: Mapping[str, Tensor], calls: list[PieceCall]) -> list[bool]:
    return [judge_expert(SPEC, durable, c, tolerance=TOL).ok for c in calls]


def test_honest_expert_hosts_reproduce_and_only_the_chosen_micro_batch_is_recorded() -> None:
    durable, calls = _expert_calls()
    assert {(c.step, c.micro_batch, c.kind) for c in calls} == {(STEP, PICKED, "expert")}
    assert sorted(c.index for c in calls) == [1, 2, 3]  # one call per remote expert with tokens
    for call in calls:
        assert call.grad_out is not None and call.grad_in is not None
        assert call.out.shape == call.x.shape == call.grad_in.shape
        verdict = judge_expert(SPEC, durable, call, tolerance=TOL)
        assert verdict.ok, verdict.evidence
        assert verdict.evidence["forward_distance"] <= 1e-6
        assert verdict.evidence["backward_distance"] <= 1e-6
        assert verdict.evidence["params"] == verdict.evidence["durable_params"]
        assert "reproduced" in verdict.evidence["why"]


def test_an_expert_host_recorded_across_the_rerouting_round_reproduces() -> None:
    """Party 2 (expert 3) never answers: its tokens go to their next-best live experts in a
    second round, so party 1's experts are sent tokens in both rounds; each expert's call joins
    them, and the referee reproduces it."""
    moe = build_model(SPEC, seed=1).blocks[0].mlp
    assert isinstance(moe, MoE)
    durable = {k: v.detach().clone() for k, v in moe.state_dict().items()}
    placement = Placement((0, 1, 1, 2))
    net = MemoryNetwork()
    witness = Witness([(STEP, PICKED)])
    shard = ExpertShard({e: moe.experts[e] for e in (1, 2)}, 32)
    server = expert_server(net.transport(), 1, shard, placement=placement, witness=witness)
    join = in_threads(lambda: (server.forward(STEP, PICKED, 0), server.backward(STEP, PICKED, 0)))
    layer = DistributedMoE(
        moe.router, {0: moe.experts[0]}, placement, 0, net.transport(), deadline_s=0.3
    )
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(11))
    (layer(x, step=STEP, micro_batch=PICKED) * g).sum().backward()
    join()
    assert layer.last is not None and layer.last.found_lost == (2,)
    assert moe.router.kept is not None
    first_round = int(moe.router.kept[1] + moe.router.kept[2])
    assert sum(len(c.x) for c in witness.calls) > first_round  # tokens came in the second round
    for call in witness.calls:
        verdict = judge_expert(SPEC, durable, call, tolerance=TOL, held=(1, 2))
        assert verdict.ok, verdict.evidence


@pytest.mark.parametrize(("mode", "parties"), [("columns", 3), ("rows", 3), ("heads", 2)])
def test_honest_slice_hosts_reproduce(mode: str, parties: int) -> None:
    state, calls = _slice_calls(mode, parties)
    assert [c.index for c in calls] == list(range(1, parties))
    for call in calls:
        verdict = judge_slice(state, call, parties=parties, heads=4, tolerance=TOL)
        assert verdict.ok, verdict.evidence
        assert (
            max(verdict.evidence["forward_distance"], verdict.evidence["backward_distance"]) <= 1e-6
        )


@pytest.mark.parametrize(
    ("fault", "shard", "stale", "caught_by"),
    [
        ("a perturbed answer", _LoudShard, False, "forward_distance"),
        ("a perturbed input gradient", _SkewedShard, False, "backward_distance"),
        ("other parameters", ExpertShard, True, "forward_distance"),
    ],
)
def test_a_faulty_expert_host_is_caught(
    fault: str, shard: type[ExpertShard], stale: bool, caught_by: str
) -> None:
    durable, calls = _expert_calls(shard, stale)
    faulty = [c for c in calls if c.index in (1, 2)]  # party 1's experts
    for call in faulty:
        verdict = judge_expert(SPEC, durable, call, tolerance=TOL)
        assert not verdict.ok, (fault, verdict.evidence)
        assert verdict.evidence[caught_by] > TOL, (fault, verdict.evidence)
        assert "\n" not in verdict.evidence["why"]
    assert _judge_experts(durable, [c for c in calls if c.index == 3]) == [True]  # party 2: honest
    if stale:  # the host's own record names its parameters; claiming the durable ones is no cover
        verdict = judge_expert(SPEC, durable, faulty[0], tolerance=TOL)
        assert verdict.evidence["why"].startswith("expert_replay: computed with parameters")
        lied = dataclasses.replace(faulty[0], params=verdict.evidence["durable_params"])
        verdict = judge_expert(SPEC, durable, lied, tolerance=TOL)
        assert not verdict.ok and "did not reproduce (forward_distance" in verdict.evidence["why"]


def test_a_slice_with_other_parameters_is_caught() -> None:
    state, calls = _slice_calls("rows", 2)
    stale = {k: v * (1 + 1e-3) for k, v in state.items()}
    verdict = judge_slice(stale, calls[0], parties=2, tolerance=TOL)
    assert not verdict.ok and verdict.evidence["forward_distance"] > TOL, verdict.evidence


def test_evidence_that_cannot_be_judged_is_refused_in_one_line() -> None:
    durable, calls = _expert_calls()
    call = calls[0]
    assert call.grad_out is not None
    n = int(call.x.shape[0])
    nan = call.x.clone()
    nan[0, 0] = float("nan")
    bad = {
        "names expert 9; the layer has 4": dataclasses.replace(call, index=9),
        f"answered \\[{n + 1}, 32\\] for the \\[{n}, 32\\] tokens": dataclasses.replace(
            call, out=torch.zeros(n + 1, 32)
        ),
        "x holds NaN or inf": dataclasses.replace(call, x=nan),
        "grad_in has shape": dataclasses.replace(call, grad_in=call.grad_out[:-1]),
        "one of its gradients without the other": dataclasses.replace(call, grad_in=None),
        "is not a sha256": dataclasses.replace(call, params="x"),
        "is not an expert's": dataclasses.replace(call, kind="rows"),
    }
    for why, evidence in bad.items():
        with pytest.raises(Unprocessable, match=why) as refused:
            judge_expert(SPEC, durable, evidence, tolerance=TOL)
        assert "\n" not in refused.value.detail and refused.value.detail.endswith("refused")
    party2 = next(c for c in calls if c.index == 3)
    with pytest.raises(Unprocessable, match="names expert 3; the placement gives the host"):
        judge_expert(SPEC, durable, party2, tolerance=TOL, held=(1, 2))
    state, slices = _slice_calls("columns", 2)
    piece = slices[0]
    wrong = {
        "was sent an input of shape \\[2, 8, 39\\]": dataclasses.replace(
            piece, x=piece.x[..., :39]
        ),
        "answered \\[2, 8, 13\\]": dataclasses.replace(piece, out=torch.zeros(2, 8, 13)),
        "slice 2 of a layer cut 2 ways does not exist": dataclasses.replace(piece, index=2),
        "is not a slice's": dataclasses.replace(piece, kind="expert"),
    }
    for why, evidence in wrong.items():
        with pytest.raises(Unprocessable, match=why):
            judge_slice(state, evidence, parties=2, tolerance=TOL)
    with pytest.raises(PipelineError, match="mode is not given cannot be witnessed"):
        slice_server(
            MemoryNetwork().transport(), 1, SliceHost(nn.Linear(4, 4), 4), witness=Witness([(0, 0)])
        )
