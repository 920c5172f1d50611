"""The console's only door into the hub: its AppKeys and domain functions.

Everything the console needs from the hub goes through this module, so the
pages never depend on how the hub stores or computes things beyond the
functions named here. Reads go through the hub's read model (``gpuflex.hub.server.readmodel``,
on the store's thread); the console changes nothing itself — a verdict is given by
the ledger (``Ledger.verdict``), the very call the API's verdict route makes.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web
from gpuflex.hub.base.errors import HubError, Unauthorized
from gpuflex.hub.server import appkeys, readmodel
from gpuflex.hub.storage import tokens

from . import evidence, queries
from .console_keys import AUDIT_STATUS_CACHE, LAYER_CACHE
from .sessions import Session

__all__ = [
    "HubError",
    "audit_log_status",
    "authenticate",
    "export_model",
    "flag",
    "flags",
    "give_verdict",
    "job_review",
    "job_view",
    "jobs",
    "layer_evidence",
    "node_history",
    "nodes",
    "principal",
    "read",
]

T = TypeVar("T")
AUDIT_RECHECK_S = 60.0


async def read(app: web.Application, fn: Callable[[sqlite3.Connection], T]) -> T:
    """Run a read-only query on the store's thread."""
    return await app[appkeys.STORE].query(fn)


async def authenticate(app: web.Application, token: str) -> tokens.Principal | None:
    """The hub's own token check (hashed, constant-time); None when refused."""
    if not token or len(token) > 256 or not token.isprintable():
        return None
    try:
        return await read(app, lambda c: tokens.lookup_token(c, token))
    except Unauthorized:
        return None


def principal(session: Session) -> tokens.Principal:
    """The hub's Principal for a console session (its token is re-checked per request)."""
    role: Any = session.role
    return tokens.Principal(token_id=int(session.token_id), role=role, name=session.name)


async def jobs(app: web.Application, who: tokens.Principal) -> list[dict[str, Any]]:
    """Jobs visible to ``who`` under the API's rule (readmodel.visible), newest first."""
    where, args = readmodel.visible(who)
    return await read(app, lambda c: queries.jobs_list(c, where, args))


async def job_view(
    app: web.Application, who: tokens.Principal, job_id: str, shard_round: int | None = None
) -> dict[str, Any]:
    """The API's job status document (same visibility, history, overhead) plus console extras."""

    def q(conn: sqlite3.Connection) -> dict[str, Any]:
        row = readmodel.job_row(conn, who, job_id)
        spec = readmodel.spec_of(row)
        doc = readmodel.job_status(conn, row, spec)
        extras = queries.job_extras(conn, job_id, row["state"], int(row["round"]), shard_round)
        # the owner of a job with a [privacy] option sees what that option leaves it (readmodel.owner_view)
        seen = readmodel.owner_view(doc, spec, who, extras)
        return {"doc": {k: v for k, v in seen.items() if k != "extras"}, **seen["extras"]}

    view = await read(app, q)
    waiting = readmodel.live_waits(app, who, job_id)
    if waiting is not None:
        view["doc"]["waiting"] = waiting
    return view


# What an auditor sees of a job and of each closed round: how the rounds went and who took part,
# not the owner, the data, the model's metrics or the models themselves.
REVIEW_JOB_FIELDS = ("id", "name", "state", "round", "rounds", "created_at", "updated_at", "history")
REVIEW_ROUND_FIELDS = ("round", "opened_at", "closed_at", "updates", "flags", "unverified", "replica_comparison",
                       "replication_overhead", "shards", "node_shares", "parallel")
REVIEW_UPDATE_FIELDS = ("update_id", "node_id", "status", "replica_group", "chunks")


def review_doc(doc: dict[str, Any]) -> dict[str, Any]:
    """An auditor's part of a job's status document (readmodel.job_status)."""
    out = {k: doc[k] for k in REVIEW_JOB_FIELDS if k in doc}
    out["history"] = [
        {k: h[k] for k in REVIEW_ROUND_FIELDS if k in h}
        | {"updates": [{k: u.get(k) for k in REVIEW_UPDATE_FIELDS} for u in h.get("updates", [])]}
        for h in doc.get("history", [])
    ]
    return out


async def job_review(
    app: web.Application, who: tokens.Principal, job_id: str, shard_round: int | None = None
) -> dict[str, Any]:
    """What an auditor reviews of any job (console only; the API's job routes stay the owner's and
    admins'): its state, each closed round's updates, flags and nodes' shares, the shard map and
    the job's flags (review_doc); no metric, data size, owner or model."""
    who.require("auditor")

    def q(conn: sqlite3.Connection) -> dict[str, Any]:
        row = queries.job_row(conn, job_id)
        doc = readmodel.job_status(conn, row, readmodel.spec_of(row))
        extras = queries.job_extras(conn, job_id, row["state"], int(row["round"]), shard_round)
        for metric in ("loss", "accuracy", "train_loss"):
            extras.pop(metric, None)
        return {"doc": review_doc(doc), **extras}

    return await read(app, q)


