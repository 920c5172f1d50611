"""A proven mismatch stops the node (hub/policy/suspension.py), on a real hub over loopback.

The forger is the only node online, so its lone updates find no replica holder and the referee
re-executes each at once: a first, honest update reproduces and waits for the round's close; a
second, crafted (x3.5) over an honest commitment, does not reproduce and is flagged
``referee_mismatch``. From the moment that flag is written the node is
suspended: no work, its pending update held out of the round, its flag first in the audit queue,
and it stays so across a restart until an auditor dismisses the flag (it works again) or
confirms it (it is banned)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gpuflex.hub.policy import suspension
from gpuflex.hub.policy.reputation import Reputation
from gpuflex.hub.policy.update_record import Flag
from gpuflex.protocol.messages import (
    Assignment,
    NoWork,
    StateRequest,
    WorkRequest,
)
from gpuflex.protocol.signing import new_nonce, seal
from gpuflex.protocol.tensors import decode_state, encode_state

from tests.helpers import RunningHub, SimNode, open_store, start_hub, submit_job, write_digits

#: shards of one chunk, then two: the round's 23 chunks keep it open across the forger's updates
HUB = {"unproven_max_chunks": 1}


async def _poll(n: SimNode, wait_s: float = 0.5) -> Assignment | NoWork | StateRequest:
    req = WorkRequest(timestamp=time.time(), nonce=new_nonce(), wait_s=wait_s, cached_chunks=())
    return await n.open_response(await n.post("/v1/work", seal(n.key, req)), StateRequest, Assignment, NoWork)


async def _flags(s: aiohttp.ClientSession, hub: RunningHub) -> list[dict[str, Any]]:
    async with s.get(hub.url + "/v1/flags", headers=hub.auth(hub.auditor_token)) as r:
        assert r.status == 200
        return list((await r.json())["flags"])


async def _node(s: aiohttp.ClientSession, hub: RunningHub, node_id: str) -> dict[str, Any]:
    async with s.get(hub.url + "/v1/nodes", headers=hub.auth(hub.auditor_token)) as r:
        assert r.status == 200
        return next(n for n in (await r.json())["nodes"] if n["id"] == node_id)


async def _suspend_a_forger(s: aiohttp.ClientSession, hub: RunningHub, tmp_path: Path) -> tuple[SimNode, str, str]:
    """A forger as the module docstring says. Returns it, its pending update's id and its flag's id."""
    train, val, spec_path = write_digits(tmp_path / "d", rounds=1, replication='"adaptive"')
    await submit_job(s, hub, spec_path, train, val)
    forger = SimNode(s, hub.url)
    await forger.register()
    a1 = await forger.work(2.0)
    assert isinstance(a1, Assignment) and a1.train.commit
    assert (await forger.upload(a1, *await forger.train(a1))).ok  # honest, committed (SimNode records it)
    a2 = await forger.work(2.0)  # hands a1's states over when the referee asks first
    assert isinstance(a2, Assignment) and a2.assignment_id != a1.assignment_id
    blob, samples, loss = await forger.train(a2)
    blob = encode_state({k: v * 3.5 for k, v in decode_state(bytearray(blob)).items()})
    assert (await forger.upload(a2, blob, samples, loss)).ok  # crafted, over its honest commitment
    deadline = time.monotonic() + 30
    while True:
        asked = await _poll(forger)
        if isinstance(asked, StateRequest):
            await forger.hand_over(asked)
            if asked.assignment_id == a2.assignment_id:
                break
        assert time.monotonic() < deadline, "the referee never asked for the crafted update's states"
    while not (flags := await _flags(s, hub)):
        assert time.monotonic() < deadline, "no flag"
        await asyncio.sleep(0.05)
    # the flag and the suspension are one write: whoever sees the flag sees the node suspended
    node = await _node(s, hub, forger.node_id)
    assert node["suspended"] and "referee_mismatch" in node["suspension"]
    (flag,) = flags
    assert (flag["reason"], flag["node_id"], flag["suspends"]) == ("referee_mismatch", forger.node_id, True)
    assert flag["suspends"] is True
    conn = open_store(hub.data_dir)
    try:
        (pending,) = [r[0] for r in conn.execute("SELECT id FROM updates WHERE assignment_id = ?",
                                                 (a1.assignment_id,)).fetchall()]
    finally:
        conn.close()
    return forger, pending, flag["id"]


async def _held_out(hub: RunningHub, update_id: str) -> None:
    """The pending update is excluded and its shard dropped (its chunks go out again)."""
    deadline = time.monotonic() + 10
    while True:
        conn = open_store(hub.data_dir)
        try:
            status, shard_state = conn.execute(
                "SELECT u.status, s.state FROM updates u JOIN assignments a ON a.id = u.assignment_id"
                " JOIN shards s ON s.id = a.shard_id WHERE u.id = ?", (update_id,)).fetchone()
        finally:
            conn.close()
        if (status, shard_state) == ("excluded", "dropped"):
            return
        assert time.monotonic() < deadline, (status, shard_state)
        await asyncio.sleep(0.05)


def _verdict_entries(hub: RunningHub) -> list[tuple[str, str]]:
    """The audit log's verdicts: (verdict, what it did to the suspension)."""
    lines = [json.loads(line) for line in (hub.data_dir / "audit.jsonl").read_text().splitlines() if line]
    return [(e["body"]["verdict"], e["body"].get("suspension", "")) for e in lines if e.get("kind") == "verdict"]


