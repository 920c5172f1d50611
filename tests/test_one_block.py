"""Nodes of one machine or behind one NAT: one address block, on a real hub over loopback with the
production defences. Replicas of a shard never go to two nodes of one block, so no replica can
come for such a node's shard: the hub must not wait `replica_wait_s` for one, the referee
re-executes the lone update instead (verified, not "unverified"), and identities of one block
gain no trust from it. Client sessions bound to 127.0.0.x all come from 127.0.0.0/24, as nodes
started without --source-address on one machine do."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import aiohttp
import pytest
import torch
from gpuflex.hub.server.appkeys import LEDGER
from gpuflex.node.checkpoints import CheckpointStore
from gpuflex.protocol.messages import (
    Ack,
    Assignment,
    NoWork,
    StateRequest,
    StateUpload,
    WorkRequest,
)
from gpuflex.protocol.signing import new_nonce, seal
from gpuflex.protocol.tensors import decode_state, encode_state

from tests.helpers import (
    RunningHub,
    SimNode,
    digits_spec,
    open_store,
    production_defences,
    sessions_from,
    start_hub,
    submit_job,
    write_digits,
)
from tests.test_hub_referee import _post_state, _train_committed

REPLICA_WAIT_S = 30.0


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)




async def _job_state(s: aiohttp.ClientSession, hub: RunningHub, job_id: str) -> dict:
    async with s.get(f"{hub.url}/v1/jobs/{job_id}", headers=hub.auth(hub.admin_token)) as r:
        return await r.json()


async def _serve(n: SimNode, store: CheckpointStore, s: aiohttp.ClientSession, hub: RunningHub, job_id: str,
                 *, craft: bool = False, timeout: float = 25.0) -> None:
    """A node's loop until the job is done: train what it is given (with checkpoint commitments)
    and hand over the states the referee asks for. ``craft``: its updates are scaled x3.5, and it
    stops after its first one has been judged."""
    give_up = time.monotonic() + timeout
    while (await _job_state(s, hub, job_id))["state"] == "running":
        assert time.monotonic() < give_up, "the job did not finish in time"
        req = WorkRequest(timestamp=time.time(), nonce=new_nonce(), wait_s=0.5, cached_chunks=())
        got = await n.open_response(await n.post("/v1/work", seal(n.key, req)), StateRequest, Assignment, NoWork)
        if isinstance(got, Assignment):
            blob, samples, loss, c = await _train_committed(n, got, store)
            if craft:
                blob = encode_state({k: v * 3.5 for k, v in decode_state(bytearray(blob)).items()})
            ack = await n.open_response(await n.upload_raw(n.update_header(got, blob, samples, loss, commitment=c),
                                                           blob), Ack)
            assert ack.ok
        elif isinstance(got, StateRequest):
            for step in got.steps:
                data = store.read(got.assignment_id, step)
                assert data is not None
                hdr = StateUpload(request_id=got.request_id, step=step, state_sha256=hashlib.sha256(data).hexdigest(), state_size=len(data), timestamp=time.time(), nonce=new_nonce())
                assert (await _post_state(n, hdr, data)).status == 200
            if craft:
                return


def _rows(hub: RunningHub, sql: str) -> list[tuple]:
    conn = open_store(hub.data_dir)
    try:
        return [tuple(r) for r in conn.execute(sql).fetchall()]
    finally:
        conn.close()


async def _run_one_block(tmp_path: Path, *, craft: bool) -> tuple[RunningHub, dict, float, list[SimNode]]:
    train, val, _ = write_digits(tmp_path / "d")
    spec = digits_spec(rounds=1, replication='"adaptive"', replica_wait_s=REPLICA_WAIT_S, spot_check=0.0)
    hub = await start_hub(tmp_path / "hub", **production_defences())
    async with sessions_from("127.0.0.1", "127.0.0.2", "127.0.0.3") as (owner, s1, s2):
        nodes = [SimNode(s1, hub.url), SimNode(s2, hub.url)]
        for n in nodes:
            await n.register()
        r = await submit_job(owner, hub, spec, train, val)
        assert r.status == 201, await r.text()
        job_id = (await r.json())["id"]
        started = time.monotonic()
        await asyncio.gather(*(_serve(n, CheckpointStore(tmp_path / f"states{i}"), owner, hub, job_id,
                                      craft=craft and i == 1) for i, n in enumerate(nodes)))
        took = time.monotonic() - started
        doc = await _job_state(owner, hub, job_id)
    return hub, doc, took, nodes


async def test_nodes_of_one_block_do_not_wait_for_a_replica_the_referee_verifies_their_updates(tmp_path):
    hub, doc, took, nodes = await _run_one_block(tmp_path, craft=False)
    try:
        assert doc["state"] == "done"
        assert took < REPLICA_WAIT_S / 2, f"the round waited {took:.1f} s for a replica that could not come"
        (h,) = doc["history"]
        assert h["unverified"] == {}, "each lone update was re-executed by the referee: verified"
        assert h["flags"] == []  # an honest node is never flagged
        assert {u["status"] for u in h["updates"]} == {"included"}
        requests = _rows(hub, "SELECT status, reason FROM state_requests")
        assert requests and set(requests) == {("reproduced", "no_replica_holder")}
        assert len(requests) == len(h["updates"])
        # the referee stood in for a replica of another block: no trust from it
        scheduler = hub.app[LEDGER].scheduler
        assert [scheduler.nodes[n.node_id].reputation.agreements_total for n in nodes] == [0, 0]
    finally:
        await hub.stop()


async def test_a_crafted_update_from_one_block_meets_the_referee_at_once(tmp_path):
    """A Sybil's identities in one block: its crafted lone update is re-executed before it counts
    (not accepted unverified after the replica wait), flagged and left out; the chunks are
    trained again by the honest node."""
    hub, doc, took, nodes = await _run_one_block(tmp_path, craft=True)
    try:
        assert doc["state"] == "done" and took < REPLICA_WAIT_S / 2
        (h,) = doc["history"]
        assert h["unverified"] == {}
        assert [(f["reason"], f["node_id"]) for f in h["flags"]] == [("referee_mismatch", nodes[1].node_id)]
        statuses = {(u["node_id"], u["status"]) for u in h["updates"]}
        assert (nodes[1].node_id, "quarantined") in statuses
        assert {s for n, s in statuses if n == nodes[0].node_id} == {"included"}
    finally:
        await hub.stop()


async def test_a_node_registering_again_from_another_block_is_recorded_there_across_a_restart(tmp_path):
    """Two nodes started on one machine share 127.0.0.0/24; one is restarted with
    --source-address 127.0.9.1 (it registers again, same key). Its recorded block is the new one,
    in memory and in the store (a restarted hub keeps it), so it may now hold the other's replica."""
    train, val, _ = write_digits(tmp_path / "d")
    spec = digits_spec(rounds=1, replication='"adaptive"', replica_wait_s=REPLICA_WAIT_S)
    hub = await start_hub(tmp_path / "hub", **production_defences())
    tokens = {"owner": hub.owner_token, "auditor": hub.auditor_token, "admin": hub.admin_token}
    async with sessions_from("127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.9.1") as (owner, s1, s2, moved):
        a, b = SimNode(s1, hub.url), SimNode(s2, hub.url)
        for n in (a, b):
            await n.register()
        b = SimNode(moved, hub.url, key=b.key)
        await b.register()

        async def blocks(h: RunningHub) -> dict[str, tuple[str, str]]:
            async with owner.get(h.url + "/v1/nodes", headers=h.auth(h.auditor_token)) as r:
                return {n["id"]: (n["address_block"], n["last_block"]) for n in (await r.json())["nodes"]}

        assert (await blocks(hub))[b.node_id] == ("127.0.9.0/24", "127.0.9.0/24")
        await hub.stop()
        hub = await start_hub(tmp_path / "hub", tokens=tokens, **production_defences())
        try:
            assert (await blocks(hub))[b.node_id] == ("127.0.9.0/24", "127.0.9.0/24")
            assert hub.app[LEDGER].scheduler.nodes[b.node_id].blocks == {"127.0.9.0/24"}
            a.url = b.url = hub.url
            r = await submit_job(owner, hub, spec, train, val)
            assert r.status == 201, await r.text()
            first = await a.work(2.0)
            assert isinstance(first, Assignment) and hub.replica_group(first.assignment_id)
            replica = await b.work(2.0)
            assert isinstance(replica, Assignment), "the re-addressed node may hold the replica now"
            assert hub.replica_group(replica.assignment_id) == hub.replica_group(first.assignment_id)
        finally:
            await hub.stop()


