"""The referee's node-facing side on a real hub over loopback: a spot-check asks the node for
its committed states in the answer to POST /v1/work, and POST /v1/states takes only the
states that node committed to, for the steps asked, before the deadline."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import torch
from gpuflex.node.checkpoints import CheckpointRecorder, CheckpointStore
from gpuflex.node.device import compute_class
from gpuflex.node.trainer import train_assignment
from gpuflex.protocol.checkpoint import auto_every, checkpoint_steps
from gpuflex.protocol.messages import (
    Ack,
    Assignment,
    NoWork,
    StateRequest,
    StateUnavailable,
    StateUpload,
    WorkRequest,
)
from gpuflex.protocol.modelspec import ModelSpec
from gpuflex.protocol.signing import new_nonce, seal
from gpuflex.protocol.tensors import decode_state, encode_state

from tests.helpers import (
    RunningHub,
    SimNode,
    open_store,
    start_hub,
    submit_job,
    wait_job,
    when_job_arrives,
    write_digits,
)


async def _train_committed(n: SimNode, a: Assignment, store: CheckpointStore) -> tuple[bytes, int, float, object]:
    torch.set_num_threads(1)
    g = decode_state(bytearray(await n.blob(a.model_hash)))
    chunks = [decode_state(bytearray(await n.blob(c.sha256))) for c in a.chunks]
    samples = sum(c.samples for c in a.chunks)
    total = math.ceil(samples / a.train.batch_size) * a.train.local_epochs
    rec = CheckpointRecorder(total_steps=total, every=auto_every(total, a.train.checkpoint_every), store=store,
                             assignment_id=a.assignment_id)
    res = train_assignment(ModelSpec.from_dict(a.model_spec), g, chunks, a.train, a.seed,
                           device=torch.device("cpu"), on_step=rec)
    return encode_state(res.delta), res.sample_count, res.loss, rec.commitment()


async def _post_state(n: SimNode, hdr: StateUpload, body: bytes, **headers: str) -> aiohttp.ClientResponse:
    return await n.session.post(n.url + "/v1/states", data=body, headers={
        "X-GPUFlex-State": base64.urlsafe_b64encode(seal(n.key, hdr)).decode(),
        "Content-Type": "application/octet-stream", **headers})


async def test_a_spot_check_asks_for_committed_states_and_checks_each_upload(tmp_path: Path) -> None:
    train, val, spec_path = write_digits(tmp_path / "d", rounds=1, replication="1.0", replica_wait_s=30.0,
                                         spot_check=1.0)
    hub = await start_hub(tmp_path / "hub")
    try:
        async with aiohttp.ClientSession() as s:
            job_id = (await (await submit_job(s, hub, spec_path, train, val)).json())["id"]
            # CPU nodes that train with oneDNN off (`gpuflex-node run --onednn off`): the referee must replay so
            with torch.backends.mkldnn.flags(enabled=False):
                no_onednn = compute_class(torch.device("cpu"))
            nodes = [SimNode(s, hub.url, compute=no_onednn), SimNode(s, hub.url, compute=no_onednn)]
            for n in nodes:
                await n.register()
            work = [await n.work(0.5) for n in nodes]
            assert all(isinstance(a, Assignment) for a in work)
            stores = {n.node_id: CheckpointStore(tmp_path / n.node_id[:12]) for n in nodes}
            commitments = {}
            for n, a in zip(nodes, work, strict=True):
                with torch.backends.mkldnn.flags(enabled=False):
                    blob, samples, loss, c = await _train_committed(n, a, stores[n.node_id])
                commitments[n.node_id] = c
                resp = await n.upload_raw(n.update_header(a, blob, samples, loss, commitment=c), blob)
                ack = await n.open_response(resp, Ack)
                assert ack.ok
            # the agreeing, untrusted pair is spot-checked: one of them is asked for its states
            asked: StateRequest | None = None
            deadline = time.monotonic() + 30
            while asked is None and time.monotonic() < deadline:
                for n in nodes:
                    req = WorkRequest(timestamp=time.time(), nonce=new_nonce(), wait_s=0.5, cached_chunks=())
                    got = await n.open_response(await n.post("/v1/work", seal(n.key, req)),
                                                StateRequest, Assignment, NoWork)
                    if isinstance(got, StateRequest):
                        asked, owner = got, n
                        break
            assert asked is not None and len(asked.steps) >= 2
            # a small model: every checkpoint is asked for, so every committed segment norm is tested
            owned = commitments[owner.node_id]
            assert asked.steps == tuple(checkpoint_steps(owned.steps, owned.every))
            other = next(n for n in nodes if n is not owner)
            store = stores[owner.node_id]
            first = store.read(asked.assignment_id, asked.steps[0])
            assert first is not None

            def hdr(step: int, data: bytes) -> StateUpload:
                return StateUpload(request_id=asked.request_id, step=step, state_sha256=hashlib.sha256(data).hexdigest(),
                                   state_size=len(data), timestamp=time.time(), nonce=new_nonce())

            async def code(resp: aiohttp.ClientResponse) -> tuple[int, str]:
                body = await resp.read()
                return resp.status, json.loads(body)["error"] if resp.status != 200 else "ok"

            assert await code(await _post_state(other, hdr(asked.steps[0], first), first)) == (403, "not_your_request")
            unasked = next(i for i in range(10_000) if i not in asked.steps)
            assert await code(await _post_state(owner, hdr(unasked, first), first)) == (400, "bad_step")
            forged = bytearray(first)
            forged[-1] ^= 1
            assert await code(await _post_state(owner, hdr(asked.steps[0], bytes(forged)), bytes(forged))) == (
                422, "not_committed")
            assert (await _post_state(owner, hdr(asked.steps[0], first), first[:-1])).status == 400  # size
            for step in asked.steps:
                data = store.read(asked.assignment_id, step)
                assert data is not None
                assert await code(await _post_state(owner, hdr(step, data), data)) == (200, "ok")
            doc = await wait_job(s, hub, job_id)
            assert doc["state"] == "done"
            assert doc["history"][0]["flags"] == []
            async with s.get(hub.url + "/metrics") as r:
                text = await r.text()
            assert "gpuflex_referee_requests_total 1" in text
            assert 'gpuflex_referee_verdicts_total{outcome="reproduced"} 1' in text
        conn = open_store(hub.data_dir)
        try:
            (status, reason, verdict), = conn.execute("SELECT status, reason, verdict FROM state_requests").fetchall()
        finally:
            conn.close()
        assert (status, reason) == ("reproduced", "spot_check")
        ev = json.loads(verdict)
        assert ev["distance"] <= ev["threshold"] == 1e-3 and ev["node"] == owner.node_id
        assert ev["onednn"] is False  # replayed in the node's class, as its hello said
        assert ev["norms_tested"] == len(commitments[owner.node_id].norms)
    finally:
        await hub.stop()


async def test_same_class_replicas_that_disagree_replay_the_segment_where_their_hashes_part(tmp_path: Path) -> None:
    """Two nodes of one compute class train a replicated shard; the second uploads another update
    with a commitment whose norms are the honest ones and whose hashes leave the honest ones at
    checkpoint 3 (what a forger rewriting segment 2 commits to). The disagreement asks both for
    segment 2, found from the hashes, not from the draw."""
    train, val, spec_path = write_digits(tmp_path / "d", rounds=1, replication="1.0", replica_wait_s=30.0)
    hub = await start_hub(tmp_path / "hub")
    try:
        async with aiohttp.ClientSession() as s:
            await submit_job(s, hub, spec_path, train, val)
            cpu = compute_class(torch.device("cpu"))
            nodes = [SimNode(s, hub.url, compute=cpu), SimNode(s, hub.url, compute=cpu)]
            for n in nodes:
                await n.register()
            work = [await n.work(0.5) for n in nodes]
            assert all(isinstance(a, Assignment) for a in work)
            for i, (n, a) in enumerate(zip(nodes, work, strict=True)):
                blob, samples, loss, c = await _train_committed(n, a, CheckpointStore(tmp_path / f"s{i}"))
                assert len(c.hashes) > 4
                if i == 1:
                    blob = encode_state({k: v * 1.5 for k, v in decode_state(bytearray(blob)).items()})
                    c = dataclasses.replace(c, hashes=(*c.hashes[:3], *(f"{j:064x}" for j in range(len(c.hashes) - 3))))
                assert (await n.open_response(await n.upload_raw(n.update_header(a, blob, samples, loss,
                                                                                commitment=c), blob), Ack)).ok
            for n in nodes:
                await _state_request(n)
        conn = open_store(hub.data_dir)
        try:
            rows = conn.execute("SELECT reason, segment FROM state_requests").fetchall()
        finally:
            conn.close()
        assert sorted(rows) == [("disagreement", 2), ("disagreement", 2)]
    finally:
        await hub.stop()


async def _state_request(n: SimNode) -> StateRequest:
    """Poll /v1/work until the hub asks ``n`` for states (30 s at most)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        req = WorkRequest(timestamp=time.time(), nonce=new_nonce(), wait_s=0.5, cached_chunks=())
        got = await n.open_response(await n.post("/v1/work", seal(n.key, req)), StateRequest, Assignment, NoWork)
        if isinstance(got, StateRequest):
            return got
    raise AssertionError("the hub never asked for states")


