"""Console security: headers, session cookie, CSRF, login CSRF, same-origin checks.

- Every console response carries a strict Content-Security-Policy (no inline
  script or style, nothing from another origin), X-Frame-Options DENY, a
  Referrer-Policy, nosniff, and HTML is never cached.
- The session cookie is HttpOnly, SameSite=Strict, Path=/console, Secure when
  the hub serves TLS; it holds only the random session id (see sessions.py).
- Every state-changing form carries the session's CSRF token, compared in
  constant time. The login form (no session yet) uses a double-submit token:
  a random value in a short-lived SameSite=Strict cookie that must equal the
  hidden form field. POSTs from another origin (Origin header) are refused too.
"""

from __future__ import annotations

from aiohttp import web

from .sessions import csrf_matches

__all__ = [
    "CONSOLE_PREFIX",
    "CSP",
    "LOGIN_CSRF_COOKIE",
    "SESSION_COOKIE",
    "add_security_headers",
    "clear_session_cookie",
    "is_console_path",
    "same_origin",
    "set_session_cookie",
]

CONSOLE_PREFIX = "/console"
SESSION_COOKIE = "gpuflex_console"
LOGIN_CSRF_COOKIE = "gpuflex_login_csrf"
COOKIE_PATH = "/console"

CSP = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "font-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)

HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "X-Content-Type-Options": "nosniff",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Permissions-Policy": "camera=(), microphone=(), geolocation=(), interest-cohort=()",
}


def is_console_path(path: str) -> bool:
    return path == "/" or path == CONSOLE_PREFIX or path.startswith(CONSOLE_PREFIX + "/")


async def add_security_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare hook: applies to console paths only (the API is the hub's)."""
    if not is_console_path(request.path):
        return
    for name, value in HEADERS.items():
        response.headers.setdefault(name, value)
    if not request.path.startswith(CONSOLE_PREFIX + "/static/"):
        response.headers["Cache-Control"] = "no-store"
    if request.secure:
        response.headers.setdefault("Strict-Transport-Security", "max-age=31536000")


def set_session_cookie(request: web.Request, response: web.StreamResponse, sid: str) -> None:
    response.set_cookie(
        SESSION_COOKIE,
        sid,
        path=COOKIE_PATH,
        httponly=True,
        samesite="Strict",
        secure=request.secure,
    )


def clear_session_cookie(response: web.StreamResponse) -> None:
    response.del_cookie(SESSION_COOKIE, path=COOKIE_PATH)


def set_login_csrf_cookie(request: web.Request, response: web.StreamResponse, value: str) -> None:
    response.set_cookie(
        LOGIN_CSRF_COOKIE,
        value,
        path=COOKIE_PATH,
        httponly=True,
        samesite="Strict",
        secure=request.secure,
        max_age=3600,
    )


def same_origin(request: web.Request) -> bool:
    """False when the browser says the request comes from another site.

    Browsers send Origin on POST; a missing header (old clients, curl) is left
    to the CSRF token, which is checked regardless. Only the host:port is
    compared: behind a TLS-terminating proxy the hub sees http while the
    browser's origin says https.
    """
    origin = request.headers.get("Origin")
    if origin is None:
        return True
    if origin == "null":
        return False
    _scheme, sep, rest = origin.partition("://")
    return bool(sep) and rest.rstrip("/").lower() == request.host.lower()


def login_csrf_ok(request: web.Request, submitted: str | None) -> bool:
    return csrf_matches(request.cookies.get(LOGIN_CSRF_COOKIE, ""), submitted)
