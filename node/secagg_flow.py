"""Secure aggregation, the node's side: send the trained update masked, never in the clear.

An assignment with ``train.secagg`` (a node-local job with ``[privacy] secure_aggregation``)
ends here instead of in an upload. The node weights its update by its share of the job's
``max_samples`` (the weight travels as one more coordinate, so the hub's sum gives a weighted
mean), clips every coordinate to +-``secagg_clip``, quantizes it to ``secagg_bits`` bits with
stochastic rounding, and then follows the hub through the protocol's steps (hub/policy/secagg.py
names them; protocol/secagg.py does the cryptography): its public keys, its encrypted shares for
the other members, its masked update, and the shares that unmask the sum. What leaves the node is
keys, ciphertexts only their receiver can open, a vector that is uniformly random without the
other members' masks, and shares that protocol/secagg.py hands over only for a sum of at least
the threshold's members (never both kinds for one node). The plain figures every update reports
(sample count, loss, training time) are sent as they are.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from gpuflex.protocol.errors import SecAggError
from gpuflex.protocol.messages import Assignment, Sealed, SecAggMasked, SecAggState, UnmaskShare
from gpuflex.protocol.modelspec import ModelSpec, manifest
from gpuflex.protocol.secagg import RosterEntry, SecAggClient, quantize
from gpuflex.protocol.signing import new_nonce

from .secagg_calls import SecAggCalls

if TYPE_CHECKING:
    from collections.abc import Mapping

    from torch import Tensor

    from .client import HubClient

#: seconds a poll waits at the hub for the round's secure aggregation to move on (a long-poll: it
#: answers as soon as this node's phase changes)
POLL_S = 10.0
#: the longest a node follows one round's protocol before it gives the assignment up
GIVE_UP_S = 900.0


@dataclass(frozen=True)
class Outcome:
    """How the node's part ended: ``unmasked`` (it did all it was asked; the hub sums), or
    ``aborted`` with the hub's reason; ``sha256`` / ``size`` of the masked vector it sent."""

    phase: str
    detail: str = ""
    sha256: str = ""
    size: int = 0


def weighted_vector(a: Assignment, delta: Mapping[str, Tensor], sample_count: int) -> np.ndarray:
    """The update's floating elements in the model's manifest order, times its weight (samples /
    max_samples), and the weight last: what the hub's sum turns into a weighted mean."""
    weight = min(1.0, sample_count / max(1, a.train.secagg_max_samples))
    parts = [delta[t.name].detach().to("cpu").double().reshape(-1).numpy() * weight
             for t in manifest(ModelSpec.from_dict(a.model_spec)) if t.dtype.startswith(("float", "bfloat"))]
    return np.concatenate([*parts, np.array([weight])])


async def take_part(client: HubClient, node_id: str, a: Assignment, delta: Mapping[str, Tensor], *,
                    sample_count: int, loss: float, train_s: float) -> Outcome:
    """Follow the round's secure aggregation to the end of this node's part. A step the
    cryptography refuses (a roster without this node, a ciphertext that does not open, an unmask
    request that would reveal an update) ends the node's part: ``aborted`` with the reason."""
    try:
        return await _take_part(client, node_id, a, delta, sample_count=sample_count, loss=loss, train_s=train_s)
    except SecAggError as exc:
        return Outcome("aborted", f"refused: {exc}".splitlines()[0][:250])


async def _take_part(client: HubClient, node_id: str, a: Assignment, delta: Mapping[str, Tensor], *,
                     sample_count: int, loss: float, train_s: float) -> Outcome:
    vector = weighted_vector(a, delta, sample_count)
    if not np.isfinite(vector).all():
        raise SecAggError("the update is not finite")
    q = quantize(vector, a.train.secagg_clip, a.train.secagg_bits, np.random.default_rng())
    sa = SecAggClient(node_id, a.job_id, a.round)
    aid = a.assignment_id
    calls = SecAggCalls(client)
    st: SecAggState = await calls.keys(aid, sa.entry.c_pk, sa.entry.s_pk)
    sent_shares = sent_masked = False
    give_up = time.monotonic() + GIVE_UP_S
    masked_sha, masked_size = "", 0
    while True:
        if st.phase == "aborted":
            return Outcome("aborted", st.detail, masked_sha, masked_size)
        if st.phase == "done":
            return Outcome("unmasked", "", masked_sha, masked_size)
        if st.phase == "shares" and not sent_shares:
            roster = [RosterEntry(m.node_id, bytes(m.c_pk), bytes(m.s_pk)) for m in st.roster]
            shares = sa.shares_for(roster, st.threshold)
            sent_shares = True
            st = await calls.shares(aid, tuple(Sealed(to, ct) for to, ct in sorted(shares.items())))
            continue
        if st.phase == "masked" and not sent_masked:
            sa.receive({s.node_id: bytes(s.ciphertext) for s in st.inbox})
            body = sa.mask(q, list(st.survivors)).astype("<u4").tobytes()
            masked_sha, masked_size = hashlib.sha256(body).hexdigest(), len(body)
            sent_masked = True
            st = await calls.masked(SecAggMasked(
                assignment_id=aid, sha256=masked_sha, size=masked_size, sample_count=sample_count,
                loss=max(0.0, float(loss)) if math.isfinite(loss) else 0.0, train_s=max(0.0, float(train_s)),
                timestamp=client.now(), nonce=new_nonce()), body)
            continue
        if st.phase == "unmask":
            shares_out = sa.unmask_shares(list(st.alive), list(st.dropped))
            await calls.unmask(aid, tuple(UnmaskShare(n, kind, share)
                                                  for n, (kind, share) in sorted(shares_out.items())))
            return Outcome("unmasked", "", masked_sha, masked_size)
        if time.monotonic() > give_up:
            return Outcome("aborted", f"the round's secure aggregation did not end in {GIVE_UP_S:.0f} s",
                           masked_sha, masked_size)
        st = await calls.poll(aid, after=st.phase, wait_s=POLL_S)
