"""Rollback (hub/policy/rollback.py) on a real hub over loopback, a real SQLite store and real
training: a forger's updates are aggregated unverified, it is suspended and then banned, the job
status lists the rounds its unverified work went into, and `gpuflex-hub job rollback` restores
the kept model of the round before its first one and continues the job, across a kill -9.

The forger F trains honestly with checkpoint commitments. Round 0: it is the only node, so the
referee stands in for the replica and reproduces one segment of its update (verified, but a
rollback counts it unverified: the replay proved that segment, not the update). Rounds 1 and 2: a
second node H takes each replica and never delivers, so F's update settles unverified when the
replica wait runs out. Round 3: H is offline, F uploads a crafted update (x3.5) over an honest
commitment, the referee stands in again, it does not reproduce: F is suspended.

In the first test, round 0 is instead a group of three: F and two partners whose replicas agree
with F's update. It counts as verified until the partners are caught too; then a rollback before
F undoes it as well."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import safetensors.torch
import torch
from gpuflex.hub.ops import cli
from gpuflex.hub.policy import rollback
from gpuflex.node.checkpoints import CheckpointStore
from gpuflex.protocol.messages import Ack, Assignment, StateRequest, StateUpload, WorkRequest
from gpuflex.protocol.signing import new_nonce, seal
from gpuflex.protocol.tensors import decode_state, encode_state

from tests.helpers import (
    RELAXED_SERVE_ARGS,
    RunningHub,
    SimNode,
    open_store,
    start_hub,
    store_args,
    submit_job,
    write_digits,
)
from tests.test_hub_referee import _post_state
from tests.test_hub_referee import _train_committed as _train
from tests.test_suspension import _flags, _poll, _verdict

#: one chunk a round (one shard), a short replica wait, no trend audit and no spot checks: F's
#: updates are verified only where the referee stands in for a replica that cannot come
SPEC = dict(rounds=6, chunk_size=2000, replication='"adaptive"', replica_wait_s=0.5)
EXTRA = "trend_rounds = 0\nkeep_rounds = 3\n"
HUB = {"online_window_s": 1.5}


async def _hand_states(n: SimNode, store: CheckpointStore) -> None:
    """Answer the referee's state request for ``n``'s last update."""
    deadline = time.monotonic() + 30
    while not isinstance(asked := await _poll(n), StateRequest):
        assert time.monotonic() < deadline, "the referee never asked for states"
    for step in asked.steps:
        data = store.read(asked.assignment_id, step)
        assert data is not None
        hdr = StateUpload(request_id=asked.request_id, step=step, state_sha256=hashlib.sha256(data).hexdigest(),
                          state_size=len(data), timestamp=time.time(), nonce=new_nonce())
        assert (await _post_state(n, hdr, data)).status == 200


async def _upload(n: SimNode, a: Assignment, store: CheckpointStore, scale: float = 1.0) -> None:
    blob, samples, loss, c = await _train(n, a, store)
    if scale != 1.0:
        blob = encode_state({k: v * scale for k, v in decode_state(bytearray(blob)).items()})
    ack = await n.open_response(await n.upload_raw(n.update_header(a, blob, samples, loss, commitment=c), blob), Ack)
    assert ack.ok


async def _job(s: aiohttp.ClientSession, hub: RunningHub, job_id: str) -> dict[str, Any]:
    async with s.get(f"{hub.url}/v1/jobs/{job_id}", headers=hub.auth()) as r:
        assert r.status == 200, await r.text()
        return dict(await r.json())


async def _round_closes(s: aiohttp.ClientSession, hub: RunningHub, job_id: str, round_: int) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while (doc := await _job(s, hub, job_id))["round"] <= round_:
        assert time.monotonic() < deadline, f"round {round_} never closed: {doc.get('waiting')}"
        await asyncio.sleep(0.05)
    return doc


async def _forger_caught(s: aiohttp.ClientSession, hub: RunningHub, tmp_path: Path, extra: str = "",
                         partners: list[SimNode] | None = None) -> tuple[str, SimNode, SimNode]:
    """The module docstring's rounds 0-3. Returns the job id, F and H. With ``partners`` (two
    nodes, registered here): round 0 is a group of three replicas, F's update and theirs, a hair
    apart on either side of F's (so F's is the medoid, the one aggregated): all agree, and F's
    update is verified by the partners' nodes, not by the referee."""
    train, val, spec_path = write_digits(tmp_path / "d", **SPEC, extra=EXTRA + extra)
    job_id = (await (await submit_job(s, hub, spec_path, train, val)).json())["id"]
    forger, helper = SimNode(s, hub.url), SimNode(s, hub.url)
    store = CheckpointStore(tmp_path / "states")
    await forger.register()
    for p in partners or ():
        await p.register()
    a0 = await forger.work(2.0)
    assert isinstance(a0, Assignment) and a0.round == 0
    if partners:
        (j, k) = partners
        aj = await j.work(2.0)
        assert isinstance(aj, Assignment) and (aj.round, aj.seed) == (0, a0.seed)
        await _upload(forger, a0, store)
        await _upload(j, aj, store, scale=1 + 2e-5)
        ak = await k.work(2.0)  # the unanimous untrusted pair wants a third replica
        assert isinstance(ak, Assignment) and (ak.round, ak.seed) == (0, a0.seed)
        await _upload(k, ak, store, scale=1 - 2e-5)
    else:
        await _upload(forger, a0, store)
        await _hand_states(forger, store)  # the referee stands in: reproduced
    await _round_closes(s, hub, job_id, 0)
    await helper.register()
    for rnd in (1, 2):
        a = await forger.work(2.0)
        replica = await helper.work(2.0)
        assert isinstance(a, Assignment) and isinstance(replica, Assignment) and a.round == replica.round == rnd
        await _upload(forger, a, store)  # the replica never comes: unverified once the wait runs out
        await _round_closes(s, hub, job_id, rnd)
    await asyncio.sleep(HUB["online_window_s"] + 0.2)  # H is offline now (and the partners)
    a3 = await forger.work(2.0)
    assert isinstance(a3, Assignment) and a3.round == 3
    await _upload(forger, a3, store, scale=3.5)
    await _hand_states(forger, store)
    deadline = time.monotonic() + 30
    while not await _flags(s, hub):
        assert time.monotonic() < deadline, "no flag"
        await asyncio.sleep(0.05)
    return job_id, forger, helper


