"""Read-only queries the console needs and the hub does not already offer.

Every function takes the hub's ``sqlite3.Connection`` (run through
``Database.read`` so it executes on the hub's database thread) and only SELECTs.
The console never writes the hub's tables: verdicts go through the hub's own
domain function. Column meanings are the hub's (hub/storage/db.py).

Results are plain dicts/lists so templates stay dumb and tests can check them.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from gpuflex.hub.base.errors import NotFound

__all__ = [
    "assignment_counts",
    "flag_context",
    "job_extras",
    "job_names",
    "job_row",
    "jobs_list",
    "node_flags",
    "node_updates",
    "token_alive",
]


def _loads(text: str | None) -> Any:
    if not text:
        return {}
    try:
        return json.loads(text)
    except ValueError:
        return {}


def token_alive(conn: sqlite3.Connection, token_id: str) -> tuple[str, str] | None:
    """(role, name) of a token that still exists and is not revoked, else None."""
    try:
        tid = int(token_id)
    except ValueError:
        return None
    row = conn.execute("SELECT role, name, revoked_at FROM tokens WHERE id = ?", (tid,)).fetchone()
    if row is None or row["revoked_at"] is not None:
        return None
    return str(row["role"]), str(row["name"])


def job_row(conn: sqlite3.Connection, job_id: str) -> sqlite3.Row:
    """Any job's row by id, for an auditor's review (bridge.job_review checks the role)."""
    row = conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
    if row is None:
        raise NotFound(f"no job {job_id}", code="unknown_job")
    return row  # type: ignore[no-any-return]


def _latest_metrics(conn: sqlite3.Connection, job_id: str) -> dict[str, Any]:
    row = conn.execute(
        "SELECT round, loss, accuracy, train_loss FROM rounds WHERE job_id = ? AND closed_at IS NOT NULL"
        " ORDER BY round DESC LIMIT 1",
        (job_id,),
    ).fetchone()
    if row is None:
        return {"loss": None, "accuracy": None, "train_loss": None}
    return {"loss": row["loss"], "accuracy": row["accuracy"], "train_loss": row["train_loss"]}


def _closed_rounds(conn: sqlite3.Connection, job_id: str) -> int:
    return int(
        conn.execute(
            "SELECT COUNT(*) FROM rounds WHERE job_id = ? AND closed_at IS NOT NULL", (job_id,)
        ).fetchone()[0]
    )


def jobs_list(
    conn: sqlite3.Connection, where: str, args: tuple[Any, ...], limit: int = 500
) -> list[dict[str, Any]]:
    """Jobs newest first, filtered by the hub's visibility rule (routes_owner.visible)."""
    rows = conn.execute(
        f"SELECT * FROM jobs WHERE {where} ORDER BY created_at DESC LIMIT ?",  # noqa: S608 - hub's fixed fragment
        (*args, limit),
    ).fetchall()
    out = []
    for r in rows:
        j = {
            "id": r["id"],
            "name": r["name"],
            "owner": r["owner"],
            "state": r["state"],
            "round": r["round"],
            "rounds": r["rounds"],
            "closed": _closed_rounds(conn, r["id"]),
            "updated_at": r["updated_at"],
        }
        j.update(_latest_metrics(conn, r["id"]))
        out.append(j)
    return out


def job_extras(
    conn: sqlite3.Connection,
    job_id: str,
    state: str,
    current_round: int,
    shard_round: int | None = None,
) -> dict[str, Any]:
    """What the API's job status lacks: latest metrics, chunk count, shard map (each shard with
    its assignments and ``copies``, those live or done), flags.

    The caller has already checked visibility (the hub's ``job_row``). The shard
    map is of ``shard_round`` when given, else of the open round while the job
    runs, else of the last round carved.
    """
    out: dict[str, Any] = dict(_latest_metrics(conn, job_id))
    out["chunks"] = conn.execute(
        "SELECT COUNT(*) FROM chunks WHERE job_id = ?", (job_id,)
    ).fetchone()[0]
    out["closed"] = _closed_rounds(conn, job_id)
    last = conn.execute("SELECT MAX(round) FROM shards WHERE job_id = ?", (job_id,)).fetchone()[0]
    if shard_round is None:
        shard_round = last
        if last is not None and state in ("queued", "running"):
            shard_round = current_round
    shards: list[dict[str, Any]] = []
    if shard_round is not None:
        upd_by_assignment = {
            row["assignment_id"]: row["status"]
            for row in conn.execute(
                "SELECT assignment_id, status FROM updates WHERE job_id = ? AND round = ?",
                (job_id, shard_round),
            )
        }
        for s in conn.execute(
            "SELECT * FROM shards WHERE job_id = ? AND round = ? ORDER BY seq",
            (job_id, shard_round),
        ).fetchall():
            chunks = [
                {"idx": c["chunk_idx"], "sha": c["chunk_sha"]}
                for c in conn.execute(
                    "SELECT chunk_idx, chunk_sha FROM shard_chunks WHERE shard_id = ? ORDER BY pos",
                    (s["id"],),
                )
            ]
            assignments = [
                {
                    "id": a["id"],
                    "node_id": a["node_id"],
                    "state": a["state"],
                    "deadline": a["deadline"],
                    "update_status": upd_by_assignment.get(a["id"]),
                }
                for a in conn.execute(
                    "SELECT id, node_id, state, deadline FROM assignments WHERE shard_id = ?"
                    " ORDER BY issued_at, id",
                    (s["id"],),
                )
            ]
            shards.append(
                {
                    "id": s["id"],
                    "seq": s["seq"],
                    "samples": s["samples"],
                    "replica_group": s["replica_group"],
                    "wanted": s["wanted"],
                    # copies of the training given out that still count: in flight or returned
                    "copies": sum(1 for a in assignments if a["state"] in ("live", "done")),
                    "state": s["state"],
                    "chunks": chunks,
                    "assignments": assignments,
                }
            )
    out["shard_round"] = shard_round
    out["rounds_carved"] = [
        r[0]
        for r in conn.execute(
            "SELECT DISTINCT round FROM shards WHERE job_id = ? ORDER BY round", (job_id,)
        )
    ]
    out["shards"] = shards
    out["flags"] = [
        dict(f)
        for f in conn.execute(
            "SELECT id, round, node_id, reason, status, created_at FROM flags WHERE job_id = ?"
            " ORDER BY created_at DESC, id LIMIT 200",
            (job_id,),
        )
    ]
    return out


