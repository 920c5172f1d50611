"""The plan a job would get now (GET /v1/jobs/{id}/plan): its model cut into pipeline units
(protocol/pipeline.py), each unit's cost measured (protocol/modelanalysis.py), and the planner
(hub/policy/pipeline_plan.py) run over what the online nodes offer. Nothing is applied: the
answer shows its owner the stages, their nodes and the predicted step time, or the planner's
one-line refusal.

A node's offer is built from what the hub already keeps of it:

- memory: its ``--max-memory`` (``NodeState.max_memory_bytes``). A node that said 0 (an older
  node, which does not say) is left out, and the answer counts it.
- speed: its benchmark's training samples/s on the reference model (``NodeState.bench_sps``, what
  ``gpuflex-node bench`` measures on ``REFERENCE_MODEL``) times that model's forward and backward
  FLOPs per sample, measured by the same analysis as the job's units.
- link: its round trip is what the hub measured on its connection (``NodeState.rtt_s``, the
  kernel's TCP round trip, hub/server/linkmeter.py), else ``ASSUMED_LINK``'s; its bandwidth is
  not measured yet, so every node gets ``ASSUMED_LINK``'s (a home line). The answer says which.

The analysis and the planner run in a worker thread, off the event loop. A job's analysis
depends only on its spec, so it is kept per job (``PLAN_CACHE``), with a refusal to cut.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web
from gpuflex.protocol.errors import SpecError
from gpuflex.protocol.jobspec import JobSpec
from gpuflex.protocol.modelanalysis import UnitCost, analyse_units
from gpuflex.protocol.modelspec import ModelSpec
from gpuflex.protocol.pipeline import pipeline_units

from ...base.errors import Conflict
from ...model.node import NodeState
from ...policy.pipeline_plan import NodeOffer, Pipeline, Plan, plan_pipelines
from ...storage.tokens import Principal
from ..appkeys import LEDGER, PLAN_CACHE, STORE
from .access import job_row, spec_of

#: the model every node's benchmark trains (node/benchmark.py's REFERENCE_MODEL, batch 32)
REFERENCE_MODEL: Final = "mlp-64-128-10"
REFERENCE_SPEC: Final = {"kind": "mlp", "input": 64, "hidden": [128], "outputs": 10}
#: the link every node is assumed to have: a home line of 20 Mbit/s with a 30 ms round trip
ASSUMED_LINK: Final = {"bandwidth_bytes_per_s": 2.5e6, "rtt_s": 0.03}
#: the micro-batch counts the planner weighs (those up to the job's batch size)
MICRO_BATCHES: Final = (1, 2, 4, 8, 16, 32)
#: the most jobs whose analysis is kept
CACHE_JOBS: Final = 256

SPEED_DERIVATION: Final = (
    f"each node's benchmark samples/s on the reference model {REFERENCE_MODEL} (batch 32) times that"
    " model's forward + backward FLOPs per sample, measured by the same analysis as the job's units"
)
LINK_ASSUMED: Final = ("the hub measures no node's bandwidth yet: every node is assumed to have this one; a node's"
                       " round trip is the kernel's TCP measure of its connection where the hub has one"
                       " (nodes[].rtt_measured), else this one")


@dataclass(frozen=True)
class ModelCut:
    """A job's model as the planner reads it: its units' names and measured costs."""

    names: tuple[str, ...]
    costs: tuple[UnitCost, ...]


def cut_model(spec: JobSpec) -> ModelCut | str:
    """The job's units and their costs, or one line saying why its model does not pipeline.
    Blocking (torch, on the meta device): called in a worker thread."""
    try:
        units = pipeline_units(spec.model)
        if len(units) < 2:
            return (
                f"the model is one pipeline unit ({units[0].name}): there is nothing to cut into"
                " stages, so it trains data-parallel (each node holds the whole model)"
            )
        costs = analyse_units(
            [u.module for u in units.units],
            spec.model.input_shape,
            spec.model.input_dtype,
            optimizer=spec.train.optimizer,
            momentum=spec.train.momentum,
        )
    except SpecError as exc:
        return f"the model cannot be cut into pipeline stages: {exc}"
    return ModelCut(tuple(u.name for u in units.units), costs)


@functools.cache
def reference_flops_per_sample() -> float:
    """Forward + backward FLOPs of one sample of the benchmark's reference model, as training
    runs it (the first unit computes no gradient for its input)."""
    import torch

    spec = ModelSpec.from_dict(REFERENCE_SPEC)
    units = pipeline_units(spec)
    costs = analyse_units([u.module for u in units.units], spec.input_shape, torch.float32)
    return float(sum(c.flops for c in costs))


def node_offers(
    nodes: Iterable[NodeState], now: float, online_window_s: float, flops_per_sample: float
) -> tuple[list[NodeOffer], int, int]:
    """The online nodes' offers (by node id), how many nodes are online, and how many of them
    were left out for offering no memory."""
    online = sorted(
        (n for n in nodes if not n.banned and now - n.last_seen <= online_window_s),
        key=lambda n: n.id,
    )
    offers = [
        NodeOffer(
            node_id=n.id,
            memory_bytes=n.max_memory_bytes,
            flops_per_s=n.bench_sps * flops_per_sample,
            bandwidth_bytes_per_s=ASSUMED_LINK["bandwidth_bytes_per_s"],
            rtt_s=n.rtt_s if n.rtt_s > 0 else ASSUMED_LINK["rtt_s"],
        )
        for n in online
        if n.max_memory_bytes > 0
    ]
    return offers, len(online), len(online) - len(offers)


async def job_plan(app: web.Application, who: Principal, job_id: str) -> dict[str, Any]:
    """The plan document (docs/http-api.md). NotFound for a job ``who`` may not read, Conflict
    (409 not_pipelined) for a model that does not pipeline."""
    row = await app[STORE].query(lambda c: job_row(c, who, job_id))
    spec = spec_of(row)
    if spec is None:
        raise Conflict(
            "the job's spec does not parse: there is no model to plan", code="not_pipelined"
        )
    cut = await _cached_cut(app, job_id, spec)
    flops = await asyncio.to_thread(reference_flops_per_sample)
    scheduler = app[LEDGER].scheduler
    offers, online, unsaid = node_offers(
        scheduler.nodes.values(), time.time(), scheduler.presence.online_window_s, flops
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
        "offers": _offers_doc(offers, online, unsaid, flops, frozenset(
            o.node_id for o in offers if scheduler.nodes[o.node_id].rtt_s > 0)),
    }
    if not offers and online:
        doc["refused"] = (
            f"none of the {online} online node{'s' if online != 1 else ''} says how much memory it"
            " offers a pipeline stage (a gpuflex-node too old to send its --max-memory)"
        )
        return doc
    counts = tuple(m for m in MICRO_BATCHES if m <= spec.train.batch_size)
    result = await asyncio.to_thread(
        plan_pipelines, cut.costs, offers, batch_size=spec.train.batch_size, micro_batches=counts
    )
    if isinstance(result, Plan):
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


def _offers_doc(offers: list[NodeOffer], online: int, unsaid: int, flops: float,
                measured: frozenset[str]) -> dict[str, Any]:
    return {
        "online": online,
        "nodes": [
            {"node_id": o.node_id, "memory_bytes": o.memory_bytes, "flops_per_s": o.flops_per_s,
             "rtt_s": o.rtt_s, "rtt_measured": o.node_id in measured}
            for o in offers
        ],
        "left_out": {
            "count": unsaid,
            "why": "said no memory offer (max_memory_bytes 0: a gpuflex-node too old to send its --max-memory)",
        },
        "speed": {
            "derived": SPEED_DERIVATION,
            "reference_model": REFERENCE_MODEL,
            "reference_flops_per_sample": flops,
        },
        "link": dict(ASSUMED_LINK) | {"assumed": True, "why": LINK_ASSUMED},
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
                "compute_s": st.compute_s,
                "transfer_s": st.transfer_s,
                "update_s": st.update_s,
            }
            for s, st in enumerate(p.stages)
        ],
    }