async def _suspend(hub: RunningHub, job_id: str, nodes: list[SimNode]) -> None:
    """Each node caught as a forger would be: an open referee_mismatch flag, through the store's own insert."""
    from gpuflex.hub.policy.update_record import Flag
    from gpuflex.hub.server.appkeys import DB
    from gpuflex.hub.storage.store_sqlite import insert_flags

    flags = [Flag(f"u-{n.node_id}", n.node_id, "referee_mismatch", {"referee": {"outcome": "mismatch"}}) for n in nodes]
    await hub.app[DB].write(lambda conn: insert_flags(conn, job_id, 0, flags, time.time()))


def _model_sha(data_dir: Path, job_id: str, version: int) -> str | None:
    conn = open_store(data_dir)
    try:
        row = conn.execute("SELECT sha FROM models WHERE job_id = ? AND version = ?", (job_id, version)).fetchone()
    finally:
        conn.close()
    return None if row is None else str(row[0])


async def test_the_status_lists_a_stopped_forgers_unverified_rounds_and_a_rollback_restores_and_continues(
        tmp_path: Path) -> None:
    hub = await start_hub(tmp_path / "hub", **HUB)
    try:
        async with aiohttp.ClientSession() as s:
            partners = [SimNode(s, hub.url), SimNode(s, hub.url)]
            job_id, forger, helper = await _forger_caught(s, hub, tmp_path, partners=partners)
            doc = await _job(s, hub, job_id)
            included = [[u for u in h["updates"] if u["status"] == "included"] for h in doc["history"]]
            assert [[u["verified"] for u in us] for us in included] == [[True], [False], [False]]
            (first,) = included[0]
            assert (first["node_id"], first["verified_by"]) == (
                forger.node_id, {"replicas": sorted(p.node_id for p in partners)})
            assert doc["unverified_work"] == [{"node_id": forger.node_id, "state": "suspended", "rounds": [1, 2],
                                               "rollback_to": 1, "kept": True, "fallback_to": None}]
            (flag,) = await _flags(s, hub)
            await _verdict(s, hub, flag["id"], "confirm")  # banned: still listed
            assert (await _job(s, hub, job_id))["unverified_work"][0]["state"] == "banned"
            # the partners that vouched for F's round-0 update are caught too: it no longer counts
            await _suspend(hub, job_id, partners)
            assert (await _job(s, hub, job_id))["unverified_work"] == [
                {"node_id": forger.node_id, "state": "banned", "rounds": [0, 1, 2], "rollback_to": 0, "kept": True,
                 "fallback_to": None}]
            text = await asyncio.to_thread(_cli_text, ["job", "status", job_id, "--hub", hub.url,
                                                       "--token", hub.owner_token])
            assert (f"unverified: {forger.node_id} (banned) had unverified updates aggregated in rounds 0, 1, 2:"
                    f" gpuflex-hub job rollback {job_id} --before-node {forger.node_id} restores round 0's model") in text
            # the refusals, each one line, nothing changed
            for body, status, code in (({"before_node": "n-nobody"}, 404, "unknown_node"),
                                       ({"to_round": 3}, 400, "bad_round"),
                                       ({"to_round": 1, "before_node": forger.node_id}, 400, "bad_rollback"),
                                       ({"to_round": "1"}, 400, "bad_round"),
                                       ({"before_node": forger.node_id, "oldest_kept": "yes"}, 400, "bad_rollback"),
                                       ({"to_round": 1, "oldest_kept": True}, 400, "bad_rollback"),
                                       ({}, 400, "bad_rollback")):
                async with s.post(f"{hub.url}/v1/jobs/{job_id}/rollback", json=body, headers=hub.auth()) as r:
                    assert (r.status, (await r.json())["error"]) == (status, code), body
            async with s.post(f"{hub.url}/v1/jobs/j-nope/rollback", json={"to_round": 0}, headers=hub.auth()) as r:
                assert (r.status, (await r.json())["error"]) == (404, "unknown_job")
            async with s.post(f"{hub.url}/v1/jobs/{job_id}/rollback", json={"to_round": 1},
                              headers=hub.auth(hub.auditor_token)) as r:
                assert r.status == 403
            assert (await _job(s, hub, job_id))["round"] == 3
    finally:
        await hub.stop()

    # the same data on `gpuflex-hub serve`: the owner rolls back from the command line, the hub is
    # killed with -9 right after the answer, and the rollback is there when it comes back
    tokens = (hub.owner_token, hub.url)
    kept = _model_sha(hub.data_dir, job_id, 0)
    assert kept is not None
    proc, url = _serve(hub.data_dir)
    try:
        out = await asyncio.to_thread(_cli, ["job", "rollback", job_id, "--before-node", forger.node_id, "--json",
                                             "--hub", url, "--token", tokens[0]])
        proc.kill()
        proc.wait(timeout=30)
        assert out == {"job_id": job_id, "restored_round": 0, "round": 4, "rounds": 10, "rolled_back": [0, 1, 2, 3],
                       "model_hash": kept, "before_node": forger.node_id, "partial": False,
                       "unverified_left": [], "by": "alice"}
    finally:
        proc.kill()
        proc.wait(timeout=30)
    proc, url = _serve(hub.data_dir, url.rsplit(":", 1)[1])
    try:
        await _after_restart(url, tokens[0], job_id, (forger, helper), kept, hub.data_dir)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


