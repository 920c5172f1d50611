"""The round policy: what happens to a shard's replicas, and what a round's review flags.

Functional core: plain typed values in, a frozen decision out. Nothing here
reads a clock, a database or an unseeded random source, and no input is mutated. The
round engine (hub/domain/rounds.py) gathers the inputs, calls these functions and applies what
they return; bench/robustness.py calls the very same functions in the same order, so
the published robustness figures describe the policy the hub runs.

- ``decide_shard``: one shard's accepted updates + the replica state ->
  ``WaitForMore`` (ask for one more replica, or keep waiting) | ``Settle`` (one
  update represents the shard) | ``Drop`` (nothing of it is aggregated; its chunks
  go back to the pool).
- ``judge_round``: the round's candidate updates (one per settled shard) ->
  ``RoundJudgement``: review_round's scores and flags, plus the vouching rule: when
  review flags the representative of an agreeing replica group, every member that
  agreed with it is flagged too, and the minority's replica_mismatch flags are
  withdrawn (the minority was right) when the minority's own update passes the same review.

The rules of ``decide_shard``, in order:

1. Not due: fewer updates than wanted, the replica wait not run out, and either a
   replica assignment still out or an online node that could take one -> keep waiting
   (``WaitForMore`` with ``wanted`` unchanged). A replica nobody can take is never waited
   for: with one update, no replica out and no online node that may take one (every other
   online node shares an address block or an operator with the holder, or none is online:
   ``replica_hopeless``) the shard is due at once.
2. A lone update (no replica came in time, none can come, or none was wanted) is used;
   unverified when a replica was wanted (no agreement credit): "no_replica_holder" when none
   could come, else "lone_update". With the referee on, a lone update no replica can come
   for is re-executed first (rule 4, ``stand_in``).
3. Otherwise ``replicas.compare_replicas`` judges the group (trusted = members
   whose reputation ``is_trusted``; until a group holds a trusted node it needs one
   more agreeing replica, and a split among untrusted nodes accuses nobody).
   - It wants another replica: ask for one (``wanted + 1``) while below
     ``max_replicas`` and the wait has not run out, unless the replicas are already
     unanimous and nobody could take another one. Otherwise unanimous replicas settle
     unverified (one represents the shard, the rest are redundant, no credit, no
     flags) and a split is dropped inconclusive (nobody flagged).
   - A majority stands: its medoid represents the shard, the rest of the majority is
     redundant and credited, the minority is flagged ``replica_mismatch``.
   - No majority at ``max_replicas``: everyone flagged, dropped. A split among
     untrusted nodes at ``max_replicas`` whose dissent is not blatant: dropped
     inconclusive, nobody flagged.
   Which tolerance: a same-class group (every member of one compute class for the job's
   precision, ``ReplicaState.comparison``) keeps the strict ``tolerance``; a cross-class
   group is judged by ``judge_cross_class`` (``cross_class_tolerance``) unless the referee
   (rule 4) can re-execute it. Either way the evidence names the comparison and the
   members' class keys.
4. The referee (issue 14; hub/policy/referee.py), when the caller passes ``committed`` (the updates
   that carry a checkpoint commitment; None switches the referee off, as bench/robustness.py
   does): replicas that disagree are not judged by the strict comparison: every member is
   re-executed on one segment first (``Referee``). Members whose segment reproduces are
   honest, whatever their whole-update distance (numerically different hardware); a member
   whose segment does not, or who was asked and did not hand over its states
   (``unverifiable``), is flagged and left out, and so is every member that agreed with it
   without being reproduced itself (it vouched for it). A member that never came back for the
   request before its deadline (``unreachable``: offline, a volunteer whose machine slept after
   the upload) is left out with no flag; it loses its run of agreements (``missed_nodes``). A shard that would settle is spot-checked when
   ``spot_draw`` (the engine's secret draw in [0, 1) for the shard) falls under its rate
   (``spot_rate``): ``[verification] spot_check`` for a group of untrusted nodes,
   ``spot_check_trusted`` for work a trusted node did (usually a lone, unreplicated update).
   Its representative is re-executed before it counts. Trust saves a node the replica, never
   every check: a node that earned trust and then crafts (a patient colluder) meets the
   referee at that rate. Whatever the draw, a representative that points against the model's
   trend in some layer (``trend``: its lowest layer cosine to the global model's movement over
   the last ``trend_rounds`` rounds, under ``trend_cosine_min``; distances.trend_alignment)
   is re-executed first (reason "against_trend"): honest updates follow the trend, so this
   costs about 1 % of them a replay, and a crafted one meets the referee on its first try
   instead of one time in ten.
   A lone update of a replicated shard that no replica can come for (rule 1) and that carries a
   commitment is always re-executed (reason "no_replica_holder"): the referee stands in for
   the replica, so nodes of one machine or one NAT are verified at once instead of waiting
   ``replica_wait_s`` and counting unverified. That check earns no agreement: trust comes only
   from replicas of other blocks and operators, so identities of one block gain none from it.
5. ``unverified = "accept"`` (the default) aggregates what rules 2-3 settle unverified,
   and the round's audit entry and status list it; ``"hold"`` keeps such a shard open
   (``WaitForMore``; one more replica wanted while below ``max_replicas`` when agreeing
   replicas cannot vouch for each other) until a replica comes that verifies it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any, Literal

from gpuflex.protocol.jobspec import VerificationSpec

from .aggregation import DEFAULT_SLICE_ELEMS
from .referee import SegmentVerdict
from .replica_comparison import (
    Distances,
    ReplicaOutcome,
    ReplicaPair,
    compare_replicas,
    fingerprinted,
    measured_in_full,
)
from .reputation import Reputation, is_trusted
from .round_review import RoundReview, review_round
from .spot_checks import trusted_rate
from .update_record import Flag, UpdateRecord, jsonable

__all__ = [
    "NO_REPLICA_HOLDER",
    "Comparison",
    "Drop",
    "GroupMember",
    "Referee",
    "ReplicaState",
    "RoundJudgement",
    "Settle",
    "ShardDecision",
    "StandIn",
    "WaitForMore",
    "against_trend",
    "bound_weights",
    "decide_shard",
    "judge_cross_class",
    "judge_round",
    "replica_hopeless",
    "shard_due",
    "spot_rate",
    "stand_in",
    "trend_base_round",
]

#: the referee's reason (and an unverified shard's) when no replica of a lone update can come
NO_REPLICA_HOLDER = "no_replica_holder"


#: how a replica group's members are compared: one compute class (strict) or several
Comparison = Literal["same_class", "cross_class"]


@dataclass(frozen=True)
class ReplicaState:
    """What the hub knows about a shard's replicas besides the updates themselves.

    ``wanted``: replicas wanted now (1 = not replicated). ``waited_s``: seconds since the
    shard's first accepted update (None: not known). ``live``: a replica assignment is
    still out. ``taker``: an online node could take another replica now; it is read only
    when ``live`` is false and there are fewer updates than wanted or two or more updates,
    so a caller may skip computing it otherwise. ``comparison``: "same_class" when every member with a known
    compute class has one class key for the job's precision, else "cross_class";
    ``class_keys``: member node id -> its class key (for the evidence).
    """

    wanted: int
    waited_s: float | None = None
    live: bool = False
    taker: bool = True
    comparison: Comparison = "same_class"
    class_keys: Mapping[str, str] = field(default_factory=dict)


def comparison_of(class_keys: Collection[str | None]) -> Comparison:
    """A replica group's comparison: cross-class when two known class keys differ."""
    known = {k for k in class_keys if k is not None}
    return "cross_class" if len(known) > 1 else "same_class"