async def test_job_status_and_the_console_say_why_a_round_waits_and_how_to_fix_it(tmp_path, capsys, monkeypatch):
    """While the referee waits for the states of a lone update no replica can come for, the status
    document, `gpuflex-hub job status` and the console's job page give the same sentence: what it
    waits for, why no replica can come (the block the nodes share) and what to do about it."""
    import html

    from gpuflex.hub.ops.cli import main

    from tests.test_console_helpers import Browserish

    train, val, _ = write_digits(tmp_path / "d")
    spec = digits_spec(rounds=1, replication='"adaptive"', replica_wait_s=REPLICA_WAIT_S, spot_check=0.0)
    hub = await start_hub(tmp_path / "hub", **production_defences())
    browser = Browserish(hub.url)
    try:
        async with sessions_from("127.0.0.1", "127.0.0.2", "127.0.0.3") as (owner, s1, s2):
            a, b = SimNode(s1, hub.url), SimNode(s2, hub.url)
            for n in (a, b):
                await n.register()
            r = await submit_job(owner, hub, spec, train, val)
            job_id = (await r.json())["id"]
            got = await a.work(2.0)
            assert isinstance(got, Assignment)
            blob, samples, loss, c = await _train_committed(a, got, CheckpointStore(tmp_path / "states"))
            assert (await a.upload_raw(a.update_header(got, blob, samples, loss, commitment=c), blob)).status == 200
            give_up = time.monotonic() + 10
            while not (doc := await _job_state(owner, hub, job_id)).get("waiting"):
                assert time.monotonic() < give_up, doc
                await asyncio.sleep(0.1)
        (why,) = doc["waiting"]
        assert why.startswith("shard ") and " waits for the referee, which re-executes a segment of " in why
        assert f"every other online node shares 127.0.0.0/24 with node {a.node_id[:12]}" in why
        assert "--source-address" in why and "the referee re-executes a segment of such an update" in why
        monkeypatch.setenv("COLUMNS", "1000")
        rc = await asyncio.to_thread(main, ["job", "status", job_id, "--hub", hub.url, "--token", hub.owner_token])
        assert rc == 0
        assert f"waiting: {why}" in " ".join(capsys.readouterr().out.split())
        await browser.login(hub.owner_token)
        status, page, _ = await browser.get(f"/console/jobs/{job_id}")
        assert status == 200 and why in " ".join(html.unescape(page).split())
    finally:
        await browser.close()
        await hub.stop()


