"""protocol/modelanalysis.py: each pipeline unit's bytes and FLOPs, measured on the meta device,
checked against what the layers' shapes say by hand (nn.Sequential layers and a small
transformer written here)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from gpuflex.protocol.errors import SpecError
from gpuflex.protocol.modelanalysis import analyse_units, optimizer_state_factor
from torch import nn

F32 = 4


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and a 4x MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape  # (batch, tokens, width)
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.down(F.gelu(self.up(self.ln2(x)))))


class Head(nn.Module):
    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.ln, self.out = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))  # (batch, tokens, vocab)


class Embed(nn.Module):
    def __init__(self, vocab: int, width: int, context: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(context, width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


def test_linear_stack_costs_match_the_shapes():
    units = [nn.Sequential(nn.Linear(8, 16), nn.ReLU()), nn.Linear(16, 4)]
    first, second = analyse_units(units, (8,), torch.float32, optimizer="adam")
    assert first.param_bytes == (8 * 16 + 16) * F32 and first.grad_bytes == first.param_bytes
    assert first.optimizer_bytes == 2 * first.param_bytes
    assert first.state_bytes == 4 * first.param_bytes
    # Linear keeps its input (8 floats), ReLU its output (16); the weight it saves is not per sample
    assert first.saved_bytes == (8 + 16) * F32
    assert first.output_bytes == 16 * F32 and second.output_bytes == 4 * F32
    assert first.forward_flops == 2 * 8 * 16 and second.forward_flops == 2 * 16 * 4
    # the first unit computes no gradient for the model's input; later units do (it is sent back)
    assert first.backward_flops == 2 * 8 * 16
    assert second.backward_flops == 2 * (2 * 16 * 4)
    assert second.flops == second.forward_flops + second.backward_flops
    assert (first.index, first.name, second.name) == (0, "Sequential", "Linear")


@pytest.mark.parametrize(
    ("optimizer", "momentum", "factor"),
    [("sgd", 0.0, 0), ("sgd", 0.9, 1), ("adam", 0.0, 2), ("adamw", 0.9, 2)],
)
def test_optimizer_state_follows_the_job_optimizer(optimizer, momentum, factor):
    assert optimizer_state_factor(optimizer, momentum) == factor
    (cost,) = analyse_units(
        [nn.Linear(10, 10)], (10,), torch.float32, optimizer=optimizer, momentum=momentum
    )
    assert cost.optimizer_bytes == factor * 110 * F32


def test_frozen_parameters_have_no_gradient_or_optimizer_state():
    layer = nn.Linear(6, 6)
    layer.weight.requires_grad_(False)
    (cost,) = analyse_units([layer], (6,), torch.float32, optimizer="adam")
    assert (
        cost.param_bytes == 42 * F32
        and cost.grad_bytes == 6 * F32
        and cost.optimizer_bytes == 12 * F32
    )


def test_transformer_blocks_measured_per_sample():
    vocab, context, width, heads = 64, 16, 32, 4
    units = [
        Embed(vocab, context=context, width=width),
        Block(width, heads),
        Block(width, heads),
        Head(width, vocab),
    ]
    costs = analyse_units(units, (context,), torch.int64, optimizer="sgd", momentum=0.9)
    embed, b1, b2, head = costs
    assert b1 == b2.__class__(**{**b2.__dict__, "index": 1})  # identical blocks cost the same
    t, d = context, width
    assert embed.param_bytes == (vocab + context) * d * F32 and embed.forward_flops == 0
    assert embed.output_bytes == t * d * F32
    block_params = (
        2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    )
    assert b1.param_bytes == block_params * F32 and b1.optimizer_bytes == b1.param_bytes
    matmuls = 2 * t * d * 3 * d + 2 * t * d * d + 2 * 2 * t * d * 4 * d
    attention = (
        4 * t * t * d
    )  # scores and the weighted sum (every position: flop_counter counts no mask)
    assert b1.forward_flops == matmuls + attention
    assert 1.5 * b1.forward_flops <= b1.backward_flops <= 3 * b1.forward_flops
    assert b1.output_bytes == t * d * F32
    # the block keeps several (tokens, width) tensors and its (tokens, 4 width) MLP activations
    assert 4 * t * 4 * d * F32 <= b1.saved_bytes <= 40 * t * d * F32
    assert head.output_bytes == t * vocab * F32 and head.forward_flops == 2 * t * d * vocab


def test_analysis_changes_nothing_in_the_units():
    units = [nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)), nn.Linear(4, 2)]
    units[0].eval()
    before = [{k: v.clone() for k, v in u.state_dict().items()} for u in units]
    analyse_units(units, (4,), torch.float32)
    assert not units[0].training and not units[0][1].training and units[1].training
    for u, state in zip(units, before, strict=True):
        for k, v in u.state_dict().items():
            assert v.device.type == "cpu" and torch.equal(v, state[k])
        assert all(p.grad is None for p in u.parameters())


def test_dropout_mask_counts_only_in_training():
    plain = analyse_units([nn.Linear(8, 8)], (8,), torch.float32)[0]
    dropped = analyse_units([nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1))], (8,), torch.float32)[
        0
    ]
    assert dropped.saved_bytes > plain.saved_bytes


def test_a_model_larger_than_memory_is_analysed_on_meta():
    with torch.device("meta"):
        units = [nn.Linear(32768, 32768) for _ in range(4)]  # 4 x 4.3 GB of parameters
    costs = analyse_units(units, (32768,), torch.float32, optimizer="adam")
    assert sum(c.state_bytes for c in costs) == 4 * 4 * (32768 * 32768 + 32768) * F32
    assert all(math.isclose(c.forward_flops, 2 * 32768**2) for c in costs)


@pytest.mark.parametrize(
    ("units", "shape", "message"),
    [
        ([], (4,), "no pipeline units"),
        ([nn.Linear(4, 4)], (0,), "must be > 0"),
        ([nn.Linear(8, 16), nn.Linear(4, 2)], (8,), "pipeline unit 1 (Linear) cannot run on input"),
    ],
)
def test_bad_input_is_one_line(units, shape, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        analyse_units(units, shape, torch.float32)
    assert "\n" not in str(info.value)


def test_unknown_optimizer_and_non_tensor_output_are_refused():
    with pytest.raises(SpecError, match=r"train\.optimizer"):
        analyse_units([nn.Linear(2, 2)], (2,), torch.float32, optimizer="lion")

    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x

    with pytest.raises(SpecError, match=r"pipeline unit 0 \(Pair\) returns tuple"):
        analyse_units([Pair()], (2,), torch.float32)


def test_an_op_without_a_meta_kernel_is_measured_on_a_tiny_cpu_batch():
    class CpuOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.is_meta:
                raise NotImplementedError(
                    "Could not run 'custom::op' with arguments from the 'Meta' backend"
                )
            return torch.relu(self.lin(x))

    (cost,) = analyse_units([CpuOnly()], (8,), torch.float32)
    assert (
        cost.forward_flops == 2 * 8 * 8
        and cost.saved_bytes == (8 + 8) * F32
        and cost.output_bytes == 8 * F32
    )

    class Never(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise NotImplementedError("no kernel\nanywhere")

    with pytest.raises(SpecError, match=r"^pipeline unit 0 \(Never\) cannot run: no kernel$"):
        analyse_units([Never()], (2,), torch.float32)
