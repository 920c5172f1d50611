"""Collusion and Sybil attacks (issue 14, item 7), replayed by a hand-written client that speaks
only the public protocol, against a real hub over loopback with the production defences.

Linux routes all of 127.0.0.0/8 to loopback, so a client session bound to 127.0.N.x reaches
the hub at 127.0.0.1 from address block 127.0.N.0/24: the tests put identities in one block
or in distinct blocks for real. Each attack is the one the issue lists; each test failed on
the hub before the defences (see the report of branch sybil), and the pure rules have unit
tests at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sqlite3
import time
from typing import Any

import aiohttp
import msgpack
import pytest
import torch
from gpuflex.hub.base.config import HubConfig
from gpuflex.hub.base.errors import Forbidden, TooManyRequests
from gpuflex.hub.policy.admission import Admission, address_block
from gpuflex.hub.policy.progress import Progress, heartbeat_deadline, stall_backoff
from gpuflex.hub.policy.reputation import Reputation, is_trusted, record_flag, record_withdrawn
from gpuflex.hub.policy.round_policy import bound_weights, norm_bound_scales
from gpuflex.protocol.errors import SpecError
from gpuflex.protocol.jobspec import VerificationSpec, parse_job_spec
from gpuflex.protocol.messages import Ack, Assignment, NoWork, progress_digest
from gpuflex.protocol.signing import new_nonce, seal_bytes
from gpuflex.protocol.tensors import decode_state, encode_state, state_from_safetensors
from gpuflex.protocol.version import PROTOCOL_VERSION
from gpuflex.protocol.workload import assignment_steps

from tests.helpers import (
    SimNode,
    digits_spec,
    finish_job,
    open_store,
    production_defences,
    sessions_from,
    start_hub,
    submit_job,
    wait_job,
    when_job_arrives,
    write_digits,
)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)




async def register_raw(node: SimNode, **hello: Any) -> aiohttp.ClientResponse:
    """POST a signed hello; the raw response (the tests look at refusals)."""
    from gpuflex.protocol.signing import seal

    if node.hub_public is None:
        async with node.session.get(node.url + "/v1/hub") as r:
            node.hub_public = bytes.fromhex((await r.json())["public_key"])
    return await node.post("/v1/nodes/register", seal(node.key, node.hello(**hello)))


def db_rows(hub, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    conn = open_store(hub.data_dir)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def spec(**kw: Any) -> str:
    extra = kw.pop("extra", "")
    return digits_spec(**kw, extra=extra)


# --------------------------------------------------------------------------- replicas and blocks


async def test_three_identities_of_one_block_never_hold_replicas_of_one_shard(tmp_path):
    """Attack: three fresh identities run from one process held every replica of a shard, so
    their identical crafted update 'agreed'. Now a replica never goes to a second node of the
    block; a node of another block gets it."""
    train, val, _ = write_digits(tmp_path / "d")
    hub = await start_hub(tmp_path / "hub", **production_defences())
    try:
        async with sessions_from("127.0.0.1", "127.0.21.1", "127.0.21.2", "127.0.21.3", "127.0.22.1") as (
            owner, s1, s2, s3, s_honest
        ):
            r = await submit_job(owner, hub, spec(rounds=1, replication='"adaptive"'), train, val)
            assert r.status == 201, await r.text()
            colluders = [SimNode(s, hub.url) for s in (s1, s2, s3)]
            honest = SimNode(s_honest, hub.url)
            for n in (*colluders, honest):
                await n.register()
            first = await colluders[0].work(0.5)
            assert isinstance(first, Assignment) and hub.replica_group(first.assignment_id), "an untrusted node's shard is replicated"
            for c in colluders[1:]:
                got = await c.work(0.5)
                assert not (isinstance(got, Assignment) and hub.replica_group(got.assignment_id) == hub.replica_group(first.assignment_id)), (
                    "a second identity of the same address block got a replica of the first one's shard")
            replica = await honest.work(0.5)
            assert isinstance(replica, Assignment) and hub.replica_group(replica.assignment_id) == hub.replica_group(first.assignment_id)
            assert [c.sha256 for c in replica.chunks] == [c.sha256 for c in first.chunks]
            async with owner.get(hub.url + "/v1/nodes", headers=hub.auth(hub.auditor_token)) as resp:
                listed = {n["id"]: n for n in (await resp.json())["nodes"]}
            assert {listed[c.node_id]["address_block"] for c in colluders} == {"127.0.21.0/24"}
            assert listed[honest.node_id]["address_block"] == "127.0.22.0/24"
            assert listed[honest.node_id]["probation"] is True
    finally:
        await hub.stop()


async def test_two_nodes_of_one_operator_in_distinct_blocks_never_replicate_each_other(tmp_path):
    """The operator rule: nodes registered with one enrollment token are one operator, wherever
    they connect from."""
    train, val, _ = write_digits(tmp_path / "d")
    hub = await start_hub(tmp_path / "hub", **production_defences())
    token = hub.token("enroll", "lab-one")
    try:
        async with sessions_from("127.0.0.1", "127.0.31.1", "127.0.32.1", "127.0.33.1") as (owner, s1, s2, s3):
            r = await submit_job(owner, hub, spec(rounds=1, replication='"adaptive"'), train, val)
            assert r.status == 201, await r.text()
            a, b, other = SimNode(s1, hub.url), SimNode(s2, hub.url), SimNode(s3, hub.url)
            for n, tok in ((a, token), (b, token), (other, "")):
                resp = await register_raw(n, enroll_token=tok)
                assert resp.status == 200, await resp.text()
            first = await a.work(0.5)
            assert isinstance(first, Assignment) and hub.replica_group(first.assignment_id)
            second = await b.work(0.5)
            assert not (isinstance(second, Assignment) and hub.replica_group(second.assignment_id) == hub.replica_group(first.assignment_id))
            third = await other.work(0.5)
            assert isinstance(third, Assignment) and hub.replica_group(third.assignment_id) == hub.replica_group(first.assignment_id)
    finally:
        await hub.stop()


# --------------------------------------------------------------------------- registration


async def test_fifty_registrations_from_one_process_are_rate_limited(tmp_path):
    """Attack: fifty registrations from one process were all accepted within 0.2 s. Now a block
    gets registrations_per_block new identities per window; the rest get one clear 429 with
    Retry-After, and a known identity re-registering (a restart) is never limited."""
    hub = await start_hub(tmp_path / "hub", **production_defences())
    per_block = HubConfig(data_dir=tmp_path).registrations_per_block
    try:
        async with sessions_from("127.0.41.7") as (s,):
            nodes = [SimNode(s, hub.url) for _ in range(50)]
            t0 = time.monotonic()
            answers = await asyncio.gather(*(register_raw(n) for n in nodes))
            assert time.monotonic() - t0 < 30
            ok = [n for n, r in zip(nodes, answers, strict=True) if r.status == 200]
            refused = [r for r in answers if r.status != 200]
            assert len(ok) == per_block, [r.status for r in answers]
            assert {r.status for r in refused} == {429}
            body = await refused[0].json()
            assert body["error"] == "rate_limited" and "\n" not in body["detail"]
            assert "try again later" in body["detail"]
            assert 1 <= int(refused[0].headers["Retry-After"]) <= 3600
            again = await register_raw(ok[0])  # a restart of an admitted node
            assert again.status == 200, await again.text()
    finally:
        await hub.stop()


async def test_registrations_are_limited_in_all_and_per_block_in_probation(tmp_path):
    """The global limit holds across blocks, and a block cannot have more than
    probation_per_block identities still earning trust, whatever the per-window limit."""
    hub = await start_hub(tmp_path / "hub", **{**production_defences(), "registrations_global": 4})
    try:
        async with sessions_from(*(f"127.0.{50 + i}.1" for i in range(6))) as ss:
            codes = [(await register_raw(SimNode(s, hub.url))).status for s in ss]
            assert codes == [200, 200, 200, 200, 429, 429]
    finally:
        await hub.stop()
    hub = await start_hub(tmp_path / "hub2", **{**production_defences(), "registrations_per_block": 100,
                                                "probation_per_block": 3})
    try:
        async with sessions_from("127.0.60.1") as (s,):
            answers = [await register_raw(SimNode(s, hub.url)) for _ in range(4)]
            assert [r.status for r in answers] == [200, 200, 200, 429]
            assert (await answers[-1].json())["error"] == "probation_full"
    finally:
        await hub.stop()


async def test_enrollment_token_required_when_the_hub_says_so(tmp_path):
    """`--require-enrollment`: no token, a wrong one or a revoked one is refused in one line; an
    enrollment token is no API token either."""
    from gpuflex.hub.storage.token_admin import list_tokens, revoke_token

    hub = await start_hub(tmp_path / "hub", require_enrollment=True)
    token = hub.token("enroll", "lab")
    try:
        async with sessions_from("127.0.70.1") as (s,):
            r = await register_raw(SimNode(s, hub.url))
            assert r.status == 403 and (await r.json())["error"] == "enrollment_required"
            r = await register_raw(SimNode(s, hub.url), enroll_token="gft_not-a-token")
            assert r.status == 403 and (await r.json())["error"] == "bad_enrollment"
            node = SimNode(s, hub.url)
            r = await register_raw(node, enroll_token=token)
            assert r.status == 200, await r.text()
            async with s.get(hub.url + "/v1/jobs", headers=hub.auth(token)) as api:
                assert api.status == 401
            (row,) = [t for t in list_tokens(hub.data_dir, store=hub.store) if t["role"] == "enroll"]
            assert row["id"] == "e1"
            revoke_token(hub.data_dir, row["id"], store=hub.store)
            r = await register_raw(SimNode(s, hub.url), enroll_token=token)
            assert r.status == 403 and (await r.json())["error"] == "bad_enrollment"
            assert db_rows(hub, "SELECT operator FROM nodes WHERE id = ?", node.node_id) == [("op-1",)]
    finally:
        await hub.stop()


async def _free_ride(node: SimNode, a: Assignment) -> None:
    """Upload an all-zero update of the right shape: a free ride, flagged at the round's close."""
    blob, samples, loss = await node.train(a)
    zeros = {k: torch.zeros_like(v) for k, v in decode_state(bytearray(blob)).items()}
    await node.upload(a, encode_state(zeros), samples, loss)


