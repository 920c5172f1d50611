"""Every piece of the hub's shared state, each under one typed `web.AppKey`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from aiohttp import web
from gpuflex.protocol.signing import ReplayGuard, SigningKey

from .auditlog import AuditLog
from .blobs import BlobStore
from .config import HubConfig
from .db import Database
from .metrics import HubMetrics
from .rounds import RoundEngine
from .scheduler import Scheduler, WorkSignal

CONFIG = web.AppKey("config", HubConfig)
DB = web.AppKey("db", Database)
BLOBS = web.AppKey("blobs", BlobStore)
HUB_KEY = web.AppKey("hub_key", SigningKey)
REPLAY = web.AppKey("replay", ReplayGuard)
SCHEDULER = web.AppKey("scheduler", Scheduler)
SIGNAL = web.AppKey("signal", WorkSignal)
ROUNDS = web.AppKey("rounds", RoundEngine)
METRICS = web.AppKey("metrics", HubMetrics)
AUDIT = web.AppKey("audit", AuditLog)
#: threads for blocking file work of uploads (hashing checks, fsync, rename): IO-bound, GIL released
IO_POOL = web.AppKey("io_pool", ThreadPoolExecutor)
#: the admin token printed on first start (None after)
FIRST_ADMIN_TOKEN = web.AppKey("first_admin_token", str)
