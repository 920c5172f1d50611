"""The plan a job would get now (GET /v1/jobs/{id}/plan): its model cut into pipeline units
(protocol/pipeline.py), each unit's cost measured (protocol/modelanalysis.py), and the planner
(hub/policy/pipeline_plan.py) run over what the online nodes offer. Nothing is applied: the
answer shows its owner the stages, their nodes and the predicted step time, or the planner's
one-line refusal. The console's job page shows the same document (an auditor's review without the
model's size and the batch: ``plan_review``).

A node's offer and the model's cut are hub/domain/pipelines/offers.py's (the pipeline's planning
builds the same).

The analysis and the planner run in a worker thread, off the event loop. A job's analysis
depends only on its spec, so it is kept per job (``PLAN_CACHE``), with a refusal to cut.
"""

from __future__ import annotations

import asyncio
import math
import sqlite3
import time
from typing import Any, Final

from aiohttp import web
from gpuflex.protocol.jobspec import JobSpec

from ...base.errors import Conflict
from ...domain.pipelines.offers import (
    ASSUMED_LINK,
    LINK_ASSUMED,
    REFERENCE_MODEL,
    REFERENCE_SPEC,
    SPEED_DERIVATION,
    ModelCut,
    benchmark_flops,
    cut_model,
    node_offers,
    reference_flops_per_sample,
)
from ...domain.pipelines.planning import Lanes, choose_pipeline
from ...policy.pipeline_plan import NodeOffer, Pipeline, Plan, Refusal, plan_pipelines
from ...policy.stage_speed import StageSpeed
from ...storage.tokens import Principal
from ..appkeys import LEDGER, PLAN_CACHE, STORE
from .access import any_job_row, job_row, spec_of

# re-exported: the plan preview's names for the offers it shows
__all__ = [
    "ASSUMED_LINK",
    "REFERENCE_MODEL",
    "REFERENCE_SPEC",
    "job_plan",
    "plan_review",
    "reference_flops_per_sample",
]

#: the micro-batch counts the planner weighs (those up to the job's batch size)
MICRO_BATCHES: Final = (1, 2, 4, 8, 16, 32)
#: the most jobs whose analysis is kept
CACHE_JOBS: Final = 256


async def job_plan(app: web.Application, who: Principal, job_id: str) -> dict[str, Any]:
    """The plan document (docs/http-api.md). NotFound for a job ``who`` may not read, Conflict
    (409 not_pipelined) for a model that does not pipeline."""
    row = await app[STORE].query(lambda c: job_row(c, who, job_id))
    return await _plan_document(app, row)


#: what an auditor's review leaves out of the plan: the owner's model and batch
NOT_REVIEWED: Final = ("model", "batch_size")


async def plan_review(app: web.Application, who: Principal, job_id: str) -> dict[str, Any]:
    """What an auditor's review of any job shows of its plan (the console's job page; the API's
    plan route stays the owner's and admins'): ``job_plan``'s document without the model's size
    and the batch (``NOT_REVIEWED``): the stages, their nodes and times, the offers, or the
    planner's refusal."""
    who.require("auditor")
    row = await app[STORE].query(lambda c: any_job_row(c, job_id))
    doc = await _plan_document(app, row)
    for key in NOT_REVIEWED:
        doc.pop(key, None)
    return doc


async def _plan_document(app: web.Application, row: sqlite3.Row) -> dict[str, Any]:
    job_id = str(row["id"])
    spec = spec_of(row)
    if spec is None:
        raise Conflict(
            "the job's spec does not parse: there is no model to plan", code="not_pipelined"
        )
    cut = await _cached_cut(app, job_id, spec)
    flops = await asyncio.to_thread(reference_flops_per_sample)
    scheduler = app[LEDGER].scheduler
    per_sample = benchmark_flops(scheduler.nodes.values(), flops)
    offers, online, unsaid = node_offers(
        scheduler.nodes.values(), time.time(), scheduler.presence.online_window_s, per_sample
    )
    doc: dict[str, Any] = {
        "id": job_id,
        "state": row["state"],
        "batch_size": spec.train.batch_size,
        "model": {
            "units": len(cut.costs),
            "state_bytes": sum(c.state_bytes for c in cut.costs),
            "flops_per_sample": sum(c.flops for c in cut.costs),
        },
        "offers": _offers_doc(offers, online, unsaid, (flops, per_sample / flops), frozenset(
            o.node_id for o in offers if scheduler.nodes[o.node_id].rtt_s > 0),
            {o.node_id: scheduler.nodes[o.node_id].stage_speed for o in offers},
            frozenset(o.node_id for o in offers if scheduler.nodes[o.node_id].uplink_bytes_per_s > 0)),
    }
    if not offers and online:
        doc["refused"] = (
            f"none of the {online} online node{'s' if online != 1 else ''} says how much memory it"
            " offers a pipeline stage (a gpuflex-node too old to send its --max-memory)"
        )
        return doc
    result: Plan | Refusal | Pipeline | Lanes | str
    if spec.pipeline is not None:  # what the hub would run: the spec's stages, micro-batches, schedule
        result = await asyncio.to_thread(
            choose_pipeline, cut.costs, offers, spec.pipeline, batch_size=spec.train.batch_size
        )
        if isinstance(result, Pipeline):
            result = Plan((result,), spec.train.batch_size, result.step_s)
        elif isinstance(result, Lanes):  # pipelines sharing each step: each trains its share
            share = spec.train.batch_size // len(result.pipelines)
            result = Plan(result.pipelines, share, result.step_s)
    else:
        counts = tuple(m for m in MICRO_BATCHES if m <= spec.train.batch_size)
        result = await asyncio.to_thread(
            plan_pipelines, cut.costs, offers, batch_size=spec.train.batch_size, micro_batches=counts
        )
    if isinstance(result, str):
        doc["refused"] = result
    elif isinstance(result, Plan):
        memory = {o.node_id: o.memory_bytes for o in offers}
        doc["plan"] = _plan_doc(result, cut.names, memory)
    else:
        doc["refused"] = result.reason
    return doc