async def test_a_banned_nodes_block_and_operator_get_no_fresh_identity(tmp_path):
    """Attack: an operator whose node had been banned registered a new key at once and got work.
    Now, for ban_cooldown_s, its block and its operator (enrollment token) admit no new identity;
    other blocks are unaffected."""
    train, val, _ = write_digits(tmp_path / "d")
    hub = await start_hub(tmp_path / "hub")
    token = hub.token("enroll", "lab")
    try:
        async with sessions_from("127.0.0.1", "127.0.81.1", "127.0.81.2", "127.0.82.1", "127.0.83.1") as (
            owner, s_bad, s_same_block, s_other_block, s_clean
        ):
            r = await submit_job(owner, hub, spec(rounds=3), train, val)
            assert r.status == 201, await r.text()
            job_id = (await r.json())["id"]
            bad = SimNode(s_bad, hub.url)
            assert (await register_raw(bad, enroll_token=token)).status == 200
            for _ in range(3):
                a = await bad.work(2.0)
                assert isinstance(a, Assignment)
                await _free_ride(bad, a)
            await wait_job(owner, hub, job_id)
            async with owner.get(f"{hub.url}/v1/flags", headers=hub.auth(hub.auditor_token)) as resp:
                flags = (await resp.json())["flags"]
            assert len(flags) >= 3
            for f in flags[:3]:
                async with owner.post(f"{hub.url}/v1/flags/{f['id']}/verdict", headers=hub.auth(hub.auditor_token),
                                      json={"verdict": "confirm", "note": "free ride"}) as resp:
                    assert resp.status == 200, await resp.text()
            assert (await register_raw(bad)).status == 403  # banned itself
            fresh = await register_raw(SimNode(s_same_block, hub.url))
            assert fresh.status == 403 and (await fresh.json())["error"] == "cooldown"
            fresh = await register_raw(SimNode(s_other_block, hub.url), enroll_token=token)
            assert fresh.status == 403 and (await fresh.json())["error"] == "cooldown"
            assert (await register_raw(SimNode(s_clean, hub.url))).status == 200
    finally:
        await hub.stop()
    hub2 = await start_hub(tmp_path / "hub", tokens={"owner": hub.owner_token, "auditor": hub.auditor_token,
                                                     "admin": hub.admin_token})  # one hub per folder: after the first
    try:  # the cooldown survives a restart (the ban time is stored)
        async with sessions_from("127.0.81.3") as (s,):
            again = await register_raw(SimNode(s, hub2.url))
            assert again.status == 403 and (await again.json())["error"] == "cooldown"
    finally:
        await hub2.stop()