def assignment_counts(conn: sqlite3.Connection) -> dict[str, dict[str, int]]:
    """Per node: assignments by state (live|done|expired|abandoned|cancelled)."""
    out: dict[str, dict[str, int]] = {}
    for r in conn.execute(
        "SELECT node_id, state, COUNT(*) AS n FROM assignments GROUP BY node_id, state"
    ):
        out.setdefault(r["node_id"], {})[r["state"]] = int(r["n"])
    return out


def job_names(conn: sqlite3.Connection) -> dict[str, str]:
    """Job id -> name, for labelling flags (the caller already filtered what is visible)."""
    return {r["id"]: r["name"] for r in conn.execute("SELECT id, name FROM jobs")}


def flag_context(conn: sqlite3.Connection, flag: dict[str, Any]) -> dict[str, Any]:
    """What a flag's page shows beside the flag row: the job's name, the round's review
    evidence (thresholds), the flagged update and its shard's replica outcome."""
    job = conn.execute("SELECT name, spec_toml FROM jobs WHERE id = ?", (flag["job_id"],)).fetchone()
    rnd = conn.execute(
        "SELECT evidence FROM rounds WHERE job_id = ? AND round = ?",
        (flag["job_id"], flag["round"]),
    ).fetchone()
    upd = conn.execute(
        "SELECT u.shard_id, u.sample_count, u.loss, u.train_s, u.status, s.replica_group"
        " FROM updates u LEFT JOIN shards s ON s.id = u.shard_id WHERE u.id = ?",
        (flag["update_id"],),
    ).fetchone()
    return {
        "job_name": job["name"] if job is not None else flag["job_id"],
        "round_evidence": _loads(rnd["evidence"]) if rnd is not None else {},
        "update": dict(upd) if upd is not None else {},
        "thresholds": _thresholds(job["spec_toml"]) if job is not None else {},
    }


def _thresholds(spec_toml: str) -> dict[str, Any]:
    """The job's [verification] settings, as its spec says (defaults from the spec parser only)."""
    from dataclasses import asdict

    from gpuflex.protocol.errors import ProtocolError
    from gpuflex.protocol.jobspec import parse_job_spec

    try:
        return asdict(parse_job_spec(spec_toml).verification)
    except ProtocolError:
        return {}


def node_flags(conn: sqlite3.Connection, node_id: str, limit: int = 50) -> list[dict[str, Any]]:
    return [
        dict(r)
        for r in conn.execute(
            "SELECT f.id, f.job_id, f.round, f.reason, f.status, f.created_at,"
            " COALESCE(j.name, f.job_id) AS job_name FROM flags f LEFT JOIN jobs j ON j.id = f.job_id"
            " WHERE f.node_id = ? ORDER BY f.created_at DESC LIMIT ?",
            (node_id, limit),
        )
    ]


def node_updates(conn: sqlite3.Connection, node_id: str, limit: int = 20) -> list[dict[str, Any]]:
    return [
        dict(r)
        for r in conn.execute(
            "SELECT u.id, u.job_id, u.round, u.sample_count, u.loss, u.status, u.received_at,"
            " COALESCE(j.name, u.job_id) AS job_name FROM updates u LEFT JOIN jobs j ON j.id = u.job_id"
            " WHERE u.node_id = ? ORDER BY u.received_at DESC LIMIT ?",
            (node_id, limit),
        )
    ]
