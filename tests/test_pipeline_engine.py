"""Pipeline execution over the in-memory transport: the same result as single-process training
with gradient accumulation over the same micro-batches, for 2, 3 and 4 stages and both schedules;
tied parameters; the receiver's checks; the schedules' order."""

from __future__ import annotations

import copy

import pytest
import torch
from gpuflex.node.errors import PipelineError
from gpuflex.node.pipeline.local import run_stages
from gpuflex.node.pipeline.schedule import stage_actions
from gpuflex.node.pipeline.stage import StageRunner, TiedGroup, boundary_specs, cut
from gpuflex.node.pipeline.transport import MemoryNetwork, MessageKey
from gpuflex.node.trainer import make_optimizer
from gpuflex.protocol.messages import TrainConfig
from gpuflex.protocol.tensors import TensorSpec
from torch import nn

torch.set_num_threads(1)

STEPS, MICRO, BATCH = 10, 4, 8
ADAM = TrainConfig(1, BATCH, "adam", 1e-2, 0.0, 0.0, 0.9, 0.999, "cross_entropy", 0.0)
SGD = TrainConfig(1, BATCH, "sgd", 5e-2, 0.9, 1e-4, 0.9, 0.999, "cross_entropy", 0.0)


def mlp_units(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [
        nn.Linear(12, 32),
        nn.Tanh(),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, 16),
        nn.GELU(),
        nn.Linear(16, 5),
    ]


def step_data(
    seed: int = 1, steps: int = STEPS
) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(steps):
        xs = [torch.randn(BATCH, 12, generator=g) for _ in range(MICRO)]
        ys = [torch.randint(0, 5, (BATCH,), generator=g) for _ in range(MICRO)]
        data.append((xs, ys))
    return data


