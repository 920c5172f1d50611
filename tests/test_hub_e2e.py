"""End to end over loopback: real app, real SQLite file, real torch, simulated nodes signing with the protocol."""

from __future__ import annotations

import asyncio
import hashlib
import time

import aiohttp
import pytest
from gpuflex.hub.server.appkeys import LEDGER
from gpuflex.protocol.messages import Ack, Assignment, NoWork, WorkRequest
from gpuflex.protocol.signing import new_nonce, seal
from gpuflex.protocol.tensors import state_from_safetensors

from tests.helpers import (
    SimNode,
    digits_spec,
    finish_job,
    open_store,
    start_hub,
    stored_blobs,
    submit_job,
    wait_job,
    write_digits,
)


def db_rows(hub, sql, *args):
    conn = open_store(hub.data_dir)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


async def test_one_node_job_runs_to_done(running_hub, digits_npz):
    train, val, spec = digits_npz
    async with aiohttp.ClientSession() as s:
        r = await submit_job(s, running_hub, spec, train, val)
        assert r.status == 201, await r.text()
        job = await r.json()
        node = SimNode(s, running_hub.url)
        await node.register()
        for _ in range(2):
            a = await node.step()
            assert isinstance(a, Assignment)
            assert a.job_id == job["id"] and running_hub.replica_group(a.assignment_id) == ""
        doc = await wait_job(s, running_hub, job["id"])
        assert [h["round"] for h in doc["history"]] == [0, 1]
        assert doc["history"][-1]["accuracy"] > 0.5
        assert doc["history"][-1]["updates"][0]["status"] == "included"
        # what crossed the wire each round: round 0 the model and every chunk, round 1 the new
        # model only (the node kept the chunks); one fp32 update up each round
        (chunk_bytes,) = db_rows(running_hub, "SELECT SUM(size) FROM chunks WHERE job_id = ?", job["id"])[0]
        models = dict(db_rows(running_hub, "SELECT version, sha FROM models WHERE job_id = ?", job["id"]))
        model_bytes = [len(await node.blob(models[v])) for v in (0, 1)]
        sizes = dict(db_rows(running_hub, "SELECT round, size FROM updates WHERE job_id = ?", job["id"]))
        t0, t1 = (h["transfer"] for h in doc["history"])
        assert t0["bytes_down"] == model_bytes[0] + chunk_bytes and t1["bytes_down"] == model_bytes[1]
        assert (t0["bytes_up"], t1["bytes_up"]) == (sizes[0], sizes[1]) and t0["updates"] == 1
        assert t0["compression_ratio"] == pytest.approx(model_bytes[0] / sizes[0]) and \
            0.99 < t0["compression_ratio"] < 1.01  # fp32 updates: no compression yet
        assert "bytes_down" not in doc["history"][0]["metrics"]
        assert isinstance(await node.work(0.1), NoWork)
        async with s.get(
            f"{running_hub.url}/v1/jobs/{job['id']}/model", headers=running_hub.auth()
        ) as r:
            assert r.status == 200
            state = state_from_safetensors(await r.read())
        assert "0.weight" in state
        async with s.get(
            f"{running_hub.url}/v1/jobs/{job['id']}/model?round=0", headers=running_hub.auth()
        ) as r:
            assert r.headers["X-GPUFlex-Model-Version"] == "0"
    # every chunk of every round counted exactly once
    chunks = {
        c for (c,) in db_rows(running_hub, "SELECT sha FROM chunks WHERE job_id = ?", job["id"])
    }
    for rnd in (0, 1):
        got = [
            c
            for (c,) in db_rows(
                running_hub,
                "SELECT sc.chunk_sha FROM updates u JOIN shard_chunks sc ON sc.shard_id = u.shard_id"
                " WHERE u.job_id = ? AND u.round = ? AND u.status = 'included'",
                job["id"],
                rnd,
            )
        ]
        assert sorted(got) == sorted(chunks)