def judge_cross_class(
    records: Sequence[UpdateRecord],
    spec: VerificationSpec,
    *,
    trusted: Collection[str] | None,
    slice_elems: int = DEFAULT_SLICE_ELEMS,
    distances: Distances | None = None,
) -> ReplicaOutcome:
    """THE place a cross-class replica group is judged.

    Honest replicas from different compute classes drift apart as training amplifies rounding
    differences (bench/class_distance.py: up to 0.16 relative L2 on the digits CNN at 5 local
    epochs, fp32 against bf16), so the strict same-class ``tolerance`` would flag honest
    volunteers. Where the members carry checkpoint commitments, the referee (rule 4) re-executes
    a segment of each instead and this is never reached; without commitments (nothing to
    re-execute) it is ``compare_replicas``' rules with ``cross_class_tolerance`` in place of
    ``tolerance``.
    """
    loose = dataclasses.replace(spec, tolerance=float(spec.cross_class_tolerance))
    out = compare_replicas(records, loose, trusted=trusted, slice_elems=slice_elems, distances=distances)
    return dataclasses.replace(out, evidence=dict(out.evidence) | {"strict_tolerance": float(spec.tolerance)})


@dataclass(frozen=True)
class WaitForMore:
    """Keep the shard open with ``wanted`` replicas (more than before: ask for one more)."""

    wanted: int
    evidence: Mapping[str, Any]


