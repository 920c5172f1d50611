"""Console pages: thin handlers (parse -> hub domain / read-only query -> template).

Authorisation mirrors the API: an owner sees only jobs whose owner is their
token name; admins see every job; auditors and admins see the nodes and the audit queue;
only auditors and admins give verdicts (through the hub's verdict function). An auditor
starts at the audit queue and reads any job's page as a review (the read model's job_review: rounds,
updates, nodes, shard map, flags; a pipelined job's plan from plans.plan_review), never an owner's
metrics, data or models.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import quote

import aiohttp_jinja2
from aiohttp import web
from gpuflex.protocol.jobspec import VerificationSpec
from markupsafe import Markup

from ...base.errors import BadRequest, Conflict
from ...base.numbers import parse_count
from ...model.job import ACTIVE_STATES
from ..readmodel.audit import audit_log_status
from ..readmodel.evidence import referee_rows, threshold_scores
from ..readmodel.flags import flag_document, flags_overview
from ..readmodel.jobs import job_review, job_view, jobs_overview
from ..readmodel.models import export_model, model_file_name
from ..readmodel.nodes import node_history, nodes_with_assignments
from ..readmodel.plans import job_plan, plan_review
from . import bridge, charts
from .console_keys import SESSION, SESSIONS, TEMPLATES
from .security import (
    CONSOLE_PREFIX,
    LOGIN_CSRF_COOKIE,
    SESSION_COOKIE,
    clear_session_cookie,
    login_csrf_ok,
    same_origin,
    set_login_csrf_cookie,
    set_session_cookie,
)
from .sessions import Session, csrf_matches, new_secret

__all__ = ["add_routes"]

AUDIT_ROLES = ("auditor", "admin")
POLL_S = 5
RECENT_ROUNDS = 5  # a job page's rounds table shows these; earlier rounds fold away
SHARDS_SHOWN = 12  # the shard map's rows shown; the rest fold away
MAX_FORM_BYTES = 16 << 10
MAX_NOTE = 1000


# --------------------------------------------------------------------------- helpers


def _session(request: web.Request) -> Session:
    s = request.get(SESSION)
    if not isinstance(s, Session):  # the middleware guarantees one on protected routes
        raise web.HTTPFound(f"{CONSOLE_PREFIX}/login")
    return s


def _require_audit(request: web.Request) -> Session:
    s = _session(request)
    if s.role not in AUDIT_ROLES:
        raise web.HTTPForbidden(text="this page needs an auditor or admin token")
    return s


def render(
    request: web.Request, template: str, ctx: Mapping[str, Any], *, status: int = 200
) -> web.Response:
    context = {"session": request.get(SESSION), **ctx}
    return aiohttp_jinja2.render_template(
        template, request, context, status=status, app_key=TEMPLATES
    )


async def _form(request: web.Request) -> Mapping[str, Any]:
    if request.content_length is not None and request.content_length > MAX_FORM_BYTES:
        raise web.HTTPRequestEntityTooLarge(
            max_size=MAX_FORM_BYTES, actual_size=request.content_length
        )
    return await request.post()


def _field(form: Mapping[str, Any], name: str) -> str | None:
    v = form.get(name)
    return v if isinstance(v, str) else None


def _safe_next(value: str | None) -> str:
    """Only redirect to a console path on this host (no open redirect)."""
    if (
        value
        and value.startswith(CONSOLE_PREFIX + "/")
        and not value.startswith("//")
        and "\\" not in value
        and all(ch.isprintable() for ch in value)
    ):
        return value
    return f"{CONSOLE_PREFIX}/"


# --------------------------------------------------------------------------- login


async def root(request: web.Request) -> web.StreamResponse:
    raise web.HTTPFound(f"{CONSOLE_PREFIX}/")


def landing(role: str) -> str:
    """Where a role starts: owners and admins at the jobs, an auditor at the audit queue."""
    return f"{CONSOLE_PREFIX}/flags" if role == "auditor" else f"{CONSOLE_PREFIX}/jobs"


async def index(request: web.Request) -> web.StreamResponse:
    """A session starts at its role's landing page; without one, at the login form (which
    comes back here)."""
    s = request.get(SESSION)
    raise web.HTTPFound(landing(s.role) if isinstance(s, Session) else f"{CONSOLE_PREFIX}/login")


async def login_page(request: web.Request) -> web.StreamResponse:
    s = request.get(SESSION)
    if isinstance(s, Session):
        raise web.HTTPFound(landing(s.role))
    token = new_secret()
    resp = render(
        request,
        "login.html",
        {"login_csrf": token, "next_url": _safe_next(request.query.get("next"))},
    )
    set_login_csrf_cookie(request, resp, token)
    return resp


async def login_submit(request: web.Request) -> web.StreamResponse:
    form = await _form(request)
    if not same_origin(request) or not login_csrf_ok(request, _field(form, "csrf_token")):
        raise web.HTTPForbidden(
            text="login form expired or came from another site: reload the page"
        )
    token = (_field(form, "token") or "").strip()
    principal = await bridge.authenticate(request.app, token)
    if principal is None:
        fresh = new_secret()
        resp = render(
            request,
            "login.html",
            {
                "login_csrf": fresh,
                "next_url": _safe_next(_field(form, "next")),
                "flash": "That token is unknown or revoked.",
                "flash_kind": "error",
            },
            status=401,
        )
        set_login_csrf_cookie(request, resp, fresh)
        return resp
    # A new session id on every login (no fixation); the old one, if any, ends.
    store = request.app[SESSIONS]
    store.delete(request.cookies.get(SESSION_COOKIE))
    sid, _ = store.create(
        token_id=str(principal.token_id), role=principal.role, name=principal.name
    )
    resp = web.HTTPSeeOther(_safe_next(_field(form, "next")))
    set_session_cookie(request, resp, sid)
    resp.del_cookie(LOGIN_CSRF_COOKIE, path=CONSOLE_PREFIX)
    raise resp


async def logout(request: web.Request) -> web.StreamResponse:
    request.app[SESSIONS].delete(request.cookies.get(SESSION_COOKIE))
    resp = web.HTTPSeeOther(f"{CONSOLE_PREFIX}/login")
    clear_session_cookie(resp)
    raise resp


# --------------------------------------------------------------------------- jobs


def _series(history: list[dict[str, Any]], key: str) -> list[tuple[float, float | None]]:
    return [(float(h["round"]), h.get(key)) for h in history]


async def jobs_page(request: web.Request) -> web.StreamResponse:
    s = _session(request)
    if s.role == "auditor":  # no jobs list for an auditor: its jobs are those of the flags
        raise web.HTTPFound(landing(s.role))
    jobs = await jobs_overview(request.app, bridge.principal(s))
    return render(request, "jobs.html", {"jobs": jobs, "nav": "jobs", "poll": POLL_S})


async def job_page(request: web.Request) -> web.StreamResponse:
    """A job's page: its owner's and admins' full view; an auditor's review (no metrics, charts,
    data sizes or models)."""
    s = _session(request)
    shard_round = _round_param(request)
    job_id = request.match_info["job_id"]
    review = s.role == "auditor"
    view = job_review if review else job_view
    d = await view(request.app, bridge.principal(s), job_id, shard_round)
    ctx = _job_context(d, review=review)
    ctx["can_audit"] = s.role in AUDIT_ROLES
    ctx["nav"] = "flags" if review else "jobs"
    if ctx["pipeline"] is not None and ctx["job"]["state"] in ACTIVE_STATES:
        ctx["plan"] = await _job_plan(request.app, s, job_id, review=review)
    return render(request, "job.html", ctx)


async def _job_plan(
    app: web.Application, s: Session, job_id: str, *, review: bool
) -> dict[str, Any]:
    """The plan a pipelined job would get on the nodes online now: GET /v1/jobs/{id}/plan's
    document, from the same read model (an auditor's review without the model's size and the
    batch). A model the hub will not cut shows its one-line reason, as a refusal does."""
    plan = plan_review if review else job_plan
    try:
        return await plan(app, bridge.principal(s), job_id)
    except Conflict as exc:
        return {"refused": exc.detail}


def _round_row(h: Mapping[str, Any]) -> dict[str, Any]:
    """One row of a job page's rounds table from a status history entry."""
    ups = h.get("updates") or []
    par = h.get("parallel") or {}
    transfer = h.get("transfer") or {}
    return {
        "round": h["round"],
        "loss": h.get("loss"),
        "accuracy": h.get("accuracy"),
        "train_loss": h.get("train_loss"),
        "closed_at": h.get("closed_at"),
        "updates": len(ups),
        "included": sum(1 for u in ups if u.get("status") == "included"),
        "quarantined": sum(1 for u in ups if u.get("status") == "quarantined"),
        "overhead": _num(h.get("replication_overhead")),
        "shards": par.get("shards"),
        "nodes": par.get("nodes"),
        "efficiency": par.get("efficiency"),
        "shares": sorted((h.get("node_shares") or {}).items(), key=lambda kv: -kv[1]),
        "unverified": len(h.get("unverified") or {}),
        "rolled_back": bool(h.get("rolled_back")),
        "restored_from": h.get("restored_from"),
        "bytes_up": transfer.get("bytes_up"),
        "bytes_down": transfer.get("bytes_down"),
        "compression": transfer.get("compression_ratio"),
    }


