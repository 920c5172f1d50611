"""Read-only queries the console needs and the hub does not already offer.

Every function takes the hub's ``sqlite3.Connection`` (run through
``Database.read`` so it executes on the hub's database thread) and only SELECTs.
The console never writes the hub's tables: verdicts go through the hub's own
domain function. Column meanings are the hub's (hub/db.py).

Results are plain dicts/lists so templates stay dumb and tests can check them.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

__all__ = [
    "flag_detail",
    "flags_list",
    "job_extras",
    "jobs_list",
    "node_detail",
    "node_flags",
    "node_updates",
    "nodes_list",
    "token_alive",
    "visible_owner",
]

FAILED_ASSIGNMENT_STATES = ("expired", "abandoned")


def visible_owner(role: str, name: str) -> str | None:
    """The owner filter for a principal: owners see their own jobs, others all."""
    return name if role == "owner" else None


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
    row = conn.execute(
        "SELECT role, name, revoked_at FROM tokens WHERE id = ?", (tid,)
    ).fetchone()
    if row is None or row["revoked_at"] is not None:
        return None
    return str(row["role"]), str(row["name"])


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


def jobs_list(conn: sqlite3.Connection, owner: str | None, limit: int = 500) -> list[dict[str, Any]]:
    """Jobs newest first; only ``owner``'s when given."""
    if owner is None:
        rows = conn.execute(
            "SELECT * FROM jobs ORDER BY created_at DESC LIMIT ?", (limit,)
        ).fetchall()
    else:
        rows = conn.execute(
            "SELECT * FROM jobs WHERE owner = ? ORDER BY created_at DESC LIMIT ?", (owner, limit)
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


def job_extras(conn: sqlite3.Connection, job_id: str, state: str, current_round: int) -> dict[str, Any]:
    """What the API's job status lacks: latest metrics, chunk count, shard map, flags.

    The caller has already checked visibility (the hub's ``job_row``). The shard
    map is of the open round while the job runs, else of the last round carved.
    """
    out: dict[str, Any] = dict(_latest_metrics(conn, job_id))
    out["chunks"] = conn.execute("SELECT COUNT(*) FROM chunks WHERE job_id = ?", (job_id,)).fetchone()[0]
    out["closed"] = _closed_rounds(conn, job_id)
    st = conn.execute(
        "SELECT COUNT(*) AS shards, COALESCE(SUM(CASE WHEN replica_group != '' THEN 1 ELSE 0 END), 0)"
        " AS replicated FROM shards WHERE job_id = ? AND state != 'dropped'",
        (job_id,),
    ).fetchone()
    out["shard_counts"] = {"shards": st["shards"], "replicated": st["replicated"]}
    last = conn.execute("SELECT MAX(round) FROM shards WHERE job_id = ?", (job_id,)).fetchone()[0]
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
            "SELECT * FROM shards WHERE job_id = ? AND round = ? ORDER BY seq", (job_id, shard_round)
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
                    "state": s["state"],
                    "chunks": chunks,
                    "assignments": assignments,
                }
            )
    out["shard_round"] = shard_round
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


