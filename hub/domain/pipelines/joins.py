"""A node that joins while a pipelined job runs: when it is worth a re-plan, and when to do it.

The live generation keeps running while the idle nodes change. Each time they do, the planner
(``planning.faster_with``) looks for a pipeline with the joining nodes whose predicted step is
at least ``HubConfig.replan_gain`` faster than the live one's (or that has the stages the spec
asks, when the live one has fewer), moving the fewest bytes of unit state. The hub acts on it
right after a step commits: the live generation ends and the next one resumes from that step,
so the steps a stage ran past it (the part of one checkpoint interval that had started) are
rolled back and redone, like after a lost stage. While no stage has reported a step past the
committed step (the generation just started, or its stages are between checkpointing a step and
reporting it) the re-plan goes ahead at once: there is nothing to redo. A re-plan never waits on
the stages: they stop on the stale answers their next call gets, so no step is applied twice.

Pure bookkeeping over the coordinator's state; the planner runs off the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ...model.job import JobState
from ...model.node import NodeState
from ...model.pipeline import Generation, PipelineState
from ...policy.pipeline_plan import NodeOffer, Pipeline
from .offers import ModelCut, benchmark_flops, offer_of, reference_flops_per_sample
from .planning import Lanes, faster_with


@dataclass(frozen=True)
class JoinPlan:
    """The pipeline a join re-plan would run, why, and the committed step when it was found."""

    pipeline: Pipeline | Lanes
    joining: frozenset[str]
    reason: str
    committed: int


class JoinWatch:
    """Per running job, the join re-plan worth making (if any) over the idle nodes last seen."""

    def __init__(self, *, gain: float) -> None:
        self.gain = gain
        self._seen: dict[str, tuple[int, tuple[str, ...]]] = {}
        self._found: dict[str, JoinPlan] = {}

    def waiting(self, job_id: str) -> bool:
        """Does a join re-plan wait for the job's next committed step?"""
        return job_id in self._found

    def forget(self, job_id: str) -> None:
        self._seen.pop(job_id, None)
        self._found.pop(job_id, None)

    async def due(
        self,
        job: JobState,
        state: PipelineState,
        g: Generation,
        cut: ModelCut | None,
        idle_offers: Callable[[float, float], list[NodeOffer]],
        nodes: Mapping[str, NodeState],
        now: float,
    ) -> JoinPlan | None:
        """The join re-plan to make now, or None (none helps, or it waits for a commit).
        ``idle_offers(flops_per_sample, now)``: the idle nodes' offers."""
        spec = job.spec.pipeline
        if spec is None or cut is None:
            return None
        flops = benchmark_flops(nodes.values(), await asyncio.to_thread(reference_flops_per_sample))
        idle = idle_offers(flops, now)
        key = (g.number, tuple(o.node_id for o in idle))
        if self._seen.get(job.id) != key:
            self._seen[job.id] = key
            self._found.pop(job.id, None)
            if idle:
                live = [offer_of(nodes[s.node_id], flops) for s in g.stages if s.node_id in nodes]
                found = await asyncio.to_thread(
                    faster_with,
                    cut.costs,
                    [*live, *idle],
                    spec,
                    batch_size=job.spec.train.batch_size,
                    live=g,
                    joining=[o.node_id for o in idle],
                    gain=self.gain,
                )
                if found is not None and _joining(found, g):
                    self._found[job.id] = JoinPlan(
                        found, _joining(found, g), _reason(found, g), state.committed_step
                    )
        return self._now(state, g)

    def _now(self, state: PipelineState, g: Generation) -> JoinPlan | None:
        """The plan found, once a step committed after it was found or no stage ran past the
        committed step."""
        plan = self._found.get(state.job_id)
        if plan is None:
            return None
        ran = max((r.steps_done for r in state.reports.values()), default=g.first_step)
        if state.committed_step > plan.committed or ran <= state.committed_step:
            self.forget(state.job_id)
            return plan
        return None


def _stages(p: Pipeline | Lanes) -> list[str]:
    """The nodes of every stage ``p`` plans (every pipeline's)."""
    lanes = p.pipelines if isinstance(p, Lanes) else (p,)
    return [s.node_id for pipeline in lanes for s in pipeline.stages]


def _joining(p: Pipeline | Lanes, g: Generation) -> frozenset[str]:
    held = {s.node_id for s in g.stages}
    return frozenset(n for n in _stages(p) if n not in held)


def _reason(p: Pipeline | Lanes, g: Generation) -> str:
    names = ", ".join(sorted(_joining(p, g)))
    lanes = len(p.pipelines) if isinstance(p, Lanes) else 1
    shape = f", {g.lanes} -> {lanes} pipelines" if lanes != g.lanes else ""
    return f"node {names} joined: predicted step {g.step_s:.3g}s -> {p.step_s:.3g}s{shape}"


__all__ = ["JoinPlan", "JoinWatch"]
