"""Giving work back to the hub: an abandoned assignment (pause, shutdown, an error) and a silo
the operator removed. The hub is told at once when it can be reached, so the shard is free
again without waiting for its deadline; what it was told is remembered for
`gpuflex-node pause` to report."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from gpuflex.protocol.messages import Assignment

from .client import HubClient
from .errors import NodeError
from .output import Output
from .totals import Totals

log = logging.getLogger(__name__)

__all__ = ["HandBack"]

#: how many of the latest abandoned assignments are remembered (pause asks about the newest)
REMEMBERED = 16


class HandBack:
    def __init__(self, client: Callable[[], HubClient], output: Output, totals: Callable[[], Totals],
                 *, timeout_s: float) -> None:
        self._client = client
        self.output = output
        self._totals = totals
        self.timeout_s = timeout_s
        self.told: dict[str, bool] = {}  # the latest abandoned assignments: was the hub told?

    async def abandon(self, a: Assignment, reason: str) -> None:
        self._totals().abandoned += 1
        told = await self.tell_abandon(a.assignment_id, reason)
        self.told[a.assignment_id] = told
        while len(self.told) > REMEMBERED:
            del self.told[next(iter(self.told))]
        self.output.event("abandoned", assignment_id=a.assignment_id, reason=reason, hub_told=told)

    async def tell_abandon(self, assignment_id: str, reason: str) -> bool:
        """Tell the hub (True) or give up after the timeout (False: the deadline frees it)."""
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._client().abandon(assignment_id, reason, limit_s=self.timeout_s)
            return True
        except (NodeError, TimeoutError) as exc:
            log.info("could not tell the hub about abandoning %s: %s", assignment_id, exc)
            return False

    async def tell_withdrawn(self, job_id: str, sha256: str) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                ack = await self._client().withdraw_silo(job_id, sha256, limit_s=self.timeout_s)
            self.output.event("silo_withdrawn", job_id=job_id, sha256=sha256, detail=ack.detail)
        except (NodeError, TimeoutError) as exc:
            log.info("could not tell the hub that the silo of job %s was removed: %s", job_id, exc)
