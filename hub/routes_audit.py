"""Auditor routes: flags with their evidence, verdicts, the audit log, the node list."""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Any

from aiohttp import web

from .appkeys import AUDIT, CONFIG, DB, SCHEDULER
from .auditlog import verdict_body
from .errors import BadRequest, Conflict, NotFound
from .scheduler import REPUTATION_SQL
from .tokens import Principal
from .verification import record_verdict
from .wire import json_response, principal, read_body

routes = web.RouteTableDef()
FLAG_STATUSES = ("open", "confirmed", "dismissed")


def _flag_dict(r: sqlite3.Row) -> dict[str, Any]:
    d = dict(r)
    d["evidence"] = json.loads(d["evidence"] or "{}")
    return d


def _flag_scope(who: Principal) -> tuple[str, tuple[Any, ...]]:
    if who.role in ("admin", "auditor"):
        return "1 = 1", ()
    return "f.job_id IN (SELECT id FROM jobs WHERE owner = ?)", (who.name,)


async def list_flags_for(app: web.Application, who: Principal, status: str | None = None,
                         job: str | None = None) -> list[dict[str, Any]]:
    """Flags visible to `who` (auditors/admins: all; owners: their jobs'), oldest first."""
    if status is not None and status not in FLAG_STATUSES:
        raise BadRequest(f"status must be one of {', '.join(FLAG_STATUSES)}", code="bad_status")
    if job is not None and len(job) > 64:
        raise BadRequest("job id is too long", code="bad_job")
    where, args = _flag_scope(who)
    sql = f"SELECT f.* FROM flags f WHERE {where}"  # noqa: S608 - fixed fragments only
    params: list[Any] = list(args)
    if status:
        sql += " AND f.status = ?"
        params.append(status)
    if job:
        sql += " AND f.job_id = ?"
        params.append(job)
    sql += " ORDER BY f.created_at, f.id LIMIT 10000"
    rows = await app[DB].read(lambda c: c.execute(sql, params).fetchall())
    return [_flag_dict(r) for r in rows]


MAX_CANDIDATES = 10


def resolve_flag_id(conn: sqlite3.Connection, who: Principal, ref: str) -> str:
    """The flag id that `ref` names among the flags `who` may see: the id itself or, as git
    does with commits, any unique prefix of it (with or without the leading "f-").

    NotFound when nothing matches; Conflict ("ambiguous_flag") listing the candidates when
    more than one does. Ids are never cut short in what the hub or the CLI prints, so a
    prefix is always the user's choice."""
    where, args = _flag_scope(who)
    if not ref or len(ref) > 64 or not ref.isprintable():
        raise NotFound(f"no flag {ref[:64]!r} visible to you", code="unknown_flag")
    exact = conn.execute(f"SELECT f.id FROM flags f WHERE f.id = ? AND {where}",  # noqa: S608
                         (ref, *args)).fetchone()
    if exact is not None:
        return str(exact["id"])
    escaped = ref.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    rows = conn.execute(
        f"SELECT f.id FROM flags f WHERE (f.id LIKE ? ESCAPE '\\' OR f.id LIKE ? ESCAPE '\\') AND {where}"  # noqa: S608
        " ORDER BY f.id LIMIT ?", (escaped + "%", "f-" + escaped + "%", *args, MAX_CANDIDATES + 1)).fetchall()
    ids = [str(r["id"]) for r in rows]
    if not ids:
        raise NotFound(f"no flag {ref} visible to you", code="unknown_flag")
    if len(ids) > 1:
        more = " ..." if len(ids) > MAX_CANDIDATES else ""
        raise Conflict(f"flag prefix {ref} is ambiguous: it matches {', '.join(ids[:MAX_CANDIDATES])}{more};"
                       " give more characters", code="ambiguous_flag")
    return ids[0]


async def flag_for(app: web.Application, who: Principal, flag_id: str) -> dict[str, Any]:
    """One flag visible to `who`, by id or unique prefix (resolve_flag_id)."""

    def read(c: sqlite3.Connection) -> sqlite3.Row:
        row: sqlite3.Row = c.execute("SELECT * FROM flags WHERE id = ?",
                                     (resolve_flag_id(c, who, flag_id),)).fetchone()
        return row

    return _flag_dict(await app[DB].read(read))


@routes.get("/v1/flags")
async def list_flags(request: web.Request) -> web.Response:
    who = await principal(request)
    flags = await list_flags_for(request.app, who, request.query.get("status"), request.query.get("job"))
    return json_response({"flags": flags})


@routes.get("/v1/flags/{flag_id}")
async def get_flag(request: web.Request) -> web.Response:
    """The flag with what the console's flag page shows beside it: `job_name`, `round_evidence`
    (the round's thresholds), `update`, `scores` (each score against its threshold) and
    `layer_evidence` (per-layer norms and cosines against the round's centre; None for
    rounds too large to profile)."""
    from .web import bridge, evidence  # the console's own computations (web imports this module)

    who = await principal(request)

    flag = await bridge.flag(request.app, who, request.match_info["flag_id"])
    flag["scores"] = evidence.threshold_scores(flag)
    flag["layer_evidence"] = await bridge.layer_evidence(request.app, flag)
    return json_response(flag)


