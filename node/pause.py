"""The node's pause/resume state machine, and what a pause or an exit interrupts.

    running --pause(reason)--> paused --resume()--> running
       \\___________ request_exit(reason) ___________/--> exiting (final)

A pause or an exit sets ``stop_training`` (a thread-safe flag the training thread polls
between batches) and the ``interrupt`` event, so that whatever the work loop is waiting
on (a long-poll, a download, a backoff sleep) is cancelled at once: :meth:`interruptible`
raises :class:`Interrupted`. A resume clears both unless the node is exiting.

No I/O here beyond the events it reports; the work loop decides what an interruption
means (abandon the assignment in hand, tell the hub).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Interrupted(Exception):
    """Internal: the node was paused or asked to exit while waiting."""


class EventSink(Protocol):
    def event(self, event: str, **fields: Any) -> None: ...


class PauseState:
    """Whether the node takes work; the events a pause, a resume or an exit fire."""

    def __init__(self, output: EventSink) -> None:
        self._output = output
        self.paused = False
        self.reason = ""
        self.exiting = False
        # Thread-safe flag the training thread polls between batches.
        self.stop_training = threading.Event()
        self.interrupt = asyncio.Event()  # set while paused or exiting: waits are cut short
        self.resumed = asyncio.Event()  # set while not paused
        self.resumed.set()
        self.exited = asyncio.Event()  # set once the node is exiting (side loops end)

    def pause(self, reason: str = "user") -> bool:
        """Stop taking work; interrupt the assignment in hand. False when already paused."""
        if self.paused:
            return False
        self.paused = True
        self.reason = reason
        self.stop_training.set()
        self.interrupt.set()
        self.resumed.clear()
        self._output.event("paused", reason=reason)
        return True

    def resume(self) -> bool:
        """Take work again. False when not paused."""
        if not self.paused:
            return False
        self.paused = False
        self.reason = ""
        if not self.exiting:
            self.stop_training.clear()
            self.interrupt.clear()
        self.resumed.set()
        self._output.event("resumed")
        return True

    def request_exit(self, reason: str = "signal") -> None:
        """Leave for good: every wait ends, training stops at the next batch."""
        if self.exiting:
            return
        self.exiting = True
        if reason != "done":
            self._output.event("stopping", reason=reason)
        self.stop_training.set()
        for ev in (self.interrupt, self.exited, self.resumed):
            ev.set()

    def new_assignment(self) -> None:
        """A stop meant for the previous assignment is spent once a new one starts."""
        if not self.paused and not self.exiting:
            self.stop_training.clear()

    async def interruptible(self, aw: Awaitable[T]) -> T:
        """Await ``aw`` unless the node pauses or exits first (then cancel it, raise Interrupted)."""
        if self.interrupt.is_set():
            if asyncio.iscoroutine(aw):
                aw.close()
            raise Interrupted
        task = asyncio.ensure_future(aw)
        waiter = asyncio.ensure_future(self.interrupt.wait())
        try:
            done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (task, waiter):
                if not t.done():
                    t.cancel()
            for t in (task, waiter):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        if task in done and not task.cancelled():
            return task.result()
        raise Interrupted

    async def sleep(self, seconds: float) -> None:
        """Sleep, ending early (quietly) on a pause or an exit."""
        with contextlib.suppress(Interrupted):
            await self.interruptible(asyncio.sleep(seconds))

    async def tick(self, seconds: float) -> None:
        """Wait ``seconds`` or until the node exits, whichever comes first (side loops)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self.exited.wait()


__all__ = ["EventSink", "Interrupted", "PauseState"]
