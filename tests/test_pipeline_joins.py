"""A node joining or leaving a running pipeline, as plain functions: a join is worth a re-plan
only when the planner predicts a step at least ``replan_gain`` faster, and a re-plan (join or
leave) moves only the units whose node must change (hub/domain/pipelines/planning.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from gpuflex.hub.domain.pipelines.planning import bytes_moved, choose_pipeline, faster_with
from gpuflex.hub.model.pipeline import Generation, StageSlot
from gpuflex.hub.policy.pipeline_plan import NodeOffer, Pipeline, evaluate_pipeline
from gpuflex.protocol.jobspec import PipelineSpec
from gpuflex.protocol.modelanalysis import UnitCost
from gpuflex.protocol.signing import SigningKey
from gpuflex.protocol.tensors import decode_state

from tests.helpers import open_store, stored_blobs
from tests.pipeline_hub import (
    DIGITS_SPEC,
    HubThread,
    drive_all,
    fetch_blob,
    job_data,
    max_rel_diff,
    poll,
    poll_until,
    reference,
    register,
    submit,
)
from tests.test_hub_pipeline import status as _pipeline

GB = 1 << 30
SPEC = PipelineSpec(stages=4, micro_batches=4, schedule="1f1b")


def _costs(n: int = 8) -> list[UnitCost]:
    return [
        UnitCost(i, "Linear", 4 << 20, 4 << 20, 4 << 20, 1024, 1024, 4e6, 8e6) for i in range(n)
    ]


def _offer(node: str, flops: float = 1e10) -> NodeOffer:
    return NodeOffer(node, GB, flops, 2.5e9, 0.001)


def _live(nodes: list[NodeOffer], ends: tuple[int, ...]) -> tuple[Generation, Pipeline]:
    p = evaluate_pipeline(_costs(), nodes, ends, micro_batches=4, schedule="1f1b", batch_size=32)
    assert p is not None
    g = Generation(
        job_id="j-1",
        number=1,
        first_step=0,
        end_step=100,
        stages=tuple(
            StageSlot(s.node_id, s.first_unit, s.end_unit, s.micro_batch_s, s.memory_bytes)
            for s in p.stages
        ),
        micro_batches=4,
        micro_batch_size=8,
        schedule="1f1b",
        step_s=p.step_s,
        bubble_fraction=p.bubble_fraction,
        reason="the first plan",
        created_at=0.0,
    )
    return g, p


def _minimum(g: Generation, p: Pipeline) -> int:
    """The unit-state bytes whose node changed: the least any re-plan can move."""
    return sum(
        _costs()[u].state_bytes
        for s in p.stages
        for u in range(s.first_unit, s.end_unit)
        if g.holder(u) != s.node_id
    )


def test_a_faster_node_that_joins_takes_the_slow_stages_units_and_nothing_else_moves() -> None:
    live_nodes = [_offer("gf1-a"), _offer("gf1-b", 1e9), _offer("gf1-c"), _offer("gf1-d")]
    g, _ = _live(live_nodes, (2, 4, 6, 8))
    got = faster_with(
        _costs(),
        [*live_nodes, _offer("gf1-e")],
        SPEC,
        batch_size=32,
        live=g,
        joining=["gf1-e"],
        gain=0.2,
    )
    assert got is not None and got.step_s <= 0.8 * g.step_s
    assert [(s.node_id, s.first_unit, s.end_unit) for s in got.stages] == [
        ("gf1-a", 0, 2),
        ("gf1-e", 2, 4),
        ("gf1-c", 4, 6),
        ("gf1-d", 6, 8),
    ]
    assert bytes_moved(got, _costs(), g) == _minimum(g, got) == 2 * _costs()[2].state_bytes


def test_a_node_that_joins_without_making_the_step_faster_changes_nothing() -> None:
    live_nodes = [_offer("gf1-a"), _offer("gf1-b"), _offer("gf1-c"), _offer("gf1-d")]
    g, _ = _live(live_nodes, (2, 4, 6, 8))
    for newcomer in (_offer("gf1-e"), _offer("gf1-e", 1e9)):
        got = faster_with(
            _costs(),
            [*live_nodes, newcomer],
            SPEC,
            batch_size=32,
            live=g,
            joining=["gf1-e"],
            gain=0.2,
        )
        assert got is None, newcomer


def _generation_of(plan: Any) -> Generation:
    """The generation the hub makes of ``plan`` (one pipeline, or pipelines sharing the steps)."""
    from gpuflex.hub.domain.pipelines.generations import new_generation
    from gpuflex.hub.model.pipeline import PipelineState

    class Job:
        id = "j-1"

    return new_generation(Job(), PipelineState("j-1", 8, 100), plan, reason="r", now=0.0)  # type: ignore[arg-type]


def test_nodes_that_join_a_job_asking_for_two_pipelines_make_the_second_one() -> None:
    """A job asking ``pipelines = 2`` runs one pipeline on the 4 nodes it had; 4 more join: the
    re-plan runs two pipelines, the first on the live nodes with the units they hold (nothing of
    theirs moves), the second on the newcomers cut the same. Once two run, the same nodes offer
    nothing more."""
    import dataclasses

    from gpuflex.hub.domain.pipelines.planning import Lanes, lane_zero

    live_nodes = [_offer(n) for n in ("gf1-a", "gf1-b", "gf1-c", "gf1-d")]
    g, _ = _live(live_nodes, (2, 4, 6, 8))
    new = [_offer(n) for n in ("gf1-e", "gf1-f", "gf1-g", "gf1-h")]
    spec = dataclasses.replace(SPEC, pipelines=2)
    got = faster_with(
        _costs(),
        [*live_nodes, *new],
        spec,
        batch_size=32,
        live=g,
        joining=[o.node_id for o in new],
        gain=0.2,
    )
    assert isinstance(got, Lanes) and len(got.pipelines) == 2
    first, second = got.pipelines
    assert bytes_moved(first, _costs(), g) == 0
    assert {s.node_id for s in second.stages} == {o.node_id for o in new}
    assert [s.end_unit for s in first.stages] == [s.end_unit for s in second.stages]
    assert first.micro_batches == second.micro_batches == 2
    two = _generation_of(got)
    assert lane_zero(two).stages == _generation_of(first).stages
    again = faster_with(
        _costs(), [*live_nodes, *new], spec, batch_size=32, live=two, joining=[], gain=0.2
    )
    assert again is None
    auto = faster_with(
        _costs(), [*live_nodes, *new], SPEC, batch_size=32, live=g, joining=["gf1-e"], gain=0.2
    )
    # under auto a second pipeline is taken only when it is replan_gain faster (here: fast links)
    assert isinstance(auto, Lanes) and auto.step_s <= 0.8 * g.step_s


def test_a_job_asking_for_two_pipelines_keeps_two_after_a_loss_when_a_spare_is_online() -> None:
    """Two pipelines of 2 stages; a node of the first is lost and a spare is idle: the re-plan
    runs two pipelines again, and the survivors of the first keep their units."""

    from gpuflex.hub.domain.pipelines.planning import Lanes, lane_zero

    spec = PipelineSpec(stages=2, micro_batches=4, schedule="1f1b", pipelines=2)
    offers = [_offer(n) for n in ("gf1-a", "gf1-b", "gf1-c", "gf1-d")]
    first = choose_pipeline(_costs(4), offers, spec, batch_size=32)
    assert isinstance(first, Lanes)
    g = _generation_of(first)
    lost = g.stages[1].node_id
    left = [o for o in offers if o.node_id != lost] + [_offer("gf1-spare")]
    again = choose_pipeline(_costs(4), left, spec, batch_size=32, previous=g)
    assert isinstance(again, Lanes) and len(again.pipelines) == 2
    keeper = g.stages[0]
    zero = again.pipelines[0].stages[0]
    assert (zero.node_id, zero.first_unit, zero.end_unit) == (
        keeper.node_id,
        keeper.unit_start,
        keeper.unit_end,
    ), "the first pipeline's survivor keeps its units"
    assert lane_zero(g) is not None and lane_zero(g).lanes == 1


def test_a_middle_stage_that_leaves_moves_only_its_own_units() -> None:
    live_nodes = [_offer("gf1-a"), _offer("gf1-b"), _offer("gf1-c"), _offer("gf1-d")]
    g, _ = _live(live_nodes, (2, 4, 6, 8))
    offers = [_offer("gf1-a"), _offer("gf1-c"), _offer("gf1-d"), _offer("gf1-spare")]
    got = choose_pipeline(_costs(), offers, SPEC, batch_size=32, previous=g)
    assert isinstance(got, Pipeline)
    assert [s.node_id for s in got.stages] == ["gf1-a", "gf1-spare", "gf1-c", "gf1-d"]
    assert (
        bytes_moved(got, _costs(), g)
        == _minimum(g, got)
        == sum(_costs()[u].state_bytes for u in (2, 3))
    )


# -- on a real hub: the nodes drive their stages with the node's engine over the relay ----------

STEPS = 60


@pytest.fixture
def hub(tmp_path):
    # the old generation's drivers may wait out their relay timeout (30 s) before they stop: a
    # stage handed meanwhile must not count as lost
    h = HubThread(tmp_path / "hub", stage_timeout_s=60.0)
    yield h
    h.stop()


def _wait(hub: HubThread, job_id: str, test, timeout_s: float = 60.0) -> dict:
    give_up = time.monotonic() + timeout_s
    while not test(doc := _pipeline(hub, job_id)):
        assert time.monotonic() < give_up, doc.get("pipeline")
        time.sleep(0.05)
    return doc


def _run_first_generation_while_a_node_joins(
    hub: HubThread, tmp_path, newcomer_sps: float
) -> tuple[dict, list, list, SigningKey, tuple]:
    """Two nodes (the second slow) run generation 1; once step 2 is committed, a node joins."""
    keys = [register(hub.url), register(hub.url, samples_per_s=50.0)]
    code, job = submit(hub, tmp_path, DIGITS_SPEC.format(stages=2, steps=STEPS, every=2))
    assert code == 201, job
    first = poll_until(hub, keys)
    s0 = next(i for i, sa in enumerate(first) if sa.stage == 0)
    start = {
        k: v.clone()
        for k, v in decode_state(fetch_blob(hub.url, keys[0], first[0].model_hash)).items()
    }
    data = job_data(hub.url, keys[s0], first[s0])
    newcomer = register(hub.url, samples_per_s=newcomer_sps)
    runs: list = []
    # each stage's reported compute time as slow as its benchmark says (20 times apart): the hub
    # plans with the measured speeds once the stages have reported a few steps
    slow = {"options": {1: {"compute_s": 0.2}}}
    driver = threading.Thread(target=lambda: runs.extend(drive_all(hub, keys, first, **slow)))
    driver.start()
    _wait(hub, job["id"], lambda d: d["pipeline"]["committed_step"] >= 2)
    # the poll wakes the hub, which may re-plan before it answers
    early = poll(hub, newcomer, 0.2)
    return job, keys, first, newcomer, (start, data, runs, early, driver)


def _check_model(hub: HubThread, job: dict, first, start, data) -> dict:
    doc = _wait(hub, job["id"], lambda d: d["state"] == "done")
    want = reference(first[0].model_spec, start, first[0], *data, STEPS)
    got = decode_state(stored_blobs(hub.hub.data_dir)[doc["model_hash"]])
    assert max_rel_diff(dict(got), {k: v.detach() for k, v in want.state_dict().items()}) <= 1e-5
    return doc


def test_a_faster_node_joining_mid_job_is_planned_in_right_after_a_committed_step(
    hub, tmp_path
) -> None:
    job, keys, first, newcomer, (start, data, _, early, driver) = (
        _run_first_generation_while_a_node_joins(hub, tmp_path, 1000.0)
    )
    fast, slow = 0, 1  # the order they registered in
    if early is None:
        second = poll_until(hub, [keys[fast], newcomer])
    else:
        second = [*poll_until(hub, [keys[fast]]), early]
    assert {sa.generation for sa in second} == {2}
    g2 = _pipeline(hub, job["id"])["pipeline"]
    resumed = second[0].first_step
    assert resumed >= 2 and resumed % 2 == 0 and all(sa.first_step == resumed for sa in second)
    assert (second[0].stage, second[0].unit_start, second[0].unit_end) == (
        first[fast].stage,
        first[fast].unit_start,
        first[fast].unit_end,
    ), "the node that stays keeps its units"
    assert (second[1].unit_start, second[1].unit_end) == (
        first[slow].unit_start,
        first[slow].unit_end,
    )
    moved = sum(u.size for u in second[1].unit_states)
    assert g2["generation"]["state_bytes_moved"] == moved, "only the slow node's units change node"
    runs = drive_all(hub, [keys[fast], newcomer], second)
    assert all(r.error is None for r in runs), [r.error for r in runs]
    driver.join(120)
    doc = _check_model(hub, job, first, start, data)
    old, new = doc["pipeline"]["generations"]
    assert old["ended_at"] is not None and new["first_step"] == resumed
    assert new["reason"].startswith(f"node {newcomer.fingerprint} joined: predicted step ")
    assert new["predicted_step_s"] <= 0.8 * old["predicted_step_s"]
    conn = open_store(hub.hub.data_dir)
    try:
        done = conn.execute(
            "SELECT stage, steps_done, COUNT(*) FROM stage_reports WHERE generation = 2"
            " GROUP BY stage, steps_done"
        ).fetchall()
    finally:
        conn.close()
    assert sorted(done) == [(s, n, 1) for s in (0, 1) for n in range(resumed + 1, STEPS + 1)], (
        "generation 2 runs each step from the committed one once"
    )


def test_a_node_joining_that_would_not_speed_the_step_up_changes_nothing(hub, tmp_path) -> None:
    job, _, first, _, (start, data, runs, early, driver) = _run_first_generation_while_a_node_joins(
        hub, tmp_path, 50.0
    )
    assert early is None, "an idle node gets no stage of the live generation"
    driver.join(120)
    assert all(r.error is None for r in runs), [r.error for r in runs]
    doc = _check_model(hub, job, first, start, data)
    assert [g["generation"] for g in doc["pipeline"]["generations"]] == [1]
