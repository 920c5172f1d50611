"""The relay's memory: bounded mailboxes of pipeline tensors, never written to the database.

One mailbox per message key (job, step, micro-batch, what it carries, from stage, to stage,
generation) holds at most one message: the sender's sealed header, as it came, and the tensor's
bytes. A message is taken once; one not taken within ``ttl_s`` is dropped. The relay holds at most
``max_bytes`` in all and ``max_per_job`` messages per job; beyond, a sender is told to retry
(429) and nothing is kept.

A take whose client hung up ends within ``HANG_UP_POLL_S`` and takes nothing: the relay asks each
waiting take's ``hung_up`` (its connection closed), one sweep for all of them (``watch``). The
hub's server does not cancel a handler whose client went away (aiohttp's handler cancellation is
off, and stays off: a cancelled handler could stop between a durable write and the memory that
follows it), and a GET has no body whose end would say so; a closed transport is what remains.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..base.errors import Conflict, TooManyRequests
from ..model.relay import RelayRegistry

#: (job, step, micro-batch, carries, from stage, to stage, generation)
RelayKey = tuple[str, int, int, str, int, int, int]

#: how often the waiting takes are asked whether their client hung up
HANG_UP_POLL_S = 0.1


@dataclass(frozen=True)
class RelayMessage:
    header: bytes  # the sender's sealed RelayHeader, as received
    body: bytes  # one GFT1 tensor
    expires: float


@dataclass
class Relay:
    """The relay's plans (``registry``) and mailboxes. Everything runs on the event loop."""

    registry: RelayRegistry = field(default_factory=RelayRegistry)
    max_bytes: int = 512 << 20
    max_per_job: int = 4096
    ttl_s: float = 120.0
    clock: Callable[[], float] = time.monotonic
    held_bytes: int = 0
    _boxes: dict[RelayKey, RelayMessage] = field(default_factory=dict)
    _per_job: dict[str, int] = field(default_factory=dict)
    _waiting: dict[RelayKey, asyncio.Future[None]] = field(default_factory=dict)
    _hung_up: dict[RelayKey, Callable[[], bool]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._boxes)

    def put(self, key: RelayKey, header: bytes, body: bytes) -> None:
        """Keep one message (Conflict when its mailbox is full, TooManyRequests when the relay is)."""
        self.expire()
        if key in self._boxes:
            raise Conflict(
                "the relay already holds this message; it is taken once", code="relay_duplicate"
            )
        size = len(header) + len(body)
        job = key[0]
        if self.held_bytes + size > self.max_bytes or self._per_job.get(job, 0) >= self.max_per_job:
            raise TooManyRequests(
                "the relay is full; send again once the next stage has taken its messages",
                retry_after_s=1.0,
                code="relay_full",
            )
        self._boxes[key] = RelayMessage(header, body, self.clock() + self.ttl_s)
        self.held_bytes += size
        self._per_job[job] = self._per_job.get(job, 0) + 1
        waiter = self._waiting.get(key)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(
        self, key: RelayKey, wait_s: float, hung_up: Callable[[], bool] | None = None
    ) -> RelayMessage | None:
        """The message under ``key``, removed; waits up to ``wait_s`` for it to come (None then).
        ``hung_up()``: whether the taker's client went away; a take that finds it so ends (within
        ``HANG_UP_POLL_S`` while ``watch`` runs) with None, and leaves the message where it is."""
        message = self._pop(key)
        if message is not None or wait_s <= 0:
            return message
        if key in self._waiting:
            raise Conflict("another request is already waiting for this message", code="relay_busy")
        waiter = self._waiting[key] = asyncio.get_running_loop().create_future()
        if hung_up is not None:
            self._hung_up[key] = hung_up
        try:
            async with asyncio.timeout(wait_s):
                await waiter
        except TimeoutError:
            pass
        finally:
            self._waiting.pop(key, None)
            self._hung_up.pop(key, None)
        if hung_up is not None and hung_up():
            return None
        return self._pop(key)

    def wake_hung_up(self) -> int:
        """End every waiting take whose client hung up; how many."""
        woken = 0
        for key, hung_up in self._hung_up.items():
            waiter = self._waiting.get(key)
            if waiter is not None and not waiter.done() and hung_up():
                waiter.set_result(None)
                woken += 1
        return woken

    async def watch(self, every_s: float = HANG_UP_POLL_S) -> None:
        """Background loop: ``wake_hung_up`` every ``every_s``."""
        while True:
            await asyncio.sleep(every_s)
            self.wake_hung_up()

    def wake_all(self) -> None:
        """Answer every waiting take now (the hub is shutting down): each finds what is there, or None."""
        for waiter in self._waiting.values():
            if not waiter.done():
                waiter.set_result(None)

    def _pop(self, key: RelayKey) -> RelayMessage | None:
        self.expire()
        message = self._boxes.pop(key, None)
        if message is not None:
            self._forget(key, message)
        return message

    def _forget(self, key: RelayKey, message: RelayMessage) -> None:
        self.held_bytes -= len(message.header) + len(message.body)
        left = self._per_job[key[0]] - 1
        if left:
            self._per_job[key[0]] = left
        else:
            del self._per_job[key[0]]

    def expire(self) -> None:
        """Drop the messages nobody took in time (the oldest first: mailboxes fill in time order)."""
        now = self.clock()
        while self._boxes:
            key = next(iter(self._boxes))
            message = self._boxes[key]
            if message.expires > now:
                return
            del self._boxes[key]
            self._forget(key, message)


__all__ = ["HANG_UP_POLL_S", "Relay", "RelayKey", "RelayMessage"]
