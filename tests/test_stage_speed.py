"""A node's speed measured on its pipeline stage (hub/policy/stage_speed.py): each generation's
warm-up steps are left out, the median holds against outliers, too few steps leave the
benchmark's speed standing, the offer of a node (offers.py) reads whichever applies, and a node
not measured is offered its benchmark on the measured nodes' scale."""

from __future__ import annotations

import pytest
from gpuflex.hub.domain.pipelines.offers import benchmark_flops, offer_of
from gpuflex.hub.model.node import NodeState
from gpuflex.hub.policy.pipeline_plan import UPDATE_FLOPS_PER_BYTE, NodeOffer, evaluate_pipeline
from gpuflex.hub.policy.stage_speed import (
    MIN_STEPS,
    WARMUP_STEPS,
    WINDOW,
    StageSpeed,
    benchmark_scale,
    stage_step_flops,
    with_step,
)
from gpuflex.protocol.modelanalysis import UnitCost


def steps(times: list[float], *, work: float = 1e9, first: int = 1) -> StageSpeed:
    """The speed after steps ``first``, ``first + 1``, ... of one generation took ``times``."""
    speed = StageSpeed()
    for k, t in enumerate(times):
        speed = with_step(speed, step_flops=work, compute_s=t, step=first + k)
    return speed


def unit(flops: float, state: int) -> UnitCost:
    return UnitCost(0, "Linear", state, 0, 0, 0, 0, flops / 3, 2 * flops / 3)


def test_the_warm_up_steps_are_left_out() -> None:
    speed = steps([50.0, 20.0, 1.0, 1.0, 1.0])
    assert WARMUP_STEPS == 2 and speed.steps == 3
    assert speed.flops_per_s == pytest.approx(1e9)
    # the same steps counted from step 3 of a generation all count
    assert steps([50.0, 20.0, 1.0], first=WARMUP_STEPS + 1).samples == (2e7, 5e7, 1e9)


def test_too_few_steps_leave_the_benchmark_standing() -> None:
    speed = steps([1.0] * (WARMUP_STEPS + MIN_STEPS - 1))
    assert speed.steps == MIN_STEPS - 1 and speed.flops_per_s is None
    node = NodeState(id="n", public_key=b"k", bench_sps=100.0, ema_sps=100.0, last_seen=0.0)
    node.max_memory_bytes = 1 << 30
    node.stage_speed = speed
    assert offer_of(node, 4e4).flops_per_s == pytest.approx(100.0 * 4e4)
    node.stage_speed = with_step(speed, step_flops=1e9, compute_s=1.0, step=99)
    assert offer_of(node, 4e4).flops_per_s == pytest.approx(1e9)


def test_the_median_ignores_outliers_and_bad_times() -> None:
    # a paused step (100x slow) and a short one (100x fast) among 1-second steps
    speed = steps([1.0, 1.0, 1.0, 100.0, 1.0, 0.01, 1.0], first=WARMUP_STEPS + 1)
    assert speed.flops_per_s == pytest.approx(1e9)
    # a zero, negative or non-finite compute time or work is no measurement
    for t, w in (
        (0.0, 1e9),
        (float("nan"), 1e9),
        (float("inf"), 1e9),
        (1.0, 0.0),
        (1.0, float("nan")),
    ):
        assert with_step(speed, step_flops=w, compute_s=t, step=10) is speed


def test_only_the_last_window_of_steps_counts() -> None:
    # a node that slowed down (throttled): once the window holds only slow steps, its speed is theirs
    speed = steps([1.0] * WINDOW + [4.0] * WINDOW, first=WARMUP_STEPS + 1)
    assert speed.steps == WINDOW and speed.flops_per_s == pytest.approx(2.5e8)


def test_a_steps_work_is_its_samples_through_its_units_and_the_optimizer_step() -> None:
    costs = (unit(10.0, 100), unit(20.0, 1000), unit(40.0, 10_000), unit(80.0, 100_000))
    assert stage_step_flops(costs, 1, 3, 32) == pytest.approx(
        32 * (20.0 + 40.0) + UPDATE_FLOPS_PER_BYTE * 11_000
    )


def test_a_measured_update_is_kept_apart_and_offered_as_bytes_per_second() -> None:
    # 1e9 FLOPs of samples and 1e4 bytes of state: 1.5 s of compute, 0.5 s of it the update
    state = 10_000
    work = 1e9 + UPDATE_FLOPS_PER_BYTE * state
    speed = StageSpeed()
    for k in range(WARMUP_STEPS + MIN_STEPS):
        speed = with_step(
            speed, step_flops=work, compute_s=1.5, step=k + 1, update_s=0.5, state_bytes=state
        )
    assert speed.flops_per_s == pytest.approx(1e9)  # the samples' work over the other second
    assert speed.update_bytes_per_s == pytest.approx(2e4)
    node = NodeState(id="n", public_key=b"k", bench_sps=1.0, ema_sps=1.0, last_seen=0.0)
    node.max_memory_bytes = 1 << 30
    node.stage_speed = speed
    offer = offer_of(node, 4e4)
    assert (offer.flops_per_s, offer.update_bytes_per_s) == (pytest.approx(1e9), pytest.approx(2e4))
    # not measured (0), or more than the compute: the whole step at one speed, no update rate
    for update_s in (0.0, 1.5, 2.0, float("nan")):
        alone = with_step(
            StageSpeed(),
            step_flops=work,
            compute_s=1.5,
            step=9,
            update_s=update_s,
            state_bytes=state,
        )
        assert alone.samples == (pytest.approx(work / 1.5),) and alone.updates == ()
    assert StageSpeed().update_bytes_per_s is None
    node.stage_speed = StageSpeed()
    assert offer_of(node, 4e4).update_bytes_per_s == 0.0


