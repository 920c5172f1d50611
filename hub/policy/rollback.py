"""Rollback: which kept model a job goes back to, and why a rollback is refused.

Every round's model is kept with its server optimizer state (the ``models`` rows), the latest
``[verification] keep_rounds`` of them (0: all; version 0, the initial model, always), and each
closed round records which updates it aggregated and whether each was verified: a replica agreed
with it or the referee reproduced it (``verified``), or neither (``unverified``: a lone update, a
replica that never came, secure aggregation's blind sum), and who verified it (``Verifier``: the
nodes whose replicas agreed, and whether the referee re-executed the whole update or one
segment of it). A node caught forging (suspended or banned, hub/policy/suspension.py) may have
written into the model through its unverified updates before it was caught; a rollback undoes
that. A verification is only as good as its verifier: for a rollback an update counts as
unverified unless a replica of a node that is not suspended or banned agreed with it, or the
referee re-executed all of it (a replay of one segment proves that segment, not the update), so
what a forger's fellow colluders vouched for is undone with the rest of its work.

``decide`` picks the model: ``before_node`` restores the model of the round where the node's
first unverified update was aggregated (the model that round trained from, before the update),
``to_round`` the model round R trained from. The job then continues from there: the round
counter moves on (a running job's open round is abandoned and the next one opens on the restored
model; a done job reopens in the round after its last), the rounds undone stay in the history
marked rolled back, and the job gains as many rounds as it lost, so it still trains as many as
its spec asks. A done job can be rolled back: a forger is often confirmed after the job ended,
and its final model is the one the owner takes away. A cancelled or failed job cannot.

When the model before the node's first unverified round is no longer kept, a rollback before it
is refused unless it asks for ``oldest_kept``: then it restores the oldest kept model after the
initial one (or the initial model when no other is kept; ``fallback_round``), undoing what can
still be undone. That rollback is partial: ``unverified_left`` names the node's unverified rounds
before the restored one, which stay in the model.

Pure: the caller gathers ``JobHistory`` from the store and applies the decision.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any, Protocol

VERIFIED = "verified"
UNVERIFIED = "unverified"
#: how much of an update the referee re-executed when it reproduced it
WHOLE = "whole"
SEGMENT = "segment"


@dataclass(frozen=True)
class Verifier:
    """Who verified an aggregated update: ``replicas``, the nodes whose replicas agreed with it, or
    ``referee``, the referee's re-execution that reproduced it (``WHOLE``: every step of it;
    ``SEGMENT``: one committed segment; None: no re-execution)."""

    replicas: tuple[str, ...] = ()
    referee: str | None = None

    def holds(self, stopped: Set[str]) -> bool:
        """Does the verification stand while the nodes ``stopped`` are suspended or banned: the
        referee re-executed the whole update, or a node not stopped agreed with it."""
        return self.referee == WHOLE or any(n not in stopped for n in self.replicas)

    def doc(self) -> dict[str, Any]:
        """As a round's evidence records it (``verified_by``)."""
        return {"replicas": list(self.replicas), **({"referee": self.referee} if self.referee else {})}

    @classmethod
    def of_doc(cls, doc: Any) -> Verifier | None:
        """The recorded verifier; None for a record that names none."""
        if not isinstance(doc, Mapping):
            return None
        replicas, referee = doc.get("replicas") or (), doc.get("referee")
        return cls(tuple(str(n) for n in replicas), referee if referee in (WHOLE, SEGMENT) else None)


class ReplayVerdict(Protocol):
    """The referee's verdict on an update (hub/policy/referee.py's ``SegmentVerdict``)."""

    @property
    def ok(self) -> bool: ...

    @property
    def evidence(self) -> Mapping[str, Any]: ...


