"""hub/policy/pipeline_plan.py: the planner's search agrees with brute force over every split,
node order, micro-batch count and schedule; no stage exceeds its node's memory; speed and memory
steer the split; every refusal is one line."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest
import torch
from gpuflex.hub.policy.pipeline_plan import (
    MAX_EXACT_NODES,
    NodeOffer,
    Plan,
    Refusal,
    bubble_fraction,
    evaluate_pipeline,
    in_flight,
    plan_pipelines,
)
from gpuflex.protocol.modelanalysis import UnitCost, analyse_units
from torch import nn

GB = 10**9
FAST_LINK = 1e15  # bytes/s: transfers that cost nothing


def unit(
    i: int, *, state: int = 1000, saved: int = 10, output: int = 10, flops: float = 1e6
) -> UnitCost:
    return UnitCost(
        index=i,
        name="Block",
        param_bytes=state // 4,
        grad_bytes=state // 4,
        optimizer_bytes=state // 2,
        saved_bytes=saved,
        output_bytes=output,
        forward_flops=flops / 3,
        backward_flops=2 * flops / 3,
    )


def node(
    name: str, memory: int = GB, speed: float = 1e9, bandwidth: float = FAST_LINK, rtt: float = 0.0
) -> NodeOffer:
    return NodeOffer(
        node_id=name,
        memory_bytes=memory,
        flops_per_s=speed,
        bandwidth_bytes_per_s=bandwidth,
        rtt_s=rtt,
    )


def brute_force(units, offers, batch_size, micro_batches, schedules):
    """The fastest single pipeline over every split, node order, micro-batch count and schedule."""
    best = None
    n = len(units)
    for stages in range(1, min(len(offers), n) + 1):
        for cuts in itertools.combinations(range(1, n), stages - 1):
            ends = [*cuts, n]
            for nodes in itertools.permutations(offers, stages):
                for m in micro_batches:
                    for schedule in schedules:
                        p = evaluate_pipeline(
                            units,
                            nodes,
                            ends,
                            micro_batches=m,
                            schedule=schedule,
                            batch_size=batch_size,
                        )
                        if p is not None and (best is None or p.step_s < best.step_s):
                            best = p
    return best


def random_case(rng: random.Random):
    units = [
        UnitCost(
            index=i,
            name="U",
            param_bytes=(p := rng.randint(1, 50) * 1000),
            grad_bytes=p,
            optimizer_bytes=rng.choice((0, p, 2 * p)),
            saved_bytes=rng.randint(0, 400),
            output_bytes=rng.randint(1, 400),
            forward_flops=(f := rng.uniform(1e5, 1e7)),
            backward_flops=2 * f,
        )
        for i in range(rng.randint(1, 6))
    ]
    offers = [
        node(
            f"n{k}",
            memory=rng.randint(20, 400) * 1000,
            speed=rng.uniform(1e8, 1e9),
            bandwidth=rng.uniform(1e4, 1e7),
            rtt=rng.uniform(0.0, 0.05),
        )
        for k in range(rng.randint(1, 4))
    ]
    if rng.random() < 0.5:  # measured per-unit overheads and optimizer rates
        offers = [
            dataclasses.replace(
                o,
                unit_overhead_s=rng.choice((0.0, rng.uniform(1e-4, 1e-2))),
                update_bytes_per_s=rng.choice((0.0, rng.uniform(1e6, 1e9))),
            )
            for o in offers
        ]
    if rng.random() < 0.4:  # identical nodes: the search groups them
        offers += [
            dataclasses.replace(offers[0], node_id=f"twin{k}") for k in range(rng.randint(1, 2))
        ]
    return units, offers


@pytest.mark.parametrize("seed", range(120))
def test_search_agrees_with_brute_force(seed):
    rng = random.Random(seed)
    units, offers = random_case(rng)
    batch = rng.choice((1, 4, 6, 16))
    micro, schedules = (1, 2, 4, 8), ("gpipe", "1f1b")
    plan = plan_pipelines(
        units, offers, batch_size=batch, micro_batches=micro, schedules=schedules, max_replicas=1
    )
    expected = brute_force(units, offers, batch, [m for m in micro if m <= batch], schedules)
    if expected is None:
        assert isinstance(plan, Refusal)
        assert "\n" not in plan.reason and plan.reason
        return
    assert isinstance(plan, Plan) and plan.replicas == 1
    assert math.isclose(plan.step_s, expected.step_s, rel_tol=1e-9)
    by_id = {o.node_id: o for o in offers}
    for stage in plan.pipelines[0].stages:
        assert stage.memory_bytes <= by_id[stage.node_id].memory_bytes


@pytest.mark.parametrize("seed", range(20))
def test_no_stage_ever_exceeds_its_nodes_memory(seed):
    rng = random.Random(1000 + seed)
    units, offers = random_case(rng)
    offers += [
        node(f"extra{k}", memory=rng.randint(20, 400) * 1000, speed=rng.uniform(1e8, 1e9))
        for k in range(rng.randint(0, 6))
    ]
    plan = plan_pipelines(units, offers, batch_size=8)
    if isinstance(plan, Refusal):
        return
    by_id = {o.node_id: o for o in offers}
    used = [s.node_id for p in plan.pipelines for s in p.stages]
    assert len(used) == len(set(used))  # a node runs one stage of one pipeline
    for p in plan.pipelines:
        assert [s.first_unit for s in p.stages] == [0, *[s.end_unit for s in p.stages[:-1]]]
        assert p.stages[-1].end_unit == len(units)
        for stage in p.stages:
            assert stage.memory_bytes <= by_id[stage.node_id].memory_bytes
            again = evaluate_pipeline(
                units,
                [by_id[s.node_id] for s in p.stages],
                [s.end_unit for s in p.stages],
                micro_batches=p.micro_batches,
                schedule=p.schedule,
                batch_size=8,
            )
            assert again == p


def test_a_faster_node_gets_proportionally_more_layers():
    units = [unit(i) for i in range(8)]
    offers = [node("slow", speed=1e9), node("fast", speed=3e9)]
    plan = plan_pipelines(units, offers, batch_size=16, micro_batches=(16,), max_replicas=1)
    assert isinstance(plan, Plan)
    layers = {s.node_id: s.end_unit - s.first_unit for s in plan.pipelines[0].stages}
    assert layers == {"fast": 6, "slow": 2}


def test_a_node_too_small_for_any_unit_is_never_chosen():
    units = [unit(i, state=10_000) for i in range(4)]
    offers = [
        node("tiny", memory=5_000, speed=1e12),
        node("a", memory=30_000),
        node("b", memory=30_000),
    ]
    plan = plan_pipelines(units, offers, batch_size=4)
    assert isinstance(plan, Plan)
    assert "tiny" not in {s.node_id for p in plan.pipelines for s in p.stages}


def test_memory_forces_more_stages_than_speed_would():
    units = [unit(i, state=10_000) for i in range(6)]
    offers = [node(f"n{k}", memory=21_000, rtt=0.01) for k in range(4)]
    plan = plan_pipelines(units, offers, batch_size=4)
    assert isinstance(plan, Plan) and plan.replicas == 1
    assert [s.end_unit - s.first_unit for s in plan.pipelines[0].stages] == [2, 2, 2]


def test_gpipe_holds_every_micro_batch_and_1f1b_fewer():
    units = [unit(i, state=0, saved=100, output=0) for i in range(4)]
    offers = [node(f"n{k}") for k in range(4)]
    ends = [1, 2, 3, 4]
    gpipe = evaluate_pipeline(units, offers, ends, micro_batches=8, schedule="gpipe", batch_size=16)
    onef = evaluate_pipeline(units, offers, ends, micro_batches=8, schedule="1f1b", batch_size=16)
    assert gpipe is not None and onef is not None
    assert [s.memory_bytes for s in gpipe.stages] == [8 * 2 * 100] * 4
    assert [s.memory_bytes for s in onef.stages] == [4 * 200, 3 * 200, 2 * 200, 1 * 200]
    assert in_flight("1f1b", 2, 4) == 2 and in_flight("gpipe", 2, 4) == 2
    assert gpipe.bubble_fraction == bubble_fraction(8, 4) == 3 / 11
    assert math.isclose(gpipe.step_s, onef.step_s)
    # where GPipe's activations do not fit, the planner picks 1F1B
    tight = [node(f"n{k}", memory=900) for k in range(4)]
    plan = plan_pipelines(units, tight, batch_size=16, micro_batches=(8,))
    assert isinstance(plan, Plan) and plan.pipelines[0].schedule == "1f1b"


def test_step_time_by_hand():
    units = [unit(0, state=4000, output=1000, flops=2e9), unit(1, state=4000, output=8, flops=2e9)]
    a, b = (
        node("a", speed=1e9, bandwidth=1e6, rtt=0.02),
        node("b", speed=2e9, bandwidth=5e5, rtt=0.04),
    )
    p = evaluate_pipeline(units, [a, b], [1, 2], micro_batches=2, schedule="gpipe", batch_size=4)
    assert p is not None and p.micro_batch_size == 2
    cut = (
        2 * (2 * 1000) / 5e5 + 0.02 + 0.04
    )  # up and down at the slower link, plus both round trips
    first = 2 * 2e9 / 1e9 + cut  # computes, sends activations
    second = 2 * 2e9 / 2e9 + cut  # computes, sends gradients back
    update = max(4000 * 0.5 / 1e9, 4000 * 0.5 / 2e9)
    # the first micro-batch crosses both stages, the second follows at the slower one's pace
    assert math.isclose(p.step_s, first + second + (2 - 1) * max(first, second) + update)
    assert math.isclose(p.stages[0].transfer_s, cut) and math.isclose(p.stages[1].compute_s, 2.0)


def test_measured_unit_overhead_and_update_rate_by_hand():
    """A node's fixed time per unit and micro-batch adds to its compute once per unit it holds;
    a measured update rate replaces the FLOP-based optimizer step."""
    units = [unit(0, state=4000, output=1000, flops=2e9)] + [unit(i, flops=1e9) for i in (1, 2)]
    a = dataclasses.replace(node("a", speed=1e9), unit_overhead_s=0.01, update_bytes_per_s=1e3)
    b = node("b", speed=1e9)
    p = evaluate_pipeline(units, [a, b], [1, 3], micro_batches=4, schedule="1f1b", batch_size=8)
    assert p is not None and p.micro_batch_size == 2
    assert math.isclose(p.stages[0].compute_s, 2 * 2e9 / 1e9 + 1 * 0.01)
    assert math.isclose(p.stages[0].update_s, 4000 / 1e3)  # the measured rate
    assert math.isclose(p.stages[1].compute_s, 2 * 2e9 / 1e9)  # no overhead measured
    assert math.isclose(p.stages[1].update_s, 2000 * 0.5 / 1e9)  # UPDATE_FLOPS_PER_BYTE
    times = [s.micro_batch_s for s in p.stages]
    assert math.isclose(p.step_s, sum(times) + (4 - 1) * max(times) + 4.0)
    heavy = dataclasses.replace(b, node_id="heavy", unit_overhead_s=1.0)
    plan = plan_pipelines(units, [a, heavy], batch_size=8, micro_batches=(4,), max_replicas=1)
    assert isinstance(plan, Plan)  # the node whose every unit costs a second gets the fewest
    counts = {s.node_id: s.end_unit - s.first_unit for s in plan.pipelines[0].stages}
    assert counts.get("heavy", 0) <= 1


def test_spare_nodes_become_data_parallel_replicas():
    units = [unit(i, state=10_000) for i in range(4)]
    offers = [node(f"n{k}", memory=25_000) for k in range(6)]
    plan = plan_pipelines(units, offers, batch_size=8)
    assert isinstance(plan, Plan)
    assert plan.replicas == 3 and all(len(p.stages) == 2 for p in plan.pipelines)
    assert math.isclose(plan.samples_per_s, 3 * 8 / plan.step_s)
    capped = plan_pipelines(units, offers, batch_size=8, max_replicas=2)
    assert isinstance(capped, Plan) and capped.replicas == 2


def test_a_slow_leftover_node_is_not_made_a_replica():
    units = [unit(i) for i in range(2)]
    offers = [node("quick", speed=1e10), node("crawl", speed=1e8)]
    plan = plan_pipelines(units, offers, batch_size=8, micro_batches=(1,))
    assert isinstance(plan, Plan) and plan.replicas == 1
    assert {s.node_id for s in plan.pipelines[0].stages} == {"quick"}


def test_many_nodes_stay_bounded():
    units = [unit(i, state=10_000, flops=1e8) for i in range(6)]
    offers = [
        node(
            f"n{k:02}",
            memory=(30 + 7 * k) * 1000,
            speed=1e9 * (1 + k / 10),
            bandwidth=1e6 * (1 + k),
            rtt=0.01 + k / 1000,
        )
        for k in range(3 * MAX_EXACT_NODES)
    ]
    plan = plan_pipelines(units, offers, batch_size=16, max_replicas=2)
    assert isinstance(plan, Plan) and 1 <= plan.replicas <= 2
    many_same = [node(f"s{k:03}", memory=70_000) for k in range(100)]
    same = plan_pipelines(units, many_same, batch_size=16)
    assert isinstance(same, Plan) and same.replicas >= 10


def test_refusals_are_one_line():
    units = [unit(i, state=3 * GB) for i in range(4)]
    small = [node(f"n{k}", memory=2 * GB) for k in range(3)]
    refusal = plan_pipelines(units, small, batch_size=8)
    assert isinstance(refusal, Refusal)
    assert (
        refusal.reason
        == "unit 0 (Block) alone needs 3.0 GB; the 3 online nodes offer 2.0 GB at most"
    )

    pairs = [unit(i, state=GB) for i in range(8)]
    two = plan_pipelines(pairs, [node("a", memory=3 * GB), node("b", memory=2 * GB)], batch_size=8)
    assert isinstance(two, Refusal)
    assert (
        two.reason
        == "the model needs 4.0 GB per stage at 2 stages; the 2 online nodes offer 3.0 GB at most"
    )

    mixed = [
        node("big", memory=5 * GB),
        node("s1", memory=GB + 10**8),
        node("s2", memory=GB + 10**8),
    ]
    three = plan_pipelines(pairs, mixed, batch_size=8)
    assert isinstance(three, Refusal)
    assert (
        three.reason
        == "the model needs 3.0 GB per stage at 3 stages; only 1 of the 3 online nodes offer that much"
    )

    lone = plan_pipelines(units, [node("a", memory=10**6)], batch_size=8)
    assert isinstance(lone, Refusal) and lone.reason.endswith(
        "the 1 online node offers 1.0 MB at most"
    )
    assert plan_pipelines(units, [], batch_size=8) == Refusal(
        "no node is online to run the pipeline"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "batch size 0"),
        ({"batch_size": 2, "micro_batches": (4, 8)}, "none is in"),
        ({"batch_size": 2, "schedules": ("interleaved",)}, "schedules"),
    ],
)
def test_calls_no_job_could_make_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_pipelines([unit(0)], [node("a")], **kwargs)
    with pytest.raises(ValueError, match="same node"):
        plan_pipelines([unit(0)], [node("a"), node("a")], batch_size=1)
    with pytest.raises(ValueError, match="speed and bandwidth"):
        plan_pipelines([unit(0)], [node("a", speed=0.0)], batch_size=1)
    late = dataclasses.replace(node("a"), unit_overhead_s=-1.0)
    with pytest.raises(ValueError, match="unit overhead"):
        plan_pipelines([unit(0)], [late], batch_size=1)


def test_plans_a_measured_transformer_like_model():
    """The analysis feeds the planner: a block list measured on the meta device, split across
    nodes whose memory is below the model's."""
    width, context = 64, 32

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(width, 4, batch_first=True)
            self.mlp = nn.Sequential(
                nn.LayerNorm(width),
                nn.Linear(width, 4 * width),
                nn.GELU(),
                nn.Linear(4 * width, width),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(x, x, x, need_weights=False)[0]
            return x + self.mlp(x)

    units = [nn.Embedding(100, width), *(Block() for _ in range(6)), nn.Linear(width, 100)]
    costs = analyse_units(units, (context,), torch.int64, optimizer="adam")
    total = sum(c.state_bytes for c in costs)
    offers = [
        node(f"n{k}", memory=total * 6 // 10, speed=1e9 * (k + 1), bandwidth=1e7, rtt=0.01)
        for k in range(4)
    ]
    plan = plan_pipelines(costs, offers, batch_size=16)
    assert isinstance(plan, Plan), plan
    stages = plan.pipelines[0].stages
    assert len(stages) >= 3
    by_id = {o.node_id: o for o in offers}
    assert all(s.memory_bytes <= by_id[s.node_id].memory_bytes for s in stages)


def test_beyond_the_exact_limit_roomy_nodes_are_tried_when_the_fastest_cannot_hold_the_model():
    units = [unit(i, state=10_000) for i in range(4)]
    fast_small = [node(f"f{k:02}", memory=5_000, speed=1e10 + k) for k in range(12)]
    slow_roomy = [node(f"s{k:02}", memory=25_000 + k, speed=1e9) for k in range(4)]
    plan = plan_pipelines(units, fast_small + slow_roomy, batch_size=4, max_replicas=1)
    assert isinstance(plan, Plan)
    assert {s.node_id[0] for s in plan.pipelines[0].stages} == {"s"}