def _node_row(conn: sqlite3.Connection, r: sqlite3.Row, online_window_s: float, now: float) -> dict[str, Any]:
    device = _loads(r["device"])
    bench = _loads(r["benchmark"])
    counts = {
        row["state"]: row["n"]
        for row in conn.execute(
            "SELECT state, COUNT(*) AS n FROM assignments WHERE node_id = ? GROUP BY state",
            (r["id"],),
        )
    }
    quarantined = conn.execute(
        "SELECT COUNT(*) FROM updates WHERE node_id = ? AND status = 'quarantined'", (r["id"],)
    ).fetchone()[0]
    banned = bool(r["banned"])
    confirmed = int(r["flags_confirmed"])
    trusted_run = int(r["consecutive_valid"])
    if banned:
        label, cls = "banned", "banned"
    elif confirmed:
        label, cls = f"suspect ({confirmed} confirmed)", "bad"
    elif trusted_run >= 10:
        label, cls = f"trusted (run {trusted_run})", "ok"
    else:
        label, cls = f"building (run {trusted_run})", "open"
    return {
        "id": r["id"],
        "software_version": r["software_version"],
        "device_kind": device.get("kind", "?"),
        "device_name": device.get("name", "?"),
        "memory": device.get("memory_bytes"),
        "threads": device.get("threads"),
        "bench_sps": r["bench_sps"],
        "tflops": bench.get("matmul_tflops_fp32"),
        "mem_gbs": bench.get("mem_bandwidth_gbs"),
        "ema_sps": r["ema_sps"],
        "registered_at": r["registered_at"],
        "last_seen": r["last_seen"],
        "online": now - float(r["last_seen"]) <= online_window_s,
        "agreed": r["agreed"],
        "disagreed": r["disagreed"],
        "consecutive_valid": trusted_run,
        "flags_confirmed": confirmed,
        "flags_dismissed": r["flags_dismissed"],
        "updates_accepted": r["updates_accepted"],
        "banned": banned,
        "rep_label": label,
        "rep_class": cls,
        "done": counts.get("done", 0),
        "failed": sum(counts.get(s, 0) for s in FAILED_ASSIGNMENT_STATES),
        "quarantined": quarantined,
        "live": counts.get("live", 0),
    }


def nodes_list(conn: sqlite3.Connection, *, online_window_s: float, now: float) -> list[dict[str, Any]]:
    rows = conn.execute("SELECT * FROM nodes ORDER BY last_seen DESC LIMIT 1000").fetchall()
    return [_node_row(conn, r, online_window_s, now) for r in rows]


def node_detail(
    conn: sqlite3.Connection, node_id: str, *, online_window_s: float, now: float
) -> dict[str, Any] | None:
    r = conn.execute("SELECT * FROM nodes WHERE id = ?", (node_id,)).fetchone()
    return None if r is None else _node_row(conn, r, online_window_s, now)


def flags_list(conn: sqlite3.Connection, status: str, limit: int = 500) -> list[dict[str, Any]]:
    """Flags newest first; ``status`` is open|confirmed|dismissed|all."""
    sql = (
        "SELECT f.id, f.job_id, f.round, f.node_id, f.reason, f.status, f.created_at,"
        " COALESCE(j.name, f.job_id) AS job_name FROM flags f LEFT JOIN jobs j ON j.id = f.job_id"
    )
    if status == "all":
        rows = conn.execute(sql + " ORDER BY f.created_at DESC, f.id LIMIT ?", (limit,))
    else:
        rows = conn.execute(
            sql + " WHERE f.status = ? ORDER BY f.created_at DESC, f.id LIMIT ?", (status, limit)
        )
    return [dict(r) for r in rows]


def flag_detail(conn: sqlite3.Connection, flag_id: str) -> dict[str, Any] | None:
    r = conn.execute(
        "SELECT f.*, COALESCE(j.name, f.job_id) AS job_name, j.owner AS job_owner FROM flags f"
        " LEFT JOIN jobs j ON j.id = f.job_id WHERE f.id = ?",
        (flag_id,),
    ).fetchone()
    if r is None:
        return None
    flag = dict(r)
    flag["evidence"] = _loads(r["evidence"])
    # The round's review evidence (thresholds, centre) and the shard's replica outcome.
    rnd = conn.execute(
        "SELECT evidence FROM rounds WHERE job_id = ? AND round = ?", (r["job_id"], r["round"])
    ).fetchone()
    flag["round_evidence"] = _loads(rnd["evidence"]) if rnd is not None else {}
    upd = conn.execute(
        "SELECT u.shard_id, u.sample_count, u.loss, u.train_s, s.outcome, s.replica_group"
        " FROM updates u LEFT JOIN shards s ON s.id = u.shard_id WHERE u.id = ?",
        (r["update_id"],),
    ).fetchone()
    flag["replica_outcome"] = _loads(upd["outcome"]) if upd is not None else {}
    flag["update"] = (
        {k: upd[k] for k in ("shard_id", "sample_count", "loss", "train_s", "replica_group")}
        if upd is not None
        else {}
    )
    return flag


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
