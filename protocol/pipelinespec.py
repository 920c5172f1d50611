"""The ``[pipeline]`` section of a job spec: the model cut into stages on different nodes
(docs/pipeline.md). protocol/jobspec.py reads the other sections and calls ``parse_pipeline``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .boundary import BOUNDARIES, check_boundary
from .errors import SpecError

if TYPE_CHECKING:
    from .jobspec import DataSpec, PrivacySpec, TrainSpec, _Section
    from .modelspec import ModelSpec

__all__ = ["PipelineSpec", "parse_pipeline"]


@dataclass(frozen=True)
class PipelineSpec:
    """[pipeline]: the model is cut into stages that run on different nodes (docs/pipeline.md).
    A step trains ``[train] batch_size`` samples, split into micro-batches."""

    #: stages per pipeline; 0: the planner chooses (the fewest that fit, balanced by speed)
    stages: int = 0
    #: micro-batches per step; 0: the planner chooses
    micro_batches: int = 0
    #: "auto" (the planner's choice), "gpipe" or "1f1b"
    schedule: str = "auto"
    #: optimizer steps of the whole job
    steps: int = 100
    #: every stage's state goes to the hub's blob store every this many steps (and at the end);
    #: a lost stage node sends every stage back to the last step all of them saved
    checkpoint_every: int = 10
    #: how activations and their gradients cross a cut: one of protocol/boundary.py's
    #: BOUNDARIES; ``boundary_rank``: a subspace code's rank (0 for the others)
    boundary: str = "fp32"
    boundary_rank: int = 0
    #: the share of (stage, checkpoint step) pairs whose work the hub re-executes: one micro-batch
    #: of that step, drawn by the hub and unknown to the nodes (hub/policy/stage_check.py)
    verify_rate: float = 0.05
    #: the most pipelines a step is shared by (hybrid data + pipeline parallelism): each runs
    #: the same stages on nodes of its own, over its share of the step's micro-batches, and the
    #: stages' gradients are summed across pipelines before the optimizer steps; 0: as many as
    #: the planner predicts faster, 1: one pipeline
    pipelines: int = 0


def parse_pipeline(
    s: _Section, model: ModelSpec, train: TrainSpec, data: DataSpec, privacy: PrivacySpec
) -> PipelineSpec:
    """The ``[pipeline]`` section ``s`` of a spec whose other sections are given."""
    d = PipelineSpec()  # the defaults live in the dataclass only
    spec = PipelineSpec(
        stages=s.get_int("stages", d.stages, 0, 1024),
        micro_batches=s.get_int("micro_batches", d.micro_batches, 0, 1 << 16),
        schedule=s.get_choice("schedule", d.schedule, ("auto", "gpipe", "1f1b")),
        steps=s.get_int("steps", d.steps, 1, 1 << 40),
        checkpoint_every=s.get_int("checkpoint_every", d.checkpoint_every, 1, 1 << 30),
        boundary=s.get_choice("boundary", d.boundary, BOUNDARIES),
        boundary_rank=s.get_int("boundary_rank", d.boundary_rank, 0, 1 << 16),
        verify_rate=s.get_float("verify_rate", d.verify_rate, 0.0, 1.0),
        pipelines=s.get_int("pipelines", d.pipelines, 0, 256),
    )
    # a transformer's every cut is its width wide; other models' cuts are checked when planned
    width = model.transformer.width if model.transformer is not None else None
    check_boundary(spec.boundary, spec.boundary_rank, width)
    if spec.stages == 1:
        raise SpecError("pipeline.stages: 0 (the planner's choice) or at least 2, got 1")
    if spec.micro_batches > train.batch_size:
        raise SpecError(
            f"pipeline.micro_batches: {spec.micro_batches} micro-batches cannot split "
            f"train.batch_size = {train.batch_size} samples"
        )
    if spec.pipelines > 1 and spec.micro_batches and spec.micro_batches % spec.pipelines:
        raise SpecError(
            f"pipeline.pipelines: {spec.pipelines} pipelines cannot share "
            f"pipeline.micro_batches = {spec.micro_batches} micro-batches evenly"
        )
    if data.node_local:
        raise SpecError(
            "pipeline: a pipelined job trains on the hub's data; node-local silos are not supported"
        )
    if privacy.dp != "off" or privacy.secure_aggregation:
        raise SpecError("pipeline: a pipelined job has no updates to privatise; remove [privacy]")
    return spec
