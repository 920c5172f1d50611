"""The Sybil defences' state in the store, and a ban's block cooldown in the operator's hands, on a
real hub over loopback with the production defences and its SQLite store (hub/policy/admission.py,
hub/domain/ledger/cooldowns.py, `gpuflex-hub cooldown`).

Linux routes all of 127.0.0.0/8 to loopback: a session bound to 127.0.N.x connects from block
127.0.N.0/24. A node registers from one block and is then seen in another; banned there, both
blocks cool down, across a restart too. The operator lists the cooldowns with their time left
and the ban that caused them, and lifts one block for one address (a NAT with innocent
contributors behind it): new identities from that address are admitted, the rest of the block
stays cooled down, and the audit log and a restart keep the lift."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gpuflex.hub.ops import cli
from gpuflex.protocol.signing import SigningKey, seal

from tests.helpers import (
    RunningHub,
    SimNode,
    open_store,
    production_defences,
    sessions_from,
    start_hub,
)


def _rows(hub: RunningHub, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    conn = open_store(hub.data_dir)
    try:
        return [tuple(r) for r in conn.execute(sql, args).fetchall()]
    finally:
        conn.close()


async def _register_from(hub: RunningHub, address: str) -> tuple[int, str]:
    """A NEW identity says hello from ``address``: (status, error code or "")."""
    async with sessions_from(address) as (s,):
        node = SimNode(s, hub.url)
        async with s.get(hub.url + "/v1/hub") as r:
            node.hub_public = bytes.fromhex((await r.json())["public_key"])
        async with s.post(
            hub.url + "/v1/nodes/register",
            data=seal(node.key, node.hello()),
            headers={"Content-Type": "application/x-msgpack"},
        ) as r:
            return r.status, "" if r.status == 200 else (await r.json())["error"]


async def _ban(hub: RunningHub, node_id: str) -> None:
    """A proven mismatch against the node (as the referee writes it), confirmed by the auditor:
    that bans it at once (hub/policy/suspension.py)."""
    conn = open_store(hub.data_dir)
    conn.execute(
        "INSERT INTO flags (id, job_id, round, update_id, node_id, reason, evidence, created_at, suspends)"
        " VALUES ('f-c001', 'j-x', 0, 'u-x', ?, 'referee_mismatch', '{}', ?, 1)",
        (node_id, time.time()),
    )
    conn.commit()
    conn.close()
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"{hub.url}/v1/flags/f-c001/verdict",
            json={"verdict": "confirm", "note": "proven"},
            headers=hub.auth(hub.auditor_token),
        ) as r,
    ):
        assert r.status == 200, await r.text()
        assert (await r.json())["node_banned"]


async def _cli(
    capsys: pytest.CaptureFixture[str], hub: RunningHub, *argv: str
) -> tuple[int, str, str]:
    code = await asyncio.to_thread(cli.main, [*argv, "--hub", hub.url, "--token", hub.admin_token])
    out, err = capsys.readouterr()
    return code, out, err


async def _restart(hub: RunningHub) -> RunningHub:
    tokens = {"owner": hub.owner_token, "auditor": hub.auditor_token, "admin": hub.admin_token}
    await hub.stop()
    return await start_hub(hub.data_dir, tokens=tokens, **production_defences())


async def test_a_ban_cools_down_where_the_node_was_last_seen_and_the_operator_lifts_it_per_address(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hub = await start_hub(tmp_path / "hub", **production_defences())
    try:
        key = SigningKey.generate()
        async with sessions_from("127.0.41.1", "127.0.42.1") as (home, away):
            node = SimNode(home, hub.url, key=key)
            await node.register()
            roaming = SimNode(away, hub.url, key=key, hub_public=node.hub_public)
            await roaming.work(0.05)  # the same node, seen in another block
        assert _rows(hub, "SELECT address_block, last_block FROM nodes") == [
            ("127.0.41.0/24", "127.0.42.0/24")
        ]
        hub = await _restart(hub)  # the block it was last seen in is the store's, not only memory's
        await _ban(hub, node.node_id)
        hub = await _restart(hub)
        assert await _register_from(hub, "127.0.42.2") == (403, "cooldown")
        assert await _register_from(hub, "127.0.41.2") == (403, "cooldown")

        code, out, err = await _cli(capsys, hub, "cooldown", "list")
        assert code == 0, err
        rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("block ")}
        assert set(rows) == {"127.0.41.0/24", "127.0.42.0/24"}, out
        for line in rows.values():
            assert (
                " 7.0 d " in line
                and f"ban of {node.node_id} at " in line
                and line.rstrip().endswith("-")
            ), line

        code, out, err = await _cli(
            capsys, hub, "cooldown", "lift", "127.0.42.2", "--note", "a university NAT"
        )
        assert code == 0, err
        assert "127.0.42.2 in 127.0.42.0/24" in out and node.node_id in out
        assert await _register_from(hub, "127.0.42.2") == (
            200,
            "",
        )  # that address is admitted again ...
        assert await _register_from(hub, "127.0.42.3") == (
            403,
            "cooldown",
        )  # ... the rest of the block is not
        code, out, _ = await _cli(capsys, hub, "cooldown", "list", "--json")
        listed = {c["name"]: c for c in json.loads(out)["cooldowns"]}
        assert (
            listed["127.0.42.0/24"]["lifted"] == ["127.0.42.2"]
            and listed["127.0.41.0/24"]["lifted"] == []
        )
        assert 6.9 * 86400 < listed["127.0.42.0/24"]["remaining_s"] <= 7 * 86400
        entries = [
            json.loads(line)
            for line in (hub.data_dir / "audit.jsonl").read_text().splitlines()
            if line
        ]
        (lift,) = [e["body"] for e in entries if e["kind"] == "cooldown_lift"]
        assert (lift["address"], lift["block"], lift["banned_node"], lift["note"]) == (
            "127.0.42.2",
            "127.0.42.0/24",
            node.node_id,
            "a university NAT",
        )

        hub = await _restart(hub)  # the lift is the store's too
        assert await _register_from(hub, "127.0.42.2") == (200, "")
        assert await _register_from(hub, "127.0.42.4") == (403, "cooldown")
    finally:
        await hub.stop()


async def test_lifting_a_whole_block_and_what_cannot_be_lifted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hub = await start_hub(tmp_path / "hub", **production_defences())
    try:
        async with sessions_from("127.0.43.1") as (s,):
            node = SimNode(s, hub.url)
            await node.register()
        code, _, err = await _cli(capsys, hub, "cooldown", "lift", "127.0.43.9")
        assert code != 0 and "409 not_cooling" in err and "\n" not in err.strip()
        await _ban(hub, node.node_id)
        for bad, why in (
            ("127.0.43.0/16", "not an address block as the hub counts them"),
            ("not-an-ip", "neither an IP address nor an address block"),
        ):
            code, _, err = await _cli(capsys, hub, "cooldown", "lift", bad)
            assert code != 0 and "400 bad_address" in err and why in err, err
        async with (
            aiohttp.ClientSession() as s,
            s.get(hub.url + "/v1/cooldowns", headers=hub.auth(hub.auditor_token)) as r,
        ):
            assert (r.status, (await r.json())["error"]) == (403, "wrong_role")
        code, out, err = await _cli(capsys, hub, "cooldown", "lift", "127.0.43.0/24")
        assert code == 0 and "the whole block" in out, err
        assert await _register_from(hub, "127.0.43.7") == (200, "")
    finally:
        await hub.stop()