def _charts(hist: list[dict[str, Any]]) -> dict[str, Markup]:
    loss_chart = charts.line_chart(
        [
            charts.Series("validation loss", _series(hist, "loss")),
            charts.Series("train loss", _series(hist, "train_loss")),
        ],
        title="Loss per round",
        y_label="loss",
    )
    acc_chart = charts.line_chart(
        [charts.Series("validation accuracy", _series(hist, "accuracy"))],
        title="Accuracy per round",
        y_label="accuracy",
        y_min=0.0,
        y_max=1.0,
    )
    return {
        "loss_chart": Markup(loss_chart),  # noqa: S704 - built from escaped parts in charts.py
        "acc_chart": Markup(acc_chart),  # noqa: S704
    }


def _job_context(d: Mapping[str, Any], *, review: bool) -> dict[str, Any]:
    """job.html's context from the read model's job_view or job_review."""
    doc = d["doc"]
    rounds = [_round_row(h) for h in doc["history"]]
    overheads = [r["overhead"] for r in rounds if r["overhead"] is not None]
    covered = sum(len(sh["chunks"]) for sh in d["shards"] if sh["state"] == "settled")
    live = sum(1 for sh in d["shards"] for a in sh["assignments"] if a["state"] == "live")
    job = {
        **doc,
        "covered": covered,
        "live": live,
        "model_hash": doc.get("model_hash") or "",
        "chunks": d["chunks"],
        "closed": d["closed"],
        **{k: d.get(k) for k in ("loss", "accuracy", "train_loss")},
    }
    trained = [sh for h in doc["history"] for sh in h.get("shards", [])]
    overhead = {
        # every round trains the same chunks, so the mean of the rounds is the overall ratio
        "total": sum(overheads) / len(overheads) if overheads else None,
        "rounds": len(overheads),
        # the closed rounds' shards, as the overhead counts them: replicated = trained twice or more
        "shards": len(trained),
        "replicated": sum(1 for sh in trained if sh.get("replicated")),
    }
    return {
        "job": job,
        "review": review,
        "history": rounds,
        "overhead": overhead,
        "parallel": doc.get("parallel") or {},
        "pipeline": doc.get("pipeline"),
        "shard_round": d["shard_round"],
        "shards": d["shards"],
        "flags": d["flags"],
        **({} if review else _charts(doc["history"])),
        "poll": POLL_S if job["state"] in ("queued", "running") else None,
        "rounds_carved": d["rounds_carved"],
        "recent_rounds": RECENT_ROUNDS,
        "shards_shown": SHARDS_SHOWN,
    }


