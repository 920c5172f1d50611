"""The hub's pipeline decisions as plain functions (hub/domain/pipelines/): the job's [pipeline]
applied to the planner, a re-plan keeping survivors on their units, which stage is lost, which
steps are checkpoint steps, what a unit's state blob must hold, and the relay's plan of a
generation."""

from __future__ import annotations

import pytest
import torch
from gpuflex.hub.base.errors import Unprocessable
from gpuflex.hub.domain.pipelines.checkpoints import (
    check_unit_state,
    is_checkpoint_step,
    max_state_bytes,
)
from gpuflex.hub.domain.pipelines.generations import relay_plan
from gpuflex.hub.domain.pipelines.liveness import GONE_S, lost_stage
from gpuflex.hub.domain.pipelines.offers import cut_model
from gpuflex.hub.domain.pipelines.planning import (
    bytes_moved,
    check_pipeline_spec,
    choose_pipeline,
    micro_batch_counts,
)
from gpuflex.hub.model.node import RelayLink
from gpuflex.hub.model.pipeline import Generation, StageSlot, StepReport
from gpuflex.hub.model.relay import Crossing
from gpuflex.hub.policy.pipeline_plan import NodeOffer
from gpuflex.protocol.jobspec import PipelineSpec, parse_job_spec
from gpuflex.protocol.modelanalysis import UnitCost
from gpuflex.protocol.tensors import encode_state

GB = 1 << 30


def _costs(n: int = 4) -> list[UnitCost]:
    return [
        UnitCost(i, "Linear", 4 << 20, 4 << 20, 4 << 20, 1024, 1024, 1e6, 2e6) for i in range(n)
    ]


def _offer(node: str, memory: int = GB, flops: float = 1e10) -> NodeOffer:
    return NodeOffer(node, memory, flops, 2.5e6, 0.03)


def _generation(stages: tuple[StageSlot, ...], first_step: int = 0) -> Generation:
    return Generation(
        job_id="j-1",
        number=1,
        first_step=first_step,
        end_step=10,
        stages=stages,
        micro_batches=4,
        micro_batch_size=8,
        schedule="1f1b",
        step_s=1.0,
        bubble_fraction=0.2,
        reason="the first plan",
        created_at=0.0,
    )


def test_the_spec_fixes_the_stages_and_micro_batches_the_planner_weighs() -> None:
    offers = [_offer(n) for n in ("gf1-a", "gf1-b", "gf1-c")]
    got = choose_pipeline(_costs(), offers, PipelineSpec(stages=3, micro_batches=2), batch_size=32)
    assert not isinstance(got, str) and len(got.stages) == 3 and got.micro_batches == 2
    auto = choose_pipeline(_costs(), offers, PipelineSpec(), batch_size=32)
    assert not isinstance(auto, str) and len(auto.stages) >= 2, (
        "a pipelined job runs on several nodes"
    )
    assert micro_batch_counts(PipelineSpec(), 24) == (1, 2, 4, 8)
    assert micro_batch_counts(PipelineSpec(micro_batches=3), 24) == (3,)


def test_too_few_or_too_small_nodes_are_refused_in_one_line() -> None:
    few = choose_pipeline(_costs(), [_offer("gf1-a")], PipelineSpec(stages=2), batch_size=32)
    assert few == "the pipeline needs 2 nodes with a memory offer; 1 idle node is online"
    tiny = choose_pipeline(
        _costs(),
        [_offer("gf1-a", 1000), _offer("gf1-b", 1000)],
        PipelineSpec(stages=2),
        batch_size=32,
    )
    assert isinstance(tiny, str) and "\n" not in tiny


def test_a_replan_keeps_the_survivor_on_its_units() -> None:
    before = _generation((StageSlot("gf1-a", 0, 1), StageSlot("gf1-b", 1, 4)))
    # the survivor is slower than the newcomer: the fastest plan would give it other units
    offers = [_offer("gf1-a", flops=1e9), _offer("gf1-c", flops=1e11)]
    got = choose_pipeline(_costs(), offers, PipelineSpec(stages=2), batch_size=32, previous=before)
    assert not isinstance(got, str)
    assert [(s.node_id, s.first_unit, s.end_unit) for s in got.stages] == [
        ("gf1-a", 0, 1),
        ("gf1-c", 1, 4),
    ]
    assert bytes_moved(got, _costs(), before) == 3 * _costs()[0].state_bytes


