"""A mixture-of-experts layer routing around a lost expert host (node/pipeline/experts.py,
expertrounds.py, reroute.py): each host a thread over a MemoryNetwork, one host silent. The step
completes, the counts are right, and the outputs and gradients equal the one-process layer's with
the lost experts masked out of the router (or, with a replica, the unchanged layer's); bad
answers are refused and change nothing."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn.functional as F
from gpuflex.node.errors import PipelineError
from gpuflex.node.pipeline.expertrounds import CallCounts
from gpuflex.node.pipeline.experts import DistributedMoE, ExpertShard, Placement, expert_server
from gpuflex.node.pipeline.remote import EXPERTS, Call
from gpuflex.node.pipeline.reroute import expert_of, substitute
from gpuflex.node.pipeline.transport import MemoryNetwork
from gpuflex.protocol.moe import MoE, combine, route
from gpuflex.protocol.tensors import TensorSpec
from torch import Tensor, nn

from tests.test_pipeline_experts import _moe, in_threads, rel

torch.set_num_threads(1)
TOL = 1e-5
DEADLINE_S = 1.5  # a healthy host thread answers well within it, even on a loaded machine
WIDTH = 32


def _reference(whole: MoE, x: Tensor, masked: tuple[int, ...]) -> Tensor:
    """The one-process layer with the experts ``masked`` removed from the router's choice."""
    b, t, c = x.shape
    flat = x.reshape(b * t, c)
    logits = F.linear(flat, whole.router.weight)
    logits[:, list(masked)] = float("-inf")
    routing = route(logits, whole.router.top_k, capacity=b * t)  # room for every token
    inputs = torch.split(flat.index_select(0, routing.tokens), list(routing.counts))
    outputs = [expert(part) for expert, part in zip(whole.experts, inputs, strict=True)]
    return combine(outputs, routing, b * t).view(b, t, c)


def _parted(
    whole: MoE, placement: Placement, silent: tuple[int, ...]
) -> tuple[MemoryNetwork, MoE, DistributedMoE, list]:
    parted = copy.deepcopy(whole)
    net = MemoryNetwork()
    servers = [
        expert_server(
            net.transport(),
            p,
            ExpertShard({e: parted.experts[e] for e in placement.held_by(p)}, WIDTH),
            timeout_s=5.0,
            placement=placement,
        )
        for p in placement.parties()
        if p != 0 and p not in silent
    ]
    local = {e: parted.experts[e] for e in placement.held_by(0)}
    layer = DistributedMoE(
        parted.router, local, placement, 0, net.transport(), deadline_s=DEADLINE_S
    )
    return net, parted, layer, servers


def _step(layer: DistributedMoE, servers: list, x: Tensor, g: Tensor, step: int) -> Tensor:
    join = in_threads(
        *[lambda s=s: (s.forward(step, 0, 0), s.backward(step, 0, 0)) for s in servers]
    )
    y = layer(x, step=step, micro_batch=0)
    (y * g).sum().backward()
    join()
    return y


def _inputs() -> tuple[Tensor, Tensor]:
    x = torch.randn(2, 16, WIDTH, generator=torch.Generator().manual_seed(2), requires_grad=True)
    g = torch.randn(2, 16, WIDTH, generator=torch.Generator().manual_seed(3))
    return x, g


def _assert_same(whole: MoE, parted: MoE, y: Tensor, y2: Tensor, x: Tensor, x2: Tensor) -> None:
    assert rel(y2, y) <= TOL
    assert x.grad is not None and x2.grad is not None and rel(x2.grad, x.grad) <= TOL
    for (name, p), (_, q) in zip(whole.named_parameters(), parted.named_parameters(), strict=True):
        if p.grad is None or q.grad is None:  # an expert no token reached (here or there)
            assert not any(t is not None and t.any() for t in (p.grad, q.grad)), name
            continue
        assert rel(q.grad, p.grad) <= TOL, name


def test_a_silent_host_is_routed_around_once_and_skipped_after() -> None:
    whole = _moe(4, 2)
    placement = Placement((1, 2, 3, 0))  # host 3 (expert 2) never answers
    x, g = _inputs()
    y = _reference(whole, x, masked=(2,))
    (y * g).sum().backward()
    plain = whole.router(x.detach().reshape(-1, WIDTH))
    _, parted, layer, servers = _parted(whole, placement, silent=(3,))

    x2 = x.detach().clone().requires_grad_(True)
    y2 = _step(layer, servers, x2, g, step=0)
    _assert_same(whole, parted, y, y2, x, x2)
    assert layer.last is not None
    assert layer.last.found_lost == (3,) and layer.lost == {3}
    assert layer.last.counts.to_next_best == plain.counts[2] > 0
    assert layer.last.counts.deadline_waits == 1 and layer.last.counts.to_replica == 0

    # the next step skips host 3 without waiting, and computes the same
    x3 = x.detach().clone().requires_grad_(True)
    started = time.monotonic()
    y3 = _step(layer, servers, x3, g, step=1)
    assert time.monotonic() - started < DEADLINE_S
    assert rel(y3, y2) <= TOL and layer.last.found_lost == () and layer.last.lost == (3,)
    assert layer.last.counts.deadline_waits == 0
    assert layer.total.to_next_best == 2 * plain.counts[2] and layer.total.deadline_waits == 1

    layer.restore(3)
    assert layer.lost == set()


