"""A generation: one plan of a job's pipeline, what the relay lets its stages send each other,
and each stage's signed StageAssignment.

Generation ``n + 1`` resumes from the job's committed step; a node in it runs steps
``first_step`` up to ``end_step``. The relay's plan for it (``RelayPlan``) names each stage's
node, the tensor crossing each boundary for one micro-batch (the unit's output before the cut,
``micro_batch_size`` samples) and each tied group (index ``g`` is ``pipeline_units(spec).tied[g]``,
its stages those holding a member unit).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from gpuflex.protocol.boundary import encoded_crossing
from gpuflex.protocol.messages import ChunkRef, StageAssignment, UnitState

from ...model.job import JobState
from ...model.node import NodeState
from ...model.pipeline import Generation, PipelineState, StageSlot
from ...model.relay import Crossing, RelayPlan, TiedStages
from ...policy.pipeline_plan import Pipeline
from .checkpoints import Entries
from .offers import ModelCut
from .planning import Lanes


def new_generation(
    job: JobState, state: PipelineState, plan: Pipeline | Lanes, *, reason: str, now: float
) -> Generation:
    """Generation ``state.generations + 1`` of ``plan`` (one pipeline, or several sharing each
    step), from the committed step."""
    lanes = plan.pipelines if isinstance(plan, Lanes) else (plan,)
    first = lanes[0]
    return Generation(
        job_id=job.id,
        number=state.generations + 1,
        first_step=state.committed_step,
        end_step=state.end_step,
        stages=tuple(
            StageSlot(s.node_id, s.first_unit, s.end_unit, s.micro_batch_s, s.memory_bytes)
            for pipeline in lanes
            for s in pipeline.stages
        ),
        micro_batches=first.micro_batches,
        micro_batch_size=first.micro_batch_size,
        schedule=first.schedule,
        step_s=plan.step_s,
        bubble_fraction=first.bubble_fraction,
        reason=reason,
        created_at=now,
        lanes=len(lanes),
        lane_micro_batches=(
            tuple(p.micro_batches for p in lanes)
            if len({p.micro_batches for p in lanes}) > 1
            else ()
        ),
    )


def relay_plan(g: Generation, cut: ModelCut, boundary: str = "fp32", rank: int = 0) -> RelayPlan:
    """What the relay lets generation ``g``'s stages send each other: each cut's tensor in the
    job's boundary encoding (``[pipeline] boundary``, protocol/boundary.py)."""
    one = g.stages[: g.per_lane]
    stage_of_unit = {
        u: s for s, slot in enumerate(one) for u in range(slot.unit_start, slot.unit_end)
    }
    boundaries = []
    for slot in one[:-1]:
        shape, dtype = cut.outputs[slot.unit_end - 1]
        encoded = encoded_crossing((g.micro_batch_size, *shape), dtype, boundary, rank)
        boundaries.append(Crossing(*encoded))
    tied = tuple(
        TiedStages(tuple(sorted({stage_of_unit[u] for u in t.units})), Crossing(t.dtype, t.shape))
        for t in cut.tied
    )
    replicas = tuple(
        tuple(
            Crossing("float32", (replica_length(cut.entries[u]),))
            for u in range(slot.unit_start, slot.unit_end)
        )
        for slot in one
    )
    return RelayPlan(
        stages=tuple(s.node_id for s in g.stages),
        boundaries=tuple(boundaries),
        micro_batches=g.micro_batches,
        first_step=g.first_step,
        end_step=g.end_step,
        tied=tied,
        generation=g.number,
        lanes=g.lanes,
        replicas=replicas if g.lanes > 1 else (),
        lane_micro_batches=g.lane_micro_batches,
    )


def replica_length(entries: Entries) -> int:
    """The elements of a unit's trainable parameters: its "replica" gradient's length."""
    return sum(math.prod(shape) for shape, _, trainable in entries.values() if trainable)


def stage_assignment(
    job: JobState,
    state: PipelineState,
    g: Generation,
    stage: int,
    nodes: Mapping[str, NodeState],
    *,
    now: float,
) -> StageAssignment:
    """Stage ``stage`` of generation ``g`` for its node (unsigned; the caller seals it)."""
    slot = g.stages[stage]
    pipeline = job.spec.pipeline
    if pipeline is None:
        raise ValueError(f"job {job.id} is not pipelined")
    committed = state.committed_states()
    ends = g.lane_of(stage)[1] in (0, g.per_lane - 1)
    return StageAssignment(
        job_id=job.id,
        generation=g.number,
        node_id=slot.node_id,
        stage=stage,
        unit_start=slot.unit_start,
        unit_end=slot.unit_end,
        stage_nodes=tuple(s.node_id for s in g.stages),
        stage_keys=tuple(nodes[s.node_id].public_key for s in g.stages),
        stage_starts=tuple(s.unit_start for s in g.stages),
        model_spec=job.spec.model.to_dict(),
        model_hash=job.model_hash,
        model_size=job.model_size,
        unit_states=tuple(
            UnitState(unit=u, sha256=committed[u].sha, size=committed[u].size)
            for u in range(slot.unit_start, slot.unit_end)
            if u in committed
        ),
        chunks=tuple(ChunkRef(c.sha, c.size, c.samples) for c in job.chunks) if ends else (),
        train=job.spec.train.train_config(),
        seed=job.spec.train.seed,
        batch_size=job.spec.train.batch_size,
        micro_batches=g.counts[g.lane_of(stage)[0]],
        schedule=g.schedule,
        first_step=g.first_step,
        end_step=g.end_step,
        checkpoint_every=pipeline.checkpoint_every,
        issued_at=now,
        stage_addresses=tuple(nodes[s.node_id].stage_address for s in g.stages),
        boundary=pipeline.boundary,
        boundary_rank=pipeline.boundary_rank,
        lanes=g.lanes,
        lane_micro_batches=g.lane_micro_batches,
    )


def stage_units(g: Generation, stage: int) -> range:
    slot = g.stages[stage]
    return range(slot.unit_start, slot.unit_end)


__all__ = ["new_generation", "relay_plan", "stage_assignment", "stage_units"]
