"""`gpuflex-hub serve --workers N`: N hub processes behind one address, on one PostgreSQL database.

The shape (a pre-fork server with a leader):

- **The supervisor** (the `serve` process) opens the listening socket once and starts N worker
  processes that inherit it, so the kernel hands each new connection to whichever worker
  accepts first. It restarts a worker that ends (kill -9 included), and stops them all on
  SIGTERM.
- **One worker leads.** The hub's round state lives in memory beside the store
  (hub/domain/ledger/), so exactly one process may hold it: the one holding the database's lease
  (hub/storage/lease.py, a PostgreSQL advisory lock). The leader is a whole hub: it closes every
  round, so no round is closed twice, and it checks every signed request against one replay
  cache, so a request replayed to another worker is refused like any replay. It also listens
  on ``leader.sock`` in the data folder (mode 0700), for the other workers.
- **The others forward.** A worker in line answers the connections it accepts by passing each
  request on to the leader's socket, streamed both ways (an update upload is never held in
  memory), with the client's address in ``X-GPUFlex-Peer``, which the leader believes only on
  that socket (hub/server/app.py's ``forwarded_peer``). A long-poll waits at the leader, so a round's
  opening wakes every node, whichever worker holds its connection. Meanwhile the worker waits
  for the lease.
- **kill -9 of the leader** drops its connection to PostgreSQL and with it the lease: within
  lease.POLL_S one of the others takes it, loads the state from the database as a restarted
  hub does (everything acknowledged was committed before its 2xx) and leads; until then the
  others answer 503 with Retry-After, which nodes retry. The supervisor starts a new worker,
  which gets in line. kill -9 of a forwarding worker loses only its open connections.

What it is not: a way to use more cores for the ledger. Every request still runs through the
leader's one event loop; the workers add a hop. bench/hub_load.py measures what that costs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from ..base.config import HubConfig
from ..base.errors import HubError
from .wire import PEER_HEADER, SCHEME_HEADER, error_response

log = logging.getLogger("gpuflex.hub.workers")

LEADER_SOCKET = "leader.sock"
#: a worker that keeps ending this soon after its start is not restarted again
CRASH_WINDOW_S = 5.0
CRASHES_MAX = 5
#: hop-by-hop headers (RFC 9110 7.6.1) and those aiohttp sets itself
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                  "transfer-encoding", "upgrade", "host", "content-length"})
#: how long a forwarding worker tries to connect to the leader before it answers 503
CONNECT_RETRY_S = 2.0
#: the leader's socket's accept queue (its default, 128, overflows when 1,000 long-polls arrive at once)
LEADER_BACKLOG = 4096
# the longest a socket path may be (sun_path is 108 bytes with its NUL on Linux)
_SUN_PATH_MAX = 107


NEEDS_POSTGRES = ("--workers N needs --store postgresql://...: every worker shares the hub's state, and SQLite"
                  " is one process's file")


class WorkersError(HubError):
    """--workers cannot run as asked."""

    status = 400
    code = "workers"


def leader_socket(data_dir: Path) -> Path:
    path = data_dir.resolve() / LEADER_SOCKET
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        raise WorkersError(f"--workers: the leader's socket {path} is longer than a Unix socket path may be"
                           f" ({_SUN_PATH_MAX} bytes); use a shorter --data path")
    return path


def check(workers: int, store: str | None, data_dir: Path) -> None:
    """One line, before anything starts, when --workers cannot be served."""
    if workers < 1:
        raise WorkersError(f"--workers takes 1 or more, not {workers}")
    if workers > 1 and store is None:
        raise WorkersError(NEEDS_POSTGRES)
    if workers > 1:
        leader_socket(data_dir)


# -- the supervisor -------------------------------------------------------------------------------


def supervise(argv: Sequence[str], workers: int, host: str, port: int, data_dir: Path, scheme: str) -> int:
    """Open the address, run ``workers`` worker processes on it, restart those that end; until
    SIGTERM or SIGINT. ``argv``: the serve command's own arguments, given to each worker."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family, backlog=4096)
    listener.set_inheritable(True)
    bound = listener.getsockname()[1]
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    def start(index: int) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "gpuflex.hub", *argv, "--worker-fd", str(listener.fileno()),
               "--worker-index", str(index)]
        return subprocess.Popen(cmd, pass_fds=(listener.fileno(),))

    procs = {i: start(i) for i in range(workers)}
    started = {i: time.monotonic() for i in procs}
    crashes = dict.fromkeys(procs, 0)
    print(f"gpuflex-hub supervisor (pid {os.getpid()}): {workers} workers on {host}:{bound}", flush=True)
    url_written = False
    code = 0
    try:
        while not stop.is_set():
            if not url_written and _leading(data_dir):
                url_written = True
                shown = host if ":" not in host else f"[{host}]"
                url = f"{scheme}://{shown}:{bound}"
                tmp = data_dir / "hub.url.tmp"
                tmp.write_text(url + "\n")
                os.replace(tmp, data_dir / "hub.url")
                print(f"gpuflex-hub listening on {url}", flush=True)
                print(f"web console: {url}/console/ (log in with a token)", flush=True)
            for i, p in list(procs.items()):
                rc = p.poll()
                if rc is None:
                    continue
                quick = time.monotonic() - started[i] < CRASH_WINDOW_S
                crashes[i] = crashes[i] + 1 if quick else 0
                if crashes[i] >= CRASHES_MAX:
                    print(f"error: worker {i} ended {CRASHES_MAX} times within {CRASH_WINDOW_S:.0f} s of its start"
                          f" (last exit status {rc}); stopping", file=sys.stderr, flush=True)
                    code = 1
                    stop.set()
                    break
                print(f"gpuflex-hub: worker {i} (pid {p.pid}) ended with status {rc}; starting it again",
                      flush=True)
                procs[i] = start(i)
                started[i] = time.monotonic()
            stop.wait(0.2)
    finally:
        print("gpuflex-hub shutting down", flush=True)
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        listener.close()
    return code