def test_a_pipeline_section_that_cannot_run_on_the_model_is_named() -> None:
    assert check_pipeline_spec(PipelineSpec(stages=5), 4, 32) == (
        "pipeline.stages = 5, but the model has 4 pipeline units"
    )
    assert "does not divide train.batch_size = 30" in check_pipeline_spec(
        PipelineSpec(micro_batches=4), 4, 30
    )
    assert "one pipeline unit" in check_pipeline_spec(PipelineSpec(), 1, 32)
    assert check_pipeline_spec(PipelineSpec(stages=4, micro_batches=4), 4, 32) is None


def test_the_lost_stage_is_the_one_behind() -> None:
    g = _generation((StageSlot("gf1-a", 0, 1), StageSlot("gf1-b", 1, 2), StageSlot("gf1-c", 2, 4)))
    reports = {
        0: StepReport(1, 0, "gf1-a", 5, 1, 1, 1, None, 10.0),
        1: StepReport(1, 1, "gf1-b", 4, 1, 1, 1, None, 12.0),
        2: StepReport(1, 2, "gf1-c", 5, 1, 1, 1, None, 9.0),
    }
    last = {s: r.reported_at for s, r in reports.items()}
    assert lost_stage(g, last, reports, 20.0, 30.0, lambda n: False) is None
    node, why = lost_stage(g, last, reports, 50.0, 30.0, lambda n: False)
    assert node == "gf1-b" and why.startswith(
        "stage 1's node gf1-b sent no report for 38 s after step 4"
    )
    node, why = lost_stage(g, last, reports, 20.0, 30.0, lambda n: n == "gf1-c")
    assert node == "gf1-c" and "banned or suspended" in why


def test_a_stage_silent_for_ten_of_its_steps_mid_step_is_lost_before_the_timeout() -> None:
    """A stage that reported steps of 0.2 s and runs a step with no checkpoint is lost after 5 s
    of silence (20 steps, at least 5 s), not the 30 s timeout; before its first report, and while
    it runs a checkpoint step (it uploads its states first), the full timeout holds."""
    from gpuflex.hub.domain.pipelines.liveness import silence_limit

    g = _generation((StageSlot("gf1-a", 0, 1), StageSlot("gf1-b", 1, 2)))
    running = {s: StepReport(1, s, f"gf1-{'ab'[s]}", 5, 0.2, 0.1, 1, None, 10.0) for s in (0, 1)}
    last = {0: 10.0, 1: 14.0}
    assert silence_limit(g, running[0], 30.0, 4) == 5.0
    assert silence_limit(g, None, 30.0, 4) == 30.0  # no step reported yet
    assert silence_limit(g, running[0], 30.0, 0) == 30.0  # checkpoints unknown
    slow = StepReport(1, 0, "gf1-a", 5, 1.25, 1.0, 1, None, 10.0)
    assert silence_limit(g, slow, 30.0, 4) == 25.0  # twenty of its own steps
    at_checkpoint = StepReport(1, 0, "gf1-a", 7, 0.2, 0.1, 1, None, 10.0)  # step 8 uploads
    assert silence_limit(g, at_checkpoint, 30.0, 4) == 30.0
    assert silence_limit(g, at_checkpoint, 30.0, 5) == 5.0
    assert lost_stage(g, last, running, 14.9, 30.0, lambda n: False, checkpoint_every=4) is None
    node, why = lost_stage(g, last, running, 15.5, 30.0, lambda n: False, checkpoint_every=4)
    assert node == "gf1-a" and why == (
        "stage 0's node gf1-a sent no report for 6 s after step 5 (its steps took 0.2 s: the hub"
        " waits 5 s)"
    )
    assert lost_stage(g, last, running, 15.5, 30.0, lambda n: False) is None  # full timeout
    # both silent, at the same step: the one whose node the hub has not heard from is lost
    heard = {"gf1-a": 15.4, "gf1-b": 9.0}
    node, _ = lost_stage(
        g, last, running, 25.0, 30.0, lambda n: False, checkpoint_every=4, seen=heard.__getitem__
    )
    assert node == "gf1-b"


