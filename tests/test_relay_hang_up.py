"""A relay take whose client hangs up, through a real hub on 127.0.0.1: the take ends within the
relay's sweep and the node's ``RelayLink`` says its connections went away (what the pipelines'
liveness reads); any request of the node's clears it; a client that keeps asking, or whose take
was answered since, is never gone; behind a forwarding worker (``serve --workers N``) the leader
sees the hang-up the same way."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import shutil
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from gpuflex.hub.model.node import NodeState
from gpuflex.hub.server.appkeys import LEDGER, RELAY
from gpuflex.hub.server.relaybox import HANG_UP_POLL_S
from gpuflex.hub.server.workers import forwarding_runner
from gpuflex.protocol.messages import RelayTake
from gpuflex.protocol.signing import SigningKey, new_nonce, seal

from tests.helpers import RunningHub, start_hub
from tests.test_pipeline_relay import _hello, plan_for

JOB = "job-hang-up"


async def _pipeline(hub: RunningHub) -> tuple[SigningKey, NodeState]:
    """Two registered nodes on a 2-stage relay plan of JOB; stage 1's key and node."""
    keys = [SigningKey.generate(), SigningKey.generate()]
    async with aiohttp.ClientSession() as session:
        for key in keys:
            async with session.post(
                f"{hub.url}/v1/nodes/register",
                data=seal(key, _hello()),
                headers={"Content-Type": "application/x-msgpack"},
            ) as resp:
                assert resp.status == 200, await resp.text()
    hub.app[RELAY].registry.assign(JOB, plan_for(keys, [0, 3], 4, end_step=10))
    return keys[1], hub.app[LEDGER].scheduler.nodes[keys[1].fingerprint]


def _auth(key: SigningKey, wait_s: float, micro_batch: int = 0) -> str:
    take = RelayTake(
        job_id=JOB,
        step=1,
        micro_batch=micro_batch,
        carries="activation",
        stage=0,
        to_stage=1,
        wait_s=wait_s,
        timestamp=time.time(),
        nonce=new_nonce(),
    )
    return base64.urlsafe_b64encode(seal(key, take)).decode()


async def _park(url: str, key: SigningKey, micro_batch: int = 0) -> asyncio.StreamWriter:
    """A raw connection with a relay GET parked on it (10 s wait): the writer, to hang up with."""
    parts = urlsplit(url)
    _, writer = await asyncio.open_connection(parts.hostname, parts.port)
    writer.write(
        (
            f"GET /v1/relay HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"X-GPUFlex-Auth: {_auth(key, 10.0, micro_batch)}\r\n\r\n"
        ).encode()
    )
    await writer.drain()
    return writer


async def _until(cond, within_s: float = 3.0) -> float:
    """Seconds until ``cond()`` held (AssertionError when it did not within ``within_s``)."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < within_s, "timed out"
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


async def _ask(url: str, key: SigningKey, wait_s: float, micro_batch: int = 0) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            f"{url}/v1/relay", headers={"X-GPUFlex-Auth": _auth(key, wait_s, micro_batch)}
        ) as resp,
    ):
        return resp.status


def _gone(node: NodeState) -> float | None:
    return node.relay.gone_at(node.last_seen)


async def test_a_take_whose_client_hangs_up_ends_and_marks_the_node_gone(tmp_path) -> None:
    hub = await start_hub(tmp_path, long_poll_max_s=10.0)
    try:
        key, node = await _pipeline(hub)
        writer = await _park(hub.url, key)
        await _until(lambda: node.relay.parked == 1)
        assert _gone(node) is None  # parked: there
        writer.close()
        took = await _until(lambda: node.relay.parked == 0)
        assert took < 2 * HANG_UP_POLL_S + 0.1, f"the take ended {took:.2f} s after the hang-up"
        assert _gone(node) is not None and time.time() - _gone(node) < 1.0
        assert len(hub.app[RELAY]) == 0
        # any request of the node's since: not gone
        assert await _ask(hub.url, key, 0.0) == 204
        assert _gone(node) is None
    finally:
        await hub.stop()


async def test_a_client_that_keeps_asking_or_was_answered_last_is_never_gone(tmp_path) -> None:
    hub = await start_hub(tmp_path, long_poll_max_s=10.0)
    try:
        key, node = await _pipeline(hub)
        for _ in range(3):  # each take answered (204 after its wait), asked again at once
            assert await _ask(hub.url, key, 0.15) == 204
            assert _gone(node) is None
        # one take hung up while another was parked, which was then answered: not gone (the
        # last take ended answered)
        writer = await _park(hub.url, key, micro_batch=1)
        await _until(lambda: node.relay.parked == 1)
        answered = asyncio.ensure_future(_ask(hub.url, key, 0.5))
        await _until(lambda: node.relay.parked == 2)
        writer.close()
        await _until(lambda: node.relay.parked == 1)
        assert await answered == 204
        assert node.relay.parked == 0 and _gone(node) is None
    finally:
        await hub.stop()


async def test_the_leader_sees_a_hang_up_behind_a_forwarding_worker(tmp_path) -> None:
    hub = await start_hub(tmp_path, long_poll_max_s=10.0)
    folder = Path(tempfile.mkdtemp(prefix="gf-"))  # a Unix socket's path is short
    runner: web.AppRunner | None = None
    try:
        sock = folder / "leader.sock"
        await web.UnixSite(hub.runner, str(sock)).start()
        runner = forwarding_runner(sock)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        key, node = await _pipeline(hub)
        writer = await _park(f"http://127.0.0.1:{port}", key)
        await _until(lambda: node.relay.parked == 1)
        writer.close()
        took = await _until(lambda: node.relay.parked == 0)
        assert took < 2 * HANG_UP_POLL_S + 0.1, f"the take ended {took:.2f} s after the hang-up"
        assert _gone(node) is not None
    finally:
        if runner is not None:
            with contextlib.suppress(Exception):
                await runner.cleanup()
        await hub.stop()
        shutil.rmtree(folder, ignore_errors=True)
