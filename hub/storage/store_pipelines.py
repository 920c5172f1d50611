"""`SqlPipelines`: the `PipelineStore`'s methods as SQL both databases run (see store_sqlite.py),
over the tables of schema v8 (hub/storage/db.py): ``pipelines`` (a job's committed step and the
highest generation planned), ``pipeline_generations``, ``unit_states`` and ``stage_reports``.
Each method is one transaction."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import asdict
from typing import Any

from ..model.job import new_id
from ..model.pipeline import Generation, StageSlot, StepReport, UnitRecord
from ..policy.suspension import flag_suspends
from ..policy.verification import Flag
from .db import Database
from .store import LoadedPipeline, PipelineStore


def generation_json(g: Generation) -> str:
    """What ``pipeline_generations.plan`` holds of a generation."""
    return json.dumps(
        {
            "stages": [asdict(s) for s in g.stages],
            "micro_batches": g.micro_batches,
            "micro_batch_size": g.micro_batch_size,
            "schedule": g.schedule,
            "step_s": g.step_s,
            "bubble_fraction": g.bubble_fraction,
            "lanes": g.lanes,
            "lane_micro_batches": list(g.lane_micro_batches),
        },
        sort_keys=True,
        separators=(",", ":"),
    )


def generation_from_row(row: Any) -> Generation:
    """A ``pipeline_generations`` row as a `Generation`."""
    plan = json.loads(row["plan"])
    return Generation(
        job_id=row["job_id"],
        number=int(row["generation"]),
        first_step=int(row["first_step"]),
        end_step=int(row["end_step"]),
        stages=tuple(StageSlot(**s) for s in plan["stages"]),
        micro_batches=int(plan["micro_batches"]),
        micro_batch_size=int(plan["micro_batch_size"]),
        schedule=str(plan["schedule"]),
        step_s=float(plan["step_s"]),
        bubble_fraction=float(plan["bubble_fraction"]),
        reason=row["reason"],
        created_at=float(row["created_at"]),
        lanes=int(plan.get("lanes", 1)),
        lane_micro_batches=tuple(int(m) for m in plan.get("lane_micro_batches", ())),
    )


class SqlPipelines(PipelineStore):
    """A pipelined job's rows."""

    db: Database

    async def save_generation(self, generation: Generation, *, now: float) -> None:
        g = generation

        def write(conn: sqlite3.Connection) -> None:
            conn.execute(
                "UPDATE pipeline_generations SET ended_at = ? WHERE job_id = ? AND ended_at IS NULL",
                (now, g.job_id),
            )
            conn.execute(
                "INSERT INTO pipeline_generations (job_id, generation, first_step, end_step, plan,"
                " reason, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    g.job_id,
                    g.number,
                    g.first_step,
                    g.end_step,
                    generation_json(g),
                    g.reason,
                    g.created_at,
                ),
            )
            conn.execute(
                "INSERT INTO pipelines (job_id, committed_step, generations, updated_at)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (job_id) DO UPDATE SET"
                " generations = excluded.generations, updated_at = excluded.updated_at",
                (g.job_id, g.first_step, g.number, now),
            )

        await self.db.write(write)

    async def end_generation(self, job_id: str, number: int, *, now: float) -> None:
        await self.db.write(
            lambda c: c.execute(
                "UPDATE pipeline_generations SET ended_at = ? WHERE job_id = ? AND generation = ?"
                " AND ended_at IS NULL",
                (now, job_id, number),
            )
        )

    async def save_unit_state(
        self,
        job_id: str,
        record: UnitRecord,
        *,
        generation: int,
        node_id: str,
        now: float,
        committed: int | None,
    ) -> None:
        r = record

        def write(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO unit_states (job_id, unit, step, sha, size, generation, node_id,"
                " created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (job_id, unit, step)"
                " DO UPDATE SET sha = excluded.sha, size = excluded.size,"
                " generation = excluded.generation, node_id = excluded.node_id,"
                " created_at = excluded.created_at",
                (job_id, r.unit, r.step, r.sha, r.size, generation, node_id, now),
            )
            if committed is not None:
                conn.execute(
                    "UPDATE pipelines SET committed_step = ?, updated_at = ? WHERE job_id = ?"
                    " AND committed_step < ?",
                    (committed, now, job_id, committed),
                )

        await self.db.write(write)

    async def flag_stage(self, job_id: str, step: int, flag: Flag, *, now: float) -> None:
        f = flag
        await self.db.write(
            lambda c: c.execute(
                "INSERT INTO flags (id, job_id, round, update_id, node_id, reason, evidence, status,"
                " created_at, suspends, run_before) VALUES (?, ?, ?, ?, ?, ?, ?, 'open', ?, ?,"
                " (SELECT consecutive_agreements FROM nodes WHERE id = ?))",
                (
                    new_id("f"),
                    job_id,
                    step,
                    f.update_id,
                    f.node_id,
                    f.reason,
                    json.dumps(f.evidence, sort_keys=True, separators=(",", ":"), default=str),
                    now,
                    int(flag_suspends(f)),
                    f.node_id,
                ),
            )
        )

    async def save_stage_report(self, job_id: str, report: StepReport) -> None:
        r = report
        await self.db.write(
            lambda c: c.execute(
                "INSERT INTO stage_reports (job_id, generation, stage, steps_done, node_id, step_s,"
                " compute_s, predicted_s, loss, reported_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (job_id, generation, stage, steps_done) DO UPDATE SET"
                " step_s = excluded.step_s, compute_s = excluded.compute_s, loss = excluded.loss,"
                " reported_at = excluded.reported_at",
                (
                    job_id,
                    r.generation,
                    r.stage,
                    r.steps_done,
                    r.node_id,
                    r.step_s,
                    r.compute_s,
                    r.predicted_s,
                    r.loss,
                    r.reported_at,
                ),
            )
        )

    async def finish_pipeline(
        self, job_id: str, model_hash: str, model_size: int, *, now: float
    ) -> None:
        def write(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO models (job_id, version, sha, created_at) VALUES (?, 1, ?, ?)"
                " ON CONFLICT (job_id, version) DO UPDATE SET sha = excluded.sha,"
                " created_at = excluded.created_at",
                (job_id, model_hash, now),
            )
            conn.execute(
                "UPDATE jobs SET model_hash = ?, model_size = ?, state = 'done', updated_at = ?"
                " WHERE id = ?",
                (model_hash, model_size, now, job_id),
            )
            conn.execute(
                "UPDATE pipeline_generations SET ended_at = ? WHERE job_id = ? AND ended_at IS NULL",
                (now, job_id),
            )

        await self.db.write(write)

    async def load_pipelines(self) -> list[LoadedPipeline]:
        return await self.db.read(_load_pipelines)


def _load_pipelines(conn: sqlite3.Connection) -> list[LoadedPipeline]:
    out = []
    for p in conn.execute(
        "SELECT p.* FROM pipelines p JOIN jobs j ON j.id = p.job_id"
        " WHERE j.state IN ('queued', 'running') ORDER BY p.job_id"
    ).fetchall():
        job_id, committed = p["job_id"], int(p["committed_step"])
        last = conn.execute(
            "SELECT * FROM pipeline_generations WHERE job_id = ? ORDER BY generation DESC LIMIT 1",
            (job_id,),
        ).fetchone()
        states = [
            UnitRecord(int(r["unit"]), int(r["step"]), r["sha"], int(r["size"]))
            for r in conn.execute(
                "SELECT unit, step, sha, size FROM unit_states WHERE job_id = ? AND step >= ?"
                " ORDER BY step, unit",
                (job_id, committed),
            )
        ]
        out.append(
            LoadedPipeline(
                job_id=job_id,
                committed_step=committed,
                generations=int(p["generations"]),
                last=None if last is None else generation_from_row(last),
                states=states,
            )
        )
    return out


__all__ = ["SqlPipelines", "generation_from_row", "generation_json"]