async def _answer_state_request(n: SimNode, store: CheckpointStore) -> StateRequest:
    """Wait until the hub asks ``n`` for states; hand over every one asked for."""
    got = await _state_request(n)
    for step in got.steps:
        data = store.read(got.assignment_id, step)
        assert data is not None
        hdr = StateUpload(request_id=got.request_id, step=step, state_sha256=hashlib.sha256(data).hexdigest(),
                          state_size=len(data), timestamp=time.time(), nonce=new_nonce())
        assert (await _post_state(n, hdr, data)).status == 200
    return got


async def test_a_trusted_nodes_lone_update_is_audited_and_a_crafted_one_is_left_out(tmp_path: Path) -> None:
    """Trust saves a node the replica, not the referee: at spot_check_trusted = 1 a trusted node's
    unreplicated update is re-executed before it counts. An honest one is reproduced (and the node
    credited); a crafted one (x3.5, what a patient colluder sends once trusted) is flagged
    referee_mismatch and left out of the aggregate."""
    train, val, spec_path = write_digits(tmp_path / "d", rounds=2, replication="0.0", spot_check=0.0,
                                         spot_check_trusted=1.0, extra="trust_after = 0\n")
    hub = await start_hub(tmp_path / "hub")
    try:
        async with aiohttp.ClientSession() as s:
            job_id = (await (await submit_job(s, hub, spec_path, train, val)).json())["id"]
            n = SimNode(s, hub.url)
            await n.register()
            store = CheckpointStore(tmp_path / "states")
            for crafted in (False, True):
                a = await n.work(2.0)
                assert isinstance(a, Assignment) and hub.replica_group(a.assignment_id) == ""  # not replicated
                blob, samples, loss, c = await _train_committed(n, a, store)
                if crafted:
                    blob = encode_state({k: v * 3.5 for k, v in decode_state(bytearray(blob)).items()})
                ack = await n.open_response(await n.upload_raw(n.update_header(a, blob, samples, loss, commitment=c),
                                                               blob), Ack)
                assert ack.ok
                asked = await _answer_state_request(n, store)
                assert asked.assignment_id == a.assignment_id
                if not crafted:  # the round closes on the reproduced update, with no flag
                    deadline = time.monotonic() + 30
                    while not (doc := await (await s.get(f"{hub.url}/v1/jobs/{job_id}",
                                                         headers=hub.auth(hub.admin_token))).json())["history"]:
                        assert time.monotonic() < deadline
                        await asyncio.sleep(0.1)
                    assert doc["history"][0]["flags"] == []
            deadline = time.monotonic() + 30
            flags: list = []
            while not flags and time.monotonic() < deadline:
                async with s.get(hub.url + "/v1/flags", headers=hub.auth(hub.auditor_token)) as r:
                    flags = (await r.json())["flags"]
                await asyncio.sleep(0.2)
            assert [(f["reason"], f["node_id"]) for f in flags] == [("referee_mismatch", n.node_id)]
        conn = open_store(hub.data_dir)
        try:
            rows = conn.execute("SELECT status, reason FROM state_requests ORDER BY requested_at").fetchall()
            statuses = dict(conn.execute("SELECT id, status FROM updates").fetchall())
        finally:
            conn.close()
        assert rows == [("reproduced", "spot_check"), ("mismatch", "spot_check")]
        assert sorted(statuses.values()) == ["included", "quarantined"]
    finally:
        await hub.stop()