@dataclass(frozen=True)
class Settle:
    """``representative`` stands for the shard in the round's aggregate.

    ``statuses``: new statuses of the other updates (redundant / quarantined).
    ``agreed_nodes`` earn an agreement, ``flagged_nodes`` a flag (``flags`` carry the
    evidence). ``unverified``: why no replica confirmed it ("lone_update",
    "replica_wait"), None when verified or never replicated.
    """

    representative: str
    statuses: Mapping[str, str]
    flags: tuple[Flag, ...]
    agreed_nodes: tuple[str, ...]
    flagged_nodes: tuple[str, ...]
    evidence: Mapping[str, Any]
    unverified: str | None = None
    #: nodes whose update was left out because they never came back for the referee's request
    #: (offline): no flag, but their run of agreements starts over (reputation.record_missed)
    missed_nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Drop:
    """Nothing of the shard is aggregated; its chunks go back to the pool.

    ``reason``: "inconclusive" (a split nobody may be accused on: no flags) or
    "no_majority" (no majority at max_replicas: every update flagged).
    """

    reason: str
    statuses: Mapping[str, str]
    flags: tuple[Flag, ...]
    flagged_nodes: tuple[str, ...]
    evidence: Mapping[str, Any]
    missed_nodes: tuple[str, ...] = ()  # as Settle.missed_nodes


@dataclass(frozen=True)
class Referee:
    """Before deciding, the referee re-executes a segment of each of ``update_ids``
    (``reason``: "disagreement" | "spot_check")."""

    update_ids: tuple[str, ...]
    reason: str
    evidence: Mapping[str, Any]


ShardDecision = WaitForMore | Settle | Drop | Referee


@dataclass(frozen=True)
class StandIn:
    """The referee stands in for a replica that cannot come (``replica_hopeless``):
    ``update_id``, the shard's lone update, is re-executed on one segment before it counts when
    ``referee`` (it carries a checkpoint commitment); otherwise it settles unverified at once."""

    update_id: str
    referee: bool


def replica_hopeless(n_updates: int, state: ReplicaState) -> bool:
    """A replicated shard holds one update, no replica assignment is out and no online node may
    take one: waiting for a replica would only delay the round."""
    return n_updates == 1 < state.wanted and not state.live and not state.taker


def stand_in(updates: Sequence[UpdateRecord], state: ReplicaState, committed: Collection[str]) -> StandIn | None:
    """How a lone update no replica can come for is verified (None: a replica may still come, or
    the shard has other updates or wanted none)."""
    if not replica_hopeless(len(updates), state):
        return None
    uid = updates[0].update_id
    return StandIn(uid, uid in committed)


def shard_due(n_updates: int, spec: VerificationSpec, state: ReplicaState) -> bool:
    """Is there anything to decide? Enough updates, the replica wait run out, or fewer updates
    than wanted with no replica out and nobody to take one (waiting only delays)."""
    if n_updates == 0:
        return False
    timed_out = state.waited_s is not None and state.waited_s >= float(spec.replica_wait_s)
    stuck = 2 <= n_updates < state.wanted and not state.live and not state.taker
    return n_updates >= state.wanted or timed_out or stuck or replica_hopeless(n_updates, state)


def decide_shard(
    updates: Sequence[UpdateRecord],
    spec: VerificationSpec,
    state: ReplicaState,
    reputations: Mapping[str, Reputation],
    *,
    slice_elems: int = DEFAULT_SLICE_ELEMS,
    committed: frozenset[str] | None = None,
    verdicts: Mapping[str, SegmentVerdict] | None = None,
    spot_draw: float = 1.0,
    trend: Mapping[str, tuple[float, str]] | None = None,
) -> ShardDecision:
    """Decide one shard (rules in the module docstring). Under ``unverified = "hold"`` a shard
    that would settle unverified keeps waiting for a replica instead (rule 5). ``committed``,
    ``verdicts``, ``spot_draw`` (1.0: never spot-checked) and ``trend`` (update id -> its
    lowest layer cosine to the model's trend and that layer; absent: not measured): the
    referee's inputs (rule 4)."""
    if committed is not None and shard_due(len(updates), spec, state):
        return _with_referee(updates, spec, state, reputations, committed, verdicts or {}, spot_draw, slice_elems,
                             trend or {})
    return _decide_plain(updates, spec, state, reputations, slice_elems=slice_elems)


def _decide_plain(
    updates: Sequence[UpdateRecord],
    spec: VerificationSpec,
    state: ReplicaState,
    reputations: Mapping[str, Reputation],
    *,
    slice_elems: int,
    distances: Distances | None = None,
) -> ShardDecision:
    decision = _decide_shard(updates, spec, state, reputations, slice_elems=slice_elems, distances=distances)
    if isinstance(decision, Settle) and decision.unverified and spec.unverified == "hold":
        # agreeing replicas that cannot vouch for each other yet: ask for one more, past the wait
        more = decision.unverified == "replica_wait" and state.wanted < int(spec.max_replicas)
        return WaitForMore(state.wanted + 1 if more else state.wanted,
                           dict(decision.evidence) | {"held": decision.unverified})
    return decision


