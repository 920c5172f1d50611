"""The console's only door into the hub: its AppKeys and domain functions.

Everything the console needs from the hub goes through this module, so the
pages never depend on how the hub stores or computes things beyond the
functions named here. Reads run on the hub's database thread (``Database.read``);
the console never writes the hub's tables itself — a verdict is given by the
very function the API's verdict route calls.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web
from gpuflex.hub import appkeys, routes_audit, routes_owner, tokens
from gpuflex.hub.errors import HubError, NotFound, Unauthorized

from . import queries
from .keys import AUDIT_STATUS_CACHE
from .sessions import Session

__all__ = [
    "HubError",
    "audit_log_status",
    "authenticate",
    "export_model",
    "give_verdict",
    "job_view",
    "job_visible",
    "online_window_s",
    "principal",
    "read",
]

T = TypeVar("T")


async def read(app: web.Application, fn: Callable[[sqlite3.Connection], T]) -> T:
    """Run a read-only query on the hub's database thread."""
    return await app[appkeys.DB].read(fn)


def online_window_s(app: web.Application) -> float:
    return float(app[appkeys.CONFIG].online_window_s)


async def authenticate(app: web.Application, token: str) -> tokens.Principal | None:
    """The hub's own token check (hashed, constant-time); None when refused."""
    if not token or len(token) > 256 or not token.isprintable():
        return None
    try:
        return await read(app, lambda c: tokens.lookup(c, f"Bearer {token}"))
    except Unauthorized:
        return None


def principal(session: Session) -> tokens.Principal:
    """The hub's Principal for a console session (re-checked live per request)."""
    role: Any = session.role
    return tokens.Principal(token_id=int(session.token_id), role=role, name=session.name)


def _job_row(conn: sqlite3.Connection, who: tokens.Principal, job_id: str) -> sqlite3.Row:
    """The hub's visibility rule for one job (NotFound when absent or not yours)."""
    fn = getattr(routes_owner, "job_row", None) or routes_owner._job_row
    return fn(conn, who, job_id)


async def job_view(app: web.Application, who: tokens.Principal, job_id: str) -> dict[str, Any]:
    """The API's job status document (same visibility, history, overhead) plus console extras."""

    def q(conn: sqlite3.Connection) -> dict[str, Any]:
        row = _job_row(conn, who, job_id)
        doc = routes_owner.job_status(conn, row)
        doc["model_sha"] = row["model_sha"]
        extras = queries.job_extras(conn, job_id, row["state"], int(row["round"]))
        return {"doc": doc, **extras}

    return await read(app, q)


async def job_visible(app: web.Application, who: tokens.Principal, job_id: str) -> bool:
    def q(conn: sqlite3.Connection) -> bool:
        try:
            _job_row(conn, who, job_id)
        except NotFound:
            return False
        return True

    return await read(app, q)


async def give_verdict(
    app: web.Application, who: tokens.Principal, flag_id: str, verdict: str, note: str
) -> None:
    """Confirm or dismiss through the hub's verdict function (the API route's own code path):
    flag status, node reputation, ban rule, audit-log entry."""
    fn = getattr(routes_audit, "give_verdict", None)
    if fn is None:
        raise HubError(
            "this hub build has no verdict function for the console yet; use POST /v1/flags/{id}/verdict",
            code="not_available",
        )
    await fn(app, who, flag_id, verdict, note)


async def export_model(app: web.Application, who: tokens.Principal, job_id: str) -> tuple[str, bytes]:
    """(file name, .safetensors bytes) of the job's latest model, as GET /v1/jobs/{id}/model."""
    fn = getattr(routes_owner, "export_model", None)
    if fn is not None:
        version, _sha, data = await fn(app, who, job_id, None)
        return f"{job_id}-v{version}.safetensors", data
    # Until the hub exposes its export function: the same two steps its route runs.
    from gpuflex.protocol.tensors import decode_state, state_to_safetensors

    def q(conn: sqlite3.Connection) -> sqlite3.Row:
        _job_row(conn, who, job_id)
        row = conn.execute(
            "SELECT version, sha FROM models WHERE job_id = ? ORDER BY version DESC LIMIT 1", (job_id,)
        ).fetchone()
        if row is None:
            raise NotFound(f"job {job_id} has no model yet", code="unknown_round")
        return row

    row = await read(app, q)
    blobs = app[appkeys.BLOBS]
    data = await asyncio.to_thread(lambda: state_to_safetensors(decode_state(blobs.read(row["sha"]))))
    return f"{job_id}-v{row['version']}.safetensors", data


async def audit_log_status(app: web.Application) -> dict[str, Any]:
    """Verify the hub's audit log (hash chain + signatures); cached while the file is unchanged."""
    config = app[appkeys.CONFIG]
    path = config.audit_log_path
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return {"ok": None, "entries": 0, "problem": "no audit log entries yet", "bad_index": None}
    stamp = (st.st_size, st.st_mtime_ns)
    cache = app[AUDIT_STATUS_CACHE]
    if cache.get("stamp") == stamp:
        return dict(cache["result"])
    from gpuflex.hub.auditlog import verify_file

    public = app[appkeys.HUB_KEY].public_bytes
    check = await asyncio.to_thread(verify_file, path, public)
    result = {
        "ok": bool(check.ok),
        "entries": getattr(check, "entries", 0),
        "bad_index": getattr(check, "bad_index", None),
        "problem": getattr(check, "problem", "") or "",
    }
    cache["stamp"] = stamp
    cache["result"] = result
    return dict(result)