async def give_verdict(app: web.Application, who: Principal, flag_id: str, verdict: str, note: str) -> dict[str, Any]:
    """Confirm or dismiss a flag: the one path for the API and the console.

    Moves the node's reputation (verification.record_verdict; 3 confirmed flags ban it)
    and appends a `verdict` entry to the audit log. Returns {"flag": ..., "node_banned": bool,
    "banned_by_this_verdict": bool} (a node banned before this verdict is not "now banned").
    """
    who.require("auditor")
    if verdict not in ("confirm", "dismiss"):
        raise BadRequest('verdict must be "confirm" or "dismiss"', code="bad_verdict")
    if not isinstance(note, str) or len(note) > 2000:
        raise BadRequest("note must be a string of at most 2000 characters", code="bad_verdict")
    status = "confirmed" if verdict == "confirm" else "dismissed"
    sched = app[SCHEDULER]
    now = time.time()

    def write(conn: sqlite3.Connection) -> dict[str, Any]:
        nonlocal flag_id
        flag_id = resolve_flag_id(conn, who, flag_id)
        row = conn.execute("SELECT * FROM flags WHERE id = ?", (flag_id,)).fetchone()
        if row["status"] != "open":
            raise Conflict(f"flag {flag_id} already has a verdict ({row['status']})", code="already_decided")
        conn.execute("UPDATE flags SET status = ?, verdict_note = ?, auditor = ?, decided_at = ? WHERE id = ?",
                     (status, note, who.name, now, flag_id))
        node = sched.nodes.get(row["node_id"])
        banned = was_banned = False
        if node is not None:
            was_banned = node.banned
            node.set_reputation(record_verdict(node.reputation, verdict))
            banned = node.banned
            conn.execute(REPUTATION_SQL, node.reputation_row())
        upd = conn.execute("SELECT sha FROM updates WHERE id = ?", (row["update_id"],)).fetchone()
        flag = _flag_dict(conn.execute("SELECT * FROM flags WHERE id = ?", (flag_id,)).fetchone())
        app[AUDIT].append("verdict", verdict_body(
            flag_id=flag_id, node_id=row["node_id"], update=upd["sha"] if upd else row["update_id"],
            reason=row["reason"], verdict=verdict, auditor=who.name, note=note, job_id=row["job_id"],
            banned=banned))
        return {"flag": flag, "node_banned": banned, "banned_by_this_verdict": banned and not was_banned}

    return await app[DB].write(write)


@routes.post("/v1/flags/{flag_id}/verdict")
async def verdict(request: web.Request) -> web.Response:
    who = await principal(request)
    who.require("auditor")
    body = await read_body(request, 64 << 10)
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("body must be JSON {\"verdict\": \"confirm\"|\"dismiss\", \"note\": \"...\"}",
                         code="bad_json") from None
    if not isinstance(doc, dict):
        raise BadRequest("body must be a JSON object", code="bad_json")
    out = await give_verdict(request.app, who, request.match_info["flag_id"], doc.get("verdict"),
                             doc.get("note", ""))
    return json_response(out)


@routes.get("/v1/audit-log")
async def audit_log(request: web.Request) -> web.StreamResponse:
    who = await principal(request)
    who.require("auditor")
    path = request.app[CONFIG].audit_log_path
    head = {"X-GPUFlex-Audit-Head": request.app[AUDIT].head}
    if not path.is_file():
        return web.Response(body=b"", content_type="application/jsonl", headers=head)
    return web.FileResponse(path, headers={"Content-Type": "application/jsonl", **head})


async def nodes_overview(app: web.Application, who: Principal) -> list[dict[str, Any]]:
    """Every registered node: device, benchmark, throughput EMA, reputation, activity (auditor/admin)."""
    who.require("auditor")
    rows = await app[DB].read(lambda c: c.execute(
        "SELECT n.id, n.software_version, n.device, n.benchmark, n.bench_sps, n.ema_sps, n.registered_at,"
        " n.last_seen, n.agreed, n.disagreed, n.consecutive_valid, n.flags_confirmed, n.flags_dismissed,"
        " n.updates_accepted, n.banned,"
        " (SELECT COUNT(*) FROM assignments a WHERE a.node_id = n.id AND a.state IN ('expired', 'abandoned'))"
        " AS assignments_failed"
        " FROM nodes n ORDER BY n.registered_at").fetchall())
    sched = app[SCHEDULER]
    now = time.time()
    out = []
    for r in rows:
        d = dict(r)
        d["device"] = json.loads(d["device"])
        d["benchmark"] = json.loads(d["benchmark"])
        live = sched.nodes.get(r["id"])
        if live is not None:
            d.update(ema_sps=live.ema_sps, last_seen=max(d["last_seen"], live.last_seen),
                     agreed=live.agreed, disagreed=live.disagreed, consecutive_valid=live.consecutive_valid,
                     flags_confirmed=live.flags_confirmed, flags_dismissed=live.flags_dismissed,
                     banned=live.banned, assignments_live=len(live.live))
        d["banned"] = bool(d["banned"])
        d["online"] = now - d["last_seen"] <= app[CONFIG].online_window_s
        d["reputation"] = {"consecutive_agreements": d["consecutive_valid"], "agreements_total": d["agreed"],
                           "flags_total": d["disagreed"], "confirmed_flags": d["flags_confirmed"],
                           "dismissed_flags": d["flags_dismissed"], "banned": d["banned"]}
        out.append(d)
    return out


@routes.get("/v1/nodes")
async def list_nodes(request: web.Request) -> web.Response:
    who = await principal(request)
    return json_response({"nodes": await nodes_overview(request.app, who)})
