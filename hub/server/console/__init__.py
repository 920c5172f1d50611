"""GPUFlex web console: pages for owners, auditors and operators, served by the hub.

``setup_console(app)`` is the one entry point: ``create_app`` calls it once, after
the hub's own routes. It adds

- ``GET /`` -> ``/console/``, the pages under ``/console/...`` (see routes.py),
- the static files under ``/console/static/`` (CSS and one small polling script;
  nothing is ever loaded from another origin: the hub may run air-gapped),
- jinja2 templates (aiohttp-jinja2, autoescaping on) under the console's own key,
- a middleware that only touches console paths (session, CSRF, HTML errors),
- an ``on_response_prepare`` hook adding security headers to console paths,
- a cleanup context that opens/closes the session store
  (``<data_dir>/console.sqlite3``).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp_jinja2
import jinja2
from aiohttp import web
from markupsafe import Markup

from .console_keys import ASSET_VERSION, SESSIONS, TEMPLATES
from .routes import add_routes, console_middleware
from .security import CONSOLE_PREFIX, add_security_headers
from .sessions import SessionStore

__all__ = ["setup_console"]

HERE = Path(__file__).resolve().parent
STATIC_DIR = HERE / "static"
TEMPLATE_DIR = HERE / "templates"


# --------------------------------------------------------------------------- filters


def _finite(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def f_num(v: Any) -> str:
    x = _finite(v)
    if x is None:
        return "—"
    if x == 0:
        return "0"
    if abs(x) >= 1e6 or abs(x) < 1e-3:
        return f"{x:.3g}"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.4g}"


def f_pct(v: Any) -> str:
    x = _finite(v)
    return "—" if x is None else f"{100 * x:.1f}%"


def f_bytes(v: Any) -> str:
    x = _finite(v)
    if x is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return "—"


def f_size(v: Any) -> str:
    """Bytes in the decimal units `--max-memory 6MB` is given in (and `job status` prints)."""
    x = _finite(v)
    if x is None:
        return "—"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x:.0f} B"


def f_flops(v: Any) -> str:
    """A speed in FLOP/s, in the decimal unit that keeps it readable (the plan's node offers)."""
    x = _finite(v)
    if x is None:
        return "—"
    for unit, scale in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6), ("kFLOP/s", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} FLOP/s"


def f_secs(v: Any) -> str:
    """A duration as `job status` prints it: milliseconds under a second."""
    x = _finite(v)
    if x is None:
        return "—"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def f_ago(v: Any) -> str:
    x = _finite(v)
    if x is None:
        return "—"
    d = max(0.0, time.time() - x)
    if d < 5:
        return "just now"
    if d < 90:
        return f"{d:.0f} s ago"
    if d < 5400:
        return f"{d / 60:.0f} min ago"
    if d < 36 * 3600:
        return f"{d / 3600:.1f} h ago"
    return f"{d / 86400:.1f} days ago"


def f_dt(v: Any) -> str:
    x = _finite(v)
    if x is None:
        return "—"
    return datetime.fromtimestamp(x, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def f_short(v: Any) -> str:
    s = str(v or "")
    return s if len(s) <= 32 else s[:31] + "…"


NODE_SHOWN = 13  # "gf1-abcd-efgh": the first two groups of a node id


def f_node(v: Any, full: bool = False) -> Markup:
    """A node id that never breaks across lines: whole (``full``) or its first two groups, the
    whole id in its title (shown on hover) either way."""
    s = str(v or "")
    shown = s if full or len(s) <= NODE_SHOWN + 1 else s[:NODE_SHOWN] + "…"
    return Markup('<span class="mono nodeid" title="{0}">{1}</span>').format(s, shown)


# --------------------------------------------------------------------------- setup


def _asset_version() -> str:
    h = hashlib.sha256()
    for p in sorted(STATIC_DIR.iterdir()):
        if p.is_file():
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:12]


def setup_console(app: web.Application) -> None:
    """Add the web console to the hub's app (call once, before the app starts)."""
    version = _asset_version()
    app[ASSET_VERSION] = version
    env = aiohttp_jinja2.setup(
        app,
        app_key=TEMPLATES,
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        autoescape=True,
        undefined=jinja2.ChainableUndefined,
        default_helpers=False,
        filters={
            "num": f_num,
            "pct": f_pct,
            "bytes": f_bytes,
            "size": f_size,
            "secs": f_secs,
            "flops": f_flops,
            "ago": f_ago,
            "dt": f_dt,
            "short": f_short,
            "node": f_node,
        },
    )
    env.globals.pop("app", None)  # templates get only what a handler hands them
    env.globals["asset"] = lambda name: f"{CONSOLE_PREFIX}/static/{name}?v={version}"
    add_routes(app)
    app.router.add_static(CONSOLE_PREFIX + "/static/", STATIC_DIR, name="console-static")
    app.middlewares.append(console_middleware)
    app.on_response_prepare.append(add_security_headers)
    app.cleanup_ctx.append(_session_store)


async def _session_store(app: web.Application) -> AsyncIterator[None]:
    from gpuflex.hub.server import appkeys

    data_dir = Path(app[appkeys.CONFIG].data_dir)
    store = SessionStore(data_dir / "console.sqlite3")
    app[SESSIONS] = store
    try:
        yield
    finally:
        store.close()