def _round_param(request: web.Request) -> int | None:
    raw = request.query.get("round")
    if raw is None:
        return None
    try:
        return parse_count(raw, "round")
    except BadRequest as exc:
        raise web.HTTPBadRequest(text=exc.detail) from None


async def job_model(request: web.Request) -> web.StreamResponse:
    s = _session(request)
    job_id = request.match_info["job_id"]
    version, _sha, data = await export_model(request.app, bridge.principal(s), job_id, _round_param(request))
    filename = model_file_name(job_id, version)
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in filename)[:128]
    return web.Response(
        body=data,
        content_type="application/octet-stream",
        headers={"Content-Disposition": f'attachment; filename="{safe}"'},
    )


# --------------------------------------------------------------------------- nodes


TRUSTED_RUN = VerificationSpec().trust_after  # nodes span jobs: the default trust run labels them


def node_view(n: Mapping[str, Any]) -> dict[str, Any]:
    """One row of the Nodes page from the hub's node overview."""
    rep = n.get("reputation") or {}
    confirmed = int(rep.get("confirmed_flags", 0))
    run = int(rep.get("consecutive_agreements", 0))
    if n.get("banned"):
        label, cls = f"banned ({confirmed} confirmed)", "banned"
    elif n.get("suspended"):
        label, cls = "suspended (a proven mismatch awaits an auditor)", "bad"
    elif confirmed:
        label, cls = f"suspect ({confirmed} confirmed)", "bad"
    elif run >= TRUSTED_RUN:
        label, cls = f"trusted (run of {run})", "ok"
    else:
        label, cls = f"building trust (run of {run})", "open"
    device = n.get("device") or {}
    bench = n.get("benchmark") or {}
    counts = n.get("assignments") or {}
    return {
        "id": n["id"],
        "software_version": n.get("software_version", "?"),
        "device_kind": device.get("kind", "?"),
        "device_name": device.get("name", "?"),
        "memory": device.get("memory_bytes"),
        "threads": device.get("threads"),
        "bench_sps": n.get("bench_sps"),
        "tflops": bench.get("matmul_tflops_fp32"),
        "mem_gbs": bench.get("mem_bandwidth_gbs"),
        "ema_sps": n.get("ema_sps"),
        "last_seen": n.get("last_seen"),
        "online": bool(n.get("online")),
        "banned": bool(n.get("banned")),
        "agreements_total": int(rep.get("agreements_total", 0)),
        "flags_total": int(rep.get("flags_total", 0)),
        "confirmed_flags": confirmed,
        "dismissed_flags": int(rep.get("dismissed_flags", 0)),
        "rep_label": label,
        "rep_class": cls,
        "done": int(counts.get("done", 0)),
        "failed": int(n.get("assignments_failed", 0)),
        "live": int(counts.get("live", 0)),
        "class_summary": class_summary(n.get("compute_class") or {}),
        "precisions": ", ".join((n.get("compute_class") or {}).get("precisions") or []),
        "precision_sps": bench.get("precision_sps") or {},
        "class_keys": n.get("class_keys") or {},
    }