def _referee_evidence(verdicts: Mapping[str, SegmentVerdict], ids: Sequence[str]) -> list[dict[str, Any]]:
    return [{"update": u, "outcome": verdicts[u].outcome, **dict(verdicts[u].evidence)} for u in ids if u in verdicts]


def _with_referee(
    updates: Sequence[UpdateRecord],
    spec: VerificationSpec,
    state: ReplicaState,
    reputations: Mapping[str, Reputation],
    committed: frozenset[str],
    verdicts: Mapping[str, SegmentVerdict],
    spot_draw: float,
    slice_elems: int,
    trend: Mapping[str, tuple[float, str]],
) -> ShardDecision:
    """Rule 4: the referee's verdicts first, then the plain rules. A disagreement among replicas
    none of which carries a commitment is judged by the plain rules (nothing to re-execute)."""
    # the pairs measured once, the fingerprints taken once (a disagreement among committed members
    # goes to the referee, no full distance needed): the plain rules below judge the group again
    ups = fingerprinted(updates, slice_elems) if committed & {u.update_id for u in updates} else list(updates)
    distances: Distances = {}
    pairs: tuple[ReplicaPair, ...] = ()
    if len(ups) >= 2:
        pairs = compare_replicas(ups, spec, trusted=_trusted_nodes(ups, reputations, spec),
                                 slice_elems=slice_elems, distances=distances).pairs
    case = _RefereeCase(tuple(u.update_id for u in ups), {u.update_id: u.node_id for u in ups}, pairs, verdicts)
    failed = frozenset(u for u in case.ids if u in verdicts and not verdicts[u].ok)
    if failed:  # a flag's evidence holds full distances
        pairs = measured_in_full(ups, pairs, failed, slice_elems=slice_elems, distances=distances)
        return _after_failure(dataclasses.replace(case, pairs=pairs), failed, spec)
    if any(not p.agree for p in pairs) and committed & set(case.ids):
        return _divergence(case, state)
    decision = _decide_plain(ups, spec, state, reputations, slice_elems=slice_elems, distances=distances)
    if not isinstance(decision, Settle):
        return decision
    return _check_settlement(decision, ups, spec, state, reputations, committed, verdicts, spot_draw, trend)


def _trusted_nodes(ups: Sequence[UpdateRecord], reputations: Mapping[str, Reputation],
                   spec: VerificationSpec) -> set[str]:
    """The members' nodes that are trusted now (a node missing from ``reputations`` is not)."""
    return {u.node_id for u in ups if (r := reputations.get(u.node_id)) is not None and is_trusted(r, spec)}


@dataclass(frozen=True)
class _RefereeCase:
    """A due shard as the referee's rule sees it: its update ids (the hub's order), their nodes,
    the pairs of members measured and the referee's verdicts so far."""

    ids: tuple[str, ...]
    node_of: Mapping[str, str]
    pairs: tuple[ReplicaPair, ...]
    verdicts: Mapping[str, SegmentVerdict]

    def pairs_evidence(self) -> list[dict[str, Any]]:
        return [p.evidence() for p in self.pairs]

    def referee_evidence(self, ids: Sequence[str]) -> list[dict[str, Any]]:
        return _referee_evidence(self.verdicts, ids)


def _after_failure(case: _RefereeCase, failed: frozenset[str], spec: VerificationSpec) -> ShardDecision:
    """Some member failed the referee (``failed``): it is flagged and left out, with every member
    that vouched for it; one that never came back for the request is left out unflagged."""
    verdicts, node_of = case.verdicts, case.node_of
    # never came back for the request (offline): left out without a flag, and no one vouched
    gone = {u for u in failed if verdicts[u].outcome == "unreachable"}
    missed = tuple(sorted({node_of[u] for u in gone}))
    flags = _failure_flags(case, failed, gone, spec)
    flagged = {f.update_id for f in flags}
    flagged_nodes = tuple(sorted({f.node_id for f in flags}))
    rest = [u for u in case.ids if u not in flagged and u not in gone]
    evidence: dict[str, Any] = {"replicas": len(case.ids), "referee": case.referee_evidence(case.ids),
                                "pairs": case.pairs_evidence()}
    statuses = {u: "quarantined" for u in flagged} | {u: "excluded" for u in gone}
    if not rest:
        return Drop("referee", statuses, tuple(flags), flagged_nodes, evidence, missed)
    lacking = tuple(u for u in rest if u not in verdicts)
    if lacking:  # after a failure, what is left counts only once the referee has seen it too
        split = any(not p.agree for p in case.pairs if p.a in rest and p.b in rest)
        return Referee(lacking, "disagreement" if split else "spot_check", evidence)
    rep = rest[0]
    for u in rest[1:]:
        statuses[u] = "redundant"
    agreed = tuple(sorted({node_of[u] for u in rest if u in verdicts and verdicts[u].ok}))
    return Settle(rep, statuses, tuple(flags), agreed, flagged_nodes, evidence, missed_nodes=missed)


