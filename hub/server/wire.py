"""Edge helpers shared by the route modules: reading signed bodies, replying, error mapping."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any, TypeVar

from aiohttp import web
from gpuflex.protocol.errors import (
    DecodeError,
    ProtocolError,
    ReplayError,
    SignatureError,
    SpecError,
    TensorError,
    VersionError,
)
from gpuflex.protocol.signing import open_sealed, seal

from ..base.errors import (
    BadRequest,
    Conflict,
    HubError,
    PayloadTooLarge,
    Unauthorized,
    Unprocessable,
)
from ..storage.tokens import Principal, lookup
from .appkeys import DB, HUB_KEY, METRICS, REPLAY
from .linkmeter import BodyClock

#: the header that carries a request's client address when a worker forwards it to the leader
#: (hub/server/workers.py; believed on leader.sock only, hub/server/app.py)
PEER_HEADER = "X-GPUFlex-Peer"
#: and the scheme the client used (a worker ends TLS itself)
SCHEME_HEADER = "X-GPUFlex-Scheme"

M = TypeVar("M")
MSGPACK = "application/x-msgpack"


def protocol_to_hub(exc: ProtocolError) -> HubError:
    """Map the protocol's error tree onto HTTP-carrying hub errors (the edge's one table)."""
    detail = str(exc) or exc.__class__.__name__
    if isinstance(exc, VersionError):
        return Conflict(detail, code="version_mismatch")
    if isinstance(exc, SignatureError):
        return Unauthorized(detail, code="bad_signature")
    if isinstance(exc, ReplayError):
        return Conflict(detail, code="replay")
    if isinstance(exc, TensorError):
        return Unprocessable(detail, code="bad_tensor")
    if isinstance(exc, SpecError):
        return Unprocessable(detail, code="bad_spec")
    if isinstance(exc, DecodeError):
        return BadRequest(detail, code="bad_message")
    return BadRequest(detail, code="bad_message")


def error_response(status: int, code: str, detail: str) -> web.Response:
    return web.json_response({"error": code, "detail": " ".join(detail.split())[:500]}, status=status)


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(data, default=str, allow_nan=False), status=status,
                        content_type="application/json")


def sealed_response(request: web.Request, msg: object) -> web.Response:
    body = seal(request.app[HUB_KEY], msg)
    request.app[METRICS].bytes_out += len(body)
    return web.Response(body=body, content_type=MSGPACK)


def b64_header(request: web.Request, name: str, *, limit: int = 16384) -> bytes:
    raw = request.headers.get(name)
    if not raw:
        raise Unauthorized(f"missing {name} header (urlsafe base64 of a sealed message)", code="missing_auth")
    if len(raw) > limit:
        raise BadRequest(f"{name} header is longer than {limit} characters", code="bad_message")
    raw = raw.strip()
    try:
        return base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4))
    except (binascii.Error, ValueError):
        raise BadRequest(f"{name} header is not urlsafe base64", code="bad_message") from None


async def read_body(request: web.Request, limit: int, clock: BodyClock | None = None) -> bytes:
    """The whole body, up to ``limit`` bytes (PayloadTooLarge beyond). ``StreamReader.read(n)``
    returns what has arrived so far, not the whole body: on a real line a body that spans TCP
    segments arrives in pieces (on loopback it never does), so read until the end. ``clock``:
    told of each piece as it arrives (linkmeter.py)."""
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"body of {request.content_length} bytes exceeds the {limit}-byte limit")
    parts: list[bytes] = []
    size = 0
    while size <= limit:
        piece = await request.content.read(limit + 1 - size)
        if clock is not None:
            clock.piece(len(piece))
        if not piece:
            break
        parts.append(piece)
        size += len(piece)
    body = b"".join(parts)
    if len(body) > limit:
        raise PayloadTooLarge(f"body exceeds the {limit}-byte limit")
    request.app[METRICS].bytes_in += len(body)
    return body


async def read_signed_body(request: web.Request, size: int, clock: BodyClock | None = None) -> bytes:
    """The body of exactly the ``size`` bytes its signed header says: a Content-Length that
    differs is refused before a byte is read, a body of another length after (400
    ``size_mismatch``)."""
    if request.content_length is not None and request.content_length != size:
        raise BadRequest(
            f"Content-Length {request.content_length} differs from the signed size {size}",
            code="size_mismatch",
        )
    body = await read_body(request, size, clock)
    if len(body) != size:
        raise BadRequest(f"body has {len(body)} bytes, the signed size says {size}", code="size_mismatch")
    return body


def open_node_message(request: web.Request, data: bytes, cls: type[M]) -> tuple[M, bytes]:
    """Verify signature, then freshness (timestamp window + nonce); returns (message, signer)."""
    try:
        msg, signer = open_sealed(data, cls)
        request.app[REPLAY].check(signer, msg.timestamp, msg.nonce)  # type: ignore[attr-defined]
    except ProtocolError as exc:
        raise protocol_to_hub(exc) from None
    return msg, signer


async def principal(request: web.Request) -> Principal:
    header = request.headers.get("Authorization")
    return await request.app[DB].read(lambda conn: lookup(conn, header))
