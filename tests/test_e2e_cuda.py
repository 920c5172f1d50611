"""CUDA only (skipped without a GPU), with real processes: a CPU hub, a CPU node in fp32 and three
CUDA nodes (one in the GPU's own precision, one held to fp32, one to tf32) train one job as replicas. The
referee, which replays on the hub's CPU, must reproduce every GPU segment it asks for, so no
honest GPU node is flagged, dropout included. Run with ``-s`` to see the referee's distances per precision."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from tests.tooling.cluster import LocalCluster, digits_job

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"
    ),
]


def test_gpu_and_cpu_replicas_of_one_job_reproduce_under_the_referee_and_nobody_is_flagged(
    tmp_path: Path,
) -> None:
    from gpuflex.hub.ops import owner_client as oc

    files = digits_job(
        tmp_path / "job",
        rounds=2,
        local_epochs=2,
        replication=1.0,
        extra_toml="spot_check = 1.0\nreplica_wait_s = 120.0\nstate_wait_s = 60.0\n",
    )
    # with dropout: a GPU node's masks must be the ones the CPU referee draws (protocol/dropout.py)
    spec = files.spec.read_text()
    files.spec.write_text(spec.replace('activation = "relu"', 'activation = "relu"\ndropout = 0.2'))
    with LocalCluster(
        workdir=tmp_path, hub_args=("--long-poll-max", "2", "--min-deadline", "4")
    ) as cluster:
        cluster.start_hub()
        cpu = cluster.start_node("cpu")
        gpu = cluster.start_node("gpu", extra=("--device", "cuda"))
        gpu32 = cluster.start_node("gpu32", extra=("--device", "cuda", "--precisions", "fp32"))
        tf32 = cluster.start_node("tf32", extra=("--device", "cuda", "--precisions", "tf32"))
        cluster.wait_registered()
        owner = cluster.create_token("owner", "alice")
        auditor = cluster.create_token("auditor", "audrey")
        job = str(
            asyncio.run(oc.submit_job(cluster.url, owner, files.spec, files.train, files.val))["id"]
        )
        status = cluster.wait_job(job, owner, timeout_s=300)
        assert status["state"] == "done", status
        flags = cluster.get_json(f"/v1/flags?job={job}", auditor)["flags"]
        reqs = cluster.rows(
            "SELECT node_id, status, reason FROM state_requests WHERE job_id = ?", job
        )
        shards = cluster.rows(
            "SELECT outcome FROM shards WHERE job_id = ? AND state = 'settled'", job
        )
        verdicts = [v for s in shards for v in (json.loads(s["outcome"]).get("referee") or [])]
        names = {
            cpu.node_id: "cpu",
            gpu.node_id: "gpu",
            gpu32.node_id: "gpu32",
            tf32.node_id: "tf32",
        }
        for v in verdicts:
            print(
                f"\nreferee: {names.get(v['node'], v['node'])} {v['precision']}: {v['outcome']} "
                f"distance {v.get('distance', '-')} (threshold {v.get('threshold', '-')}) {'' if 'distance' in v else v}"
            )
        print(
            f"\nstate requests: {len(reqs)}, by node: "
            f"{ {names[n]: sum(r['node_id'] == n for r in reqs) for n in names} }, flags: {len(flags)}"
        )
        assert flags == [], flags
        assert reqs and {r["status"] for r in reqs} == {"reproduced"}, reqs
        assert {r["node_id"] for r in reqs} & {gpu.node_id, gpu32.node_id, tf32.node_id}
        assert verdicts and all(v["outcome"] == "reproduced" for v in verdicts)
