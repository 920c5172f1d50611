"""Tokens and roles: who may do what, over the real HTTP API."""

from __future__ import annotations

import aiohttp
import pytest
from gpuflex.hub.ops import cli
from gpuflex.hub.storage.token_admin import list_tokens, revoke_token

from tests.helpers import open_store


async def _status(s, method, url, token=None, **kw):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with s.request(method, url, headers=headers, **kw) as r:
        body = await r.json(content_type=None)
        return r.status, body


async def test_missing_wrong_and_revoked_tokens_are_refused(running_hub):
    url = f"{running_hub.url}/v1/jobs"
    async with aiohttp.ClientSession() as s:
        status, body = await _status(s, "GET", url)
        assert status == 401 and body["error"] == "missing_token"
        status, body = await _status(s, "GET", url, token="gft_not-a-token")
        assert status == 401 and body["error"] == "bad_token"
        async with s.get(url, headers={"Authorization": "Basic abc"}) as r:
            assert r.status == 401
        token = running_hub.token("owner", "bob")
        status, _ = await _status(s, "GET", url, token=token)
        assert status == 200
        bob = next(t for t in list_tokens(running_hub.data_dir, store=running_hub.store) if t["name"] == "bob")
        revoke_token(running_hub.data_dir, int(bob["id"]), store=running_hub.store)  # while it runs
        status, body = await _status(s, "GET", url, token=token)
        assert status == 401 and body["error"] == "bad_token"


async def test_flags_verdict_and_ban_flow(running_hub):
    """Flags are written by the hub; here we insert rows the way rounds.py does and drive verdicts."""
    import time

    from gpuflex.hub.model.node import NodeState
    from gpuflex.hub.server.appkeys import LEDGER

    node_id = "gf1-test-node-aaaa-bbbb-cccc"
    running_hub.app[LEDGER].scheduler.nodes[node_id] = NodeState(
        id=node_id, public_key=b"k" * 32, bench_sps=1.0, ema_sps=1.0, last_seen=time.time()
    )
    conn = open_store(running_hub.data_dir)
    conn.execute(
        "INSERT INTO nodes (id, public_key, software_version, device, benchmark, bench_sps, ema_sps,"
        " registered_at, last_seen) VALUES (?, ?, '0', '{}', '{}', 1, 1, 0, 0)",
        (node_id, b"k" * 32),
    )
    for i in range(3):
        conn.execute(
            "INSERT INTO flags (id, job_id, round, update_id, node_id, reason, evidence, created_at)"
            " VALUES (?, 'j-x', 0, ?, ?, 'outlier', '{\"cosine\": -1}', ?)",
            (f"f-{i}", f"u-{i}", node_id, i),
        )
    conn.commit()
    conn.close()
    base = running_hub.url
    async with aiohttp.ClientSession() as s:
        status, body = await _status(
            s, "GET", f"{base}/v1/flags?status=open", token=running_hub.auditor_token
        )
        assert [f["id"] for f in body["flags"]] == ["f-0", "f-1", "f-2"]
        assert body["flags"][0]["evidence"] == {"cosine": -1}
        status, body = await _status(
            s, "GET", f"{base}/v1/flags?status=bogus", token=running_hub.auditor_token
        )
        assert status == 400
        status, body = await _status(
            s,
            "POST",
            f"{base}/v1/flags/f-0/verdict",
            token=running_hub.auditor_token,
            data=b"not json",
        )
        assert status == 400 and body["error"] == "bad_json"
        status, body = await _status(
            s,
            "POST",
            f"{base}/v1/flags/f-0/verdict",
            token=running_hub.auditor_token,
            json={"verdict": "maybe"},
        )
        assert status == 400 and body["error"] == "bad_verdict"
        for i in range(3):
            status, body = await _status(
                s,
                "POST",
                f"{base}/v1/flags/f-{i}/verdict",
                token=running_hub.auditor_token,
                json={"verdict": "confirm", "note": "bad"},
            )
            assert status == 200 and body["flag"]["status"] == "confirmed"
        assert body["node_banned"] is True
        status, body = await _status(
            s,
            "POST",
            f"{base}/v1/flags/f-0/verdict",
            token=running_hub.auditor_token,
            json={"verdict": "dismiss"},
        )
        assert status == 409 and body["error"] == "already_decided"
        async with s.get(
            f"{base}/v1/audit-log", headers={"Authorization": f"Bearer {running_hub.auditor_token}"}
        ) as r:
            log = await r.read()
        assert log.count(b'"verdict"') >= 3
    from gpuflex.hub.storage.auditlog import verify_log

    check = verify_log(
        log.splitlines(keepends=True),
        running_hub.app[
            __import__("gpuflex.hub.server.appkeys", fromlist=["HUB_KEY"]).HUB_KEY
        ].public_bytes,
    )
    assert check.ok


def test_token_cli_create_list_revoke(tmp_path, capsys):
    data = tmp_path / "hubdata"
    assert (
        cli.main(["token", "create", "--data", str(data), "--role", "owner", "--name", "carol"])
        == 0
    )
    token = capsys.readouterr().out.strip()
    assert token.startswith("gft_") and len(token) > 40
    assert cli.main(["token", "list", "--data", str(data)]) == 0
    listing = capsys.readouterr().out
    assert "carol" in listing and token not in listing
    assert cli.main(["token", "revoke", "--data", str(data), "1"]) == 0
    assert (
        cli.main(["token", "revoke", "--data", str(data), "1"]) == 1
    )  # already revoked: clear error
    assert "no live token" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["token", "create", "--data", str(data), "--role", "king", "--name", "x"])
    import sqlite3

    stored = sqlite3.connect(data / "hub.sqlite3").execute("SELECT hash FROM tokens").fetchall()
    assert all(token not in row[0] for row in stored)  # only hashes are kept
