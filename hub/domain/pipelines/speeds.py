"""Each node's speed measured on its pipeline stage (hub/policy/stage_speed.py), kept on the node
(``NodeState.stage_speed``) as its stage reports come in, and read by every offer made of it
(offers.py's ``offer_of``: a generation's plan, a join's re-plan, the plan preview).

The speed is kept per node, not per job: a node runs one stage at a time, so its window holds its
most recent stage work, and the offer of it serves whichever job is planned next. The op mix of
another job's units differs, but a measurement of the node's device as it runs now (its real
precision, its thermal state, what else runs on it) on a stage's matrix products is closer to any
job's stage work than the benchmark's small reference MLP, which misses all of these.

Memory only: the reports themselves are durable (``stage_reports``), but replaying them would
need each job's model analysed again at start-up; a restarted hub plans with the benchmarks until
the nodes' stages have reported ``MIN_STEPS`` steps again, a few seconds of a running pipeline.
"""

from __future__ import annotations

from ...model.node import NodeState
from ...model.pipeline import Generation, StepReport
from ...policy.stage_speed import stage_step_flops, with_step
from .offers import ModelCut


def note_step(node: NodeState, cut: ModelCut | None, g: Generation, report: StepReport) -> None:
    """Add ``report`` (an accepted report of ``node``'s stage in ``g``) to the node's measured
    speed; nothing without the job's model cut. The stage's step ran its pipeline's share of the
    step's micro-batches (all of them with one pipeline), each through each of its units."""
    if cut is None or not 0 <= report.stage < len(g.stages):
        return
    slot = g.stages[report.stage]
    micro_batches = g.counts[g.lane_of(report.stage)[0]]
    node.stage_speed = with_step(
        node.stage_speed,
        step_flops=stage_step_flops(
            cut.costs, slot.unit_start, slot.unit_end, micro_batches * g.micro_batch_size
        ),
        compute_s=report.compute_s,
        step=report.steps_done - g.first_step,
        update_s=report.update_s,
        state_bytes=sum(u.state_bytes for u in cut.costs[slot.unit_start : slot.unit_end]),
        unit_overhead_s=report.unit_overhead_s,
        unit_calls=micro_batches * (slot.unit_end - slot.unit_start),
    )


__all__ = ["note_step"]
