"""Rollback: which kept model a job goes back to, and why a rollback is refused.

Every round's model is kept with its server optimizer state (the ``models`` rows), the latest
``[verification] keep_rounds`` of them (0: all; version 0, the initial model, always), and each
closed round records which updates it aggregated and whether each was verified: a replica agreed
with it or the referee reproduced it (``verified``), or neither (``unverified``: a lone update, a
replica that never came, secure aggregation's blind sum). A node caught forging (suspended or
banned, hub/policy/suspension.py) may have written into the model through its unverified updates
before it was caught; a rollback undoes that.

``decide`` picks the model: ``before_node`` restores the model of the round where the node's
first unverified update was aggregated (the model that round trained from, before the update),
``to_round`` the model round R trained from. The job then continues from there: the round
counter moves on (a running job's open round is abandoned and the next one opens on the restored
model; a done job reopens in the round after its last), the rounds undone stay in the history
marked rolled back, and the job gains as many rounds as it lost, so it still trains as many as
its spec asks. A done job can be rolled back: a forger is often confirmed after the job ended,
and its final model is the one the owner takes away. A cancelled or failed job cannot.

Pure: the caller gathers ``JobHistory`` from the store and applies the decision.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

VERIFIED = "verified"
UNVERIFIED = "unverified"


@dataclass(frozen=True)
class Aggregated:
    """An update a closed round aggregated."""

    round: int
    update_id: str
    node_id: str
    verified: bool


@dataclass(frozen=True)
class JobHistory:
    """What a rollback is decided from. ``round``: the job's round counter (its open round while
    it runs; its closed rounds count when done); ``kept``: the model versions still kept (version
    R is the model round R trained from); ``rolled_back``: rounds a rollback already undid."""

    job_id: str
    state: str
    round: int
    rounds: int
    keep_rounds: int
    aggregated: tuple[Aggregated, ...]
    kept: frozenset[int]
    rolled_back: frozenset[int]


@dataclass(frozen=True)
class Rollback:
    """Restore model version ``to_round`` and open round ``new_round`` on it; the rounds
    ``undone`` are marked rolled back; the job's rounds become ``rounds``."""

    to_round: int
    new_round: int
    rounds: int
    undone: tuple[int, ...]
    node_id: str | None


@dataclass(frozen=True)
class Refused:
    """Why not, in one line; ``code`` names it for the API (409 unless ``bad_round``: 400)."""

    code: str
    detail: str


def verification_of(evidence: Mapping[str, Any], included: Sequence[str]) -> dict[str, bool]:
    """Update id -> verified, for a closed round's aggregated updates, from its evidence: the
    marks the round recorded (``aggregated``), or for a round that recorded none, every update
    not listed ``unverified``."""
    marks = evidence.get("aggregated")
    if isinstance(marks, Mapping):
        return {u: marks.get(u) == VERIFIED for u in included}
    unverified = evidence.get("unverified") or {}
    return {u: u not in unverified for u in included}


def unverified_rounds(history: JobHistory, node_id: str) -> list[int]:
    """The rounds, not rolled back, where the node's unverified updates were aggregated."""
    return sorted({a.round for a in history.aggregated
                   if a.node_id == node_id and not a.verified and a.round not in history.rolled_back})


def decide(history: JobHistory, *, before_node: str | None = None, to_round: int | None = None) -> Rollback | Refused:
    """The rollback asked for, or why not (the module docstring says which model)."""
    h = history
    which = Refused("bad_rollback", "say which model, one of: before a node (before_node) or a round (to_round)")
    if (before_node is None) == (to_round is None):
        return which
    if h.round == 0:
        return Refused("no_closed_round", f"job {h.job_id} has no closed round to roll back")
    if h.state not in ("running", "done"):
        return Refused("job_ended", f"job {h.job_id} is {h.state}: only a running or done job can be rolled back")
    if to_round is not None:
        target = to_round
        if not 0 <= target < h.round:
            return Refused("bad_round", f"round must be a closed round of job {h.job_id}: 0 to {h.round - 1},"
                                        f" got {target}")
        if target in h.rolled_back:
            return Refused("rolled_back", f"round {target} of job {h.job_id} was rolled back already")
    elif before_node is not None:
        found = unverified_rounds(h, before_node)
        if not found:
            return Refused("nothing_to_roll_back", f"node {before_node} has no unverified update aggregated in"
                                                   f" job {h.job_id} (outside rounds already rolled back)")
        target = found[0]
    else:  # (neither: refused above)
        return which
    if target not in h.kept:
        oldest = min((v for v in h.kept if v > 0), default=0)
        return Refused("round_not_kept", f"the model of round {target} of job {h.job_id} is no longer kept"
                                         f" (keep_rounds = {h.keep_rounds}; the oldest kept after the"
                                         f" initial one is round {oldest})")
    # a running job's open round is abandoned (undone too) and the next opens; a done job reopens
    new_round = h.round + 1 if h.state == "running" else h.round
    undone = tuple(r for r in range(target, new_round) if r not in h.rolled_back)
    return Rollback(to_round=target, new_round=new_round, rounds=h.rounds + new_round - target,
                    undone=undone, node_id=before_node)


def prune_below(model_version: int, keep_rounds: int) -> int | None:
    """The model versions under this one may leave the store once version ``model_version`` is
    made (versions above 0 only: the initial model stays); None keeps them all."""
    if keep_rounds <= 0:
        return None
    below = model_version - keep_rounds + 1
    return below if below > 1 else None
