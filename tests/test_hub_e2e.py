"""End to end over loopback: submit, nodes train rounds, the model improves and downloads."""

from __future__ import annotations

import aiohttp

from gpuflex.protocol.messages import Assignment, NoWork
from gpuflex.protocol.tensors import state_from_safetensors
from tests.helpers import SimNode, submit_job, wait_job


async def test_one_node_job_runs_to_done(running_hub, digits_npz):
    train, val, spec = digits_npz
    async with aiohttp.ClientSession() as s:
        r = await submit_job(s, running_hub, spec, train, val)
        assert r.status == 201, await r.text()
        job = await r.json()
        node = SimNode(s, running_hub.url)
        await node.register()
        for _ in range(2):
            a = await node.step()
            assert isinstance(a, Assignment)
            assert a.job_id == job["id"]
        doc = await wait_job(s, running_hub, job["id"])
        assert [h["round"] for h in doc["history"]] == [0, 1]
        assert doc["history"][-1]["accuracy"] > 0.5
        assert isinstance(await node.work(0.1), NoWork)
        async with s.get(f"{running_hub.url}/v1/jobs/{job['id']}/model", headers=running_hub.auth()) as r:
            assert r.status == 200
            state = state_from_safetensors(await r.read())
        assert "0.weight" in state
