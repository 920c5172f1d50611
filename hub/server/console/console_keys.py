"""The console's own application keys (the hub's live in hub/server/appkeys.py)."""

from __future__ import annotations

from typing import Any

import jinja2
from aiohttp import web

from .sessions import Session, SessionStore

__all__ = ["ASSET_VERSION", "SESSION", "SESSIONS", "TEMPLATES"]

TEMPLATES = web.AppKey("gpuflex_console_templates", jinja2.Environment)
SESSIONS = web.AppKey("gpuflex_console_sessions", SessionStore)
ASSET_VERSION = web.AppKey("gpuflex_console_asset_version", str)
#: per-request: the authenticated console session (web.RequestKey exists only in
#: recent aiohttp releases; pyproject allows older ones, which take a str key)
SESSION: Any = (
    web.RequestKey("gpuflex_console_session", Session)
    if hasattr(web, "RequestKey")
    else "gpuflex_console_session"
)
