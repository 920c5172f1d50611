"""Nodes started exactly as the contributor's guide (docs/contributor.md) shows, on one machine: real
`gpuflex-node run` processes with no --source-address reach a `gpuflex-hub serve` process (the
production defences) from one address block, 127.0.0.0/24. No replica of their shards can go to
the other node, so no round may wait `replica_wait_s` for one: the referee re-executes a segment
of each lone update instead, and the job finishes verified, with nobody flagged."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.tooling.cluster import LocalCluster, digits_job

pytestmark = pytest.mark.e2e

ROUNDS = 3
REPLICA_WAIT_S = 30.0


@pytest.fixture(scope="module")
def bench_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bench") / "bench.json"


def test_nodes_of_one_machine_finish_a_job_verified_without_waiting_for_replicas(
        tmp_path: Path, bench_cache: Path) -> None:
    import asyncio

    from gpuflex.hub.ops import owner_client as oc

    files = digits_job(tmp_path / "job", rounds=ROUNDS, local_epochs=1,
                       extra_toml=f"spot_check = 0.0\nreplica_wait_s = {REPLICA_WAIT_S}\n")
    with LocalCluster(workdir=tmp_path, hub_args=("--long-poll-max", "2"), shared_bench_cache=bench_cache,
                      distinct_blocks=False) as cluster:
        cluster.start_hub()
        nodes = [cluster.start_node("a"), cluster.start_node("b")]
        cluster.wait_registered()
        owner = cluster.create_token("owner", "alice")
        auditor = cluster.create_token("auditor", "audrey")
        listed = {n["id"]: n for n in cluster.get_json("/v1/nodes", auditor)["nodes"]}
        assert {listed[n.node_id]["address_block"] for n in nodes} == {"127.0.0.0/24"}
        started = time.monotonic()
        job = str(asyncio.run(oc.submit_job(cluster.url, owner, files.spec, files.train, files.val))["id"])
        status = cluster.wait_job(job, owner, timeout_s=ROUNDS * REPLICA_WAIT_S + 60)
        took = time.monotonic() - started
        assert status["state"] == "done", status
        # before: every round waited the replica wait, then counted its shards unverified
        assert took < REPLICA_WAIT_S, f"{ROUNDS} rounds took {took:.1f} s"
        assert all(h["unverified"] == {} for h in status["history"]), status["history"]
        assert cluster.get_json(f"/v1/flags?job={job}", auditor)["flags"] == []
        reqs = cluster.rows("SELECT reason, status FROM state_requests WHERE job_id = ?", job)
        assert reqs and {(r["reason"], r["status"]) for r in reqs} == {("no_replica_holder", "reproduced")}
