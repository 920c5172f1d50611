"""What a rollback would undo, as the job status shows it (hub/policy/rollback.py): for each node
that is suspended or banned now, the rounds (not rolled back) where its unverified updates were
aggregated (verified only by a node stopped now, or by a replay of one segment, counts as
unverified), and the round whose kept model a rollback before it restores."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

from ...policy.rollback import Aggregated, Verifier, fallback_round, unverified_by_node
from ...storage.store_rollback import stopped_nodes


def unverified_work(conn: sqlite3.Connection, job_id: str, history: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``history``: the job's closed rounds (rounds.history). One entry a stopped node, in the
    order of its first such round: node_id, state (suspended|banned), rounds, rollback_to (the
    round whose model ``job rollback --before-node`` restores), kept (is that model still kept)
    and fallback_to (when it is not: the round whose model ``--or-oldest-kept`` restores, None when
    no kept model undoes any of those rounds)."""
    stopped = stopped_nodes(conn)
    if not stopped:
        return []
    aggregated = [Aggregated(int(h["round"]), u["update_id"], u["node_id"], bool(u["verified"]),
                             Verifier.of_doc(u.get("verified_by")))
                  for h in history for u in h["updates"] if u["status"] == "included"]
    rolled_back = {int(h["round"]) for h in history if h.get("rolled_back")}
    rounds = unverified_by_node(aggregated, rolled_back=rolled_back, stopped=set(stopped))
    kept = {int(r[0]) for r in conn.execute("SELECT version FROM models WHERE job_id = ?", (job_id,))}
    closed = 1 + max((int(h["round"]) for h in history), default=-1)
    out = [{"node_id": node, "state": stopped[node], "rounds": rs, "rollback_to": rs[0], "kept": rs[0] in kept,
            "fallback_to": None if rs[0] in kept else fallback_round(rs, kept=kept, rolled_back=rolled_back,
                                                                     closed=closed)}
           for node, rs in rounds.items() if node in stopped]
    return sorted(out, key=lambda w: (w["rollback_to"], w["node_id"]))