async def _verdict(s: aiohttp.ClientSession, hub: RunningHub, flag_id: str, verdict: str) -> dict[str, Any]:
    async with s.post(f"{hub.url}/v1/flags/{flag_id}/verdict", json={"verdict": verdict, "note": "test"},
                      headers=hub.auth(hub.auditor_token)) as r:
        assert r.status == 200, await r.text()
        return dict(await r.json())


async def test_a_proven_mismatch_suspends_until_an_auditor_dismisses_the_flag_and_survives_a_restart(
        tmp_path: Path) -> None:
    hub = await start_hub(tmp_path / "hub", **HUB)
    try:
        async with aiohttp.ClientSession() as s:
            forger, pending, flag_id = await _suspend_a_forger(s, hub, tmp_path)
            await _held_out(hub, pending)
            got = await forger.work(0.5)
            assert isinstance(got, NoWork) and got.reason.startswith("suspended: referee_mismatch"), got
            honest = SimNode(s, hub.url)
            await honest.register()
            assert isinstance(await honest.work(2.0), Assignment)  # the round goes on without the forger
            tokens = {"owner": hub.owner_token, "auditor": hub.auditor_token, "admin": hub.admin_token}
            await hub.stop()
            hub = await start_hub(tmp_path / "hub", tokens=tokens, **HUB)
            forger.url = hub.url
            assert (await _node(s, hub, forger.node_id))["suspended"]
            assert isinstance(await forger.work(0.5), NoWork)
            out = await _verdict(s, hub, flag_id, "dismiss")
            assert out["flag"]["status"] == "dismissed" and not out["node_banned"]
            assert not (await _node(s, hub, forger.node_id))["suspended"]
            assert isinstance(await forger.work(2.0), Assignment)  # it works again
        conn = open_store(hub.data_dir)
        try:
            entries = [r[0] for r in conn.execute("SELECT suspends FROM flags").fetchall()]
        finally:
            conn.close()
        assert entries == [1]
        assert _verdict_entries(hub) == [("dismiss", "lifted: the flag is dismissed")]
    finally:
        await hub.stop()


async def test_confirming_a_suspending_flag_bans_the_node_and_its_flag_leads_the_queue(tmp_path: Path) -> None:
    hub = await start_hub(tmp_path / "hub", **HUB)
    try:
        async with aiohttp.ClientSession() as s:
            forger, _, flag_id = await _suspend_a_forger(s, hub, tmp_path)
            assert (await _flags(s, hub))[0]["id"] == flag_id
            out = await _verdict(s, hub, flag_id, "confirm")
            assert out["node_banned"] and out["banned_by_this_verdict"]
            node = await _node(s, hub, forger.node_id)
            assert node["banned"] and not node["suspended"]
            r = await forger.post("/v1/work", seal(forger.key, WorkRequest(
                timestamp=time.time(), nonce=new_nonce(), wait_s=0.0, cached_chunks=())))
            assert r.status == 403 and (await r.json())["error"] == "banned"
        assert _verdict_entries(hub) == [("confirm", "confirmed: the node is banned")]
    finally:
        await hub.stop()


@pytest.mark.parametrize(("reason", "evidence", "suspends"), [
    ("referee_mismatch", {"referee": {}}, True),  # its own segment did not reproduce (or a forged residual chain)
    ("referee_mismatch", {"vouched_for": "u-1"}, False),  # agreed with one that did not: no proof of its own
    ("unverifiable", {}, False),
    ("replica_mismatch", {}, False),
    ("outlier", {}, False),
    ("implausible", {}, False),
])
def test_only_a_proven_mismatch_suspends(reason: str, evidence: dict[str, Any], suspends: bool) -> None:
    assert suspension.flag_suspends(Flag("u-0", "n-0", reason, evidence)) is suspends


def test_confirming_a_suspending_flag_bans_at_once_and_dismissing_it_does_not() -> None:
    rep = Reputation()
    assert suspension.record_verdict(rep, "confirm", True).banned
    assert not suspension.record_verdict(rep, "confirm", False).banned  # three confirmed flags ban
    assert not suspension.record_verdict(rep, "dismiss", True).banned


def test_audit_show_says_a_node_is_suspended_and_why(capsys: pytest.CaptureFixture[str]) -> None:
    from gpuflex.hub.ops import cli_audit

    why = suspension.why("referee_mismatch", "u-1")
    cli_audit._print_node({"id": "gf1-x", "online": True, "suspended": True, "suspension": why})
    assert f"state       SUSPENDED ({why}), online" in capsys.readouterr().out