async def test_two_jobs_share_two_nodes(tmp_path):
    train, val, spec = write_digits(tmp_path / "d", rounds=2, round_target_s=0.5)
    hub = await start_hub(tmp_path / "hub")
    try:
        async with aiohttp.ClientSession() as s:
            ids = []
            for _ in range(2):
                r = await submit_job(s, hub, spec, train, val)
                ids.append((await r.json())["id"])
            nodes = [SimNode(s, hub.url, samples_per_s=1000.0) for _ in range(2)]
            for n in nodes:
                await n.register()
            seen_jobs = set()

            async def all_done() -> bool:
                for job_id in ids:
                    async with s.get(f"{hub.url}/v1/jobs/{job_id}", headers=hub.auth()) as r:
                        if (await r.json())["state"] != "done":
                            return False
                return True

            async def drive(n: SimNode) -> None:
                while True:
                    a = await n.step(wait_s=0.5)
                    if a is None:
                        # No work within the poll: done, or a round is still closing (slow disk).
                        if await all_done():
                            return
                        continue
                    seen_jobs.add(a.job_id)

            await asyncio.wait_for(asyncio.gather(*(drive(n) for n in nodes)), 90)
            for job_id in ids:
                doc = await wait_job(s, hub, job_id)
                assert len(doc["history"]) == 2
                assert (
                    len(doc["history"][0]["updates"]) > 1
                )  # a 500-sample shard: several per round
            assert seen_jobs == set(ids)
    finally:
        await hub.stop()


async def test_request_signed_before_a_restart_is_refused_as_a_replay(tmp_path):
    """The nonce memory does not survive a restart; the time it started does the job instead."""
    train, val, spec = write_digits(tmp_path / "d", rounds=1)
    hub = await start_hub(tmp_path / "hub")
    async with aiohttp.ClientSession() as s:
        await submit_job(s, hub, spec, train, val)
        node = SimNode(s, hub.url)
        await node.register()
        captured = seal(node.key, WorkRequest(timestamp=time.time(), nonce=new_nonce(), wait_s=0.0,
                                              cached_chunks=()))
        async with s.post(f"{hub.url}/v1/work", data=captured, headers={"Content-Type": "application/x-msgpack"}) as r:
            assert r.status == 200
        tokens = {"owner": hub.owner_token, "auditor": hub.auditor_token, "admin": hub.admin_token}
        await hub.stop()
        hub = await start_hub(tmp_path / "hub", tokens=tokens)
        try:
            async with s.post(f"{hub.url}/v1/work", data=captured, headers={"Content-Type": "application/x-msgpack"}) as r:
                body = await r.json()
                assert r.status == 409 and body["error"] == "replay" and "before this hub started" in body["detail"]
            fresh = seal(node.key, WorkRequest(timestamp=time.time(), nonce=new_nonce(), wait_s=0.0,
                                               cached_chunks=()))
            async with s.post(f"{hub.url}/v1/work", data=fresh, headers={"Content-Type": "application/x-msgpack"}) as r:
                assert r.status == 200  # the node, signing again, is served
        finally:
            await hub.stop()


async def test_restart_between_accepting_and_aggregating_gives_identical_model(tmp_path):
    train, val, spec = write_digits(tmp_path / "d", rounds=1)

    async def run(data_dir, restart: bool) -> str:
        hub = await start_hub(data_dir)
        async with aiohttp.ClientSession() as s:
            job_id = (await (await submit_job(s, hub, spec, train, val)).json())["id"]
            node = SimNode(s, hub.url)
            await node.register()
            if restart:

                async def hold(job, now=None):  # this hub accepts updates but never aggregates
                    return None

                hub.app[LEDGER].rounds.advance = hold
            assert await node.step() is not None
            tokens = {
                "owner": hub.owner_token,
                "auditor": hub.auditor_token,
                "admin": hub.admin_token,
            }
            if restart:
                await hub.stop()
                assert db_rows(hub, "SELECT status FROM updates") == [("accepted",)]
                hub = await start_hub(data_dir, tokens=tokens)  # aggregates on start
            doc = await wait_job(s, hub, job_id)
        await hub.stop()
        return doc["history"][0]["model_hash"]

    plain = await run(tmp_path / "plain", restart=False)
    restarted = await run(tmp_path / "restarted", restart=True)
    assert plain == restarted


