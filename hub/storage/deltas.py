"""Model deltas served to nodes (protocol/blobdelta.py): made once per (base, new) pair, off
the event loop, and kept for the few pairs a round asks for.

Every node that held last round's model asks for the same delta, so the first request makes it
(in the I/O pool) and the others wait on that one; the newest ``keep`` deltas stay in memory, and
never more than ``max_bytes`` of them (a 100 MB model's delta is some 60 MB).

As a round publishes its model the hub starts its delta at once (``published``), but only when
some node fetched the model before it as a delta too: nodes on fast links take the model whole
(node/modelpath.py), and a delta made for nobody costs the machine's CPU some 20 ms per 1.2 MB of
model, at the moment the round's nodes start training. A node that asks anyway gets the delta
made on demand.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from concurrent.futures import Executor

from gpuflex.protocol.blobdelta import make_delta

from .blobs import BlobStore

#: deltas kept in memory (a round's model from its one or two predecessors, for a few jobs)
KEEP = 8
#: and at most this many bytes of them (the newest one is always kept)
MAX_BYTES = 256 << 20


class ModelDeltas:
    def __init__(self, blobs: BlobStore, pool: Executor, keep: int = KEEP, max_bytes: int = MAX_BYTES) -> None:
        self.blobs = blobs
        self.pool = pool
        self.keep = keep
        self.max_bytes = max_bytes
        self._made: OrderedDict[tuple[str, str], asyncio.Future[bytes | None]] = OrderedDict()
        self._asked: OrderedDict[str, None] = OrderedDict()  # models some node fetched as a delta (newest last)

    def _held(self) -> int:
        return sum(len(f.result() or b"") for f in self._made.values()
                   if f.done() and not f.cancelled() and f.exception() is None)

    def published(self, base: str, new: str) -> None:
        """A round published model ``new`` after ``base``: make its delta ahead if ``base`` itself
        was fetched as a delta (nodes that did so once will likely do so again). On the event loop."""
        if base in self._asked:
            self.prepare(base, new)

    def prepare(self, base: str, new: str) -> None:
        """Start making the delta now (the I/O pool), without waiting (``published`` and ``get``
        call it), so the nodes that ask a moment later find it made or under way. Must be called
        on the event loop."""
        key = (base, new)
        if key in self._made:
            return
        fut = asyncio.get_running_loop().run_in_executor(self.pool, self._make, base, new)
        fut.add_done_callback(lambda f: None if f.cancelled() else f.exception())  # never "never retrieved"
        self._made[key] = fut
        while len(self._made) > self.keep:
            self._made.popitem(last=False)

    async def get(self, base: str, new: str) -> bytes | None:
        """The delta from blob ``base`` to blob ``new`` (None: they differ in size)."""
        key = (base, new)
        self._asked[new] = None
        self._asked.move_to_end(new)
        while len(self._asked) > 4 * self.keep:
            self._asked.popitem(last=False)
        if key not in self._made:
            self.prepare(base, new)
        else:
            self._made.move_to_end(key)
        fut = self._made[key]
        try:
            delta = await asyncio.shield(fut)
        except BaseException:
            if fut.done():
                self._made.pop(key, None)  # a failed one is made again next time
            raise
        while len(self._made) > 1 and self._held() > self.max_bytes:
            self._made.popitem(last=False)
        return delta

    def _make(self, base: str, new: str) -> bytes | None:
        return make_delta(self.blobs.read(base), self.blobs.read(new))


__all__ = ["ModelDeltas"]