def test_a_node_is_gone_once_a_hang_up_ended_its_last_parked_take_and_it_asked_nothing_since() -> (
    None
):
    link = RelayLink()
    assert link.gone_at(last_seen=1.0) is None  # never parked a take
    link.park()  # its takes' requests: last_seen 1.0
    link.park()
    link.unpark(2.0, hung_up=True)
    assert link.gone_at(1.0) is None  # one take still parked
    link.unpark(2.1, hung_up=True)
    assert link.gone_at(1.0) == 2.1
    assert link.gone_at(2.5) is None  # a request since
    # between two takes, or holding what it asked for: the last one ended answered
    answered = RelayLink()
    answered.park()
    answered.unpark(2.0, hung_up=False)
    assert answered.gone_at(1.0) is None
    # one hung up while another was parked, which was then answered: not gone
    mixed = RelayLink()
    mixed.park()
    mixed.park()
    mixed.unpark(2.0, hung_up=True)
    mixed.unpark(2.1, hung_up=False)
    assert mixed.gone_at(1.0) is None
    # one answered (the node holds it), then the other hung up: gone
    mixed.park()
    mixed.park()
    mixed.unpark(2.2, hung_up=False)
    mixed.unpark(2.3, hung_up=True)
    assert mixed.gone_at(1.0) == 2.3


def test_a_stage_whose_node_closed_its_relay_connections_is_lost_after_the_grace() -> None:
    """Long before the silence limit (the full 30 s timeout here); never for connections closed
    before the stage was handed to the node or last reported, nor after its last step."""
    g = _generation((StageSlot("gf1-a", 0, 1), StageSlot("gf1-b", 1, 2), StageSlot("gf1-c", 2, 4)))
    reports = {s: StepReport(1, s, f"gf1-{'abc'[s]}", 5, 0.2, 0.1, 1, None, 10.0) for s in range(3)}
    last = dict.fromkeys(range(3), 10.0)
    closed = {"gf1-b": 11.0}

    def lost(now: float, last=last, reports=reports, closed=closed):
        return lost_stage(g, last, reports, now, 30.0, lambda n: False, gone=closed.get)

    assert GONE_S == 1.5
    assert lost(12.4) is None  # within the grace
    assert lost(12.6) == (
        "gf1-b",
        "stage 1's node gf1-b closed its relay connections 1.6 s ago and made no request since",
    )
    assert lost(20.0, last={**last, 1: 11.5}) is None  # its last stage's takes, closed before
    done = {**reports, 1: StepReport(1, 1, "gf1-b", 10, 0.2, 0.1, 1, None, 10.5)}
    assert lost(20.0, reports=done) is None  # its run is over
    node, _ = lost(20.0, closed={"gf1-b": 11.0, "gf1-c": 10.5})
    assert node == "gf1-c"  # the one closed longest ago
    assert lost_stage(g, last, reports, 20.0, 30.0, lambda n: False) is None  # not known


def test_checkpoint_steps() -> None:
    assert [s for s in range(12) if is_checkpoint_step(s, first_step=2, end_step=10, every=3)] == [
        3,
        6,
        9,
        10,
    ]


SPEC = parse_job_spec(
    '[job]\nname = "x"\n[model]\nkind = "mlp"\ninput = 8\nhidden = [4]\noutputs = 3\n'
    '[train]\nbatch_size = 8\noptimizer = "adam"\n[pipeline]\nstages = 2\n'
)


