"""Settling a shard at upload: does a lone update stand for its shard the moment it arrives?

Functional core: plain values in, a frozen ``Settlement`` out; nothing here reads a clock, a
database or a random source (the spot-check draw is passed in). The ledger
(hub/domain/ledger/uploads.py) gathers the inputs and carries the decision out in the same
transaction that records the update. A shard the rule leaves open is decided later by the round
engine, off the event loop (hub/policy/round_policy.py ``decide_shard``).

The rule, in order: a shard settles at upload only when

1. one update is wanted (no replica: there is nothing to compare it with),
2. it is the shard's first accepted update,
3. the shard is still open,
4. the round's alignment with the model's trend is not to be measured first, and
5. the referee's draw does not pick the shard for a spot-check (``round_policy.spot_rate`` for
   the node's trust: the engine draws against the very same rate when it settles the shard).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gpuflex.protocol.jobspec import VerificationSpec

from .round_policy import spot_rate
from .verification import Reputation, is_trusted

#: why a shard does or does not settle at upload (the rule's numbers in the module docstring)
SettlementReason = Literal["lone_update", "replicated", "not_first", "not_open", "trend", "spot_check"]


@dataclass(frozen=True)
class Settlement:
    """The decision on a shard when an update of it is accepted: ``settles`` (its one update
    represents it, in the upload's transaction) or not (the round engine decides), and why."""

    settles: bool
    reason: SettlementReason


def settle_at_upload(*, wanted: int, accepted: int, shard_state: str, trend_measured: bool,
                     reputation: Reputation, spec: VerificationSpec, spot_draw: float) -> Settlement:
    """May the update arriving now settle its shard at once?

    ``wanted``: the updates the shard wants (1: no replica); ``accepted``: its updates accepted
    before this one; ``shard_state``: "open", "settled" or "dropped"; ``trend_measured``: the
    round's alignment with the model's trend is measured before its shards count;
    ``reputation``: the uploading node's; ``spot_draw``: the shard's spot-check draw in [0, 1)."""
    if wanted != 1:
        return Settlement(False, "replicated")
    if accepted:
        return Settlement(False, "not_first")
    if shard_state != "open":
        return Settlement(False, "not_open")
    if trend_measured:
        return Settlement(False, "trend")
    rate = spot_rate(is_trusted(reputation, spec), spec, reputation)
    if rate > 0.0 and spot_draw < rate:
        return Settlement(False, "spot_check")
    return Settlement(True, "lone_update")