async def _cached_cut(app: web.Application, job_id: str, spec: JobSpec) -> ModelCut:
    cache: dict[str, ModelCut | str] = app[PLAN_CACHE]
    cut = cache.get(job_id)
    if cut is None:
        cut = await asyncio.to_thread(cut_model, spec)
        cache[job_id] = cut
        while len(cache) > CACHE_JOBS:
            del cache[next(iter(cache))]
    if isinstance(cut, str):
        raise Conflict(cut, code="not_pipelined")
    return cut


def _offers_doc(offers: list[NodeOffer], online: int, unsaid: int, flops: tuple[float, float],
                measured: frozenset[str], speeds: dict[str, StageSpeed],
                timed: frozenset[str]) -> dict[str, Any]:
    """``flops``: the reference model's FLOPs per sample and the benchmarks' scale; ``measured``:
    the nodes whose round trip the hub measured, ``timed``: those whose bodies it timed."""
    return {
        "online": online,
        "nodes": [
            {"node_id": o.node_id, "memory_bytes": o.memory_bytes, "flops_per_s": o.flops_per_s,
             "speed_from": "benchmark" if speeds[o.node_id].flops_per_s is None else "stage_reports",
             "speed_steps": speeds[o.node_id].steps,
             "update_bytes_per_s": o.update_bytes_per_s or None,
             "unit_overhead_s": o.unit_overhead_s or None,
             "rtt_s": o.rtt_s, "rtt_measured": o.node_id in measured,
             "bandwidth_bytes_per_s": o.bandwidth_bytes_per_s,
             "bandwidth_measured": o.node_id in timed}
            for o in offers
        ],
        "left_out": {
            "count": unsaid,
            "why": "said no memory offer (max_memory_bytes 0: a gpuflex-node too old to send its --max-memory)",
        },
        "speed": {
            "derived": SPEED_DERIVATION,
            "reference_model": REFERENCE_MODEL,
            "reference_flops_per_sample": flops[0],
            "benchmark_scale": flops[1],
        },
        # what a node without a measure of its own is taken to have; assumed while none has one
        "link": dict(ASSUMED_LINK) | {"assumed": not timed, "why": LINK_ASSUMED},
    }


def _plan_doc(plan: Plan, names: tuple[str, ...], offered: dict[str, int]) -> dict[str, Any]:
    return {
        "replicas": plan.replicas,
        "step_s": plan.step_s,
        "samples_per_s": plan.samples_per_s if math.isfinite(plan.samples_per_s) else None,
        "pipelines": [_pipeline_doc(p, names, offered) for p in plan.pipelines],
    }


def _pipeline_doc(p: Pipeline, names: tuple[str, ...], offered: dict[str, int]) -> dict[str, Any]:
    return {
        "micro_batches": p.micro_batches,
        "micro_batch_size": p.micro_batch_size,
        "schedule": p.schedule,
        "step_s": p.step_s,
        "bubble_fraction": p.bubble_fraction,
        "stages": [
            {
                "stage": s,
                "first_unit": st.first_unit,
                "end_unit": st.end_unit,
                "unit_names": list(names[st.first_unit : st.end_unit]),
                "node_id": st.node_id,
                "memory_bytes": st.memory_bytes,
                "offered_bytes": offered[st.node_id],
                "micro_batch_s": st.micro_batch_s,
                "compute_s": st.compute_s,
                "transfer_s": st.transfer_s,
                "update_s": st.update_s,
            }
            for s, st in enumerate(p.stages)
        ],
    }
