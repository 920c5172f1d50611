"""`gpuflex-hub serve --workers N` on PostgreSQL (hub/server/workers.py, hub/storage/lease.py): real processes.

The supervisor, its workers and a real node process run as users run them, on a PostgreSQL
server the tests start (tests/conftest.py's `postgres_server`). kill -9 of the leading worker
mid-round loses no acknowledged update and changes no byte of the final model; a request the
old leader took is refused by the new one; kill -9 of a forwarding worker leaves the job to
the others; a second hub on a led database, and --workers on SQLite, are refused in one line.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from gpuflex.hub.ops.localcluster import digits_job
from gpuflex.hub.storage.token_admin import create_token
from gpuflex.protocol.signing import seal

from tests.helpers import SimNode, start_hub
from tests.test_e2e_journey import NO_REFEREE, _audit_entries, _submit, _tensors_digest, _wait_event
from tests.tooling.cluster import LocalCluster


@pytest.fixture(scope="module")
def bench_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One machine benchmark shared by every node of this module."""
    return tmp_path_factory.mktemp("bench") / "bench.json"


WORKER_LINE = re.compile(r"gpuflex-hub worker (\d+) \(pid (\d+)\): (leading|forwarding)")


def _workers(cluster: LocalCluster) -> list[tuple[int, int, str]]:
    """(index, pid, role) for every worker line the supervisor's log holds, in order."""
    assert cluster.hub is not None
    return [(int(i), int(pid), role) for i, pid, role in WORKER_LINE.findall(cluster.hub.log.read_text())]


def _wait(what: str, ok, timeout_s: float = 60.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        got = ok()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _run(tmp_path: Path, bench_cache: Path, url: str, *, kill_leader_in_round: int | None):
    """One node, one shard per round (deterministic end to end), on a 2-worker hub."""
    with LocalCluster(workdir=tmp_path, shared_bench_cache=bench_cache, hub_args=(
            "--store", url, "--workers", "2", "--long-poll-max", "2", "--min-deadline", "60",
            "--unproven-max-chunks", "0")) as cluster:
        cluster.start_hub()
        leader = _wait("a leader", lambda: [w for w in _workers(cluster) if w[2] == "leading"])[0]
        _wait("the other worker", lambda: len(_workers(cluster)) >= 2)
        token = create_token(cluster.hub_dir, "owner", "alice", store=url)
        files = digits_job(tmp_path / "job", rounds=3, local_epochs=8, replication=0.0, round_target_s=86400.0,
                           extra_toml=NO_REFEREE)
        if kill_leader_in_round is None:
            node = cluster.start_node("solo")
        else:  # the killed round's assignment waits 4 s before training: the kill lands while the node holds it
            node = cluster.start_node("solo", attack="stall",
                                      extra=("--stall-after", str(kill_leader_in_round), "--stall-s", "4"))
        job_id = _submit(cluster, token, files.spec, files.train, files.val)
        if kill_leader_in_round is not None:
            held = _wait_event(node, "assignment", timeout_s=120, round=kill_leader_in_round)
            os.kill(leader[1], signal.SIGKILL)
            killed_at = time.time()
            # another worker leads (the one that was forwarding), the supervisor starts a new one
            new = _wait("a new leader", lambda: [w for w in _workers(cluster) if w[2] == "leading" and w[1] != leader[1]])
            assert new[0][0] != leader[0], new
            log = cluster.hub.log.read_text()  # type: ignore[union-attr]
            _wait("the restart", lambda: f"worker {leader[0]} (pid {leader[1]}) ended with status -9; starting it again"
                  in cluster.hub.log.read_text())  # type: ignore[union-attr]
            assert "Traceback" not in log, log
        status = cluster.wait_job(job_id, token, timeout_s=240)
        assert status["state"] == "done", status
        if kill_leader_in_round is not None:
            done = _wait_event(node, "uploaded", timeout_s=5, assignment_id=held["assignment_id"])
            assert done["ok"] and done["ts"] > killed_at, (done, killed_at)
        model = cluster.get_bytes(f"/v1/jobs/{job_id}/model", token)
        acked = [e["update_sha256"] for e in node.events() if e.get("event") == "uploaded" and e.get("ok")]
        included = [sha for e in _audit_entries(cluster) if e["kind"] == "aggregation" for sha in e["body"]["included"]]
        return model, acked, included


def _registered(url: str) -> tuple[SimNode, bytes]:
    """A registration the current leader accepts; the caller replays its exact bytes later."""
    import asyncio

    async def go() -> tuple[SimNode, bytes]:
        async with aiohttp.ClientSession() as s:
            n = SimNode(s, url)
            async with s.get(url + "/v1/hub") as r:
                n.hub_public = bytes.fromhex((await r.json())["public_key"])
            body = seal(n.key, n.hello())
            resp = await n.post("/v1/nodes/register", body)
            assert resp.status == 200, await resp.text()
            return n, body

    return asyncio.run(go())


def _replay(url: str, body: bytes) -> tuple[int, dict]:
    import asyncio

    async def go() -> tuple[int, dict]:
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/nodes/register", data=body,
                                                        headers={"Content-Type": "application/x-msgpack"}) as r:
            return r.status, await r.json(content_type=None)

    return asyncio.run(go())