async def _history(s: aiohttp.ClientSession, hub: RunningHub, job_id: str, rounds: int) -> dict[str, Any]:
    """The job's status once its history holds ``rounds`` closed rounds (30 s at most)."""
    deadline = time.monotonic() + 30
    while len((doc := await (await s.get(f"{hub.url}/v1/jobs/{job_id}",
                                         headers=hub.auth(hub.admin_token))).json())["history"]) < rounds:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    return doc


async def test_an_update_against_the_models_trend_is_re_executed_though_no_spot_check_is_drawn(tmp_path: Path) -> None:
    """A trusted node is never spot-checked here (spot_check_trusted = 0) and its work is not
    replicated. Its honest round-1 update follows the model's trend and counts at once; in round 2
    it sends what a patient colluder sends (its output layer sign-flipped, x2.2, every threshold
    it can see respected): that layer points against the trend, so the referee asks for its states
    first, finds the update is not what it trained, and it is flagged and left out."""
    train, val, spec_path = write_digits(tmp_path / "d", rounds=3, replication="0.0", spot_check=0.25,
                                         spot_check_trusted=0.0, extra="trust_after = 0\ntrend_rounds = 1\n")
    hub = await start_hub(tmp_path / "hub")
    try:
        async with aiohttp.ClientSession() as s:
            job_id = (await (await submit_job(s, hub, spec_path, train, val)).json())["id"]
            n = SimNode(s, hub.url)
            await n.register()
            store = CheckpointStore(tmp_path / "states")
            for rnd in range(3):
                a = await n.work(2.0)
                assert isinstance(a, Assignment) and hub.replica_group(a.assignment_id) == "" and a.round == rnd
                blob, samples, loss, c = await _train_committed(n, a, store)
                if rnd == 2:
                    delta = decode_state(bytearray(blob))
                    out = {k for k in delta if k.startswith("2.")}  # the output layer of 64-128-10
                    blob = encode_state({k: (-v if k in out else v) * 2.2 for k, v in delta.items()})
                ack = await n.open_response(await n.upload_raw(n.update_header(a, blob, samples, loss, commitment=c),
                                                               blob), Ack)
                assert ack.ok
                if rnd < 2:  # followed the trend (or had none yet): the round closes without the referee
                    doc = await _history(s, hub, job_id, rnd + 1)
                    assert doc["history"][rnd]["flags"] == []
            asked = await _answer_state_request(n, store)
            assert asked.assignment_id == a.assignment_id
            deadline = time.monotonic() + 30
            flags: list = []
            while not flags and time.monotonic() < deadline:
                async with s.get(hub.url + "/v1/flags", headers=hub.auth(hub.auditor_token)) as r:
                    flags = (await r.json())["flags"]
                await asyncio.sleep(0.2)
            assert [(f["reason"], f["node_id"]) for f in flags] == [("referee_mismatch", n.node_id)]
        conn = open_store(hub.data_dir)
        try:
            rows = conn.execute("SELECT status, reason, verdict FROM state_requests").fetchall()
        finally:
            conn.close()
        assert [(st, reason) for st, reason, _ in rows] == [("mismatch", "against_trend")]
    finally:
        await hub.stop()


