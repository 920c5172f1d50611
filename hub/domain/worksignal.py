"""Waking the nodes that wait in a long-poll (POST /v1/work) when work may have appeared.

Waking every waiting poll on every change is a storm at scale: each woken poll runs the
scheduler's plan, so with thousands of idle nodes one returned shard or one wanted replica
costs thousands of plans (bench/simulation.py measured the hub's CPU per node and round
growing 5x from 100 to 3,000 nodes that way). So a change says how far it reaches:

- ``notify()``: every waiting poll (a round opened, a job started or ended, shutdown);
- ``offer()``: work for *some* node (chunks back in the pool). The poll that has waited
  longest is woken first; it passes the offer on (``pass_on``) when it got work (more may be
  left) or when it found nothing, until ``MISSES`` polls in a row found nothing;
- ``offer(to=...)``: work for one node that ``to`` accepts (a replica wanted: not a member of
  the group, not its address block, trusted first): the longest-waiting such poll; it passes
  the offer on only if it found nothing after all;
- ``for_node(node_id)``: that node's polls only (the referee asks it for states, a ban).

No wake-up is lost to a poll that is between its plan and its wait: every change bumps
``generation``, a poll reads it before planning (``since``), and ``wait`` returns at once
when it has moved. A poll that times out has simply waited its ``wait_s``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal

__all__ = ["MISSES", "Pulse", "Target", "Wake", "WorkSignal", "pass_on"]

#: polls in a row that may find nothing before an offer stops travelling
MISSES: Final = 3

WakeKind = Literal["timeout", "all", "offer", "node", "moved"]


#: which waiting node an offer is for (node id -> may it take the work?)
Target = Callable[[str], bool]


@dataclass(frozen=True)
class Wake:
    """Why a wait ended. For an offer: ``misses``, how many polls before this one found nothing;
    ``to``, the nodes it is for (None: any)."""

    kind: WakeKind
    misses: int = 0
    to: Target | None = None


def pass_on(wake: Wake, got_work: bool) -> int | None:
    """After a poll woken by ``wake`` planned: the ``misses`` to offer the next poll with (for the
    same nodes, ``wake.to``), or None when the offer stops here: it was no offer, it was for one
    node and that node took it, or ``MISSES`` polls in a row found nothing."""
    if wake.kind != "offer":
        return None
    if got_work:
        return None if wake.to is not None else 0
    misses = wake.misses + 1
    return misses if misses < MISSES else None


@dataclass
class _Waiter:
    node_id: str
    future: asyncio.Future[Wake]


class WorkSignal:
    def __init__(self) -> None:
        self._waiters: OrderedDict[int, _Waiter] = OrderedDict()  # oldest first
        self._ids = itertools.count()
        self.generation = 0
        self.closing = False

    def __len__(self) -> int:
        return len(self._waiters)

    def _wake(self, key: int, wake: Wake) -> None:
        waiter = self._waiters.pop(key)
        if not waiter.future.done():
            waiter.future.set_result(wake)

    def notify(self) -> None:
        """Wake every waiting poll."""
        self.generation += 1
        for key in list(self._waiters):
            self._wake(key, Wake("all"))

    def offer(self, misses: int = 0, to: Target | None = None) -> bool:
        """Wake the poll that has waited longest, of a node ``to`` accepts (None: any node);
        False if no such poll waits."""
        self.generation += 1
        for key, waiter in self._waiters.items():
            if to is None or to(waiter.node_id):
                self._wake(key, Wake("offer", misses, to))
                return True
        return False

    def for_node(self, node_id: str) -> None:
        """Wake the polls of one node."""
        self.generation += 1
        for key in [k for k, w in self._waiters.items() if w.node_id == node_id]:
            self._wake(key, Wake("node"))

    def close(self) -> None:
        """The hub is stopping: wake every long-poll now so none holds the shutdown up."""
        self.closing = True
        self.notify()

    async def wait(self, node_id: str, within_s: float, since: int | None = None) -> Wake:
        """Wait up to ``within_s`` for a wake-up meant for ``node_id``. ``since``: the generation
        read before the caller last planned; if anything changed after it, return at once."""
        if self.closing:
            return Wake("all")
        if since is not None and since != self.generation:
            return Wake("moved")
        key = next(self._ids)
        future: asyncio.Future[Wake] = asyncio.get_running_loop().create_future()
        self._waiters[key] = _Waiter(node_id, future)
        try:
            async with asyncio.timeout(max(0.0, within_s)):
                return await future
        except TimeoutError:
            return Wake("timeout")
        except asyncio.CancelledError:  # the poll went away (the client hung up): an offer it got goes on
            if future.done() and not future.cancelled() and (got := future.result()).kind == "offer":
                self.offer(got.misses, got.to)
            raise
        finally:
            self._waiters.pop(key, None)


class Pulse:
    """Wakes every waiter each time it fires: the secure-aggregation long-polls (POST
    /v1/secagg/poll), a handful per round, wait on it for their round to move on. A waiter takes
    ``event`` before it looks at the state it waits on, so a fire in between is not lost."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    @property
    def event(self) -> asyncio.Event:
        return self._event

    def fire(self) -> None:
        fired, self._event = self._event, asyncio.Event()
        fired.set()
