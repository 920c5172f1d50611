"""Auditor routes: flags with their evidence, verdicts, the audit log, the node list; and the
operator's (admin) view of a ban's block cooldowns, which it may lift per address."""

from __future__ import annotations

import json

from aiohttp import web

from ..base.errors import BadRequest
from .appkeys import AUDIT, CONFIG, LEDGER, STORE
from .readmodel import flags, nodes
from .wire import json_response, principal, read_body

routes = web.RouteTableDef()
@routes.get("/v1/flags")
async def list_flags(request: web.Request) -> web.Response:
    who = await principal(request)
    found = await flags.list_flags_for(request.app, who, request.query.get("status"), request.query.get("job"))
    return json_response({"flags": found})


@routes.get("/v1/flags/{flag_id}")
async def get_flag(request: web.Request) -> web.Response:
    """The flag with what the console's flag page shows beside it (readmodel.flags.flag_document):
    `job_name`, `round_evidence` (the round's thresholds), `update`, `headline` (the check it
    failed, with its numbers), `scores` (each score against its threshold), `referee` and
    `layer_evidence` (per-layer norms and cosines against the round's centre; None for rounds
    too large to profile)."""
    who = await principal(request)
    return json_response(await flags.flag_document(request.app, who, request.match_info["flag_id"]))


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
    flag_id = await request.app[STORE].query(lambda c: flags.resolve_flag_id(c, who, request.match_info["flag_id"]))
    out = await request.app[LEDGER].flags.verdict(who, flag_id, doc.get("verdict"), doc.get("note", ""))
    return json_response({"flag": out.flag.to_dict(), "node_banned": out.node_banned,
                          "banned_by_this_verdict": out.banned_by_this_verdict})


@routes.get("/v1/audit-log")
async def audit_log(request: web.Request) -> web.StreamResponse:
    who = await principal(request)
    who.require("auditor")
    path = request.app[CONFIG].audit_log_path
    head = {"X-GPUFlex-Audit-Head": request.app[AUDIT].head}
    if not path.is_file():
        return web.Response(body=b"", content_type="application/jsonl", headers=head)
    return web.FileResponse(path, headers={"Content-Type": "application/jsonl", **head})


@routes.get("/v1/nodes")
async def list_nodes(request: web.Request) -> web.Response:
    who = await principal(request)
    return json_response({"nodes": await nodes.nodes_overview(request.app, who)})


@routes.get("/v1/cooldowns")
async def list_cooldowns(request: web.Request) -> web.Response:
    """The blocks and operators cooling down after a ban (admin): hub/domain/ledger/cooldowns.py."""
    who = await principal(request)
    return json_response({"cooldowns": request.app[LEDGER].cooldowns.cooldowns(who)})


@routes.post("/v1/cooldowns/lift")
async def lift_cooldown(request: web.Request) -> web.Response:
    """Lift a ban's block cooldown for one address or the whole block (admin; in the audit log)."""
    who = await principal(request)
    who.require("admin")
    body = await read_body(request, 64 << 10)
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise BadRequest('body must be JSON {"address": "IP or block", "note": "..."}', code="bad_json") from None
    if not isinstance(doc, dict):
        raise BadRequest("body must be a JSON object", code="bad_json")
    return json_response(await request.app[LEDGER].cooldowns.lift(who, doc.get("address"), doc.get("note", "")))
