"""`SqlRollbacks`: the `RollbackStore`'s methods as SQL that SQLite and PostgreSQL both run
(``?`` placeholders, ``ON CONFLICT``), composed into `SqlStore` (hub/storage/store_sqlite.py) like
its other aggregates. Each method is one transaction."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence

from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.jobspec import parse_job_spec

from ..policy.rollback import Aggregated, JobHistory, Rollback, verification_of, verifiers_of
from .db import Database
from .store import RollbackStore


def _keep_rounds(spec_toml: str) -> int:
    try:
        return int(parse_job_spec(spec_toml).verification.keep_rounds)
    except ProtocolError:  # a job that cannot be resumed: nothing is pruned
        return 0


def stopped_nodes(conn: sqlite3.Connection) -> dict[str, str]:
    """node id -> banned | suspended (an open flag that suspends it), for every node stopped now."""
    out = {str(r[0]): "suspended" for r in conn.execute(
        "SELECT DISTINCT node_id FROM flags WHERE status = 'open' AND suspends = 1")}
    out.update({str(r[0]): "banned" for r in conn.execute("SELECT id FROM nodes WHERE banned = 1")})
    return out


def _history(conn: sqlite3.Connection, job_id: str) -> JobHistory | None:
    job = conn.execute("SELECT state, round, rounds, spec_toml FROM jobs WHERE id = ?", (job_id,)).fetchone()
    if job is None:
        return None
    included: dict[int, list[tuple[str, str]]] = {}
    for u in conn.execute("SELECT id, node_id, round FROM updates WHERE job_id = ? AND status = 'included'"
                          " ORDER BY round, id", (job_id,)):
        included.setdefault(int(u["round"]), []).append((u["id"], u["node_id"]))
    aggregated: list[Aggregated] = []
    rolled_back: set[int] = set()
    for r in conn.execute("SELECT round, evidence, rolled_back_at FROM rounds WHERE job_id = ?"
                          " AND closed_at IS NOT NULL ORDER BY round", (job_id,)):
        rnd = int(r["round"])
        if r["rolled_back_at"] is not None:
            rolled_back.add(rnd)
        ups = included.get(rnd, [])
        evidence = json.loads(r["evidence"] or "{}")
        verified = verification_of(evidence, [uid for uid, _ in ups])
        by = verifiers_of(evidence, [uid for uid, _ in ups])
        aggregated += [Aggregated(rnd, uid, node, verified[uid], by[uid]) for uid, node in ups]
    kept = {int(m[0]) for m in conn.execute("SELECT version FROM models WHERE job_id = ?", (job_id,))}
    return JobHistory(job_id=job_id, state=job["state"], round=int(job["round"]), rounds=int(job["rounds"]),
                      keep_rounds=_keep_rounds(job["spec_toml"]), aggregated=tuple(aggregated),
                      kept=frozenset(kept), rolled_back=frozenset(rolled_back), stopped=frozenset(stopped_nodes(conn)))


def _unreferenced(conn: sqlite3.Connection, shas: set[str]) -> list[str]:
    """Those of ``shas`` no kept model (of any job: identical models share a blob) and no job names."""
    return sorted(sha for sha in shas if conn.execute(
        "SELECT 1 FROM models WHERE sha = ? OR opt_state_sha = ?"
        " UNION ALL SELECT 1 FROM jobs WHERE model_hash = ? OR opt_state_sha = ?",
        (sha, sha, sha, sha)).fetchone() is None)


class SqlRollbacks(RollbackStore):
    """Kept models and rollbacks (hub/policy/rollback.py)."""

    db: Database

    async def rollback_history(self, job_id: str) -> JobHistory | None:
        return await self.db.read(lambda c: _history(c, job_id))

    async def kept_model(self, job_id: str, version: int) -> tuple[str, str | None] | None:
        row = await self.db.read(lambda c: c.execute(
            "SELECT sha, opt_state_sha FROM models WHERE job_id = ? AND version = ?", (job_id, version)).fetchone())
        return None if row is None else (str(row[0]), None if row[1] is None else str(row[1]))

    async def roll_back(self, job_id: str, plan: Rollback, *, model_hash: str, opt_state_sha: str | None,
                        cancelled: Sequence[str], now: float) -> None:
        def write(conn: sqlite3.Connection) -> None:
            job = conn.execute("SELECT round, state FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if job is not None and job["state"] == "running":
                # the open round is abandoned: its shards and pending updates count for nothing
                conn.execute("UPDATE shards SET state = 'dropped' WHERE job_id = ? AND round = ?", (job_id, job["round"]))
                conn.execute("UPDATE updates SET status = 'excluded' WHERE job_id = ? AND round = ?"
                             " AND status IN ('accepted', 'redundant')", (job_id, job["round"]))
            conn.executemany("UPDATE rounds SET rolled_back_at = ?, closed_at = COALESCE(closed_at, ?)"
                             " WHERE job_id = ? AND round = ? AND rolled_back_at IS NULL",
                             [(now, now, job_id, r) for r in plan.undone])
            conn.executemany("UPDATE assignments SET state = 'cancelled' WHERE id = ? AND state = 'live'",
                             [(a,) for a in cancelled])
            conn.execute("INSERT INTO models (job_id, version, sha, created_at, opt_state_sha) VALUES (?, ?, ?, ?, ?)"
                         " ON CONFLICT (job_id, version) DO UPDATE SET sha = excluded.sha,"
                         " created_at = excluded.created_at, opt_state_sha = excluded.opt_state_sha",
                         (job_id, plan.new_round, model_hash, now, opt_state_sha))
            conn.execute("INSERT INTO rounds (job_id, round, model_hash, opened_at, restored_from) VALUES (?, ?, ?, ?, ?)"
                         " ON CONFLICT (job_id, round) DO UPDATE SET model_hash = excluded.model_hash,"
                         " opened_at = excluded.opened_at, new_model_hash = NULL, closed_at = NULL,"
                         " train_loss = NULL, loss = NULL, accuracy = NULL, metrics = NULL, evidence = NULL,"
                         " rolled_back_at = NULL, restored_from = excluded.restored_from",
                         (job_id, plan.new_round, model_hash, now, plan.to_round))
            conn.execute("UPDATE jobs SET round = ?, rounds = ?, model_hash = ?, opt_state_sha = ?, state = 'running',"
                         " error = NULL, updated_at = ? WHERE id = ?",
                         (plan.new_round, plan.rounds, model_hash, opt_state_sha, now, job_id))

        await self.db.write(write)

    async def prune_models(self, job_id: str, below: int) -> list[str]:
        def write(conn: sqlite3.Connection) -> list[str]:
            rows = conn.execute("SELECT sha, opt_state_sha FROM models WHERE job_id = ? AND version > 0"
                                " AND version < ?", (job_id, below)).fetchall()
            if not rows:
                return []
            conn.execute("DELETE FROM models WHERE job_id = ? AND version > 0 AND version < ?", (job_id, below))
            return _unreferenced(conn, {str(v) for r in rows for v in r if v is not None})

        return await self.db.write(write)
