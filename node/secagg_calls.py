"""The node's calls of secure aggregation (POST /v1/secagg/...), over its HubClient: each is a
signed message and a hub-signed SecAggState back. node/secagg_flow.py drives them."""

from __future__ import annotations

from gpuflex.protocol.messages import (
    Sealed,
    SecAggKeys,
    SecAggMasked,
    SecAggPoll,
    SecAggShares,
    SecAggState,
    SecAggUnmask,
    UnmaskShare,
)
from gpuflex.protocol.signing import new_nonce, seal

from .client import HubClient

__all__ = ["SecAggCalls"]


class SecAggCalls:
    def __init__(self, client: HubClient) -> None:
        self.client = client

    async def keys(self, assignment_id: str, c_pk: bytes, s_pk: bytes) -> SecAggState:
        c = self.client
        msg = SecAggKeys(assignment_id=assignment_id, c_pk=c_pk, s_pk=s_pk, timestamp=c.now(), nonce=new_nonce())
        return c._signed_answer(await c._post("/v1/secagg/keys", msg), SecAggState, "secure aggregation keys")

    async def poll(self, assignment_id: str, *, after: str = "", wait_s: float = 0.0) -> SecAggState:
        """Where the round's secure aggregation stands: at once, or (``after``, ``wait_s``) once this
        node's phase is no longer ``after``, waiting at most ``wait_s`` at the hub."""
        c = self.client
        msg = SecAggPoll(assignment_id=assignment_id, timestamp=c.now(), nonce=new_nonce(), after=after,
                         wait_s=wait_s)
        return c._signed_answer(await c._post("/v1/secagg/poll", msg, limit_s=15 + wait_s), SecAggState,
                                "secure aggregation poll")

    async def shares(self, assignment_id: str, shares: tuple[Sealed, ...]) -> SecAggState:
        c = self.client
        msg = SecAggShares(assignment_id=assignment_id, shares=shares, timestamp=c.now(), nonce=new_nonce())
        return c._signed_answer(await c._post("/v1/secagg/shares", msg), SecAggState, "secure aggregation shares")

    async def masked(self, header: SecAggMasked, body: bytes) -> SecAggState:
        c = self.client
        return await c._post_sealed("/v1/secagg/masked", "X-GPUFlex-Masked", seal(c.key, header), body,
                                    "masked update", SecAggState)

    async def unmask(self, assignment_id: str, shares: tuple[UnmaskShare, ...]) -> SecAggState:
        c = self.client
        msg = SecAggUnmask(assignment_id=assignment_id, shares=shares, timestamp=c.now(), nonce=new_nonce())
        return c._signed_answer(await c._post("/v1/secagg/unmask", msg), SecAggState, "secure aggregation unmask")