def _leading(data_dir: Path) -> bool:
    """Whether a worker leads and answers on the leader's socket."""
    path = data_dir / LEADER_SOCKET
    if not path.exists():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


# -- a worker -------------------------------------------------------------------------------------


def _unavailable(exc: BaseException) -> web.Response:
    log.warning("the leader cannot be reached: %s: %s", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
    resp = error_response(503, "leader_unavailable", f"the hub's leading worker cannot be reached ({type(exc).__name__});"
                          " another takes over within a second: retry")
    resp.headers["Retry-After"] = "1"
    return resp


def forwarder(sock_path: Path) -> web.Application:
    """The app of a worker in line: every request goes on to the leader (streamed both ways)."""
    app = web.Application(client_max_size=0)
    session_key = web.AppKey("session", aiohttp.ClientSession)

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        conn = aiohttp.UnixConnector(path=str(sock_path), limit=0)
        # bytes pass through as they are: no decompression, no cookies
        app[session_key] = aiohttp.ClientSession(connector=conn, auto_decompress=False,
                                                 cookie_jar=aiohttp.DummyCookieJar())
        yield
        await app[session_key].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in _HOP)
        headers[PEER_HEADER] = request.remote or ""  # replaces any the client sent
        headers[SCHEME_HEADER] = request.scheme
        if request.host:
            headers["Host"] = request.host
        if request.content_length is not None:
            headers["Content-Length"] = str(request.content_length)
        body = request.content if request.body_exists else None
        resp: web.StreamResponse | None = None
        give_up = time.monotonic() + CONNECT_RETRY_S
        while True:
            try:
                async with app[session_key].request(
                    request.method, f"http://leader{request.rel_url}", headers=headers, data=body,
                    allow_redirects=False, timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                ) as up:
                    resp = web.StreamResponse(status=up.status, reason=up.reason)
                    for k, v in up.headers.items():
                        if k.lower() not in _HOP:
                            resp.headers.add(k, v)
                    if up.content_length is not None:
                        resp.content_length = up.content_length
                    await resp.prepare(request)
                    async for block in up.content.iter_chunked(1 << 16):
                        await resp.write(block)
                    await resp.write_eof()
                    return resp
            except aiohttp.ClientConnectorError as exc:
                # not connected: nothing of the request was read, so it can go again (a full
                # accept queue, or the next leader a moment from listening)
                if time.monotonic() < give_up:
                    await asyncio.sleep(0.02)
                    continue
                return _unavailable(exc)
            except (aiohttp.ClientConnectionError, OSError) as exc:
                if resp is not None and resp.prepared:
                    raise  # the leader went away mid-answer: the client sees the connection drop
                return _unavailable(exc)

    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def forwarding_runner(sock_path: Path) -> web.AppRunner:
    """The runner of a worker in line. A client that hangs up cancels its forward (the forward
    holds no state of the hub's), which closes the connection to the leader: the leader sees the
    hang-up as if the client were its own, and a relay take parked there ends (hub/server/relaybox.py)."""
    return web.AppRunner(forwarder(sock_path), handle_signals=False, access_log=None, shutdown_timeout=5.0,
                         handler_cancellation=True)


