"""The hub's app factory: state under typed AppKeys, routes, error middleware, background loops."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from aiohttp import web
from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.signing import ReplayGuard

from . import routes_audit, routes_node, routes_owner
from .appkeys import (
    AUDIT,
    BLOBS,
    CONFIG,
    DB,
    FIRST_ADMIN_TOKEN,
    HUB_KEY,
    IO_POOL,
    METRICS,
    REPLAY,
    ROUNDS,
    SCHEDULER,
    SIGNAL,
)
from .auditlog import AuditLog
from .blobs import BlobStore
from .config import HubConfig
from .db import Database
from .edge import guard_edge
from .errors import HubError
from .jobs import load_jobs
from .keys import load_or_create_hub_key
from .metrics import HubMetrics
from .openapi import openapi_document
from .rounds import RoundEngine
from .scheduler import NodeState, Scheduler, WorkSignal, peak_flops
from .tokens import insert_token
from .wire import error_response, json_response, protocol_to_hub

log = logging.getLogger("gpuflex.hub")


def _is_api(path: str) -> bool:
    return path.startswith("/v1/") or path in ("/healthz", "/metrics")


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """The one place where domain errors become HTTP: {"error": code, "detail": one line}."""
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
    request.app[METRICS].requests[route] += 1
    try:
        return await handler(request)
    except HubError as exc:
        return error_response(exc.status, exc.code, exc.detail)
    except ProtocolError as exc:
        err = protocol_to_hub(exc)
        return error_response(err.status, err.code, err.detail)
    except web.HTTPException as exc:
        if exc.status >= 400 and _is_api(request.path):
            code = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}.get(exc.status, "http_error")
            return error_response(exc.status, code, exc.reason)
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal", "the hub hit an unexpected error; see its log")


def create_app(config: HubConfig) -> web.Application:
    """Build the hub. First start creates the key (0600), the database (WAL) and the blob store."""
    config.data_dir.mkdir(parents=True, exist_ok=True)
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)
    with contextlib.suppress(OSError):
        os.chmod(config.data_dir, 0o700)
    key, _created = load_or_create_hub_key(config.key_path)
    db = Database(config.db_path)
    admin_token = ""

    def first_admin(conn: sqlite3.Connection) -> str:
        if conn.execute("SELECT COUNT(*) FROM tokens WHERE role = 'admin'").fetchone()[0]:
            return ""
        return insert_token(conn, "admin", "admin")

    admin_token = db.write_sync(first_admin)
    app = web.Application(middlewares=[error_middleware], client_max_size=config.max_message_bytes)
    metrics = HubMetrics()
    signal = WorkSignal()
    scheduler = Scheduler(min_deadline_s=config.min_deadline_s, online_window_s=config.online_window_s,
                          rng=random.Random(int.from_bytes(os.urandom(8), "big")))
    blobs = BlobStore(config.blob_dir)
    audit = AuditLog(config.audit_log_path, key)
    app[CONFIG] = config
    app[DB] = db
    app[BLOBS] = blobs
    app[HUB_KEY] = key
    # Nonces live in memory only: a request signed before this start is refused (see ReplayGuard).
    app[REPLAY] = ReplayGuard(window_s=config.replay_window_s, not_before=time.time())
    app[SCHEDULER] = scheduler
    app[SIGNAL] = signal
    app[METRICS] = metrics
    app[AUDIT] = audit
    app[IO_POOL] = ThreadPoolExecutor(max_workers=config.io_threads, thread_name_prefix="gpuflex-hub-io")
    app[FIRST_ADMIN_TOKEN] = admin_token
    app[ROUNDS] = RoundEngine(db=db, blobs=blobs, scheduler=scheduler, metrics=metrics, signal=signal,
                              audit=audit)
    app.add_routes(routes_node.routes)
    app.add_routes(routes_owner.routes)
    app.add_routes(routes_audit.routes)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", prometheus)
    app.router.add_get("/v1/openapi.json", openapi)
    app.cleanup_ctx.append(background)
    app.on_shutdown.append(_wake_long_polls)
    guard_edge(app)  # malformed HTTP, undocumented query parameters: 4xx, one log line (hub/edge.py)
    _attach_console(app)
    return app


async def _wake_long_polls(app: web.Application) -> None:
    """Shutdown waits for in-flight handlers: answer every waiting long-poll now (NoWork,
    retry soon) rather than let each run out its wait (up to long_poll_max_s)."""
    app[SIGNAL].close()


def _attach_console(app: web.Application) -> None:
    """The web console (hub/web, owned by the console area) mounts itself under /console."""
    try:
        from .web import setup_console
    except ImportError:
        return
    setup_console(app)


async def healthz(request: web.Request) -> web.Response:
    await request.app[DB].read(lambda c: c.execute("SELECT 1").fetchone())
    return json_response({"ok": True, "fingerprint": request.app[HUB_KEY].fingerprint})


async def prometheus(request: web.Request) -> web.Response:
    app = request.app
    sched = app[SCHEDULER]

    def gauges() -> dict[str, float]:
        now = time.time()
        return {"nodes_online": sched.online_nodes(now), "nodes_registered": len(sched.nodes),
                "assignments_in_flight": sched.in_flight(),
                "jobs_active": sum(1 for j in sched.jobs.values() if j.active)}

    return web.Response(text=app[METRICS].render(gauges), content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


async def openapi(request: web.Request) -> web.Response:
    return json_response(openapi_document())


# -- background ---------------------------------------------------------------------------------


async def _load_state(app: web.Application) -> None:
    """Rebuild the working state from the database: nodes, then every active job's round."""
    sched = app[SCHEDULER]

    def read(conn: sqlite3.Connection) -> tuple[list[sqlite3.Row], Any]:
        nodes = conn.execute("SELECT * FROM nodes").fetchall()
        return nodes, load_jobs(conn)

    nodes, (jobs, broken) = await app[DB].read(read)
    for r in nodes:
        sched.nodes[r["id"]] = NodeState(
            id=r["id"], public_key=bytes(r["public_key"]), bench_sps=r["bench_sps"], ema_sps=r["ema_sps"],
            last_seen=r["last_seen"], banned=bool(r["banned"]), agreed=r["agreed"], disagreed=r["disagreed"],
            consecutive_valid=r["consecutive_valid"], flags_confirmed=r["flags_confirmed"],
            flags_dismissed=r["flags_dismissed"], updates_accepted=r["updates_accepted"],
            peak_flops=peak_flops(json.loads(r["benchmark"])),
        )
    for job in jobs:
        sched.add_job(job)
        app[ROUNDS].poke(job.id)  # a round with every update in aggregates now
    for job_id, reason in broken:
        log.error("job %s cannot be resumed: %s", job_id, reason)
        await app[DB].write(lambda c, j=job_id, r=reason: c.execute(
            "UPDATE jobs SET state = 'failed', error = ? WHERE id = ?", (f"cannot resume: {r}", j)))


