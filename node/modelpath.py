"""Whole model or delta: the node fetches each round's model the way that reached it sooner.

A delta (protocol/blobdelta.py) is 1.4-1.8x smaller than the model, but it costs time the
whole download does not: the hub makes it (some 20 ms for a 1.2 MB model), the node applies it
(some 7 ms) and asks for it in a request of its own. Over a home line the bytes it saves are
worth far more than that; over a LAN or loopback it only makes the round slower (on the
2-node digits job of bench/scaling.py, 15-35 ms of a 0.9 s round).

So the node times both: each way's latest wall time, request to cached blob, per byte of the
model. It takes the faster one. The slower one is tried again after ``RETRY_FIRST`` rounds,
then after twice as many each time it loses again, so a link that changes speed is noticed
and a home line pays for a whole download only a few times in a long job. Round 0's whole
download shares the link with the chunks: its timing is on the slow side, which favours the
delta until the whole model is timed alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal

Way = Literal["whole", "delta"]

#: the way not taken is first tried again after this many rounds; the wait doubles each time
#: it loses again
RETRY_FIRST: Final = 4


@dataclass
class Timing:
    s_per_byte: float | None = None  # the latest timing, seconds per byte of the model
    rounds_since: int = 0  # rounds the other way was taken since this one was
    retry_after: int = RETRY_FIRST


@dataclass
class ModelPath:
    """The node's choice between a whole model download and a delta from the model it holds."""

    ways: dict[Way, Timing] = field(default_factory=lambda: {"whole": Timing(), "delta": Timing()})

    def _faster(self) -> Way | None:
        whole, delta = self.ways["whole"].s_per_byte, self.ways["delta"].s_per_byte
        if whole is None or delta is None:
            return None
        return "delta" if delta < whole else "whole"

    def choose(self) -> Way:
        """The way to fetch the next model (called only when the node holds the one before)."""
        if self.ways["delta"].s_per_byte is None:
            return "delta"  # untimed: it saves bytes
        faster = self._faster()
        if faster is None:
            return "whole"
        slower: Way = "whole" if faster == "delta" else "delta"
        t = self.ways[slower]
        return slower if t.rounds_since >= t.retry_after else faster

    def record(self, way: Way, seconds: float, model_bytes: int) -> None:
        """``way`` brought a model of ``model_bytes`` in ``seconds`` (request to cached blob)."""
        retried = self._faster() not in (None, way)
        t = self.ways[way]
        t.s_per_byte = max(seconds, 0.0) / max(model_bytes, 1)
        t.rounds_since = 0
        other: Way = "delta" if way == "whole" else "whole"
        self.ways[other].rounds_since += 1
        if retried:  # the slower way was tried again: wait longer next time if it lost again
            t.retry_after = t.retry_after * 2 if self._faster() != way else RETRY_FIRST


__all__ = ["RETRY_FIRST", "ModelPath", "Timing", "Way"]
