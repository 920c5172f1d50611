"""Node-local data (issue 18): a job whose rows stay in silos on the nodes.

A real hub on 127.0.0.1 with its SQLite file, nodes that sign every request (tests/helpers.py
SimNode) and train with the node's own trainer; the silos are scikit-learn's digits, split over
the nodes with a Dirichlet(0.5) label split (tests/tooling/partition.py) as flwr-datasets does.
The node process end to end (``gpuflex-node data add``, the bytes a node sends) is
tests/test_node_silos_e2e.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import time
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
from gpuflex.hub.model.job import silo_seed
from gpuflex.hub.policy.evaluation import evaluate
from gpuflex.hub.server.appkeys import BLOBS, HUB_KEY, LEDGER
from gpuflex.protocol.errors import SpecError
from gpuflex.protocol.jobspec import parse_job_spec
from gpuflex.protocol.messages import Ack, Assignment, NoWork
from gpuflex.protocol.tensors import decode_state, encode_state
from sklearn.datasets import load_digits

from tests.helpers import SimNode, open_store, start_hub
from tests.tooling.partition import dirichlet_split

SPEC = """
[job]
name = "silos"
[model]
kind = "mlp"
input = 64
hidden = [32]
outputs = 10
[train]
rounds = {rounds}
local_epochs = 2
batch_size = 32
lr = 0.1
seed = 3
[data]
source = "node-local"
min_samples = 20
max_samples = 1000
label_histogram = true
quorum = {quorum}
round_deadline_s = {deadline}
"""


def spec(rounds: int = 3, quorum: int = 2, deadline: float = 60.0) -> str:
    return SPEC.format(rounds=rounds, quorum=quorum, deadline=deadline)


def digits() -> tuple[np.ndarray, np.ndarray]:
    d = load_digits()
    return (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)


def silo_blob(x: np.ndarray, y: np.ndarray) -> bytes:
    """A silo encoded as the node encodes it: the chunk format (encode_state of x and y)."""
    return encode_state({"x": torch.from_numpy(np.ascontiguousarray(x)), "y": torch.from_numpy(np.ascontiguousarray(y))})


def npz(x: np.ndarray, y: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, x=x, y=y)
    return buf.getvalue()


async def submit(session: aiohttp.ClientSession, hub: Any, text: str, *, train: bytes | None = None,
                 val: bytes | None = None) -> aiohttp.ClientResponse:
    form = aiohttp.FormData()
    form.add_field("spec", text.encode(), filename="spec.toml")
    if train is not None:
        form.add_field("train", train, filename="train.npz")
    if val is not None:
        form.add_field("val", val, filename="val.npz")
    return await session.post(f"{hub.url}/v1/jobs", data=form, headers={"Authorization": f"Bearer {hub.owner_token}"})


async def status(session: aiohttp.ClientSession, hub: Any, job_id: str) -> dict[str, Any]:
    async with session.get(f"{hub.url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {hub.owner_token}"}) as r:
        assert r.status == 200, await r.text()
        return await r.json()  # type: ignore[no-any-return]


async def error_of(resp: aiohttp.ClientResponse) -> tuple[int, str, str]:
    doc = await resp.json()
    return resp.status, doc["error"], doc["detail"]


# -- the spec ------------------------------------------------------------------------------------


def test_a_node_local_spec_turns_replication_and_the_referee_off():
    s = parse_job_spec(spec())
    assert s.data.node_local and s.data.max_samples == 1000 and s.data.quorum == 2
    assert s.verification.replication == 0.0 and not s.verification.asks_referee()
    assert not s.verification.audits_trend()


@pytest.mark.parametrize(("extra", "message"), [
    ("[verification]\nreplication = \"adaptive\"\n", "verification.replication: a node-local job cannot be replicated"),
    ("[verification]\nspot_check = 0.5\n", "verification.spot_check: a node-local job cannot"),
])
def test_a_node_local_spec_refuses_what_silos_cannot_give(extra, message):
    with pytest.raises(SpecError, match=message):
        parse_job_spec(spec() + extra)


@pytest.mark.parametrize(("data", "message"), [
    ('source = "node-local"\nchunk_size = 10\n', "no training set at the hub"),
    ('source = "node-local"\nmin_samples = 10\nmax_samples = 5\n', "data.max_samples: must be at least min_samples"),
    ("quorum = 3\n", 'data.quorum: only for source = "node-local"'),
    ('source = "elsewhere"\n', "data.source"),
])
def test_data_section_mistakes_are_one_line_errors(data, message):
    text = '[job]\nname = "x"\n[model]\nkind = "mlp"\ninput = 4\nhidden = [4]\noutputs = 2\n[data]\n' + data
    with pytest.raises(SpecError, match=message) as info:
        parse_job_spec(text)
    assert "\n" not in str(info.value)


# -- submitting and attaching ---------------------------------------------------------------------


@pytest.mark.asyncio
async def test_submission_without_rows_and_silo_refusals(tmp_path):
    hub = await start_hub(tmp_path, long_poll_max_s=0.3)
    x, y = digits()
    try:
        async with aiohttp.ClientSession() as session:
            r = await submit(session, hub, spec(), train=npz(x, y))  # rows for a node-local job: refused
            assert (await error_of(r))[:2] == (422, "bad_form")
            r = await submit(session, hub, spec().replace('source = "node-local"\n', "")
                             .split("min_samples")[0])  # a hub job without rows: refused
            assert r.status == 400 and "train" in (await r.json())["detail"]
            r = await submit(session, hub, spec(), val=npz(x[:200], y[:200]))
            assert r.status == 201, await r.text()
            job = (await r.json())["id"]
            assert (await r.json())["chunks"] == 0
            doc = await status(session, hub, job)
            assert doc["data_source"] == "node-local" and doc["silos"] == [] and doc["train_samples"] == 0

            a, b = SimNode(session, hub.url), SimNode(session, hub.url)
            await a.register()
            await b.register()
            schema = await a.silo_schema(job)
            assert (schema.min_samples, schema.max_samples, schema.label_histogram, schema.attached) == (20, 1000, True, "")
            assert schema.model_spec["input"] == 64
            ok = silo_blob(x[:100], y[:100])
            hist = tuple(int(c) for c in np.bincount(y[:100], minlength=10))
            cases = [
                ({"samples": 10}, silo_blob(x[:10], y[:10]), "holds 20..1000 samples"),
                ({"samples": 1500}, silo_blob(x[:1500], y[:1500]), "holds 20..1000 samples"),
                ({"size": 7}, ok, "encodes to"),
                ({"label_histogram": (100,) + (0,) * 8}, ok, "label histogram has 10 counts"),
                ({"label_histogram": (1,) * 10}, ok, "sum to the sample count"),
            ]
            for over, blob, message in cases:
                samples = over.pop("samples", 100)
                got = await error_of(await a.attach_silo(job, blob, samples, **over))
                assert got[:2] == (422, "bad_silo") and message in got[2], got
            assert await status(session, hub, job) == doc | {"updated_at": doc["updated_at"]}  # nothing changed
            assert await error_of(await a.attach_silo("j-nope", ok, 100)) == (404, "unknown_job", "no running job j-nope")

            r = await a.attach_silo(job, ok, 100, histogram=hist)
            assert (await a.open_response(r, Ack)).detail == "attached"
            r = await a.attach_silo(job, ok, 100, histogram=hist)
            assert (await a.open_response(r, Ack)).detail == "attached already"
            got = await error_of(await b.attach_silo(job, ok, 100))
            assert got[:2] == (409, "silo_taken")
            assert (await a.silo_schema(job)).attached == hashlib.sha256(ok).hexdigest()
            doc = await status(session, hub, job)
            assert [(s["node_id"], s["samples"], s["label_histogram"]) for s in doc["silos"]] == [
                (a.node_id, 100, list(hist))]
    finally:
        await hub.stop()
    # the silo survives a restart: it is in the SQLite file, and the job trains it again
    hub = await start_hub(tmp_path, tokens={"owner": hub.owner_token, "auditor": hub.auditor_token,
                                            "admin": hub.admin_token}, long_poll_max_s=0.3)
    try:
        live = hub.app[LEDGER].scheduler.jobs[job]
        assert [(c.owner, c.samples) for c in live.chunks] == [(a.node_id, 100)]
        assert live.silo_of == {a.node_id: 0} and live.free == {0}
    finally:
        await hub.stop()


# -- rounds over silos ------------------------------------------------------------------------------


#: (round, silo blob id) -> the seed of the assignment that trained it
SEEDS: dict[tuple[int, str], int] = {}
#: update id -> the update's blob, as its node uploaded it (what the hub's probe evidence is about)
UPLOADED: dict[str, bytes] = {}


async def _train_and_upload(node: SimNode, a: Assignment) -> None:
    blob, samples, loss = await node.train(a)
    UPLOADED["u-" + a.assignment_id.removeprefix("a-")] = blob
    hdr = node.update_header(a, blob, samples, loss)
    from gpuflex.protocol.signing import seal

    from tests.helpers import b64

    async with node.session.post(f"{node.url}/v1/updates", data=blob, headers={
            "Content-Type": "application/octet-stream", "X-GPUFlex-Update": b64(seal(node.key, hdr))}) as r:
        assert r.status == 200, await r.text()


async def _serve(node: SimNode, job: str, *, served: list[tuple[int, str, str]],
                 stop: asyncio.Event) -> None:
    """A node that works until ``stop``: each assignment it gets, trained on its own silo."""
    while not stop.is_set():
        got = await node.work(0.3)
        if isinstance(got, NoWork):
            continue
        assert isinstance(got, Assignment) and got.job_id == job
        served.append((got.round, node.node_id, got.chunks[0].sha256))
        SEEDS[(got.round, got.chunks[0].sha256)] = got.seed
        await _train_and_upload(node, got)


async def _until_done(session: aiohttp.ClientSession, hub: Any, job: str, tasks: list[asyncio.Task[None]],
                      stop: asyncio.Event, timeout_s: float = 60.0) -> dict[str, Any]:
    """The job's status once it is no longer running (or after ``timeout_s``); the serving
    ``tasks`` are then stopped and awaited."""
    give_up = time.monotonic() + timeout_s
    while (doc := await status(session, hub, job))["state"] == "running" and time.monotonic() < give_up:
        await asyncio.sleep(0.2)
    stop.set()
    await asyncio.gather(*tasks)
    return doc


@pytest.mark.asyncio
async def test_rounds_train_each_silo_on_its_own_node_weighted_by_count(tmp_path):
    hub = await start_hub(tmp_path, long_poll_max_s=0.3)
    x, y = digits()
    val = np.arange(0, len(y), 6)  # the owner's own held-out rows
    rest = np.setdiff1d(np.arange(len(y)), val)
    parts = [rest[p] for p in dirichlet_split(y[rest], 3, 0.5, seed=1, min_size=60)]
    try:
        async with aiohttp.ClientSession() as session:
            r = await submit(session, hub, spec(rounds=4, quorum=3), val=npz(x[val], y[val]))
            job = (await r.json())["id"]
            nodes = [SimNode(session, hub.url) for _ in parts]
            silos = {}
            for node, idx in zip(nodes, parts, strict=True):
                await node.register()
                blob = silo_blob(x[idx], y[idx])
                assert (await node.attach_silo(job, blob, len(idx))).status == 200
                silos[node.node_id] = (hashlib.sha256(blob).hexdigest(), len(idx))
            served: list[tuple[int, str, str]] = []
            stop = asyncio.Event()
            tasks = [asyncio.create_task(_serve(n, job, served=served, stop=stop)) for n in nodes]
            first_model = hub.app[LEDGER].scheduler.jobs[job].model_hash
            give_up = time.monotonic() + 120
            while (doc := await status(session, hub, job))["state"] == "running" and time.monotonic() < give_up:
                await asyncio.sleep(0.2)
            stop.set()
            await asyncio.gather(*tasks)
            first_state = decode_state(bytearray(hub.app[BLOBS].read(first_model)))
            after_first = decode_state(bytearray(hub.app[BLOBS].read(doc["history"][0]["model_hash"])))
    finally:
        await hub.stop()
    assert doc["state"] == "done", doc.get("error")
    # FedAvg by sample count: round 0 moved the model by the count-weighted mean of the three updates
    # (no silo is capped at the round's median count, as an untrusted volunteer's update would be)
    ups = {u["update_id"]: u["samples"] for u in doc["history"][0]["updates"]}
    total = sum(ups.values())
    for k, t in first_state.items():
        want = sum(decode_state(bytearray(UPLOADED[uid]))[k].double() * n for uid, n in ups.items()) / total
        assert torch.allclose(after_first[k].double() - t.double(), want, atol=1e-6), k
    # the owner's validation set probes each update (evidence for the auditors): round 0's, again here
    probe = doc["history"][0]["probe"]
    assert probe["samples"] == len(val) and set(probe["loss_change"]) == {u["update_id"] for u in doc["history"][0]["updates"]}
    val_set = {"x": torch.from_numpy(x[val]), "y": torch.from_numpy(y[val])}
    jspec = parse_job_spec(spec(rounds=4, quorum=3))
    before = evaluate(jspec, first_state, val_set)["loss"]
    assert probe["loss_before"] == pytest.approx(before, abs=1e-5)
    for uid, change in probe["loss_change"].items():
        delta = decode_state(bytearray(UPLOADED[uid]))
        moved = {k: t + delta[k] if k in delta else t for k, t in first_state.items()}
        assert change == pytest.approx(evaluate(jspec, moved, val_set)["loss"] - before, abs=1e-5)
    # every node trained only its own silo, once a round, and nobody downloaded another's; each
    # round's seed names the silo (its blob id), whoever attached or asked first
    assert all(sha == silos[nid][0] for _, nid, sha in served)
    assert all(SEEDS[(r, sha)] == silo_seed(3, r, sha) for r, _, sha in served)
    assert sorted((r, n) for r, n, _ in served) == sorted((r, n.node_id) for r in range(4) for n in nodes)
    for h in doc["history"]:
        assert sorted((u["node_id"], u["samples"]) for u in h["updates"]) == sorted(
            (nid, n) for nid, (_, n) in silos.items())
        assert h["replication_overhead"] == 0.0
    accuracy = [h["accuracy"] for h in doc["history"]]
    # a real model, trained where the data is (non-IID silos: ~0.8 after 4 rounds, 0.1 is chance)
    assert accuracy[-1] > 0.65 and accuracy[-1] > accuracy[0] + 0.2, accuracy


@pytest.mark.asyncio
async def test_a_round_closes_on_its_quorum_at_its_deadline_and_at_once_without_an_offline_silo(tmp_path):
    # online window 4 s, round deadline 2 s; the third node attaches its silo, then never asks
    hub = await start_hub(tmp_path, long_poll_max_s=0.3, online_window_s=4.0)
    x, y = digits()
    try:
        async with aiohttp.ClientSession() as session:
            r = await submit(session, hub, spec(rounds=4, quorum=2, deadline=2.0))
            job = (await r.json())["id"]
            nodes = [SimNode(session, hub.url) for _ in range(3)]
            for i, node in enumerate(nodes):
                await node.register()
                lo = 100 * i
                assert (await node.attach_silo(job, silo_blob(x[lo:lo + 100], y[lo:lo + 100]), 100)).status == 200
            served: list[tuple[int, str, str]] = []
            stop = asyncio.Event()
            tasks = [asyncio.create_task(_serve(n, job, served=served, stop=stop)) for n in nodes[:2]]
            doc = await _until_done(session, hub, job, tasks, stop)
    finally:
        await hub.stop()
    assert doc["state"] == "done", doc.get("error")
    assert all(len(h["updates"]) == 2 for h in doc["history"])
    assert {n for _, n, _ in served} == {nodes[0].node_id, nodes[1].node_id}
    took = [h["closed_at"] - h["opened_at"] for h in doc["history"]]
    # round 0: the silent node is online (it just attached), so the round waits for it until its
    # deadline and closes on the quorum of two; once it is offline, rounds close as soon as the
    # two online silos are in
    assert 1.9 < took[0] < 3.5, took
    assert max(took[2:]) < 1.5, took


@pytest.mark.asyncio
@pytest.mark.parametrize("late", ["next", "drop"])
async def test_a_straggler_counts_in_the_next_round_or_is_dropped_as_the_job_says(tmp_path, late):
    hub = await start_hub(tmp_path, long_poll_max_s=0.3)
    x, y = digits()
    try:
        async with aiohttp.ClientSession() as session:
            text = spec(rounds=3, quorum=2, deadline=1.5).replace("round_deadline_s", f'late = "{late}"\nround_deadline_s')
            job = (await (await submit(session, hub, text)).json())["id"]
            nodes = [SimNode(session, hub.url) for _ in range(3)]
            for i, node in enumerate(nodes):
                await node.register()
                lo = 100 * i
                assert (await node.attach_silo(job, silo_blob(x[lo:lo + 100], y[lo:lo + 100]), 100)).status == 200
            live = hub.app[LEDGER].scheduler.jobs[job]
            slow = nodes[2]
            got = await slow.work(0.3)  # the straggler takes its round-0 shard...
            assert isinstance(got, Assignment) and got.round == 0
            await slow.blob(got.model_hash)  # it has the model: it trains from it, offline
            served: list[tuple[int, str, str]] = []
            stop = asyncio.Event()
            tasks = [asyncio.create_task(_serve(n, job, served=served, stop=stop)) for n in nodes[:2]]
            while live.round == 0:  # ... and is still training when round 0 closes at its deadline
                await asyncio.sleep(0.05)
            blob, samples, loss = await slow.train(got)
            hdr = slow.update_header(got, blob, samples, loss)
            from gpuflex.protocol.signing import seal

            from tests.helpers import b64

            async with session.post(f"{hub.url}/v1/updates", data=blob, headers={
                    "Content-Type": "application/octet-stream", "X-GPUFlex-Update": b64(seal(slow.key, hdr))}) as r:
                late_status, late_body = r.status, (await r.read()).decode(errors="replace")
            tasks.append(asyncio.create_task(_serve(slow, job, served=served, stop=stop)))
            doc = await _until_done(session, hub, job, tasks, stop)
    finally:
        await hub.stop()
    assert doc["state"] == "done", doc.get("error")
    first, second, _ = doc["history"]
    assert {u["node_id"] for u in first["updates"]} == {nodes[0].node_id, nodes[1].node_id}
    late_update = "u-" + got.assignment_id.removeprefix("a-")
    if late == "next":
        assert late_status == 200, late_body
        # trained on round 0's model, counted in round 1 with the other two, and said so
        assert second["late"] == {late_update: 0}
        assert {u["update_id"] for u in second["updates"] if u["node_id"] == slow.node_id} == {late_update}
        assert len(second["updates"]) == 3 and all(u["status"] == "included" for u in second["updates"])
    else:
        assert late_status == 409 and "late_update" in late_body, late_body
        assert "late" not in second and all(u["update_id"] != late_update for u in second["updates"])


async def _withdraw(node: SimNode, job: str, sha: str) -> Ack:
    from gpuflex.protocol.messages import SiloWithdrawal
    from gpuflex.protocol.signing import new_nonce, seal

    msg = SiloWithdrawal(job_id=job, sha256=sha, timestamp=time.time(), nonce=new_nonce())
    return await node.open_response(await node.post("/v1/silos/withdraw", seal(node.key, msg)), Ack)  # type: ignore[no-any-return]


@pytest.mark.asyncio
async def test_a_withdrawn_silo_is_not_assigned_or_waited_for_and_stays_withdrawn_across_a_restart(tmp_path):
    """`gpuflex-node data remove` tells the hub: the node's live assignment of its silo ends, no round
    assigns it or waits for it while the node stays online, and the SQLite file keeps it withdrawn."""

    hub = await start_hub(tmp_path, long_poll_max_s=0.3, online_window_s=30.0)
    x, y = digits()
    try:
        async with aiohttp.ClientSession() as session:
            job = (await (await submit(session, hub, spec(rounds=3, quorum=2, deadline=30.0))).json())["id"]
            nodes = [SimNode(session, hub.url) for _ in range(3)]
            shas = []
            for i, node in enumerate(nodes):
                await node.register()
                blob = silo_blob(x[100 * i:100 * i + 100], y[100 * i:100 * i + 100])
                shas.append(hashlib.sha256(blob).hexdigest())
                assert (await node.attach_silo(job, blob, 100)).status == 200
            quitter = nodes[2]
            got = await quitter.work(0.3)
            assert isinstance(got, Assignment) and got.chunks[0].sha256 == shas[2]
            ack = await _withdraw(quitter, job, shas[1])  # another node's blob: not this node's silo
            assert ack.detail == "not attached: nothing to withdraw"
            ack = await _withdraw(quitter, job, shas[2])
            assert ack.detail == f"withdrawn; its assignment {got.assignment_id} ended"
            assert (await _withdraw(quitter, job, shas[2])).detail == "not attached: nothing to withdraw"
            live = hub.app[LEDGER].scheduler.jobs[job]
            assert quitter.node_id not in live.silo_of and live.free == {0, 1}
            assert isinstance(await quitter.work(0.3), NoWork)
            assert [s["node_id"] for s in (await status(session, hub, job))["silos"]] == [
                nodes[0].node_id, nodes[1].node_id]
    finally:
        await hub.stop()
    conn = open_store(tmp_path)
    try:
        assert conn.execute("SELECT owner_node FROM chunks WHERE sha = ?", (shas[2],)).fetchall() == [(None,)]
        assert conn.execute("SELECT state FROM assignments WHERE id = ?", (got.assignment_id,)).fetchall() == [
            ("abandoned",)]
    finally:
        conn.close()

    hub = await start_hub(tmp_path, tokens={"owner": hub.owner_token, "auditor": hub.auditor_token,
                                            "admin": hub.admin_token}, long_poll_max_s=0.3, online_window_s=30.0)
    try:
        live = hub.app[LEDGER].scheduler.jobs[job]
        assert quitter.node_id not in live.silo_of and live.free == {0, 1}
        async with aiohttp.ClientSession() as session:
            for node in nodes:
                node.session, node.url = session, hub.url
            served: list[tuple[int, str, str]] = []
            stop = asyncio.Event()
            tasks = [asyncio.create_task(_serve(n, job, served=served, stop=stop)) for n in nodes]  # all online
            doc = await _until_done(session, hub, job, tasks, stop)
    finally:
        await hub.stop()
    assert doc["state"] == "done", doc.get("error")
    assert {n for _, n, _ in served} == {nodes[0].node_id, nodes[1].node_id}  # never the withdrawn silo
    took = [h["closed_at"] - h["opened_at"] for h in doc["history"]]
    assert max(took) < 10.0, took  # not the 30 s deadline: no round waits for the online quitter


@pytest.mark.asyncio
async def test_a_node_whose_clock_is_an_hour_ahead_signs_by_the_hubs_clock_before_it_registers(tmp_path, monkeypatch):
    """`gpuflex-node data add` signs before any registration: the client takes the hub's clock from
    GET /v1/hub, so a machine an hour off is not refused as a replay."""
    import types

    from gpuflex.node import client as client_mod
    from gpuflex.node.client import HubClient
    from gpuflex.node.errors import HubError

    hub = await start_hub(tmp_path, long_poll_max_s=0.3)
    try:
        async with aiohttp.ClientSession() as session:
            job = (await (await submit(session, hub, spec())).json())["id"]
            node = SimNode(session, hub.url)
            await node.register()
            ahead = types.SimpleNamespace(**{k: getattr(time, k) for k in ("monotonic", "perf_counter", "sleep")},
                                          time=lambda: time.time() + 3600.0)
            monkeypatch.setattr(client_mod, "time", ahead)
            client = HubClient(hub.url, node.key, session)
            client.hub_public_key = bytes.fromhex(hub.app[HUB_KEY].public_bytes.hex())
            with pytest.raises(HubError, match="in the future"):
                await client.silo_schema(job)  # signed an hour ahead: refused
            await client.hub_info()
            assert -3601.0 < client.clock_offset < -3599.0
            assert (await client.silo_schema(job)).job_id == job
    finally:
        await hub.stop()