def test_an_unmeasured_node_is_offered_its_benchmark_on_the_measured_nodes_scale() -> None:
    assert benchmark_scale([]) == 1.0
    # three measured nodes run 8, 10 and 40 times their benchmark: the median, not the mean
    assert benchmark_scale([(8.0, 1.0), (20.0, 2.0), (40.0, 1.0)]) == pytest.approx(10.0)
    assert benchmark_scale([(1.0, 0.0), (float("inf"), 1.0), (0.0, 1.0)]) == 1.0
    nodes = [
        NodeState(id=n, public_key=b"k", bench_sps=sps, ema_sps=sps, last_seen=0.0)
        for n, sps in (("a", 100.0), ("b", 300.0))
    ]
    assert benchmark_flops(nodes, 4e4) == 4e4
    nodes[0].stage_speed = steps([1.0] * 5, work=100.0 * 4e4 * 10)  # 10 times its benchmark
    per_sample = benchmark_flops(nodes, 4e4)
    assert per_sample == pytest.approx(4e5)
    assert offer_of(nodes[1], per_sample).flops_per_s == pytest.approx(300.0 * 4e4 * 10)
    assert offer_of(nodes[0], per_sample).flops_per_s == pytest.approx(100.0 * 4e4 * 10)


def test_a_stages_fixed_time_per_unit_and_micro_batch_is_read_apart_and_offered() -> None:
    """A stage of 3 units whose true cost is 1e9 FLOP/s on the samples plus 10 ms per unit and
    micro-batch: measured at 8 micro-batches and read with the fixed time, the offer predicts
    the stage's compute at 2 and at 32 micro-batches; read without it, it misses both."""
    costs = (unit(3e6, 100), unit(3e6, 100), unit(3e6, 100))
    batch, fixed, true_speed = 64, 0.01, 1e9

    def true_s(micro: int) -> float:
        return batch * 9e6 / true_speed + micro * len(costs) * fixed

    def offer(with_fixed: bool) -> NodeOffer:
        speed = StageSpeed()
        for k in range(1, WARMUP_STEPS + MIN_STEPS + 1):
            speed = with_step(
                speed,
                step_flops=batch * 9e6,
                compute_s=true_s(8),
                step=k,
                unit_overhead_s=fixed if with_fixed else 0.0,
                unit_calls=8 * len(costs),
            )
        assert (speed.unit_overhead_s is not None) == with_fixed
        node = NodeState(id="n", public_key=b"k", bench_sps=1.0, ema_sps=1.0, last_seen=0.0)
        node.max_memory_bytes = 1 << 30
        node.stage_speed = speed
        return offer_of(node, 1.0)

    for with_fixed in (True, False):
        o = offer(with_fixed)
        assert o.unit_overhead_s == (fixed if with_fixed else 0.0)
        for micro in (2, 8, 32):
            p = evaluate_pipeline(
                costs, [o], [len(costs)], micro_batches=micro, schedule="gpipe", batch_size=batch
            )
            assert p is not None
            predicted = sum(s.compute_s for s in p.stages) * micro
            if with_fixed or micro == 8:
                assert predicted == pytest.approx(true_s(micro), rel=1e-9)
            else:  # the fixed time priced as samples: too slow at 2 micro-batches, too fast at 32
                assert (predicted > true_s(micro) * 1.2) == (micro == 2)
                assert (predicted < true_s(micro) * 0.8) == (micro == 32)


def test_a_fixed_time_not_below_the_samples_time_is_not_taken() -> None:
    for overhead in (0.05, 0.2, float("nan"), float("inf")):
        speed = with_step(
            StageSpeed(),
            step_flops=1e9,
            compute_s=1.0,
            step=9,
            unit_overhead_s=overhead,
            unit_calls=20,
        )
        assert speed.samples == (pytest.approx(1e9),) and speed.overheads == ()


def test_a_stage_of_one_pipeline_of_several_is_credited_with_its_own_micro_batches() -> None:
    """Two pipelines share a 64-sample step 12 + 4 micro-batches of 4 samples: pipeline 1's
    stage ran 16 samples, not 64, and paid its fixed time 4 times per unit."""
    from gpuflex.hub.domain.pipelines.offers import ModelCut
    from gpuflex.hub.domain.pipelines.speeds import note_step
    from gpuflex.hub.model.pipeline import Generation, StageSlot, StepReport

    costs = (unit(3e6, 100), unit(3e6, 100))
    slots = tuple(StageSlot(f"n{k}", u, u + 1) for k in range(2) for u in range(2))
    g = Generation(
        "job", 1, 0, 10, slots, 8, 4, "1f1b", 0.1, 0.0, "first", 0.0, lanes=2,
        lane_micro_batches=(12, 4),
    )  # fmt: skip
    cut = ModelCut(("a", "b"), costs)
    node = NodeState(id="n1", public_key=b"k", bench_sps=1.0, ema_sps=1.0, last_seen=0.0)
    for done in range(1, WARMUP_STEPS + MIN_STEPS + 1):
        note_step(
            node, cut, g, StepReport(1, 3, "n1", done, 0.5, 0.5, 0.1, None, 0.0, 0.0, 0.01)
        )  # fmt: skip
    # slot 3: pipeline 1's second stage, one unit, 4 micro-batches: 0.04 s of fixed time
    work = 16 * costs[1].flops + UPDATE_FLOPS_PER_BYTE * costs[1].state_bytes
    assert node.stage_speed.flops_per_s == pytest.approx(work / (0.5 - 0.04))
    assert node.stage_speed.unit_overhead_s == pytest.approx(0.01)
