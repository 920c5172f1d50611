"""The round trip the hub measures on a node's connection (hub/server/linkmeter.py): the
kernel's TCP round trip, read as the node asks for work, kept per node and used by the
pipeline plan instead of the assumed one."""

from __future__ import annotations

import socket
import sys

import aiohttp
import pytest
from aiohttp import web
from gpuflex.hub.domain.presence import Presence
from gpuflex.hub.model.node import NodeState
from gpuflex.hub.server.appkeys import LEDGER
from gpuflex.hub.server.linkmeter import tcp_rtt_s

from tests.helpers import SimNode

linux_only = pytest.mark.skipif(not (sys.platform.startswith("linux") and hasattr(socket, "TCP_INFO")),
                                reason="TCP_INFO is Linux's")


@linux_only
async def test_the_kernels_round_trip_of_a_real_connection_is_read() -> None:
    seen: list[float | None] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(tcp_rtt_s(request))
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(3):
                async with s.get(f"http://127.0.0.1:{port}/") as r:
                    assert r.status == 200
    finally:
        await runner.cleanup()
    assert all(v is not None and 0 < v < 1.0 for v in seen), seen


def test_the_node_keeps_a_moving_average_and_ignores_a_non_sample() -> None:
    node = NodeState(id="n", public_key=b"k" * 32, bench_sps=1.0, ema_sps=1.0, last_seen=0.0)
    Presence.observe_rtt(node, 0.0)
    assert node.rtt_s == 0.0
    Presence.observe_rtt(node, 0.1)
    assert node.rtt_s == pytest.approx(0.1)
    Presence.observe_rtt(node, 0.2)
    assert node.rtt_s == pytest.approx(0.12)
    Presence.observe_rtt(node, float("nan"))
    assert node.rtt_s == pytest.approx(0.12)


@linux_only
async def test_a_node_asking_for_work_gets_its_round_trip_measured(running_hub) -> None:
    async with aiohttp.ClientSession() as s:
        node = SimNode(s, running_hub.url)
        await node.register()
        assert running_hub.app[LEDGER].scheduler.nodes[node.node_id].rtt_s == 0.0
        await node.work(wait_s=0.0)
        state = running_hub.app[LEDGER].scheduler.nodes[node.node_id]
        assert 0 < state.rtt_s < 1.0, state.rtt_s
