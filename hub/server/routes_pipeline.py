"""A pipelined job's stage nodes: unit checkpoints and step reports (hub/domain/pipelines/).

POST /v1/pipeline/checkpoint: header X-GPUFlex-Auth = a sealed UnitCheckpoint, body = the unit's
GFT1 state. Refused in one line, keeping nothing, before the body is read: a bad signature or
replay, an unknown node or job, another generation (409 ``stale_generation``), a stage or unit
the node does not run, a step that is not a checkpoint step, a size beyond what the unit's state
can be or not the Content-Length; after: bytes not matching the signed size and SHA-256, a state
that is not exactly the unit's entries plus its optimizer's, NaN or infinity. The blob is stored
durably (content-addressed) and its record committed before the 200 (a sealed Ack).

POST /v1/pipeline/report: body = a sealed StageReport; the answer a sealed Ack (ok=False: the
generation is over, stop and ask for work).
"""

from __future__ import annotations

import asyncio
import hashlib
from functools import partial

from aiohttp import web
from gpuflex.protocol.messages import Ack, StageReport, UnitCheckpoint

from ..base.errors import Unprocessable
from ..domain.pipelines import CheckpointTarget
from ..domain.pipelines.checkpoints import check_unit_state
from ..storage.blobs import BlobStore
from .appkeys import BLOBS, CONFIG, IO_POOL, LEDGER
from .linkmeter import BodyClock
from .wire import b64_header, open_node_message, read_body, read_signed_body, sealed_response

routes = web.RouteTableDef()


def _ingest_state(body: bytes, sha: str, target: CheckpointTarget, blobs: BlobStore) -> None:
    """Hash, check against the unit, store durably. Worker thread."""
    if hashlib.sha256(body).hexdigest() != sha:
        raise Unprocessable(
            "the unit state's bytes do not hash to its signed SHA-256", code="hash_mismatch"
        )
    check_unit_state(body, target.unit_name, target.entries, target.train)
    blobs.put(body, sha=sha)


@routes.post("/v1/pipeline/checkpoint")
async def checkpoint(request: web.Request) -> web.Response:
    """One unit's state at a checkpoint step (signed UnitCheckpoint + GFT1 body -> signed Ack)."""
    app = request.app
    ledger = app[LEDGER]
    msg, signer = open_node_message(request, b64_header(request, "X-GPUFlex-Auth"), UnitCheckpoint)
    node = await ledger.registry.known_node(signer, request.remote)
    target = ledger.pipelines.checkpoint_target(node, msg)
    clock = BodyClock()
    body = await read_signed_body(request, msg.size, clock)
    ledger.scheduler.presence.observe_uplink(node, clock.rate())
    await asyncio.get_running_loop().run_in_executor(
        app[IO_POOL], partial(_ingest_state, body, msg.sha256, target, app[BLOBS])
    )
    detail = await ledger.pipelines.accept_checkpoint(node, msg)
    return sealed_response(request, Ack(ok=True, detail=detail, deadline=0.0))


@routes.post("/v1/pipeline/report")
async def report(request: web.Request) -> web.Response:
    """A stage's report of a step (signed StageReport -> signed Ack)."""
    app = request.app
    body = await read_body(request, app[CONFIG].max_message_bytes)
    msg, signer = open_node_message(request, body, StageReport)
    ledger = app[LEDGER]
    node = await ledger.registry.known_node(signer, request.remote)
    return sealed_response(request, await ledger.pipelines.report(node, msg))


__all__ = ["routes"]