def test_a_unit_state_holds_its_entries_and_only_its_optimizers() -> None:
    cut = cut_model(SPEC)
    assert not isinstance(cut, str)
    entries = cut.entries[0]
    own = {"0.weight": torch.zeros(4, 8), "0.bias": torch.zeros(4)}
    adam = {
        f"optim.{slot}.{k}": torch.zeros_like(v)
        for k, v in own.items()
        for slot in ("exp_avg", "exp_avg_sq")
    }
    full = encode_state(own | adam | {"optim.step": torch.ones(1, dtype=torch.int64)})
    check_unit_state(full, "layers_0_1", entries, SPEC.train)
    check_unit_state(encode_state(own), "layers_0_1", entries, SPEC.train)  # no optimizer state yet
    assert len(full) <= max_state_bytes(entries, SPEC.train)
    for bad, code in (
        (own | {"optim.momentum_buffer.0.weight": torch.zeros(4, 8)}, "bad_state"),  # not Adam's
        (own | {"optim.exp_avg.0.weight": torch.zeros(2, 2)}, "bad_state"),
        (own | {"optim.step": torch.ones(1)}, "bad_state"),  # float, not int64
        ({"0.weight": own["0.weight"]}, "bad_state"),
        (own | {"0.bias": torch.full((4,), float("inf"))}, "nonfinite"),
    ):
        with pytest.raises(Unprocessable) as caught:
            check_unit_state(encode_state(bad), "layers_0_1", entries, SPEC.train)
        assert caught.value.code == code and "\n" not in caught.value.detail
    with pytest.raises(Unprocessable):
        check_unit_state(b"not gft1", "layers_0_1", entries, SPEC.train)


def test_the_relay_plan_of_a_generation() -> None:
    cut = cut_model(SPEC)
    assert not isinstance(cut, str)
    g = _generation((StageSlot("gf1-a", 0, 1), StageSlot("gf1-b", 1, 2)), first_step=4)
    plan = relay_plan(g, cut)
    assert plan.stages == ("gf1-a", "gf1-b") and plan.generation == 1
    assert plan.boundaries == (Crossing("float32", (8, 4)),) and plan.micro_batches == 4
    assert (plan.first_step, plan.end_step, plan.tied) == (4, 10, ())


def test_a_tied_embedding_crosses_between_the_stages_holding_it() -> None:
    from gpuflex.hub.model.relay import TiedStages

    spec = parse_job_spec(
        '[job]\nname = "lm"\n[model]\nkind = "transformer"\nvocab = 50\ncontext = 8\n'
        "layers = 2\nheads = 2\nwidth = 16\n[train]\nbatch_size = 8\n[pipeline]\nstages = 2\n"
    )
    cut = cut_model(spec)
    assert not isinstance(cut, str) and cut.names == ("embed", "block_0", "block_1", "head")
    plan = relay_plan(_generation((StageSlot("gf1-a", 0, 2), StageSlot("gf1-b", 2, 4))), cut)
    assert plan.boundaries == (Crossing("float32", (8, 8, 16)),)
    assert plan.tied == (TiedStages((0, 1), Crossing("float32", (50, 16))),)


