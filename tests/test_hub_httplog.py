"""Malformed HTTP from the network: a 400, at most one log line each (rate-limited), never a traceback."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import pytest
from gpuflex.hub.server.httplog import LINES_PER_WINDOW, BadRequestLog

MALFORMED = [
    b"GET /v1/hub HTTP/1.1\r\nHost: x\r\nX-Evil: a\x00b\r\n\r\n",  # NUL in a header value
    b"GET /v1/hub HTTP/1.1\r\nHost: x\r\nX-Evil\x01: 1\r\n\r\n",  # control char in a name
    b"GET /v1/\x00hub HTTP/1.1\r\nHost: x\r\n\r\n",  # NUL in the target
    b"GET /v1/hub HTTP/9.x\r\nHost: x\r\n\r\n",  # bad version
    b"GET /v1/hub HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"GET /v1/hub HTTP/1.1\r\nHost: x\r\n" + b"X-Long: " + b"a" * 20000 + b"\r\n\r\n",
    b"POST /v1/work HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n\r\n",
    b"POST /v1/work HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"GET /v1/hub HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n"  # a second request line below is garbage
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
]


async def _send(port: int, raw: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        return await asyncio.wait_for(reader.read(65536), 10)
    finally:
        writer.close()


@pytest.fixture
def fresh_filter(running_hub) -> BadRequestLog:
    """The filter the hub's app factory installed (none: the test fails), with a fresh window."""
    found = [f for f in logging.getLogger("aiohttp.server").filters if isinstance(f, BadRequestLog)]
    assert len(found) == 1, "create_app did not install the bad-request log filter"
    found[0].reset()
    return found[0]


async def test_each_malformed_request_is_a_400_and_one_line(running_hub, caplog, fresh_filter):
    port = int(running_hub.url.rsplit(":", 1)[1])
    for raw in MALFORMED[:LINES_PER_WINDOW]:
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
            answer = await _send(port, raw)
            await asyncio.sleep(0.05)
        assert answer.split(b"\r\n", 1)[0].split(b" ")[1].startswith(b"4"), (raw[:60], answer[:200])
        lines = [r for r in caplog.records if r.name == "aiohttp.server" and r.levelno >= logging.INFO]
        assert len(lines) <= 1, [r.getMessage() for r in lines]
        for r in caplog.records:
            assert r.exc_info is None and r.exc_text is None, r.getMessage()
            assert r.levelno < logging.ERROR
            assert "\n" not in r.getMessage() and r.getMessage().isprintable()
        if lines:
            assert lines[0].getMessage().startswith("bad HTTP request from 127.0.0.1 refused (400)")


async def test_a_flood_of_malformed_requests_is_rate_limited(running_hub, caplog, fresh_filter):
    port = int(running_hub.url.rsplit(":", 1)[1])
    with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
        for i in range(40):
            await _send(port, MALFORMED[i % len(MALFORMED)])
        await asyncio.sleep(0.1)
    lines = [r for r in caplog.records if r.name == "aiohttp.server" and r.levelno >= logging.INFO]
    assert 1 <= len(lines) <= LINES_PER_WINDOW
    assert fresh_filter.suppressed >= 40 - LINES_PER_WINDOW - 10  # a few answers are parsed as debug-only
    assert not [r for r in caplog.records if r.exc_info]
    # a good request still works on the same hub
    status = (await _send(port, b"GET /v1/hub HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")).split(b" ")[1]
    assert status == b"200"


def test_the_next_line_after_a_quiet_window_says_how_many_were_left_out():
    now = [0.0]
    f = BadRequestLog(per_window=2, window_s=10.0, clock=lambda: now[0])
    from aiohttp.http_exceptions import BadHttpMessage

    def record() -> logging.LogRecord:
        try:
            raise BadHttpMessage("bad \x00 header\nsecond line")
        except BadHttpMessage as exc:
            return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1,
                                     "Error handling request from %s", ("10.0.0.1",),
                                     (type(exc), exc, exc.__traceback__))

    passed = [f.filter(r) for r in (record() for _ in range(5))]
    assert passed == [True, True, False, False, False]
    now[0] = 11.0
    r = record()
    assert f.filter(r)
    msg = r.getMessage()
    assert "(3 more since the last line)" in msg and "\\x00" in msg and "\n" not in msg
    assert r.levelno == logging.WARNING and r.exc_info is None
    other = logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "boom", (), None)
    assert f.filter(other) and other.levelno == logging.ERROR  # the hub's own errors pass unchanged


@pytest.mark.e2e
def test_serve_process_log_has_no_traceback_for_malformed_http(hub_process):
    port = int(hub_process.url.rsplit(":", 1)[1])
    for i in range(30):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(MALFORMED[i % len(MALFORMED)])
            sock.recv(65536)
    time.sleep(0.2)
    hub_process.proc.terminate()
    rest, _ = hub_process.proc.communicate(timeout=30)
    assert "Traceback" not in rest, rest[-3000:]
    bad_lines = [line for line in rest.splitlines() if "bad HTTP request" in line]
    assert 1 <= len(bad_lines) <= LINES_PER_WINDOW, rest[-3000:]