async def _after_restart(url: str, owner: str, job_id: str, nodes: tuple[SimNode, SimNode], kept: str,
                         data_dir: Path) -> None:
    forger, node = nodes
    auth = {"Authorization": f"Bearer {owner}"}
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v1/jobs/{job_id}", headers=auth) as r:
            doc = await r.json()
        assert (doc["state"], doc["round"], doc["rounds"], doc["model_hash"]) == ("running", 4, 10, kept)
        assert [(h["round"], h["rolled_back"]) for h in doc["history"]] == [
            (0, True), (1, True), (2, True), (3, True)]
        assert doc["unverified_work"] == []  # nothing of F's is in the model any more
        # the model, bit for bit: the current one is round 0's kept model (the initial one)
        async with s.get(f"{url}/v1/jobs/{job_id}/model", headers=auth) as r:
            now = await r.read()
        async with s.get(f"{url}/v1/jobs/{job_id}/model?round=0", headers=auth) as r:
            then = await r.read()
        now_t, then_t = safetensors.torch.load(now), safetensors.torch.load(then)  # (their metadata name the round)
        assert now_t.keys() == then_t.keys()
        assert all(now_t[k].dtype == then_t[k].dtype and torch.equal(now_t[k], then_t[k]) for k in now_t)
        # training continues from it (H: the banned forger's address block cools down, no new node joins)
        node.session, node.url = s, url
        a = await node.work(3.0)
        assert isinstance(a, Assignment) and a.round == 4 and a.model_hash == kept
        await _upload(node, a, CheckpointStore(data_dir.parent / "states-g"))
        forger.session, forger.url = s, url
        r = await forger.post("/v1/work", seal(forger.key, WorkRequest(timestamp=time.time(), nonce=new_nonce(),
                                                                         wait_s=0.0, cached_chunks=())))
        assert r.status == 403 and (await r.json())["error"] == "banned"
    lines = [json.loads(x) for x in (data_dir / "audit.jsonl").read_text().splitlines() if x]
    (entry,) = [e["body"] for e in lines if e["kind"] == "rollback"]
    assert (entry["restored_round"], entry["before_node"], entry["by"]) == (0, forger.node_id, "alice")