def _failure_flags(case: _RefereeCase, failed: Collection[str], gone: Collection[str],
                   spec: VerificationSpec) -> list[Flag]:
    """A flag for each member that failed the referee (not the unreachable), then one for each
    member that agreed with a mismatching one without being reproduced itself (it vouched for it;
    a refusal to hand over states says nothing of the update's content: no vouching there)."""
    verdicts, node_of = case.verdicts, case.node_of
    flags: list[Flag] = []
    for u in case.ids:
        if u in failed and u not in gone:
            v = verdicts[u]
            reason = "unverifiable" if v.outcome == "unverifiable" else "referee_mismatch"
            flags.append(Flag(u, node_of[u], reason, {
                "referee": case.referee_evidence([u])[0], "group": case.referee_evidence(case.ids),
                "pairs": [p.evidence() for p in case.pairs if p.involves(u)], "tolerance": spec.tolerance}))
    for p in case.pairs:
        for mine, theirs in ((p.a, p.b), (p.b, p.a)):
            if (p.agree and theirs in failed and mine not in failed
                    and verdicts[theirs].outcome == "mismatch"
                    and not (mine in verdicts and verdicts[mine].ok)
                    and all(f.update_id != mine for f in flags)):
                reason = "unverifiable" if verdicts[theirs].outcome == "unverifiable" else "referee_mismatch"
                flags.append(Flag(mine, node_of[mine], reason, {
                    "vouched_for": theirs, "relative_distance": jsonable(p.distance),
                    "referee": case.referee_evidence([theirs])[0]}))
    return flags


def _divergence(case: _RefereeCase, state: ReplicaState) -> ShardDecision:
    """Replicas that disagree, some with a commitment: every member is re-executed first; when
    every one reproduced its segment, it is an honest divergence (different hardware), not a flag."""
    ids = case.ids
    lacking = tuple(u for u in ids if u not in case.verdicts)
    if lacking:
        return Referee(lacking, "disagreement", {"replicas": len(ids), "pairs": case.pairs_evidence()})
    rep = ids[0]
    evidence = {"replicas": len(ids), "pairs": case.pairs_evidence(), "referee": case.referee_evidence(ids),
                "cross_class": True, "comparison": state.comparison}
    if state.class_keys:
        evidence["class_keys"] = dict(state.class_keys)
    return Settle(rep, {u: "redundant" for u in ids if u != rep}, (), tuple(sorted(set(case.node_of.values()))), (),
                  evidence)


def _check_settlement(
    decision: Settle,
    ups: Sequence[UpdateRecord],
    spec: VerificationSpec,
    state: ReplicaState,
    reputations: Mapping[str, Reputation],
    committed: frozenset[str],
    verdicts: Mapping[str, SegmentVerdict],
    spot_draw: float,
    trend: Mapping[str, tuple[float, str]],
) -> ShardDecision:
    """A shard the plain rules settle: verified when the referee reproduced its representative;
    else re-executed first when it points against the trend, stands in for a replica that cannot
    come, or the spot-check draw falls under its rate."""
    rep = decision.representative
    if rep in verdicts:  # reproduced by the referee: verified, and the node earns the agreement ...
        # ... unless the referee stood in for a replica of another block (rule 4: no trust from it),
        # whatever it was asked for first (a lone update against the trend, say)
        standing_in = verdicts[rep].evidence.get("reason") == NO_REPLICA_HOLDER or replica_hopeless(len(ups), state)
        node_of = {u.update_id: u.node_id for u in ups}
        agreed = tuple(sorted({*decision.agreed_nodes, *(() if standing_in else (node_of[rep],))}))
        evidence = {k: v for k, v in decision.evidence.items() if k != "unverified"}
        return Settle(rep, decision.statuses, decision.flags, agreed, decision.flagged_nodes,
                      evidence | {"referee": _referee_evidence(verdicts, [rep])}, None)
    if decision.flags:
        return decision
    against = against_trend(trend.get(rep), spec)
    if against is not None:
        return Referee((rep,), "against_trend", dict(decision.evidence) | {"trend": against})
    standin = stand_in(ups, state, committed)
    if standin is not None and standin.referee:
        return Referee((standin.update_id,), NO_REPLICA_HOLDER, dict(decision.evidence))
    trusted = _trusted_nodes(ups, reputations, spec)
    rate = max((spot_rate(True, spec, reputations[n]) for n in trusted), default=spot_rate(False, spec))
    if spot_draw < rate:
        return Referee((rep,), "spot_check", dict(decision.evidence))
    return decision


