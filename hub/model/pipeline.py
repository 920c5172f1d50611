"""A pipelined job as the hub works with it: its generations (each plan of its stages), the unit
states its stages checkpoint, its committed step, and what the stages last reported.

Plain state shared by the store (which saves it) and the domain (hub/domain/pipelines/, which
changes it on the event loop). A generation's sealed stage assignments and the stages' reports
live in memory only: after a restart the hub plans a new generation from the committed step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StageSlot:
    """Stage ``units [unit_start, unit_end)`` on ``node_id``; the planner's predicted time of one
    micro-batch on it (compute and transfer) and the memory it needs."""

    node_id: str
    unit_start: int
    unit_end: int
    predicted_s: float = 0.0
    memory_bytes: int = 0


@dataclass(frozen=True)
class Generation:
    """One plan of a job's pipeline: steps ``first_step`` up to ``end_step`` on ``stages``, each
    step cut into ``micro_batches`` micro-batches of ``micro_batch_size`` samples, run under
    ``schedule``; ``step_s`` and ``bubble_fraction`` are the planner's prediction. ``reason``:
    why it was planned (the first plan, a lost node, a restart)."""

    job_id: str
    number: int
    first_step: int
    end_step: int
    stages: tuple[StageSlot, ...]
    micro_batches: int
    micro_batch_size: int
    schedule: str
    step_s: float
    bubble_fraction: float
    reason: str
    created_at: float
    #: pipelines sharing each step (hybrid parallelism): ``stages`` lists every pipeline's,
    #: pipeline after pipeline, each cut the same; pipeline ``p`` runs ``micro_batches`` of the
    #: step's ``lanes * micro_batches`` micro-batches, and only pipeline 0 checkpoints
    lanes: int = 1
    #: each pipeline's micro-batch count when they differ (a faster pipeline runs more of the
    #: step's micro-batches, all of one size); empty: each runs ``micro_batches``
    lane_micro_batches: tuple[int, ...] = ()

    @property
    def counts(self) -> tuple[int, ...]:
        """Each pipeline's micro-batches in a step."""
        return self.lane_micro_batches or (self.micro_batches,) * self.lanes

    def lane_range(self, lane: int) -> tuple[int, int]:
        """(first micro-batch of the step, count) of pipeline ``lane``."""
        return sum(self.counts[:lane]), self.counts[lane]

    @property
    def per_lane(self) -> int:
        """Stages in each pipeline."""
        return len(self.stages) // self.lanes

    def lane_of(self, stage: int) -> tuple[int, int]:
        """(pipeline, stage within it) of slot ``stage``."""
        return divmod(stage, self.per_lane)

    def stage_of(self, node_id: str) -> int | None:
        for s, slot in enumerate(self.stages):
            if slot.node_id == node_id:
                return s
        return None

    def holder(self, unit: int) -> str:
        """The node whose stage holds ``unit`` (pipeline 0's)."""
        for slot in self.stages:
            if slot.unit_start <= unit < slot.unit_end:
                return slot.node_id
        raise KeyError(unit)


@dataclass(frozen=True)
class UnitRecord:
    """A unit's durable state at ``step`` (steps 0 to step - 1 applied): a GFT1 blob."""

    unit: int
    step: int
    sha: str
    size: int


@dataclass(frozen=True)
class StepReport:
    """What a stage said after a step (messages.StageReport), with the predicted time beside it."""

    generation: int
    stage: int
    node_id: str
    steps_done: int
    step_s: float
    compute_s: float
    predicted_s: float
    loss: float | None
    reported_at: float
    update_s: float = 0.0
    unit_overhead_s: float = 0.0


@dataclass
class PipelineState:
    """A running pipelined job's working state.

    ``states``: step -> unit -> the unit's record at that step (the committed step's and later
    ones). ``generation``: the live plan, None while the job waits for nodes (``refusal`` then
    says why, once the planner said). ``sealed``: node id -> its signed StageAssignment;
    ``last_report``: stage -> when it last reported (or was handed its stage); ``reports``: stage
    -> its last report."""

    job_id: str
    units: int
    end_step: int
    committed_step: int = 0
    states: dict[int, dict[int, UnitRecord]] = field(default_factory=dict)
    generation: Generation | None = None
    generations: int = 0  # the highest generation number ever planned (durable)
    #: the last generation planned, live or ended (a re-plan keeps its survivors' units)
    previous: Generation | None = None
    #: node id -> the unit states its StageAssignment names (the blobs it may read of them)
    named: dict[str, frozenset[str]] = field(default_factory=dict)
    #: nodes of the live generation that were handed their stage (each is handed it once)
    handed: set[str] = field(default_factory=set)
    refusal: str | None = None
    sealed: dict[str, bytes] = field(default_factory=dict)
    last_report: dict[int, float] = field(default_factory=dict)
    reports: dict[int, StepReport] = field(default_factory=dict)
    #: the idle nodes' offers (node id, memory) the planner last refused: planned again only
    #: once they change
    refused_over: tuple[tuple[str, int], ...] | None = None
    #: why the next generation is planned (set when the live one ends)
    replan_reason: str = "the first plan"
    #: the live generation's unit-state bytes that changed node, and those its nodes downloaded
    state_bytes_moved: int = 0
    state_bytes_served: int = 0

    def committed_states(self) -> dict[int, UnitRecord]:
        """Each unit's record at the committed step ({} at step 0: the job's model)."""
        return self.states.get(self.committed_step, {}) if self.committed_step else {}

    def complete_step(self, step: int) -> bool:
        """Does every unit have a state at ``step``?"""
        return len(self.states.get(step, {})) == self.units


__all__ = ["Generation", "PipelineState", "StageSlot", "StepReport", "UnitRecord"]
