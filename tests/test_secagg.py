"""Secure aggregation over silos (issue 18): the hub learns the sum of a round's updates, no single one.

A real hub on 127.0.0.1 and nodes that run the node's own side of the protocol
(node/secagg_flow.py over the node's HubClient) after training their silo with the node's
trainer. Every node's plain update is kept here, so each round's model change can be checked
against the weighted mean of the updates the protocol summed: what FedAvg over the same updates
would give, up to the quantization.
"""

from __future__ import annotations

import asyncio
import io
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
from gpuflex.hub.server.appkeys import BLOBS, LEDGER, STORE
from gpuflex.node import secagg_flow
from gpuflex.node.client import HubClient
from gpuflex.node.secagg_calls import SecAggCalls
from gpuflex.node.trainer import train_assignment
from gpuflex.protocol.errors import SpecError
from gpuflex.protocol.jobspec import parse_job_spec
from gpuflex.protocol.messages import Assignment, NoWork
from gpuflex.protocol.modelspec import ModelSpec
from gpuflex.protocol.tensors import decode_state, encode_state
from sklearn.datasets import load_digits

from tests.helpers import SimNode, start_hub
from tests.tooling.partition import dirichlet_split

SPEC = """
[job]
name = "secagg"
[model]
kind = "mlp"
input = 64
hidden = [16]
outputs = 10
[train]
rounds = {rounds}
local_epochs = 1
batch_size = 32
lr = 0.1
seed = 2
[data]
source = "node-local"
max_samples = 1000
quorum = {quorum}
round_deadline_s = 30
[privacy]
secure_aggregation = true
secagg_phase_s = {phase_s}
"""


def spec(rounds: int = 2, quorum: int = 4, phase_s: float = 2.0) -> str:
    return SPEC.format(rounds=rounds, quorum=quorum, phase_s=phase_s)


def test_the_spec_allows_secure_aggregation_only_where_it_holds():
    s = parse_job_spec(spec())
    assert s.privacy.secure_aggregation and s.privacy.secagg_bits == 22
    base = spec()
    for change, message in [
        (("quorum = 4", "quorum = 2"), "needs \\[data\\] quorum >= 3"),
        (("[privacy]", '[aggregation]\nmethod = "median"\n[privacy]'), "must be method = \"fedavg\""),
        (("[privacy]", '[communication]\nupdate = "int8"\n[privacy]'), "update = \"fp32\""),
        (("secure_aggregation = true", 'secure_aggregation = true\ndp = "central"'), "not both"),
        (("secure_aggregation = true", "secure_aggregation = true\nsecagg_bits = 31"), "overflow"),
        (("secure_aggregation = true", "secure_aggregation = false"), "only with secure_aggregation"),
        (("round_deadline_s = 30", 'late = "next"\nround_deadline_s = 30'), "a late update is dropped"),
    ]:
        with pytest.raises(SpecError, match=message):
            parse_job_spec(base.replace(*change))


def _npz(x: np.ndarray, y: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, x=x, y=y)
    return buf.getvalue()


class Silo:
    """A node with its silo: registers, attaches, trains what it is assigned, takes part."""

    def __init__(self, session: aiohttp.ClientSession, url: str, x: np.ndarray, y: np.ndarray) -> None:
        self.sim = SimNode(session, url)
        self.x, self.y = x, y
        self.blob = encode_state({"x": torch.from_numpy(x), "y": torch.from_numpy(y)})
        self.client: HubClient | None = None
        #: round -> (plain update, sample count) of what it trained
        self.trained: dict[int, tuple[dict[str, torch.Tensor], int]] = {}

    async def start(self, job: str) -> None:
        await self.sim.register()
        self.client = HubClient(self.sim.url, self.sim.key, self.sim.session, hub_public_key=self.sim.hub_public)
        r = await self.sim.attach_silo(job, self.blob, len(self.y))
        assert r.status == 200, await r.text()

    async def work(self, *, drop_after_shares: bool = False) -> tuple[int, secagg_flow.Outcome] | None:
        got = await self.sim.work(0.3)
        if isinstance(got, NoWork):
            return None
        assert isinstance(got, Assignment) and got.train.secagg
        state = decode_state(bytearray(await self.sim.blob(got.model_hash)))
        chunk = {"x": torch.from_numpy(self.x), "y": torch.from_numpy(self.y)}
        torch.set_num_threads(1)
        res = await asyncio.to_thread(train_assignment, ModelSpec.from_dict(got.model_spec), state, [chunk], got.train,
                                      got.seed, device=torch.device("cpu"))
        self.trained[got.round] = (res.delta, res.sample_count)
        assert self.client is not None
        if drop_after_shares:
            return got.round, await _keys_and_shares_only(self.client, self.sim.node_id, got, res.delta)
        outcome = await secagg_flow.take_part(self.client, self.sim.node_id, got, res.delta,
                                              sample_count=res.sample_count, loss=res.loss, train_s=res.train_s)
        return got.round, outcome