async def test_the_owners_console_button_rolls_back_before_the_stopped_node(tmp_path: Path) -> None:
    """The job page lists the suspended forger's unverified rounds with a button; the owner's
    post rolls the job back (as the API does); an auditor sees the list and no button."""
    from tests.test_console_helpers import Browserish

    hub = await start_hub(tmp_path / "hub", **HUB)
    try:
        async with aiohttp.ClientSession() as s:
            job_id, forger, _ = await _forger_caught(s, hub, tmp_path)
            auditor = Browserish(hub.url)
            try:
                await auditor.login(hub.auditor_token)
                status, html, _ = await auditor.get(f"/console/jobs/{job_id}")
                assert status == 200 and "Unverified work of stopped nodes" in html and "Roll back to" not in html
                status, _, _ = await auditor.post(f"/console/jobs/{job_id}/rollback",
                                                  {"csrf_token": auditor.csrf_in(html), "before_node": forger.node_id})
                assert status == 403
            finally:
                await auditor.close()
            owner = Browserish(hub.url)
            try:
                await owner.login(hub.owner_token)
                status, html, _ = await owner.get(f"/console/jobs/{job_id}")
                assert status == 200 and "Roll back to round 0" in html
                status, _, r = await owner.post(f"/console/jobs/{job_id}/rollback",
                                                {"csrf_token": owner.csrf_in(html), "before_node": forger.node_id})
                assert status == 303 and r.headers["Location"] == f"/console/jobs/{job_id}"
                status, html, _ = await owner.get(f"/console/jobs/{job_id}")
                assert "rolled back" in html and "Roll back to" not in html
            finally:
                await owner.close()
            doc = await _job(s, hub, job_id)
            assert (doc["round"], doc["model_hash"]) == (4, _model_sha(hub.data_dir, job_id, 0))
    finally:
        await hub.stop()


async def test_a_job_that_opts_in_rolls_itself_back_when_the_forger_is_suspended(tmp_path: Path) -> None:
    hub = await start_hub(tmp_path / "hub", **HUB)
    try:
        async with aiohttp.ClientSession() as s:
            job_id, forger, _ = await _forger_caught(s, hub, tmp_path, extra="auto_rollback = true\n")
            deadline = time.monotonic() + 30
            while (doc := await _job(s, hub, job_id))["round"] != 4:
                assert time.monotonic() < deadline, doc["round"]
                await asyncio.sleep(0.05)
            assert (doc["rounds"], doc["model_hash"], doc["unverified_work"]) == (
                10, _model_sha(hub.data_dir, job_id, 0), [])
            assert [h["rolled_back"] for h in doc["history"]] == [True, True, True, True]
        lines = [json.loads(x) for x in (hub.data_dir / "audit.jsonl").read_text().splitlines() if x]
        (entry,) = [e["body"] for e in lines if e["kind"] == "rollback"]
        assert (entry["before_node"], entry["by"]) == (forger.node_id, "hub (auto_rollback)")
    finally:
        await hub.stop()