async def test_a_node_offline_after_its_upload_is_left_out_without_a_flag(tmp_path: Path) -> None:
    """The referee asks a trusted node for its states; the node never polls again (its machine
    slept after the upload). At the deadline its update is left out, unflagged ("unreachable":
    an honest volunteer is not accused for being offline), and it must earn trust again."""
    train, val, spec_path = write_digits(tmp_path / "d", rounds=2, replication="0.0", spot_check=0.0,
                                         spot_check_trusted=1.0, extra="trust_after = 0\nstate_wait_s = 2.0\n")
    hub = await start_hub(tmp_path / "hub")
    try:
        async with aiohttp.ClientSession() as s:
            job_id = (await (await submit_job(s, hub, spec_path, train, val)).json())["id"]
            n = SimNode(s, hub.url)
            await n.register()
            store = CheckpointStore(tmp_path / "states")
            for rnd in range(2):
                a = await n.work(2.0)
                assert isinstance(a, Assignment) and a.round == rnd
                blob, samples, loss, c = await _train_committed(n, a, store)
                ack = await n.open_response(await n.upload_raw(n.update_header(a, blob, samples, loss, commitment=c),
                                                               blob), Ack)
                assert ack.ok
                if rnd == 0:  # online: it hands its states over, is reproduced and earns an agreement
                    await _answer_state_request(n, store)
                    await _history(s, hub, job_id, 1)
                    conn = open_store(hub.data_dir)
                    try:
                        assert conn.execute("SELECT consecutive_agreements FROM nodes").fetchone() == (1,)
                    finally:
                        conn.close()
            # round 1: it never polls again
            deadline = time.monotonic() + 30
            while True:
                conn = open_store(hub.data_dir)
                try:
                    rows = conn.execute("SELECT status, verdict FROM state_requests WHERE round = 1").fetchall()
                    (status,) = conn.execute("SELECT status FROM updates WHERE id LIKE ?",
                                             ("u-" + a.assignment_id.removeprefix("a-"),)).fetchone()
                    (run,) = conn.execute("SELECT consecutive_agreements FROM nodes").fetchone()
                finally:
                    conn.close()
                # the verdict and the shard's settling are two commits: wait for both
                if rows and rows[0][0] != "open" and status != "accepted":
                    break
                assert time.monotonic() < deadline, (rows, status)
                await asyncio.sleep(0.2)
            assert rows[0][0] == "unreachable"
            assert "did not come back" in json.loads(rows[0][1])["why"]
            assert status == "excluded" and run == 0
            async with s.get(hub.url + "/v1/flags", headers=hub.auth(hub.auditor_token)) as r:
                assert (await r.json())["flags"] == []
            async with s.get(hub.url + "/metrics") as r:
                assert 'gpuflex_referee_verdicts_total{outcome="unreachable"} 1' in await r.text()
    finally:
        await hub.stop()