async def test_expired_assignment_returns_to_pool_and_late_update_is_refused(tmp_path):
    train, val, spec = write_digits(tmp_path / "d", rounds=1)
    hub = await start_hub(tmp_path / "hub", min_deadline_s=1.5, sweep_interval_s=0.05)
    try:
        async with aiohttp.ClientSession() as s:
            await submit_job(s, hub, spec, train, val)
            slow, fast = SimNode(s, hub.url), SimNode(s, hub.url)
            await slow.register()
            await fast.register()
            a_slow = await slow.work(0.5)
            assert isinstance(a_slow, Assignment)
            blob, samples, loss = await slow.train(
                a_slow
            )  # too slow: the deadline passes meanwhile
            await asyncio.sleep(max(0.0, a_slow.deadline - time.time()) + 0.3)
            a_fast = await fast.work(2.0)
            assert isinstance(a_fast, Assignment)
            assert {c.sha256 for c in a_fast.chunks} == {c.sha256 for c in a_slow.chunks}
            r = await slow.upload_raw(slow.update_header(a_slow, blob, samples, loss), blob)
            assert r.status == 409 and (await r.json())["error"] == "late_update"
            hb = await slow.heartbeat(a_slow.assignment_id)
            ack = await slow.open_response(hb, Ack)
            assert ack.ok is False
            blob2, samples2, loss2 = await fast.train(a_fast)
            assert isinstance(await fast.upload(a_fast, blob2, samples2, loss2), Ack)
            r = await fast.upload_raw(fast.update_header(a_fast, blob2, samples2, loss2), blob2)
            assert r.status == 409 and (await r.json())["error"] == "duplicate_update"
            assert len(db_rows(hub, "SELECT id FROM updates")) == 1
    finally:
        await hub.stop()


async def test_heartbeat_extends_and_abandon_frees_the_shard(tmp_path):
    train, val, spec = write_digits(tmp_path / "d", rounds=1)
    hub = await start_hub(tmp_path / "hub", min_deadline_s=5.0)
    try:
        async with aiohttp.ClientSession() as s:
            await submit_job(s, hub, spec, train, val)
            a_node, b_node = SimNode(s, hub.url), SimNode(s, hub.url)
            await a_node.register()
            await b_node.register()
            a = await a_node.work(0.5)
            assert isinstance(a, Assignment)
            await asyncio.sleep(0.2)
            ack = await a_node.open_response(await a_node.heartbeat(a.assignment_id), Ack)
            assert ack.ok and ack.deadline > a.deadline
            # the same node asking again gets the same assignment back (it may have restarted)
            again = await a_node.work(0.1)
            assert isinstance(again, Assignment) and again.assignment_id == a.assignment_id
            assert isinstance(await b_node.work(0.1), NoWork)  # everything is taken
            r = await b_node.heartbeat(a.assignment_id)
            assert r.status == 403 and (await r.json())["error"] == "not_your_assignment"
            await a_node.open_response(await a_node.abandon(a.assignment_id), Ack)
            b = await b_node.work(1.0)
            assert isinstance(b, Assignment) and b.assignment_id != a.assignment_id
    finally:
        await hub.stop()


async def test_waiting_long_poll_wakes_with_the_next_round(tmp_path):
    train, val, spec = write_digits(tmp_path / "d", rounds=2)
    hub = await start_hub(tmp_path / "hub", long_poll_max_s=20.0)
    try:
        async with aiohttp.ClientSession() as s:
            await submit_job(s, hub, spec, train, val)
            first, waiter = SimNode(s, hub.url), SimNode(s, hub.url)
            await first.register()
            await waiter.register()
            a = await first.work(0.5)
            blob, samples, loss = await first.train(a)
            poll = asyncio.create_task(waiter.work(20.0))
            await asyncio.sleep(0.3)
            assert not poll.done()
            t0 = time.monotonic()
            await first.upload(a, blob, samples, loss)
            nxt = await asyncio.wait_for(poll, 10)
            assert isinstance(nxt, Assignment) and nxt.round == 1
            assert time.monotonic() - t0 < 5.0
    finally:
        await hub.stop()


async def test_stopping_hub_answers_waiting_long_polls_at_once(tmp_path):
    """Shutdown waits for in-flight handlers: a node long-polling for 30 s must not hold it up.
    It gets a NoWork that says why (and when to come back) before the hub's shutdown timeout."""
    hub = await start_hub(tmp_path / "hub", long_poll_max_s=30.0)
    async with aiohttp.ClientSession() as s:
        node = SimNode(s, hub.url)
        await node.register()
        poll = asyncio.create_task(node.work(30.0))
        await asyncio.sleep(0.3)
        assert not poll.done()
        await hub.stop()
        # Without the wake-up the poll outlives the shutdown timeout and its connection is cut.
        answer = await asyncio.wait_for(poll, 5)
    assert isinstance(answer, NoWork) and "shutting down" in answer.reason, answer
    assert 0 < answer.retry_after_s <= 5


