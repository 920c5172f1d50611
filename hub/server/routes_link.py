"""A node's link probe: POST /v1/nodes/probe (header X-GPUFlex-Auth: a sealed LinkProbe; body: its
``size`` bytes of SHA-256 ``sha256``, at most ``MAX_LINK_PROBE_BYTES``).

A node sends one after it registers, so that the hub times its uplink (linkmeter.py's
``BodyClock``) before it plans a pipeline stage on it; without one the plan assumes a home line
for the node until its first relayed tensor or update. Refused in one line, keeping nothing: a bad
signature or replay, an unknown node, a size over the limit or not the Content-Length; after the
body: bytes not matching the signed size and SHA-256. The answer is a sealed Ack saying the rate
measured (a body the kernel handed over in one piece says nothing).
"""

from __future__ import annotations

import hashlib

from aiohttp import web
from gpuflex.protocol.messages import Ack, LinkProbe

from ..base.errors import Unprocessable
from .appkeys import LEDGER
from .linkmeter import BodyClock
from .wire import b64_header, open_node_message, read_signed_body, sealed_response

routes = web.RouteTableDef()


@routes.post("/v1/nodes/probe")
async def link_probe(request: web.Request) -> web.Response:
    """Time one body of the node's (signed LinkProbe -> signed Ack)."""
    ledger = request.app[LEDGER]
    msg, signer = open_node_message(request, b64_header(request, "X-GPUFlex-Auth"), LinkProbe)
    node = await ledger.registry.known_node(signer, request.remote)
    clock = BodyClock()
    body = await read_signed_body(request, msg.size, clock)
    if hashlib.sha256(body).hexdigest() != msg.sha256:
        raise Unprocessable("the probe's bytes do not hash to its signed SHA-256", code="hash_mismatch")
    rate = clock.rate()
    ledger.scheduler.presence.observe_uplink(node, rate)
    detail = (
        f"uplink timed at {rate / 1e6:.2f} MB/s"
        if rate is not None
        else "the probe came in one piece: too fast to time"
    )
    return sealed_response(request, Ack(ok=True, detail=detail, deadline=0.0))


__all__ = ["routes"]