async def test_a_node_that_no_longer_holds_its_states_says_so_and_the_hub_decides_at_once(tmp_path: Path) -> None:
    """The referee asks for states the node no longer keeps. It says so (POST /v1/states/unavailable)
    and the hub decides at once, long before the request's 60 s deadline: the update is left out
    unverified, the node is not flagged, and the shard goes out again in the same round."""
    train, val, spec_path = write_digits(tmp_path / "d", rounds=1, replication="0.0", spot_check=0.0,
                                         spot_check_trusted=1.0, extra="trust_after = 0\nstate_wait_s = 60.0\n")
    hub = await start_hub(tmp_path / "hub")
    try:
        async with aiohttp.ClientSession() as s:
            job_id = (await (await submit_job(s, hub, spec_path, train, val)).json())["id"]
            n, stranger = SimNode(s, hub.url), SimNode(s, hub.url)
            await n.register()
            await stranger.register()
            store = CheckpointStore(tmp_path / "states")
            a = await n.work(2.0)
            assert isinstance(a, Assignment)
            blob, samples, loss, c = await _train_committed(n, a, store)
            ack = await n.open_response(await n.upload_raw(n.update_header(a, blob, samples, loss, commitment=c),
                                                           blob), Ack)
            assert ack.ok
            asked = await _state_request(n)

            async def decline(who: SimNode, steps: tuple[int, ...]) -> tuple[int, str]:
                msg = StateUnavailable(request_id=asked.request_id, steps=steps, reason="pruned",
                                       timestamp=time.time(), nonce=new_nonce())
                resp = await who.post("/v1/states/unavailable", seal(who.key, msg))
                body = await resp.read()
                return resp.status, json.loads(body)["error"] if resp.status != 200 else "ok"

            unasked = next(i for i in range(10_000) if i not in asked.steps)
            assert await decline(stranger, asked.steps) == (403, "not_your_request")
            assert await decline(n, (unasked,)) == (400, "bad_step")
            assert await decline(n, ()) == (400, "bad_step")
            said = time.monotonic()
            assert await decline(n, asked.steps[-1:]) == (200, "ok")
            while True:  # decided at once: the verdict, then the shard back in the pool
                conn = open_store(hub.data_dir)
                try:
                    rows = conn.execute("SELECT status, verdict FROM state_requests").fetchall()
                    statuses = [r[0] for r in conn.execute("SELECT status FROM updates").fetchall()]
                finally:
                    conn.close()
                if rows[0][0] != "open" and statuses == ["excluded"]:
                    break
                assert time.monotonic() - said < 10, (rows, statuses)
                await asyncio.sleep(0.1)
            assert rows[0][0] == "unreachable"
            assert json.loads(rows[0][1])["declined_steps"] == [asked.steps[-1]]
            assert await decline(n, asked.steps[:1]) == (404, "unknown_request")  # decided: nothing open
            again = await n.work(2.0)  # the shard is trained again in the same round
            assert isinstance(again, Assignment) and again.round == 0 and again.assignment_id != a.assignment_id
            async with s.get(hub.url + "/v1/flags", headers=hub.auth(hub.auditor_token)) as r:
                assert (await r.json())["flags"] == []
            doc = await (await s.get(f"{hub.url}/v1/jobs/{job_id}", headers=hub.auth(hub.admin_token))).json()
            assert doc["state"] == "running"
    finally:
        await hub.stop()


