"""Experts and tensor slices on other parties (node/pipeline/experts.py, tensorsplit.py): the same
outputs and gradients as the one-process computation (fp32, no token dropped by capacity), each
party in its own thread over a MemoryNetwork; and what a party refuses."""

from __future__ import annotations

import copy
import itertools
import threading
from collections.abc import Callable, Sequence

import pytest
import torch
from gpuflex.node.errors import PipelineError
from gpuflex.node.pipeline.experts import DistributedMoE, ExpertShard, Placement, expert_server
from gpuflex.node.pipeline.remote import EXPERTS, SLICES, Call, exchange
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
from gpuflex.protocol import ModelSpec, build_model
from gpuflex.protocol.moe import MoE
from gpuflex.protocol.transformer import SelfAttention
from torch import Tensor, nn

torch.set_num_threads(1)
TOL = 1e-5

SPEC = {"kind": "transformer", "vocab": 64, "context": 16, "layers": 1, "width": 32, "heads": 4}


def rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm().clamp_min(1e-30))


def in_threads(*jobs: Callable[[], None]) -> Callable[[], None]:
    """Start ``jobs`` in threads; the returned join re-raises the first failure."""
    errors: list[BaseException] = []

    def run(job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as exc:  # re-raised by join
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(job,), daemon=True) for job in jobs]
    for t in threads:
        t.start()

    def join() -> None:
        for t in threads:
            t.join(timeout=60)
        if errors:
            raise errors[0]

    return join


def _moe(experts: int, top_k: int) -> MoE:
    spec = ModelSpec.from_dict(
        {**SPEC, "experts": experts, "top_k": top_k, "capacity_factor": float(experts)}
    )  # room for every token
    block = build_model(spec, seed=1).blocks[0].mlp
    assert isinstance(block, MoE)
    return block


@pytest.mark.parametrize(
    ("experts", "top_k", "hosts"),
    [
        (4, 1, (0, 1, 1, 2)),  # the router's party holds expert 0 itself
        (4, 2, (1, 2, 3, 1)),
        (6, 2, (1, 1, 1, 1, 1, 1)),
    ],
)
def test_distributed_experts_match_one_process(
    experts: int, top_k: int, hosts: tuple[int, ...]
) -> None:
    whole = _moe(experts, top_k)
    x = torch.randn(3, 16, 32, generator=torch.Generator().manual_seed(2), requires_grad=True)
    g = torch.randn(3, 16, 32, generator=torch.Generator().manual_seed(3))
    y = whole(x)
    ((y * g).sum() + whole.router.aux_loss).backward()
    router = whole.router
    assert router.routed is not None and router.kept is not None
    assert torch.equal(router.routed, router.kept)  # nothing dropped

    parted = copy.deepcopy(whole)
    parted.zero_grad()
    placement = Placement(hosts)
    net = MemoryNetwork()
    shards = {
        p: ExpertShard({e: parted.experts[e] for e in placement.held_by(p)}, 32)
        for p in placement.parties()
        if p != 0
    }
    servers = [expert_server(net.transport(), p, shard) for p, shard in shards.items()]
    join = in_threads(*[lambda s=s: (s.forward(5, 1, 0), s.backward(5, 1, 0)) for s in servers])
    local = {e: parted.experts[e] for e in placement.held_by(0)}
    layer = DistributedMoE(parted.router, local, placement, 0, net.transport())
    x2 = x.detach().clone().requires_grad_(True)
    y2 = layer(x2, step=5, micro_batch=1)
    ((y2 * g).sum() + parted.router.aux_loss).backward()
    join()
    assert rel(y2, y) <= TOL
    assert x.grad is not None and x2.grad is not None and rel(x2.grad, x.grad) <= TOL
    for (name, p), (_, q) in zip(whole.named_parameters(), parted.named_parameters(), strict=True):
        if name.startswith("drop"):
            continue
        assert p.grad is not None and q.grad is not None, name
        assert rel(q.grad, p.grad) <= TOL, name