def test_kill_9_of_the_leading_worker_mid_round_loses_nothing_and_changes_no_byte(
        tmp_path: Path, bench_cache: Path, postgres_server) -> None:
    clean_model, clean_acked, clean_included = _run(tmp_path / "clean", bench_cache, postgres_server.new_database(),
                                                    kill_leader_in_round=None)
    model, acked, included = _run(tmp_path / "killed", bench_cache, postgres_server.new_database(),
                                  kill_leader_in_round=1)
    assert set(acked) <= set(included), "an acknowledged update is missing from the aggregates"
    assert included == clean_included, "the accepted update set differs from the uninterrupted run"
    assert _tensors_digest(model) == _tensors_digest(clean_model)  # the files name their own job and hub
    assert len(set(clean_acked)) == 3


def test_a_request_taken_by_the_old_leader_is_refused_by_the_new_one_and_a_dead_forwarder_is_replaced(
        tmp_path: Path, bench_cache: Path, postgres_url: str) -> None:
    with LocalCluster(workdir=tmp_path, shared_bench_cache=bench_cache, hub_args=(
            "--store", postgres_url, "--workers", "2", "--long-poll-max", "2")) as cluster:
        cluster.start_hub()
        leader = _wait("a leader", lambda: [w for w in _workers(cluster) if w[2] == "leading"])[0]
        other = _wait("the forwarder", lambda: [w for w in _workers(cluster) if w[2] == "forwarding"])[0]
        _, body = _registered(cluster.url)
        # the same bytes again, over fresh connections (either worker may take each): a replay, refused
        for _ in range(6):
            status, err = _replay(cluster.url, body)
            assert status == 409 and err["error"] == "replay", (status, err)
        os.kill(leader[1], signal.SIGKILL)
        _wait("a new leader", lambda: [w for w in _workers(cluster) if w[2] == "leading" and w[1] != leader[1]])

        def answered():  # type: ignore[no-untyped-def]
            status, err = _replay(cluster.url, body)
            return (status, err) if status != 503 else None

        status, err = _wait("the new leader's answer", answered)
        assert status == 409 and err["error"] == "replay" and "before this hub started" in err["detail"], err
        # kill -9 of a forwarding worker (the restarted old leader's index): the supervisor replaces it
        restarted = _wait("the restarted worker", lambda: [w for w in _workers(cluster)
                                                          if w[0] == leader[0] and w[1] != leader[1]])[0]
        assert restarted[2] == "forwarding" and other[0] != leader[0]
        os.kill(restarted[1], signal.SIGKILL)
        _wait("its replacement", lambda: [w for w in _workers(cluster) if w[0] == leader[0]
                                          and w[1] not in (leader[1], restarted[1])])
        token = create_token(cluster.hub_dir, "owner", "bob", store=postgres_url)
        assert cluster.get_json("/v1/jobs", token) == {"jobs": []}


async def test_a_second_hub_on_a_led_database_is_refused_in_one_line(tmp_path: Path, postgres_url: str) -> None:
    from gpuflex.hub.storage.lease import DatabaseBusy

    hub = await start_hub(tmp_path / "one", store=postgres_url)
    try:
        with pytest.raises(DatabaseBusy) as got:
            await start_hub(tmp_path / "two", store=postgres_url)
        assert "is led by another hub (gpuflex-hub (pid" in str(got.value) and "\n" not in str(got.value)
    finally:
        await hub.stop()
    again = await start_hub(tmp_path / "two", store=postgres_url)  # the lease went with the first hub
    await again.stop()


def test_workers_on_sqlite_are_refused_before_anything_starts(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "gpuflex.hub", "serve", "--data", str(tmp_path / "hub"),
                           "--port", "0", "--workers", "2"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.startswith("error: --workers N needs --store postgresql://")
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "hub").exists()


async def test_the_forwarded_client_address_is_believed_on_the_leader_socket_only(tmp_path: Path) -> None:
    """hub/server/app.py's forwarded_peer: X-GPUFlex-Peer over TCP is the client's own claim and ignored;
    on the leader's Unix socket (where only the hub's workers connect) it is the client's address."""
    from aiohttp import web
    from gpuflex.hub.server.appkeys import LEDGER
    from gpuflex.hub.server.workers import PEER_HEADER

    hub = await start_hub(tmp_path / "hub")
    sock = tmp_path / "leader.sock"
    await web.UnixSite(hub.runner, str(sock)).start()
    try:
        async with aiohttp.ClientSession() as s:  # over TCP: the claim changes nothing
            n = SimNode(s, hub.url)
            async with s.get(hub.url + "/v1/hub") as r:
                n.hub_public = bytes.fromhex((await r.json())["public_key"])
            async with s.post(hub.url + "/v1/nodes/register", data=seal(n.key, n.hello()),
                              headers={"Content-Type": "application/x-msgpack", PEER_HEADER: "10.9.8.7"}) as r:
                assert r.status == 200, await r.text()
        assert hub.app[LEDGER].scheduler.nodes[n.node_id].block.startswith("127.0.0.")
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock))) as s:
            m = SimNode(s, "http://leader")
            m.hub_public = n.hub_public
            async with s.post("http://leader/v1/nodes/register", data=seal(m.key, m.hello()),
                              headers={"Content-Type": "application/x-msgpack", PEER_HEADER: "10.9.8.7"}) as r:
                assert r.status == 200, await r.text()
        assert hub.app[LEDGER].scheduler.nodes[m.node_id].block == "10.9.8.0/24"
    finally:
        await hub.stop()
