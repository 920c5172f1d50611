"""The node as a real process: SIGTERM mid-training exits cleanly within 10 s, tells the hub,
and the shard goes to another node; the CLI's id/status commands."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import torch
from test_node_support import (
    EventLog,
    Hub,
    ProcessEvents,
    agent,
    dataset,
    spec_toml,
    start_node_process,
    wait_for,
)


async def test_sigterm_mid_training_abandons_and_shard_is_reassigned(tmp_path):
    torch.set_num_threads(1)
    hub = await Hub(tmp_path / "hub").start()
    proc = None
    try:
        # 8 chunks of 1024 samples x 1000 epochs: far longer than the test needs to react,
        # so the SIGTERM lands mid-training on any machine.
        await hub.submit(spec_toml(rounds=1, epochs=1000, chunk_size=1024), dataset(n=8192))
        data = tmp_path / "node"
        proc = start_node_process(data, hub.url)
        out = ProcessEvents(proc)
        await wait_for(lambda: out.of("assignment"), timeout=60, step=0.1)
        # Training has started once the status endpoint says so.
        from gpuflex.node.control import call_control

        async def training() -> bool:
            try:
                st = await asyncio.to_thread(call_control, data, "GET", "/v1/status")
            except Exception:
                return False
            return bool(st["assignment"] and st["assignment"]["phase"] == "training")

        deadline = time.monotonic() + 30
        while not await training():
            assert time.monotonic() < deadline, out.raw
            await asyncio.sleep(0.1)
        cache_before = {p.name for p in (data / "cache" / "blobs").iterdir()}
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(proc.wait, 15)
        elapsed = time.monotonic() - t0
        assert rc == 0, out.raw
        assert elapsed < 10, elapsed
        ab = out.of("abandoned")
        assert ab and ab[0]["reason"] == "shutting down" and ab[0]["hub_told"] is True, out.raw
        assert "uploaded" not in out.names()
        assert [r["state"] for r in hub.db_rows("SELECT state FROM assignments")] == ["abandoned"]
        # Cache: only complete blobs, nothing half-written; no temp files left behind.
        blobs = list((data / "cache" / "blobs").iterdir())
        assert {p.name for p in blobs} == cache_before
        assert not (data / "control.url").exists()

        # The shard is free again: another node gets it at once.
        events = EventLog()
        other = agent(tmp_path / "other", hub.url, events)
        task = asyncio.create_task(other.run())
        got = await wait_for(lambda: events.of("assignment"), timeout=20)
        other.request_exit("test")
        await asyncio.wait_for(task, 15)
        assert got[0]["round"] == 0 and got[0]["chunks"] == 8
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        await hub.stop()


def test_cli_id_version_and_status_without_node(tmp_path):
    def run(*a):
        return subprocess.run(
            [sys.executable, "-m", "gpuflex.node", *a],
            capture_output=True,
            text=True,
            timeout=60,
        )
    r = run("id", "--data-dir", str(tmp_path))
    assert r.returncode == 0 and r.stdout.startswith("gf1-")
    assert (tmp_path / "node.key").stat().st_mode & 0o077 == 0
    from gpuflex.protocol.signing import SigningKey

    assert SigningKey.load(tmp_path / "node.key").fingerprint == r.stdout.strip()
    r = run("status", "--data-dir", str(tmp_path))
    assert r.returncode == 1 and "no node is running" in r.stderr
    r = run("--version")
    assert r.returncode == 0 and "gpuflex-node" in r.stdout