async def test_job_status_says_what_else_a_round_waits_for(tmp_path):
    """The other waits, in the same words everywhere: chunks with no node online, a replica an
    online node of another block may still take (with the time left), a replica in training."""
    train, val, _ = write_digits(tmp_path / "d")
    spec = digits_spec(rounds=1, replication='"adaptive"', replica_wait_s=REPLICA_WAIT_S)
    hub = await start_hub(tmp_path / "hub", **production_defences())
    try:
        async with sessions_from("127.0.0.1", "127.0.0.2", "127.0.5.1") as (owner, s1, s2):
            r = await submit_job(owner, hub, spec, train, val)
            job_id = (await r.json())["id"]
            (alone,) = (await _job_state(owner, hub, job_id))["waiting"]
            assert alone.endswith(" chunks wait for a node: no node is online")
            a, c = SimNode(s1, hub.url), SimNode(s2, hub.url)
            for n in (a, c):
                await n.register()
            got = await a.work(2.0)
            assert isinstance(got, Assignment)
            await a.upload(got, *(await a.train(got)))
            (why,) = (await _job_state(owner, hub, job_id))["waiting"]
            assert why.startswith("shard ") and " waits up to " in why
            assert why.endswith(" s more for a replica: an online node may take it when it next asks for work")
            assert int(why.split(" waits up to ")[1].split()[0]) in range(int(REPLICA_WAIT_S) - 10, int(REPLICA_WAIT_S) + 1)
            replica = await c.work(2.0)
            assert isinstance(replica, Assignment)
            assert hub.replica_group(replica.assignment_id) == hub.replica_group(got.assignment_id)
            (why,) = (await _job_state(owner, hub, job_id))["waiting"]
            assert why.endswith(f" waits for its replica from node {c.node_id[:12]}, who is training it")
    finally:
        await hub.stop()