async def test_replicas_of_a_shard_agree_and_count_once(tmp_path):
    """Two new (untrusted) nodes agree; no third replica comes within replica_wait_s, so the agreeing
    pair stands unverified: one update counts, the other is redundant, nobody is flagged or credited."""
    # A long replica window: the pair settles at once because no other online node could take
    # a third replica (not because the window ran out), however slowly the second upload comes.
    train, val, spec_path = write_digits(tmp_path / "d", rounds=1, replication="1.0", replica_wait_s=30.0)
    hub = await start_hub(tmp_path / "hub")
    try:
        async with aiohttp.ClientSession() as s:
            job_id = (await (await submit_job(s, hub, spec_path, train, val)).json())["id"]
            n1, n2 = SimNode(s, hub.url), SimNode(s, hub.url)
            await n1.register()
            await n2.register()
            a1 = await n1.work(0.5)
            a2 = await n2.work(0.5)
            assert isinstance(a1, Assignment) and isinstance(a2, Assignment)
            assert hub.replica_group(a1.assignment_id) and hub.replica_group(a1.assignment_id) == hub.replica_group(a2.assignment_id)
            # ...and neither node is told: a signed assignment looks the same replicated or not, so a
            # node cannot behave only where it is checked.
            assert a1.replica_group == a2.replica_group == ""
            assert (a1.seed, [c.sha256 for c in a1.chunks]) == (
                a2.seed,
                [c.sha256 for c in a2.chunks],
            )
            for n, a in ((n1, a1), (n2, a2)):
                blob, samples, loss = await n.train(a)
                await n.upload(a, blob, samples, loss)
            doc = await wait_job(s, hub, job_id)
            statuses = sorted(u["status"] for u in doc["history"][0]["updates"])
            assert statuses == ["included", "redundant"]
            assert doc["history"][0]["replication_overhead"] == 1.0
            async with s.get(f"{hub.url}/v1/nodes", headers=hub.auth(hub.auditor_token)) as r:
                nodes = (await r.json())["nodes"]
            assert all(n["reputation"]["agreements_total"] == 0 for n in nodes)
            assert doc["history"][0]["flags"] == []
            async with s.get(f"{hub.url}/v1/audit-log", headers=hub.auth(hub.auditor_token)) as r:
                assert r.status == 200
                assert b'"aggregation"' in await r.read()
    finally:
        await hub.stop()


async def test_a_node_that_cheats_only_when_unwatched_is_caught(tmp_path):
    """The attack the wire used to allow: a node reads its signed assignment, and cheats (here it
    flips its update's sign) only where the shard is not replicated. The hub never says, so the
    cheat lands on a replicated shard too, disagrees with the honest replica, and the referee
    re-executes both: the cheat's committed training does not give its update, so it is flagged."""
    from gpuflex.protocol.tensors import decode_state, encode_state

    train, val, spec_path = write_digits(tmp_path / "d", rounds=1, replication="1.0", replica_wait_s=30.0)
    hub = await start_hub(tmp_path / "hub")
    try:
        async with aiohttp.ClientSession() as s:
            job_id = (await (await submit_job(s, hub, spec_path, train, val)).json())["id"]
            sly, h1, h2 = SimNode(s, hub.url), SimNode(s, hub.url), SimNode(s, hub.url)
            for n in (sly, h1, h2):
                await n.register()
            cheated = []
            for n in (sly, h1):
                a = await n.work(0.5)
                assert isinstance(a, Assignment) and hub.replica_group(a.assignment_id)
                blob, samples, loss = await n.train(a)
                if n is sly and a.replica_group == "":  # "nobody is checking this one"
                    blob = encode_state({k: -t for k, t in decode_state(blob).items()})
                    cheated.append(a.assignment_id)
                await n.upload(a, blob, samples, loss)
            assert cheated, "the node could not tell a replicated shard from another"
            doc = await finish_job(s, hub, job_id, [sly, h1, h2])
            flags = doc["history"][0]["flags"]
            assert [(f["node_id"], f["reason"]) for f in flags] == [(sly.node_id, "referee_mismatch")], flags
    finally:
        await hub.stop()