# --------------------------------------------------------------------------- throughput


async def test_a_node_claiming_1e9_samples_per_s_gets_a_capped_shard(tmp_path):
    """Attack: a node claiming 1e9 samples/s was handed every chunk and downloaded the whole
    training set. Now an unproven node's shard is capped at unproven_max_chunks (doubling per
    delivery), and chunks outside it are refused."""
    train, val, _ = write_digits(tmp_path / "d")
    hub = await start_hub(tmp_path / "hub", **production_defences())
    cap = HubConfig(data_dir=tmp_path).unproven_max_chunks
    try:
        async with sessions_from("127.0.0.1", "127.0.91.1") as (owner, s):
            r = await submit_job(owner, hub, spec(rounds=2, chunk_size=32), train, val)
            assert r.status == 201, await r.text()
            job_id = (await r.json())["id"]
            chunks = [c for (c,) in db_rows(hub, "SELECT sha FROM chunks WHERE job_id = ?", job_id)]
            assert len(chunks) > 4 * cap
            liar = SimNode(s, hub.url, samples_per_s=1e9)
            await liar.register()
            a = await liar.work(1.0)
            assert isinstance(a, Assignment)
            assert len(a.chunks) <= cap, f"{len(a.chunks)} of {len(chunks)} chunks to an unproven node"
            mine = {c.sha256 for c in a.chunks}
            other = next(c for c in chunks if c not in mine)
            async with s.get(f"{hub.url}/v1/blobs/{other}", headers=liar.blob_auth(other)) as resp:
                assert resp.status == 403
            blob, samples, loss = await liar.train(a)
            await liar.upload(a, blob, samples, loss)
            b = await liar.work(1.0)
            assert isinstance(b, Assignment) and len(b.chunks) <= 2 * cap
            ema = db_rows(hub, "SELECT ema_sps FROM nodes WHERE id = ?", liar.node_id)[0][0]
            assert ema < 1e9
    finally:
        await hub.stop()


async def test_an_unproven_node_among_several_gets_its_equal_part_not_what_it_claims(tmp_path):
    """Two fresh nodes wait when the job arrives; one claims 1e9 samples/s. Neither climbs the
    ramp of unproven_max_chunks (a round of small shards each), and the liar gets no more than
    its equal half of the round's chunks, whatever it claims."""
    train, val, _ = write_digits(tmp_path / "d")
    hub = await start_hub(tmp_path / "hub", long_poll_max_s=10.0, **production_defences())
    cap = HubConfig(data_dir=tmp_path).unproven_max_chunks
    try:
        async with sessions_from("127.0.0.1", "127.0.92.1", "127.0.93.1") as (owner, s1, s2):
            liar, honest = SimNode(s1, hub.url, samples_per_s=1e9), SimNode(s2, hub.url, samples_per_s=500.0)
            job, got = await when_job_arrives([liar, honest], owner, hub, spec(rounds=1, chunk_size=32), train, val)
            job_id = job["id"]
            assert all(isinstance(a, Assignment) for a in got)
            total = len(db_rows(hub, "SELECT sha FROM chunks WHERE job_id = ?", job_id))
            sizes = [len(a.chunks) for a in got]
            assert all(cap < n <= math.ceil(total / 2) for n in sizes), (sizes, total)
            assert sum(sizes) == total  # one shard each covers the round
    finally:
        await hub.stop()