def verifier_of(verdict: ReplayVerdict | None, agreed: Iterable[str], *, unverified: bool) -> Verifier | None:
    """Who verified an aggregated update, None when nobody did: the referee when it judged the
    update (its verdict decides; its evidence says how much it re-executed), else the nodes whose
    replicas agreed with it (``agreed``); nobody when its shard settled ``unverified``."""
    if unverified:
        return None
    if verdict is not None:
        return Verifier(referee=replay_reach(verdict.evidence)) if verdict.ok else None
    nodes = tuple(sorted(set(agreed)))
    return Verifier(nodes) if nodes else None


def replay_reach(evidence: Mapping[str, Any]) -> str:
    """``WHOLE`` when a referee verdict's evidence says the replay ran from step 0 to the update's
    last step (its one segment is the whole update), else ``SEGMENT``."""
    steps, last = evidence.get("steps"), evidence.get("last_step")
    whole = isinstance(steps, Sequence) and len(steps) == 2 and steps[0] == 0 and last is not None and steps[1] == last
    return WHOLE if whole else SEGMENT


@dataclass(frozen=True)
class Aggregated:
    """An update a closed round aggregated: ``verified`` as the round recorded it, by
    ``verified_by`` (None: the record names no verifier, and the mark stands alone)."""

    round: int
    update_id: str
    node_id: str
    verified: bool
    verified_by: Verifier | None = None

    def stands(self, stopped: Set[str]) -> bool:
        """Is it verified for a rollback while the nodes ``stopped`` are suspended or banned."""
        return self.verified and (self.verified_by is None or self.verified_by.holds(stopped))


@dataclass(frozen=True)
class JobHistory:
    """What a rollback is decided from. ``round``: the job's round counter (its open round while
    it runs; its closed rounds count when done); ``kept``: the model versions still kept (version
    R is the model round R trained from); ``rolled_back``: rounds a rollback already undid;
    ``stopped``: the nodes suspended or banned now (a verification they gave does not stand)."""

    job_id: str
    state: str
    round: int
    rounds: int
    keep_rounds: int
    aggregated: tuple[Aggregated, ...]
    kept: frozenset[int]
    rolled_back: frozenset[int]
    stopped: frozenset[str]


@dataclass(frozen=True)
class Rollback:
    """Restore model version ``to_round`` and open round ``new_round`` on it; the rounds
    ``undone`` are marked rolled back; the job's rounds become ``rounds``. ``unverified_left``: the node's
    unverified rounds that stay in the model, before ``to_round`` (a partial rollback to the
    oldest kept model; empty when all of them are undone)."""

    to_round: int
    new_round: int
    rounds: int
    undone: tuple[int, ...]
    node_id: str | None
    unverified_left: tuple[int, ...] = ()

    @property
    def partial(self) -> bool:
        """Does some of the node's unverified work stay in the model."""
        return bool(self.unverified_left)


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


def verifiers_of(evidence: Mapping[str, Any], included: Sequence[str]) -> dict[str, Verifier | None]:
    """Update id -> who verified it, for a closed round's aggregated updates, from its evidence
    (``verified_by``); None for an update it names no verifier of."""
    by = evidence.get("verified_by")
    marks = by if isinstance(by, Mapping) else {}
    return {u: Verifier.of_doc(marks.get(u)) for u in included}


def unverified_by_node(aggregated: Iterable[Aggregated], *, rolled_back: Set[int],
                       stopped: Set[str]) -> dict[str, list[int]]:
    """Node id -> the rounds, not rolled back, where its updates were aggregated unverified: never
    verified, or verified only by nodes ``stopped`` now or by a replay of one segment."""
    rounds: dict[str, set[int]] = {}
    for a in aggregated:
        if a.round not in rolled_back and not a.stands(stopped):
            rounds.setdefault(a.node_id, set()).add(a.round)
    return {node: sorted(rs) for node, rs in rounds.items()}


def unverified_rounds(history: JobHistory, node_id: str) -> list[int]:
    """The rounds, not rolled back, where the node's unverified updates were aggregated
    (``unverified_by_node``)."""
    mine = (a for a in history.aggregated if a.node_id == node_id)
    return unverified_by_node(mine, rolled_back=history.rolled_back, stopped=history.stopped).get(node_id, [])