async def test_an_open_state_request_and_the_states_handed_over_survive_a_restart(tmp_path: Path) -> None:
    """The hub stops after the node handed over one of its states: the new hub asks for the same
    request again, takes the rest, and the referee judges with all of them."""
    train, val, spec_path = write_digits(tmp_path / "d", rounds=1, replication="1.0", replica_wait_s=30.0,
                                         spot_check=1.0)
    hub = await start_hub(tmp_path / "hub")
    tokens = {"owner": hub.owner_token, "auditor": hub.auditor_token, "admin": hub.admin_token}
    async with aiohttp.ClientSession() as s:
        job_id = (await (await submit_job(s, hub, spec_path, train, val)).json())["id"]
        nodes = [SimNode(s, hub.url), SimNode(s, hub.url)]
        for n in nodes:
            await n.register()
        work = [await n.work(0.5) for n in nodes]
        stores = {n.node_id: CheckpointStore(tmp_path / n.node_id[:12]) for n in nodes}
        for n, a in zip(nodes, work, strict=True):
            blob, samples, loss, c = await _train_committed(n, a, stores[n.node_id])
            assert (await n.upload_raw(n.update_header(a, blob, samples, loss, commitment=c), blob)).status == 200
        asked, owner = await _asked(nodes)
        data = stores[owner.node_id].read(asked.assignment_id, asked.steps[0])
        assert data is not None
        up = StateUpload(request_id=asked.request_id, step=asked.steps[0], state_sha256=hashlib.sha256(data).hexdigest(),
                         state_size=len(data), timestamp=time.time(), nonce=new_nonce())
        assert (await _post_state(owner, up, data)).status == 200
    await hub.stop()

    hub = await start_hub(tmp_path / "hub", tokens=tokens)
    try:
        async with aiohttp.ClientSession() as s:
            for n in nodes:
                n.session, n.url = s, hub.url
            again, who = await _asked(nodes)
            assert (again.request_id, who.node_id) == (asked.request_id, owner.node_id)
            for step in again.steps[1:]:
                data = stores[owner.node_id].read(again.assignment_id, step)
                assert data is not None
                up = StateUpload(request_id=again.request_id, step=step, state_sha256=hashlib.sha256(data).hexdigest(),
                                 state_size=len(data), timestamp=time.time(), nonce=new_nonce())
                assert (await _post_state(owner, up, data)).status == 200
            doc = await wait_job(s, hub, job_id)
            assert doc["state"] == "done" and doc["history"][0]["flags"] == []
        conn = open_store(hub.data_dir)
        try:
            rows = conn.execute("SELECT id, status FROM state_requests").fetchall()
        finally:
            conn.close()
        assert rows == [(asked.request_id, "reproduced")]
    finally:
        await hub.stop()