# --------------------------------------------------------------------------- progress


def legacy_heartbeat(node: SimNode, assignment_id: str, progress: float) -> bytes:
    """A heartbeat as the issue's client sent it (no steps, no digest), signed."""
    payload = msgpack.packb({"v": PROTOCOL_VERSION, "kind": "heartbeat", "assignment_id": assignment_id,
                             "progress": progress, "timestamp": time.time(), "nonce": new_nonce()},
                            use_bin_type=True)
    return seal_bytes(node.key, "heartbeat", payload)


async def _sybil_heartbeats(sybils: list[tuple[SimNode, Assignment]], stop: asyncio.Event) -> None:
    """Every Sybil claims progress: a growing step count and a well-formed digest chain."""
    while not stop.is_set():
        for node, a in sybils:
            resp = await node.heartbeat(a.assignment_id, 0.5)  # one more (fake) step each time
            if resp.status == 400:  # a hub without progress proofs: the issue's heartbeat
                resp = await node.post("/v1/heartbeat", legacy_heartbeat(node, a.assignment_id, 0.5))
            resp.release()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.3)


async def test_sybils_holding_every_shard_with_heartbeats_no_longer_stall_the_job(tmp_path):
    """Attack: fresh identities took every shard (and every replica) of round 0, sent heartbeats
    and never uploaded; a job with 3 honest nodes online made no progress, because every
    heartbeat pushed the deadline forward (up to 6 h). Now a deadline moves only on proven
    progress and within progress_extension_max x its first window, the expired Sybils back off,
    and the honest nodes finish the job."""
    train, val, _ = write_digits(tmp_path / "d")
    hub = await start_hub(tmp_path / "hub", **{**production_defences(), "min_deadline_s": 3.0})
    stop = asyncio.Event()
    n_sybils = 16
    addresses = ["127.0.0.1", *(f"127.0.{100 + i}.1" for i in range(n_sybils)),
                 *(f"127.0.{150 + i}.1" for i in range(3))]
    try:
        async with sessions_from(*addresses) as ss:
            owner, sybil_sessions, honest_sessions = ss[0], ss[1:1 + n_sybils], ss[1 + n_sybils:]
            r = await submit_job(owner, hub, spec(rounds=1, replication='"adaptive"'), train, val)
            assert r.status == 201, await r.text()
            job_id = (await r.json())["id"]
            sybils: list[tuple[SimNode, Assignment]] = []
            beats = asyncio.create_task(_sybil_heartbeats(sybils, stop))  # beats from the first shard on
            idle = [SimNode(s, hub.url, samples_per_s=1e9) for s in sybil_sessions]
            for node in idle:
                await node.register()
            for _ in range(4):  # the hub's view of who is online is refreshed each second: ask again
                for node in list(idle):
                    a = await node.work(0.1)
                    if isinstance(a, Assignment):
                        sybils.append((node, a))
                        idle.remove(node)
                await asyncio.sleep(0.6)
            honest = [SimNode(s, hub.url) for s in honest_sessions]
            for h in honest:
                await h.register()
            assert isinstance(await honest[0].work(0.2), NoWork), "the Sybils should hold every shard"

            async def honest_loop(h: SimNode) -> None:
                while not stop.is_set():
                    await h.step(wait_s=1.0)

            workers = [asyncio.create_task(honest_loop(h)) for h in honest]
            try:
                doc = await wait_job(owner, hub, job_id, timeout=60.0)
            finally:
                stop.set()
                for t in (beats, *workers):
                    t.cancel()
                await asyncio.gather(beats, *workers, return_exceptions=True)
            assert doc["state"] == "done"
            expired = db_rows(hub, "SELECT COUNT(*) FROM assignments WHERE state = 'expired'")[0][0]
            assert expired >= len(sybils)
    finally:
        await hub.stop()


async def test_a_heartbeat_without_new_steps_does_not_extend_the_deadline(tmp_path):
    """The progress rule over the wire: the same steps again, or no steps, move nothing; new
    steps move the deadline, never past the bound."""
    train, val, _ = write_digits(tmp_path / "d")
    hub = await start_hub(tmp_path / "hub", min_deadline_s=5.0)
    try:
        async with sessions_from("127.0.0.1", "127.0.120.1") as (owner, s):
            r = await submit_job(owner, hub, spec(rounds=1), train, val)
            assert r.status == 201
            node = SimNode(s, hub.url)
            await node.register()
            a = await node.work(1.0)
            assert isinstance(a, Assignment)

            async def beat(**kw: Any) -> float:
                resp = await node.heartbeat(a.assignment_id, **kw)
                ack = await node.open_response(resp, Ack)
                return float(ack.deadline)

            d0 = await beat(steps=0)
            assert d0 == pytest.approx(a.deadline)
            await asyncio.sleep(0.3)
            d1 = await beat()  # step 1
            assert d1 > d0
            await asyncio.sleep(0.3)
            assert await beat(steps=1) == d1  # the same step again
            for _ in range(40):
                d = await beat()
            assert d <= a.issued_at + 4.0 * 5.0 + 1e-6
    finally:
        await hub.stop()


