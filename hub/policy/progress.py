"""Heartbeats prove progress: when a heartbeat may move an assignment's deadline.

A heartbeat carries the steps the node has trained so far and a running digest of them
(a SHA-256 chain over the per-step losses, see ``gpuflex.protocol.messages.progress_digest``).
The hub cannot recompute the chain (it does not train), but it holds the node to it:

- the deadline moves only when the step count went up AND the digest changed (a node
  that repeats itself, or counts backwards, gets no more time);
- a step count above what the shard has (ceil(samples / batch) x local epochs) is no proof;
- however much progress is reported, the deadline never passes
  ``issued_at + progress_extension_max x the first window`` (nor ``max_assignment_s``),
  so fake progress buys a bounded delay, after which the assignment expires and its
  chunks go back to the pool;
- a node whose assignment expired undelivered waits ``stall_backoff_s`` (doubling per
  expiry in a row, up to an hour) before it gets new work (hub/domain/scheduler.py ``plan``),
  so identities that hold shards without delivering cannot take them straight back.

The digest chain is kept with the assignment in memory as a commitment the referee's
re-execution (issue 14, item 4) can check. Pure function; the ledger applies it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Progress", "heartbeat_deadline", "stall_backoff"]

MAX_STALL_BACKOFF_S = 3600.0


@dataclass(frozen=True)
class Progress:
    """The last progress a heartbeat proved for one assignment."""

    steps: int = 0
    digest: bytes = b""


def heartbeat_deadline(*, now: float, issued_at: float, deadline: float, window_s: float, steps: int,
                       digest: bytes, last: Progress, total_steps: int, extension_max: float,
                       max_assignment_s: float) -> tuple[float, str]:
    """(the new deadline, why) for a heartbeat reporting ``steps`` and ``digest``.

    ``window_s`` is the assignment's first window, max(min_deadline_s, expected_s x slack).
    """
    if steps <= last.steps or digest == last.digest or not digest:
        return deadline, "no new progress; deadline unchanged"
    if steps > total_steps:
        return deadline, f"{steps} steps is more than the shard has ({total_steps}); deadline unchanged"
    cap = issued_at + min(max_assignment_s, max(window_s, extension_max * window_s))
    new = min(max(deadline, now + window_s), cap)
    if new <= deadline:
        return deadline, "progress noted; the deadline is at its bound"
    return new, "deadline extended"


def stall_backoff(stalls: int, base_s: float) -> float:
    """Seconds a node waits for new work after ``stalls`` expiries in a row (doubling, capped)."""
    if stalls <= 0 or base_s <= 0:
        return 0.0
    return min(MAX_STALL_BACKOFF_S, base_s * 2.0 ** min(stalls - 1, 20))
