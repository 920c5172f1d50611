"""Flags as they are shown: the API's list and flag document (GET /v1/flags, /v1/flags/{id}), a flag
named by a unique prefix, what a flag's page shows beside it, the console's audit queue."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import asdict
from typing import Any

from aiohttp import web
from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.jobspec import parse_job_spec

from ...base.errors import BadRequest, Conflict, NotFound
from ...storage.tokens import Principal
from ..appkeys import STORE
from . import evidence
from .access import flag_scope

FLAG_STATUSES = ("open", "confirmed", "dismissed", "moot")


def _flag_dict(r: sqlite3.Row) -> dict[str, Any]:
    d = dict(r)
    d["evidence"] = json.loads(d["evidence"] or "{}")
    d["suspends"] = bool(d.get("suspends"))
    return d


async def list_flags_for(
    app: web.Application, who: Principal, status: str | None = None, job: str | None = None
) -> list[dict[str, Any]]:
    """Flags visible to `who` (auditors/admins: all; owners: their jobs'): the open flags that
    suspend a node first (hub/policy/suspension.py), then oldest first."""
    if status is not None and status not in FLAG_STATUSES:
        raise BadRequest(f"status must be one of {', '.join(FLAG_STATUSES)}", code="bad_status")
    if job is not None and len(job) > 64:
        raise BadRequest("job id is too long", code="bad_job")
    where, args = flag_scope(who)
    sql = f"SELECT f.* FROM flags f WHERE {where}"  # noqa: S608 - fixed fragments only
    params: list[Any] = list(args)
    if status:
        sql += " AND f.status = ?"
        params.append(status)
    if job:
        sql += " AND f.job_id = ?"
        params.append(job)
    sql += (" ORDER BY CASE WHEN f.status = 'open' AND f.suspends = 1 THEN 0 ELSE 1 END, f.created_at, f.id"
            " LIMIT 10000")
    rows = await app[STORE].query(lambda c: c.execute(sql, params).fetchall())
    return [_flag_dict(r) for r in rows]


MAX_CANDIDATES = 10


def resolve_flag_id(conn: sqlite3.Connection, who: Principal, ref: str) -> str:
    """The flag id that `ref` names among the flags `who` may see: the id itself or, as git
    does with commits, any unique prefix of it (with or without the leading "f-").

    NotFound when nothing matches; Conflict ("ambiguous_flag") listing the candidates when
    more than one does. Ids are never cut short in what the hub or the CLI prints, so a
    prefix is always the user's choice."""
    where, args = flag_scope(who)
    if not ref or len(ref) > 64 or not ref.isprintable():
        raise NotFound(f"no flag {ref[:64]!r} visible to you", code="unknown_flag")
    exact = conn.execute(
        f"SELECT f.id FROM flags f WHERE f.id = ? AND {where}",  # noqa: S608
        (ref, *args),
    ).fetchone()
    if exact is not None:
        return str(exact["id"])
    escaped = ref.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    rows = conn.execute(
        f"SELECT f.id FROM flags f WHERE (f.id LIKE ? ESCAPE '\\' OR f.id LIKE ? ESCAPE '\\') AND {where}"  # noqa: S608
        " ORDER BY f.id LIMIT ?",
        (escaped + "%", "f-" + escaped + "%", *args, MAX_CANDIDATES + 1),
    ).fetchall()
    ids = [str(r["id"]) for r in rows]
    if not ids:
        raise NotFound(f"no flag {ref} visible to you", code="unknown_flag")
    if len(ids) > 1:
        more = " ..." if len(ids) > MAX_CANDIDATES else ""
        raise Conflict(
            f"flag prefix {ref} is ambiguous: it matches {', '.join(ids[:MAX_CANDIDATES])}{more};"
            " give more characters",
            code="ambiguous_flag",
        )
    return ids[0]


async def flag_for(app: web.Application, who: Principal, flag_id: str) -> dict[str, Any]:
    """One flag visible to `who`, by id or unique prefix (resolve_flag_id)."""

    def read(c: sqlite3.Connection) -> sqlite3.Row:
        row: sqlite3.Row = c.execute(
            "SELECT * FROM flags WHERE id = ?", (resolve_flag_id(c, who, flag_id),)
        ).fetchone()
        return row

    return _flag_dict(await app[STORE].query(read))


def _loads(text: str | None) -> Any:
    if not text:
        return {}
    try:
        return json.loads(text)
    except ValueError:
        return {}


def flag_context(conn: sqlite3.Connection, flag: dict[str, Any]) -> dict[str, Any]:
    """What a flag's page shows beside the flag row: the job's name, the round's review
    evidence (thresholds), the flagged update and its shard's replica outcome."""
    job = conn.execute(
        "SELECT name, spec_toml FROM jobs WHERE id = ?", (flag["job_id"],)
    ).fetchone()
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
    try:
        return asdict(parse_job_spec(spec_toml).verification)
    except ProtocolError:
        return {}


def job_names(conn: sqlite3.Connection) -> dict[str, str]:
    """Job id -> name, for labelling flags (the caller already filtered what is visible)."""
    return {r["id"]: r["name"] for r in conn.execute("SELECT id, name FROM jobs")}


def job_flags(conn: sqlite3.Connection, job_id: str) -> list[dict[str, Any]]:
    """A job's flags, newest first (at most 200), for its page (the caller checked visibility)."""
    return [
        dict(f)
        for f in conn.execute(
            "SELECT id, round, node_id, reason, status, created_at FROM flags WHERE job_id = ?"
            " ORDER BY created_at DESC, id LIMIT 200",
            (job_id,),
        )
    ]


async def flags_overview(
    app: web.Application, who: Principal, status: str | None
) -> list[dict[str, Any]]:
    """The console's audit queue: GET /v1/flags's list (same scoping), the open flags that suspend a
    node first, then newest first, with job names."""
    found = await list_flags_for(app, who, status=status)
    names = await app[STORE].query(job_names)
    for f in found:
        f["job_name"] = names.get(f["job_id"], f["job_id"])
    found.reverse()
    found.sort(key=lambda f: not (f["status"] == "open" and f["suspends"]))  # stable: newest first within
    return found


async def flag_with_context(app: web.Application, who: Principal, flag_id: str) -> dict[str, Any]:
    """One flag (same scoping as flag_for) plus what flag_context adds: the job's name, the round's
    thresholds and the flagged update."""
    f = await flag_for(app, who, flag_id)
    f.update(await app[STORE].query(lambda c: flag_context(c, f)))
    return f


async def flag_document(app: web.Application, who: Principal, flag_id: str) -> dict[str, Any]:
    """GET /v1/flags/{id} and the console's flag page: the flag with its context (flag_with_context),
    ``scores`` (each score against its threshold), ``headline`` (the check it failed, with its
    numbers), ``referee`` (the re-executed segments) and ``layer_evidence`` (per-layer norms and
    cosines against the round's centre; None for rounds too large to profile)."""
    flag = await flag_with_context(app, who, flag_id)
    flag["scores"] = evidence.threshold_scores(flag)
    flag["headline"] = evidence.headline(flag)
    flag["referee"] = evidence.referee_rows(flag)
    flag["layer_evidence"] = await evidence.layer_evidence(app, flag)
    return flag