def trend_base_round(round_: int, spec: VerificationSpec) -> int | None:
    """The round whose model the trend of round ``round_`` is measured from (the trend is the
    current model minus that one): ``trend_rounds`` back, round 0 at the earliest; None in round
    0 (no movement yet) or with the trend audit off."""
    if round_ <= 0 or not spec.audits_trend():
        return None
    return max(0, round_ - int(spec.trend_rounds))


def against_trend(alignment: tuple[float, str] | None, spec: VerificationSpec) -> dict[str, Any] | None:
    """The evidence that an update points against the model's trend (None: it does not, or it
    was not measured): its lowest layer cosine, the layer, the threshold and the span."""
    if alignment is None or not spec.audits_trend():
        return None
    cosine, layer = alignment
    if cosine >= float(spec.trend_cosine_min):
        return None
    return {"cosine": cosine, "layer": layer, "threshold": float(spec.trend_cosine_min),
            "rounds": int(spec.trend_rounds)}


def spot_rate(trusted: bool, spec: VerificationSpec, reputation: Reputation | None = None) -> float:
    """The share of settling shards the referee spot-checks: ``spot_check_trusted`` when a
    trusted node did the work (its update usually stands alone), raised for that node's short
    or stale record (``reputation``: spot_checks.trusted_rate), else ``spot_check``. The
    ledger asks it too, before it lets a lone update settle the shard at upload."""
    if not trusted:
        return float(spec.spot_check)
    return float(spec.spot_check_trusted) if reputation is None else trusted_rate(reputation, spec)


def _decide_shard(
    updates: Sequence[UpdateRecord],
    spec: VerificationSpec,
    state: ReplicaState,
    reputations: Mapping[str, Reputation],
    *,
    slice_elems: int,
    distances: Distances | None = None,
) -> ShardDecision:
    """Rules 1-3 of the module docstring.

    ``updates``: the shard's accepted updates in the hub's fixed order (update sha, then
    id); the first stands for unanimous unverified replicas. ``reputations``: the
    members' reputations (a member missing from it counts as untrusted).
    """
    if not shard_due(len(updates), spec, state):
        return WaitForMore(state.wanted, {})
    ups = list(updates)
    if len(ups) == 1:
        why = (NO_REPLICA_HOLDER if replica_hopeless(1, state) else "lone_update") if state.wanted > 1 else None
        return Settle(ups[0].update_id, {}, (), (), (), {"replicas": 1} | ({"unverified": why} if why else {}), why)
    trusted = _trusted_nodes(ups, reputations, spec)
    if state.comparison == "cross_class":
        out = judge_cross_class(ups, spec, trusted=trusted, slice_elems=slice_elems, distances=distances)
    else:
        out = compare_replicas(ups, spec, trusted=trusted, slice_elems=slice_elems, distances=distances)
    evidence = dict(out.evidence) | {"comparison": state.comparison}
    if state.class_keys:
        evidence["class_keys"] = dict(state.class_keys)
    if out.needs_more:
        return _wanting_more(ups, out, evidence, spec, state)
    return _settle_outcome(ups, out, evidence)


def _wanting_more(
    ups: Sequence[UpdateRecord],
    out: ReplicaOutcome,
    evidence: dict[str, Any],
    spec: VerificationSpec,
    state: ReplicaState,
) -> ShardDecision:
    """The comparison wants another replica: ask for one while that can help; past it,
    unanimous replicas settle unverified and a split is dropped inconclusive."""
    ids = [u.update_id for u in ups]
    unanimous = bool(out.pairs) and all(p.agree for p in out.pairs)
    timed_out = state.waited_s is not None and state.waited_s >= float(spec.replica_wait_s)
    # Waiting for a replica nobody can take only delays the round: unanimous replicas settle now.
    nobody = unanimous and not state.live and not state.taker
    if state.wanted < int(spec.max_replicas) and not timed_out and not nobody:
        return WaitForMore(state.wanted + 1, evidence)
    if unanimous:
        rep = ids[0]
        return Settle(
            rep,
            {u: "redundant" for u in ids if u != rep},
            (),
            (),
            (),
            evidence | {"unverified": "replica_wait"},
            "replica_wait",
        )
    return Drop(
        "inconclusive",
        {u: "excluded" for u in ids},
        (),
        (),
        evidence | {"inconclusive": "replica_wait"},
    )