async def _lone_rounds(s: aiohttp.ClientSession, hub: RunningHub, job_id: str,
                       trainers: list[SimNode]) -> dict[str, Any]:
    """Rounds 0, 1, ..., one lone (unverified) update each, trained by ``trainers[r]``."""
    for n in dict.fromkeys(trainers):
        await n.register()
    for rnd, who in enumerate(trainers):
        a = await who.work(2.0)
        assert isinstance(a, Assignment) and a.round == rnd
        await who.upload(a, *await who.train(a))
        doc = await _round_closes(s, hub, job_id, rnd)
    return doc


async def test_a_job_that_opts_in_falls_back_to_the_oldest_kept_model_when_the_one_before_the_forger_is_gone(
        tmp_path: Path) -> None:
    """A running job that opted in to auto_rollback, keep_rounds = 3, lone (unverified) updates:
    A trains round 0, X round 1, B rounds 2-4. X and B are banned while round 5 is open; when A's
    round-5 update closes it (versions 0, 4, 5, 6 kept), the hub looks at X first (its round 1 is
    before every kept model but the initial one: nothing of it can be undone), then at B: it rolls
    back to the oldest kept model, round 4's, by itself, and says B's rounds 2 and 3 stay."""
    train, val, spec_path = write_digits(tmp_path / "d", rounds=8, chunk_size=2000,
                                         extra=EXTRA + "auto_rollback = true\n")
    hub = await start_hub(tmp_path / "hub")
    try:
        async with aiohttp.ClientSession() as s:
            job_id = (await (await submit_job(s, hub, spec_path, train, val)).json())["id"]
            first, early, node = SimNode(s, hub.url), SimNode(s, hub.url), SimNode(s, hub.url)
            await _lone_rounds(s, hub, job_id, [first, early, node, node, node])
            await _suspend(hub, job_id, [early, node])
            for flag in await _flags(s, hub):
                await _verdict(s, hub, flag["id"], "confirm")  # banned
            a = await first.work(2.0)
            assert isinstance(a, Assignment) and a.round == 5
            await first.upload(a, *await first.train(a))
            deadline = time.monotonic() + 10
            while (doc := await _job(s, hub, job_id))["round"] != 7:
                assert time.monotonic() < deadline, doc["round"]
                await asyncio.sleep(0.05)
            assert (doc["rounds"], doc["model_hash"]) == (11, doc["history"][3]["model_hash"])
            assert [h["rolled_back"] for h in doc["history"]] == [False] * 4 + [True] * 3  # (6: abandoned open)
            assert [(w["node_id"], w["rounds"], w["fallback_to"]) for w in doc["unverified_work"]] == [
                (early.node_id, [1], None), (node.node_id, [2, 3], None)]
        lines = [json.loads(x) for x in (hub.data_dir / "audit.jsonl").read_text().splitlines() if x]
        (entry,) = [e["body"] for e in lines if e["kind"] == "rollback"]
        assert (entry["restored_round"], entry["rolled_back"], entry["partial"], entry["unverified_left"],
                entry["before_node"], entry["by"]) == (4, [4, 5, 6], True, [2, 3], node.node_id,
                                                       "hub (auto_rollback)")
    finally:
        await hub.stop()


