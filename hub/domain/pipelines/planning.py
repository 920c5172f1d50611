"""Which stages a generation runs, on which nodes: the job's ``[pipeline]`` spec applied to the
planner (hub/policy/pipeline_plan.py).

Pure: measured unit costs and the idle nodes' offers in, a `Pipeline` or a one-line refusal out.

- micro-batch counts: the spec's fixed ``micro_batches``, else those of 1, 2, 4, ... 32 that
  divide ``[train] batch_size`` (every micro-batch has the same shape, which the relay checks);
- schedules: the spec's, or both under "auto";
- pipelines (hybrid data + pipeline parallelism): up to ``[pipeline] pipelines`` of them (0: as
  many as the idle nodes make, 1: one) may share each step. Each runs the same cut, schedule and
  micro-batch count on nodes of its own over its share of the step's micro-batches (``Lanes``),
  and its stages send every other pipeline's same stage their gradients before the optimizer
  steps; the predicted step is the slowest pipeline's plus that exchange through the relay
  (each stage sends and receives its units' parameter bytes once per other pipeline). Several
  pipelines are chosen only when that step is predicted shorter than one pipeline's, and never
  on a re-plan that keeps a previous generation's survivors (they keep their units first);
- stages: the spec's fixed count, or the planner's choice, at least 2 (a pipelined job runs on
  several nodes; its model pipelines into at least 2 units);
- a re-plan prefers keeping each surviving node on the units it held (the fewest bytes of unit
  state moved), then the fastest predicted step.

When the planner's own choice does not fit those rules (a fixed stage count it did not pick, a
re-plan), candidates are evaluated with the planner's cost model (``evaluate_pipeline``): every
contiguous cut (up to ``MAX_CUTS``) on the previous generation's survivors, in their order, with
new nodes in the lost places, and on the nodes offering the most memory.

A node that joins while a generation runs (``faster_with``) is worth a re-plan only when some
candidate is at least ``gain`` faster than the live generation's predicted step (or the live one
has fewer stages than the spec asks); among those, the one moving the fewest bytes of unit state
wins: the live generation's nodes in their order with a joining node in one stage's place, or
(without a fixed stage count) inserted between two stages, over every contiguous cut.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from gpuflex.protocol.jobspec import PipelineSpec
from gpuflex.protocol.modelanalysis import UnitCost

from ...model.pipeline import Generation
from ...policy.pipeline_plan import (
    DEFAULT_MICRO_BATCHES,
    SCHEDULES,
    NodeOffer,
    Pipeline,
    Plan,
    evaluate_pipeline,
    plan_pipelines,
)

#: the most contiguous cuts of the model one candidate node order is tried with
MAX_CUTS: Final = 4096


@dataclass(frozen=True)
class Lanes:
    """Several pipelines sharing each step: the same cut, micro-batch count and schedule, each on
    nodes of its own; ``step_s``: the slowest one's step and the exchange of their gradients."""

    pipelines: tuple[Pipeline, ...]
    step_s: float


def micro_batch_counts(spec: PipelineSpec, batch_size: int) -> tuple[int, ...]:
    if spec.micro_batches:
        return (spec.micro_batches,)
    return tuple(m for m in DEFAULT_MICRO_BATCHES if m <= batch_size and batch_size % m == 0)


def schedules(spec: PipelineSpec) -> tuple[str, ...]:
    return SCHEDULES if spec.schedule == "auto" else (spec.schedule,)


def check_pipeline_spec(spec: PipelineSpec, units: int, batch_size: int) -> str | None:
    """Why a job's ``[pipeline]`` cannot run on its model (one line), or None."""
    if units < 2:
        return (
            "the model is one pipeline unit: there is nothing to cut into stages; remove [pipeline]"
        )
    if spec.stages > units:
        return f"pipeline.stages = {spec.stages}, but the model has {units} pipeline units"
    if spec.micro_batches and batch_size % spec.micro_batches:
        return (
            f"pipeline.micro_batches = {spec.micro_batches} does not divide train.batch_size ="
            f" {batch_size}: every micro-batch must hold the same number of samples"
        )
    return None


