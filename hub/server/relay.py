"""The pipeline relay: stages behind NAT hand each other activations and gradients through the hub.

POST /v1/relay puts one tensor (header X-GPUFlex-Relay: a sealed RelayHeader; body: one GFT1
tensor of the header's size and SHA-256); GET /v1/relay (header X-GPUFlex-Auth: a sealed
RelayTake) takes it, waiting up to the long-poll limit, and answers the bytes with the sender's
sealed header as it came (X-GPUFlex-Relay), so the receiving stage verifies the sender itself.

Every refusal is one line and keeps nothing: a bad signature or a replayed nonce, an unknown
node, a job with no pipeline, a message of another generation than the job's current plan
(409 ``stale_generation``), a step or stage the node does not own under the job's plan
(hub/model/relay.py), a body larger than the plan's tensor can be or not matching its signed
size and hash, a tensor of another shape or dtype, NaN or infinity, a sketch
(protocol/stagesketch.py) that is malformed, on anything but an activation or a gradient, or,
on an fp32 boundary, whose entries or signed sums are not the payload's (400 ``bad_sketch``).
Messages live in memory only (hub/server/relaybox.py), never in the database.

A take whose client hangs up ends within a tenth of a second and takes nothing; the node's
``RelayLink`` (hub/model/node.py) records how its takes ended, which is how the pipelines learn
that a stage node's process died (hub/domain/pipelines/liveness.py).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import math
import time

import numpy as np
import torch
from aiohttp import web
from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.messages import Ack, RelayHeader, RelayTake
from gpuflex.protocol.stagesketch import decode_sketch, sketch_projections
from gpuflex.protocol.tensors import TensorSpec, check_blob, decode_state, max_encoded_size

from ..base.errors import BadRequest, PayloadTooLarge, Unprocessable
from ..domain.pipelines.liveness import GONE_S
from ..model.relay import Crossing, RelayPlan
from .appkeys import CONFIG, IO_POOL, LEDGER, METRICS, RELAY
from .linkmeter import BodyClock
from .relaybox import RelayKey
from .wire import b64_header, open_node_message, protocol_to_hub, read_body, sealed_response

routes = web.RouteTableDef()
RELAY_HEADER = "X-GPUFlex-Relay"
#: the most bytes one relayed tensor may take, whatever its plan says
MAX_RELAY_BODY = 256 << 20
#: a body up to this size is hashed and checked on the event loop (about a tenth of a millisecond,
#: less than the hand-off to a thread and back); a larger one in a thread, where hashing runs
#: beside the loop
CHECK_ON_LOOP = 256 << 10


def _crossing(plan: RelayPlan, msg: RelayHeader | RelayTake) -> Crossing:
    return plan.crossing(
        step=msg.step,
        micro_batch=msg.micro_batch,
        carries=msg.carries,
        stage=msg.stage,
        to_stage=msg.to_stage,
    )


def _key(msg: RelayHeader | RelayTake) -> RelayKey:
    return (
        msg.job_id,
        msg.step,
        msg.micro_batch,
        msg.carries,
        msg.stage,
        msg.to_stage,
        msg.generation,
    )


def _check_body(body: bytes, hdr: RelayHeader, spec: TensorSpec) -> None:
    """The bytes against their signed size and SHA-256, then the tensor against the plan's."""
    if len(body) != hdr.size or hashlib.sha256(body).hexdigest() != hdr.sha256:
        raise BadRequest(
            "the relayed bytes do not match their signed size and SHA-256", code="hash_mismatch"
        )
    _check_tensor(body, spec)
    _check_sketch(body, hdr, spec)


def _check_sketch(body: bytes, hdr: RelayHeader, spec: TensorSpec) -> None:
    """The sender's sketch of the raw tensor, where it can be checked here: its form, and on an
    fp32 boundary (the payload is the raw tensor) its entries and its signed sums against the
    payload's (the same float64 sums, so equal bit for bit). Behind an
    encoded boundary only that it covers whole rows of the wire's; the referee compares the
    values with its recomputation (hub/policy/stage_check.py)."""
    if not hdr.sketch:
        return
    if hdr.carries not in ("activation", "gradient"):
        raise BadRequest(
            f"a relayed {hdr.carries} carries no sketch, only an activation or a gradient",
            code="bad_sketch",
        )
    numel = math.prod(spec.shape)
    raw = spec.dtype == "float32"  # every encoded form is int8 or a half
    try:
        sketch = decode_sketch(hdr.sketch, numel=numel if raw else None)
    except ProtocolError as exc:
        raise BadRequest(
            f"the relayed {hdr.carries}'s sketch is refused: {exc}", code="bad_sketch"
        ) from None
    rows = numel // spec.shape[-1] if spec.shape and spec.shape[-1] else 0
    if not raw and (rows == 0 or sketch.numel % rows):
        raise BadRequest(
            f"the relayed {hdr.carries}'s sketch covers {sketch.numel} elements, not whole rows "
            f"of its {rows}",
            code="bad_sketch",
        )
    if raw:
        flat = decode_state(body)[hdr.carries].reshape(-1)
        sums = sketch.projections
        if not torch.equal(flat[sketch.indices], sketch.values) or (
            sums is not None
            and not np.array_equal(
                sketch_projections(flat.numpy(), sketch.seed).astype(np.float32), sums.numpy()
            )
        ):
            raise BadRequest(
                f"the relayed {hdr.carries}'s sketch does not match its payload", code="bad_sketch"
            )


