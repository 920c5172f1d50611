"""A job's rounds as they are shown: each closed round's history entry (metrics, traffic, evidence,
updates, flags, how it was spread), the latest metrics, and the shard map of one round."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from typing import Any

from ...policy.rollback import verification_of, verifiers_of


def history(conn: sqlite3.Connection, job: sqlite3.Row, chunk_samples: int) -> list[dict[str, Any]]:
    """The job's closed rounds, oldest first (round_entry each)."""
    rounds = conn.execute(
        "SELECT * FROM rounds WHERE job_id = ? ORDER BY round", (job["id"],)
    ).fetchall()
    return [round_entry(conn, job, r, chunk_samples) for r in rounds if r["closed_at"] is not None]


def round_entry(
    conn: sqlite3.Connection, job: sqlite3.Row, r: sqlite3.Row, chunk_samples: int
) -> dict[str, Any]:
    """One closed round of the job status's history: its metrics, traffic, evidence, updates,
    flags, replication overhead and how it was spread. ``chunk_samples``: the samples of the
    job's chunks, 0 for a node-local job (never replicated: each silo is on one node, so its
    rounds train the silos that were online, not every chunk)."""
    ups = conn.execute(
        "SELECT u.id, u.node_id, u.status, u.sample_count, u.loss, u.train_s, u.size, s.id AS shard_id, s.samples,"
        " s.replica_group, u.received_at - a.issued_at AS elapsed_s,"
        " (SELECT COUNT(*) FROM shard_chunks sc WHERE sc.shard_id = s.id) AS nchunks"
        " FROM updates u JOIN shards s ON s.id = u.shard_id JOIN assignments a ON a.id = u.assignment_id"
        " WHERE u.job_id = ? AND u.round = ?"
        " ORDER BY u.received_at, u.id",
        (job["id"], r["round"]),
    ).fetchall()
    flags = conn.execute(
        "SELECT id, node_id, reason, status FROM flags WHERE job_id = ? AND round = ?",
        (job["id"], r["round"]),
    ).fetchall()
    trained = sum(u["samples"] for u in ups)
    metrics = json.loads(r["metrics"] or "{}")
    ev = json.loads(r["evidence"] or "{}")
    # each aggregated update: verified (a replica agreed, the referee reproduced it) or not
    included = [u["id"] for u in ups if u["status"] == "included"]
    verified = verification_of(ev, included)
    # who: the nodes whose replicas agreed, the referee's replay (whole or one segment)
    verifiers = verifiers_of(ev, included)
    return {
        "round": r["round"],
        "loss": r["loss"],
        "accuracy": r["accuracy"],
        "train_loss": r["train_loss"],
        "model_hash": r["new_model_hash"],
        "closed_at": r["closed_at"],
        "opened_at": r["opened_at"],
        # a rollback undid what this round made; this round opened on that round's kept model
        "rolled_back": r["rolled_back_at"] is not None,
        "restored_from": r["restored_from"],
        "metrics": {k: v for k, v in metrics.items() if k != "bytes_down"},
        "transfer": _transfer(ups, job["model_size"], metrics.get("bytes_down")),
        # aggregated without a replica's confirmation: update id -> why (verification.unverified)
        "unverified": ev.get("unverified", {}),
        # replica groups: shard id -> same_class | cross_class (which tolerance judged it)
        "replica_comparison": ev.get("replica_comparison", {}),
        # secure_aggregation: the protocol's round (roster, survivors, summed, or why aborted);
        # probe: each update's effect on the owner's validation loss (node-local); late: the
        # round before's stragglers (late = "next"); privacy: the round's clip and noise (dp)
        **{k: ev[k] for k in ("secure_aggregation", "probe", "late", "privacy") if ev.get(k)},
        "updates": [
            {
                "update_id": u["id"],
                "node_id": u["node_id"],
                "chunks": u["nchunks"],
                "samples": u["samples"],
                "loss": u["loss"],
                "status": u["status"],
                "verified": verified.get(u["id"]),
                "verified_by": v.doc() if (v := verifiers.get(u["id"])) is not None else None,
                "replica_group": u["replica_group"],
            }
            for u in ups
        ],
        "flags": [
            {
                "flag_id": f["id"],
                "node_id": f["node_id"],
                "reason": f["reason"],
                "status": f["status"],
            }
            for f in flags
        ],
        "replication_overhead": (trained - chunk_samples) / chunk_samples if chunk_samples else 0.0,
        **_parallelism(ups, r["closed_at"] - r["opened_at"]),
    }


def _transfer(
    ups: Sequence[sqlite3.Row], model_size: int, bytes_down: float | None
) -> dict[str, Any]:
    """A round's traffic: the updates' bytes up (every update received, whatever became of it),
    the models' and chunks' bytes down (None when the hub did not count them: rounds closed before
    it did), and the compression ratio: what the updates would weigh as full fp32 models over what
    they weighed (1.0 for fp32 updates, about 4 for int8: the job's [communication] update)."""
    up = sum(int(u["size"]) for u in ups)
    return {
        "updates": len(ups),
        "bytes_up": up,
        "bytes_down": None if bytes_down is None else int(bytes_down),
        "compression_ratio": (len(ups) * model_size / up) if up else None,
    }


