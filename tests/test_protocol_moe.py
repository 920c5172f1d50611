"""The transformer's mixture-of-experts block: its spec (one-line errors, the dense default left
as it was), its routing (top-k, capacity, keyed jitter, the balancing loss), and training: the
node's trainer includes the balancing loss and the referee's replay reproduces it bit for bit."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from gpuflex.hub.policy.referee import replay_segment
from gpuflex.node.checkpoints import training_state
from gpuflex.node.trainer import train_assignment
from gpuflex.protocol import ModelSpec, SpecError, build_model, encode_state, param_count
from gpuflex.protocol.checkpoint import model_part
from gpuflex.protocol.dropout import dropout_step
from gpuflex.protocol.jobspec import parse_job_spec
from gpuflex.protocol.moe import MoE, Router, aux_loss_of, route
from gpuflex.protocol.transformer import NextTokenLoss, Transformer

from tests.tooling.text import stdlib_text

torch.set_num_threads(1)

DENSE = {"kind": "transformer", "vocab": 256, "context": 16, "layers": 2, "width": 32, "heads": 4}
MOE = {**DENSE, "experts": 4, "top_k": 2, "router_jitter": 0.05, "dropout": 0.1}


def _bad(d: dict[str, Any], *needles: str) -> None:
    with pytest.raises(SpecError) as info:
        ModelSpec.from_dict(d)
    text = str(info.value)
    assert "\n" not in text
    for needle in needles:
        assert needle in text, text


def _tokens(batch: int, context: int = 16, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 256, (batch, context), generator=torch.Generator().manual_seed(seed))


def _routers(model: torch.nn.Module) -> list[Router]:
    return [m for m in model.modules() if isinstance(m, Router)]


def test_the_spec_reads_writes_and_refuses_bad_settings_in_one_line() -> None:
    spec = ModelSpec.from_dict(MOE)
    c = spec.transformer
    assert c is not None and (c.experts, c.top_k, c.capacity_factor, c.moe_every) == (4, 2, 1.25, 1)
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    every = ModelSpec.from_dict({**MOE, "layers": 4, "moe_every": 2}).transformer
    assert every is not None and [every.is_moe(i) for i in range(4)] == [False, True, False, True]
    _bad({**MOE, "top_k": 5}, "model.top_k", "at most experts (4)")
    _bad({**MOE, "top_k": 0}, "model.top_k")
    _bad({**MOE, "capacity_factor": 0}, "model.capacity_factor", "> 0")
    _bad({**MOE, "capacity_factor": -1.0}, "model.capacity_factor")
    _bad({**MOE, "router_jitter": 0.9}, "model.router_jitter")
    _bad({**MOE, "aux_loss_weight": -0.1}, "model.aux_loss_weight")
    _bad({**MOE, "moe_every": 3}, "model.moe_every", "at most layers (2)")
    _bad({**MOE, "experts": 1000}, "model.experts")
    _bad({**MOE, "experts": 2.5}, "model.experts", "integer")
    _bad({**DENSE, "top_k": 2}, "model.top_k", "experts > 0")
    _bad({**DENSE, "experts": 0, "capacity_factor": 2.0}, "model.capacity_factor", "experts > 0")
    text = (
        '[job]\nname = "m"\n[model]\n'
        + "\n".join(f"{k} = {v!r}" for k, v in MOE.items())
        + "\n[train]\nbatch_size = 8\n[pipeline]\nstages = 2\n"
    )
    # a mixture of experts pipelines: each stage holds whole blocks, experts and all
    job = parse_job_spec(text.replace("'", '"'))
    assert job.pipeline is not None and job.pipeline.stages == 2 and job.model.transformer.experts


def test_the_dense_default_is_unchanged() -> None:
    dense = ModelSpec.from_dict(DENSE)
    assert ModelSpec.from_dict({**DENSE, "experts": 0}) == dense
    assert "experts" not in dense.to_dict()
    model = build_model(dense, seed=1)
    assert _routers(model) == [] and aux_loss_of(model(_tokens(2))) is None
    moe = ModelSpec.from_dict(MOE)
    assert param_count(moe) > param_count(dense)
    assert encode_state(build_model(moe, seed=1).state_dict()) == encode_state(
        build_model(moe, seed=1).state_dict()
    )


def test_routing_keeps_the_capacity_and_counts_what_it_drops() -> None:
    logits = torch.tensor([[3.0, 0.0, 0.0], [2.0, 1.0, 0.0], [2.5, 0.0, 1.0], [0.0, 0.0, 4.0]])
    r = route(logits, top_k=1, capacity=2)
    assert r.routed.tolist() == [3, 0, 1] and r.counts == (2, 0, 1)  # token 2 over expert 0's room
    assert r.tokens.tolist() == [0, 1, 3]
    assert torch.allclose(r.gates, logits.softmax(-1).max(-1).values[[0, 1, 3]])
    two = route(logits, top_k=2, capacity=8)
    assert two.kept == 8 and torch.allclose(
        torch.zeros(4).index_add(0, two.tokens, two.gates), torch.ones(4)
    )
    balanced = route(torch.zeros(6, 3), top_k=1, capacity=6)
    assert balanced.aux.item() == pytest.approx(1.0)  # experts x sum f_e P_e with P_e = 1/experts
    # a block whose capacity drops tokens: they get nothing from the experts, and the router says so
    spec = ModelSpec.from_dict({**MOE, "capacity_factor": 0.25, "dropout": 0.0})
    model = build_model(spec, seed=2)
    block_moe = model.blocks[0].mlp
    assert isinstance(block_moe, MoE)
    x = torch.randn(2, 16, 32)
    y = block_moe(x)
    router = block_moe.router
    assert router.routed is not None and router.kept is not None
    dropped = int(router.routed.sum() - router.kept.sum())
    assert dropped > 0 and int(router.kept.max()) <= router.capacity(32)
    silent = (y.reshape(32, 32).abs().sum(-1) == 0).sum().item()
    assert silent > 0  # tokens both of whose choices were past capacity


def test_jitter_is_keyed_by_the_step_and_off_outside_training() -> None:
    spec = ModelSpec.from_dict({**MOE, "router_jitter": 0.5, "dropout": 0.0})
    model = build_model(spec, seed=4)
    x = _tokens(4)

    def logits(step: int | None, train: bool = True) -> torch.Tensor:
        model.train(train)
        if step is None:
            return model(x)
        with dropout_step(9, step):
            return model(x)

    assert torch.equal(logits(1), logits(1))
    assert not torch.equal(logits(1), logits(2))
    assert torch.equal(logits(None), logits(1, train=False))  # no key / evaluation: no jitter


def test_the_loss_includes_the_balancing_loss_and_trains_the_router() -> None:
    spec = ModelSpec.from_dict(
        {**MOE, "aux_loss_weight": 0.5, "dropout": 0.0, "router_jitter": 0.0}
    )
    model = build_model(spec, seed=5)
    assert isinstance(model, Transformer)
    x = _tokens(4)
    out = model(x)
    aux = aux_loss_of(out)
    assert aux is not None and aux.item() >= 0.5 * 2 * 0.99  # two routers, each >= weight x ~1
    loss = NextTokenLoss()(out, x)
    plain = torch.nn.functional.cross_entropy(out.flatten(0, 1), x.flatten())
    assert loss.item() == pytest.approx(plain.item() + aux.item(), rel=1e-6)
    loss.backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in _routers(model))


def test_the_nodes_training_and_the_referees_replay_agree_bit_for_bit() -> None:
    """The node's trainer (keyed dropout and jitter, the balancing loss in the loss) and the hub's
    replay of the same steps from the same start reach the same state."""
    job = parse_job_spec(
        '[job]\nname = "moe"\n[model]\n'
        + "\n".join(f"{k} = {v!r}".replace("'", '"') for k, v in MOE.items())
        + '\n[train]\nbatch_size = 8\nlocal_steps = 4\noptimizer = "adam"\nlr = 0.003\n'
    )
    text = torch.frombuffer(bytearray(stdlib_text(32 * 17)), dtype=torch.uint8).to(torch.int64)
    windows = text.view(32, 17)
    x, y = windows[:, :16].contiguous(), windows[:, 1:].contiguous()
    cfg = dataclasses.replace(job.train.train_config(), precision="fp32")
    start = {k: v.clone() for k, v in build_model(job.model, seed=0).state_dict().items()}
    states: dict[int, dict[str, torch.Tensor]] = {}

    def keep(step: int, model: torch.nn.Module, opt: Any, scaler: Any) -> None:
        states[step] = training_state(model, opt, step, scaler)

    res = train_assignment(
        job.model, start, [{"x": x, "y": y}], cfg, 7, device=torch.device("cpu"), on_step=keep
    )
    assert res.steps == 4 and res.loss > 0
    replayed = replay_segment(job.model, states[0], x, y, cfg, 7, 0, 4)
    final = model_part(states[4])
    assert set(replayed) == set(final)
    assert all(torch.equal(replayed[k], final[k]) for k in final)
    # without the balancing loss the same steps end elsewhere: the trainer did include it
    no_aux = dataclasses.replace(
        job.model, transformer=dataclasses.replace(job.model.transformer, aux_loss_weight=0.0)
    )
    other = replay_segment(no_aux, states[0], x, y, cfg, 7, 0, 4)
    router = "blocks.0.mlp.router.weight"
    assert not torch.equal(other[router], final[router])