async def test_models_older_than_keep_rounds_leave_the_store_and_a_rollback_falls_back_to_the_oldest_kept(
        tmp_path: Path) -> None:
    """Node A trains round 0, node B rounds 1-4 (lone updates: unverified); keep_rounds = 3 keeps
    versions 0, 3, 4, 5. B is suspended: the model before its first round (version 1) is gone, so a
    rollback before B is refused unless it asks for the oldest kept model, which undoes rounds 3
    and 4 and says rounds 1 and 2 stay in the model."""
    from gpuflex.hub.server.appkeys import BLOBS

    from tests.test_console_helpers import Browserish

    train, val, spec_path = write_digits(tmp_path / "d", rounds=5, chunk_size=2000, extra=EXTRA)
    hub = await start_hub(tmp_path / "hub")
    try:
        async with aiohttp.ClientSession() as s:
            job_id = (await (await submit_job(s, hub, spec_path, train, val)).json())["id"]
            first, node = SimNode(s, hub.url), SimNode(s, hub.url)
            doc = await _lone_rounds(s, hub, job_id, [first, node, node, node, node])
            assert doc["state"] == "done"
            made = [h["model_hash"] for h in doc["history"]]  # versions 1..5
            assert len(set(made)) == 5
            conn = open_store(hub.data_dir)
            try:
                kept = sorted(r[0] for r in conn.execute("SELECT version FROM models WHERE job_id = ?", (job_id,)))
            finally:
                conn.close()
            assert kept == [0, 3, 4, 5]
            blobs = hub.app[BLOBS]
            assert [blobs.has(sha) for sha in made] == [False, False, True, True, True]
            async with s.post(f"{hub.url}/v1/jobs/{job_id}/rollback", json={"to_round": 2}, headers=hub.auth()) as r:
                assert (r.status, (await r.json())["error"]) == (409, "round_not_kept")
            await _suspend(hub, job_id, [node])
            async with s.post(f"{hub.url}/v1/jobs/{job_id}/rollback", json={"before_node": node.node_id},
                              headers=hub.auth()) as r:
                refused = await r.json()
            assert (r.status, refused["error"]) == (409, "round_not_kept")
            assert "--or-oldest-kept" in refused["detail"] and "rounds 1, 2 in the model" in refused["detail"]
            doc = await _job(s, hub, job_id)
            assert (doc["state"], doc["unverified_work"]) == ("done", [  # nothing changed
                {"node_id": node.node_id, "state": "suspended", "rounds": [1, 2, 3, 4], "rollback_to": 1,
                 "kept": False, "fallback_to": 3}])
            text = await asyncio.to_thread(_cli_text, ["job", "status", job_id, "--hub", hub.url,
                                                       "--token", hub.owner_token])
            assert (f"round 1's model is no longer kept; gpuflex-hub job rollback {job_id} --before-node"
                    f" {node.node_id} --or-oldest-kept restores round 3's, leaving rounds 1, 2 in the model") in text
            owner = Browserish(hub.url)
            try:  # the console's button says the same
                await owner.login(hub.owner_token)
                status, html, _ = await owner.get(f"/console/jobs/{job_id}")
                assert status == 200 and "Roll back to round 3 (partial: rounds 1, 2 stay)" in html
                assert 'name="oldest_kept" value="1"' in html
            finally:
                await owner.close()
            # a done job rolls back and runs again, with the rounds it lost given back: partially
            text = await asyncio.to_thread(_cli_text, ["job", "rollback", job_id, "--before-node", node.node_id,
                                                       "--or-oldest-kept", "--hub", hub.url,
                                                       "--token", hub.owner_token])
            assert f"partial: the oldest kept model; {node.node_id}'s unverified rounds 1, 2 stay in the model" in text
            doc = await _job(s, hub, job_id)
            assert (doc["state"], doc["round"], doc["rounds"], doc["model_hash"]) == ("running", 5, 7, made[2])
            assert [h["rolled_back"] for h in doc["history"]] == [False, False, False, True, True]
            assert doc["unverified_work"][0]["rounds"] == [1, 2]  # what stays in the model is still listed
            a = await first.work(2.0)  # (B is suspended)
            assert isinstance(a, Assignment) and a.round == 5 and a.model_hash == made[2]
        lines = [json.loads(x) for x in (hub.data_dir / "audit.jsonl").read_text().splitlines() if x]
        (entry,) = [e["body"] for e in lines if e["kind"] == "rollback"]
        assert (entry["restored_round"], entry["rolled_back"], entry["partial"], entry["unverified_left"]) == (
            3, [3, 4], True, [1, 2])
    finally:
        await hub.stop()


