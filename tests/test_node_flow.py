"""End to end against a real hub over loopback: caching, determinism across nodes,
surviving a hub restart, pause/resume through the local control endpoint."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import torch
from gpuflex.node.control import TOKEN_FILE, URL_FILE, call_control
from test_node_support import EventLog, Hub, agent, dataset, spec_toml, wait_for


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


async def test_cached_chunks_are_not_downloaded_again(tmp_path):
    hub = await Hub(tmp_path / "hub").start()
    try:
        job_id = await hub.submit(spec_toml(rounds=3), dataset())  # 8 chunks of 32
        events = EventLog()
        code = await agent(tmp_path / "node", hub.url, events, max_assignments=2).run()
        assert code == 0 and len(events.of("uploaded")) == 2
        # round 0: the 8 chunks; round 1: nothing (each round's small model comes inside the work answer)
        assert hub.blob_requests() == 8
        assert [e["kind"] for e in events.of("download")] == ["chunk"] * 8
        assert events.of("uploaded")[1]["fetched_bytes"] < events.of("uploaded")[0]["fetched_bytes"]
        # A restarted node keeps its cache too.
        events2 = EventLog()
        assert await agent(tmp_path / "node", hub.url, events2, once=True).run() == 0
        assert hub.blob_requests() == 8  # chunks re-hashed from its cache, the model inline
        assert events2.of("cache")[0]["hits"] >= 1 and not events2.of("download")
        doc = await hub.job(job_id)
        assert doc["round"] >= 2 or doc["state"] == "done"
    finally:
        await hub.stop()


async def test_two_nodes_same_shard_give_byte_identical_updates(tmp_path):
    hub = await Hub(tmp_path / "hub").start()
    try:
        ev_a, ev_b = EventLog(), EventLog()
        a = agent(tmp_path / "a", hub.url, ev_a, once=True)
        b = agent(tmp_path / "b", hub.url, ev_b, once=True)
        ta, tb = asyncio.create_task(a.run()), asyncio.create_task(b.run())
        # Both online before the job exists: the hub replicates a shard only to a second live node.
        await wait_for(lambda: ev_a.of("registered") and ev_b.of("registered"), timeout=20)
        await hub.submit(spec_toml(rounds=1, replication=1.0), dataset())
        done, _ = await asyncio.wait({ta, tb}, timeout=30)
        if len(done) != 2:
            a.request_exit("test")
            b.request_exit("test")
            await asyncio.gather(ta, tb)
            rows = hub.db_rows("SELECT id, shard_id, node_id, state FROM assignments")
            shards = hub.db_rows("SELECT id, replica_group, wanted, state, outcome FROM shards")
            raise AssertionError(f"{ev_a.names()}\n{ev_b.names()}\n{rows}\n{shards}\n{ev_a.of('no_work')[:2]}{ev_b.of('no_work')[:2]}")
        assert [ta.result(), tb.result()] == [0, 0]
        ua, ub = ev_a.of("uploaded")[0], ev_b.of("uploaded")[0]
        rows = hub.db_rows("SELECT shard_id, sha, node_id FROM updates ORDER BY node_id")
        assert len(rows) == 2 and rows[0]["shard_id"] == rows[1]["shard_id"]
        assert rows[0]["node_id"] != rows[1]["node_id"]
        assert ua["update_sha256"] == ub["update_sha256"] == rows[0]["sha"] == rows[1]["sha"]
    finally:
        await hub.stop()


class _UploadSignal(EventLog):
    """Wakes the test the moment the node reports an upload (no polling gap in which a fast
    node could finish the whole job)."""

    def __init__(self) -> None:
        super().__init__()
        self.uploaded = asyncio.Event()

    def event(self, event: str, **fields) -> None:
        super().event(event, **fields)
        if event == "uploaded":
            self.uploaded.set()


async def test_hub_restart_mid_job_node_carries_on(tmp_path):
    hub = await Hub(tmp_path / "hub").start()
    events = _UploadSignal()
    node = agent(tmp_path / "node", hub.url, events, max_assignments=3)
    try:
        # The hub is stopped the moment the first upload is reported (no polling gap), and two
        # more rounds of 60 local epochs are left: the outage always lands mid-job.
        await hub.submit(spec_toml(rounds=3, epochs=60), dataset())
        task = asyncio.create_task(node.run())
        await asyncio.wait_for(events.uploaded.wait(), 30)
        await hub.stop()  # the hub goes away between rounds
        await wait_for(
            lambda: any(e.get("error") == "HubUnavailable" for e in events.of("error")), timeout=15
        )
        assert not task.done()
        await asyncio.sleep(0.5)
        await hub.start()  # same data dir, same port
        code = await asyncio.wait_for(task, 60)
        assert code == 0
        assert len(events.of("uploaded")) == 3
        rows = hub.db_rows("SELECT round FROM updates ORDER BY round")
        assert [r["round"] for r in rows] == [0, 1, 2]
    finally:
        node.request_exit("test")
        await hub.stop()


def _status_url(data_dir):
    return (data_dir / URL_FILE).read_text().strip()


async def test_pause_resume_via_control_endpoint_and_token_required(tmp_path):
    hub = await Hub(tmp_path / "hub").start()
    events = EventLog()
    data = tmp_path / "node"
    node = agent(data, hub.url, events, control=True)
    task = asyncio.create_task(node.run())
    try:
        # Long training (8 chunks of 1024 samples x 1000 epochs) so that pausing lands
        # mid-assignment on any machine.
        await hub.submit(spec_toml(rounds=1, epochs=1000, chunk_size=1024), dataset(n=8192))
        await wait_for(lambda: (data / URL_FILE).exists(), timeout=10)
        assert (data / TOKEN_FILE).stat().st_mode & 0o077 == 0
        url = _status_url(data)
        async with aiohttp.ClientSession() as s:
            for headers in ({}, {"Authorization": "Bearer nope"}):
                async with s.get(url + "/v1/status", headers=headers) as r:
                    assert r.status == 401
                async with s.post(url + "/v1/pause", headers=headers) as r:
                    assert r.status == 401
        assert not node.paused

        await wait_for(
            lambda: node.state == "training" and node.current and node.current.progress > 0,
            timeout=60,
        )
        status = await asyncio.to_thread(call_control, data, "GET", "/v1/status")
        assert status["assignment"]["phase"] == "training" and status["node_id"] == node.node_id
        res = await asyncio.to_thread(call_control, data, "POST", "/v1/pause")
        assert res["paused"] and res["changed"] and res["assignment"]["outcome"] == "handed_back", res
        ab = await wait_for(lambda: events.of("abandoned"), timeout=10)
        assert ab[0]["reason"] == "paused" and ab[0]["hub_told"] is True
        rows = hub.db_rows("SELECT state FROM assignments")
        assert [r["state"] for r in rows] == ["abandoned"]
        await wait_for(lambda: node.state == "paused", timeout=5)
        status = await asyncio.to_thread(call_control, data, "GET", "/v1/status")
        assert status["paused"] and status["assignment"] is None

        await asyncio.to_thread(call_control, data, "POST", "/v1/resume")
        await wait_for(
            lambda: len(events.of("assignment")) >= 2, timeout=15
        )  # the shard comes back
    finally:
        node.request_exit("test")
        code = await asyncio.wait_for(task, 15)
        await hub.stop()
    assert code == 0
    assert not (data / URL_FILE).exists()
    assert json.loads((data / "totals.json").read_text())["abandoned"] >= 1


def _slow_steps_agent_class(seconds: float) -> type:
    """A slow device: its first steps take `seconds` in all, and it proves each one (the steps and
    the digest chain its heartbeats carry), as the real trainer's step callback does."""
    import time

    from gpuflex.node.agent import NodeAgent
    from gpuflex.protocol.messages import progress_digest

    class SlowSteps(NodeAgent):
        def train(self, assignment, chunks, global_state):
            cur = self.current
            until, step = time.monotonic() + seconds, 0
            while time.monotonic() < until and not self.stop_training.wait(0.5):
                step += 1
                cur.digest = progress_digest(cur.digest, step, 1.0 / step)
                cur.steps = step
            return super().train(assignment, chunks, global_state)

    return SlowSteps