async def _sweep(app: web.Application) -> None:
    """Expire overdue assignments (their chunks go back to the pool); settle waiting replicas."""
    cfg = app[CONFIG]
    while True:
        await asyncio.sleep(cfg.sweep_interval_s)
        try:
            await _sweep_once(app)
        except Exception:  # a failed sweep is retried next tick; it must not stop the loops
            log.exception("sweep failed")


async def _sweep_once(app: web.Application) -> None:
    sched = app[SCHEDULER]
    now = time.time()
    expired = sched.expired(now)
    if expired:
        for a in expired:
            shard = sched.detach(a)
            if shard is not None:
                sched.release_if_empty(shard)
        ids = [(a.id,) for a in expired]
        await app[DB].write(lambda c: c.executemany(
            "UPDATE assignments SET state = 'expired' WHERE id = ? AND state = 'live'", ids))
        app[METRICS].assignments_expired += len(expired)
        app[SIGNAL].notify()
    for job in list(sched.jobs.values()):
        if job.state != "running":
            continue
        waiting = any(s.state == "open" and s.accepted for s in job.shards.values())
        if waiting or job.round_complete():
            app[ROUNDS].poke(job.id)


async def _loops(app: web.Application) -> None:
    async with asyncio.TaskGroup() as tg:
        tg.create_task(app[ROUNDS].run(), name="gpuflex-rounds")
        tg.create_task(_sweep(app), name="gpuflex-sweep")


async def background(app: web.Application) -> AsyncIterator[None]:
    await _load_state(app)
    loops = asyncio.create_task(_loops(app), name="gpuflex-hub-loops")
    try:
        yield
    finally:
        loops.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loops
        # Let a running aggregation thread finish its commit before the database closes.
        await asyncio.to_thread(app[DB].close)
        app[IO_POOL].shutdown(wait=True)
        app[AUDIT].close()
