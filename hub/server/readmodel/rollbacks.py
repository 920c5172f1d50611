"""What a rollback would undo, as the job status shows it (hub/policy/rollback.py): for each node
that is suspended or banned now, the rounds (not rolled back) where its unverified updates were
aggregated, and the round whose kept model a rollback before it restores."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any


def unverified_work(conn: sqlite3.Connection, job_id: str, history: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``history``: the job's closed rounds (rounds.history). One entry a stopped node, in the
    order of its first such round: node_id, state (suspended|banned), rounds, rollback_to (the
    round whose model ``job rollback --before-node`` restores) and kept (is that model still kept)."""
    rounds: dict[str, set[int]] = {}
    for h in history:
        if h.get("rolled_back"):
            continue
        for u in h["updates"]:
            if u.get("verified") is False:
                rounds.setdefault(u["node_id"], set()).add(int(h["round"]))
    if not rounds:
        return []
    stopped = _stopped(conn, list(rounds))
    kept = {int(r[0]) for r in conn.execute("SELECT version FROM models WHERE job_id = ?", (job_id,))}
    out = [{"node_id": node, "state": stopped[node], "rounds": sorted(rs), "rollback_to": min(rs),
            "kept": min(rs) in kept} for node, rs in rounds.items() if node in stopped]
    return sorted(out, key=lambda w: (w["rollback_to"], w["node_id"]))


def _stopped(conn: sqlite3.Connection, nodes: list[str]) -> dict[str, str]:
    """node id -> banned | suspended (an open flag that suspends it), for those of ``nodes`` stopped."""
    marks = ",".join("?" * len(nodes))
    out = {r[0]: "suspended" for r in conn.execute(
        f"SELECT DISTINCT node_id FROM flags WHERE status = 'open' AND suspends = 1 AND node_id IN ({marks})",  # noqa: S608
        nodes)}
    out.update({r[0]: "banned" for r in conn.execute(
        f"SELECT id FROM nodes WHERE banned = 1 AND id IN ({marks})", nodes)})  # noqa: S608
    return out
