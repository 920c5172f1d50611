"""Bad HTTP from the network is the client's fault: a 4xx and at most one log line, never a traceback.

Two places let a malformed request reach the log as a traceback:

- aiohttp's own parser (a bad request line, a header holding a control character, a broken
  chunked body) answers 400 itself and logs the parser's exception with its traceback at
  error level on the ``aiohttp.server`` logger. `BadRequestLog`, a filter on that logger,
  turns such a record into one warning line (who, what, sanitised) and rate-limits them:
  a fuzzer or a port scanner must not fill the disk.
- a handler that reads a body (multipart part headers, chunked payloads) meets the same
  parser errors as exceptions; `client_errors` maps them to 400 ``bad_request`` before the
  error middleware would call them a 500.

hub/server/edge.py installs both; the filter once per process (logging is global).
Errors of the hub itself (status 500) keep their tracebacks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from ..base.errors import BadRequest

SERVER_LOGGER = "aiohttp.server"
LINES_PER_WINDOW = 5
WINDOW_S = 60.0
MAX_DETAIL = 200


def client_fault(exc: BaseException | None) -> bool:
    """An HTTP parse error caused by what the client sent (4xx), not by the hub."""
    return isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 400) < 500


def one_line(text: str) -> str:
    """Printable, single-line, bounded: bytes from the network never forge log lines."""
    flat = "".join(ch if ch.isprintable() else f"\\x{ord(ch):02x}" for ch in " ".join(text.split()))
    return flat[:MAX_DETAIL] + ("..." if len(flat) > MAX_DETAIL else "")


def describe(exc: HttpProcessingError) -> str:
    return one_line(f"{exc.__class__.__name__}: {exc.message or ''}")


class BadRequestLog(logging.Filter):
    """Rewrites aiohttp.server's tracebacks for malformed client requests into one warning
    line, at most `per_window` lines per `window_s` seconds; the next line that passes says
    how many were left out. Other records pass unchanged."""

    def __init__(self, *, per_window: int = LINES_PER_WINDOW, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__("gpuflex.bad_request")
        self.per_window = per_window
        self.window_s = window_s
        self.clock = clock
        self._lock = threading.Lock()
        self._window_start = -float("inf")
        self._in_window = 0
        self.suppressed = 0

    def reset(self) -> None:
        """Start a fresh window (tests; an operator's log rotation needs nothing)."""
        with self._lock:
            self._window_start, self._in_window, self.suppressed = -float("inf"), 0, 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError) or not client_fault(exc):
            return True
        with self._lock:
            now = self.clock()
            if now - self._window_start >= self.window_s:
                self._window_start, self._in_window = now, 0
            if self._in_window >= self.per_window:
                self.suppressed += 1
                return False
            self._in_window += 1
            left_out, self.suppressed = self.suppressed, 0
        remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        record.msg = "bad HTTP request from %s refused (400): %s%s"
        record.args = (one_line(str(remote)), describe(exc),
                       f" ({left_out} more since the last line)" if left_out else "")
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


_FILTER_LOCK = threading.Lock()


def install_log_filter(logger_name: str = SERVER_LOGGER) -> BadRequestLog:
    """Attach one BadRequestLog to aiohttp's server logger (idempotent); returns it."""
    logger = logging.getLogger(logger_name)
    with _FILTER_LOCK:
        for f in logger.filters:
            if isinstance(f, BadRequestLog):
                return f
        f = BadRequestLog()
        logger.addFilter(f)
        return f


@web.middleware
async def client_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """A parse error met while a handler reads the body is a 400, not a 500."""
    try:
        return await handler(request)
    except HttpProcessingError as exc:
        if not client_fault(exc):
            raise
        raise BadRequest(f"malformed request: {describe(exc)}", code="bad_request") from None