def test_pipelines_sharing_a_step_have_a_relay_plan_that_keeps_them_apart() -> None:
    """Two pipelines of 2 stages (slots 0-1 and 2-3): activations, gradients and tied
    gradients stay within a pipeline and its micro-batches; a unit's "replica" gradient (its
    trainable elements, float32) goes only between the same stage of the two pipelines."""
    import dataclasses

    from gpuflex.hub.base.errors import BadRequest
    from gpuflex.protocol.pipeline import pipeline_units

    spec = parse_job_spec(
        '[job]\nname = "lm"\n[model]\nkind = "transformer"\nvocab = 50\ncontext = 8\n'
        "layers = 2\nheads = 2\nwidth = 16\n[train]\nbatch_size = 8\n[pipeline]\nstages = 2\n"
    )
    cut = cut_model(spec)
    assert not isinstance(cut, str)
    lane = (StageSlot("gf1-a", 0, 2), StageSlot("gf1-b", 2, 4))
    other = (StageSlot("gf1-c", 0, 2), StageSlot("gf1-d", 2, 4))
    g = dataclasses.replace(_generation((*lane, *other)), micro_batches=2, lanes=2)
    plan = relay_plan(g, cut)
    units = pipeline_units(spec.model)
    sizes = [
        sum(p.numel() for _, p in u.module.named_parameters(remove_duplicate=False))
        for u in units.units
    ]
    assert [[c.shape[0] for c in stage] for stage in plan.replicas] == [sizes[:2], sizes[2:]]
    assert (
        plan.crossing(step=0, micro_batch=3, carries="activation", stage=2, to_stage=3)
        == (plan.boundaries[0])
    )
    assert (
        plan.crossing(step=0, micro_batch=1, carries="replica", stage=3, to_stage=1)
        == (plan.replicas[1][1])
    )
    assert plan.crossing(step=0, micro_batch=0, carries="tied", stage=3, to_stage=2) == (
        plan.tied[0].crossing
    )
    refused = [
        (
            dict(micro_batch=1, carries="activation", stage=2, to_stage=3),
            "not one of the plan's 2 to 3 (pipeline 1's)",
        ),
        (dict(micro_batch=0, carries="activation", stage=1, to_stage=2), "in different pipelines"),
        (dict(micro_batch=0, carries="tied", stage=0, to_stage=3), "in different pipelines"),
        (
            dict(micro_batch=0, carries="replica", stage=0, to_stage=3),
            "the same stage of two pipelines",
        ),
        (
            dict(micro_batch=0, carries="replica", stage=0, to_stage=1),
            "the same stage of two pipelines",
        ),
        (dict(micro_batch=2, carries="replica", stage=0, to_stage=2), "holds 2 units, not unit 2"),
    ]
    for message, words in refused:
        with pytest.raises(BadRequest) as caught:
            plan.crossing(step=0, **message)
        assert words in caught.value.detail and "\n" not in caught.value.detail


def test_the_planner_shares_the_steps_between_pipelines_when_asked_or_faster() -> None:
    """``pipelines = 2`` on 4 nodes: two pipelines cut the same on nodes of their own, each
    running half the micro-batches, the step priced with the gradient exchange. Under "auto" the
    planner takes them only when that is faster: not over a home line with 4 MB units (the
    exchange outweighs the compute), yes with slow compute on a fast link."""
    from gpuflex.hub.domain.pipelines.planning import Lanes, exchange_s

    offers = [_offer(n) for n in ("gf1-a", "gf1-b", "gf1-c", "gf1-d")]
    asked = choose_pipeline(
        _costs(), offers, PipelineSpec(stages=2, micro_batches=4, pipelines=2), batch_size=32
    )
    assert isinstance(asked, Lanes) and len(asked.pipelines) == 2
    one, two = asked.pipelines
    assert [s.end_unit for s in one.stages] == [s.end_unit for s in two.stages]
    assert one.micro_batches == two.micro_batches == 2 and one.micro_batch_size == 8
    assert len({s.node_id for p in asked.pipelines for s in p.stages}) == 4
    assert asked.step_s == pytest.approx(
        max(one.step_s, two.step_s) + exchange_s(_costs(), one, asked.pipelines, offers)
    )
    single = choose_pipeline(_costs(), offers, PipelineSpec(stages=2, pipelines=1), batch_size=32)
    assert not isinstance(single, (str, Lanes))
    home = choose_pipeline(_costs(), offers, PipelineSpec(stages=2), batch_size=32)
    assert not isinstance(home, (str, Lanes)), "over a home line one pipeline is faster"
    fast = [NodeOffer(o.node_id, GB, 1e7, 1e9, 0.001) for o in offers]
    lanes = choose_pipeline(_costs(), fast, PipelineSpec(stages=2), batch_size=32)
    assert isinstance(lanes, Lanes) and len(lanes.pipelines) == 2
    solo = choose_pipeline(_costs(), fast, PipelineSpec(stages=2, pipelines=1), batch_size=32)
    assert not isinstance(solo, (str, Lanes)) and lanes.step_s < solo.step_s
    # a micro-batch count the pipelines cannot share is refused with the spec
    from gpuflex.protocol.errors import SpecError

    with pytest.raises(SpecError, match=r"2 pipelines cannot share pipeline\.micro_batches = 3"):
        parse_job_spec(
            '[job]\nname = "x"\n[model]\nkind = "mlp"\ninput = 4\nhidden = [4]\noutputs = 2\n'
            "[train]\nbatch_size = 6\n[pipeline]\nmicro_batches = 3\npipelines = 2\n"
        )


