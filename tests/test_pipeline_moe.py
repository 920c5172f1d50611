"""A mixture-of-experts transformer pipelined: each stage adds its own routers' balancing loss,
weighted by the micro-batch's share of the step, to what it differentiates (one process adds
every router's to the logits' loss), and the hub's referee replays a middle MoE stage the same
way: its honest work reproduces, and the same work judged without the routers' loss does not.
(The stages' equality with one process: tests/test_stage_worker.py, ``moe-2`` and ``moe-4``.)"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from gpuflex.hub.policy.stage_check import StageEvidence, judge_stage, stage_loss
from gpuflex.node.pipeline.local import run_stages
from gpuflex.node.pipeline.stage import StageRunner, boundary_specs
from gpuflex.node.pipeline.transport import MemoryNetwork, MemoryTransport, MessageKey
from gpuflex.node.trainer import make_optimizer
from gpuflex.protocol.messages import TrainConfig
from gpuflex.protocol.modelspec import build_model
from gpuflex.protocol.pipeline import cut_state, load_unit, pipeline_units
from gpuflex.protocol.tensors import TensorSpec
from torch import nn

from tests.test_stage_worker import MOE  # every block 4 experts, top-2, jitter, capacity drops

torch.set_num_threads(1)

SGD = TrainConfig(1, 8, "sgd", 0.1, 0.0, 0.0, 0.9, 0.999, "cross_entropy", 0.0)
MICRO, BATCH, SEED, STARTS = 2, 8, 3, (0, 1, 3)


class Tap(MemoryTransport):
    """A stage's transport that keeps what it sent and received (the relay's kept tensors)."""

    def __init__(self, network: MemoryNetwork) -> None:
        super().__init__(network)
        self.kept: dict[MessageKey, torch.Tensor] = {}

    def send(self, key: MessageKey, tensor: torch.Tensor) -> None:
        self.kept[key] = tensor.detach().clone()
        super().send(key, tensor)

    def receive(self, key: MessageKey, expected: TensorSpec, *, timeout_s: float) -> torch.Tensor:
        got = super().receive(key, expected, timeout_s=timeout_s)
        self.kept[key] = got.detach().clone()
        return got


def test_the_referee_replays_a_middle_moe_stage_with_its_routers_loss() -> None:
    units = pipeline_units(MOE).units
    model = build_model(MOE, seed=0).state_dict()
    states = [cut_state(u, model) for u in units]
    bounds = [*STARTS, len(units)]
    stages = [
        nn.Sequential(*(load_unit(units[u], states[u]) for u in range(a, b)))
        for a, b in itertools.pairwise(bounds)
    ]
    specs = boundary_specs(stages, torch.zeros(BATCH // MICRO, 6, dtype=torch.int64))
    network = MemoryNetwork()
    taps = [Tap(network) for _ in stages]
    runners = [
        StageRunner(
            module=module.train(),
            stage=s,
            stages=len(stages),
            transport=taps[s],
            optimizer=make_optimizer(list(module.parameters()), SGD),
            inbound=specs[s - 1] if s else None,
            outbound=specs[s] if s < len(stages) - 1 else None,
            loss_fn=stage_loss(MOE, "cross_entropy") if s == len(stages) - 1 else None,
            seed=SEED,
            batch_samples=BATCH,
        )
        for s, module in enumerate(stages)
    ]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 13, (BATCH, 7), generator=g)
    xs, ys = list(ids[:, :6].chunk(MICRO)), list(ids[:, 1:].chunk(MICRO))
    run_stages(runners, [(xs, ys)])
    mid = taps[1].kept
    honest = StageEvidence(
        x=mid[MessageKey(0, 1, "activation", 0, 1)],
        out=mid[MessageKey(0, 1, "activation", 1, 2)],
        grad_out=mid[MessageKey(0, 1, "gradient", 2, 1)],
        grad_in=mid[MessageKey(0, 1, "gradient", 1, 0)],
        weight=(BATCH // MICRO) / BATCH,
    )
    middle = units[STARTS[1] : STARTS[2]]
    mine = states[STARTS[1] : STARTS[2]]

    def judge(evidence: StageEvidence):
        return judge_stage(middle, mine, evidence, seed=SEED, step=0, micro_batch=1, tolerance=1e-5)

    verdict = judge(honest)
    assert verdict.ok and verdict.evidence["backward_distance"] < 1e-6, verdict.evidence
    without = judge(dataclasses.replace(honest, weight=0.0))  # the routers' loss left out
    assert not without.ok and without.evidence["backward_distance"] > 1e-5, without.evidence
