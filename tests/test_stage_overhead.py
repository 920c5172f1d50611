"""The fixed time a stage measures of itself before its first step (node/pipeline/overhead.py):
it finds a fixed cost per call that does not grow with the micro-batch, and it leaves the
stage's training exactly as it would have been (parameters, gradients, batch-norm statistics,
train/eval modes, the random state)."""

from __future__ import annotations

import time

import torch
from gpuflex.node.pipeline.overhead import unit_overhead_s
from torch import Tensor, nn


class Pause(nn.Module):
    """A unit that costs ``seconds`` per call, whatever the batch (its backward costs nothing)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(self.seconds)
        return x


def stage() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Dropout(0.5)),
        nn.Sequential(nn.Linear(32, 16), nn.ReLU()),
    )


def test_a_cost_per_call_is_found_and_spread_over_the_units() -> None:
    module = nn.Sequential(nn.Linear(16, 16), Pause(0.02))
    took = unit_overhead_s(module, torch.zeros(64, 16), units=2)
    # 20 ms a call over 2 units: 10 ms each (and a little of the Linear's own fixed cost)
    assert 0.008 <= took <= 0.02
    # the same stage without the pause costs far less per call
    assert unit_overhead_s(nn.Sequential(nn.Linear(16, 16)), torch.zeros(64, 16), units=1) < 0.005


def test_measuring_changes_nothing_the_training_reads() -> None:
    module = stage().train()
    module[1][0].weight.grad = torch.ones_like(module[1][0].weight)  # a gradient left as it was
    before = {k: v.clone() for k, v in module.state_dict().items()}
    rng = torch.get_rng_state()
    took = unit_overhead_s(module, torch.zeros(8, 16), units=2)
    assert took >= 0.0
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # batch-norm statistics too
    assert all(m.training for m in module.modules())
    assert torch.equal(torch.get_rng_state(), rng)
    assert module[0][0].weight.grad is None
    assert torch.equal(module[1][0].weight.grad, torch.ones_like(module[1][0].weight))


def test_an_integer_input_and_a_one_sample_micro_batch_are_measured() -> None:
    module = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8))
    assert unit_overhead_s(module, torch.zeros(1, 4, dtype=torch.long), units=2) >= 0.0
    assert unit_overhead_s(module, torch.zeros(1, 4, dtype=torch.long), units=0) == 0.0