def _run_split(
    mode: str,
    parties: int,
    module: nn.Module,
    pieces: Sequence[nn.Module],
    in_sizes: Sequence[int],
    out_sizes: Sequence[int],
    after: nn.Module | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    x = torch.randn(
        2,
        16,
        in_sizes[0] if mode != "rows" else sum(in_sizes),
        generator=torch.Generator().manual_seed(4),
        requires_grad=True,
    )
    y = module(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
    (y * g).sum().backward()
    net = MemoryNetwork()
    servers = [
        slice_server(net.transport(), i, SliceHost(pieces[i], in_sizes[i]))
        for i in range(1, parties)
    ]
    join = in_threads(*[lambda s=s: (s.forward(0, 0, 0), s.backward(0, 0, 0)) for s in servers])
    layer = SplitLayer(
        mode,
        pieces[0],
        list(range(1, parties)),
        in_sizes=in_sizes,
        out_sizes=out_sizes,
        party=0,
        transport=net.transport(),
        after=after,
    )
    x2 = x.detach().clone().requires_grad_(True)
    y2 = layer(x2, step=0, micro_batch=0)
    (y2 * g).sum().backward()
    join()
    assert x.grad is not None and x2.grad is not None
    return y, y2, x.grad, x2.grad


@pytest.mark.parametrize("parties", [2, 3, 4])
def test_a_linear_split_by_columns_matches_one_process(parties: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(24, 40)
    pieces = split_columns(linear, parties)
    y, y2, gx, gx2 = _run_split(
        "columns", parties, linear, pieces, [24] * parties, split_sizes(40, parties)
    )
    assert rel(y2, y) <= TOL and rel(gx2, gx) <= TOL
    assert linear.weight.grad is not None and linear.bias.grad is not None
    assert rel(torch.cat([p.weight.grad for p in pieces]), linear.weight.grad) <= TOL  # type: ignore[misc]
    assert rel(torch.cat([p.bias.grad for p in pieces]), linear.bias.grad) <= TOL  # type: ignore[misc]


@pytest.mark.parametrize("parties", [2, 3, 4])
def test_a_linear_split_by_rows_matches_one_process(parties: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(40, 24)
    pieces = split_rows(linear, parties)
    y, y2, gx, gx2 = _run_split(
        "rows", parties, linear, pieces, split_sizes(40, parties), [24] * parties
    )
    assert rel(y2, y) <= TOL and rel(gx2, gx) <= TOL
    assert linear.weight.grad is not None and linear.bias.grad is not None
    assert rel(torch.cat([p.weight.grad for p in pieces], dim=1), linear.weight.grad) <= TOL  # type: ignore[misc]
    assert pieces[0].bias is not None and pieces[0].bias.grad is not None
    assert rel(pieces[0].bias.grad, linear.bias.grad) <= TOL
    assert all(p.bias is None for p in pieces[1:])


@pytest.mark.parametrize("parties", [2, 3, 4])
def test_attention_split_by_heads_matches_one_process(parties: int) -> None:
    spec = ModelSpec.from_dict(SPEC)
    attn = build_model(spec, seed=3).blocks[0].attn
    assert isinstance(attn, SelfAttention)
    pieces = split_heads(attn, parties)
    y, y2, gx, gx2 = _run_split(
        "heads", parties, attn, pieces, [32] * parties, [32] * parties, after=attn.drop
    )
    assert rel(y2, y) <= TOL and rel(gx2, gx) <= TOL
    hw = 32 // 4
    bounds = list(
        itertools.pairwise([0, *torch.tensor(split_sizes(4, parties)).cumsum(0).tolist()])
    )
    assert attn.qkv.weight.grad is not None and attn.proj.weight.grad is not None
    for piece, (a, b) in zip(pieces, bounds, strict=True):
        assert piece.proj.weight.grad is not None and piece.qkv.weight.grad is not None
        assert rel(piece.proj.weight.grad, attn.proj.weight.grad[:, a * hw : b * hw]) <= TOL
        q_rows = attn.qkv.weight.grad[a * hw : b * hw]
        assert rel(piece.qkv.weight.grad[: (b - a) * hw], q_rows) <= TOL


def test_a_host_refuses_what_it_was_not_sent_or_cannot_take() -> None:
    net = MemoryNetwork()
    shard = ExpertShard({1: nn.Linear(8, 8)}, 8, max_tokens=100)
    server = expert_server(net.transport(), 1, shard, timeout_s=2.0)
    call = Call(net.transport(), EXPERTS, 0, 0, 0, 1, 2.0)
    # a header asking for more tokens than the host takes: refused before any tensor is read
    call.transport.send(call.out("expert_route"), torch.tensor([1000]))
    with pytest.raises(PipelineError, match="at most 100; refused"):
        server.forward(0, 0, 0)
    # tokens of another shape than the counts say
    call = Call(net.transport(), EXPERTS, 1, 0, 0, 1, 2.0)
    call.transport.send(call.out("expert_route"), torch.tensor([3]))
    call.transport.send(call.out("expert_in"), torch.zeros(4, 8))
    with pytest.raises(PipelineError, match=r"has shape \[4, 8\], expected \[3, 8\]"):
        server.forward(1, 0, 0)
    with pytest.raises(PipelineError, match="no forward of step 1"):
        server.backward(1, 0, 0)
    # a host's answer for tokens it was not sent (one more row): the router refuses it
    call = Call(net.transport(), EXPERTS, 2, 0, 0, 1, 2.0)
    net.transport().send(call.back("expert_out"), torch.zeros(4, 8))
    with pytest.raises(PipelineError, match=r"expert_out .* has shape"):
        exchange([call], [torch.tensor([3])], [torch.zeros(3, 8)], [(3, 8)])
    # a slice of the wrong width; a placement that leaves an expert out
    host = SliceHost(nn.Linear(8, 4), 8)
    with pytest.raises(PipelineError, match="input features was sent an input of shape"):
        host.input_shape(torch.tensor([2, 3, 9]))
    router = _moe(4, 1).router
    with pytest.raises(PipelineError, match="names 3 experts; the router has 4"):
        DistributedMoE(router, {}, Placement((1, 1, 2)), 0, net.transport())
    assert SLICES.header == "slice_shape"