def _settle_outcome(ups: Sequence[UpdateRecord], out: ReplicaOutcome, evidence: dict[str, Any]) -> ShardDecision:
    """A comparison that wants no more replicas: the majority settles the shard (the minority
    flagged), or the shard is dropped (a split nobody is accused on, or no majority)."""
    ids = [u.update_id for u in ups]
    flags = tuple(out.flags)
    flagged = {f.update_id for f in flags}
    flagged_nodes = tuple(sorted({f.node_id for f in flags}))
    statuses = {u: "quarantined" for u in ids if u in flagged}
    if not out.agreed:
        if not flags:  # a split among untrusted nodes: nobody flagged, nobody credited
            return Drop(
                "inconclusive",
                {u: "excluded" for u in ids},
                (),
                (),
                evidence | {"inconclusive": True},
            )
        return Drop("no_majority", statuses, flags, flagged_nodes, evidence)
    rep = out.canonical or min(out.majority)
    node_of = {u.update_id: u.node_id for u in ups}
    agreed_nodes = tuple(sorted({node_of[m] for m in out.majority if m in node_of}))
    for u in ids:
        if u != rep and u not in flagged:
            statuses[u] = "redundant"
    return Settle(rep, statuses, flags, agreed_nodes, flagged_nodes, evidence)


# --------------------------------------------------------------------------- the round


@dataclass(frozen=True)
class GroupMember:
    """Another accepted update of a settled replica group, with the status its settlement gave."""

    update_id: str
    node_id: str
    status: str


@dataclass(frozen=True)
class RoundJudgement:
    """``review``: review_round's result (``review.included`` is what is aggregated).
    ``statuses``: every candidate (included / quarantined / excluded) and every member
    that vouched for a flagged representative (quarantined). ``flags``: review's flags,
    then the vouching flags. ``withdrawn``: updates whose replica_mismatch flags are
    withdrawn. ``flagged_nodes``: one reputation flag per entry (a node flagged twice
    appears twice)."""

    review: RoundReview
    statuses: Mapping[str, str]
    flags: tuple[Flag, ...]
    withdrawn: tuple[str, ...]
    flagged_nodes: tuple[str, ...]
    #: included update id -> the scale its delta is aggregated with (< 1: its norm per sample
    #: was over ``norm_bound`` x the round's median); absent = 1
    scales: Mapping[str, float] = field(default_factory=dict)
    #: included update id -> factor on its weight (sample count): ``bound_weights``; absent = 1
    weight_factors: Mapping[str, float] = field(default_factory=dict)
    #: what the bounds did, for the round's evidence
    bounds: Mapping[str, Any] = field(default_factory=dict)


def judge_round(
    candidates: Sequence[UpdateRecord],
    global_norm: float,
    spec: VerificationSpec,
    groups: Mapping[str, Sequence[GroupMember]],
    *,
    slice_elems: int = DEFAULT_SLICE_ELEMS,
    vouched_by_trusted: Collection[str] | None = None,
    dissent: Mapping[str, UpdateRecord] | None = None,
) -> RoundJudgement:
    """Review the round's candidates (one per settled shard) and apply the vouching rule.

    ``groups``: representative update id -> the other accepted updates of its shard.
    ``dissent``: the records of the groups' quarantined members (the outvoted minorities), by
    update id. A minority's replica_mismatch flag is withdrawn only when its own update then
    passes the same review (scored with the round's candidates, never included): a majority
    flagged at review does not make a sign-flipped minority right. None: withdrawn unchecked
    (the rule before dissent was scored; kept for callers that hold no minority records).
    ``vouched_by_trusted``: the candidates a trusted node delivered or agreed with; the rest
    carry bounded weight (``bound_weights``). None: no weight bound (every update counts as
    vouched for).

    Then the bounds no single update may pass: an included update whose norm per sample is
    over ``spec.norm_bound`` x the round's median (of the included updates, 3 or more) is
    scaled down to that bound (``scales``), and ``bound_weights`` gives the weight factors.
    """
    if candidates:
        review = review_round(candidates, global_norm, spec, slice_elems=slice_elems)
    else:
        review = RoundReview([], [], {})
    reasons = {f.update_id: f.reason for f in review.flags}
    keep = set(review.included)
    statuses = {
        c.update_id: "included"
        if c.update_id in keep
        else ("quarantined" if c.update_id in reasons else "excluded")
        for c in candidates
    }
    vouched: list[Flag] = []
    withdrawn: list[str] = []
    for rep, members in groups.items():
        if rep not in reasons:
            continue
        for m in members:
            if m.status == "redundant":
                vouched.append(Flag(m.update_id, m.node_id, reasons[rep], {"vouched_for": rep}))
                statuses[m.update_id] = "quarantined"
            elif m.status == "quarantined":
                withdrawn.append(m.update_id)
    if dissent is not None and withdrawn:
        withdrawn = _minority_right(candidates, withdrawn, dissent, global_norm, spec, slice_elems)
    flagged_nodes = (*sorted({f.node_id for f in review.flags}), *(f.node_id for f in vouched))
    included = [c for c in candidates if c.update_id in keep]
    norms = {c.update_id: _finite(review.norms.get(c.update_id, math.inf)) for c in included}
    unit = {c.update_id: norms[c.update_id] / c.work for c in included}
    scales = norm_bound_scales(unit, float(spec.norm_bound))
    samples = {c.update_id: float(c.shard_samples) for c in included}
    vouched_ids = set(samples) if vouched_by_trusted is None else set(vouched_by_trusted)
    factors = bound_weights(samples, vouched_ids, float(spec.untrusted_share))
    bounds: dict[str, Any] = {"norm_bound": float(spec.norm_bound),
                              "untrusted_share": float(spec.untrusted_share)}
    if scales:
        bounds["clipped"] = {u: round(f, 6) for u, f in scales.items()}
    if factors:
        bounds["untrusted_weight_factors"] = {u: round(f, 6) for u, f in factors.items()}
    return RoundJudgement(
        review, statuses, (*review.flags, *vouched), tuple(withdrawn), flagged_nodes,
        scales, factors, bounds,
    )


