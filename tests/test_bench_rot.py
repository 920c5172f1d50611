"""The benches' cores on tiny configurations, so that a bench cannot rot unseen.

bench/hub_load.py broke once without anyone noticing: the Sybil defences turned its simulated
nodes (all from 127.0.0.1) away at registration. These run each bench's own measuring code
(hub_load's run_once on both stores, the simulation's simulate) small enough for every CI run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import hub_load  # noqa: E402
import simulation  # noqa: E402


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
async def test_hub_load_serves_a_small_job_on_each_store(store: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue("postgres_url") if store == "postgresql" else None
    r = await hub_load.run_once(6, 2, "inproc", url)
    assert r["final_state"] == "done" and r["store"] == store and r["workers"] == 1
    assert r["nodes"] == 6 and r["rounds"] == 2
    assert 0 < r["p50_assignment_ms"] <= r["p99_assignment_ms"] <= r["max_assignment_ms"]
    assert r["requests_per_s"] > 0 and r["baseline_echo_requests_per_s"] > 0
    # the ratio is written to 3 decimals (and the two rates to 0.1): up to 5e-4 off in absolute terms
    assert r["ratio_vs_echo"] == pytest.approx(r["requests_per_s"] / r["baseline_echo_requests_per_s"],
                                               rel=0.01, abs=6e-4)
    # the floors ran (their servers answered every request 200, fresh nonces each pass)
    assert r["baseline_signed_echo_requests_per_s"] > 0 and r["ratio_vs_signed_echo"] > 0
    assert r["durable_signed_echo_ratio_vs_echo"] > 0 and r["signed_echo_openssl_ratio_vs_echo"] > 0


def test_the_simulation_runs_the_hubs_policy_and_catches_the_adversary() -> None:
    r = simulation.simulate(60, 4, attackers=0.2, churn=0.05, trust_after=2, seed=0)
    assert r["nodes"] == 60 and r["rounds"] == 4 and r["shards_per_round"] > 1
    assert r["adversary_updates"] > 0 and r["detection_rate"] == 1.0 and r["honest_flagged"] == 0
    assert r["hub_cpu_ms_per_node_round"] > 0 and r["shard_balance_median"] >= 1.0


def test_model_delta_bench_runs_on_one_small_job(tmp_path: Path) -> None:
    import json

    import model_delta

    out = tmp_path / "d.json"
    assert model_delta.main(["--rounds", "1", "--jobs", "cnn", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["ratios"]["cnn_model_bytes_vs_delta"] > 1.0 and r["figures"]["cnn"]["rounds"][0]["delta_bytes"] > 0


async def test_hub_load_sustained_mode_spreads_the_arrivals() -> None:
    r = await hub_load.run_once(6, 2, "inproc", None, spread_s=0.3)
    assert r["mode"] == "sustained" and r["spread_s"] == 0.3 and r["final_state"] == "done"
    assert r["nodes"] == 6 and float(r["p99_assignment_ms"]) >= 0  # type: ignore[arg-type]
    assert r["baseline_signed_echo_requests_per_s"] is None  # the floors are a burst's


async def test_hub_load_floor_serves_the_same_nodes() -> None:
    """bench/floor_hub.py (the least a hub must do for these nodes) answers hub_load's nodes
    through every round, in its own process, as the hub does."""
    r = await hub_load.run_once(6, 2, "process", floor=True)
    assert r["store"] == "floor" and r["final_state"] == "done" and r["nodes"] == 6 and r["rounds"] == 2
    assert r["requests_per_s"] > 0 and 0 < r["p50_assignment_ms"] <= r["p99_assignment_ms"]