def class_summary(c: Mapping[str, Any]) -> str:
    """A compute class in one line: what decides whether two nodes' replicas match bit for bit."""
    kind = c.get("device_kind")
    if not kind or kind == "unknown":
        return "class not reported"
    if kind == "cuda":
        parts = [f"sm {c.get('capability')}", f"CUDA {c.get('cuda_version') or '?'}",
                 f"cuDNN {c.get('cudnn_version') or '?'}"]
    elif kind == "cpu":
        parts = [str(c.get("cpu_vendor")), " ".join(c.get("isa") or []) or "no vector ISA",
                 f"oneDNN {'on' if c.get('onednn') else 'off'}", f"{c.get('threads')} threads"]
    else:
        parts = [str(c.get("device_model"))]
    return " · ".join([*parts, f"torch {c.get('torch_version')}"])


async def nodes_page(request: web.Request) -> web.StreamResponse:
    s = _require_audit(request)
    nodes = [node_view(n) for n in await nodes_with_assignments(request.app, bridge.principal(s))]
    nodes.sort(key=lambda n: -(n["last_seen"] or 0))
    return render(request, "nodes.html", {"nodes": nodes, "nav": "nodes", "poll": POLL_S})


# --------------------------------------------------------------------------- audit


FLAG_STATUSES = ("open", "confirmed", "dismissed", "moot", "all")


