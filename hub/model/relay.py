"""Who owns which pipeline stage, and what passes between stages: what the hub's relay checks.

A job's pipeline ``RelayPlan`` names the node that runs each stage, the tensor that crosses each
boundary per micro-batch (an activation forward, its gradient back: the same shape and dtype),
the tied-parameter groups, and the steps it governs. The pipeline's planning sets it with
``RelayRegistry.assign``; the relay (hub/server/relay.py) refuses every message the plan does
not allow, in one line, before it reads the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..base.errors import BadRequest, Conflict, Forbidden, NotFound


@dataclass(frozen=True)
class Crossing:
    """A tensor that one message carries: its dtype name (GFT1's: "float32") and shape."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TiedStages:
    """A parameter held by several stages: each sends its gradient (``crossing``) to every other."""

    stages: tuple[int, ...]
    crossing: Crossing


@dataclass(frozen=True)
class RelayPlan:
    """``stages[i]``: the node id running stage i; ``boundaries[i]``: what crosses between stage
    i and i + 1 per micro-batch; steps ``first_step`` up to ``end_step`` (None: no end).

    With ``lanes`` pipelines sharing each step (hybrid parallelism), ``stages`` lists every
    pipeline's stages, pipeline after pipeline (stage ``s`` of pipeline ``p`` is
    ``p * per_lane + s``), each cut the same: activations and gradients stay within a pipeline,
    pipeline ``p`` carries micro-batches ``p * micro_batches`` up to ``(p + 1) * micro_batches``,
    and stage ``s`` of one pipeline sends stage ``s`` of every other its units' summed gradients
    ("replica", the micro-batch the unit's place in the stage, ``replicas[s][unit]``)."""

    stages: tuple[str, ...]
    boundaries: tuple[Crossing, ...]
    micro_batches: int
    first_step: int = 0
    end_step: int | None = None
    tied: tuple[TiedStages, ...] = ()
    #: the plan's generation (StageAssignment.generation); the relay refuses another one's messages
    generation: int = 0
    lanes: int = 1
    replicas: tuple[tuple[Crossing, ...], ...] = ()
    #: each pipeline's micro-batch count when they differ (empty: ``micro_batches`` each)
    lane_micro_batches: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.stages) < 2 * self.lanes or len(self.stages) != self.lanes * (
            len(self.boundaries) + 1
        ):
            raise ValueError(
                "a pipeline plan has at least 2 stages per pipeline and one boundary between each two"
            )
        if self.micro_batches < 1:
            raise ValueError("a pipeline plan has at least one micro-batch")
        if self.lanes > 1 and len(self.replicas) != self.per_lane:
            raise ValueError("pipelines sharing a step need each stage's replica crossings")

    @property
    def per_lane(self) -> int:
        return len(self.boundaries) + 1

    def crossing(
        self, *, step: int, micro_batch: int, carries: str, stage: int, to_stage: int
    ) -> Crossing:
        """What a message from ``stage`` to ``to_stage`` must hold; Forbidden for a step outside the
        plan, BadRequest when the plan has no such message."""
        if step < self.first_step or (self.end_step is not None and step >= self.end_step):
            end = "" if self.end_step is None else f" up to {self.end_step - 1}"
            raise Forbidden(
                f"step {step} is not one of this pipeline plan's (steps {self.first_step}{end})",
                code="not_your_step",
            )
        if not (0 <= stage < len(self.stages) and 0 <= to_stage < len(self.stages)):
            raise BadRequest(
                f"the pipeline has stages 0 to {len(self.stages) - 1}, not {max(stage, to_stage)}",
                code="not_in_plan",
            )
        lane, local = divmod(stage, self.per_lane)
        to_lane, to_local = divmod(to_stage, self.per_lane)
        if carries == "replica":
            return self._replica(micro_batch, lane, local, to_lane, to_local)
        if lane != to_lane:
            raise BadRequest(
                f"stages {stage} and {to_stage} are in different pipelines: only their replica"
                " gradients cross between them",
                code="not_in_plan",
            )
        if carries == "tied":
            if (
                micro_batch < len(self.tied)
                and {local, to_local} <= set(self.tied[micro_batch].stages)
                and stage != to_stage
            ):
                return self.tied[micro_batch].crossing
            raise BadRequest(
                f"stages {stage} and {to_stage} share no tied group {micro_batch}",
                code="not_in_plan",
            )
        counts = self.lane_micro_batches or (self.micro_batches,) * self.lanes
        first, count = sum(counts[:lane]), counts[lane]
        if not first <= micro_batch < first + count:
            raise BadRequest(
                f"micro-batch {micro_batch} is not one of the plan's"
                f" {first} to {first + count - 1}"
                + (f" (pipeline {lane}'s)" if self.lanes > 1 else ""),
                code="not_in_plan",
            )
        if carries == "activation" and to_local == local + 1:
            return self.boundaries[local]
        if carries == "gradient" and to_local == local - 1:
            return self.boundaries[to_local]
        raise BadRequest(
            f"an {carries} does not go from stage {stage} to stage {to_stage}", code="not_in_plan"
        )

    def _replica(self, unit: int, lane: int, local: int, to_lane: int, to_local: int) -> Crossing:
        if self.lanes == 1 or lane == to_lane or local != to_local:
            raise BadRequest(
                "a replica gradient goes between the same stage of two pipelines sharing a step",
                code="not_in_plan",
            )
        if unit >= len(self.replicas[local]):
            raise BadRequest(
                f"stage {local} holds {len(self.replicas[local])} units, not unit {unit}",
                code="not_in_plan",
            )
        return self.replicas[local][unit]

    def check_generation(self, generation: int) -> None:
        """Conflict (409 ``stale_generation``) for a message of another generation than this plan's."""
        if generation != self.generation:
            raise Conflict(
                f"generation {generation} of this job's pipeline is over (it runs generation"
                f" {self.generation}): stop the stage and ask for work",
                code="stale_generation",
            )

    def check_owner(self, node_id: str, stage: int, what: str) -> None:
        """Forbidden unless ``node_id`` runs ``stage``."""
        if self.stages[stage] != node_id:
            raise Forbidden(
                f"this node does not run stage {stage} of the pipeline, so it may not {what}",
                code="not_your_stage",
            )


@dataclass
class RelayRegistry:
    """The current pipeline plan of each job (memory only; the pipeline's planning sets it)."""

    plans: dict[str, RelayPlan] = field(default_factory=dict)

    def assign(self, job_id: str, plan: RelayPlan) -> None:
        self.plans[job_id] = plan

    def drop(self, job_id: str) -> None:
        self.plans.pop(job_id, None)

    def plan(self, job_id: str) -> RelayPlan:
        plan = self.plans.get(job_id)
        if plan is None:
            raise NotFound(f"job {job_id} runs no pipeline on this hub", code="no_pipeline")
        return plan


__all__ = ["Crossing", "RelayPlan", "RelayRegistry", "TiedStages"]