async def _keys_and_shares_only(client: HubClient, node_id: str, a: Assignment, delta: Any) -> secagg_flow.Outcome:
    """A node that sends its keys and its shares, then goes away (its machine slept)."""
    from gpuflex.protocol.messages import Sealed
    from gpuflex.protocol.secagg import RosterEntry, SecAggClient

    sa = SecAggClient(node_id, a.job_id, a.round)
    st = await SecAggCalls(client).keys(a.assignment_id, sa.entry.c_pk, sa.entry.s_pk)
    while st.phase == "keys":
        await asyncio.sleep(0.1)
        st = await SecAggCalls(client).poll(a.assignment_id)
    assert st.phase == "shares", st
    shares = sa.shares_for([RosterEntry(m.node_id, m.c_pk, m.s_pk) for m in st.roster], st.threshold)
    await SecAggCalls(client).shares(a.assignment_id, tuple(Sealed(t, c) for t, c in sorted(shares.items())))
    return secagg_flow.Outcome("dropped")


async def _run(hub: Any, session: aiohttp.ClientSession, silos: list[Silo], job: str, *,
               drop: dict[int, set[int]] | None = None) -> dict[str, Any]:
    """Every silo works each round (silo i drops out after its shares in the rounds ``drop[i]``
    names, and comes back for the next round) until the job is done; the job's status."""
    live = hub.app[LEDGER].scheduler.jobs[job]

    async def serve(i: int, s: Silo) -> None:
        while live.state == "running":
            r = live.round
            got = await s.work(drop_after_shares=r in (drop or {}).get(i, set()))
            if got is not None and got[1].phase == "dropped":
                while live.state == "running" and live.round == r:  # gone until the next round
                    await asyncio.sleep(0.1)

    await asyncio.wait_for(asyncio.gather(*(serve(i, s) for i, s in enumerate(silos))), 120)
    async with session.get(f"{hub.url}/v1/jobs/{job}", headers={"Authorization": f"Bearer {hub.owner_token}"}) as r:
        return await r.json()  # type: ignore[no-any-return]


def _weighted_mean(silos: list[Silo], rnd: int, members: list[int]) -> dict[str, torch.Tensor]:
    total = sum(silos[i].trained[rnd][1] for i in members)
    keys = silos[members[0]].trained[rnd][0].keys()
    return {k: sum(silos[i].trained[rnd][0][k].double() * silos[i].trained[rnd][1] for i in members) / total
            for k in keys}


def _digits(n: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    d = load_digits()
    x, y = (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)
    return [(x[p], y[p]) for p in dirichlet_split(y, n, 0.5, seed=seed, min_size=80)]


async def _submit(session: aiohttp.ClientSession, hub: Any, text: str) -> str:
    form = aiohttp.FormData()
    form.add_field("spec", text.encode(), filename="spec.toml")
    async with session.post(f"{hub.url}/v1/jobs", data=form,
                            headers={"Authorization": f"Bearer {hub.owner_token}"}) as r:
        assert r.status == 201, await r.text()
        return str((await r.json())["id"])


async def _job_run(tmp_path: Any, *, rounds: int, drop: dict[int, set[int]] | None = None,
                   long_poll_max_s: float = 0.3, recheck_s: float | None = None) -> tuple[
        dict[str, Any], list[Silo], list[dict[str, torch.Tensor]], dict[str, bytes]]:
    """A job over 4 silos; (status, the silos, the model before each round and after the last,
    update id -> the bytes the hub stored for it)."""
    hub = await start_hub(tmp_path, long_poll_max_s=long_poll_max_s)
    if recheck_s is not None:
        hub.app[LEDGER].secagg.recheck_s = recheck_s
    try:
        async with aiohttp.ClientSession() as session:
            job = await _submit(session, hub, spec(rounds=rounds, quorum=4))
            silos = [Silo(session, hub.url, x, y) for x, y in _digits(4, seed=1)]
            for s in silos:
                await s.start(job)
            first = hub.app[LEDGER].scheduler.jobs[job].model_hash
            doc = await _run(hub, session, silos, job, drop=drop)
        blobs = hub.app[BLOBS]
        states = [decode_state(bytearray(blobs.read(sha))) for sha in [first] + [h["model_hash"] for h in doc["history"]]]
        rows = await hub.app[STORE].query(lambda c: c.execute("SELECT id, sha FROM updates WHERE job_id = ?",
                                                              (job,)).fetchall())
        stored = {r["id"]: bytes(blobs.read(r["sha"])) for r in rows}
    finally:
        await hub.stop()
    return doc, silos, states, stored


def _change(states: list[dict[str, torch.Tensor]], rnd: int) -> dict[str, torch.Tensor]:
    return {k: states[rnd + 1][k].double() - states[rnd][k].double() for k in states[rnd]
            if states[rnd][k].is_floating_point()}


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, float]:
    err = max(float((got[k] - want[k]).abs().max()) for k in want)
    return err, max(float(want[k].abs().max()) for k in want)


