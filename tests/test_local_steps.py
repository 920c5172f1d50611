"""[train] local_steps (issue 17, DiLoCo rounds): a fixed number of optimizer steps per
assignment in place of local_epochs passes. The node's trainer, the hub's accounting and the
referee's commitment grid all count the same steps (protocol/workload.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from gpuflex.node.trainer import train_assignment
from gpuflex.protocol.errors import SpecError
from gpuflex.protocol.jobspec import parse_job_spec
from gpuflex.protocol.workload import assignment_steps, samples_processed
from test_node_support import EventLog, Hub, agent, dataset, spec_toml, wait_for

from tests.tooling import attacks as atk


def test_steps_and_samples_of_an_assignment() -> None:
    assert assignment_steps(100, 32, 3) == 12 and samples_processed(100, 32, 3) == 300
    assert assignment_steps(100, 32, 3, local_steps=10) == 10
    # 4 steps an epoch: 2 whole epochs (200 samples), then 2 batches of 32 of the third
    assert samples_processed(100, 32, 3, local_steps=10) == 264
    assert samples_processed(100, 32, 1, local_steps=3) == 96
    assert samples_processed(100, 32, 1, local_steps=4) == 100  # the last batch holds 4
    assert assignment_steps(0, 32, 3, local_steps=10) == 0 and samples_processed(0, 32, 3, 10) == 0


def test_the_job_spec_takes_local_steps_and_refuses_bad_ones() -> None:
    base = '[job]\nname = "s"\n[model]\nkind = "mlp"\ninput = 64\nhidden = [8]\noutputs = 10\n[train]\n'
    spec = parse_job_spec(base + "local_steps = 50\n")
    assert spec.train.local_steps == 50 and spec.train.train_config().local_steps == 50
    assert spec.train.steps(1000) == 50 and parse_job_spec(base).train.steps(64) == 2
    for bad in ("-1", "1.5", '"many"'):
        with pytest.raises(SpecError, match=r"train\.local_steps"):
            parse_job_spec(base + f"local_steps = {bad}\n")


def test_the_trainer_stops_after_local_steps_on_the_epochs_own_batches() -> None:
    """Steps walk the same per-epoch permutations: 4 steps over a 4-batch shard ARE one epoch
    (bit for bit), and 7 steps stop 3 batches into the second epoch."""
    torch.set_num_threads(1)
    spec = atk.digits_spec()
    xtr, ytr, _, _ = atk.digits_data()
    chunk = {"x": xtr[:128], "y": ytr[:128]}
    state = atk.initial_state(spec)
    epoch = train_assignment(spec, state, [chunk], atk.train_config(local_epochs=1), 5, device=torch.device("cpu"))
    four = train_assignment(spec, state, [chunk], atk.train_config(local_epochs=9, local_steps=4), 5,
                            device=torch.device("cpu"))
    assert epoch.steps == four.steps == 4
    assert all(torch.equal(epoch.delta[k], four.delta[k]) for k in epoch.delta)
    seen: list[int] = []
    seven = train_assignment(spec, state, [chunk], atk.train_config(local_epochs=1, local_steps=7), 5,
                             device=torch.device("cpu"), on_step=lambda s, m, o, scaler: seen.append(s))
    assert seven.steps == 7 and seen == list(range(8)) and seven.sample_count == 128
    assert not all(torch.equal(epoch.delta[k], seven.delta[k]) for k in epoch.delta)


async def test_a_local_steps_job_runs_with_the_referee_checking_its_steps(tmp_path) -> None:
    """A real node agent against a real hub: every assignment trains exactly local_steps steps,
    commits to that grid, and the referee's spot-check re-executes a segment of it."""
    hub = await Hub(tmp_path / "hub").start()
    try:
        job_id = await hub.submit(spec_toml(rounds=2, chunk_size=64, extra_train="local_steps = 11\n",
                                            spot_check=1.0), dataset(n=256))
        events = EventLog()
        node = agent(tmp_path / "node", hub.url, events)
        task = asyncio.create_task(node.run())
        await wait_for(lambda: len(events.of("uploaded")) >= 2, timeout=90)
        doc = await hub.wait_job(job_id, 30)
        node.request_exit("test")
        await asyncio.wait_for(task, 15)
        assert [e["steps"] for e in events.of("trained")] == [11, 11]
        rows = hub.db_rows("SELECT status, reason FROM state_requests ORDER BY requested_at")
        assert [(r["status"], r["reason"]) for r in rows] == [("reproduced", "spot_check")] * 2
        assert all(not h["flags"] for h in doc["history"])
    finally:
        await hub.stop()
