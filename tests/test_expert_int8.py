"""A LoRA job's experts on other parties (node/pipeline/experts.py: load_expert_shard,
load_distributed_moe): each host and the router's party load their share of the model from the
job's spec and state as a stage does, so their experts' frozen Linear weights are int8 with
per-channel scales and only the adapters train. Against the same LoRA int8 mixture in one process
the outputs and the gradients of the input and of every adapter agree within 1e-5, the frozen
tensors get no gradient, a host hands back its adapters alone, and its memory is about a quarter
of an fp32 host's. LoRA targets reach inside the experts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gpuflex.node.errors import PipelineError
from gpuflex.node.pipeline.experts import (
    ExpertShard,
    Placement,
    expert_server,
    load_distributed_moe,
    load_expert_shard,
)
from gpuflex.node.pipeline.transport import MemoryNetwork
from gpuflex.protocol.errors import SpecError
from gpuflex.protocol.finetune import LoraConfig, with_lora
from gpuflex.protocol.lora import LoraLinear
from gpuflex.protocol.modelspec import ModelSpec, build_model, update_manifest
from gpuflex.protocol.moe import MoE
from torch import Tensor, nn

from tests.test_pipeline_experts import in_threads, rel

torch.set_num_threads(1)
TOL = 1e-5
WIDTH = 64
PLAIN = ModelSpec.from_dict(
    {
        "kind": "transformer",
        "vocab": 64,
        "context": 8,
        "layers": 2,
        "width": WIDTH,
        "heads": 4,
        "experts": 4,
        "top_k": 2,
        "capacity_factor": 4.0,  # room for every token
    }
)
INT8 = LoraConfig(rank=2, alpha=4.0, targets=("experts",), frozen="int8")


def _lora(config: LoraConfig = INT8) -> ModelSpec:
    return with_lora(PLAIN, config, where="train")


def _model(spec: ModelSpec) -> nn.Module:
    """The model with its adapters' B drawn (B is zero untrained, and A would get no
    gradient)."""
    model = build_model(spec, seed=1)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".lora_b"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def _state(spec: ModelSpec) -> dict[str, Tensor]:
    return _model(spec).state_dict()


def _bytes(module: nn.Module) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize(
    "hosts",
    [
        (0, 1, 1, 2),  # 3 parties; the router's party holds expert 0 itself
        (1, 2, 2, 1),  # 3 parties; the router's party holds none
        (0, 1, 0, 1),  # 2 parties
    ],
)
def test_int8_experts_on_other_parties_match_the_one_process_lora_mixture(
    hosts: tuple[int, ...],
) -> None:
    spec = _lora()
    whole = _model(spec)
    state = whole.state_dict()
    moe = whole.blocks[1].mlp
    assert isinstance(moe, MoE) and isinstance(moe.experts[3].fc, LoraLinear)
    x = torch.randn(3, 8, WIDTH, generator=torch.Generator().manual_seed(2), requires_grad=True)
    g = torch.randn(3, 8, WIDTH, generator=torch.Generator().manual_seed(3))
    y = moe(x)
    assert moe.router.aux_loss is not None
    ((y * g).sum() + moe.router.aux_loss).backward()

    placement = Placement(hosts)
    net = MemoryNetwork()
    shards = {
        p: load_expert_shard(spec, 1, placement.held_by(p), state)
        for p in placement.parties()
        if p != 0
    }
    servers = [expert_server(net.transport(), p, s, placement=placement) for p, s in shards.items()]
    join = in_threads(*[lambda s=s: (s.forward(5, 1, 0), s.backward(5, 1, 0)) for s in servers])
    layer = load_distributed_moe(spec, 1, state, placement, 0, net.transport())
    x2 = x.detach().clone().requires_grad_(True)
    y2 = layer(x2, step=5, micro_batch=1)
    assert layer.router.aux_loss is not None
    ((y2 * g).sum() + layer.router.aux_loss).backward()
    join()

    assert rel(y2, y) <= TOL
    assert x.grad is not None and x2.grad is not None and rel(x2.grad, x.grad) <= TOL
    held: dict[str, nn.Parameter] = {}
    for party, part in [(0, layer), *shards.items()]:
        lora = [m for m in part.modules() if isinstance(m, LoraLinear)]
        assert len(lora) == 2 * len(placement.held_by(party))  # every expert's fc and proj
        assert all(m.get_buffer("weight_q").dtype == torch.int8 for m in lora)
        for name, p in part.named_parameters():
            if name.endswith((".lora_a", ".lora_b")):
                assert p.requires_grad and p.grad is not None, name
            else:  # frozen: the router, every bias; the weights are int8 buffers
                assert not p.requires_grad and p.grad is None, name
        assert sorted(part.trained_state()) == sorted(part.trained_parameters())
        held.update(part.trained_parameters())
    adapters = [t.name for t in update_manifest(spec) if t.name.startswith("blocks.1.mlp.")]
    assert sorted(held) == sorted(adapters)  # every adapter, held once, under the model's name
    for name, p in held.items():
        want = whole.get_parameter(name)
        assert torch.equal(p.detach(), want.detach())
        assert want.grad is not None and p.grad is not None and rel(p.grad, want.grad) <= TOL, name


def test_an_int8_host_holds_about_a_quarter_of_an_fp32_hosts_bytes() -> None:
    experts = (1, 3)
    full = load_expert_shard(PLAIN, 1, experts, build_model(PLAIN, seed=1).state_dict())
    over_fp32 = _lora(dataclasses.replace(INT8, frozen="fp32"))
    fp32 = load_expert_shard(over_fp32, 1, experts, build_model(over_fp32, seed=1).state_dict())
    spec = _lora()
    int8 = load_expert_shard(spec, 1, experts, _state(spec))
    frozen = _bytes(int8) - sum(t.numel() * 4 for t in int8.trained_state().values())
    assert _bytes(int8) < 0.35 * _bytes(full)  # adapters included, against full fine-tuning's
    assert _bytes(int8) < 0.35 * _bytes(fp32)  # the same adapters over fp32 frozen weights
    assert frozen < 0.3 * _bytes(full)
    assert set(full.trained_state()) == {
        f"blocks.1.mlp.experts.{e}.{n}"
        for e in experts
        for n, _ in full.experts[0].named_parameters()
    }  # a full fine-tune hands back every parameter of its experts


def test_lora_targets_reach_inside_the_experts_and_a_target_naming_none_is_refused() -> None:
    one = _lora(dataclasses.replace(INT8, targets=("experts.1",)))  # expert 1 in every block
    model = build_model(one, seed=1)
    adapted = sorted(n for n, m in model.named_modules() if isinstance(m, LoraLinear))
    assert adapted == [f"blocks.{b}.mlp.experts.1.{k}" for b in (0, 1) for k in ("fc", "proj")]
    exact = _lora(dataclasses.replace(INT8, targets=("blocks.0.mlp.experts.2.fc",)))
    assert [
        n for n, m in build_model(exact, seed=1).named_modules() if isinstance(m, LoraLinear)
    ] == ["blocks.0.mlp.experts.2.fc"]
    with pytest.raises(
        SpecError, match=r"^train\.lora_targets: 'experts\.9' names no Linear layer"
    ):
        _lora(dataclasses.replace(INT8, targets=("experts.9",)))


def test_a_host_refuses_a_block_or_expert_or_state_it_cannot_load_in_one_line() -> None:
    spec = _lora()
    state = _state(spec)
    dense = ModelSpec.from_dict(
        {"kind": "transformer", "vocab": 64, "context": 8, "layers": 1, "width": 16, "heads": 2}
    )
    with pytest.raises(PipelineError, match="block 0 of this transformer model is not a mixture"):
        load_expert_shard(dense, 0, (0,), build_model(dense, seed=1).state_dict())
    with pytest.raises(PipelineError, match=r"experts \[4\] are not distinct experts of block 1"):
        load_expert_shard(spec, 1, (4,), state)
    del state["blocks.1.mlp.experts.2.proj.weight_scale"]
    with pytest.raises(PipelineError, match=r"has no tensor '.*experts\.2\.proj\.weight_scale'"):
        load_expert_shard(spec, 1, (2,), state)
    state["blocks.1.mlp.experts.3.fc.weight_q"] = state[
        "blocks.1.mlp.experts.3.fc.weight_q"
    ].float()
    with pytest.raises(PipelineError, match=r"does not fit unit experts\.3"):  # fp32 for the int8
        load_expert_shard(spec, 1, (3,), state)
    with pytest.raises(PipelineError, match="the placement names 3 experts; block 1 has 4"):
        load_distributed_moe(spec, 1, state, Placement((0, 1, 1)), 0, MemoryNetwork().transport())
    assert isinstance(load_expert_shard(spec, 1, (1,), state), ExpertShard)


def test_the_referee_rebuilds_an_int8_expert_as_its_host_did_and_catches_moved_adapters() -> None:
    """Hosts of a LoRA int8 mixture record one call each (node/pipeline/witness.py); the
    referee (hub/policy/piece_check.judge_expert) builds each expert from the durable state as
    the host built it: int8 frozen weights, fp32 adapters. Honest calls reproduce; a host whose
    adapters moved by 1e-2 is caught on the parameters' hash and on its answer."""
    from gpuflex.hub.policy.piece_check import judge_expert
    from gpuflex.node.pipeline.witness import Witness

    spec = _lora()
    state = _model(spec).state_dict()
    moe_state = {k.removeprefix("blocks.1.mlp."): v for k, v in state.items() if ".1.mlp." in k}
    placement = Placement((0, 1, 1, 2))

    def calls(moved: bool) -> list[object]:
        net = MemoryNetwork()
        shards = {p: load_expert_shard(spec, 1, placement.held_by(p), state) for p in (1, 2)}
        if moved:
            with torch.no_grad():
                for name, p in shards[1].named_parameters():
                    if name.endswith(".lora_b"):
                        p.mul_(1.01)
        witnesses = {p: Witness([(5, 1)]) for p in shards}
        servers = [
            expert_server(net.transport(), p, s, placement=placement, witness=witnesses[p])
            for p, s in shards.items()
        ]
        join = in_threads(*[lambda s=s: (s.forward(5, 1, 0), s.backward(5, 1, 0)) for s in servers])
        layer = load_distributed_moe(spec, 1, state, placement, 0, net.transport())
        x = torch.randn(3, 8, WIDTH, generator=torch.Generator().manual_seed(2), requires_grad=True)
        (layer(x, step=5, micro_batch=1) * 2.0).sum().backward()
        join()
        return [*witnesses[1].calls, *witnesses[2].calls]

    honest = calls(moved=False)
    assert {c.index for c in honest} == {1, 2, 3}  # type: ignore[attr-defined]
    for call in honest:
        verdict = judge_expert(spec, moe_state, call, tolerance=1e-4, block=1)  # type: ignore[arg-type]
        assert verdict.ok, verdict.evidence
    caught = [
        judge_expert(spec, moe_state, c, tolerance=1e-4, block=1)  # type: ignore[arg-type]
        for c in calls(moved=True)
        if c.index in (1, 2)  # type: ignore[attr-defined]
    ]
    assert caught and not any(v.ok for v in caught)
    assert all(v.evidence["forward_distance"] > 1e-4 for v in caught)
