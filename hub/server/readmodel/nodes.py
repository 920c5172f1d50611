"""Nodes as they are shown: GET /v1/nodes's overview (device, benchmark, throughput, reputation,
compute class, activity), and what the console adds (assignments by state, a node's history)."""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Any

from aiohttp import web
from gpuflex.protocol.compute import class_key
from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.messages import ComputeClass, nested_from_dict, nested_to_dict

from ...storage.tokens import Principal
from ..appkeys import CONFIG, LEDGER, STORE

REPUTATION_FIELDS = (
    "consecutive_agreements",
    "agreements_total",
    "flags_total",
    "confirmed_flags",
    "dismissed_flags",
)


def _compute_view(text: str) -> tuple[dict[str, Any], dict[str, str]]:
    """A stored compute class as shown (its fields) and its class key per precision it trains."""
    try:
        cc = nested_from_dict(ComputeClass, json.loads(text))
    except (ValueError, ProtocolError):
        return {}, {}
    return nested_to_dict(cc), {p: class_key(cc, p) for p in cc.precisions}


async def nodes_overview(app: web.Application, who: Principal) -> list[dict[str, Any]]:
    """Every registered node: device, benchmark, throughput EMA, reputation, activity (auditor/admin).
    A node's track record is its `reputation` (the Reputation's fields, the columns' names)."""
    who.require("auditor")
    rows = await app[STORE].query(
        lambda c: c.execute(
            "SELECT n.*,"
            " (SELECT COUNT(*) FROM assignments a WHERE a.node_id = n.id AND a.state IN ('expired', 'abandoned'))"
            " AS assignments_failed"
            " FROM nodes n ORDER BY n.registered_at"
        ).fetchall()
    )
    sched = app[LEDGER].scheduler
    now = time.time()
    out = []
    for r in rows:
        d = {
            k: r[k]
            for k in (
                "id",
                "software_version",
                "bench_sps",
                "ema_sps",
                "registered_at",
                "last_seen",
                "updates_accepted",
                "assignments_failed",
            )
        }
        d["device"] = json.loads(r["device"])
        d["benchmark"] = json.loads(r["benchmark"])
        d["compute_class"], d["class_keys"] = _compute_view(r["compute_class"])
        rep = {k: r[k] for k in REPUTATION_FIELDS} | {"banned": bool(r["banned"])}
        live = sched.nodes.get(r["id"])
        if live is not None:  # memory is at least as new as the row
            d.update(
                ema_sps=live.ema_sps,
                last_seen=max(d["last_seen"], live.last_seen),
                updates_accepted=live.updates_accepted,
                assignments_live=len(live.live),
            )
            rep = {k: getattr(live.reputation, k) for k in (*REPUTATION_FIELDS, "banned")}
        d["reputation"] = rep
        d["banned"] = rep["banned"]
        # Sybil defences: where it last registered from and was last seen, its operator, its probation
        d["address_block"], d["last_block"] = r["address_block"], r["last_block"]
        d["operator"], d["banned_at"] = r["operator"], r["banned_at"]
        if live is not None:
            d["last_block"] = live.last_block or d["last_block"]
            d["probation"] = live.reputation.probation
        d["online"] = now - d["last_seen"] <= app[CONFIG].online_window_s
        # a proven mismatch suspends it until an auditor's verdict (hub/policy/suspension.py)
        d["suspension"] = live.suspended if live is not None else None
        d["suspended"] = d["suspension"] is not None
        out.append(d)
    return out


def assignment_counts(conn: sqlite3.Connection) -> dict[str, dict[str, int]]:
    """Per node: assignments by state (live|done|expired|abandoned|cancelled)."""
    out: dict[str, dict[str, int]] = {}
    for r in conn.execute(
        "SELECT node_id, state, COUNT(*) AS n FROM assignments GROUP BY node_id, state"
    ):
        out.setdefault(r["node_id"], {})[r["state"]] = int(r["n"])
    return out


async def nodes_with_assignments(app: web.Application, who: Principal) -> list[dict[str, Any]]:
    """The console's nodes: GET /v1/nodes's overview (auditor/admin; live scheduler state) plus each
    node's assignments by state."""
    overview = await nodes_overview(app, who)
    counts = await app[STORE].query(assignment_counts)
    for n in overview:
        n["assignments"] = counts.get(n["id"], {})
    return overview


def node_flags(conn: sqlite3.Connection, node_id: str, limit: int = 50) -> list[dict[str, Any]]:
    """A node's flags, newest first, with their jobs' names."""
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
    """A node's updates, newest first, with their jobs' names."""
    return [
        dict(r)
        for r in conn.execute(
            "SELECT u.id, u.job_id, u.round, u.sample_count, u.loss, u.status, u.received_at,"
            " COALESCE(j.name, u.job_id) AS job_name FROM updates u LEFT JOIN jobs j ON j.id = u.job_id"
            " WHERE u.node_id = ? ORDER BY u.received_at DESC LIMIT ?",
            (node_id, limit),
        )
    ]


async def node_history(app: web.Application, node_id: str) -> dict[str, Any]:
    """A node's other flags and recent updates (auditor pages only: spans every owner's jobs)."""

    def q(conn: sqlite3.Connection) -> dict[str, Any]:
        return {
            "node_flags": node_flags(conn, node_id),
            "node_updates": node_updates(conn, node_id),
        }

    return await app[STORE].query(q)
