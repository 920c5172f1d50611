"""A node on a home line (issue 17): a real hub process and a real node process in its own
network namespace, behind a veth pair shaped to 20 Mbit/s up and 100 Mbit/s down
(tests/tooling/netshape.py). The job sends int8 updates with error feedback; the round's traffic
the hub reports is what crossed that line. bench/bandwidth.py measures the same set-up's times."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from tests.tooling import netshape
from tests.tooling.cluster import LocalCluster, digits_job

WHY = netshape.unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"network namespaces: {WHY}")


def test_a_node_behind_a_shaped_home_line_trains_an_int8_job(tmp_path: Path) -> None:
    from gpuflex.hub import owner_client as oc

    with netshape.HomeLines(1, up_mbit=20, down_mbit=100) as lines, \
            LocalCluster(workdir=tmp_path, hub_args=("--long-poll-max", "2"), hub_host="0.0.0.0") as cluster:
        line = lines[0]
        # the line is real and shaped: the node's side reaches the hub's address through it
        qdisc = subprocess.run([*line.prefix(), "tc", "qdisc", "show"], capture_output=True, text=True, check=True)
        assert "tbf" in qdisc.stdout and "20Mbit" in qdisc.stdout, qdisc.stdout
        cluster.start_hub()
        token = cluster.create_token("owner", "alice")
        files = digits_job(tmp_path / "job", rounds=3, local_epochs=1, replication=0.0,
                           extra_toml='spot_check = 0.0\nspot_check_trusted = 0.0\n'
                                      '[communication]\nupdate = "int8"\nerror_feedback = true\n')
        node = cluster.start_node("home", prefix=line.prefix(), hub_url=f"http://{line.hub_ip}:{cluster.port}")
        cluster.wait_registered([node], timeout_s=120)
        job_id = str(asyncio.run(oc.submit_job(cluster.url, token, files.spec, files.train, files.val))["id"])
        status = cluster.wait_job(job_id, token, timeout_s=180)
        assert status["state"] == "done", status
        hist = status["history"]
        for h in hist:
            t = h["transfer"]
            assert t["updates"] >= 1 and t["compression_ratio"] > 3.5, t  # int8: about 4x under fp32
            assert t["bytes_down"] is not None and t["bytes_down"] > 0
        uploaded = [e for e in node.events() if e.get("event") == "uploaded"]
        assert uploaded and all(e["ok"] for e in uploaded)
        assert (node.data_dir / "feedback" / f"{job_id}.gft").is_file()
