"""Late updates: what becomes of the assignments still training when a round closes.

A node-local job under ``[data] late = "next"`` carries each of them once into the next round
(the update counts there, trained on the model before: one round stale), on a shard of its silo;
every other one is cancelled. Pure: the round engine gathers the stragglers and applies this.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["LateCarry", "Straggler", "carry_late"]


@dataclass(frozen=True)
class Straggler:
    """An assignment still training when its round closes. ``carried_from``: the round it was
    carried from already (None: it was not); ``shard_open``: whether its shard is still the
    round's (a carried assignment keeps its shard's data, seed and samples)."""

    assignment_id: str
    carried_from: int | None
    shard_open: bool


@dataclass(frozen=True)
class LateCarry:
    """``carried``: the assignments that count in the next round, in order (the order numbers
    their new shards); ``cancelled``: the rest, void."""

    carried: tuple[str, ...]
    cancelled: tuple[str, ...]


def carry_late(
    stragglers: Sequence[Straggler],
    *,
    node_local: bool,
    late: str,
    secure_aggregation: bool,
    last_round: bool,
) -> LateCarry:
    """Carry a node-local job's stragglers into the next round under ``late = "next"``, each at
    most once, never past the job's last round and never under secure aggregation (a masked update
    belongs to its round's roster); cancel every other one."""
    allowed = node_local and late == "next" and not secure_aggregation and not last_round
    carried = tuple(
        s.assignment_id for s in stragglers if allowed and s.carried_from is None and s.shard_open
    )
    keep = set(carried)
    return LateCarry(
        carried, tuple(s.assignment_id for s in stragglers if s.assignment_id not in keep)
    )