def _finite(value: float) -> float:
    """A norm the bounds can use: a non-finite one counts as infinitely large."""
    return value if math.isfinite(value) else math.inf


def _minority_right(
    candidates: Sequence[UpdateRecord],
    pending: Sequence[str],
    dissent: Mapping[str, UpdateRecord],
    global_norm: float,
    spec: VerificationSpec,
    slice_elems: int,
) -> list[str]:
    """The outvoted updates (``pending``) whose own scores pass the round's review: their
    replica_mismatch flags are withdrawn. One without a record in ``dissent`` keeps its flag."""
    known = [dissent[u] for u in pending if u in dissent]
    if not known:
        return []
    scored = review_round(candidates, global_norm, spec, score_only=known, slice_elems=slice_elems)
    failed = {f.update_id for f in scored.flags}
    return [u for u in pending if u in dissent and u not in failed]


def norm_bound_scales(unit_norms: Mapping[str, float], bound: float) -> dict[str, float]:
    """update id -> scale (< 1) for each update whose norm per sample is over ``bound`` x the
    median of ``unit_norms`` (norms per sample of the round's included updates). Needs 3 or
    more updates (the median of two is their mean, which one update drags); ``bound`` 0 = off.

    Unlike the review's norm-ratio limit, this bound does not widen for a shard larger than the
    round's median (``round_review.size_allowance``): clipping accuses nobody, and a node can ask
    for a larger shard by claiming more throughput, so the room a crafted update gets stays
    ``bound`` x the median per sample whatever its shard's size."""
    if bound <= 0 or len(unit_norms) < 3:
        return {}
    centre = median(list(unit_norms.values()))
    if not math.isfinite(centre) or centre <= 0:
        return {}
    limit = bound * centre
    return {u: limit / n for u, n in unit_norms.items() if n > limit}


def bound_weights(samples: Mapping[str, float], vouched: Collection[str], share: float) -> dict[str, float]:
    """update id -> weight factor (< 1) for the updates no trusted node vouched for.

    Each such update weighs at most the round's median sample count, and together they
    weigh at most ``share`` of the round once vouched-for updates are in it:
    U <= share / (1 - share) x V. A round with no vouched-for update (a network still
    forming trust) cannot be bounded this way; the norm bound and replication still apply.
    """
    untrusted = {u: w for u, w in samples.items() if u not in vouched}
    if not untrusted or share >= 1.0:
        return {}
    middle = median(list(samples.values()))
    capped = {u: min(w, middle) for u, w in untrusted.items()}
    v_total = math.fsum(w for u, w in samples.items() if u in vouched)
    u_total = math.fsum(capped.values())
    scale = 1.0
    if v_total > 0 and u_total > 0:
        scale = min(1.0, share / (1.0 - share) * v_total / u_total)
    out = {}
    for u, w in untrusted.items():
        f = (capped[u] * scale) / w if w > 0 else 1.0
        if f < 1.0:
            out[u] = f
    return out