def accumulate(model: nn.Module, data, cfg: TrainConfig) -> list[float]:
    """The reference: one process, each micro-batch's loss weighted by 1/m, one step per batch."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params, cfg)
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    for xs, ys in data:
        opt.zero_grad()
        total = 0.0
        n = sum(y.shape[0] for y in ys)
        for x, y in zip(xs, ys, strict=True):
            loss = loss_fn(model(x), y) * (y.shape[0] / n)
            loss.backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)
    return losses


def runners_for(
    units, starts, cfg, schedule, network, tied=(), timeout_s=30.0, seed=0, lane=0, lanes=1
):
    stages = cut(units, starts)
    specs = boundary_specs(stages, torch.zeros(BATCH, 12))
    out = []
    for s, module in enumerate(stages):
        last = s == len(stages) - 1
        out.append(
            StageRunner(
                module=module,
                stage=s,
                stages=len(stages),
                transport=network.transport(),
                optimizer=make_optimizer([p for p in module.parameters()], cfg),
                inbound=specs[s - 1] if s else None,
                outbound=None if last else specs[s],
                loss_fn=nn.CrossEntropyLoss() if last else None,
                schedule=schedule,
                tied=tied,
                timeout_s=timeout_s,
                seed=seed,
                lane=lane,
                lanes=lanes,
                batch_samples=BATCH * MICRO if lanes > 1 else 0,
            )
        )
    return out


def max_rel_diff(stages: list[nn.Module], reference: nn.Module) -> float:
    got = [p for module in stages for p in module.parameters()]
    want = list(reference.parameters())
    assert len(got) == len(want)
    return max(
        float(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).detach())
        for a, b in zip(got, want, strict=True)
    )


CUTS = {2: [0, 3], 3: [0, 2, 5], 4: [0, 2, 4, 6]}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_a_pipeline_equals_gradient_accumulation(stages: int, schedule: str) -> None:
    cfg = ADAM if stages != 3 else SGD
    units = mlp_units()
    reference = nn.Sequential(*copy.deepcopy(units))
    data = step_data()
    want = accumulate(reference, data, cfg)
    runners = runners_for(units, CUTS[stages], cfg, schedule, MemoryNetwork())
    got = run_stages(runners, data)
    assert max_rel_diff([r.module for r in runners], reference) <= 1e-5
    assert got == pytest.approx(want, rel=1e-5)
    assert got[-1] < got[0]  # it trains


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_dropout_in_a_pipeline_draws_what_one_process_draws(schedule: str) -> None:
    """Keyed dropout (protocol/dropout.py): each stage keys its masks by (seed, step,
    micro-batch), as one process accumulating over the same micro-batches does."""
    from gpuflex.protocol.dropout import KeyedDropout, dropout_step

    units = mlp_units()
    units[2:2] = [KeyedDropout(0.3, slot=2)]
    units[5:5] = [KeyedDropout(0.3, slot=5)]
    reference = nn.Sequential(*copy.deepcopy(units))
    data = step_data()
    params = list(reference.parameters())
    opt = make_optimizer(params, ADAM)
    for step, (xs, ys) in enumerate(data):
        opt.zero_grad()
        n = sum(y.shape[0] for y in ys)
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            with dropout_step(7, step, part=i):
                (nn.CrossEntropyLoss()(reference(x), y) * (y.shape[0] / n)).backward()
        opt.step()
    runners = runners_for(units, [0, 3, 6], ADAM, schedule, MemoryNetwork(), seed=7)
    run_stages(runners, data)
    assert max_rel_diff([r.module for r in runners], reference) <= 1e-5
    other = runners_for(units, [0, 3, 6], ADAM, schedule, MemoryNetwork(), seed=8)
    run_stages(other, data)
    assert max_rel_diff([r.module for r in other], reference) > 1e-3, "other seed, other masks"


def _dropout_reference(steps: int) -> tuple[list[nn.Module], nn.Module, list, list[float]]:
    """The MLP with keyed dropout (seed 3), ``steps`` steps of data, and one process accumulating
    every micro-batch of each step: (units, the trained reference, the data, each step's loss)."""
    from gpuflex.protocol.dropout import KeyedDropout, dropout_step

    units = mlp_units()
    units[2:2] = [KeyedDropout(0.2, slot=2)]
    reference = nn.Sequential(*copy.deepcopy(units))
    data = step_data(steps=steps)
    opt = make_optimizer(list(reference.parameters()), ADAM)
    want = []
    for step, (xs, ys) in enumerate(data):
        opt.zero_grad()
        want.append(0.0)
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            with dropout_step(3, step, part=i):
                loss = nn.CrossEntropyLoss()(reference(x), y) * (y.shape[0] / (BATCH * MICRO))
            loss.backward()
            want[-1] += float(loss.detach())
        opt.step()
    return units, reference, data, want


@pytest.mark.parametrize(
    ("lanes", "starts", "schedule"), [(2, [0, 3], "1f1b"), (4, [0, 2, 4, 6], "gpipe")]
)
def test_pipelines_sharing_a_step_equal_gradient_accumulation(
    lanes: int, starts: list[int], schedule: str
) -> None:
    """Hybrid parallelism: ``lanes`` pipelines each train their share of a step's micro-batches
    and sum their stages' gradients before the optimizer steps: one process accumulating every
    micro-batch of the step gets the same parameters, dropout included (keyed by the micro-batch's
    place in the whole step), and every pipeline holds the same parameters, bit for bit."""
    units, reference, data, want = _dropout_reference(steps=6)
    network = MemoryNetwork()
    runners = [
        r
        for lane in range(lanes)
        for r in runners_for(units, starts, ADAM, schedule, network, seed=3, lane=lane, lanes=lanes)
    ]
    assert run_stages(runners, data) == pytest.approx(want, rel=1e-5)
    per = len(starts)
    assert max_rel_diff([r.module for r in runners[:per]], reference) <= 1e-5
    for lane in range(1, lanes):
        for a, b in zip(runners[:per], runners[lane * per : (lane + 1) * per], strict=True):
            assert all(
                torch.equal(x, y) for x, y in zip(a.module.parameters(), b.module.parameters())
            )


def test_pipelines_running_different_shares_of_a_step_equal_gradient_accumulation() -> None:
    """A faster pipeline runs more of the step's micro-batches (3 and 1 of 4): the same result
    as one process accumulating all 4, dropout keyed by each micro-batch's place in the step."""
    units, reference, data, want = _dropout_reference(steps=5)
    network = MemoryNetwork()
    runners = []
    for lane, first in ((0, 0), (1, 3)):
        for r in runners_for(units, [0, 3], ADAM, "1f1b", network, lane=lane, lanes=2, seed=3):
            r.first_micro_batch = first
            runners.append(r)
    assert run_stages(runners, data, counts=(3, 1)) == pytest.approx(want, rel=1e-5)
    assert max_rel_diff([r.module for r in runners[:2]], reference) <= 1e-5
    # each stage timed its step's end (the gradient sum and the optimizer step) for its report
    assert all(r.update_s > 0 for r in runners)


class Tied(nn.Module):
    """Uses a shared weight: ``Tied(lin)`` computes x @ lin.weight (its transpose's layer)."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.weight = lin.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight  # (batch, 32) @ (32, 12) -> (batch, 12)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_tied_parameters_are_summed_across_stages(schedule: str) -> None:
    torch.manual_seed(0)
    first = nn.Linear(12, 32)
    units = [first, nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), Tied(first), nn.Linear(12, 5)]
    reference = copy.deepcopy(nn.Sequential(*units))  # one shared weight, deep-copied once
    data = step_data(steps=5)
    accumulate(reference, data, ADAM)
    groups = (TiedGroup(((0, "0.weight"), (2, "0.weight"))),)
    runners = runners_for(units, [0, 2, 4], ADAM, schedule, MemoryNetwork(), tied=groups)
    run_stages(runners, data)
    w0 = runners[0].module[0].weight
    w2 = runners[2].module[0].weight
    assert torch.equal(w0, w2)  # both copies took the same update
    assert (
        float(((w0 - reference[0].weight).abs().max() / reference[0].weight.abs().max()).detach())
        <= 1e-5
    )
    assert float((runners[2].module[1].weight - reference[5].weight).abs().max().detach()) <= 1e-5


def test_the_schedules_order_forwards_and_backwards() -> None:
    gpipe = stage_actions("gpipe", stage=1, stages=3, micro_batches=3)
    assert [(a.op, a.micro_batch) for a in gpipe] == [
        ("F", 0),
        ("F", 1),
        ("F", 2),
        ("B", 0),
        ("B", 1),
        ("B", 2),
    ]
    first = stage_actions("1f1b", stage=0, stages=3, micro_batches=4)
    assert [(a.op, a.micro_batch) for a in first] == [
        ("F", 0),
        ("F", 1),
        ("F", 2),
        ("B", 0),
        ("F", 3),
        ("B", 1),
        ("B", 2),
        ("B", 3),
    ]
    last = stage_actions("1f1b", stage=2, stages=3, micro_batches=2)
    assert [(a.op, a.micro_batch) for a in last] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    with pytest.raises(PipelineError, match="unknown pipeline schedule 'zb'"):
        stage_actions("zb", stage=0, stages=2, micro_batches=2)


def test_a_bad_cut_is_refused_in_one_line() -> None:
    with pytest.raises(PipelineError, match=r"do not cut 7 units"):
        cut(mlp_units(), [0, 3, 3])
    with pytest.raises(PipelineError, match=r"do not cut 7 units"):
        cut(mlp_units(), [1, 3])
    with pytest.raises(PipelineError, match=r"^pipeline 2 is not one of 2$"):
        runners_for(mlp_units(), [0, 3], SGD, "1f1b", MemoryNetwork(), lane=2, lanes=2)


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (torch.zeros(4, 3), r"has shape \[4, 3\], expected \[4, 2\]"),
        (torch.zeros(4, 2, dtype=torch.float64), "has dtype float64, expected float32"),
        (torch.tensor([[0.0, float("nan")]] * 4), "holds NaN or infinite values; refused"),
        (torch.tensor([[0.0, float("inf")]] * 4), "holds NaN or infinite values; refused"),
    ],
)
def test_the_receiver_refuses_a_wrong_tensor_in_one_line(
    tensor: torch.Tensor, message: str
) -> None:
    transport = MemoryNetwork().transport()
    key = MessageKey(3, 1, "activation", 0, 1)
    transport.send(key, tensor)
    with pytest.raises(PipelineError, match=message) as info:
        transport.receive(key, TensorSpec("activation", "float32", (4, 2)), timeout_s=1.0)
    assert "\n" not in str(info.value)
    assert "the activation of step 3 micro-batch 1 from stage 0 to stage 1" in str(info.value)


def test_a_neighbour_that_never_sends_is_named() -> None:
    runners = runners_for(mlp_units(), [0, 3], SGD, "1f1b", MemoryNetwork(), timeout_s=0.2)
    _xs, ys = step_data(steps=1)[0]
    with pytest.raises(
        PipelineError,
        match=r"the activation of step 0 micro-batch 0 from stage 0 to stage 1 did "
        r"not arrive within 0\.2 s",
    ):
        runners[1].run_step(0, MICRO, targets=ys)