# --------------------------------------------------------------------------- the norm bound


async def test_a_crafted_x3_5_update_does_not_get_in_unchanged(tmp_path):
    """Attack: an update scaled x3.5 (under norm_ratio_max = 4) was aggregated as it came, whether
    its colluding replica partners agreed or stalled. Now an update whose norm per sample is over
    norm_bound (2.5) x the round's median is scaled down to the bound before aggregating."""
    train, val, _ = write_digits(tmp_path / "d")
    hub = await start_hub(tmp_path / "hub")
    try:
        async with sessions_from("127.0.0.1", *(f"127.0.{130 + i}.1" for i in range(4))) as ss:
            owner, node_sessions = ss[0], ss[1:]
            nodes = [SimNode(s, hub.url) for s in node_sessions]
            for n in nodes:
                await n.register()
                await n.work(0.05)  # polled just now: in the gathering the round is cut for
            r = await submit_job(owner, hub, spec(rounds=1), train, val)
            assert r.status == 201, await r.text()
            job_id = (await r.json())["id"]
            got = await asyncio.gather(*(n.work(1.0) for n in nodes))
            assert all(isinstance(a, Assignment) for a in got)
            deltas: dict[str, dict[str, torch.Tensor]] = {}
            samples: dict[str, int] = {}
            for i, (n, a) in enumerate(zip(nodes, got, strict=True)):
                blob, count, loss = await n.train(a)
                delta = decode_state(bytearray(blob))
                if i == 0:  # the crafted one
                    delta = {k: v * 3.5 for k, v in delta.items()}
                    blob = encode_state(delta)
                deltas[a.assignment_id] = {k: v.double() for k, v in delta.items()}
                samples[a.assignment_id] = count
                await n.upload(a, blob, count, loss)
            await wait_job(owner, hub, job_id)
            async with owner.get(f"{hub.url}/v1/jobs/{job_id}/model?round=0", headers=hub.auth()) as resp:
                before = state_from_safetensors(await resp.read())
            async with owner.get(f"{hub.url}/v1/jobs/{job_id}/model?round=1", headers=hub.auth()) as resp:
                after = state_from_safetensors(await resp.read())
        (evidence,) = db_rows(hub, "SELECT evidence FROM rounds WHERE job_id = ? AND round = 0", job_id)[0]
        bounds = json.loads(evidence)["bounds"]
        crafted = "u-" + got[0].assignment_id.removeprefix("a-")
        assert list(bounds["clipped"]) == [crafted]
        scale = bounds["clipped"][crafted]
        assert 0.5 < scale < 1.0
        moved = {k: after[k].double() - before[k].double() for k in before}
        total = sum(samples.values())

        def mean(factor: float) -> dict[str, torch.Tensor]:
            return {k: sum(deltas[a][k] * samples[a] * (factor if a == got[0].assignment_id else 1.0)
                           for a in deltas) / total for k in before}

        def dist(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> float:
            return math.sqrt(sum(float(((x[k] - y[k]) ** 2).sum()) for k in x))

        unchanged, bounded = mean(1.0), mean(scale)
        assert dist(moved, bounded) < 1e-3 * dist(unchanged, bounded) + 1e-6
        assert dist(moved, unchanged) > 0.5 * dist(unchanged, bounded)
    finally:
        await hub.stop()


async def test_a_crafted_update_without_a_commitment_whose_partner_replica_stalls_gets_nothing_in(tmp_path):
    """Attack: one colluder uploaded a x3.5 update with no checkpoint commitment while its partner
    held the replica and stalled; once replica_wait_s had passed the update was aggregated as it
    came (unverified, clipped and weight-bounded, never re-executed). Now the job may ask the
    referee, so an update without a commitment is refused at upload: both assignments run out,
    the honest nodes train the shard, and nothing of the colluder is stored or aggregated."""
    train, val, _ = write_digits(tmp_path / "d")
    hub = await start_hub(tmp_path / "hub", min_deadline_s=3.0)
    try:
        async with sessions_from("127.0.0.1", *(f"127.0.{170 + i}.1" for i in range(5))) as ss:
            owner = ss[0]
            c1, c2, h1, h2, h3 = nodes = [SimNode(s, hub.url) for s in ss[1:]]
            for n in nodes:
                await n.register()
                await n.work(0.05)  # in the gathering the round is cut for
            r = await submit_job(owner, hub, spec(rounds=1, replication='"adaptive"', replica_wait_s=1.0),
                                 train, val)
            assert r.status == 201, await r.text()
            job_id = (await r.json())["id"]
            a_c1 = await c1.work(1.0)
            a_c2 = await c2.work(1.0)  # the partner takes the replica, and never delivers it
            assert isinstance(a_c1, Assignment) and isinstance(a_c2, Assignment)
            assert hub.replica_group(a_c2.assignment_id) == hub.replica_group(a_c1.assignment_id)
            blob, count, loss = await c1.train(a_c1)
            crafted = encode_state({k: v * 3.5 for k, v in decode_state(bytearray(blob)).items()})
            resp = await c1.upload_raw(c1.update_header(a_c1, crafted, count, loss, commitment=None), crafted)
            assert (resp.status, (await resp.json())["error"]) == (400, "commitment_required")
            doc = await finish_job(owner, hub, job_id, [h1, h2, h3])
        assert doc["state"] == "done"
        included = {u["node_id"] for u in doc["history"][0]["updates"] if u["status"] == "included"}
        assert included and included <= {h1.node_id, h2.node_id, h3.node_id}, included
        assert db_rows(hub, "SELECT id FROM updates WHERE node_id IN (?, ?)", c1.node_id, c2.node_id) == []
        assert db_rows(hub, "SELECT state FROM assignments WHERE id IN (?, ?)", a_c1.assignment_id,
                       a_c2.assignment_id) == [("expired",), ("expired",)]
    finally:
        await hub.stop()


# --------------------------------------------------------------------------- an outvoted honest node


async def _wait(pred, timeout: float = 30.0) -> None:
    give_up = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < give_up, "timed out"
        await asyncio.sleep(0.05)


async def test_colluders_cannot_outvote_an_honest_replica_the_referee_replays_each(tmp_path):
    """Attack: two colluders out-voted an honest replica with an identical crafted update, and the
    honest node's run of agreements was reset (given back only if the round's review then caught
    the colluders' update). Now every member of a disagreeing group carries a commitment, and the
    referee re-executes each: the honest node reproduces and keeps its run, the colluders' crafted
    update is not what their committed training gives, and they are flagged."""
    from gpuflex.hub.server.appkeys import LEDGER

    train, val, _ = write_digits(tmp_path / "d")
    hub = await start_hub(tmp_path / "hub", throughput_alpha=0.0)  # shard sizes stay as seeded
    ledger = hub.app[LEDGER]
    try:
        async with sessions_from("127.0.0.1", *(f"127.0.{200 + i}.1" for i in range(7))) as ss:
            owner = ss[0]
            # a few chunks per shard (2,000 samples/s x round_target_s 0.1 s), so a round has several
            h, c1, c2, x, y, z, w = nodes = [SimNode(s, hub.url, samples_per_s=2000.0) for s in ss[1:]]
            for n in nodes:
                await n.register()
                await n.work(0.05)  # in the gathering the first round is cut for
            r = await submit_job(owner, hub, spec(rounds=2, replication="1.0", round_target_s=0.1,
                                                  extra="trust_after = 1\nmax_replicas = 3\n"), train, val)
            assert r.status == 201, await r.text()
            job_id = (await r.json())["id"]
            job = ledger.scheduler.jobs[job_id]

            async def step_in(n: SimNode, round_: int) -> None:
                a = await n.work(0.3)
                if isinstance(a, Assignment) and a.round == round_:
                    blob, count, loss = await n.train(a)
                    await n.upload(a, blob, count, loss)
                elif isinstance(a, Assignment):  # the next round opened: leave it to the script
                    (await n.abandon(a.assignment_id)).release()

            async def everyone_works(round_: int, who: tuple[SimNode, ...]) -> None:
                while job.round == round_:
                    await asyncio.gather(*(step_in(n, round_) for n in who))

            # round 0: every pair trains honestly and agrees -> every node has a run of 1 (trusted)
            for n in nodes:
                a = await n.work(0.5)
                if isinstance(a, Assignment):
                    blob, count, loss = await n.train(a)
                    await n.upload(a, blob, count, loss)
            await everyone_works(0, (h, c1, c2, x, y, z, w))
            run = {n.node_id: ledger.scheduler.nodes[n.node_id].reputation.consecutive_agreements for n in nodes}
            assert run[h.node_id] >= 1 and run[c1.node_id] >= 1 and run[c2.node_id] >= 1, run
            # round 1: the honest node and a colluder share a shard; the colluder sends a crafted update
            a_h = await h.work(1.0)
            a_c1 = await c1.work(1.0)
            assert isinstance(a_h, Assignment) and isinstance(a_c1, Assignment)
            assert hub.replica_group(a_c1.assignment_id) == hub.replica_group(a_h.assignment_id)
            honest_blob, count, loss = await h.train(a_h)
            await c1.train(a_c1)  # the colluder's commitment is honest training's: it binds another update
            crafted = encode_state({k: -v for k, v in decode_state(bytearray(honest_blob)).items()})
            await h.upload(a_h, honest_blob, count, loss)
            await c1.upload(a_c1, crafted, count, loss)
            await everyone_works(1, (h, c1, c2, x, y, z, w))  # each hands its states over when asked
            await wait_job(owner, hub, job_id)
        flags = db_rows(hub, "SELECT node_id, reason FROM flags")
        assert (c1.node_id, "referee_mismatch") in flags and not [f for f in flags if f[0] == h.node_id], flags
        verdicts = db_rows(hub, "SELECT node_id, status FROM state_requests WHERE shard_id = ?",
                           hub.replica_group(a_h.assignment_id))
        assert (h.node_id, "reproduced") in verdicts and (c1.node_id, "mismatch") in verdicts, verdicts
        assert ledger.scheduler.nodes[h.node_id].reputation.consecutive_agreements >= run[h.node_id]
        assert ledger.scheduler.nodes[c1.node_id].suspended is not None  # a proven mismatch stops it
    finally:
        await hub.stop()


# --------------------------------------------------------------------------- the real node


async def test_the_real_node_enrolls_and_connects_from_its_source_address(tmp_path):
    """`gpuflex-node run --enroll-token T --source-address IP` (NodeConfig): the node registers
    with a hub that requires enrollment, from the address it was given, and trains."""
    from test_node_support import EventLog, agent

    train, val, _ = write_digits(tmp_path / "d")
    hub = await start_hub(tmp_path / "hub", require_enrollment=True)
    token = hub.token("enroll", "lab")
    try:
        async with sessions_from("127.0.0.1") as (owner,):
            r = await submit_job(owner, hub, spec(rounds=1), train, val)
            assert r.status == 201, await r.text()
        events = EventLog()
        node = agent(tmp_path / "node", hub.url, events, once=True, enroll_token=token,
                     source_address="127.0.77.1")
        assert await asyncio.wait_for(node.run(), 60) == 0, events.names()
        assert events.of("uploaded")
        assert db_rows(hub, "SELECT address_block, operator FROM nodes") == [("127.0.77.0/24", "op-1")]
    finally:
        await hub.stop()


def test_the_trainer_reports_steps_and_losses_for_the_progress_chain():
    """node/trainer.py's on_loss callback: (step, loss) at the progress points, steps increasing,
    ending at the last step; the node folds them into the heartbeat's digest."""
    from gpuflex.node.trainer import train_assignment
    from gpuflex.protocol.modelspec import build_model

    job = parse_job_spec('[job]\nname = "x"\n[model]\nkind = "mlp"\ninput = 4\nhidden = [8]\noutputs = 2\n'
                         "[train]\nbatch_size = 8\nlocal_epochs = 2\n")
    state = build_model(job.model, 0).state_dict()
    chunk = {"x": torch.randn(64, 4), "y": torch.randint(0, 2, (64,))}
    seen: list[tuple[int, float]] = []
    res = train_assignment(job.model, state, [chunk], job.train.train_config(), 1, device=torch.device("cpu"),
                           on_loss=lambda step, loss: seen.append((step, loss)))
    steps = [s for s, _ in seen]
    assert steps == sorted(set(steps)) and steps[-1] == res.steps == assignment_steps(64, 8, 2)
    assert all(math.isfinite(v) and v > 0 for _, v in seen)
    digest = bytes(32)
    for step, loss in seen:
        digest = progress_digest(digest, step, loss)
    assert len(digest) == 32 and digest != bytes(32)


# --------------------------------------------------------------------------- pure rules


def test_address_blocks():
    assert address_block("203.0.113.77") == "203.0.113.0/24"
    assert address_block("::ffff:203.0.113.77") == "203.0.113.0/24"
    assert address_block("2001:db8:1:2::5") == "2001:db8:1::/48"
    assert address_block("2001:db8:1:2::5", ipv6_prefix=64) == "2001:db8:1:2::/64"
    assert address_block("10.1.2.3", ipv4_prefix=16) == "10.1.0.0/16"
    assert address_block(None) == "unknown"
    assert address_block("not-an-ip").startswith("other:")
    assert address_block("127.0.21.1") != address_block("127.0.22.1")


def test_admission_windows_probation_and_cooldown(tmp_path):
    cfg = HubConfig(data_dir=tmp_path, registrations_per_block=2, registrations_global=5,
                    registration_window_s=100.0, trust_min_age_s=1000.0, probation_per_block=3,
                    ban_cooldown_s=50.0)
    adm = Admission(cfg)
    for t in (0.0, 1.0):
        adm.check("A", None, t)
        adm.admitted("A", None, t)
    with pytest.raises(TooManyRequests) as exc:
        adm.check("A", None, 2.0)
    assert exc.value.retry_after_s == 98
    adm.check("A", None, 101.0)  # the window moved on
    adm.admitted("A", None, 101.0)
    with pytest.raises(TooManyRequests) as exc:
        adm.check("A", None, 300.0)  # 3 still in probation
    assert exc.value.code == "probation_full"
    adm.check("B", "op-1", 300.0)
    adm.admitted("B", "op-1", 300.0)
    adm.admitted("C", "op-1", 300.0)
    with pytest.raises(TooManyRequests):
        adm.check("D", "op-1", 300.0)  # the operator's window is full, whatever the block
    adm.banned(["E"], "op-2", 400.0)
    with pytest.raises(Forbidden):
        adm.check("E", None, 449.0)
    with pytest.raises(Forbidden):
        adm.check("F", "op-2", 449.0)
    adm.check("E", None, 451.0)
    for i, block in enumerate("GHIJK"):
        adm.admitted(block, None, 455.0 + i)
    with pytest.raises(TooManyRequests):
        adm.check("I", None, 462.0)  # the global window: 5 in the last 100 s


def test_heartbeat_deadline_rule():
    kw = dict(now=100.0, issued_at=90.0, deadline=120.0, window_s=30.0, total_steps=50, extension_max=4.0,
              max_assignment_s=21600.0)
    d1 = progress_digest(bytes(32), 1, 0.5)
    assert heartbeat_deadline(steps=1, digest=d1, last=Progress(), **kw)[0] == 130.0
    assert heartbeat_deadline(steps=1, digest=d1, last=Progress(1, d1), **kw)[0] == 120.0  # same again
    assert heartbeat_deadline(steps=2, digest=d1, last=Progress(1, d1), **kw)[0] == 120.0  # digest unchanged
    assert heartbeat_deadline(steps=0, digest=b"", last=Progress(), **kw)[0] == 120.0
    assert heartbeat_deadline(steps=51, digest=d1, last=Progress(), **kw)[0] == 120.0  # more than the shard has
    late = {**kw, "now": 200.0, "deadline": 205.0}
    assert heartbeat_deadline(steps=2, digest=d1, last=Progress(1, bytes(32)), **late)[0] == 210.0  # 90 + 4 x 30
    assert assignment_steps(100, 32, 2) == 8
    assert [stall_backoff(n, 30.0) for n in range(4)] == [0.0, 30.0, 60.0, 120.0]
    assert stall_backoff(30, 30.0) == 3600.0


def test_norm_bound_clips_only_what_passes_k_times_the_median():
    assert norm_bound_scales({"a": 1.0, "b": 1.1, "c": 0.9, "x": 3.5}, 2.5) == {"x": pytest.approx(2.625 / 3.5)}
    assert norm_bound_scales({"a": 1.0, "x": 3.5}, 2.5) == {}  # two: the median is their mean
    assert norm_bound_scales({"a": 1.0, "b": 1.0, "x": 3.5}, 0.0) == {}  # off


def test_untrusted_updates_carry_bounded_weight():
    w = {"t1": 100.0, "t2": 100.0, "u1": 100.0, "u2": 300.0}
    f = bound_weights(w, {"t1", "t2"}, 0.5)
    untrusted = f.get("u1", 1.0) * 100 + f["u2"] * 300
    assert untrusted == pytest.approx(200.0)  # share 0.5: no more than the trusted
    f = bound_weights({"t1": 100.0, "u1": 100.0, "u2": 100.0, "u3": 100.0}, {"t1"}, 0.25)
    assert sum(f[u] * 100 for u in ("u1", "u2", "u3")) == pytest.approx(100.0 / 3)  # 1/4 of the round
    assert f["u2"] * 300 <= 100.0 + 1e-9  # and none above the round's median sample count
    assert bound_weights(w, set(w), 0.5) == {}
    assert bound_weights({"u1": 100.0, "u2": 100.0}, set(), 0.5) == {}  # nobody trusted yet: nothing to bound by


def test_probation_blocks_trust_and_a_withdrawn_flag_gives_the_run_back():
    spec = VerificationSpec(trust_after=2)
    rep = Reputation(consecutive_agreements=5, agreements_total=5)
    assert is_trusted(rep, spec)
    assert not is_trusted(Reputation(consecutive_agreements=5, probation=True), spec)
    flagged = record_flag(rep)
    assert flagged.consecutive_agreements == 0
    assert record_withdrawn(flagged, 5).consecutive_agreements == 5


def test_job_spec_norm_bound_and_untrusted_share():
    base = '[job]\nname = "x"\n[model]\nkind = "mlp"\ninput = 4\nhidden = []\noutputs = 2\n'
    assert parse_job_spec(base).verification.norm_bound == 2.5
    assert parse_job_spec(base + "[verification]\nnorm_bound = 0\n").verification.norm_bound == 0.0
    with pytest.raises(SpecError, match="norm_bound"):
        parse_job_spec(base + "[verification]\nnorm_bound = 0.5\n")
    with pytest.raises(SpecError, match="untrusted_share"):
        parse_job_spec(base + "[verification]\nuntrusted_share = 0\n")


def test_cli_issues_lists_and_revokes_enrollment_tokens(tmp_path, capsys):
    """`gpuflex-hub token create --role enroll`: stored hashed in its own table, listed as e<N>,
    revoked by that id; `serve` has the admission options."""
    from gpuflex.hub.ops import cli

    data = tmp_path / "hub"
    assert cli.main(["token", "create", "--data", str(data), "--role", "enroll", "--name", "lab-42"]) == 0
    token = capsys.readouterr().out.strip()
    assert token.startswith("gft_")
    conn = sqlite3.connect(data / "hub.sqlite3")
    try:
        (stored,) = conn.execute("SELECT hash FROM enroll_tokens").fetchone()
    finally:
        conn.close()
    assert token not in stored and len(stored) == 64
    assert cli.main(["token", "list", "--data", str(data)]) == 0
    listed = capsys.readouterr().out
    assert "e1" in listed and "enroll" in listed and "lab-42" in listed
    assert cli.main(["token", "revoke", "--data", str(data), "e1"]) == 0
    assert cli.main(["token", "list", "--data", str(data)]) == 0
    assert "revoked" in capsys.readouterr().out
    args = cli.build_parser().parse_args(["serve", "--data", str(data), "--require-enrollment",
                                          "--registrations-per-block", "3", "--unproven-max-chunks", "0"])
    assert args.require_enrollment and args.registrations_per_block == 3 and args.unproven_max_chunks == 0
