"""GET /v1/jobs/{id}/plan and `gpuflex-hub job plan`: the pipeline plan a job would get on the
nodes online now, from their --max-memory offers and benchmarks, on a real hub with signed
hellos: the stages cover every unit once, in order, and never exceed a node's offer; offers too
small get the planner's one-line refusal; a model that does not pipeline gets 409."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from gpuflex.hub.server.readmodel.plans import REFERENCE_MODEL, reference_flops_per_sample
from gpuflex.protocol.dataset import text_windows
from gpuflex.protocol.messages import Welcome
from gpuflex.protocol.signing import seal

from tests.helpers import RunningHub, SimNode, submit_job
from tests.tooling.text import stdlib_text

CONTEXT = 16
LM_SPEC = f"""[job]
name = "lm-plan"
[model]
kind = "transformer"
vocab = 256
context = {CONTEXT}
layers = 3
width = 32
heads = 4
[train]
optimizer = "adam"
batch_size = 16
"""
#: one Linear: nothing to cut
FLAT_SPEC = """[job]
name = "flat"
[model]
kind = "mlp"
input = 8
hidden = []
outputs = 3
"""
#: each node's benchmark samples/s on the reference model
SPEEDS = (4e5, 2e5, 1e5, 5e4)


async def _register(node: SimNode, memory: int) -> None:
    resp = await node.post(
        "/v1/nodes/register", seal(node.key, node.hello(max_memory_bytes=memory))
    )
    await node.open_response(resp, Welcome)


async def _plan(
    s: aiohttp.ClientSession, hub: RunningHub, job: str, token: str | None = None
) -> tuple[int, Any]:
    async with s.get(f"{hub.url}/v1/jobs/{job}/plan", headers=hub.auth(token)) as r:
        return r.status, await r.json()


async def _lm_job(s: aiohttp.ClientSession, hub: RunningHub, tmp_path: Path) -> str:
    data = text_windows(stdlib_text(4_000), CONTEXT, what="text")
    train = tmp_path / "train.npz"
    np.savez(train, x=data.x, y=data.y)
    r = await submit_job(s, hub, LM_SPEC, train)
    assert r.status == 201, await r.text()
    return str((await r.json())["id"])


def _cli(hub: RunningHub, job: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuflex.hub",
            "job",
            "plan",
            job,
            "--hub",
            hub.url,
            "--token",
            hub.owner_token,
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, COLUMNS="200"),
    )


async def test_the_plan_covers_every_unit_once_within_each_offer_and_the_cli_shows_it(
    running_hub: RunningHub, tmp_path: Path
) -> None:
    hub = running_hub
    async with aiohttp.ClientSession() as s:
        job = await _lm_job(s, hub, tmp_path)
        nodes = [SimNode(s, hub.url, samples_per_s=sps) for sps in SPEEDS]
        legacy = SimNode(s, hub.url)  # says no --max-memory: left out
        await legacy.register()
        for n in nodes:
            n.hub_public = legacy.hub_public
        await _register(nodes[0], 1)  # registered before the size is known: updated below
        status, doc = await _plan(s, hub, job)
        assert status == 200 and doc["model"]["units"] == 5, doc  # embed, 3 blocks, head
        state = doc["model"]["state_bytes"]
        # every offer below the model's state alone: it takes a pipeline of several stages
        offers = {
            n.node_id: int(state * f) for n, f in zip(nodes, (0.9, 0.75, 0.6, 0.5), strict=True)
        }
        for n in nodes:
            await _register(n, offers[n.node_id])
        status, doc = await _plan(s, hub, job)
        assert status == 200 and "refused" not in doc, doc
        plan = doc["plan"]
        assert plan["replicas"] == len(plan["pipelines"]) >= 1 and plan["step_s"] > 0
        used: set[str] = set()
        for p in plan["pipelines"]:
            stages = p["stages"]
            assert (
                len(stages) >= 2
                and 0 <= p["bubble_fraction"] < 1
                and p["schedule"] in ("gpipe", "1f1b")
            )
            assert [st["first_unit"] for st in stages] == [
                0,
                *(st["end_unit"] for st in stages[:-1]),
            ]
            assert stages[-1]["end_unit"] == 5
            names = [name for st in stages for name in st["unit_names"]]
            assert names == ["embed", "block_0", "block_1", "block_2", "head"]
            for st in stages:
                assert st["offered_bytes"] == offers[st["node_id"]]
                assert 0 < st["memory_bytes"] <= st["offered_bytes"]
                assert st["node_id"] not in used
                used.add(st["node_id"])
        # speed: the benchmark's samples/s times the reference model's measured FLOPs per sample
        flops = reference_flops_per_sample()
        assert doc["offers"]["speed"]["reference_model"] == REFERENCE_MODEL
        assert doc["offers"]["speed"]["reference_flops_per_sample"] == pytest.approx(flops)
        by_id = {o["node_id"]: o for o in doc["offers"]["nodes"]}
        assert by_id.keys() == offers.keys() and doc["offers"]["online"] == 5
        for n in nodes:
            assert by_id[n.node_id]["flops_per_s"] == pytest.approx(n.samples_per_s * flops)
        assert doc["offers"]["left_out"]["count"] == 1 and doc["offers"]["link"]["assumed"] is True

        shown = await asyncio.to_thread(_cli, hub, job)
        assert shown.returncode == 0, shown.stderr
        out = shown.stdout
        assert "memory used / offered" in out and "bubble" in out and "refused" not in out, out
        for p in plan["pipelines"]:
            for st in p["stages"]:
                row = next(line for line in out.splitlines() if st["node_id"] in line)
                assert st["unit_names"][0] in row and "/" in row, row

        # offers too small for one block: the planner's one line, in the API and the CLI
        for n in nodes:
            await _register(n, 20_000)
        status, doc = await _plan(s, hub, job)
        assert status == 200 and "plan" not in doc, doc
        assert "\n" not in doc["refused"] and "alone needs" in doc["refused"], doc["refused"]
        shown = await asyncio.to_thread(_cli, hub, job)
        assert shown.returncode == 0 and f"refused: {doc['refused']}" in shown.stdout, shown
        as_json = await asyncio.to_thread(_cli, hub, job, "--json")
        assert json.loads(as_json.stdout)["refused"] == doc["refused"]


async def test_a_model_that_does_not_pipeline_gets_409_and_others_cannot_read_a_plan(
    running_hub: RunningHub, tmp_path: Path
) -> None:
    hub = running_hub
    rng = np.random.default_rng(0)
    train = tmp_path / "flat.npz"
    np.savez(train, x=rng.normal(size=(64, 8)).astype(np.float32), y=rng.integers(0, 3, 64))
    async with aiohttp.ClientSession() as s:
        r = await submit_job(s, hub, FLAT_SPEC, train)
        assert r.status == 201, await r.text()
        flat = (await r.json())["id"]
        status, doc = await _plan(s, hub, flat)
        assert status == 409 and doc["error"] == "not_pipelined", doc
        assert "one pipeline unit" in doc["detail"] and "\n" not in doc["detail"]
        lm = await _lm_job(s, hub, tmp_path)
        assert (await _plan(s, hub, lm))[1]["refused"] == "no node is online to run the pipeline"
        await SimNode(s, hub.url).register()  # a node too old to say what memory it offers
        status, doc = await _plan(s, hub, lm)
        assert status == 200 and doc["offers"]["left_out"]["count"] == 1, doc
        assert doc["refused"].startswith("none of the 1 online node says how much memory"), doc
        assert (await _plan(s, hub, lm, hub.admin_token))[0] == 200
        bob = hub.token("owner", "bob")
        assert await _plan(s, hub, lm, bob) == (
            404,
            {"error": "unknown_job", "detail": f"no job {lm} visible to you"},
        )
        status, doc = await _plan(s, hub, lm, hub.auditor_token)
        assert status == 403 and doc["error"] == "wrong_role"
        assert (await _plan(s, hub, "j-nonesuch"))[0] == 404
        shown = await asyncio.to_thread(_cli, hub, flat)
        assert shown.returncode == 1 and "409 not_pipelined" in shown.stderr, shown
        assert len(shown.stderr.strip().splitlines()) == 1


def test_speed_is_derived_from_the_benchmarks_own_reference_model() -> None:
    from gpuflex.hub.server.readmodel.plans import REFERENCE_SPEC
    from gpuflex.node.benchmark import REFERENCE_MODEL as BENCHMARKED

    assert BENCHMARKED == f"{REFERENCE_MODEL}/b32"
    dims = [REFERENCE_SPEC["input"], *REFERENCE_SPEC["hidden"], REFERENCE_SPEC["outputs"]]
    assert REFERENCE_MODEL == "mlp-" + "-".join(str(d) for d in dims)
    # forward: both Linears; backward: both weights' gradients and the hidden layer's input
    # gradient (the model's input needs none)
    forward = 2 * (64 * 128 + 128 * 10)
    assert reference_flops_per_sample() == forward + 2 * 64 * 128 + 2 * 2 * 128 * 10


async def test_a_pipelined_jobs_plan_is_the_one_the_hub_would_run_under_its_spec(
    running_hub: RunningHub, tmp_path: Path
) -> None:
    """`[pipeline] stages`, `micro_batches` and `schedule` bind the preview as they bind the hub's
    own planning: the plan shown is the plan a generation would get."""
    hub = running_hub
    async with aiohttp.ClientSession() as s:
        data = text_windows(stdlib_text(4_000), CONTEXT, what="text")
        train = tmp_path / "train.npz"
        np.savez(train, x=data.x, y=data.y)
        spec = LM_SPEC + '[pipeline]\nstages = 4\nmicro_batches = 2\nschedule = "gpipe"\nsteps = 10\n'
        r = await submit_job(s, hub, spec, train)
        assert r.status == 201, await r.text()
        job = str((await r.json())["id"])
        legacy = SimNode(s, hub.url)
        await legacy.register()
        nodes = [SimNode(s, hub.url, samples_per_s=sps) for sps in SPEEDS]
        for n in nodes:
            n.hub_public = legacy.hub_public
            await _register(n, 1 << 30)  # room for the whole model on each: the spec asks for 4
        status, doc = await _plan(s, hub, job)
        assert status == 200 and "refused" not in doc, doc
        (p,) = doc["plan"]["pipelines"]
        assert (len(p["stages"]), p["micro_batches"], p["schedule"]) == (4, 2, "gpipe"), p
        await _register(nodes[3], 0)  # three nodes offer memory: 4 stages cannot be planned
        status, doc = await _plan(s, hub, job)
        assert status == 200 and "plan" not in doc and "4" in doc["refused"], doc
