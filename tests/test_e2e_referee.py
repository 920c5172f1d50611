"""The referee with real processes (issue 14, items 4-6): a `gpuflex-hub serve` process and
`gpuflex-node run` processes over 127.0.0.1. Nodes commit to their checkpoints, the hub asks
for states, re-executes a segment and judges; honest numeric classes are not flagged, a crafted
update is caught even when its replica agrees, and a node that withholds its states is flagged
unverifiable and left out."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.tooling.cluster import LocalCluster, digits_job

pytestmark = pytest.mark.e2e

HUB = ("--long-poll-max", "2", "--min-deadline", "4")


@pytest.fixture(scope="module")
def bench_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bench") / "bench.json"


def _submit(cluster: LocalCluster, token: str, files: Any) -> str:
    import asyncio

    from gpuflex.hub.ops import owner_client as oc

    return str(asyncio.run(oc.submit_job(cluster.url, token, files.spec, files.train, files.val))["id"])


def _hub_cli(argv: list[str], env: dict[str, str]) -> str:
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "gpuflex.hub", *argv], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    return done.stdout


def _wait_rows(cluster: LocalCluster, sql: str, *args: Any, timeout_s: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = cluster.rows(sql, *args)
        if rows:
            return rows
        time.sleep(0.25)
    raise AssertionError(f"nothing for {sql!r} within {timeout_s} s")


def test_honest_nodes_of_different_numeric_classes_disagree_and_are_not_flagged(
        tmp_path: Path, bench_cache: Path) -> None:
    """An fp32 node and a bf16-autocast node train every shard as replicas: their updates differ
    far beyond the strict tolerance, the referee re-executes a segment of each in its claimed
    precision, both reproduce, nobody is flagged and the job finishes."""
    files = digits_job(tmp_path / "job", rounds=2, local_epochs=2, replication=1.0,
                       extra_toml="spot_check = 0.0\nreplica_wait_s = 120.0\nstate_wait_s = 60.0\n")
    with LocalCluster(workdir=tmp_path, hub_args=HUB, shared_bench_cache=bench_cache) as cluster:
        cluster.start_hub()
        fp32 = cluster.start_node("fp32")
        bf16 = cluster.start_node("bf16", extra=("--precisions", "bf16", "--onednn", "off"))
        cluster.wait_registered()
        owner = cluster.create_token("owner", "alice")
        auditor = cluster.create_token("auditor", "audrey")
        job = _submit(cluster, owner, files)
        status = cluster.wait_job(job, owner, timeout_s=240)
        assert status["state"] == "done", status
        assert cluster.get_json(f"/v1/flags?job={job}", auditor)["flags"] == []
        reqs = cluster.rows("SELECT * FROM state_requests WHERE job_id = ?", job)
        assert reqs and {r["reason"] for r in reqs} == {"disagreement"}
        assert {r["status"] for r in reqs} == {"reproduced"}
        assert {r["node_id"] for r in reqs} == {fp32.node_id, bf16.node_id}
        shards = cluster.rows("SELECT outcome FROM shards WHERE job_id = ? AND state = 'settled'", job)
        outcomes = [json.loads(s["outcome"]) for s in shards]
        crossed = [o for o in outcomes if o.get("cross_class")]
        assert crossed, outcomes
        for o in crossed:
            assert all(p["relative_distance"] > 1e-4 and not p["agree"] for p in o["pairs"])
            for v in o["referee"]:
                assert v["outcome"] == "reproduced" and v["distance"] <= v["threshold"]
        precisions = {v["node"]: v["precision"] for o in crossed for v in o["referee"]}
        assert precisions == {fp32.node_id: "fp32", bf16.node_id: "bf16"}
        nodes = {n["id"]: n for n in cluster.get_json("/v1/nodes", auditor)["nodes"]}
        assert nodes[fp32.node_id]["reputation"]["flags_total"] == 0
        assert nodes[bf16.node_id]["reputation"]["flags_total"] == 0


def test_a_crafted_update_with_a_colluding_replica_is_caught_by_the_spot_check(
        tmp_path: Path, bench_cache: Path) -> None:
    """Two colluders return the same wrong update for the shard they share: the strict
    comparison sees agreement, the spot-check re-executes the representative and flags both."""
    files = digits_job(tmp_path / "job", rounds=1, local_epochs=1, replication=1.0,
                       extra_toml="spot_check = 1.0\nreplica_wait_s = 120.0\nstate_wait_s = 60.0\n")
    with LocalCluster(workdir=tmp_path, hub_args=HUB, shared_bench_cache=bench_cache) as cluster:
        cluster.start_hub()
        a = cluster.start_node("col-a", attack="colluding")
        b = cluster.start_node("col-b", attack="colluding")
        cluster.wait_registered()
        owner = cluster.create_token("owner", "alice")
        job = _submit(cluster, owner, files)
        flags = _wait_rows(cluster, "SELECT * FROM flags WHERE job_id = ?", job, timeout_s=180)
        time.sleep(0.5)
        flags = cluster.rows("SELECT * FROM flags WHERE job_id = ?", job)
        assert {f["node_id"] for f in flags} == {a.node_id, b.node_id}
        assert {f["reason"] for f in flags} == {"referee_mismatch"}
        ev = [json.loads(f["evidence"]) for f in flags]
        direct = [e for e in ev if "vouched_for" not in e]
        assert direct and direct[0]["referee"]["reason"] == "spot_check"
        assert "not the committed last state" in direct[0]["referee"]["why"]
        assert any("vouched_for" in e for e in ev)
        ups = cluster.rows("SELECT status FROM updates WHERE job_id = ?", job)
        assert ups and all(u["status"] == "quarantined" for u in ups[:2])
        auditor = cluster.create_token("auditor", "audrey")
        first = next(f for f in flags if "vouched_for" not in json.loads(f["evidence"]))
        show = cluster.get_json(f"/v1/flags/{first['id']}", auditor)
        assert show["referee"][0]["this"] and show["referee"][0]["steps"]
        text = _hub_cli(["audit", "show", first["id"]], {"GPUFLEX_HUB": cluster.url, "GPUFLEX_TOKEN": auditor})
        assert "referee re-execution" in text and "spot_check" in text and "mismatch" in text


@pytest.mark.one_store  # the referee's verdict on real nodes; the state requests' store calls are in-process tests'
def test_a_node_that_withholds_its_states_is_unverifiable_and_left_out(tmp_path: Path, bench_cache: Path) -> None:
    files = digits_job(tmp_path / "job", rounds=1, local_epochs=1, replication="adaptive",
                       extra_toml="spot_check = 1.0\nreplica_wait_s = 1.0\nstate_wait_s = 3.0\n")
    with LocalCluster(workdir=tmp_path, hub_args=HUB, shared_bench_cache=bench_cache) as cluster:
        cluster.start_hub()
        mute = cluster.start_node("mute", attack="withhold")
        cluster.wait_registered()
        owner = cluster.create_token("owner", "alice")
        auditor = cluster.create_token("auditor", "audrey")
        job = _submit(cluster, owner, files)
        flags = _wait_rows(cluster, "SELECT * FROM flags WHERE job_id = ? AND reason = 'unverifiable'", job,
                           timeout_s=180)
        assert flags[0]["node_id"] == mute.node_id
        ev = json.loads(flags[0]["evidence"])["referee"]
        # alone, no replica can come: the referee stands in for it at once (not a spot check after the wait)
        assert "not handed over" in ev["why"] and ev["reason"] == "no_replica_holder"
        withheld = {f["update_id"] for f in flags}
        honest = cluster.start_node("honest")  # the job can finish without the mute node's work
        status = cluster.wait_job(job, owner, timeout_s=240)
        assert status["state"] == "done", status
        mine = cluster.rows("SELECT id, status FROM updates WHERE node_id = ?", mute.node_id)
        assert all(u["status"] != "included" for u in mine)
        assert {u["id"] for u in mine if u["status"] == "quarantined"} >= withheld
        assert cluster.rows("SELECT 1 FROM updates WHERE node_id = ? AND status = 'included'", honest.node_id)
        show = cluster.get_json(f"/v1/flags/{flags[0]['id']}", auditor)
        assert show["reason"] == "unverifiable"
        (row,) = show["referee"]
        assert row["node"] == mute.node_id and row["outcome"] == "unverifiable" and row["reason"] == "no_replica_holder"
        text = _hub_cli(["audit", "show", flags[0]["id"]], {"GPUFLEX_HUB": cluster.url, "GPUFLEX_TOKEN": auditor})
        assert "referee re-execution" in text and "not handed over" in text and "unverifiable" in text


@pytest.mark.one_store  # the referee's policy at scale; its store traffic is the other tests'
def test_many_tiny_assignments_a_round_with_spot_checks_flag_no_honest_node_and_stall_no_round(
        tmp_path: Path, bench_cache: Path) -> None:
    """Small chunks: each of 3 honest `gpuflex-node` processes trains dozens of assignments a
    round, and the referee spot-checks them, long after the node has trained many more. Every
    state asked for is still kept (the node keeps all of the job's two newest rounds), so every
    re-execution reproduces: no node is flagged, and no round waits on a state nobody holds (a
    round lasts its work, far under the 60 s a request may wait)."""
    files = digits_job(tmp_path / "job", rounds=2, local_epochs=1, chunk_size=8, replication="adaptive",
                       round_target_s=0.002,
                       extra_toml="spot_check = 0.5\nstate_wait_s = 60.0\nreplica_wait_s = 5.0\n")
    with LocalCluster(workdir=tmp_path, hub_args=HUB, shared_bench_cache=bench_cache) as cluster:
        cluster.start_hub()
        nodes = [cluster.start_node(f"honest-{i}") for i in range(3)]
        cluster.wait_registered()
        owner = cluster.create_token("owner", "alice")
        auditor = cluster.create_token("auditor", "audrey")
        job = _submit(cluster, owner, files)
        status = cluster.wait_job(job, owner, timeout_s=300)
        assert status["state"] == "done", status
        assert cluster.get_json(f"/v1/flags?job={job}", auditor)["flags"] == []
        reqs = cluster.rows("SELECT * FROM state_requests WHERE job_id = ?", job)
        assert len(reqs) >= 6 and {r["status"] for r in reqs} == {"reproduced"}, [
            (r["status"], r["verdict"]) for r in reqs]
        for h in status["history"]:
            assert h["closed_at"] - h["opened_at"] < 45, h
        # the check reached back past the node's newest few assignments: the retention is what held
        done = cluster.rows("SELECT node_id, id, issued_at FROM assignments WHERE job_id = ? ORDER BY issued_at", job)
        later = [sum(1 for d in done if d["node_id"] == r["node_id"] and d["issued_at"] > issued)
                 for r in reqs
                 for issued in [next(d["issued_at"] for d in done if d["id"] == r["assignment_id"])]]
        assert max(later) >= 5, later
        per_round = [sum(1 for u in h["updates"] if u["node_id"] == n.node_id) for h in status["history"]
                     for n in nodes]
        assert max(per_round) >= 8, per_round
        for n in nodes:
            assert not [e for e in n.events() if e.get("event") == "state_missing"]