@pytest.mark.asyncio
async def test_the_hub_gets_the_weighted_mean_of_the_updates_and_none_of_them(tmp_path):
    doc, silos, states, stored = await _job_run(tmp_path, rounds=2)
    assert doc["state"] == "done", doc.get("error")
    assert doc["redacted"] == "secure aggregation: no update's own training loss is shown"
    for rnd, h in enumerate(doc["history"]):
        assert len(h["updates"]) == 4 and all(u["status"] == "included" for u in h["updates"])
        assert h["secure_aggregation"]["phase"] == "done" and h["secure_aggregation"]["summed"] == 4
        # the owner sees the round's train loss, not any one silo's (readmodel.redaction.owner_view)
        assert all(u["loss"] is None for u in h["updates"]) and h["train_loss"] is not None
        # the model moved by the FedAvg of the four plain updates, up to the quantization
        # (2 x clip / (2^22 - 1) = 9.5e-7 a coordinate and node, divided by the weights)
        err, scale = _close(_change(states, rnd), _weighted_mean(silos, rnd, [0, 1, 2, 3]))
        assert err < 2e-5 and scale > 1e-3, (rnd, err, scale)
    # what the hub stored for each update is its masked vector: uniform over 32 bits, where a plain
    # quantized update sits in the lower 22 bits around their middle (mean 2^21 / 2^32 = 0.0005). The
    # bounds are 6 standard deviations of a uniform vector's mean (1 / sqrt(12 n)): a fixed 0.02 for a
    # 1,211-value vector was 2.4 of them and failed in CI one run in about eight (8 vectors a run)
    vectors = [np.frombuffer(blob, dtype="<u4").astype(np.float64) / 2**32 for blob in stored.values()]
    for v in vectors:
        assert abs(v.mean() - 0.5) < 6 / np.sqrt(12 * v.size) and (v >= 2**-10).mean() > 0.99, v.mean()
    pooled = np.concatenate(vectors)
    assert abs(pooled.mean() - 0.5) < 6 / np.sqrt(12 * pooled.size), pooled.mean()


@pytest.mark.asyncio
async def test_a_members_poll_answers_when_the_round_moves_on_not_at_its_timeout(tmp_path):
    """The protocol's polls are long-polls that the hub answers as soon as the member's phase
    changes: with a 20 s long-poll limit and no timed re-check before it, 2 rounds of 3 waits each
    end in seconds (a poll that only answered at its limit would take 2 minutes)."""
    import time

    t0 = time.monotonic()
    doc, _, _, _ = await _job_run(tmp_path, rounds=2, long_poll_max_s=20.0, recheck_s=20.0)
    took = time.monotonic() - t0
    assert doc["state"] == "done" and all(h["secure_aggregation"]["phase"] == "done" for h in doc["history"])
    assert took < 30.0, took


@pytest.mark.asyncio
async def test_a_silo_that_drops_out_after_its_shares_is_recovered_and_the_round_closes(tmp_path):
    doc, silos, states, _ = await _job_run(tmp_path, rounds=2, drop={3: {0}})
    assert doc["state"] == "done", doc.get("error")
    first, second = doc["history"]
    assert first["secure_aggregation"]["survivors"] == 4 and first["secure_aggregation"]["summed"] == 3
    err, scale = _close(_change(states, 0), _weighted_mean(silos, 0, [0, 1, 2]))
    assert err < 2e-5 and scale > 1e-3, (err, scale)
    assert second["secure_aggregation"]["summed"] == 4  # it is back for the next round
    err, _ = _close(_change(states, 1), _weighted_mean(silos, 1, [0, 1, 2, 3]))
    assert err < 2e-5


@pytest.mark.asyncio
async def test_too_few_masked_updates_abort_the_round_and_leave_the_model_unchanged(tmp_path):
    doc, _, states, _ = await _job_run(tmp_path, rounds=2, drop={2: {0}, 3: {0}})
    assert doc["state"] == "done", doc.get("error")
    first, second = doc["history"]
    sa = first["secure_aggregation"]
    assert sa["phase"] == "aborted" and "unmasking needs 3" in sa["detail"], sa
    assert all(float(_change(states, 0)[k].abs().max()) == 0.0 for k in _change(states, 0))
    assert second["secure_aggregation"]["summed"] == 4
