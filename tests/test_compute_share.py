"""`gpuflex-node run --compute-share F`: the node rests after each piece of training so it
computes about F of its time, on a pipeline stage as in data-parallel work, without changing a
number it computes; it offers the hub its speed times F; a share it cannot run at is one line."""

from __future__ import annotations

import copy
import math
import time

import pytest
import torch
from gpuflex.node.cli import main
from gpuflex.node.computeshare import ComputeShare, check_share, offered
from gpuflex.node.errors import ConfigError
from gpuflex.node.pipeline.local import run_stages
from gpuflex.node.pipeline.transport import MemoryNetwork
from gpuflex.node.trainer import train_assignment
from gpuflex.protocol.messages import TrainConfig
from gpuflex.protocol.modelspec import ModelSpec, build_model
from torch import nn

from tests.helpers import start_hub
from tests.test_max_memory import _registered
from tests.test_node_support import FAST_BENCH
from tests.test_pipeline_engine import (
    ADAM,
    accumulate,
    max_rel_diff,
    mlp_units,
    runners_for,
    step_data,
)


@pytest.mark.parametrize("share", [0.0, 0.04, -0.5, 1.01, 7.0, math.nan, math.inf])
def test_a_share_the_node_cannot_run_at_is_one_line(share: float) -> None:
    with pytest.raises(
        ConfigError, match=r"^--compute-share .*: expected a fraction from 0.05 to 1$"
    ):
        check_share(share)
    with pytest.raises(ConfigError):
        ComputeShare(share)


def test_a_bad_share_stops_the_node_before_it_starts(capsys) -> None:
    code = main(["run", "--hub", "http://127.0.0.1:9", "--compute-share", "0"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and err.count("\n") == 0
    assert err == "gpuflex-node: error: --compute-share 0.0: expected a fraction from 0.05 to 1"


def test_the_rest_is_what_the_share_leaves_and_carries_over() -> None:
    pace = ComputeShare(0.25)
    pace.rest_for(0.0005)  # owes 1.5 ms: under a sleep's grain, carried
    assert pace.rested_s == 0 and pace.owed_s == pytest.approx(0.0015)
    pace.rest_for(0.005)  # owes 16.5 ms in all: slept, an oversleep carried as a debt paid back
    assert pace.rested_s >= 0.0165 * 0.9
    assert pace.rested_s + pace.owed_s == pytest.approx(0.0165)


def test_a_piece_is_timed_from_its_start_to_its_end() -> None:
    pace = ComputeShare(0.5)
    started = time.perf_counter()
    with pace.computing():
        time.sleep(0.02)  # the piece
    elapsed = time.perf_counter() - started
    # at a half share the node rests as long as it computed: the piece's 20 ms, at most what passed
    assert 0.02 <= pace.rested_s + pace.owed_s <= elapsed


def test_a_full_share_times_and_rests_nothing() -> None:
    pace = ComputeShare(1.0)
    with pace.computing():
        time.sleep(0.005)
    assert pace.full and pace.rested_s == 0 and pace.owed_s == 0


def test_a_resting_pipeline_computes_what_a_full_one_does() -> None:
    data = step_data(steps=3)
    reference = nn.Sequential(*copy.deepcopy(mlp_units()))
    want = accumulate(reference, data, ADAM)
    runners = runners_for(mlp_units(), [0, 3], ADAM, "1f1b", MemoryNetwork())
    for r in runners:
        r.pace = ComputeShare(0.5)
    got = run_stages(runners, data)
    assert max_rel_diff([r.module for r in runners], reference) <= 1e-5
    assert got == pytest.approx(want, rel=1e-5)
    for r in runners:  # every stage rested for its forwards, backwards and optimizer steps
        assert r.pace is not None and r.pace.rested_s + r.pace.owed_s > 0


def test_the_offer_is_the_speed_times_the_share() -> None:
    half = offered(FAST_BENCH, 0.5)
    assert half.samples_per_s == pytest.approx(FAST_BENCH.samples_per_s / 2)
    assert half.matmul_tflops_fp32 == pytest.approx(FAST_BENCH.matmul_tflops_fp32 / 2)
    assert half.precision_sps == {
        k: pytest.approx(v / 2) for k, v in FAST_BENCH.precision_sps.items()
    }
    assert half.mem_bandwidth_gbs == FAST_BENCH.mem_bandwidth_gbs  # a bandwidth is what it is
    assert offered(FAST_BENCH, 1.0) is FAST_BENCH


async def test_a_real_node_offers_the_hub_its_share_of_its_speed(tmp_path) -> None:
    hub = await start_hub(tmp_path / "hub")
    try:
        full = await _registered(tmp_path, hub, "full")
        quarter = await _registered(tmp_path, hub, "quarter", compute_share=0.25)
    finally:
        await hub.stop()
    assert full["benchmark"]["samples_per_s"] == pytest.approx(FAST_BENCH.samples_per_s)
    assert quarter["benchmark"]["samples_per_s"] == pytest.approx(FAST_BENCH.samples_per_s / 4)
    assert quarter["benchmark"]["matmul_tflops_fp32"] == pytest.approx(
        FAST_BENCH.matmul_tflops_fp32 / 4
    )


def test_training_under_a_share_changes_no_number(tmp_path) -> None:
    spec = ModelSpec.from_dict({"kind": "mlp", "input": 6, "hidden": [8], "outputs": 3})
    model = build_model(spec, 0)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    chunks = [{"x": torch.randn(64, 6, generator=g), "y": torch.randint(0, 3, (64,), generator=g)}]
    cfg = TrainConfig(1, 16, "sgd", 0.1, 0.9, 0.0, 0.9, 0.999, "cross_entropy", 0.0)
    cpu = torch.device("cpu")
    plain = train_assignment(spec, state, chunks, cfg, 3, device=cpu)
    pace = ComputeShare(0.5)
    rested = train_assignment(spec, state, chunks, cfg, 3, device=cpu, pace=pace)
    assert plain.loss == rested.loss and plain.steps == rested.steps == 4
    assert all(torch.equal(plain.delta[k], rested.delta[k]) for k in plain.delta)
    assert pace.rested_s + pace.owed_s > 0


async def test_status_says_the_share(tmp_path, capsys) -> None:
    """`gpuflex-node status` of a running node started with a share says so."""
    import asyncio

    from tests.test_node_support import EventLog, agent, wait_for

    hub = await start_hub(tmp_path / "hub")
    events = EventLog()
    node = agent(tmp_path / "node", hub.url, events, compute_share=0.5, control=True)
    try:
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(node.run())
            try:
                await wait_for(lambda: events.of("registered") or task.done())
                code = await asyncio.to_thread(main, ["status", "--data-dir", str(tmp_path / "node")])
            finally:
                node.request_exit("test")
    finally:
        await hub.stop()
    out = capsys.readouterr().out
    assert code == 0 and "computing 50% of the time" in out, out