async def export_model(
    app: web.Application, who: tokens.Principal, job_id: str, version: int | None = None
) -> tuple[str, bytes]:
    """(file name, .safetensors bytes) of the job's latest model or of model ``version``
    (0 = initial, N = after N rounds): GET /v1/jobs/{id}/model's function."""
    version, _sha, data = await readmodel.export_model(app, who, job_id, version)
    return f"{job_id}-v{version}.safetensors", data


async def nodes(app: web.Application, who: tokens.Principal) -> list[dict[str, Any]]:
    """GET /v1/nodes's overview (auditor/admin; live scheduler state) plus assignment counts."""
    overview = await readmodel.nodes_overview(app, who)
    counts = await read(app, queries.assignment_counts)
    for n in overview:
        n["assignments"] = counts.get(n["id"], {})
    return overview


async def flags(
    app: web.Application, who: tokens.Principal, status: str | None
) -> list[dict[str, Any]]:
    """GET /v1/flags's list (same scoping), newest first, with job names."""
    found = await readmodel.list_flags_for(app, who, status=status)
    names = await read(app, queries.job_names)
    for f in found:
        f["job_name"] = names.get(f["job_id"], f["job_id"])
    found.reverse()
    return found


async def flag(app: web.Application, who: tokens.Principal, flag_id: str) -> dict[str, Any]:
    """GET /v1/flags/{id} (same scoping) plus the job name, round thresholds and the update."""
    f = await readmodel.flag_for(app, who, flag_id)
    f.update(await read(app, lambda c: queries.flag_context(c, f)))
    return f


async def node_history(app: web.Application, node_id: str) -> dict[str, Any]:
    """A node's other flags and recent updates (auditor pages only: spans every owner's jobs)."""

    def q(conn: sqlite3.Connection) -> dict[str, Any]:
        return {
            "node_flags": queries.node_flags(conn, node_id),
            "node_updates": queries.node_updates(conn, node_id),
        }

    return await read(app, q)


async def give_verdict(
    app: web.Application, who: tokens.Principal, flag_id: str, verdict: str, note: str
) -> None:
    """Confirm or dismiss through the ledger, as POST /v1/flags/{id}/verdict does: flag status,
    node reputation (3 confirmed flags ban), audit-log entry."""
    await app[appkeys.LEDGER].verdict(who, flag_id, verdict, note)


async def layer_evidence(app: web.Application, flag: dict[str, Any]) -> dict[str, Any] | None:
    """Per-layer rows of the flagged update against its round's centre (see evidence.py);
    None when the round or model is too large to profile on a page view."""
    cache = app[LAYER_CACHE]
    if flag["id"] in cache:
        return cache[flag["id"]]  # type: ignore[no-any-return]
    needed = await read(app, lambda c: evidence.candidate_shas(c, flag))
    result = None
    if needed is not None:
        result = await asyncio.to_thread(evidence.round_layer_evidence, app[appkeys.BLOBS], needed)
    if result is not None and result["closed"]:  # a closed round's updates never change
        if len(cache) >= 256:
            cache.clear()
        cache[flag["id"]] = result
    return result


async def audit_log_status(app: web.Application) -> dict[str, Any]:
    """Verify the hub's audit log (hash chain + signatures).

    The result is reused while the file's size and mtime are unchanged, for at most
    AUDIT_RECHECK_S: an edit that restores both still shows up within that time."""
    config = app[appkeys.CONFIG]
    path = config.audit_log_path
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return {"ok": None, "entries": 0, "problem": "no audit log entries yet", "bad_index": None}
    stamp = (st.st_size, st.st_mtime_ns)
    cache = app[AUDIT_STATUS_CACHE]
    now = time.monotonic()
    if cache.get("stamp") == stamp and now - cache.get("at", -1e9) < AUDIT_RECHECK_S:
        return dict(cache["result"])
    from gpuflex.hub.storage.auditlog import verify_file

    public = app[appkeys.HUB_KEY].public_bytes
    check = await asyncio.to_thread(verify_file, path, public)
    result = {
        "ok": bool(check.ok),
        "entries": check.entries,
        "bad_index": check.bad_index,
        "problem": check.problem or "",
        "truncated": bool(getattr(check, "truncated", False)),
        "head": str(getattr(check, "head", "")),
    }
    cache.update(stamp=stamp, result=result, at=now)
    return dict(result)
