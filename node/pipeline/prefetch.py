"""``Prefetch``: a stage's receives through the hub's relay, asked for ahead of need.

A relay receive is a GET that long-polls the hub for one message; asked only when the stage
needs the tensor, each costs the stage a whole round trip even when the tensor already waits at
the hub. The stage knows from its schedule which tensors it will receive in a step and in what
order (``StageRunner.receives``); ``expect`` hands that order over, and ``depth`` threads, each
with its own relay connection, keep GETs for the next of them in flight. What they fetch waits
in a bounded inbox as the hub handed it over (the sender's sealed header and the bytes), so at
most ``depth`` messages are in flight or held at a time. ``receive`` checks a held message
exactly as a plain relay receive does (the signed header, the sender, size and hash, then shape,
dtype and finiteness) before the tensor is used; a fetch that failed (a refusal, a stale
generation, a hub out of reach) is raised by the receive of that message. A message nobody asked
ahead for is fetched on the caller's own connection, as before. ``close`` ends every GET under
way (their sockets shut down) and joins the threads.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence

import torch
from gpuflex.protocol.tensors import TensorSpec

from ..errors import PipelineError
from .relay import RelayTransport
from .transport import MessageKey

#: how long one of the fetching threads' requests may take, in all: the stage's own timeout
#: (its receive waiting on the inbox) is what gives up on a tensor that does not come
_FETCH_FOREVER_S = 1e9

#: (the sender's sealed header in base64, the tensor's bytes), or why the fetch failed
_Fetched = tuple[str, bytes] | BaseException


class Prefetch:
    """Receives of one stage through the relay, ``depth`` of them asked ahead.

    ``relay`` makes one relay transport (its own connection); ``depth`` + 1 are made: one per
    fetching thread and the caller's own."""

    def __init__(self, relay: Callable[[], RelayTransport], *, depth: int = 8) -> None:
        if depth < 1:
            raise PipelineError(f"a prefetch keeps at least one receive ahead, not {depth}")
        self.depth = depth
        self._own = relay()
        self._relays = [relay() for _ in range(depth)]
        self._cond = threading.Condition()
        self._plan: collections.deque[MessageKey] = collections.deque()
        self._asked: set[MessageKey] = set()
        self._held: dict[MessageKey, _Fetched] = {}
        self._closed = False
        self._threads = [
            threading.Thread(target=self._fetching, args=(r,), name=f"gpuflex-prefetch-{i}")
            for i, r in enumerate(self._relays)
        ]
        for thread in self._threads:
            thread.daemon = True
            thread.start()

    def expect(self, keys: Sequence[MessageKey]) -> None:
        """The messages this stage will receive next, in the order it will need them."""
        with self._cond:
            if self._closed:
                raise PipelineError("the stage's receiver is closed")
            known = set(self._plan) | self._asked | self._held.keys()
            self._plan.extend(k for k in keys if k not in known)
            self._cond.notify_all()

    def _next(self) -> MessageKey | None:
        """The next message to ask for, once the inbox has room; None once closed."""
        with self._cond:
            while not self._closed and (
                not self._plan or len(self._asked) + len(self._held) >= self.depth
            ):
                self._cond.wait()
            if self._closed:
                return None
            key = self._plan.popleft()
            self._asked.add(key)
            return key

    def _fetching(self, relay: RelayTransport) -> None:
        while (key := self._next()) is not None:
            got: _Fetched
            try:
                got = relay.fetch(key, timeout_s=_FETCH_FOREVER_S)
            except BaseException as exc:  # raised by the receive of this message
                got = exc
            with self._cond:
                self._asked.discard(key)
                if not self._closed:
                    self._held[key] = got
                self._cond.notify_all()

    def receive(self, key: MessageKey, expected: TensorSpec, *, timeout_s: float) -> torch.Tensor:
        give_up = time.monotonic() + timeout_s
        with self._cond:
            if self._closed:
                raise PipelineError(f"{key.describe()} cannot be received: the receiver is closed")
            if key not in self._asked and key not in self._held:
                # not asked for ahead (or not yet): the caller fetches it itself
                if key in self._plan:
                    self._plan.remove(key)
                got: _Fetched | None = None
            else:
                while key not in self._held:
                    left = give_up - time.monotonic()
                    if left <= 0 or self._closed:
                        raise PipelineError(
                            f"{key.describe()} did not arrive within {timeout_s:g} s"
                        )
                    self._cond.wait(left)
                got = self._held.pop(key)
                self._cond.notify_all()
        if got is None:
            return self._own.receive(key, expected, timeout_s=timeout_s)
        if isinstance(got, BaseException):
            raise got
        return self._own.open(key, expected, *got)

    def close(self) -> None:
        """End every fetch under way and join the threads, dropping what is held (idempotent)."""
        with self._cond:
            self._closed = True
            self._plan.clear()
            self._held.clear()
            self._cond.notify_all()
        for relay in self._relays:
            relay.abort()
        for thread in self._threads:
            thread.join()
        for relay in (*self._relays, self._own):
            relay.close()


__all__ = ["Prefetch"]