async def test_a_lone_untrusted_node_is_not_kept_waiting_and_the_referee_checks_it(tmp_path):
    """Adaptive replication: an untrusted node's shard always wants a replica. Alone, no replica
    can come, so the round does not wait replica_wait_s for one: the referee re-executes a segment
    of its committed update at once (reason no_replica_holder), and the update counts verified."""
    train, val, spec = write_digits(tmp_path / "d", rounds=1, replication='"adaptive"', replica_wait_s=30.0)
    hub = await start_hub(tmp_path / "hub")
    try:
        async with aiohttp.ClientSession() as s:
            job_id = (await (await submit_job(s, hub, spec, train, val)).json())["id"]
            node = SimNode(s, hub.url)
            await node.register()
            a = await node.step()
            assert a is not None and hub.replica_group(a.assignment_id) != "", "an untrusted node's shard is replicated"
            t0 = time.monotonic()
            doc = await finish_job(s, hub, job_id, [node], timeout=20)
            assert time.monotonic() - t0 < 15, "the round waited for a replica that could not come"
            (h,) = doc["history"]
            (upd,) = h["updates"]
            assert h["unverified"] == {} and upd["status"] == "included"
            conn = open_store(hub.data_dir)
            try:
                asked = conn.execute("SELECT reason, status FROM state_requests").fetchall()
            finally:
                conn.close()
            assert [tuple(r) for r in asked] == [("no_replica_holder", "reproduced")]
    finally:
        await hub.stop()


async def test_hold_keeps_a_lone_untrusted_update_out_until_a_replica_agrees(tmp_path):
    """unverified = "hold": a replicated shard nobody confirms stays out, and the job waits; two
    fresh nodes that agree are not enough either (until a group holds a trusted node it needs one
    more agreeing replica), so the round closes once a third node has agreed."""
    train, val, spec = write_digits(tmp_path / "d", rounds=1, replication='"adaptive"', replica_wait_s=0.5)
    spec.write_text(spec.read_text().replace("[verification]", '[verification]\nunverified = "hold"'))
    hub = await start_hub(tmp_path / "hub")
    try:
        async with aiohttp.ClientSession() as s:
            job_id = (await (await submit_job(s, hub, spec, train, val)).json())["id"]
            first = SimNode(s, hub.url)
            await first.register()
            a = await first.step()
            assert a is not None and hub.replica_group(a.assignment_id)
            await asyncio.sleep(1.5)  # the replica wait runs out: "hold" keeps the round open
            async with s.get(f"{hub.url}/v1/jobs/{job_id}", headers=hub.auth()) as r:
                doc = await r.json()
            assert doc["state"] == "running" and doc["history"] == []
            for _ in range(2):
                other = SimNode(s, hub.url)
                await other.register()
                b = await other.step()
                assert b is not None and hub.replica_group(b.assignment_id) == hub.replica_group(a.assignment_id), "a newcomer takes the replica"
            doc = await wait_job(s, hub, job_id, timeout=20)
            (h,) = doc["history"]
            assert h["unverified"] == {}
            assert sorted(u["status"] for u in h["updates"]) == ["included", "redundant", "redundant"]
    finally:
        await hub.stop()


async def test_blobs_only_for_a_live_assignment_and_range_works(running_hub, digits_npz):
    train, val, spec = digits_npz
    async with aiohttp.ClientSession() as s:
        await submit_job(s, running_hub, spec, train, val)
        node, other = SimNode(s, running_hub.url), SimNode(s, running_hub.url)
        await node.register()
        await other.register()
        a = await node.work(0.5)
        sha = a.chunks[0].sha256
        headers = node.blob_auth(sha) | {"Range": "bytes=0-9"}
        async with s.get(f"{running_hub.url}/v1/blobs/{sha}", headers=headers) as r:
            assert r.status == 206 and len(await r.read()) == 10
        for blob_id in (sha, a.model_hash):  # both small: served from the hub's memory cache
            async with s.get(f"{running_hub.url}/v1/blobs/{blob_id}", headers=node.blob_auth(blob_id)) as r:
                whole = await r.read()
                assert r.status == 200 and hashlib.sha256(whole).hexdigest() == blob_id
            for rng, want in ((f"bytes=5-{len(whole) + 50}", whole[5:]), ("bytes=-7", whole[-7:]),
                              (f"bytes={len(whole) - 3}-", whole[-3:])):
                async with s.get(f"{running_hub.url}/v1/blobs/{blob_id}",
                                 headers=node.blob_auth(blob_id) | {"Range": rng}) as r:
                    assert r.status == 206 and await r.read() == want, rng
                    assert r.headers["Content-Range"].endswith(f"/{len(whole)}")
            async with s.get(f"{running_hub.url}/v1/blobs/{blob_id}",
                             headers=node.blob_auth(blob_id) | {"Range": f"bytes={len(whole) + 10}-"}) as r:
                assert r.status == 416
        async with s.get(f"{running_hub.url}/v1/blobs/{sha}", headers=other.blob_auth(sha)) as r:
            assert r.status == 403 and (await r.json())["error"] == "not_assigned"
        auth = node.blob_auth(sha)
        async with s.get(f"{running_hub.url}/v1/blobs/{sha}", headers=auth) as r:
            assert r.status == 200
        async with s.get(
            f"{running_hub.url}/v1/blobs/{sha}", headers=auth
        ) as r:  # same nonce again
            assert r.status == 409 and (await r.json())["error"] == "replay"


