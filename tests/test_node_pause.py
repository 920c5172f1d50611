"""node/pause.py: the pause/resume state machine and what a pause or an exit interrupts;
node/datadir.py in one process: an agent holds its data dir until its run ends."""

from __future__ import annotations

import asyncio

import pytest
from gpuflex.node.datadir import DataDirLock
from gpuflex.node.errors import DataDirBusy
from gpuflex.node.pause import Interrupted, PauseState
from test_node_support import EventLog, agent


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
