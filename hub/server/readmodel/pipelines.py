"""A pipelined job's pipeline as its status shows it (GET /v1/jobs/{id}, ``job status``): the live
generation's stages, units and nodes with the predicted and measured step time and the bubble,
the committed step against the last, every generation planned with why, and while the job waits
for nodes the planner's one-line refusal."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Mapping
from typing import Any

from gpuflex.protocol.jobspec import JobSpec

from ...domain.pipelines import Pipelines
from ...model.pipeline import Generation, PipelineState, StepReport
from ...storage.store_pipelines import generation_from_row


def generations(conn: sqlite3.Connection, job_id: str) -> list[dict[str, Any]]:
    """Every generation of the job's pipeline, oldest first, with its measured step time (the
    mean of its stages' reports) and its last loss."""
    out = []
    for row in conn.execute(
        "SELECT * FROM pipeline_generations WHERE job_id = ? ORDER BY generation", (job_id,)
    ).fetchall():
        g = generation_from_row(row)
        measured, steps = conn.execute(
            "SELECT AVG(step_s), MAX(steps_done) FROM stage_reports WHERE job_id = ? AND generation = ?",
            (job_id, g.number),
        ).fetchone()
        # the last step every pipeline's last stage reported: their shares of its loss, summed
        loss = conn.execute(
            "SELECT SUM(loss) FROM stage_reports WHERE job_id = ? AND generation = ? AND loss IS"
            " NOT NULL GROUP BY steps_done HAVING COUNT(*) = ? ORDER BY steps_done DESC LIMIT 1",
            (job_id, g.number, g.lanes),
        ).fetchone()
        out.append(
            {
                "generation": g.number,
                "first_step": g.first_step,
                "end_step": g.end_step,
                "reason": g.reason,
                "created_at": g.created_at,
                "ended_at": row["ended_at"],
                "stages": g.per_lane,
                "pipelines": g.lanes,
                "predicted_step_s": g.step_s,
                "measured_step_s": None if measured is None else float(measured),
                "steps_done": steps,
                "loss": None if loss is None else loss[0],
            }
        )
    return out


def committed_step(conn: sqlite3.Connection, job_id: str) -> int:
    row = conn.execute(
        "SELECT committed_step FROM pipelines WHERE job_id = ?", (job_id,)
    ).fetchone()
    return 0 if row is None else int(row[0])


def pipeline_doc(conn: sqlite3.Connection, job_id: str, spec: JobSpec) -> dict[str, Any]:
    """The stored part of the pipeline document (the live generation is added by ``live``)."""
    p = spec.pipeline
    if p is None:
        raise ValueError("not pipelined")
    return {
        "steps": p.steps,
        "checkpoint_every": p.checkpoint_every,
        "stages_asked": p.stages,
        "micro_batches_asked": p.micro_batches,
        "schedule_asked": p.schedule,
        "committed_step": committed_step(conn, job_id),
        "generation": None,
        "waiting": None,
        "generations": generations(conn, job_id),
    }


def live(doc: dict[str, Any], pipelines: Pipelines, job_id: str) -> None:
    """The live generation (memory: what its stages last reported, and the memory each stage's
    node offers), or the planner's refusal."""
    state = pipelines.jobs.get(job_id)
    if state is None:
        return
    doc["committed_step"] = max(doc["committed_step"], state.committed_step)
    g = state.generation
    if g is None:
        doc["waiting"] = state.refusal or "the hub is planning the pipeline"
        return
    cut = pipelines.known_cut(job_id)
    nodes = pipelines.scheduler.nodes
    offered = {s.node_id: nodes[s.node_id].max_memory_bytes for s in g.stages if s.node_id in nodes}
    doc["generation"] = generation_doc(g, state, cut.names if cut else (), time.time(), offered)


def generation_doc(
    g: Generation,
    state: PipelineState,
    names: tuple[str, ...],
    now: float,
    offered: Mapping[str, int],
) -> dict[str, Any]:
    reports = state.reports
    measured = [r.step_s for r in reports.values()]
    return {
        "number": g.number,
        "first_step": g.first_step,
        "end_step": g.end_step,
        "reason": g.reason,
        "micro_batches": g.micro_batches,
        "micro_batch_size": g.micro_batch_size,
        "schedule": g.schedule,
        "predicted_step_s": g.step_s,
        "measured_step_s": max(measured) if measured else None,
        "bubble_fraction": g.bubble_fraction,
        "state_bytes_moved": state.state_bytes_moved,
        "state_bytes_served": state.state_bytes_served,
        "steps_done": min((r.steps_done for r in reports.values()), default=g.first_step),
        "loss": _step_loss(g, reports),
        "pipelines": g.lanes,
        "stages": [
            {
                "stage": s,
                "node_id": slot.node_id,
                "first_unit": slot.unit_start,
                "end_unit": slot.unit_end,
                "unit_names": list(names[slot.unit_start : slot.unit_end]),
                "predicted_micro_batch_s": slot.predicted_s,
                "memory_bytes": slot.memory_bytes,
                "offered_bytes": offered.get(slot.node_id),
                "steps_done": reports[s].steps_done if s in reports else None,
                "step_s": reports[s].step_s if s in reports else None,
                "compute_s": reports[s].compute_s if s in reports else None,
                "silent_s": round(now - state.last_report.get(s, g.created_at), 3),
            }
            for s, slot in enumerate(g.stages)
        ],
    } | _lanes_doc(g)


def _lanes_doc(g: Generation) -> dict[str, Any]:
    """Pipelines sharing the steps: each slot's pipeline and its stage in it (``job status``
    shows stage ``p.s``); nothing for one pipeline."""
    if g.lanes == 1:
        return {}
    return {
        "lane_micro_batches": list(g.counts),
        "lanes": [
            dict(zip(("pipeline", "stage"), g.lane_of(s), strict=True))
            for s in range(len(g.stages))
        ],
    }


def _step_loss(g: Generation, reports: Mapping[int, StepReport]) -> float | None:
    """The last reported step's loss: its pipelines' last stages' shares of it, summed (None
    until each has reported the same step)."""
    last = [lane * g.per_lane + g.per_lane - 1 for lane in range(g.lanes)]
    got = [reports[s] for s in last if s in reports and reports[s].loss is not None]
    if len(got) != len(last) or len({r.steps_done for r in got}) != 1:
        return got[0].loss if g.lanes == 1 and got else None
    return sum(r.loss for r in got if r.loss is not None)


def drop_losses(doc: dict[str, Any]) -> None:
    """An auditor's pipeline: how its generations ran and on which nodes, not the model's loss."""
    for g in (doc.get("generation"), *doc["generations"]):
        if g is not None:
            g.pop("loss", None)


__all__ = ["committed_step", "drop_losses", "generation_doc", "generations", "live", "pipeline_doc"]