async def test_cancel_stops_the_job(running_hub, digits_npz):
    train, val, spec = digits_npz
    async with aiohttp.ClientSession() as s:
        job_id = (await (await submit_job(s, running_hub, spec, train, val)).json())["id"]
        node = SimNode(s, running_hub.url)
        await node.register()
        a = await node.work(0.5)
        blob, samples, loss = await node.train(a)
        async with s.post(
            f"{running_hub.url}/v1/jobs/{job_id}/cancel", headers=running_hub.auth()
        ) as r:
            assert r.status == 200 and (await r.json())["state"] == "cancelled"
        async with s.get(
            f"{running_hub.url}/v1/blobs/{a.model_hash}", headers=node.blob_auth(a.model_hash)
        ) as r:
            assert r.status == 403  # no live assignment any more
        r = await node.upload_raw(node.update_header(a, blob, samples, loss), blob)
        assert r.status == 409 and (await r.json())["error"] == "late_update"
        assert isinstance(await node.work(0.1), NoWork)


async def test_spec_with_validation_fraction_and_csv(running_hub, tmp_path):
    import numpy as np

    from tests.helpers import digits_arrays

    x, y, _, _ = digits_arrays()
    csv = tmp_path / "train.csv"
    header = ",".join([f"f{i}" for i in range(64)] + ["digit"])
    rows = [
        ",".join(f"{v:g}" for v in row) + f",{label}"
        for row, label in zip(x[:400], y[:400], strict=True)
    ]
    csv.write_text(header + "\n" + "\n".join(rows) + "\n")
    spec = digits_spec(rounds=1, extra="").replace(
        'split = "stratified"',
        'split = "stratified"\nvalidation_fraction = 0.25\nlabel_column = "digit"',
    )
    async with aiohttp.ClientSession() as s:
        r = await submit_job(s, running_hub, spec, csv)
        assert r.status == 201, await r.text()
        job_id = (await r.json())["id"]
        node = SimNode(s, running_hub.url)
        await node.register()
        await node.step()
        doc = await wait_job(s, running_hub, job_id)
        assert doc["val_samples"] + doc["train_samples"] == 400 and 90 <= doc["val_samples"] <= 110
        assert doc["history"][0]["accuracy"] is not None
    assert np.isfinite(doc["history"][0]["loss"])


async def test_server_optimizer_state_persists_and_health_metrics(tmp_path):
    train, val, spec = write_digits(tmp_path / "d", rounds=2)
    spec.write_text(spec.read_text() + '\n[aggregation]\nserver_optimizer = "fedavgm"\nserver_lr = 1.0\n')
    hub = await start_hub(tmp_path / "hub", long_poll_max_s=10.0)
    try:
        async with aiohttp.ClientSession() as s:
            job_id = (await (await submit_job(s, hub, spec, train, val)).json())["id"]
            node = SimNode(s, hub.url)
            await node.register()
            a = await node.step()
            nxt = await node.work(5.0)  # long-polls until round 1 opens
            assert a.round == 0 and nxt.round == 1
            (opt_sha,) = db_rows(hub, "SELECT opt_state_sha FROM jobs WHERE id = ?", job_id)[0]
            assert opt_sha and opt_sha in stored_blobs(hub.data_dir)
            blob, samples, loss = await node.train(nxt)
            await node.upload(nxt, blob, samples, loss)
            doc = await wait_job(s, hub, job_id)
            assert doc["history"][1]["accuracy"] > 0.5
            async with s.get(f"{hub.url}/healthz") as r:
                assert r.status == 200 and (await r.json())["ok"] is True
            async with s.get(f"{hub.url}/metrics") as r:
                text = await r.text()
            for name in ("gpuflex_nodes_online 1", "gpuflex_rounds_closed_total 2", "gpuflex_assignments_in_flight 0",
                         "gpuflex_updates_accepted_total 2", "gpuflex_bytes_in_total", "gpuflex_bytes_out_total"):
                assert name in text, name
    finally:
        await hub.stop()
