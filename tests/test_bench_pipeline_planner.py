"""bench/pipeline_planner.py's configuration code, so the bench cannot rot: every configuration
is planned by the product's planner, the throttle and the memory meter run on a real stage, and
the figures come out. Nothing here asserts a speed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import pipeline_planner as pp  # noqa: E402
from gpuflex.hub.policy.pipeline_plan import evaluate_pipeline  # noqa: E402
from gpuflex.node.pipeline.stage import StageRunner  # noqa: E402
from gpuflex.node.pipeline.transport import MemoryNetwork  # noqa: E402

#: what the nodes' probes measure, made up: the planner needs only numbers of the right kind
SPEEDS = [
    {"flops_per_s": 1e11 / t, "unit_overhead_s": 1e-4 * t, "update_bytes_per_s": 4e9 / t}
    for t in pp.THROTTLES
]
LINK = {"message_s": 0.004, "per_byte_s": 2e-9}


def test_every_configuration_is_planned_as_the_issue_asks():
    state = pp.state_bytes()
    docs = [pp.plan_doc(c, pp.plan(c, SPEEDS, LINK), state) for c in pp.CONFIGS]
    assert len(docs) >= 10
    assert len({len(d["nodes"]) for d in docs}) >= 3  # different stage counts
    assert {d["schedule"] for d in docs} == {"gpipe", "1f1b"}
    assert len({d["micro"] for d in docs}) >= 3
    assert len({tuple(c.caps) for c in pp.CONFIGS}) >= 4  # different memory caps
    assert len(set(pp.THROTTLES)) >= 3  # nodes of different speeds
    for doc in docs:
        assert state / max(doc["caps"]) >= 3.0  # the model is at least 3x the largest cap
        assert all(m <= c for m, c in zip(doc["predicted_memory"], doc["caps"], strict=True))
        assert doc["starts"][0] == 0 and doc["predicted_step_s"] > 0
        assert pp.BATCH % doc["micro"] == 0
        assert pp.BATCH // doc["micro"] * pp.WIDTH * 4 <= 128 << 10  # a message fits 128 KiB


def test_link_fit_splits_fixed_and_per_byte_cost():
    fit = pp.fit_link([{"1000": [0.011, 0.010, 0.012], "5000": [0.015, 0.014]}])
    assert fit["per_byte_s"] == pytest.approx(0.0035 / 4000)
    assert fit["message_s"] == pytest.approx(0.011 - 1000 * 0.0035 / 4000)


@pytest.fixture
def small_model(monkeypatch):
    monkeypatch.setattr(pp, "WIDTH", 32)
    monkeypatch.setattr(pp, "LAYERS", 3)
    monkeypatch.setattr(pp, "BATCH", 16)


def test_a_throttled_stage_is_metered_within_the_planners_memory(small_model):
    """One stage holding the whole model, 4 micro-batches under GPipe: its measured peak (state,
    saved activations, held outputs) is at least its state and no more than the planner's
    prediction for it, plus the loss's own saved tensors (not a unit's)."""
    torch.set_num_threads(1)
    module = nn.Sequential(*pp.units())
    optimizer = pp.optimizer_for(module)
    meter = pp.Meter(module, optimizer)
    runner = StageRunner(
        module=module,
        stage=0,
        stages=1,
        transport=pp.MeteredTransport(MemoryNetwork().transport(), meter),
        optimizer=optimizer,
        loss_fn=nn.CrossEntropyLoss(),
        schedule="gpipe",
    )
    with pp.Throttle(2.0), meter.hooks():
        for n, (xs, ys) in enumerate(pp.step_batches(4, 2)):
            assert runner.run_step(n, 4, inputs=xs, targets=ys) is not None
            meter.sample()
    costs = pp.unit_costs()
    node = pp.offers(pp.Config("one", (0,), (1.0,), 4, "gpipe"), SPEEDS, LINK, 10**9)[0]
    predicted = evaluate_pipeline(
        costs, [node], [len(costs)], micro_batches=4, schedule="gpipe", batch_size=pp.BATCH
    )
    assert predicted is not None
    state = sum(c.state_bytes for c in costs)
    loss_saved = pp.BATCH * 10 * 4  # log_softmax keeps its output for the backward pass
    assert state <= meter.peak <= predicted.stages[0].memory_bytes + loss_saved


def test_figures_from_stage_results():
    plans = [
        {
            "name": "two",
            "schedule": "1f1b",
            "micro": 2,
            "nodes": [0, 1],
            "starts": [0, 3],
            "caps": [100, 200],
            "predicted_memory": [90, 150],
            "predicted_step_s": 1.0,
            "throttles": [10.0, 10.0],
        }
    ]
    results = {
        (0, 0): {"step_s": [1.1], "send_s": 0.1, "receive_s": 0.2, "peak_bytes": 80},
        (0, 1): {"step_s": [0.9, 1.0, 1.2], "send_s": 0.1, "receive_s": 0.2, "peak_bytes": 210},
    }
    fig = pp.figures(plans, results, state=600)
    assert fig["ratios"] == [1.0] and fig["step_time_ratio_worst"] == 1.0
    assert fig["model_bytes_over_largest_cap"] == 3.0
    assert fig["peak_bytes_over_cap_max"] == 1.05
