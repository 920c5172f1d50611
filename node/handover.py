"""The node's answer to the hub's referee (messages.StateRequest): the committed checkpoint
states it asked for, each checked by the hub against the commitment; or, when some are no
longer kept (node/checkpoints.py says what is kept), a StateUnavailable at once, so the hub
decides without waiting for the request's deadline."""

from __future__ import annotations

import asyncio
import hashlib

from gpuflex.protocol.messages import StateRequest, StateUnavailable, StateUpload
from gpuflex.protocol.signing import new_nonce

from .checkpoints import CheckpointStore
from .client import HubClient
from .output import Output

__all__ = ["hand_over"]


async def hand_over(client: HubClient, store: CheckpointStore, output: Output, asked: StateRequest) -> None:
    """Upload the states asked for; when some are gone, say which instead (the referee cannot
    re-execute without them, so the others are not sent)."""
    output.event("state_request", request_id=asked.request_id, assignment_id=asked.assignment_id,
                 steps=list(asked.steps))
    held = set(await asyncio.to_thread(store.held, asked.assignment_id, asked.steps))
    if missing := [s for s in asked.steps if s not in held]:
        msg = StateUnavailable(request_id=asked.request_id, steps=tuple(missing),
                               reason="pruned from the node's checkpoint store", timestamp=client.now(),
                               nonce=new_nonce())
        ack = await client.states_unavailable(msg)
        output.event("state_missing", request_id=asked.request_id, steps=missing, ok=ack.ok)
        return
    for step in asked.steps:
        data = await asyncio.to_thread(store.read, asked.assignment_id, step)
        if data is None:  # dropped between the look and the read: said on the next ask
            output.event("state_missing", request_id=asked.request_id, steps=[step])
            return
        hdr = StateUpload(request_id=asked.request_id, step=step, state_sha256=hashlib.sha256(data).hexdigest(),
                          state_size=len(data), timestamp=client.now(), nonce=new_nonce())
        ack = await client.upload_state(hdr, data)
        output.event("state_sent", request_id=asked.request_id, step=step, bytes=len(data), ok=ack.ok)
