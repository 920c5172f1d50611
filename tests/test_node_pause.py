"""node/pause.py: the pause/resume state machine and what a pause or an exit interrupts;
node/datadir.py in one process: an agent holds its data dir until its run ends."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch
from gpuflex.node.control import URL_FILE
from gpuflex.node.datadir import DataDirLock
from gpuflex.node.errors import DataDirBusy
from gpuflex.node.pause import Interrupted, PauseState
from test_node_support import EventLog, Hub, agent, dataset, spec_toml, wait_for


async def test_pause_resume_exit_transitions_and_events():
    events = EventLog()
    p = PauseState(events)
    assert not p.paused and p.resumed.is_set() and not p.stop_training.is_set()
    assert p.pause("user") and not p.pause("user")  # the second changes nothing
    assert p.paused and p.reason == "user" and p.stop_training.is_set() and p.interrupt.is_set()
    assert not p.resumed.is_set()
    assert p.resume() and not p.resume()
    assert not p.stop_training.is_set() and not p.interrupt.is_set() and p.resumed.is_set()
    p.pause("gpu_busy")
    p.request_exit("SIGTERM")
    assert p.exiting and p.exited.is_set() and p.resumed.is_set()
    p.resume()  # resuming while exiting never clears the stop
    assert p.stop_training.is_set() and p.interrupt.is_set()
    assert events.names() == ["paused", "resumed", "paused", "stopping", "resumed"]
    assert events.of("stopping")[0]["reason"] == "SIGTERM"


async def test_a_pause_interrupts_a_wait_and_a_new_assignment_clears_a_spent_stop():
    p = PauseState(EventLog())
    assert await p.interruptible(asyncio.sleep(0, result=7)) == 7
    wait = asyncio.ensure_future(p.interruptible(asyncio.sleep(60)))
    await asyncio.sleep(0.05)
    p.pause()
    with pytest.raises(Interrupted):
        await asyncio.wait_for(wait, 5)
    with pytest.raises(Interrupted):  # already paused: refused before it starts
        await p.interruptible(asyncio.sleep(60))
    p.resume()
    p.stop_training.set()  # e.g. the hub dropped the previous assignment
    p.new_assignment()
    assert not p.stop_training.is_set()
    await asyncio.wait_for(p.sleep(0.01), 5)


async def test_an_agent_holds_its_data_dir_until_its_run_ends(tmp_path):
    data = tmp_path / "node"
    first = agent(data, "http://127.0.0.1:9", once=True)
    with pytest.raises(DataDirBusy, match="already running with data dir"):
        agent(data, "http://127.0.0.1:9")
    first.request_exit("test")
    assert await asyncio.wait_for(first.run(), 15) == 0
    second = agent(data, "http://127.0.0.1:9")  # free again
    second.lock.release()
    lock = DataDirLock(data).acquire()
    with pytest.raises(DataDirBusy):
        DataDirLock(data).acquire()
    lock.release()


def _node_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """The real `gpuflex-node` command line, in its own process."""
    return subprocess.run([sys.executable, "-m", "gpuflex.node", *argv], capture_output=True, text=True, timeout=120)


async def test_gpuflex_node_pause_says_whether_an_assignment_was_handed_back(tmp_path):
    """`gpuflex-node pause` says what the pause did: with nothing in hand, that nothing was
    handed back; with an assignment training, that this assignment went back to the hub."""
    torch.set_num_threads(1)
    hub = await Hub(tmp_path / "hub").start()
    data = tmp_path / "node"
    node = agent(data, hub.url, EventLog(), control=True)
    task = asyncio.create_task(node.run())
    try:
        await wait_for(lambda: (data / URL_FILE).exists() and node.registered, timeout=30)
        idle = await asyncio.to_thread(_node_cli, "pause", "--data-dir", str(data))
        assert idle.returncode == 0, idle.stderr
        assert "handed back" not in idle.stdout and "no assignment was in hand" in idle.stdout, idle.stdout
        again = await asyncio.to_thread(_node_cli, "pause", "--data-dir", str(data))
        assert again.stdout.strip() == "already paused"
        assert (await asyncio.to_thread(_node_cli, "resume", "--data-dir", str(data))).returncode == 0

        # long training (8 chunks of 1024 samples x 1000 epochs): the pause lands mid-assignment
        await hub.submit(spec_toml(rounds=1, epochs=1000, chunk_size=1024), dataset(n=8192))
        await wait_for(lambda: node.state == "training" and node.current and node.current.progress > 0, timeout=60)
        held = node.current.assignment.assignment_id
        busy = await asyncio.to_thread(_node_cli, "pause", "--data-dir", str(data))
        assert busy.returncode == 0, busy.stderr
        assert f"assignment {held} was handed back to the hub" in busy.stdout, busy.stdout
        assert [r["state"] for r in hub.db_rows("SELECT state FROM assignments")] == ["abandoned"]
    finally:
        node.request_exit("test")
        await asyncio.wait_for(task, 15)
        await hub.stop()