async def test_slow_device_keeps_its_assignment_alive_with_heartbeats(tmp_path):
    """Training takes longer than the hub's deadline: heartbeats that prove new steps extend it,
    the update is accepted. (A node that proves no steps loses its shard: tests/test_sybil.py.)"""
    slow_agent = _slow_steps_agent_class(4.0)
    hub = Hub(tmp_path / "hub", min_deadline_s=2.5)  # below the 4 s of slow steps: only heartbeats save it
    await hub.start()
    try:
        await hub.submit(spec_toml(rounds=1, round_target_s=0.01), dataset())
        events = EventLog()
        node = agent(tmp_path / "node", hub.url, events, cls=slow_agent, once=True, heartbeat_s=0.3)
        assert await asyncio.wait_for(node.run(), 60) == 0
        assert events.of("uploaded"), [(e["event"], e.get("detail")) for e in events.events]
        assert len(events.of("heartbeat")) >= 5
        rows = hub.db_rows("SELECT issued_at, deadline, state FROM assignments")
        assert rows[0]["state"] == "done" and rows[0]["deadline"] - rows[0]["issued_at"] > 3.0
    finally:
        await hub.stop()


async def test_hub_forgets_node_then_node_re_registers_by_itself(tmp_path):
    from gpuflex.hub.server.appkeys import LEDGER

    hub = await Hub(tmp_path / "hub").start()
    events = _UploadSignal()
    # Three rounds of 60 local epochs: the table is cleared the moment the first upload is
    # reported, and the later rounds' requests come after the clear however fast this machine is.
    node = agent(tmp_path / "node", hub.url, events, max_assignments=3)
    try:
        await hub.submit(spec_toml(rounds=3, epochs=60), dataset())
        task = asyncio.create_task(node.run())
        await asyncio.wait_for(events.uploaded.wait(), 30)
        hub.app[LEDGER].scheduler.nodes.clear()  # as if the hub lost its node table
        assert await asyncio.wait_for(task, 60) == 0
        assert len(events.of("registered")) >= 2
        assert any(e.get("action") == "re-register" for e in events.of("error"))
        assert len(events.of("uploaded")) == 3
    finally:
        node.request_exit("test")
        await hub.stop()