def test_a_replica_takes_the_lost_hosts_tokens() -> None:
    whole = _moe(4, 1)
    # expert 2 lives on host 3 with a copy on host 1; expert 1 on host 2 with a copy on host 3
    placement = Placement((1, 2, 3, 1), replicas=((), (3,), (1,), ()))
    x, g = _inputs()
    y = whole(x)
    (y * g).sum().backward()
    _, parted, layer, servers = _parted(whole, placement, silent=(3,))
    x2 = x.detach().clone().requires_grad_(True)
    y2 = _step(layer, servers, x2, g, step=0)
    _assert_same(whole, parted, y, y2, x, x2)
    assert layer.last is not None and layer.last.found_lost == (3,)
    assert whole.router.kept is not None
    assert layer.last.counts.to_replica == int(whole.router.kept[2]) > 0
    assert layer.last.counts.to_next_best == 0 and layer.last.counts.dropped == 0


def test_a_host_gone_before_the_backward_costs_its_tokens_gradient_only() -> None:
    whole = _moe(4, 2)
    placement = Placement((1, 2, 1, 2))
    _, _, layer, servers = _parted(whole, placement, silent=())
    join = in_threads(
        lambda: (servers[0].forward(0, 0, 0), servers[0].backward(0, 0, 0)),
        lambda: servers[1].forward(0, 0, 0),  # host 2 answers, then is gone
    )
    x, g = _inputs()
    y = layer(x, step=0, micro_batch=0)
    (y * g).sum().backward()
    join()
    assert layer.last is not None and layer.lost == {2}
    sent = sum(layer.router.kept[e] for e in placement.held_by(2))  # type: ignore[index]
    assert layer.last.counts.lost_gradients == sent > 0
    assert layer.last.counts.deadline_waits == 1 and layer.total.lost_gradients == sent
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_bad_answers_and_routes_are_refused_and_change_nothing() -> None:
    whole = _moe(4, 2)
    placement = Placement((1, 1, 1, 1))
    net, parted, layer, _ = _parted(whole, placement, silent=(1,))

    def lying_host() -> None:  # answers with one row more than it was sent
        call = Call(net.transport(), EXPERTS, 0, 0, 0, 1, 5.0)
        net.transport().receive(
            call.out("expert_route"), TensorSpec("h", "int64", (4,)), timeout_s=5
        )
        tokens = net.box(call.out("expert_in")).get(timeout=5)
        net.transport().send(call.back("expert_out"), torch.zeros(len(tokens) + 1, WIDTH))

    join = in_threads(lying_host)
    x, _ = _inputs()
    with pytest.raises(PipelineError, match=r"expert_out .* has shape"):
        layer(x, step=0, micro_batch=0)
    join()
    assert layer.lost == set() and layer.total == CallCounts() and layer.last is None

    # a gate that routes to an expert the layer does not have
    parted.router.weight = nn.Parameter(torch.randn(5, WIDTH))
    with pytest.raises(PipelineError, match=r"to 5 experts .* the layer has 4; refused"):
        layer(x, step=1, micro_batch=0)
    # a host whose experts are not the ones the placement gives it; a replica on its own host
    with pytest.raises(PipelineError, match=r"holds experts \[0\]; the placement gives it"):
        expert_server(net.transport(), 1, ExpertShard({0: nn.Linear(4, 4)}, 4), placement=placement)
    with pytest.raises(PipelineError, match="must be distinct"):
        Placement((1, 2), replicas=((1,), ()))
    with pytest.raises(PipelineError, match="not one of this layer's expert hosts"):
        layer.mark_lost(7)


def test_with_top_1_a_lost_experts_tokens_take_their_best_live_expert_at_its_probability() -> None:
    logits = torch.randn(12, 4, generator=torch.Generator().manual_seed(5))
    routing = route(logits, top_k=1, capacity=12)
    live = torch.tensor([True, False, True, True])
    moved, count = substitute(routing, 1, live)
    assert count == routing.counts[1] > 0 and moved.counts[1] == 0
    probs = logits.softmax(dim=-1)
    best = probs.masked_fill(~live, -1.0).argmax(dim=-1)
    owner = expert_of(moved)
    assert sorted(moved.tokens.tolist()) == list(range(12))
    assert torch.equal(owner, best[moved.tokens])
    assert torch.allclose(moved.gates, probs[moved.tokens, owner])
    same, none = substitute(routing, 1, torch.ones(4, dtype=torch.bool))
    assert same is routing and none == 0  # nothing lost: the router's own routing
