"""What every request meets before a handler: the hub's edge guards, installed by `guard_edge`.

- Malformed HTTP is the client's fault: a 4xx and at most one rate-limited log line, never a
  traceback (hub/server/httplog.py).
- The OpenAPI document is the contract for query strings too: a query parameter that the
  document does not name for that operation is refused (400 bad_query), so a typo such as
  `?rounds=3` never silently means "the latest model". Console pages are not API operations
  and keep their own parameters.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from ..base.errors import BadRequest
from .httplog import client_errors, install_log_filter
from .openapi import openapi_document

QueryRule = dict[tuple[str, str], frozenset[str]]
QUERY_RULES: web.AppKey[QueryRule] = web.AppKey("gpuflex_query_rules", dict)


def documented_queries() -> QueryRule:
    """(METHOD, path template) -> the query parameter names the document allows."""
    rules: QueryRule = {}
    for path, ops in openapi_document()["paths"].items():
        for method, op in ops.items():
            names = frozenset(p["name"] for p in op.get("parameters", ()) if p.get("in") == "query")
            rules[(method.upper(), path)] = names
    return rules


@web.middleware
async def documented_query_only(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    if request.query:
        resource = request.match_info.route.resource
        canonical = resource.canonical if resource is not None else None
        allowed = request.app[QUERY_RULES].get((request.method, canonical or ""))
        if allowed is not None:
            unknown = sorted(set(request.query) - allowed)
            if unknown:
                known = ", ".join(sorted(allowed)) or "none"
                raise BadRequest(f"unknown query parameter {unknown[0][:40]!r}; this operation takes: {known}",
                                 code="bad_query")
    return await handler(request)


def guard_edge(app: web.Application) -> None:
    """Install the edge guards (from create_app, before the app starts)."""
    app[QUERY_RULES] = documented_queries()
    app.middlewares.append(client_errors)
    app.middlewares.append(documented_query_only)
    install_log_filter()
