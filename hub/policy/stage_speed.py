"""A node's training speed measured on its pipeline stage, from the steps its stage reports.

A stage's report says how long its last step computed (``StageReport.compute_s``: the step's
wall time less the time its transport spent sending and waiting for the neighbours' tensors,
node/pipeline/worker.py). The hub knows the work of that step from the job's measured unit
costs: every sample of the step through the stage's units forward and backward, and the
optimizer step over their state, counted as the planner counts it (hub/policy/pipeline_plan.py,
``UPDATE_FLOPS_PER_BYTE``). Their ratio is the node's effective FLOP/s on real stage work, in
the unit the planner's offers use, so a plan made with it predicts that stage's compute as
measured.

The speed is the median of the node's last `WINDOW` steps, once it has `MIN_STEPS` of them; the
first `WARMUP_STEPS` steps of each generation are left out (allocator, kernel autotuning and
lazy initialisation make them slow). The median ignores a step slowed by a pause or sped up by
a short measurement, as long as they are fewer than half. Before `MIN_STEPS` the node's
benchmark speed stands.

Functional core: numbers in, a new frozen `StageSpeed` out, nothing mutated.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from gpuflex.protocol.modelanalysis import UnitCost

from .pipeline_plan import UPDATE_FLOPS_PER_BYTE

#: each generation's first steps, left out (warm-up)
WARMUP_STEPS: Final = 2
#: the steps a measured speed needs before it replaces the benchmark's
MIN_STEPS: Final = 3
#: the most recent steps kept; the speed is their median
WINDOW: Final = 16


@dataclass(frozen=True)
class StageSpeed:
    """The FLOP/s each of a node's recent stage steps computed at, oldest first (at most
    `WINDOW`), the bytes of state per second its optimizer steps updated at, from the steps
    that measured their end apart (``StageReport.update_s``), and the fixed seconds per unit and
    micro-batch its stage measured (``StageReport.unit_overhead_s``), from the steps that said."""

    samples: tuple[float, ...] = ()
    updates: tuple[float, ...] = ()
    overheads: tuple[float, ...] = ()

    @property
    def steps(self) -> int:
        return len(self.samples)

    @property
    def flops_per_s(self) -> float | None:
        """The median of the samples, once there are `MIN_STEPS`; None before (the benchmark's
        speed stands)."""
        if len(self.samples) < MIN_STEPS:
            return None
        return statistics.median(self.samples)

    @property
    def update_bytes_per_s(self) -> float | None:
        """The median update rate, once `MIN_STEPS` steps measured it; None before (the planner
        counts the update as `UPDATE_FLOPS_PER_BYTE` at the node's speed)."""
        if len(self.updates) < MIN_STEPS:
            return None
        return statistics.median(self.updates)

    @property
    def unit_overhead_s(self) -> float | None:
        """The median fixed time per unit and micro-batch, once `MIN_STEPS` steps said it; None
        before (the planner counts a unit's FLOPs alone)."""
        if len(self.overheads) < MIN_STEPS:
            return None
        return statistics.median(self.overheads)


def stage_step_flops(
    costs: Sequence[UnitCost], unit_start: int, unit_end: int, samples: int
) -> float:
    """One step's work on the stage of units ``[unit_start, unit_end)``: ``samples`` samples
    forward and backward through them, and the optimizer step over their state."""
    units = costs[unit_start:unit_end]
    return samples * sum(u.flops for u in units) + UPDATE_FLOPS_PER_BYTE * sum(
        u.state_bytes for u in units
    )


def with_step(
    speed: StageSpeed,
    *,
    step_flops: float,
    compute_s: float,
    step: int,
    update_s: float = 0.0,
    state_bytes: int = 0,
    unit_overhead_s: float = 0.0,
    unit_calls: int = 0,
) -> StageSpeed:
    """``speed`` with one stage step added: ``step_flops`` of work (`stage_step_flops`) computed
    in ``compute_s``, the ``step``-th step of its generation (from 1). A warm-up step, or one
    whose time or work is not a positive finite number, leaves it as it is.

    ``update_s``: the part of ``compute_s`` the step's end took (its optimizer step over
    ``state_bytes`` of state, and the sums of gradients shared with other stages or pipelines).
    When it is measured (between 0 and ``compute_s``), the speed is the samples' work over the
    rest of the time and the update is counted apart, in bytes per second: an optimizer step is
    bound by memory, and on a device whose matrix products are fast it takes many times what its
    FLOPs say, a fixed cost per step that a slow replica pays whatever its share of the samples.

    ``unit_overhead_s``: the fixed time the stage measured a unit's forward and backward to
    take per micro-batch whatever its size, and ``unit_calls`` how many times the step paid it
    (its units times its micro-batches). When both are given and their product is less than the
    samples' time, the speed is the samples' work over what is left: a speed read with the
    fixed time in it is too slow for larger micro-batches and too fast for smaller ones, so a
    plan that changes the micro-batch count would mispredict by it. The planner then adds the
    same fixed time back per unit and micro-batch (hub/policy/pipeline_plan.py)."""
    if step <= WARMUP_STEPS or not (
        math.isfinite(compute_s) and compute_s > 0 and math.isfinite(step_flops) and step_flops > 0
    ):
        return speed
    update_flops = UPDATE_FLOPS_PER_BYTE * state_bytes
    measured_update = 0 < update_s < compute_s and state_bytes > 0 and step_flops > update_flops
    work, took = (
        (step_flops - update_flops, compute_s - update_s) if measured_update else (step_flops, compute_s)
    )
    fixed = unit_overhead_s * unit_calls
    overheads = speed.overheads
    if math.isfinite(fixed) and 0 < fixed < took:
        took -= fixed
        overheads = (*overheads, unit_overhead_s)[-WINDOW:]
    return StageSpeed(
        (*speed.samples, work / took)[-WINDOW:],
        (*speed.updates, state_bytes / update_s)[-WINDOW:] if measured_update else speed.updates,
        overheads,
    )


def benchmark_scale(pairs: Iterable[tuple[float, float]]) -> float:
    """How many times its benchmark's speed a measured node computes its stages at: the median
    over ``pairs`` of (measured FLOP/s, benchmark FLOP/s), 1 when there is none. A node not yet
    measured is offered its benchmark's speed times this, on the scale of the measured ones: the
    benchmark's small model misjudges every node's speed on a job's units in the same direction,
    and planning measured nodes against raw benchmarks would rank the unmeasured ones by that
    error. The median keeps one node's odd ratio (or false reports) from setting the scale."""
    ratios = [m / b for m, b in pairs if b > 0 and math.isfinite(m / b) and m / b > 0]
    return statistics.median(ratios) if ratios else 1.0


__all__ = [
    "MIN_STEPS",
    "WARMUP_STEPS",
    "WINDOW",
    "StageSpeed",
    "benchmark_scale",
    "stage_step_flops",
    "with_step",
]