def _parallelism(ups: list[sqlite3.Row], wall_s: float) -> dict[str, Any]:
    """How a round was spread: its shards (size, nodes, training time), each node's share of the
    samples trained, and the parallel efficiency, the round's training time summed over nodes
    against its wall time (1.0 = every node trained the whole round)."""
    shards: dict[str, dict[str, Any]] = {}
    per_node: dict[str, int] = {}
    for u in ups:
        sh = shards.setdefault(
            u["shard_id"],
            {
                "shard_id": u["shard_id"],
                "samples": u["samples"],
                "chunks": u["nchunks"],
                "replicated": False,
                "nodes": [],
                "train_s": 0.0,
                "elapsed_s": 0.0,
            },
        )
        sh["nodes"].append(u["node_id"])
        sh["replicated"] = len(sh["nodes"]) >= 2  # trained twice or more, not only planned so
        sh["train_s"] = max(sh["train_s"], float(u["train_s"]))  # what the node reports
        sh["elapsed_s"] = max(
            sh["elapsed_s"], float(u["elapsed_s"])
        )  # issue to upload, as the hub saw it
        per_node[u["node_id"]] = per_node.get(u["node_id"], 0) + int(u["samples"])
    trained = sum(per_node.values())
    work_s = sum(float(u["train_s"]) for u in ups)
    nodes = len(per_node)
    wall = max(float(wall_s), 1e-9)
    times = [sh["train_s"] for sh in shards.values() if sh["train_s"] > 0]
    return {
        "shards": sorted(shards.values(), key=lambda sh: (-sh["samples"], sh["shard_id"])),
        "node_shares": {n: k / trained for n, k in sorted(per_node.items())} if trained else {},
        "parallel": {
            "nodes": nodes,
            "shards": len(shards),
            "wall_s": float(wall_s),
            "train_s_sum": work_s,
            "speedup": work_s / wall,
            "efficiency": work_s / wall / nodes if nodes else 0.0,
            "balance": max(times) / (sum(times) / len(times)) if times else None,
        },
    }


def job_parallelism(history: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's summary of how it was spread: mean shards, nodes, speedup and efficiency per round."""
    ps = [h["parallel"] for h in history if h["parallel"]["nodes"]]
    if not ps:
        return {"rounds": 0, "shards": None, "nodes": None, "speedup": None, "efficiency": None}
    return {
        "rounds": len(ps),
        "shards": sum(p["shards"] for p in ps) / len(ps),
        "nodes": sum(p["nodes"] for p in ps) / len(ps),
        "speedup": sum(p["speedup"] for p in ps) / len(ps),
        "efficiency": sum(p["efficiency"] for p in ps) / len(ps),
    }


def latest_metrics(conn: sqlite3.Connection, job_id: str) -> dict[str, Any]:
    """The last closed round's loss, accuracy and train loss (None each before one closes)."""
    row = conn.execute(
        "SELECT round, loss, accuracy, train_loss FROM rounds WHERE job_id = ? AND closed_at IS NOT NULL"
        " ORDER BY round DESC LIMIT 1",
        (job_id,),
    ).fetchone()
    if row is None:
        return {"loss": None, "accuracy": None, "train_loss": None}
    return {"loss": row["loss"], "accuracy": row["accuracy"], "train_loss": row["train_loss"]}


def closed_rounds(conn: sqlite3.Connection, job_id: str) -> int:
    return int(
        conn.execute(
            "SELECT COUNT(*) FROM rounds WHERE job_id = ? AND closed_at IS NOT NULL", (job_id,)
        ).fetchone()[0]
    )


def shard_map(
    conn: sqlite3.Connection,
    job_id: str,
    state: str,
    current_round: int,
    shard_round: int | None = None,
) -> dict[str, Any]:
    """The shards of one round, each with its chunks, its assignments and ``copies`` (those live
    or done), and the rounds carved. The round is ``shard_round`` when given, else the open round
    while the job runs, else the last round carved."""
    last = conn.execute("SELECT MAX(round) FROM shards WHERE job_id = ?", (job_id,)).fetchone()[0]
    if shard_round is None:
        shard_round = last
        if last is not None and state in ("queued", "running"):
            shard_round = current_round
    shards = [] if shard_round is None else _shards(conn, job_id, shard_round)
    carved = [
        r[0]
        for r in conn.execute(
            "SELECT DISTINCT round FROM shards WHERE job_id = ? ORDER BY round", (job_id,)
        )
    ]
    return {"shard_round": shard_round, "rounds_carved": carved, "shards": shards}


def _shards(conn: sqlite3.Connection, job_id: str, round_: int) -> list[dict[str, Any]]:
    update_status = {
        row["assignment_id"]: row["status"]
        for row in conn.execute(
            "SELECT assignment_id, status FROM updates WHERE job_id = ? AND round = ?",
            (job_id, round_),
        )
    }
    rows = conn.execute(
        "SELECT * FROM shards WHERE job_id = ? AND round = ? ORDER BY seq", (job_id, round_)
    )
    return [_shard(conn, s, update_status) for s in rows.fetchall()]


def _shard(
    conn: sqlite3.Connection, s: sqlite3.Row, update_status: dict[str, str]
) -> dict[str, Any]:
    """One shard of the map: its chunks, and its assignments with their update's status."""
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
            "update_status": update_status.get(a["id"]),
        }
        for a in conn.execute(
            "SELECT id, node_id, state, deadline FROM assignments WHERE shard_id = ?"
            " ORDER BY issued_at, id",
            (s["id"],),
        )
    ]
    return {
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
