"""An uploaded update's manifest (tensor names, dtypes, shapes), judged from its first bytes.

An update that is larger than the model is wrong, but its size is only the symptom: an
extra or renamed tensor makes the header longer, a wrong shape makes the data longer. The
upload route calls this before it refuses such an update as too large, so the node is told
which tensor is wrong (422 bad_manifest) rather than only that the bytes are too many.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.tensors import PREFIX, Manifest, check_manifest_prefix, header_span

from ..base.errors import BadRequest, Unprocessable


async def _read_exactly(request: web.Request, n: int) -> bytes:
    try:
        return await request.content.readexactly(n)
    except asyncio.IncompleteReadError:
        raise BadRequest("body is shorter than update_size", code="size_mismatch") from None


async def check_streamed_manifest(request: web.Request, update_size: int, expected: Manifest) -> None:
    """Read the update's GFT1 prefix and header from the request body (at most the header's
    own bounded length) and raise 422 bad_manifest naming the first tensor that is not the
    model's. Returns when the header matches; the caller then judges the size. Consumes the
    body's first bytes: call it only on an update that will be refused either way."""
    try:
        head = await _read_exactly(request, min(PREFIX.size, update_size))
        span = header_span(head)
        if span > update_size:
            raise Unprocessable(f"update header of {span} bytes is longer than update_size {update_size}",
                                code="bad_manifest")
        head += await _read_exactly(request, span - len(head))
        check_manifest_prefix(head, update_size, expected)
    except ProtocolError as exc:
        raise Unprocessable(f"update does not match the model: {exc}", code="bad_manifest") from None
