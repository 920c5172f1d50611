"""Every piece of the hub's shared state, each under one typed `web.AppKey`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from aiohttp import web
from gpuflex.protocol.signing import ReplayGuard, SigningKey

from ..base.config import HubConfig
from ..domain.ledger import Ledger
from ..domain.metrics import HubMetrics
from ..storage.auditlog import AuditLog
from ..storage.blobs import BlobStore
from ..storage.db import Database
from ..storage.deltas import ModelDeltas
from ..storage.store import Store
from .loops import LoopHealth
from .relaybox import Relay

CONFIG = web.AppKey("config", HubConfig)
#: the store's database (SQLite, or PostgreSQL's PgDatabase): the read model's and tokens' queries
DB = web.AppKey("db", Database)
#: every state change goes through the ledger (it holds the scheduler, the round engine, the store)
LEDGER = web.AppKey("ledger", Ledger)
STORE = web.AppKey("store", Store)
#: the background loops' health (a dead loop turns /healthz 503)
LOOPS = web.AppKey("loops", LoopHealth)
BLOBS = web.AppKey("blobs", BlobStore)
#: model deltas for nodes that hold the previous model (hub/storage/deltas.py)
DELTAS = web.AppKey("deltas", ModelDeltas)
HUB_KEY = web.AppKey("hub_key", SigningKey)
REPLAY = web.AppKey("replay", ReplayGuard)
METRICS = web.AppKey("metrics", HubMetrics)
AUDIT = web.AppKey("audit", AuditLog)
#: threads for blocking file work of uploads (hashing checks, fsync, rename): IO-bound, GIL released
IO_POOL = web.AppKey("io_pool", ThreadPoolExecutor)
#: the admin token printed on first start (None after)
FIRST_ADMIN_TOKEN = web.AppKey("first_admin_token", str)
#: the pipeline relay: its plans and its in-memory mailboxes (hub/server/relay.py)
RELAY = web.AppKey("relay", Relay)
#: the read model's: flag id -> a closed round's per-layer evidence (bounded; blobs never change)
LAYER_CACHE = web.AppKey("layer_cache", dict)
#: the read model's: (log size, mtime) -> the audit log's verification, so an unchanged log is not re-read
AUDIT_STATUS_CACHE = web.AppKey("audit_status_cache", dict)
#: the read model's: job id -> its model cut into pipeline units and measured, or why it cannot be
#: (readmodel/plans.py; a job's spec never changes)
PLAN_CACHE = web.AppKey("plan_cache", dict)
