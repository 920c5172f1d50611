"""A request body that stops arriving is cut off: ``HubConfig.body_idle_timeout_s``.

aiohttp waits for a body as long as the client keeps its connection open. A client that sends
a request's head (or part of its body) and then nothing would keep a handler waiting for ever,
and with it whatever the handler holds: an update's upload holds its assignment, so the node's
own retry is told the update is already being uploaded. This middleware watches each request
whose body has not all arrived when its handler starts: when the handler has waited for body
bytes for ``body_idle_timeout_s`` and none came, the read raises `BodyIdle` (408 body_idle),
the handler lets go of what it holds, the answer is written and the connection is closed.

Time the handler spends on anything else (hashing, writing to disk, waiting for the store)
does not count: only a wait for the client's bytes does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.streams import StreamReader

from ..base.errors import HubError
from .appkeys import CONFIG


class BodyIdle(HubError, TimeoutError):
    """No body bytes arrived for the idle timeout. A TimeoutError too: after the answer, aiohttp
    stops reading what is left of the body at once (its lingering read ends on a timeout) and
    closes the connection, rather than wait for more."""

    status = 408
    code = "body_idle"


class _Watch:
    """Checks one request's body stream a few times per timeout, on the event loop's timer."""

    def __init__(self, content: StreamReader, timeout_s: float) -> None:
        self.content = content
        self.timeout_s = timeout_s
        self.step_s = max(0.05, timeout_s / 4)
        self.loop = asyncio.get_running_loop()
        self.seen = content.total_bytes
        self.since = self.loop.time()
        self.timer: asyncio.TimerHandle | None = self.loop.call_later(self.step_s, self.check)

    def check(self) -> None:
        content = self.content
        self.timer = None
        if content.is_eof() or content.exception() is not None:
            return
        now = self.loop.time()
        # StreamReader keeps the future a read waits on as _waiter: set only while the handler waits
        waiting = getattr(content, "_waiter", None) is not None
        if content.total_bytes != self.seen or not waiting:
            self.seen, self.since = content.total_bytes, now
        elif now - self.since >= self.timeout_s:
            content.set_exception(BodyIdle(f"no bytes of the request body arrived for {self.timeout_s:g} s;"
                                           " the connection is closed (send the request again)"))
            return
        self.timer = self.loop.call_later(self.step_s, self.check)

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


@web.middleware
async def body_idle_guard(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    timeout_s = request.app[CONFIG].body_idle_timeout_s
    content = request.content
    if timeout_s <= 0 or content.is_eof():  # no body, or all of it here already: nothing to watch
        return await handler(request)
    watch = _Watch(content, timeout_s)
    try:
        return await handler(request)
    finally:
        watch.stop()