def decide(history: JobHistory, *, before_node: str | None = None, to_round: int | None = None,
           oldest_kept: bool = False) -> Rollback | Refused:
    """The rollback asked for, or why not (the module docstring says which model). ``oldest_kept``
    (with ``before_node`` only): when the model before the node's first unverified round is no
    longer kept, fall back to the oldest kept one that undoes some of its rounds."""
    h = history
    which = Refused("bad_rollback", "say which model, one of: before a node (before_node) or a round (to_round)")
    if (before_node is None) == (to_round is None):
        return which
    if oldest_kept and before_node is None:
        return Refused("bad_rollback", "oldest_kept goes with before_node: a round (to_round) names its model")
    if h.round == 0:
        return Refused("no_closed_round", f"job {h.job_id} has no closed round to roll back")
    if h.state not in ("running", "done"):
        return Refused("job_ended", f"job {h.job_id} is {h.state}: only a running or done job can be rolled back")
    found: list[int] = []
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
        fallback = fallback_round(found, kept=h.kept, rolled_back=h.rolled_back, closed=h.round)
        if not oldest_kept or fallback is None:
            return _not_kept(h, target, before_node, found, fallback)
        target = fallback
    # a running job's open round is abandoned (undone too) and the next opens; a done job reopens
    new_round = h.round + 1 if h.state == "running" else h.round
    undone = tuple(r for r in range(target, new_round) if r not in h.rolled_back)
    return Rollback(to_round=target, new_round=new_round, rounds=h.rounds + new_round - target,
                    undone=undone, node_id=before_node, unverified_left=tuple(r for r in found if r < target))


def fallback_round(found: Sequence[int], *, kept: Set[int], rolled_back: Set[int], closed: int) -> int | None:
    """The kept model a rollback before a node falls back to when the one before its first
    unverified round is no longer kept (``found``: its unverified rounds, in order; ``closed``: the
    job's round counter, rounds under it closed). Of the kept models after the initial one, not
    rolled back, those of closed rounds: the newest before its first round (undoes them all), else
    the oldest (undoes those from it on); the initial model when no model after it is kept at
    all; None when the oldest kept comes after all of its rounds (undoes none of them)."""
    if not found:
        return None
    after_initial = sorted(v for v in kept if v > 0 and v not in rolled_back)
    if not after_initial:
        return 0
    closed_rounds = [v for v in after_initial if v < closed]
    before = [v for v in closed_rounds if v <= found[0]]
    if before:
        return before[-1]
    return closed_rounds[0] if closed_rounds and closed_rounds[0] <= found[-1] else None


def _not_kept(h: JobHistory, target: int, before_node: str | None, found: Sequence[int],
              fallback: int | None) -> Refused:
    """``round_not_kept`` in one line, naming the fallback a rollback before the node could take."""
    oldest = min((v for v in h.kept if v > 0), default=0)
    detail = (f"the model of round {target} of job {h.job_id} is no longer kept (keep_rounds = {h.keep_rounds};"
              f" the oldest kept after the initial one is round {oldest})")
    if before_node is not None and fallback is not None:
        left = ", ".join(str(r) for r in found if r < fallback) or "none"
        detail += (f"; oldest_kept (--or-oldest-kept) restores round {fallback}'s model, leaving node"
                   f" {before_node}'s unverified rounds {left} in the model")
    elif before_node is not None:
        detail += (f"; no kept model after the initial one undoes any of node {before_node}'s unverified rounds"
                   f" ({found[0]} to {found[-1]}): --to-round 0 restores the initial model")
    return Refused("round_not_kept", detail)


def prune_below(model_version: int, keep_rounds: int) -> int | None:
    """The model versions under this one may leave the store once version ``model_version`` is
    made (versions above 0 only: the initial model stays); None keeps them all."""
    if keep_rounds <= 0:
        return None
    below = model_version - keep_rounds + 1
    return below if below > 1 else None