def _serve(data_dir: Path, port: str = "0") -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "gpuflex.hub", "serve", "--data", str(data_dir), "--port", port,
                             "--long-poll-max", "2", *RELAXED_SERVE_ARGS, *store_args(data_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("gpuflex-hub listening on "):
            return proc, line.rsplit(" ", 1)[1].strip()
    proc.kill()
    raise AssertionError("the hub did not start")


def _cli(argv: list[str]) -> Any:
    """`gpuflex-hub ARGV --json` through cli.main: its JSON output."""
    return json.loads(_cli_text(argv))


def _cli_text(argv: list[str]) -> str:
    """`gpuflex-hub ARGV` through cli.main: what it printed."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(argv) == 0
    return buf.getvalue()


# -- the policy -----------------------------------------------------------------------------------


def _history(**over: Any) -> rollback.JobHistory:
    base = dict(job_id="j", state="running", round=5, rounds=10, keep_rounds=3,
                aggregated=(rollback.Aggregated(1, "u1", "a", True), rollback.Aggregated(2, "u2", "f", False),
                            rollback.Aggregated(3, "u3", "f", False), rollback.Aggregated(4, "u4", "f", True)),
                kept=frozenset({0, 2, 3, 4, 5}), rolled_back=frozenset(), stopped=frozenset({"f"}))
    return rollback.JobHistory(**(base | over))  # type: ignore[arg-type]


def test_the_policy_picks_the_round_before_the_first_unverified_update_and_refuses_in_one_line() -> None:
    assert rollback.decide(_history(), before_node="f") == rollback.Rollback(
        to_round=2, new_round=6, rounds=14, undone=(2, 3, 4, 5), node_id="f")
    done = rollback.decide(_history(state="done"), to_round=3)
    assert done == rollback.Rollback(to_round=3, new_round=5, rounds=12, undone=(3, 4), node_id=None)
    refusals = {
        "nothing_to_roll_back": rollback.decide(_history(), before_node="a"),
        "round_not_kept": rollback.decide(_history(), to_round=1),
        "bad_round": rollback.decide(_history(), to_round=5),
        "job_ended": rollback.decide(_history(state="cancelled"), to_round=3),
        "no_closed_round": rollback.decide(_history(round=0), to_round=0),
        "rolled_back": rollback.decide(_history(rolled_back=frozenset({3})), to_round=3),
        "bad_rollback": rollback.decide(_history()),
    }
    for code, got in refusals.items():
        assert isinstance(got, rollback.Refused) and got.code == code and "\n" not in got.detail, (code, got)
    # rounds already rolled back hold nothing to undo
    assert rollback.decide(_history(rolled_back=frozenset({2, 3})), before_node="f").code == "nothing_to_roll_back"
    assert rollback.prune_below(10, 3) == 8 and rollback.prune_below(10, 0) is None and rollback.prune_below(2, 3) is None


def test_a_rollback_before_a_node_whose_model_is_gone_falls_back_to_the_oldest_kept_only_when_asked() -> None:
    """F's unverified rounds are 2, 3 and 4; keep_rounds has let version 2 go."""
    marks = (*_history().aggregated[:3], rollback.Aggregated(4, "u4", "f", False))
    h = _history(aggregated=marks, kept=frozenset({0, 3, 4, 5}))
    refused = rollback.decide(h, before_node="f")
    assert isinstance(refused, rollback.Refused) and refused.code == "round_not_kept"
    assert "--or-oldest-kept" in refused.detail and "restores round 3's model" in refused.detail
    assert "unverified rounds 2 in the model" in refused.detail and "\n" not in refused.detail
    partial = rollback.decide(h, before_node="f", oldest_kept=True)
    assert partial == rollback.Rollback(to_round=3, new_round=6, rounds=13, undone=(3, 4, 5), node_id="f",
                                        unverified_left=(2,))
    assert isinstance(partial, rollback.Rollback) and partial.partial
    # the model before its first round kept: the option changes nothing
    assert rollback.decide(_history(), before_node="f", oldest_kept=True) == rollback.decide(
        _history(), before_node="f")
    # a kept model older than its first round undoes all of it (not partial)
    older = rollback.decide(_history(kept=frozenset({0, 1, 4, 5})), before_node="f", oldest_kept=True)
    assert isinstance(older, rollback.Rollback) and (older.to_round, older.partial) == (1, False)
    # no kept model but the initial one: the initial model
    initial = rollback.decide(_history(kept=frozenset({0})), before_node="f", oldest_kept=True)
    assert isinstance(initial, rollback.Rollback) and (initial.to_round, initial.undone, initial.partial) == (
        0, (0, 1, 2, 3, 4, 5), False)
    # the oldest kept comes after all of its rounds: it would undo none of them, refused (also when
    # the only one kept after the initial model is the one the open round trains from)
    for kept in ({0, 4, 5}, {0, 5}):
        late = rollback.decide(_history(kept=frozenset(kept)), before_node="f", oldest_kept=True)
        assert isinstance(late, rollback.Refused) and late.code == "round_not_kept" and "--to-round 0" in late.detail
    # rounds already rolled back are no fallback (their models hold what a rollback undid)
    assert rollback.fallback_round([2, 4], kept={0, 3, 4, 5}, rolled_back={3}, closed=5) == 4
    # a round names its model: the option goes with before_node only
    assert rollback.decide(h, to_round=3, oldest_kept=True).code == "bad_rollback"  # type: ignore[union-attr]


def test_a_verification_counts_for_a_rollback_only_while_its_verifier_stands() -> None:
    """F's round-2 update was verified by C's agreeing replica, its round-3 update by a replay of
    one segment, its round-4 one by the referee's replay of the whole update; round 5 unverified."""
    marks = (rollback.Aggregated(1, "u1", "f", True, rollback.Verifier(("h",))),
             rollback.Aggregated(2, "u2", "f", True, rollback.Verifier(("c",))),
             rollback.Aggregated(3, "u3", "f", True, rollback.Verifier((), rollback.SEGMENT)),
             rollback.Aggregated(4, "u4", "f", True, rollback.Verifier((), rollback.WHOLE)),
             rollback.Aggregated(5, "u5", "f", False))
    h = _history(round=6, aggregated=marks, kept=frozenset(range(7)))
    # a partial replay does not count; an honest partner's agreement and a whole replay do
    assert rollback.unverified_rounds(h, "f") == [3, 5]
    assert rollback.decide(h, before_node="f").to_round == 3  # type: ignore[union-attr]
    # once the colluder C is suspended too, what it vouched for is undone: the rollback point moves earlier
    both = _history(round=6, aggregated=marks, kept=frozenset(range(7)), stopped=frozenset({"f", "c"}))
    assert rollback.unverified_rounds(both, "f") == [2, 3, 5]
    assert rollback.decide(both, before_node="f") == rollback.Rollback(
        to_round=2, new_round=7, rounds=15, undone=(2, 3, 4, 5, 6), node_id="f")
    # one honest agreeing replica beside a stopped one still verifies; a record naming no verifier stands
    assert rollback.Verifier(("c", "h")).holds({"c"}) and not rollback.Verifier(("c",), rollback.SEGMENT).holds({"c"})
    assert rollback.Aggregated(1, "u", "f", True).stands({"f"})
    # as a round's evidence records them, and as a referee verdict's evidence says how far it replayed
    evidence = {"aggregated": {"u1": "verified", "u2": "verified", "u3": "unverified"},
                "verified_by": {"u1": {"replicas": ["c"], "referee": "segment"}}}
    assert rollback.verifiers_of(evidence, ["u1", "u2", "u3"]) == {
        "u1": rollback.Verifier(("c",), rollback.SEGMENT), "u2": None, "u3": None}
    assert rollback.Verifier.of_doc(rollback.Verifier(("c",), rollback.WHOLE).doc()) == rollback.Verifier(
        ("c",), rollback.WHOLE)
    assert rollback.replay_reach({"steps": [0, 63], "last_step": 63}) == rollback.WHOLE
    assert rollback.replay_reach({"steps": [8, 16], "last_step": 63}) == rollback.SEGMENT
    assert rollback.replay_reach({}) == rollback.SEGMENT


@pytest.mark.parametrize("keep", ["1", "10"])
def test_keep_rounds_must_exceed_the_trend_span(keep: str) -> None:
    from gpuflex.protocol.jobspec import SpecError, parse_job_spec

    from tests.helpers import digits_spec

    with pytest.raises(SpecError, match="keep_rounds"):
        parse_job_spec(digits_spec(extra=f"keep_rounds = {keep}\n"))
    assert parse_job_spec(digits_spec(extra="keep_rounds = 0\n")).verification.keep_rounds == 0
