"""The hub's app factory: state under typed AppKeys, routes, error middleware, background loops."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
from aiohttp import web
from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.signing import ReplayGuard

from ..base.config import HubConfig
from ..base.errors import HubError, TooManyRequests
from ..domain.ledger import Ledger
from ..domain.metrics import HubMetrics
from ..domain.scheduler import Scheduler
from ..domain.worksignal import WorkSignal
from ..model.relay import RelayRegistry
from ..storage import backend
from ..storage.auditlog import AuditLog
from ..storage.backend import open_blob_store
from ..storage.datalock import DataLock
from ..storage.db import Database
from ..storage.deltas import ModelDeltas
from ..storage.hub_key import load_or_create_hub_key
from ..storage.migrate import refuse_if_migrated
from ..storage.store import Store
from . import relay, routes_audit, routes_link, routes_node, routes_owner, routes_pipeline
from .appkeys import (
    AUDIT,
    AUDIT_STATUS_CACHE,
    BLOBS,
    CONFIG,
    DB,
    DELTAS,
    FIRST_ADMIN_TOKEN,
    HUB_KEY,
    IO_POOL,
    LAYER_CACHE,
    LEDGER,
    LOOPS,
    METRICS,
    PLAN_CACHE,
    RELAY,
    REPLAY,
    STORE,
)
from .bodywatch import body_idle_guard
from .edge import guard_edge
from .loops import LoopHealth, supervise
from .openapi import openapi_document
from .relaybox import Relay
from .wire import PEER_HEADER, SCHEME_HEADER, error_response, json_response, protocol_to_hub

if TYPE_CHECKING:
    from ..storage.lease import Lease

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
        resp = error_response(exc.status, exc.code, exc.detail)
        if isinstance(exc, TooManyRequests):
            resp.headers["Retry-After"] = str(exc.retry_after_s)
        return resp
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


@web.middleware
async def forwarded_peer(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """A request that a forwarding worker passed on (`serve --workers N`, hub/server/workers.py) arrives
    on the leader's Unix socket, with the client's address in X-GPUFlex-Peer and its scheme in
    X-GPUFlex-Scheme: the address every per-address rule (admission, replica separation, the HTTP
    log) must see. Only on that socket (mode 0600, in the 0700 data folder) are the headers
    believed; over TCP they are ignored."""
    transport = request.transport
    if transport is not None and isinstance(transport.get_extra_info("sockname"), str):
        peer = request.headers.get(PEER_HEADER)
        if peer:
            # the worker ended TLS (if any): the scheme is the client's, for the console's cookies
            scheme = "https" if request.headers.get(SCHEME_HEADER) == "https" else "http"
            request = request.clone(remote=peer, scheme=scheme)
    return await handler(request)


def open_store(config: HubConfig) -> tuple[Database, Store]:
    """The database and the `Store` on it: SQLite in the data folder, or PostgreSQL when
    `config.store` names one (StoreUnavailable, one line, when it cannot be used); the one switch
    is hub/storage/backend.py's. A SQLite hub in a folder whose state moved to PostgreSQL is
    refused in one line, not started empty."""
    if config.store is None:
        refuse_if_migrated(config.data_dir)
    return backend.open_store(config.data_dir, config.store)


def create_app(config: HubConfig, lease: Lease | None = None) -> web.Application:
    """Build the hub. First start creates the key (0600), the database (SQLite's WAL file, or the
    schema in the PostgreSQL database `config.store` names) and the blob store.

    On PostgreSQL the hub leads the database (hub/storage/lease.py): ``lease`` is one this process already
    holds (a worker of `serve --workers N` that waited its turn); without one, the lease is taken
    here, and a database another hub leads is refused in one line (DatabaseBusy)."""
    config.data_dir.mkdir(parents=True, exist_ok=True)
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)
    with contextlib.suppress(OSError):
        os.chmod(config.data_dir, 0o700)
    lock = DataLock(config.data_dir, "a hub").acquire()  # one hub process per data folder
    try:
        if config.store is not None and lease is None:
            from ..storage.lease import Lease  # psycopg: the postgres extra

            lease = Lease(config.store, "gpuflex-hub").acquire()  # one leading hub per database
    except BaseException:
        lock.release()
        raise
    try:
        key, _created = load_or_create_hub_key(config.key_path)
        blobs = open_blob_store(config)  # a bucket that cannot be used: one line, here at start-up
        db, store = open_store(config)
    except BaseException:
        lock.release()
        if lease is not None:
            lease.release()
        raise
    admin_token = store.first_admin_token_sync()
    app = web.Application(middlewares=[forwarded_peer, error_middleware, body_idle_guard],
                          client_max_size=config.max_message_bytes)
    metrics = HubMetrics()
    audit = AuditLog(config.audit_log_path, key)
    scheduler = Scheduler(min_deadline_s=config.min_deadline_s, online_window_s=config.online_window_s,
                          rng=random.Random(int.from_bytes(os.urandom(8), "big")),
                          separate_replicas=config.separate_replicas, trust_min_age_s=config.trust_min_age_s,
                          unproven_max_chunks=config.unproven_max_chunks)
    app[CONFIG] = config
    app[DB] = db
    app[STORE] = store
    app[BLOBS] = blobs
    app[HUB_KEY] = key
    # Nonces live in memory only: a request signed before this start is refused (see ReplayGuard).
    app[REPLAY] = ReplayGuard(window_s=config.replay_window_s, not_before=time.time())
    app[METRICS] = metrics
    app[AUDIT] = audit
    app[LOOPS] = LoopHealth()
    app[IO_POOL] = ThreadPoolExecutor(max_workers=config.io_threads, thread_name_prefix="gpuflex-hub-io")
    app[DELTAS] = deltas = ModelDeltas(blobs, app[IO_POOL])
    app[FIRST_ADMIN_TOKEN] = admin_token
    plans = RelayRegistry()  # the relay's plans: the pipelines' coordinator keeps them
    app[RELAY] = Relay(registry=plans)
    app[LAYER_CACHE] = {}
    app[AUDIT_STATUS_CACHE] = {}
    app[PLAN_CACHE] = {}
    app[LEDGER] = Ledger(config=config, store=store, blobs=blobs, key=key, scheduler=scheduler,
                         signal=WorkSignal(), metrics=metrics, audit=audit, relay=plans)
    app[LEDGER].rounds.on_new_model = deltas.published  # its delta made at once, if nodes take deltas
    for module in (routes_node, routes_owner, routes_audit, relay, routes_pipeline, routes_link):
        app.add_routes(module.routes)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", prometheus)
    app.router.add_get("/v1/openapi.json", openapi)
    app.cleanup_ctx.append(background)

    async def release_data_folder(_app: web.Application) -> None:  # after background's cleanup
        lock.release()
        if lease is not None:
            lease.release()

    app.on_cleanup.append(release_data_folder)
    app.on_shutdown.append(_wake_long_polls)
    guard_edge(app)  # malformed HTTP, undocumented query parameters: 4xx, one log line (hub/server/edge.py)
    _attach_console(app)
    return app


async def _wake_long_polls(app: web.Application) -> None:
    """Shutdown waits for in-flight handlers: answer every waiting long-poll now (NoWork,
    retry soon; a relay take, 204) rather than let each run out its wait (up to long_poll_max_s)."""
    app[LEDGER].signal.close()
    app[RELAY].wake_all()


def _attach_console(app: web.Application) -> None:
    """The web console (hub/server/console) mounts itself under /console."""
    from .console import setup_console

    setup_console(app)


async def healthz(request: web.Request) -> web.Response:
    """200 while the store answers and every background loop runs; 503 naming what is down."""
    app = request.app
    await app[STORE].ping()
    loops = app[LOOPS]
    doc = {"ok": not loops.down, "fingerprint": app[HUB_KEY].fingerprint, "loops": loops.report()}
    if loops.down:
        doc["error"] = "; ".join(f"the {s.name} loop died ({s.last_error}) and is restarting" for s in loops.down)
        return json_response(doc, status=503)
    return json_response(doc)


async def prometheus(request: web.Request) -> web.Response:
    app = request.app
    sched = app[LEDGER].scheduler

    def gauges() -> dict[str, float]:
        now = time.time()
        return {"nodes_online": sched.presence.online_nodes(now), "nodes_registered": len(sched.nodes),
                "assignments_in_flight": sched.in_flight(),
                "jobs_active": sum(1 for j in sched.jobs.values() if j.active),
                "loops_down": len(app[LOOPS].down)}

    return web.Response(text=app[METRICS].render(gauges), content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


async def openapi(request: web.Request) -> web.Response:
    return json_response(openapi_document())


# -- background ---------------------------------------------------------------------------------


#: seconds between two looks for interrupted uploads whose assignment is over
PARTIAL_SWEEP_S = 30.0


async def _sweep(app: web.Application) -> None:
    """Expire overdue assignments (their chunks go back to the pool); settle waiting replicas;
    now and then, drop what interrupted uploads left for assignments that are over."""
    cfg = app[CONFIG]
    next_partials = 0.0
    while True:
        await asyncio.sleep(cfg.sweep_interval_s)
        await _sweep_once(app)
        if time.monotonic() >= next_partials:
            next_partials = time.monotonic() + PARTIAL_SWEEP_S
            await drop_stale_partials(app)


async def drop_stale_partials(app: web.Application) -> int:
    """Delete the bytes of interrupted uploads whose assignment is no longer live; how many."""
    blobs = app[BLOBS]
    held = await asyncio.to_thread(blobs.partial_uploads)
    stale = app[LEDGER].uploads.stale_partials(held)
    for path in stale:
        await asyncio.to_thread(path.unlink, missing_ok=True)
    return len(stale)


async def _sweep_once(app: web.Application) -> None:
    ledger = app[LEDGER]
    await ledger.assignments.expire_overdue(time.time())
    for job in list(ledger.scheduler.jobs.values()):
        if job.state != "running":
            continue
        waiting = any(s.state == "open" and s.accepted for s in job.shards.values())
        if waiting or job.round_complete(time.time(), ledger.scheduler.presence.is_online):
            ledger.rounds.poke(job.id)


async def _loops(app: web.Application) -> None:
    ledger, health, cfg = app[LEDGER], app[LOOPS], app[CONFIG]

    async def rounds_crashed(exc: BaseException) -> None:
        job = ledger.rounds.current
        ledger.rounds.current = None
        if job is not None:
            job.error = f"the round loop failed while closing round {job.round}: {exc}".splitlines()[0]

    async with asyncio.TaskGroup() as tg:
        tg.create_task(supervise("rounds", ledger.rounds.run, health, on_crash=rounds_crashed,
                                 first_delay_s=cfg.loop_restart_s), name="gpuflex-rounds")
        tg.create_task(supervise("sweep", lambda: _sweep(app), health, first_delay_s=cfg.loop_restart_s),
                       name="gpuflex-sweep")
        tg.create_task(supervise("pipelines", ledger.pipelines.run, health, first_delay_s=cfg.loop_restart_s),
                       name="gpuflex-pipelines")
        tg.create_task(supervise("relay_hang_ups", app[RELAY].watch, health, first_delay_s=cfg.loop_restart_s),
                       name="gpuflex-relay-hang-ups")
        tg.create_task(supervise("stage_checks", ledger.pipelines.checks.run, health,
                                 first_delay_s=cfg.loop_restart_s), name="gpuflex-stage-checks")


async def background(app: web.Application) -> AsyncIterator[None]:
    await app[LEDGER].load()
    loops = asyncio.create_task(_loops(app), name="gpuflex-hub-loops")
    try:
        yield
    finally:
        loops.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loops
        # Let a running aggregation thread finish its commit before the database closes.
        await asyncio.to_thread(app[STORE].close)
        app[IO_POOL].shutdown(wait=True)
        app[BLOBS].close()
        app[AUDIT].close()