async def _asked(nodes: list[SimNode]) -> tuple[StateRequest, SimNode]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for n in nodes:
            req = WorkRequest(timestamp=time.time(), nonce=new_nonce(), wait_s=0.5, cached_chunks=())
            got = await n.open_response(await n.post("/v1/work", seal(n.key, req)), StateRequest, Assignment, NoWork)
            if isinstance(got, StateRequest):
                return got, n
    raise AssertionError("no state request within 30 s")


async def test_linear_lr_scaling_signs_each_shard_its_factor_and_the_referee_replays_with_it(tmp_path: Path) -> None:
    """[train] lr_scaling = "linear": each assignment carries lr x (round's samples / shard's),
    capped at lr_scale_max; the referee re-executes a segment with the same factor (the honest
    updates reproduce), and the round's review compares the updates by samples x factor (no flag)."""
    train, val, spec_path = write_digits(tmp_path / "d", rounds=1, replication="0.0", spot_check=1.0)
    spec_path.write_text(spec_path.read_text().replace("seed = 0\n", 'seed = 0\nlr_scaling = "linear"\n'))
    hub = await start_hub(tmp_path / "hub", long_poll_max_s=10.0)
    try:
        async with aiohttp.ClientSession() as s:
            nodes = [SimNode(s, hub.url, samples_per_s=500.0) for _ in range(3)]
            job, work = await when_job_arrives(nodes, s, hub, spec_path, train, val)  # a shard each
            job_id = job["id"]
            got = [(n, a) for n, a in zip(nodes, work, strict=True) if isinstance(a, Assignment)]
            with np.load(train, allow_pickle=False) as arrays:
                total = int(arrays["y"].shape[0])  # the round pools every training row
            scales = []
            for _, a in got:
                samples = sum(c.samples for c in a.chunks)
                assert a.train.lr == 0.05 * min(8.0, max(1.0, total / samples))
                scales.append(a.train.lr / 0.05)
            assert len(got) >= 2 and all(x > 1.0 for x in scales), scales  # the round was shared out
            stores = {n.node_id: CheckpointStore(tmp_path / n.node_id[:12]) for n, _ in got}
            for n, a in got:
                blob, samples, loss, c = await _train_committed(n, a, stores[n.node_id])
                ack = await n.open_response(await n.upload_raw(n.update_header(a, blob, samples, loss, commitment=c),
                                                               blob), Ack)
                assert ack.ok
            for n, _ in got:
                await _answer_state_request(n, stores[n.node_id])
            doc = await _history(s, hub, job_id, 1)
            assert doc["history"][0]["flags"] == []
        conn = open_store(hub.data_dir)
        try:
            rows = conn.execute("SELECT status FROM state_requests").fetchall()
        finally:
            conn.close()
        assert rows and all(r == ("reproduced",) for r in rows), rows
    finally:
        await hub.stop()