async def test_hashing_and_cache_listing_stay_off_the_event_loop(tmp_path, monkeypatch):
    """Blob hashing (resumed partials, every received block, commits), the update's encoding
    and hash, and reading inputs run in worker threads; no poll lists the cache folder."""
    import pathlib
    import threading

    hub = await Hub(tmp_path / "hub").start()
    try:
        await hub.submit(spec_toml(rounds=2), dataset())
        events = EventLog()
        node = agent(tmp_path / "node", hub.url, events, max_assignments=2)
        loop_thread = threading.get_ident()
        calls: list[tuple[str, bool]] = []  # (what, ran on the event loop's thread)

        def spy(obj, name):
            real = getattr(obj, name)

            def wrapper(*a, **kw):
                calls.append((name, threading.get_ident() == loop_thread))
                out = real(*a, **kw)
                if name == "writer":
                    spy(out, "write")
                    spy(out, "commit")
                return out

            setattr(obj, name, wrapper)

        spy(node.cache, "writer")
        spy(node.cache, "verify")
        spy(node.transfers._encoder, "encode")
        listed: list[pathlib.Path] = []
        real_iterdir = pathlib.Path.iterdir
        monkeypatch.setattr(pathlib.Path, "iterdir", lambda p: listed.append(p) or real_iterdir(p))
        assert await asyncio.wait_for(node.run(), 60) == 0
        assert len(events.of("uploaded")) == 2
        kinds = {name for name, _ in calls}
        assert {"writer", "write", "commit", "encode"} <= kinds, kinds
        assert not [name for name, on_loop in calls if on_loop], calls
        assert node.cache.blob_dir not in listed  # the work requests' cache lists: the index
    finally:
        await hub.stop()


async def test_a_job_the_referee_never_checks_trains_without_checkpoint_commitments(tmp_path):
    """No replica and no spot-check: the assignment says commit = false, the node records no
    checkpoint (none of the commitment's cost) and its update carries none; by default it does."""
    hub = await Hub(tmp_path / "hub").start()
    try:
        bare = await hub.submit(spec_toml(rounds=1, spot_check=0.0) + "spot_check_trusted = 0.0\n", dataset())
        code = await agent(tmp_path / "n1", hub.url, EventLog(), max_assignments=1).run()
        assert code == 0
        rows = hub.db_rows("SELECT commitment FROM updates WHERE job_id = ?", (bare,))
        assert rows and all(r["commitment"] is None for r in rows)
        assert not list((tmp_path / "n1").glob("checkpoints/**/*.gft"))
        await wait_for(lambda: hub.db_rows("SELECT state FROM jobs WHERE id = ?", (bare,))[0]["state"] == "done")
        checked = await hub.submit(spec_toml(rounds=1, spot_check=0.25), dataset())  # the default rate
        assert await agent(tmp_path / "n2", hub.url, EventLog(), max_assignments=1).run() == 0
        rows = hub.db_rows("SELECT commitment FROM updates WHERE job_id = ?", (checked,))
        assert rows and all(json.loads(r["commitment"])["steps"] > 0 for r in rows)
    finally:
        await hub.stop()
