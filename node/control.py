"""The local control endpoint: status, pause, resume, for the volunteer only.

Served on 127.0.0.1 at a random port (written to DIR/control.url) and guarded by a
fresh random token in DIR/control.token (0600, owner only), compared in constant time.
Anyone who can read the token file is the volunteer (or root); nobody else on the
machine can drive the node.

    GET  /v1/status   -> JSON status
    POST /v1/pause    -> JSON {"paused": true, "changed": bool, "assignment": null or
                                {"assignment_id": id, "outcome": "handed_back" | "not_told" | "ended" | "pending"}}
    POST /v1/resume   -> JSON {"paused": false, "changed": bool}
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import secrets
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from .errors import ControlError
from .files import write_private_file

TOKEN_FILE = "control.token"  # noqa: S105 - a file name, not a secret
URL_FILE = "control.url"


class Controllable(Protocol):
    """What the endpoint drives: the running node (it never imports the agent)."""

    def status(self) -> dict[str, Any]: ...

    async def pause_and_report(self, reason: str = "user") -> dict[str, Any]: ...

    def resume(self) -> bool: ...


class EventSink(Protocol):
    def event(self, event: str, **fields: Any) -> None: ...


_NODE: web.AppKey[Controllable] = web.AppKey("node", Controllable)
_TOKEN: web.AppKey[str] = web.AppKey("token", str)


@web.middleware
async def _auth(request: web.Request, handler: Any) -> web.StreamResponse:
    expected = request.app[_TOKEN]
    given = request.headers.get("Authorization", "")
    prefix = "Bearer "
    token = given[len(prefix):] if given.startswith(prefix) else ""
    if not hmac.compare_digest(token.encode(), expected.encode()):
        return web.json_response(
            {"error": "unauthorized", "detail": f"send the token from {TOKEN_FILE} as a Bearer token"},
            status=401,
        )
    response: web.StreamResponse = await handler(request)
    return response


async def _status(request: web.Request) -> web.Response:
    return web.json_response(request.app[_NODE].status())


async def _pause(request: web.Request) -> web.Response:
    return web.json_response(await request.app[_NODE].pause_and_report("user"))


async def _resume(request: web.Request) -> web.Response:
    changed = request.app[_NODE].resume()
    return web.json_response({"paused": False, "changed": changed})


def create_control_app(node: Controllable, token: str) -> web.Application:
    app = web.Application(middlewares=[_auth], client_max_size=4096)
    app[_NODE] = node
    app[_TOKEN] = token
    app.router.add_get("/v1/status", _status)
    app.router.add_post("/v1/pause", _pause)
    app.router.add_post("/v1/resume", _resume)
    return app


class ControlServer:
    """Serves the endpoint until ``stop`` is set; its files exist exactly that long.

    The node holds the data dir's lock before it serves, so the files are this process's
    own; even so, clean-up removes only a URL and a token that are still the ones it wrote.
    """

    def __init__(self, node: Controllable, data_dir: Path, output: EventSink) -> None:
        self.node = node
        self.data_dir = data_dir
        self.output = output
        self.url = ""

    async def serve(self, stop: asyncio.Event) -> None:
        token = secrets.token_urlsafe(32)
        write_private_file(self.data_dir / TOKEN_FILE, token + "\n")
        runner = web.AppRunner(create_control_app(self.node, token), access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            server = site._server
            sockets = getattr(server, "sockets", None) or []
            port = sockets[0].getsockname()[1]
            self.url = f"http://127.0.0.1:{port}"
            write_private_file(self.data_dir / URL_FILE, self.url + "\n")
            self.output.event("control", url=self.url)
            await stop.wait()
        finally:
            # the token dies with the endpoint
            for name, mine in ((URL_FILE, self.url), (TOKEN_FILE, token)):
                path = self.data_dir / name
                with contextlib.suppress(OSError):
                    if mine and path.read_text(encoding="utf-8").strip() == mine:
                        path.unlink()
            await runner.cleanup()


# ---------------------------------------------------------------- client side (CLI)


def call_control(data_dir: Path, method: str, path: str, *, timeout_s: float = 5.0) -> dict[str, Any]:
    """Call the running node's control endpoint; ControlError with an actionable line."""
    try:
        url = (data_dir / URL_FILE).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise ControlError(f"no node is running with data dir {data_dir} ({URL_FILE} not found)") from None
    try:
        token = (data_dir / TOKEN_FILE).read_text(encoding="utf-8").strip()
    except PermissionError:
        raise ControlError(f"cannot read {data_dir / TOKEN_FILE}: run as the user who runs the node") from None
    except FileNotFoundError:
        raise ControlError(f"{data_dir / TOKEN_FILE} is missing; restart the node") from None
    if not url.startswith("http://127.0.0.1:"):
        raise ControlError(f"{data_dir / URL_FILE} does not name a local endpoint: {url[:80]!r}")
    req = urllib.request.Request(  # noqa: S310 - a loopback http URL checked above
        url + path, method=method, data=b"" if method == "POST" else None,
        headers={"Authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310
            result: dict[str, Any] = json.loads(resp.read(1 << 20))
            return result
    except urllib.error.HTTPError as exc:
        raise ControlError(f"control endpoint answered {exc.code}: {exc.read(300).decode(errors='replace')}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ControlError(f"node not reachable at {url} ({exc}); is it running?") from None
