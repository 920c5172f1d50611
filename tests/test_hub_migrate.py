"""`gpuflex-hub migrate`: a real hub's SQLite state moved into a real PostgreSQL server (the
session's `postgres_server`), through the command line, and the job carries on there; every
refusal leaves both sides as they were; one hub process per data folder."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import aiohttp
import psycopg
import pytest
from gpuflex.hub.storage.datalock import DataFolderBusy, DataLock
from gpuflex.hub.storage.migrate import MigrationError, migrate, row_digest, tables
from gpuflex.protocol.messages import Assignment, NoWork

from tests.helpers import SimNode, start_hub, submit_job, wait_job, write_digits
from tests.test_hub_postgres import _tokens, _wait_round


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuflex.hub", *args], capture_output=True, text=True, timeout=120)


def _counts(url: str) -> dict[str, int]:
    with psycopg.connect(url) as conn:
        return {t: int(conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0]) for t in tables()}


def _pg_tables_exist(url: str) -> bool:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT to_regclass('public.jobs')").fetchone()[0] is not None


async def test_a_running_job_moves_to_postgres_and_finishes_there_with_the_same_tokens(tmp_path, postgres_url):
    train, val, spec = write_digits(tmp_path / "d", rounds=3)
    data = tmp_path / "hub"
    hub = await start_hub(data, store=None)
    async with aiohttp.ClientSession() as s:
        r = await submit_job(s, hub, spec, train, val)
        assert r.status == 201, await r.text()
        job_id = (await r.json())["id"]
        node = SimNode(s, hub.url)
        await node.register()
        assert isinstance(await node.step(), Assignment)
        before = await _wait_round(s, hub, job_id, 1)
        async with s.get(f"{hub.url}/v1/nodes", headers=hub.auth(hub.auditor_token)) as r:
            nodes_before = (await r.json())["nodes"]

        refused = _cli("migrate", "--data", str(data), "--to", postgres_url)  # the hub still runs
        assert refused.returncode == 1 and "in use by a hub" in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1
        assert (data / "hub.sqlite3").exists()

        await hub.stop()
        done = _cli("migrate", "--data", str(data), "--to", postgres_url)
        assert done.returncode == 0, done.stderr
        assert "jobs" in done.stdout and "count + digest" in done.stdout
        assert not (data / "hub.sqlite3").exists() and (data / "hub.sqlite3.migrated").is_file()
        marker = json.loads((data / "migrated.json").read_text())
        assert marker["tables"]["jobs"]["rows"] == 1 and marker["tables"]["updates"]["rows"] == 1
        assert "password" not in json.dumps(marker)

        with pytest.raises(MigrationError, match="moved to postgresql://"):  # no silent empty hub on SQLite
            await start_hub(data, tokens=_tokens(hub), store=None)
        again = _cli("migrate", "--data", str(data), "--to", postgres_url)
        assert again.returncode == 1 and "already migrated" in again.stderr

        hub = await start_hub(data, tokens=_tokens(hub), store=postgres_url)  # the same tokens work
        try:
            node.url = hub.url
            async with s.get(f"{hub.url}/v1/jobs/{job_id}", headers=hub.auth()) as r:
                after = await r.json()
            assert (after["state"], after["round"]) == ("running", 1)
            assert after["history"] == before["history"]
            async with s.get(f"{hub.url}/v1/nodes", headers=hub.auth(hub.auditor_token)) as r:
                nodes_after = (await r.json())["nodes"]
            assert [(n["id"], n["updates_accepted"]) for n in nodes_after] == \
                [(n["id"], n["updates_accepted"]) for n in nodes_before]
            for _ in range(2):  # the node the SQLite hub registered trains the last two rounds
                assert isinstance(await node.step(), Assignment)
            doc = await wait_job(s, hub, job_id)
            assert [h["round"] for h in doc["history"]] == [0, 1, 2]
            assert isinstance(await node.work(0.1), NoWork)
            for version in (0, 1, 3):  # blobs stayed in the data folder; the rows that name them moved
                async with s.get(f"{hub.url}/v1/jobs/{job_id}/model?round={version}", headers=hub.auth()) as r:
                    assert r.status == 200
        finally:
            await hub.stop()
    made = _cli("token", "create", "--data", str(data), "--store", postgres_url, "--role", "owner", "--name", "bob")
    assert made.returncode == 0, made.stderr  # the identity counter moved past the copied token ids
    listed = _cli("token", "list", "--data", str(data), "--store", postgres_url)
    assert {"alice", "audrey", "bob"} <= set(listed.stdout.split())


async def test_a_database_that_already_holds_a_hub_is_never_merged_into(tmp_path, postgres_url):
    other = await start_hub(tmp_path / "other", store=postgres_url)  # a hub already lives there
    await other.stop()
    counts = _counts(postgres_url)
    data = tmp_path / "hub"
    await (await start_hub(data, store=None)).stop()
    with pytest.raises(MigrationError, match="already holds a hub"):
        migrate(data, postgres_url)
    assert _counts(postgres_url) == counts
    assert (data / "hub.sqlite3").exists() and not (data / "migrated.json").exists()


async def test_a_row_postgres_refuses_rolls_the_whole_copy_back(tmp_path, postgres_url):
    data = tmp_path / "hub"
    await (await start_hub(data, store=None)).stop()
    conn = sqlite3.connect(data / "hub.sqlite3")
    conn.execute("INSERT INTO nodes (id, public_key, software_version, device, benchmark, bench_sps, ema_sps,"
                 " registered_at, last_seen, agreements_total) VALUES ('n1', x'00', '1', '{}', '{}', 1, 1, 0, 0, 1.5)")  # SQLite keeps a REAL in an INTEGER column
    conn.commit()
    conn.close()
    with pytest.raises(MigrationError, match="nothing was committed"):
        migrate(data, postgres_url)
    assert set(_counts(postgres_url).values()) == {0}, "tokens were copied before nodes: rolled back too"
    assert (data / "hub.sqlite3").exists() and not (data / "migrated.json").exists()


def test_refusals_are_one_line_and_change_nothing(tmp_path, postgres_url):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _cli("migrate", "--data", str(empty), "--to", postgres_url)
    assert r.returncode == 1 and r.stderr.startswith("error: no hub database")
    r = _cli("migrate", "--data", str(empty), "--to", "mysql://x@localhost/db")
    assert r.returncode == 1 and "postgresql://" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not _pg_tables_exist(postgres_url)


async def test_one_hub_process_per_data_folder(tmp_path):
    hub = await start_hub(tmp_path / "hub", store=None)
    try:
        with pytest.raises(DataFolderBusy, match=r"in use by a hub \(pid \d+\)"):
            await start_hub(tmp_path / "hub", tokens=_tokens(hub), store=None)
    finally:
        await hub.stop()
    again = await start_hub(tmp_path / "hub", tokens=_tokens(hub), store=None)  # released at stop
    await again.stop()
    lock = DataLock(tmp_path / "hub", "test").acquire()
    lock.release()


def test_the_digest_ignores_row_order_and_sees_any_changed_value() -> None:
    rows = [(1, "a", 0.5, b"\x00\x01", None), (2, "b", 1.0, b"", "x")]
    assert row_digest(rows) == row_digest(reversed(rows))
    assert row_digest(rows)[0] == 2
    for changed in ([(1, "a", 0.5000001, b"\x00\x01", None), rows[1]], [(1, "a", 0.5, b"\x00\x02", None), rows[1]],
                    [(1, "a", 0.5, b"\x00\x01", ""), rows[1]], rows[:1]):
        assert row_digest(changed) != row_digest(rows)


def test_every_table_of_the_schema_is_migrated() -> None:
    from gpuflex.hub.storage.db import _SCHEMA

    assert tables() == [t for t in tables() if f"CREATE TABLE IF NOT EXISTS {t} " in _SCHEMA]
    assert set(tables()) >= {"tokens", "enroll_tokens", "jobs", "nodes", "updates", "flags", "state_requests"}

