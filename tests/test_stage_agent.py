"""The node agent's side of a pipeline stage, against a real hub on 127.0.0.1: a bad
StageAssignment is refused in one line before anything runs; a good one runs in a worker thread
with a line when it starts and one when it ends, its blobs read from the node's cache; the hub's
answers to its reports and checkpoints reach the worker (a hub that does not take this node's
stage ends it without a step more)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
from pathlib import Path

import aiohttp
import pytest
import torch
from gpuflex.node.agent import NodeAgent, NodeConfig
from gpuflex.node.client import HubClient
from gpuflex.node.errors import AssignmentRejected, PipelineError
from gpuflex.node.output import Output
from gpuflex.node.stagework import HubStage, take_stage
from gpuflex.protocol.messages import Benchmark, StageReport
from gpuflex.protocol.signing import new_nonce
from gpuflex.protocol.tensors import sha256_hex

from tests.helpers import start_hub
from tests.test_stage_worker import SGD, STACK, Job

torch.set_num_threads(1)

BENCH = Benchmark(
    samples_per_s=100.0,
    matmul_tflops_fp32=0.1,
    matmul_tflops_bf16=None,
    matmul_tflops_fp16=None,
    mem_bandwidth_gbs=1.0,
    h2d_gbs=None,
    d2h_gbs=None,
    reference_model="x",
)


async def test_the_agent_checks_then_runs_a_stage_and_says_so(tmp_path: Path) -> None:
    hub = await start_hub(tmp_path / "hub")
    lines = io.StringIO()
    agent = NodeAgent(
        NodeConfig(
            hub_url=hub.url,
            data_dir=tmp_path / "node",
            control=False,
            benchmark=BENCH,
            device="cpu",
        ),
        output=Output(lines, json_lines=True),
    )
    try:
        async with aiohttp.ClientSession() as session:
            agent.client = HubClient(hub.url, agent.key, session)
            await agent._connect(BENCH)
            job = Job(STACK, SGD)
            a = job.assignment(
                [0], 0, node_id=agent.node_id, stage_nodes=(agent.node_id,), checkpoint_every=1
            )
            for sha, body in job.hub.blobs.items():  # the job's model and chunks, cached already
                writer = agent.cache.writer(sha, len(body), resume=False)
                writer.write(body)
                writer.commit()

            with pytest.raises(AssignmentRejected, match="3 micro-batches do not divide") as info:
                await take_stage(agent, dataclasses.replace(a, micro_batches=3))
            assert "\n" not in str(info.value)

            assert await take_stage(agent, a) is False  # this hub runs no pipeline for it
            with pytest.raises(AssignmentRejected, match="already run"):
                await take_stage(agent, a)
            assert agent.status()["stage"] is None

            hub_stage = HubStage(
                agent._client(), agent.transfers, agent.cache, asyncio.get_running_loop()
            )
            body = b"unit state bytes"
            await asyncio.to_thread(hub_stage.keep, sha256_hex(body), body)
            got = await asyncio.to_thread(hub_stage.blob, sha256_hex(body), len(body))
            assert bytes(got) == body and hub_stage.fetched == 0
            report = StageReport("job-pp", 1, 0, 1, 0.1, 0.1, None, "", 0.0, new_nonce())
            with pytest.raises(PipelineError, match="stage report"):
                await asyncio.to_thread(hub_stage.report, report)
    finally:
        await hub.stop()
        agent.lock.release()
    events = [json.loads(line) for line in lines.getvalue().splitlines()]
    started = [e for e in events if e["event"] == "stage"]
    ended = [e for e in events if e["event"] == "stage_ended"]
    assert [e["detail"] for e in started] == ["stage 0 of 1 (units 0-3) of job job-pp, steps 0-9"]
    assert len(ended) == 1 and ended[0]["ended"] in ("failed", "over", "stale")
    assert ended[0]["steps_done"] <= 1 and ended[0]["fetched_bytes"] == 0
    assert sum(e["event"] == "rejected" for e in events) == 0  # take_stage raises; the loop says it