def test_a_faster_pipeline_runs_more_of_the_steps_micro_batches() -> None:
    """Two pipelines on nodes 4x apart in speed: the step's 8 micro-batches are shared out so
    the slowest finishes first (the fast one runs more), which beats the even split; the
    generation, the relay plan and each stage's assignment carry the counts."""
    import dataclasses

    from gpuflex.hub.base.errors import BadRequest
    from gpuflex.hub.domain.pipelines.planning import Lanes

    fast = [NodeOffer(n, GB, 4e9, 1e9, 0.001) for n in ("gf1-a", "gf1-b")]
    slow = [NodeOffer(n, GB, 1e9, 1e9, 0.001) for n in ("gf1-c", "gf1-d")]
    got = choose_pipeline(
        _costs(),
        [*fast, *slow],
        PipelineSpec(stages=2, micro_batches=8, pipelines=2),
        batch_size=32,
    )
    assert isinstance(got, Lanes)
    counts = [p.micro_batches for p in got.pipelines]
    quick = next(p for p in got.pipelines if p.stages[0].node_id in ("gf1-a", "gf1-b"))
    assert sum(counts) == 8 and quick.micro_batches >= 5 and min(counts) >= 1, counts
    assert {p.micro_batch_size for p in got.pipelines} == {4}
    from gpuflex.hub.domain.pipelines.generations import new_generation
    from gpuflex.hub.model.pipeline import PipelineState

    class _Job:
        id = "j-1"

    g = new_generation(_Job(), PipelineState("j-1", 4, 10), got, reason="r", now=0.0)  # type: ignore[arg-type]
    assert g.counts == tuple(counts) and g.lane_range(1) == (counts[0], counts[1])
    spec = parse_job_spec(
        '[job]\nname = "x"\n[model]\nkind = "mlp"\ninput = 4\nhidden = [4, 4, 4]\noutputs = 2\n'
        "[train]\nbatch_size = 32\n[pipeline]\nstages = 2\n"
    )
    cut = cut_model(spec)
    assert not isinstance(cut, str)
    g = dataclasses.replace(
        g,
        stages=tuple(
            dataclasses.replace(s, unit_end=min(s.unit_end, len(cut.costs))) for s in g.stages
        ),
    )
    plan = relay_plan(g, cut)
    last = counts[0] + counts[1] - 1
    plan.crossing(step=0, micro_batch=last, carries="activation", stage=2, to_stage=3)
    with pytest.raises(BadRequest, match=f"not one of the plan's 0 to {counts[0] - 1}"):
        plan.crossing(step=0, micro_batch=counts[0], carries="activation", stage=0, to_stage=1)


def test_a_relay_plan_refuses_another_generation_in_one_line() -> None:
    from gpuflex.hub.base.errors import Conflict
    from gpuflex.hub.model.relay import RelayPlan

    plan = RelayPlan(
        stages=("gf1-a", "gf1-b"),
        boundaries=(Crossing("float32", (2, 3)),),
        micro_batches=1,
        generation=3,
    )
    plan.check_generation(3)
    for other in (0, 2, 4):
        with pytest.raises(Conflict) as caught:
            plan.check_generation(other)
        assert caught.value.code == "stale_generation" and caught.value.status == 409
        assert f"generation {other}" in caught.value.detail and "\n" not in caught.value.detail
    assert (
        RelayPlan(
            stages=("a", "b"), boundaries=(Crossing("float32", (1,)),), micro_batches=1
        ).generation
        == 0
    )
