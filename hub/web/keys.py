"""The console's own application keys (the hub's live in hub/appkeys.py)."""

from __future__ import annotations

import jinja2
from aiohttp import web

from .sessions import SessionStore

__all__ = ["ASSET_VERSION", "AUDIT_STATUS_CACHE", "SESSION", "SESSIONS", "TEMPLATES"]

TEMPLATES = web.AppKey("gpuflex_console_templates", jinja2.Environment)
SESSIONS = web.AppKey("gpuflex_console_sessions", SessionStore)
ASSET_VERSION = web.AppKey("gpuflex_console_asset_version", str)
#: (log size, mtime) -> verification result, so the queue page does not re-verify an unchanged log
AUDIT_STATUS_CACHE = web.AppKey("gpuflex_console_audit_cache", dict)
#: per-request: the authenticated console session (a plain str key: web.RequestKey
#: only exists in recent aiohttp releases and pyproject allows >= 3.9)
SESSION = "gpuflex_console_session"