def _check_tensor(body: bytes, spec: TensorSpec) -> None:
    try:
        nonfinite = check_blob(body, (spec,), max_total_bytes=MAX_RELAY_BODY)
    except ProtocolError as exc:
        raise protocol_to_hub(exc) from None
    if nonfinite is not None:
        raise Unprocessable(
            f"the relayed {spec.name} holds NaN or infinite values; refused", code="nonfinite"
        )


@routes.post("/v1/relay")
async def relay_put(request: web.Request) -> web.Response:
    """Keep one tensor for the stage it is addressed to (signed RelayHeader -> signed Ack)."""
    app = request.app
    sealed = b64_header(request, RELAY_HEADER)
    hdr, signer = open_node_message(request, sealed, RelayHeader)
    node = await app[LEDGER].registry.known_node(signer, request.remote)
    plan = app[RELAY].registry.plan(hdr.job_id)
    plan.check_generation(hdr.generation)
    crossing = _crossing(plan, hdr)
    plan.check_owner(node.id, hdr.stage, f"send as stage {hdr.stage}")
    spec = TensorSpec(hdr.carries, crossing.dtype, crossing.shape)
    limit = min(max_encoded_size((spec,)), MAX_RELAY_BODY)
    if hdr.size > limit:
        raise PayloadTooLarge(
            f"a relayed {hdr.carries} of this pipeline is at most {limit} bytes, not {hdr.size}",
            code="too_large",
        )
    if request.content_length is not None and request.content_length != hdr.size:
        raise BadRequest(
            f"Content-Length {request.content_length} differs from the signed size {hdr.size}",
            code="size_mismatch",
        )
    clock = BodyClock()
    body = await read_body(request, hdr.size, clock)
    app[LEDGER].scheduler.presence.observe_uplink(node, clock.rate())
    if len(body) <= CHECK_ON_LOOP:
        _check_body(body, hdr, spec)
    else:
        await asyncio.get_running_loop().run_in_executor(app[IO_POOL], _check_body, body, hdr, spec)
    app[RELAY].put(_key(hdr), sealed, body)
    # a copy for the referee when this tensor belongs to a sampled stage check (verify.py)
    app[LEDGER].pipelines.checks.observe(hdr, body)
    return sealed_response(
        request, Ack(ok=True, detail=f"{hdr.carries} relayed to stage {hdr.to_stage}", deadline=0.0)
    )


def _hung_up(request: web.Request) -> bool:
    """Whether the request's client went away: its connection is closed or closing. Behind a
    forwarding worker (``serve --workers N``) the connection is the worker's, which closes it
    when its client's closes (hub/server/workers.py)."""
    transport = request.transport
    return transport is None or transport.is_closing()


@routes.get("/v1/relay")
async def relay_take(request: web.Request) -> web.Response:
    """Take the tensor sent to the caller's stage: 200 with it, or 204 when none came in time."""
    app = request.app
    take, signer = open_node_message(request, b64_header(request, "X-GPUFlex-Auth"), RelayTake)
    node = await app[LEDGER].registry.known_node(signer, request.remote)
    plan = app[RELAY].registry.plan(take.job_id)
    plan.check_generation(take.generation)
    _crossing(plan, take)
    plan.check_owner(node.id, take.to_stage, f"take what is sent to stage {take.to_stage}")
    link = node.relay  # the node's link now: a stage handed to it meanwhile starts a fresh one
    link.park()
    hung_up = False
    try:
        message = await app[RELAY].take(
            _key(take),
            min(float(take.wait_s), app[CONFIG].long_poll_max_s),
            hung_up=lambda: _hung_up(request),
        )
        hung_up = message is None and _hung_up(request)
    finally:
        now = time.time()
        link.unpark(now, hung_up=hung_up)
    if hung_up and not link.parked:  # the pipelines look again once it counts as gone
        app[LEDGER].pipelines.poke(at=now + GONE_S + 0.05)  # a timer may fire a hair early
    if message is None:
        return web.Response(status=204)
    app[METRICS].bytes_out += len(message.body)
    return web.Response(
        body=message.body,
        content_type="application/octet-stream",
        headers={RELAY_HEADER: base64.urlsafe_b64encode(message.header).decode("ascii")},
    )


__all__ = ["MAX_RELAY_BODY", "RELAY_HEADER", "routes"]
