"""The audit log's state as the console's audit queue shows it: verified (hash chain and the hub's
signatures), with its entry count and head, or where it breaks."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from aiohttp import web

from ...storage.auditlog import verify_file
from ..appkeys import AUDIT_STATUS_CACHE, CONFIG, HUB_KEY

AUDIT_RECHECK_S = 60.0


async def audit_log_status(app: web.Application) -> dict[str, Any]:
    """Verify the hub's audit log (hash chain + signatures).

    The result is reused while the file's size and mtime are unchanged, for at most
    AUDIT_RECHECK_S: an edit that restores both still shows up within that time."""
    config = app[CONFIG]
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
    public = app[HUB_KEY].public_bytes
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