def choose_pipeline(
    costs: Sequence[UnitCost],
    offers: Sequence[NodeOffer],
    spec: PipelineSpec,
    *,
    batch_size: int,
    previous: Generation | None = None,
) -> Pipeline | Lanes | str:
    """The generation's pipeline (or pipelines sharing each step) on ``offers`` (idle nodes), or
    why none fits (one line). ``previous``: the generation before (its surviving nodes keep their
    units where they can)."""
    first = lane_zero(previous)
    one = _choose_one(costs, offers, spec, batch_size=batch_size, previous=first)
    if spec.pipelines == 1:
        return one
    lanes = _choose_lanes(costs, offers, spec, batch_size, previous=first)
    if lanes is None:
        return one
    asked = spec.pipelines > 1  # the owner's count, or the most of it the nodes make
    if asked or isinstance(one, str) or lanes.step_s < one.step_s:
        return lanes
    return one


def lane_zero(g: Generation | None) -> Generation | None:
    """``g``'s first pipeline as a generation of its own (the one a re-plan keeps the units of,
    where it can: every pipeline holds the same state)."""
    if g is None or g.lanes == 1:
        return g
    return dataclasses.replace(g, stages=g.stages[: g.per_lane], lanes=1)


def _choose_lanes(
    costs: Sequence[UnitCost],
    offers: Sequence[NodeOffer],
    spec: PipelineSpec,
    batch_size: int,
    *,
    previous: Generation | None = None,
) -> Lanes | None:
    """The plan of 2 or more pipelines sharing each step (at most ``spec.pipelines``): with a
    count asked for, the most pipelines up to it that fit, else the fastest; None when none
    fits."""
    best: Lanes | None = None
    most = len(offers) // max(spec.stages, 2)
    for count in range(2, min(most, spec.pipelines or most) + 1):
        if batch_size % count or (spec.micro_batches and spec.micro_batches % count):
            continue
        lane_spec = dataclasses.replace(
            spec, micro_batches=spec.micro_batches // count, pipelines=1
        )
        first = _choose_one(
            costs, offers, lane_spec, batch_size=batch_size // count, previous=previous
        )
        if isinstance(first, str):
            continue
        lanes = [first]
        left = [o for o in offers if o.node_id not in {s.node_id for s in first.stages}]
        while len(lanes) < count:
            more = _same_cut(costs, left, first, batch_size // count)
            if more is None:
                break
            lanes.append(more)
            left = [o for o in left if o.node_id not in {s.node_id for s in more.stages}]
        if len(lanes) < count:
            continue
        lanes = balance(costs, offers, lanes)
        step = max(p.step_s for p in lanes) + exchange_s(costs, first, lanes, offers)
        if best is None or spec.pipelines > 1 or step < best.step_s:
            best = Lanes(tuple(lanes), step)
    return best


def balance(
    costs: Sequence[UnitCost], offers: Sequence[NodeOffer], lanes: Sequence[Pipeline]
) -> list[Pipeline]:
    """``lanes`` with the step's micro-batches (their sum, all of one size) shared out so the
    slowest pipeline finishes first: each at least one, each next one to the pipeline whose step
    it lengthens least (a faster pipeline runs more). The even split when it is as fast."""
    by_id = {o.node_id: o for o in offers}
    size = lanes[0].micro_batch_size
    total = sum(p.micro_batches for p in lanes)

    def run(lane: Pipeline, count: int) -> Pipeline | None:
        return evaluate_pipeline(
            costs,
            [by_id[s.node_id] for s in lane.stages],
            [s.end_unit for s in lane.stages],
            micro_batches=count,
            schedule=lane.schedule,
            batch_size=count * size,
        )

    shared = [run(lane, 1) for lane in lanes]
    counts = [1] * len(lanes)
    for _ in range(total - len(lanes)):
        grown = [run(lane, k + 1) for lane, k in zip(lanes, counts, strict=True)]
        steps = [math.inf if p is None else p.step_s for p in grown]
        best = min(range(len(lanes)), key=lambda i: (steps[i], i))
        if steps[best] == math.inf:
            return list(lanes)
        counts[best] += 1
        shared[best] = grown[best]
    if any(p is None for p in shared):
        return list(lanes)
    balanced = [p for p in shared if p is not None]
    if max(p.step_s for p in balanced) < max(p.step_s for p in lanes):
        return balanced
    return list(lanes)


def _same_cut(
    costs: Sequence[UnitCost], offers: Sequence[NodeOffer], like: Pipeline, batch_size: int
) -> Pipeline | None:
    """A pipeline cut as ``like`` on some of ``offers``: the stage needing the most memory on
    the roomiest node, and so on (the fastest first among equals); None when it does not fit."""
    if len(offers) < len(like.stages):
        return None
    roomiest = sorted(offers, key=lambda o: (-o.memory_bytes, -o.flops_per_s, o.node_id))
    needs = sorted(range(len(like.stages)), key=lambda s: -like.stages[s].memory_bytes)
    nodes: list[NodeOffer | None] = [None] * len(like.stages)
    for stage, node in zip(needs, roomiest, strict=False):
        nodes[stage] = node
    chosen = [n for n in nodes if n is not None]
    return evaluate_pipeline(
        costs,
        chosen,
        [s.end_unit for s in like.stages],
        micro_batches=like.micro_batches,
        schedule=like.schedule,
        batch_size=batch_size,
    )


def exchange_s(
    costs: Sequence[UnitCost],
    like: Pipeline,
    lanes: Sequence[Pipeline],
    offers: Sequence[NodeOffer],
) -> float:
    """The predicted time the pipelines' stages take to swap their gradients through the relay:
    the slowest stage's, each sending and receiving its units' parameter bytes once per other
    pipeline over its node's link, plus a round trip."""
    by_id = {o.node_id: o for o in offers}
    worst = 0.0
    for s, stage in enumerate(like.stages):
        size = sum(costs[u].param_bytes for u in range(stage.first_unit, stage.end_unit))
        for pipeline in lanes:
            node = by_id[pipeline.stages[s].node_id]
            moved = 2 * (len(lanes) - 1) * size
            worst = max(worst, moved / node.bandwidth_bytes_per_s + node.rtt_s)
    return worst


def _choose_one(
    costs: Sequence[UnitCost],
    offers: Sequence[NodeOffer],
    spec: PipelineSpec,
    *,
    batch_size: int,
    previous: Generation | None = None,
) -> Pipeline | str:
    """One pipeline on ``offers``, or why none fits (one line)."""
    counts = micro_batch_counts(spec, batch_size)
    scheds = schedules(spec)
    least = spec.stages or 2
    if len(offers) < least:
        return (
            f"the pipeline needs {least} nodes with a memory offer; {len(offers)} idle"
            f" node{'s are' if len(offers) != 1 else ' is'} online"
        )
    planned = plan_pipelines(
        costs, offers, batch_size=batch_size, micro_batches=counts, schedules=scheds, max_replicas=1
    )
    fitting = (
        planned.pipelines[0]
        if isinstance(planned, Plan) and _stage_count_fits(len(planned.pipelines[0].stages), spec)
        else None
    )
    survivors = _survivors(previous, offers)
    if fitting is not None and not survivors:
        return fitting
    best = _best_candidate(costs, offers, spec, counts, scheds, batch_size, previous, fitting)
    if best is not None:
        return best
    if isinstance(planned, Plan):
        return f"no plan of {least} stages fits the idle nodes' memory"
    return planned.reason


def _stage_count_fits(stages: int, spec: PipelineSpec) -> bool:
    return stages == spec.stages if spec.stages else stages >= 2


def _survivors(previous: Generation | None, offers: Sequence[NodeOffer]) -> list[str]:
    idle = {o.node_id for o in offers}
    return [] if previous is None else [s.node_id for s in previous.stages if s.node_id in idle]


def bytes_moved(pipeline: Pipeline, costs: Sequence[UnitCost], previous: Generation | None) -> int:
    """The unit state that changes node from ``previous`` to ``pipeline`` (0 with no previous)."""
    if previous is None:
        return 0
    moved = 0
    for stage in pipeline.stages:
        for unit in range(stage.first_unit, stage.end_unit):
            if previous.holder(unit) != stage.node_id:
                moved += costs[unit].state_bytes
    return moved


def _best_candidate(
    costs: Sequence[UnitCost],
    offers: Sequence[NodeOffer],
    spec: PipelineSpec,
    counts: tuple[int, ...],
    scheds: tuple[str, ...],
    batch_size: int,
    previous: Generation | None,
    planned: Pipeline | None,
) -> Pipeline | None:
    """The candidate moving the fewest bytes of unit state, then the fastest."""
    found = [planned] if planned is not None else []
    for nodes in _node_orders(offers, spec, previous):
        for ends in _cuts(len(costs), len(nodes)):
            for m, schedule in itertools.product(counts, scheds):
                p = evaluate_pipeline(
                    costs, nodes, ends, micro_batches=m, schedule=schedule, batch_size=batch_size
                )
                if p is not None:
                    found.append(p)
    if not found:
        return None
    return min(found, key=lambda p: (bytes_moved(p, costs, previous), p.step_s))


def _node_orders(
    offers: Sequence[NodeOffer], spec: PipelineSpec, previous: Generation | None
) -> list[list[NodeOffer]]:
    """Node sequences to try: the previous generation's survivors in their order with new nodes
    (the roomiest first) in the lost places, and the roomiest nodes in id order."""
    by_id = {o.node_id: o for o in offers}
    roomiest = sorted(offers, key=lambda o: (-o.memory_bytes, -o.flops_per_s, o.node_id))
    stages = spec.stages or 2
    orders: list[list[NodeOffer]] = []
    if previous is not None:
        fresh = [o for o in roomiest if o.node_id not in {s.node_id for s in previous.stages}]
        kept: list[NodeOffer] = []
        for slot in previous.stages:
            if slot.node_id in by_id:
                kept.append(by_id[slot.node_id])
            elif fresh:
                kept.append(fresh.pop(0))
        if not spec.stages or len(kept) == spec.stages:
            if len(kept) >= 2:
                orders.append(kept)
    top = sorted(roomiest[:stages], key=lambda o: o.node_id)
    if len(top) == stages:
        orders.append(top)
    return orders


def faster_with(
    costs: Sequence[UnitCost],
    offers: Sequence[NodeOffer],
    spec: PipelineSpec,
    *,
    batch_size: int,
    live: Generation,
    joining: Sequence[str],
    gain: float,
) -> Pipeline | Lanes | None:
    """The pipeline (or pipelines sharing the steps) a re-plan with the ``joining`` nodes would
    run (``offers``: the live generation's nodes and the idle ones), or None when none is worth
    ending ``live`` for. More pipelines than the live generation's are worth it when the spec
    asks for them (``pipelines`` above the live count) or when they are ``gain`` faster."""
    more = None
    if spec.pipelines != 1:
        lanes = _choose_lanes(costs, offers, spec, batch_size, previous=lane_zero(live))
        if lanes is not None and len(lanes.pipelines) > live.lanes:
            asked = spec.pipelines > 1
            if asked or lanes.step_s <= live.step_s * (1.0 - gain):
                more = lanes
    if more is not None or live.lanes > 1:
        return more
    counts = micro_batch_counts(spec, batch_size)
    scheds = schedules(spec)
    short = bool(spec.stages) and len(live.stages) < spec.stages
    by_id = {o.node_id: o for o in offers}
    if any(s.node_id not in by_id for s in live.stages):
        return None
    kept = [by_id[s.node_id] for s in live.stages]
    orders = [_roomiest(offers, spec)]
    for new in (by_id[n] for n in joining if n in by_id):
        orders += [[*kept[:i], new, *kept[i + 1 :]] for i in range(len(kept))]
        if not spec.stages or short:
            orders += [[*kept[:i], new, *kept[i:]] for i in range(len(kept) + 1)]
    found = []
    for nodes in orders:
        if len(nodes) < 2 or (spec.stages and len(nodes) != spec.stages):
            continue
        for ends in _cuts(len(costs), len(nodes)):
            for m, schedule in itertools.product(counts, scheds):
                p = evaluate_pipeline(
                    costs, nodes, ends, micro_batches=m, schedule=schedule, batch_size=batch_size
                )
                if p is not None and (short or p.step_s <= live.step_s * (1.0 - gain)):
                    found.append(p)
    if not found:
        return None
    return min(found, key=lambda p: (bytes_moved(p, costs, live), p.step_s))


def _roomiest(offers: Sequence[NodeOffer], spec: PipelineSpec) -> list[NodeOffer]:
    roomiest = sorted(offers, key=lambda o: (-o.memory_bytes, -o.flops_per_s, o.node_id))
    return sorted(roomiest[: spec.stages or 2], key=lambda o: o.node_id)


def _cuts(units: int, stages: int) -> list[tuple[int, ...]]:
    """Contiguous cuts of ``units`` into ``stages`` (each stage's end), at most ``MAX_CUTS``,
    the most even first."""
    if stages > units:
        return []
    if math.comb(units - 1, stages - 1) > MAX_CUTS:
        even = tuple(round(units * (s + 1) / stages) for s in range(stages))
        return [even]
    return [(*inner, units) for inner in itertools.combinations(range(1, units), stages - 1)]


__all__ = [
    "Lanes",
    "bytes_moved",
    "check_pipeline_spec",
    "choose_pipeline",
    "exchange_s",
    "faster_with",
    "micro_batch_counts",
    "schedules",
]
