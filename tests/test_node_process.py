"""The node as a real process: SIGTERM mid-training exits cleanly within 10 s, tells the hub,
and the shard goes to another node; the CLI's id/status commands."""

from __future__ import annotations

import asyncio
import os
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


def _cli(*a, env=None):
    return subprocess.run(
        [sys.executable, "-m", "gpuflex.node", *a],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_cli_id_is_read_only_version_and_status_without_node(tmp_path):
    from gpuflex.protocol.signing import SigningKey

    r = _cli("id", "--data-dir", str(tmp_path))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "no identity yet" in r.stderr
    assert str(tmp_path / "node.key") in r.stderr and "gpuflex-node run --data-dir" in r.stderr
    assert not (tmp_path / "node.key").exists()
    key = SigningKey.generate()
    key.save(tmp_path / "node.key")
    r = _cli("id", "--data-dir", str(tmp_path))
    assert r.returncode == 0 and r.stdout.strip() == key.fingerprint
    r = _cli("status", "--data-dir", str(tmp_path))
    assert r.returncode == 1 and "no node is running" in r.stderr
    r = _cli("--version")
    assert r.returncode == 0 and "gpuflex-node" in r.stdout


def test_cli_id_without_data_dir_creates_nothing(tmp_path):
    """The default data folder (the platform's, here under XDG_DATA_HOME) is only read."""
    env = dict(os.environ, HOME=str(tmp_path / "home"), XDG_DATA_HOME=str(tmp_path / "xdg"))
    r = _cli("id", env=env)
    where = tmp_path / "xdg" / "gpuflex-node" / "node.key"
    assert r.returncode == 1 and r.stdout == "", r.stderr
    assert "no identity yet" in r.stderr and str(where) in r.stderr
    assert "`gpuflex-node run` creates it" in r.stderr
    assert not (tmp_path / "xdg").exists() and not (tmp_path / "home").exists()


def _closed_port_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_second_node_on_the_same_data_dir_refuses_and_leaves_the_first_alone(tmp_path):
    """Two `gpuflex-node run` on one folder: the second says so in one line and exits 1; the
    first keeps its control endpoint. The lock is the kernel's: a kill -9 leaves none behind."""
    from gpuflex.node.control import URL_FILE, call_control

    data = tmp_path / "node"
    url = _closed_port_url()  # no hub needed: the node retries, its control endpoint is up
    first = start_node_process(data, url)
    procs = [first]
    try:
        out = ProcessEvents(first)
        deadline = time.monotonic() + 60
        while not (data / URL_FILE).exists():
            assert time.monotonic() < deadline and first.poll() is None, out.raw
            time.sleep(0.1)
        control_url = (data / URL_FILE).read_text()
        node_id = call_control(data, "GET", "/v1/status")["node_id"]

        second = start_node_process(data, url)
        procs.append(second)
        stdout, stderr = second.communicate(timeout=60)
        assert second.returncode == 1, (stdout, stderr)
        assert stderr.count("\n") == 1, stderr  # one line, no traceback
        assert stderr.startswith("gpuflex-node: error: another gpuflex-node is already running")
        assert str(data) in stderr and f"pid {first.pid}" in stderr and "--data-dir" in stderr
        assert "registered" not in stdout and "control" not in stdout

        assert first.poll() is None
        assert (data / URL_FILE).read_text() == control_url  # not deleted, not replaced
        assert call_control(data, "GET", "/v1/status")["node_id"] == node_id

        first.kill()  # kill -9: no clean-up ran, the lock file stays, the lock does not
        first.wait(15)
        third = start_node_process(data, url)
        procs.append(third)
        out3 = ProcessEvents(third)
        deadline = time.monotonic() + 60
        while not out3.of("control"):
            assert time.monotonic() < deadline and third.poll() is None, (out3.raw, third.stderr)
            time.sleep(0.1)
        third.send_signal(signal.SIGTERM)
        assert third.wait(15) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_bench_says_what_it_measures_while_it_measures(tmp_path):
    """Not a terminal: one line per step on stderr; the JSON on stdout stays clean."""
    import json

    r = _cli("bench", "--force", "--json", "--device", "cpu", "--threads", "1", "--data-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0].startswith("measuring this machine") and str(tmp_path / "bench.json") in lines[0]
    steps = [line.strip() for line in lines[1:]]
    assert steps[0] == "[1/7] matmul fp32" and steps[-1] == "[7/7] training mlp-784-1024-1024-10/b128"
    assert len(steps) == 7 and "[6/7] training mlp-64-128-10/b32 bf16" in steps
    results = json.loads(r.stdout)
    assert results["quick"] is False and results["cached"] is False
    assert results["matmul_tflops_fp32"] > 0 and results["matmul_tflops_bf16"] is not None
    assert set(results["training"]) == {"mlp-64-128-10/b32", "mlp-784-1024-1024-10/b128"}
    assert set(results["precision_sps"]) == {"fp32", "bf16"} and min(results["precision_sps"].values()) > 0