async def run_worker(config: HubConfig, ssl_ctx: ssl.SSLContext | None, fd: int, index: int) -> int:
    """One worker: forward to the leader until this process holds the lease, then lead."""
    from ..storage.lease import Lease, fence
    from .app import create_app
    from .heap import settle_heap

    if config.store is None:  # the supervisor checked: a worker started by hand is told the same
        raise WorkersError(NEEDS_POSTGRES)
    sock_path = leader_socket(config.data_dir)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    lease = Lease(config.store, f"gpuflex-hub worker {index}")

    def shared() -> socket.socket:  # each site owns (and closes) its own copy of the listening socket
        return socket.socket(fileno=os.dup(fd))

    if not await asyncio.to_thread(lease.try_acquire):
        runner = forwarding_runner(sock_path)
        await runner.setup()
        settle_heap()
        await web.SockSite(runner, shared(), ssl_context=ssl_ctx).start()
        print(f"gpuflex-hub worker {index} (pid {os.getpid()}): forwarding to the leader", flush=True)
        waiting = threading.Event()
        got = asyncio.ensure_future(asyncio.to_thread(lease.wait, waiting))
        halt = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({got, halt}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.set()
            halt.cancel()
            leads = await got
            await runner.cleanup()
        if not leads or stop.is_set():
            lease.release()
            return 0
    app = create_app(config, lease=lease)
    lease.watch(fence)
    from .appkeys import FIRST_ADMIN_TOKEN, HUB_KEY

    print(f"hub key fingerprint: {app[HUB_KEY].fingerprint}", flush=True)
    if app[FIRST_ADMIN_TOKEN]:
        print(f"admin token (shown once): {app[FIRST_ADMIN_TOKEN]}", flush=True)
    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=10.0)
    await runner.setup()
    settle_heap()  # hub/server/heap.py
    with contextlib.suppress(FileNotFoundError):
        sock_path.unlink()  # a dead leader's
    await web.UnixSite(runner, str(sock_path), backlog=LEADER_BACKLOG).start()
    os.chmod(sock_path, 0o600)
    await web.SockSite(runner, shared(), ssl_context=ssl_ctx).start()
    print(f"gpuflex-hub worker {index} (pid {os.getpid()}): leading", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
    return 0


__all__ = ["LEADER_SOCKET", "PEER_HEADER", "SCHEME_HEADER", "WorkersError", "check", "forwarder", "forwarding_runner",
           "leader_socket", "run_worker", "supervise"]