async def flags_page(request: web.Request) -> web.StreamResponse:
    s = _require_audit(request)
    status = request.query.get("status", "open")
    if status not in FLAG_STATUSES:
        raise web.HTTPBadRequest(text=f"status must be one of {', '.join(FLAG_STATUSES)}")
    flags = await flags_overview(
        request.app, bridge.principal(s), None if status == "all" else status
    )
    auditlog = await audit_log_status(request.app)
    return render(
        request,
        "flags.html",
        {"flags": flags, "status": status, "auditlog": auditlog, "nav": "flags", "poll": POLL_S},
    )


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def evidence_view(
    flag: Mapping[str, Any], computed: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Turn a flag's evidence (hub/policy/verification.py shapes) into rows and charts.

    ``computed``: per-layer rows against the round's centre (the read model's layer evidence),
    used when the recorded evidence has none of its own."""
    ev: Mapping[str, Any] = flag.get("evidence") or {}
    if not isinstance(ev, Mapping):
        ev = {}
    rev: Mapping[str, Any] = flag.get("round_evidence") or {}
    scores = [
        {
            **row,
            "gauge": Markup(  # noqa: S704 - escaped in charts.score_gauge
                charts.score_gauge(row["value"], row["threshold"], bad_when=row["bad_when"], title=row["name"])
            ),
        }
        for row in threshold_scores(flag)
    ]
    layer_chart, layer_note = _layer_charts(ev, rev, computed)
    replica, distance_chart = _replica_view(flag, ev)
    layer_chart += distance_chart
    if not layer_chart:
        layer_chart = charts.bar_chart([], title="Per-layer evidence", legend=[])
    problems = [str(p) for p in ev.get("problems") or [] if isinstance(p, (str, int, float))]
    if not problems and ev.get("why"):
        problems = [str(ev["why"])]
    return {
        "layer_note": layer_note,
        "referee": referee_rows(flag),
        "scores": scores,
        "layer_chart": Markup(layer_chart),  # noqa: S704 - escaped in charts.bar_chart
        "replica": replica,
        "problems": problems,
        "evidence_json": json.dumps(ev, indent=2, sort_keys=True, default=str),
    }


def _layer_charts(
    ev: Mapping[str, Any], rev: Mapping[str, Any], computed: Mapping[str, Any] | None
) -> tuple[str, str]:
    """Per-layer bars against the round's centre, recorded evidence first, else computed: (the
    charts' SVG, the note that says where the centre came from); ("", "") without layers."""
    layers = ev.get("layers")
    centre_note = (
        "From the flag's evidence: the round's robust centre (coordinate-wise median),"
        " scaled to this update's shard samples."
    )
    if not (isinstance(layers, list) and layers) and computed and computed.get("layers"):
        layers = computed["layers"]
        centre_note = (
            "Computed from the stored updates: the round's centre is the coordinate-wise"
            f" median of its {computed.get('centre_of')} candidate updates (aggregated or"
            " quarantined as outliers)."
        )
    if not (isinstance(layers, list) and layers):
        return "", ""
    bars = [
        charts.Bar(str(x.get("name", "?")), [_num(x.get("norm")), _num(x.get("centre_norm"))])
        for x in layers
        if isinstance(x, Mapping)
    ]
    layer_chart = charts.bar_chart(
        bars,
        title="Per-layer L2 norm: this update vs. the round's centre",
        legend=["this update", "round centre"],
    )
    cos_bars = [
        charts.Bar(str(x.get("name", "?")), [_num(x.get("cosine"))])
        for x in layers
        if isinstance(x, Mapping) and _num(x.get("cosine")) is not None
    ]
    if cos_bars:
        layer_chart += charts.bar_chart(
            cos_bars,
            title="Per-layer cosine to the round's centre",
            legend=["cosine"],
            threshold=_num(rev.get("cosine_min", 0.0)),
            threshold_label="min",
        )
    return layer_chart, centre_note


