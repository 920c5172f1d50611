"""A dead background loop is never silent: /healthz turns 503, the traceback is logged, the job
shows the error, and the loop starts again by itself once the fault is gone."""

from __future__ import annotations

import asyncio
import logging
import sqlite3

import aiohttp
from gpuflex.hub.server.appkeys import LEDGER, STORE
from gpuflex.protocol.messages import Assignment

from tests.helpers import SimNode, digits_spec, start_hub, submit_job, wait_job, write_digits


async def test_round_loop_failure_is_reported_and_the_loop_restarts(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="gpuflex.hub")
    hub = await start_hub(tmp_path / "hub", loop_restart_s=3.0)
    train, val, _ = write_digits(tmp_path / "digits")
    store = hub.app[STORE]
    healthy_close, healthy_end = store.close_round, store.end_job

    async def disk_failure(*args, **kwargs):
        raise sqlite3.OperationalError("disk I/O error")

    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{hub.url}/healthz") as r:
                assert r.status == 200 and (await r.json())["loops"]["rounds"]["running"]
            r = await submit_job(s, hub, digits_spec(rounds=1), train, val)
            assert r.status == 201, await r.text()
            job_id = (await r.json())["id"]
            # The disk fails: closing the round fails, and so does failing the job.
            store.close_round = disk_failure
            store.end_job = disk_failure
            node = SimNode(s, hub.url)
            await node.register()
            assert isinstance(await node.step(), Assignment)
            health = None
            for _ in range(100):
                async with s.get(f"{hub.url}/healthz") as r:
                    if r.status == 503:
                        health = await r.json()
                        break
                await asyncio.sleep(0.05)
            assert health is not None, "/healthz stayed 200 while the round loop was dead"
            assert "rounds" in health["error"] and "disk I/O error" in health["error"]
            assert health["loops"]["rounds"]["restarts"] == 1
            logged = [r for r in caplog.records if r.exc_info and "rounds" in r.getMessage()]
            assert logged, "the loop's death left no traceback in the log"
            async with s.get(f"{hub.url}/v1/jobs/{job_id}", headers=hub.auth()) as r:
                doc = await r.json()
            assert doc["state"] == "running" and "disk I/O error" in (doc["error"] or ""), doc
            # The disk is back: the loop starts again by itself and the round closes.
            store.close_round, store.end_job = healthy_close, healthy_end
            done = await wait_job(s, hub, job_id, timeout=30)
            assert [h["round"] for h in done["history"]] == [0]
            assert not done["error"]
            async with s.get(f"{hub.url}/healthz") as r:
                assert r.status == 200
                assert (await r.json())["loops"]["rounds"]["restarts"] == 1
    finally:
        await hub.stop()


async def test_sweep_loop_failure_turns_health_red_until_it_recovers(tmp_path):
    hub = await start_hub(tmp_path / "hub", loop_restart_s=2.0)
    assignments = hub.app[LEDGER].assignments
    healthy = assignments.expire_overdue
    calls = 0

    async def broken(now: float) -> int:
        nonlocal calls
        calls += 1
        raise RuntimeError("sweep broke")

    try:
        assignments.expire_overdue = broken
        async with aiohttp.ClientSession() as s:
            statuses = []
            for _ in range(60):
                async with s.get(f"{hub.url}/healthz") as r:
                    statuses.append(r.status)
                    if r.status == 503:
                        assert "sweep broke" in (await r.json())["error"]
                        break
                await asyncio.sleep(0.05)
            assert statuses[-1] == 503 and calls >= 1
            assignments.expire_overdue = healthy
            for _ in range(100):
                async with s.get(f"{hub.url}/healthz") as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.05)
            assert r.status == 200
    finally:
        await hub.stop()
