"""The hub on PostgreSQL end to end: the real app (create_app with HubConfig.store) on loopback,
a real PostgreSQL server (tests/conftest.py's `postgres_server`), real torch, simulated nodes
signing with the protocol. A job runs to done across a hub restart; the same accepted updates
give the same model on both stores; the read side (API, audit, console) reads PostgreSQL rows;
`gpuflex-hub serve --store` and `token ... --store` reach it from the command line."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from gpuflex.hub.server.appkeys import DB, LEDGER
from gpuflex.protocol.messages import Assignment, NoWork

from tests.helpers import SimNode, start_hub, submit_job, wait_job, write_digits
from tests.test_console_helpers import Browserish


def _tokens(hub) -> dict[str, str]:
    return {"owner": hub.owner_token, "auditor": hub.auditor_token, "admin": hub.admin_token}


async def _wait_round(s: aiohttp.ClientSession, hub, job_id: str, round_: int, timeout: float = 60.0) -> dict:
    give_up = time.monotonic() + timeout
    while True:
        async with s.get(f"{hub.url}/v1/jobs/{job_id}", headers=hub.auth()) as r:
            doc = await r.json()
        if doc["round"] >= round_:
            return doc
        assert time.monotonic() < give_up, f"job still in round {doc['round']}"
        await asyncio.sleep(0.05)


async def test_a_digits_job_runs_to_done_on_postgres_and_a_restarted_hub_keeps_it(tmp_path, postgres_url):
    train, val, spec = write_digits(tmp_path / "d", rounds=3)
    data = tmp_path / "hub"
    hub = await start_hub(data, store=postgres_url)
    try:
        assert not (data / "hub.sqlite3").exists(), "the state is in PostgreSQL, not in the data folder"
        async with aiohttp.ClientSession() as s:
            r = await submit_job(s, hub, spec, train, val)
            assert r.status == 201, await r.text()
            job_id = (await r.json())["id"]
            node = SimNode(s, hub.url)
            await node.register()
            assert isinstance(await node.step(), Assignment)
            before = await _wait_round(s, hub, job_id, 1)
            assert [h["round"] for h in before["history"]] == [0]

            await hub.stop()  # a new app on the same database and data folder
            hub = await start_hub(data, tokens=_tokens(hub), store=postgres_url)
            node.url = hub.url
            async with s.get(f"{hub.url}/v1/jobs/{job_id}", headers=hub.auth()) as r:
                after = await r.json()
            assert (after["state"], after["round"]) == ("running", 1)
            assert after["history"] == before["history"], "the closed round is kept as it was"

            for _ in range(2):  # the node (known to the restarted hub) trains the last two rounds
                assert isinstance(await node.step(), Assignment)
            doc = await wait_job(s, hub, job_id)
            assert [h["round"] for h in doc["history"]] == [0, 1, 2]
            assert doc["history"][-1]["accuracy"] > 0.5
            assert all(h["updates"][0]["status"] == "included" for h in doc["history"])
            assert isinstance(await node.work(0.1), NoWork)
            for version in (0, 3):
                async with s.get(f"{hub.url}/v1/jobs/{job_id}/model?round={version}", headers=hub.auth()) as r:
                    assert r.status == 200 and r.headers["X-GPUFlex-Model-Version"] == str(version)
            async with s.get(f"{hub.url}/v1/jobs", headers=hub.auth()) as r:
                assert [j["id"] for j in (await r.json())["jobs"]] == [job_id]
            async with s.get(f"{hub.url}/v1/nodes", headers=hub.auth(hub.auditor_token)) as r:
                (seen,) = (await r.json())["nodes"]
            assert seen["id"] == node.node_id and seen["updates_accepted"] == 3
            async with s.get(f"{hub.url}/healthz") as r:
                assert r.status == 200
            async with s.get(f"{hub.url}/v1/audit-log", headers=hub.auth(hub.auditor_token)) as r:
                assert r.status == 200 and (await r.read()).count(b'"aggregation"') == 3
    finally:
        await hub.stop()


async def test_the_same_accepted_update_gives_the_same_model_on_sqlite_and_on_postgres_after_a_restart(
        tmp_path, postgres_url):
    """An accepted update is durable in PostgreSQL: a hub stopped before it aggregated aggregates
    it on its next start, into the bytes a SQLite hub that never stopped produces."""
    train, val, spec = write_digits(tmp_path / "d", rounds=1)

    async def run(data: Path, store: str | None, restart: bool) -> str:
        hub = await start_hub(data, store=store)
        try:
            async with aiohttp.ClientSession() as s:
                job_id = (await (await submit_job(s, hub, spec, train, val)).json())["id"]
                node = SimNode(s, hub.url)
                await node.register()
                if restart:
                    async def hold(job, now=None):  # this hub accepts the update but never aggregates
                        return None

                    hub.app[LEDGER].rounds.advance = hold
                assert await node.step() is not None
                if restart:
                    await hub.stop()
                    hub = await start_hub(data, tokens=_tokens(hub), store=store)  # aggregates on start
                doc = await wait_job(s, hub, job_id)
        finally:
            await hub.stop()
        return str(doc["history"][0]["model_hash"])

    on_sqlite = await run(tmp_path / "sqlite", None, restart=False)
    on_postgres = await run(tmp_path / "postgres", postgres_url, restart=True)
    assert on_postgres == on_sqlite


async def test_flags_verdicts_tokens_and_the_console_read_postgres(tmp_path, postgres_url):
    from gpuflex.hub.policy.update_record import Flag
    from gpuflex.hub.storage.store_sqlite import insert_flags
    from gpuflex.hub.storage.token_admin import create_token, list_tokens, revoke_token

    train, val, spec = write_digits(tmp_path / "d", rounds=1)
    hub = await start_hub(tmp_path / "hub", store=postgres_url)
    browser = Browserish(hub.url)
    try:
        async with aiohttp.ClientSession() as s:
            job_id = (await (await submit_job(s, hub, spec, train, val)).json())["id"]
            node = SimNode(s, hub.url)
            await node.register()
            evidence = {"problems": ["cosine -0.99 to the round's median < 0"], "cosine": -0.99, "norm_ratio": 1.1}
            flags = [Flag("u-pg-1", node.node_id, "outlier", evidence),
                     Flag("u-pg-2", node.node_id, "free_rider", {"update_norm": 0.0, "threshold": 1e-7})]

            def insert(conn) -> list[str]:  # as verification raises them: through the store's own insert
                insert_flags(conn, job_id, 0, flags, time.time())
                return [r[0] for r in conn.execute("SELECT id FROM flags ORDER BY update_id")]

            first, second = await hub.app[DB].write(insert)
            auditor = hub.auth(hub.auditor_token)
            async with s.get(f"{hub.url}/v1/flags?status=open", headers=auditor) as r:
                assert sorted(f["id"] for f in (await r.json())["flags"]) == sorted([first, second])
            async with s.get(f"{hub.url}/v1/flags/{first[:10]}", headers=auditor) as r:  # a unique prefix
                got = await r.json()
            assert r.status == 200 and got["id"] == first and got["evidence"]["cosine"] == -0.99
            async with s.post(f"{hub.url}/v1/flags/{first}/verdict", headers=auditor,
                              data=json.dumps({"verdict": "dismiss", "note": "honest"})) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["flag"]["status"] == "dismissed"
            async with s.get(f"{hub.url}/v1/flags?status=open", headers=hub.auth()) as r:  # the owner's view
                assert [f["id"] for f in (await r.json())["flags"]] == [second]

        await browser.login(hub.admin_token)
        for path in ("/console/jobs", f"/console/jobs/{job_id}", "/console/nodes", "/console/flags",
                     f"/console/flags/{first}", f"/console/flags/{second}"):
            status, html, _ = await browser.get(path)
            assert status == 200, (path, html[:300])

        enroll = create_token(hub.data_dir, "enroll", "lab", store=postgres_url)
        assert enroll.startswith("gft_")
        listed = {t["name"]: t for t in list_tokens(hub.data_dir, store=postgres_url)}
        assert {"alice", "audrey", "lab"} <= set(listed) and str(listed["lab"]["id"]).startswith("e")
        revoke_token(hub.data_dir, listed["alice"]["id"], store=postgres_url)
        async with aiohttp.ClientSession() as s, s.get(f"{hub.url}/v1/jobs", headers=hub.auth()) as r:
            assert r.status == 401, "a token revoked in PostgreSQL is refused at once"
    finally:
        await browser.close()
        await hub.stop()


def test_serve_and_token_take_store_from_the_command_line(tmp_path, postgres_url):
    """`gpuflex-hub serve --store URL` runs on PostgreSQL; `token create --store URL` reaches it."""
    data = tmp_path / "hubproc"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuflex.hub", "serve", "--data", str(data), "--port", "0", "--store", postgres_url],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines: list[str] = []
    url = ""
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("gpuflex-hub listening on "):
                url = line.rsplit(" ", 1)[1].strip()
                break
        assert url, "\n".join(lines)
        assert any(line.startswith("admin token (shown once): ") for line in lines)
        assert not (data / "hub.sqlite3").exists()
        made = subprocess.run(
            [sys.executable, "-m", "gpuflex.hub", "token", "create", "--data", str(data), "--store", postgres_url,
             "--role", "owner", "--name", "carol"], capture_output=True, text=True, check=True)
        token = made.stdout.strip()
        import urllib.request

        req = urllib.request.Request(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read()) == {"jobs": []}
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_a_released_lease_can_be_taken_at_once(postgres_url):
    """A hub that stops gives its lease up before stop returns: the next hub on the database,
    started at once, leads it (the server had not yet seen the first connection close)."""
    from gpuflex.hub.storage.lease import Lease

    for i in range(40):
        first = Lease(postgres_url, f"first-{i}").acquire()
        first.release()
        Lease(postgres_url, f"second-{i}").acquire().release()
