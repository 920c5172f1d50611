"""Model deltas served to nodes (protocol/blobdelta.py): made once per (base, new) pair, off
the event loop, and kept for the few pairs a round asks for.

Every node that held last round's model asks for the same delta, so the first request makes it
(in the I/O pool) and the others wait on that one; the newest ``keep`` deltas stay in memory.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from concurrent.futures import Executor

from gpuflex.protocol.blobdelta import make_delta

from .blobs import BlobStore

#: deltas kept in memory (a round's model from its one or two predecessors, for a few jobs)
KEEP = 8


class ModelDeltas:
    def __init__(self, blobs: BlobStore, pool: Executor, keep: int = KEEP) -> None:
        self.blobs = blobs
        self.pool = pool
        self.keep = keep
        self._made: OrderedDict[tuple[str, str], asyncio.Future[bytes | None]] = OrderedDict()

    async def get(self, base: str, new: str) -> bytes | None:
        """The delta from blob ``base`` to blob ``new`` (None: they differ in size)."""
        key = (base, new)
        fut = self._made.get(key)
        if fut is None:
            fut = asyncio.get_running_loop().run_in_executor(self.pool, self._make, base, new)
            self._made[key] = fut
            while len(self._made) > self.keep:
                self._made.popitem(last=False)
        else:
            self._made.move_to_end(key)
        try:
            return await asyncio.shield(fut)
        except BaseException:
            if fut.done():
                self._made.pop(key, None)  # a failed one is made again next time
            raise

    def _make(self, base: str, new: str) -> bytes | None:
        return make_delta(self.blobs.read(base), self.blobs.read(new))


__all__ = ["ModelDeltas"]