def _replica_view(flag: Mapping[str, Any], ev: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """A replica group's comparison (its pairs, tolerance, majority) and the chart of the
    flagged update's per-tensor distances to the others ("" without any); (None, "") when the
    evidence has no pairs."""
    pairs = ev.get("pairs")
    if not isinstance(pairs, list):
        return None, ""
    rows = []
    worst: dict[str, float] = {}
    for p in pairs:
        if not isinstance(p, Mapping):
            continue
        raw = p.get("tensors")
        tensors: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
        items = sorted(
            ((str(k), v) for k, v in tensors.items() if _num(v) is not None),
            key=lambda kv: -float(kv[1]),
        )
        if flag.get("update_id") in (p.get("a"), p.get("b")):
            for k, v in items:
                worst[k] = max(worst.get(k, 0.0), float(v))
        rows.append(
            {
                "a": str(p.get("a", "")),
                "b": str(p.get("b", "")),
                "relative_distance": _num(p.get("relative_distance")),
                "agree": bool(p.get("agree")),
                "tensors": items,
            }
        )
    replica = {
        "tolerance": _num(ev.get("tolerance")),
        "majority": [str(m) for m in ev.get("majority") or []],
        "distance": _num(ev.get("relative_distance_to_canonical")),
        "why": str(ev.get("why", "")),
        "pairs": rows,
    }
    if not worst:
        return replica, ""
    chart = charts.bar_chart(
        [charts.Bar(k, [v]) for k, v in sorted(worst.items(), key=lambda kv: -kv[1])],
        title="Per-tensor relative distance to the other replicas",
        legend=["relative distance"],
        threshold=_num(ev.get("tolerance")),
        threshold_label="tolerance",
    )
    return replica, chart


async def flag_page(request: web.Request) -> web.StreamResponse:
    s = _session(request)
    who = bridge.principal(s)
    auditor = s.role in AUDIT_ROLES
    # Visibility exactly as GET /v1/flags/{id}: auditors and admins, and the job's owner.
    flag = await flag_document(request.app, who, request.match_info["flag_id"])
    node = None
    history: dict[str, Any] = {"node_flags": [], "node_updates": []}
    if auditor:  # a node's history spans every owner's jobs
        found = [n for n in await nodes_with_assignments(request.app, who) if n["id"] == flag["node_id"]]
        node = node_view(found[0]) if found else None
        history = await node_history(request.app, flag["node_id"])
    flash = None
    kind = "info"
    done = request.query.get("done")
    if done in ("confirm", "dismiss"):
        flash, kind = f"Verdict recorded: {done}ed.", "ok"
    return render(
        request,
        "flag.html",
        {
            "flag": flag,
            "headline": flag["headline"],
            "node": node,
            **history,
            **evidence_view(flag, flag["layer_evidence"]),
            "can_decide": auditor,
            "nav": "flags" if auditor else "jobs",
            "flash": flash,
            "flash_kind": kind,
        },
    )


async def flag_verdict(request: web.Request) -> web.StreamResponse:
    s = _require_audit(request)
    flag_id = request.match_info["flag_id"]
    form = await _form(request)
    verdict = _field(form, "verdict")
    note = (_field(form, "note") or "").strip()
    if verdict not in ("confirm", "dismiss"):
        raise web.HTTPBadRequest(text="verdict must be confirm or dismiss")
    if not note or len(note) > MAX_NOTE:
        raise web.HTTPBadRequest(text=f"a note of 1..{MAX_NOTE} characters is required")
    await bridge.give_verdict(request.app, bridge.principal(s), flag_id, verdict, note)
    raise web.HTTPSeeOther(f"{CONSOLE_PREFIX}/flags/{quote(flag_id)}?done={verdict}")


async def job_rollback(request: web.Request) -> web.StreamResponse:
    """The owner's button on the job page: roll back before a stopped node's unverified work (to the
    oldest kept model when the one before it is gone: ``oldest_kept``)."""
    s = _session(request)
    if s.role == "auditor":
        raise web.HTTPForbidden(text="only the job's owner or an admin rolls a job back")
    job_id = request.match_info["job_id"]
    form = await _form(request)
    node = _field(form, "before_node")
    if not node:
        raise web.HTTPBadRequest(text="say which node to roll back before")
    await bridge.roll_back(request.app, bridge.principal(s), job_id, node, oldest_kept=_field(form, "oldest_kept") == "1")
    raise web.HTTPSeeOther(f"{CONSOLE_PREFIX}/jobs/{quote(job_id)}")


# --------------------------------------------------------------------------- wiring


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/", root, name="console-root")
    r.add_get(CONSOLE_PREFIX, index)
    r.add_get(CONSOLE_PREFIX + "/", index, name="console-index")
    r.add_get(CONSOLE_PREFIX + "/login", login_page, name="console-login")
    r.add_post(CONSOLE_PREFIX + "/login", login_submit)
    r.add_post(CONSOLE_PREFIX + "/logout", logout)
    r.add_get(CONSOLE_PREFIX + "/jobs", jobs_page, name="console-jobs")
    r.add_get(CONSOLE_PREFIX + "/jobs/{job_id}", job_page, name="console-job")
    r.add_get(CONSOLE_PREFIX + "/jobs/{job_id}/model", job_model)
    r.add_post(CONSOLE_PREFIX + "/jobs/{job_id}/rollback", job_rollback)
    r.add_get(CONSOLE_PREFIX + "/nodes", nodes_page, name="console-nodes")
    r.add_get(CONSOLE_PREFIX + "/flags", flags_page, name="console-flags")
    r.add_get(CONSOLE_PREFIX + "/flags/{flag_id}", flag_page, name="console-flag")
    r.add_post(CONSOLE_PREFIX + "/flags/{flag_id}/verdict", flag_verdict)


PUBLIC_PATHS = frozenset({"/", CONSOLE_PREFIX, CONSOLE_PREFIX + "/login"})


@web.middleware
async def console_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Session + CSRF for /console/*; HTML error pages for console paths."""
    path = request.path
    if not (path == "/" or path == CONSOLE_PREFIX or path.startswith(CONSOLE_PREFIX + "/")):
        return await handler(request)
    if path.startswith(CONSOLE_PREFIX + "/static/"):
        return await handler(request)
    try:
        session = await _load_session(request)
        if session is not None:
            request[SESSION] = session
        if request.method not in ("GET", "HEAD", "OPTIONS") and path != CONSOLE_PREFIX + "/login":
            await _check_csrf(request, session)
        elif session is None and path not in PUBLIC_PATHS and path != CONSOLE_PREFIX + "/":
            raise web.HTTPFound(f"{CONSOLE_PREFIX}/login?next={quote(request.path_qs)}")
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error_page(request, exc.status, exc.reason, exc.text or "")
    except bridge.HubError as exc:
        return _error_page(request, exc.status, exc.code, exc.detail)


async def _load_session(request: web.Request) -> Session | None:
    sid = request.cookies.get(SESSION_COOKIE)
    if not sid:
        return None
    store = request.app[SESSIONS]
    session = store.get(sid)
    if session is None:
        return None
    # The token behind a session must still be live (revocation ends sessions).
    alive = await bridge.session_alive(request.app, session)
    if alive is None or alive != (session.role, session.name):
        store.delete_for_token(session.token_id)
        return None
    return session


async def _check_csrf(request: web.Request, session: Session | None) -> None:
    if session is None:
        raise web.HTTPForbidden(text="log in first: no console session")
    if not same_origin(request):
        raise web.HTTPForbidden(text="cross-origin form post refused")
    given = request.headers.get("X-CSRF-Token")
    if given is None:
        form = await _form(request)
        given = _field(form, "csrf_token")
    if not csrf_matches(session.csrf, given):
        raise web.HTTPForbidden(text="missing or wrong CSRF token: reload the page and try again")


def _error_page(request: web.Request, status: int, reason: str, detail: str) -> web.Response:
    text = detail if detail and not detail.startswith(f"{status}:") else reason
    return render(
        request,
        "error.html",
        {"status": status, "reason": reason, "detail": text},
        status=status,
    )
