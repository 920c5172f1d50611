"""Replica comparison: do the updates of one shard, trained by distinct nodes, agree?

``compare_replicas`` clusters a replica group by relative distance and decides whether a
majority stands (and which update represents the shard), another replica is needed, or the
group ends without agreement. hub/policy/round_policy.py decides what the round does with it.

A pair is read from the members' fingerprints first (hub/policy/fingerprints.py): equal bytes
agree (distance exactly 0), and a pair whose lower bound clears the tolerance disagrees; any
other pair is measured in full. The decision is the full distance's in every case (the bounds
are inequalities); what changes is the evidence of a pair the fingerprints settled apart, which
holds the lower bound (``measured`` "fingerprint") until a flag needs it: every pair a flag's
evidence names is measured in full first (``measured_in_full``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from gpuflex.protocol.jobspec import VerificationSpec

from .aggregation import DEFAULT_SLICE_ELEMS, PageReleaser, floating_keys
from .distances import cosine_and_norms, relative_distance
from .fingerprints import Fingerprint, distance_bounds, fingerprint_of
from .update_record import EPS, Flag, UpdateRecord, VerificationError, jsonable

__all__ = [
    "TOP_TENSORS",
    "ReplicaOutcome",
    "ReplicaPair",
    "compare_replicas",
    "fingerprinted",
    "measured_in_full",
    "needs_no_fingerprint",
]

TOP_TENSORS = 5  # per-tensor evidence kept for a replica pair


@dataclass(frozen=True)
class ReplicaPair:
    """Two members of a replica group and how far apart their updates are.

    ``tensors``: the ``TOP_TENSORS`` tensors that differ most, (name, relative distance),
    farthest first (ties by name). ``measured``: "full"; "memo" (a full measure read from the
    caller's memo); "bytes" when the shas or fingerprints found the same bytes (the distance and
    tensors are then exactly the full measure's, 0.0); "fingerprint" when the fingerprints
    settled the pair apart: ``distance`` is then a lower bound, and no tensors."""

    a: str
    b: str
    distance: float
    agree: bool
    tensors: tuple[tuple[str, float], ...] = ()
    measured: str = "full"

    def involves(self, update_id: str) -> bool:
        return update_id in (self.a, self.b)

    def evidence(self) -> dict[str, Any]:
        """The pair as the auditors see it (the replica evidence's "pairs" entries)."""
        return {
            "a": self.a,
            "b": self.b,
            "relative_distance": jsonable(self.distance),
            "agree": self.agree,
            "tensors": {k: jsonable(v) for k, v in self.tensors},
        } | ({"measured": "fingerprint_lower_bound"} if self.measured == "fingerprint" else {})


@dataclass(frozen=True)
class ReplicaOutcome:
    """Result of comparing one replica group.

    ``agreed``: a majority cluster of >= quorum stands (``majority`` = its update ids,
    ``canonical`` = the one to aggregate). ``needs_more``: issue another replica.
    Neither: the group is resolved without agreement (everything flagged).
    ``pairs``: every pair of members measured (also in ``evidence["pairs"]``, as JSON).
    """

    agreed: bool
    majority: list[str]
    flags: list[Flag]
    needs_more: bool
    evidence: dict[str, Any]
    canonical: str = ""
    pairs: tuple[ReplicaPair, ...] = ()


#: a memo of pairwise distances by update-id pair: (whole-update distance, per tensor)
Distances = dict[tuple[str, str], tuple[float, dict[str, float]]]
#: a memo of fingerprints by update id (a record that carries its own is read first)
Fingerprints = dict[str, Fingerprint]


def compare_replicas(
    records: Sequence[UpdateRecord],
    spec: VerificationSpec,
    *,
    trusted: Collection[str] | None = None,
    slice_elems: int = DEFAULT_SLICE_ELEMS,
    distances: Distances | None = None,
    fingerprints: Fingerprints | None = None,
    use_fingerprints: bool = True,
) -> ReplicaOutcome:
    """Decide one replica group (updates of the same shard, seed and chunks).

    ``distances``: a memo of pairwise distances by update-id pair, shared by calls that
    judge one group more than once (hub/policy/round_policy.py asks with the strict tolerance, then
    with the cross-class one): each pair is measured once. Members uploaded as the same bytes
    (equal ``sha``) are at distance 0 at once; other pairs are read from the fingerprints the
    records carry, and, with ``fingerprints`` (a memo by update id), from ones taken now for
    the members that carry none. ``use_fingerprints`` False measures every pair in full (the
    same decision, at the full price; a bench compares the two).

    ``trusted``: ids of the nodes that are trusted now (``is_trusted``); pass it
    (the hub should). When NO member of the group is trusted, agreement proves
    less - a deterministic attack agrees with itself, so two attackers handed the
    same shard agree - hence: the group needs quorum + 1 agreeing replicas (capped
    at max_replicas), and a split vote among untrusted nodes is INCONCLUSIVE
    unless every dissenter differs BLATANTLY from the majority (cosine below
    cosine_min or a norm ratio beyond norm_ratio_max): no
    canonical, no flags (nobody is accused on the word of the untrusted), the
    shard is simply not aggregated (the hub's policy, hub/policy.decide_shard,
    drops it and trains its chunks again; ``review_round``'s ``score_only`` could
    score its members, which the hub does not do). With a trusted
    member, or ``trusted=None``, the plain majority rule below applies.

    ``spec`` is a VerificationSpec (quorum, max_replicas, tolerance). Two updates
    agree when their relative distance is <= tolerance. For each update, its
    cluster is the set of updates that agree with it; the largest cluster wins
    when it has >= quorum members AND is a strict majority of the group. Ties
    and too-small clusters ask for another replica while the group is smaller
    than ``max_replicas``; after that every update is flagged.
    Updates that claim a different shard than the first are rejected as a group
    error (the hub must not mix shards).
    """
    quorum = int(spec.quorum)
    max_replicas = int(spec.max_replicas)
    tolerance = float(spec.tolerance)
    n = len(records)
    base: dict[str, Any] = {"tolerance": tolerance, "quorum": quorum, "replicas": n}
    if n == 0:
        return ReplicaOutcome(False, [], [], True, {**base, "why": "no replicas yet"})
    _check_group(records)
    dist, pairs = _measure(
        records, tolerance, slice_elems, distances, fingerprints, use_fingerprints
    )
    clusters = [[j for j in range(n) if dist[i][j] <= tolerance] for i in range(n)]
    best_size = max(len(c) for c in clusters)
    # Distinct largest clusters (as sets): more than one means a tie, no majority.
    largest = {tuple(c) for c in clusters if len(c) == best_size}
    evidence = {**base, "pairs": [p.evidence() for p in pairs]}
    if trusted is not None and not any(r.node_id in trusted for r in records):
        evidence["untrusted_group"] = True
        if best_size < n and n >= max_replicas:
            evidence["blatant_dissent"] = _blatant_dissent(
                records, dist, largest, quorum, spec, slice_elems
            )
        early = _untrusted_wait(n, best_size, quorum, max_replicas, evidence, pairs)
        if early is not None:
            return early
    if best_size >= quorum and 2 * best_size > n and len(largest) == 1:
        members = next(iter(largest))
        flagged = set(range(n)) - set(members)
        pairs = _flagged_in_full(records, dist, pairs, flagged, slice_elems, distances, evidence)
        return _majority(records, dist, members, tolerance, evidence, pairs)
    if n < max_replicas:
        why = "fewer than quorum replicas" if n < quorum else "no majority yet"
        return ReplicaOutcome(False, [], [], True, {**evidence, "why": why}, pairs=pairs)
    pairs = _flagged_in_full(records, dist, pairs, set(range(n)), slice_elems, distances, evidence)
    return _no_majority(records, quorum, tolerance, evidence, pairs)


def _check_group(records: Sequence[UpdateRecord]) -> None:
    """One shard, distinct nodes: anything else is a bug upstream (VerificationError)."""
    shards = {r.shard_id for r in records}
    if len(shards) != 1:
        raise VerificationError(
            f"replica group mixes shards {sorted(shards)}: compare one shard at a time"
        )
    if len({r.node_id for r in records}) != len(records):
        # The scheduler hands replicas to distinct nodes; a node's second copy
        # proves nothing, so only its first update counts as a replica.
        raise VerificationError(
            "replica group has two updates from one node: replicas must be distinct nodes"
        )


def _measure(
    records: Sequence[UpdateRecord],
    tolerance: float,
    slice_elems: int,
    distances: Distances | None,
    fingerprints: Fingerprints | None,
    use_fingerprints: bool,
) -> tuple[list[list[float]], tuple[ReplicaPair, ...]]:
    """The (n, n) matrix of relative distances and every pair (i < j), each measured once
    (``distances``, when given, is read first and filled), each read from the shas and the
    fingerprints first (``_read``) unless ``use_fingerprints`` is False. A pair settled apart
    holds the lower bound, which is over ``tolerance``: the clusters are the full distance's."""
    n = len(records)
    ids = [r.update_id for r in records]
    dist = [[0.0] * n for _ in range(n)]
    pairs: list[ReplicaPair] = []
    pages = PageReleaser()
    for i in range(n):
        for j in range(i + 1, n):
            key = (ids[i], ids[j])
            known = distances.get(key) if distances is not None else None
            measured = "memo"
            if known is None and use_fingerprints:
                read = _read(records[i], records[j], fingerprints, slice_elems)
                if read is not None and read[2] != "bytes" and read[0] > tolerance:
                    dist[i][j] = dist[j][i] = read[0]
                    pairs.append(ReplicaPair(*key, read[0], False, measured="fingerprint"))
                    continue
                if read is not None and read[2] == "bytes":
                    known, measured = (read[0], read[1]), "bytes"
            if known is None:
                known = relative_distance(
                    records[i].delta, records[j].delta, slice_elems=slice_elems, pages=pages
                )
                measured = "full"
            if distances is not None:
                distances[key] = known
            d, per = known
            dist[i][j] = dist[j][i] = d
            pairs.append(ReplicaPair(*key, d, d <= tolerance, _worst(per), measured))
    return dist, tuple(pairs)


def _read(
    a: UpdateRecord, b: UpdateRecord, memo: Fingerprints | None, slice_elems: int
) -> tuple[float, dict[str, float], str] | None:
    """A pair as the shas and fingerprints tell it: (0.0, per tensor 0.0, "bytes") for the same
    bytes (what relative_distance returns for them); (lower bound, {}, "bound"); None when they
    tell nothing (no fingerprint to read, or they bound nothing)."""
    if _same_blob(a, b):
        return 0.0, dict.fromkeys(floating_keys(a.delta), 0.0), "bytes"
    fa, fb = _fingerprint(a, memo, slice_elems), _fingerprint(b, memo, slice_elems)
    bounds = None if fa is None or fb is None else distance_bounds(fa, fb)
    if bounds is None:
        return None
    if bounds[1]:
        return 0.0, {name: 0.0 for name, _ in fa.layout}, "bytes"  # type: ignore[union-attr]
    return bounds[0], {}, "bound"


def _worst(per: dict[str, float]) -> tuple[tuple[str, float], ...]:
    return tuple(sorted(per.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP_TENSORS])


def _same_blob(a: UpdateRecord, b: UpdateRecord) -> bool:
    """Both uploaded as the same bytes (equal shas of their blobs)."""
    return a.sha is not None and a.sha == b.sha


def _fingerprint(
    r: UpdateRecord, memo: Fingerprints | None, slice_elems: int
) -> Fingerprint | None:
    """The record's own fingerprint, else the memo's, else one taken now and kept in the memo;
    None without a memo (only the fingerprints the records carry are read)."""
    if r.fingerprint is not None or memo is None:
        return r.fingerprint
    fp = memo.get(r.update_id)
    if fp is None:
        fp = memo[r.update_id] = fingerprint_of(r.delta, sha=r.sha, slice_elems=slice_elems)
    return fp


def fingerprinted(
    records: Sequence[UpdateRecord], slice_elems: int = DEFAULT_SLICE_ELEMS
) -> list[UpdateRecord]:
    """``records``, each carrying its fingerprint (taken now where it has none), for a caller
    that compares one group more than once; as they are when every one was uploaded as the same
    bytes (no pair needs a fingerprint then)."""
    if len(records) < 2 or needs_no_fingerprint(records):
        return list(records)
    return [
        r
        if r.fingerprint is not None
        else dataclasses.replace(
            r, fingerprint=fingerprint_of(r.delta, sha=r.sha, slice_elems=slice_elems)
        )
        for r in records
    ]


def needs_no_fingerprint(records: Sequence[UpdateRecord]) -> bool:
    """Every record was uploaded as the same bytes: each pair is read from the shas alone."""
    return all(_same_blob(records[0], r) for r in records[1:])


def measured_in_full(
    records: Sequence[UpdateRecord],
    pairs: Sequence[ReplicaPair],
    involving: Collection[str],
    *,
    slice_elems: int = DEFAULT_SLICE_ELEMS,
    distances: Distances | None = None,
) -> tuple[ReplicaPair, ...]:
    """``pairs`` with every pair that involves an update of ``involving`` and was settled by the
    fingerprints measured in full (a flag's evidence holds the full distance). The decision stays:
    the full distance is at least the lower bound that settled the pair apart."""
    by_id = {r.update_id: r for r in records}
    out = []
    for p in pairs:
        if p.measured == "fingerprint" and (p.a in involving or p.b in involving):
            known = distances.get((p.a, p.b)) if distances is not None else None
            if known is None:
                known = relative_distance(
                    by_id[p.a].delta, by_id[p.b].delta, slice_elems=slice_elems
                )
                if distances is not None:
                    distances[(p.a, p.b)] = known
            p = dataclasses.replace(p, distance=known[0], tensors=_worst(known[1]), measured="full")
        out.append(p)
    return tuple(out)


def _flagged_in_full(
    records: Sequence[UpdateRecord],
    dist: list[list[float]],
    pairs: tuple[ReplicaPair, ...],
    flagged: set[int],
    slice_elems: int,
    distances: Distances | None,
    evidence: dict[str, Any],
) -> tuple[ReplicaPair, ...]:
    """``measured_in_full`` for the members about to be flagged (indices); ``dist`` and the
    outcome's ``evidence["pairs"]`` follow."""
    ids = [r.update_id for r in records]
    pairs = measured_in_full(
        records, pairs, {ids[i] for i in flagged}, slice_elems=slice_elems, distances=distances
    )
    at = {u: i for i, u in enumerate(ids)}
    for p in pairs:
        dist[at[p.a]][at[p.b]] = dist[at[p.b]][at[p.a]] = p.distance
    evidence["pairs"] = [p.evidence() for p in pairs]
    return pairs


def _untrusted_wait(
    n: int,
    best_size: int,
    quorum: int,
    max_replicas: int,
    evidence: dict[str, Any],
    pairs: tuple[ReplicaPair, ...],
) -> ReplicaOutcome | None:
    """A group with no trusted member: the outcome when nobody's word may count yet (None: the
    plain majority rule decides). ``evidence["blatant_dissent"]`` is set for a split at
    ``max_replicas``."""
    if best_size < n:  # a split among untrusted nodes: nobody's word counts
        if n < max_replicas:
            return ReplicaOutcome(
                False, [], [], True, {**evidence, "why": "split among untrusted nodes"}, pairs=pairs
            )
        if not evidence["blatant_dissent"]:
            return ReplicaOutcome(
                False,
                [],
                [],
                False,
                {**evidence, "why": "inconclusive: split among untrusted nodes"},
                pairs=pairs,
            )
        # Blatant dissent (e.g. a sign flip or a x10 update against two identical
        # updates): the plain majority rule decides. Should the majority be the bad
        # side, its canonical meets review_round, and the hub's vouching rule flags
        # the majority and withdraws the dissenter's flag.
        return None
    need = min(quorum + 1, max_replicas)
    if n < need:
        return ReplicaOutcome(
            False,
            [],
            [],
            True,
            {**evidence, "why": f"untrusted group needs {need} agreeing"},
            pairs=pairs,
        )
    return None


def _majority(
    records: Sequence[UpdateRecord],
    dist: list[list[float]],
    members: tuple[int, ...],
    tolerance: float,
    evidence: dict[str, Any],
    pairs: tuple[ReplicaPair, ...],
) -> ReplicaOutcome:
    """A majority cluster (``members``, indices into ``records``) stands: the rest is flagged."""
    ids = [r.update_id for r in records]
    majority = [ids[i] for i in members]
    # Canonical: the medoid of the cluster (ties by update id) - any member would do
    # for bit-identical replicas, the medoid is the safest under tiny noise.
    canonical_idx = min(members, key=lambda i: (sum(dist[i][j] for j in members), ids[i]))
    flags = [
        Flag(
            r.update_id,
            r.node_id,
            "replica_mismatch",
            {
                "shard_id": r.shard_id,
                "majority": majority,
                "relative_distance_to_canonical": jsonable(dist[i][canonical_idx]),
                "tolerance": tolerance,
                "pairs": [p.evidence() for p in pairs if p.involves(r.update_id)],
            },
        )
        for i, r in enumerate(records)
        if i not in members
    ]
    return ReplicaOutcome(True, majority, flags, False, evidence, ids[canonical_idx], pairs)


def _no_majority(
    records: Sequence[UpdateRecord],
    quorum: int,
    tolerance: float,
    evidence: dict[str, Any],
    pairs: tuple[ReplicaPair, ...],
) -> ReplicaOutcome:
    """No majority at ``max_replicas``: every update of the group is flagged (an auditor decides)."""
    n = len(records)
    flags = [
        Flag(
            r.update_id,
            r.node_id,
            "replica_mismatch",
            {
                "shard_id": r.shard_id,
                "majority": [],
                "why": f"no {quorum} of {n} replicas agree within tolerance",
                "tolerance": tolerance,
                "pairs": [p.evidence() for p in pairs if p.involves(r.update_id)],
            },
        )
        for r in records
    ]
    return ReplicaOutcome(
        False, [], flags, False, {**evidence, "why": "no majority at max_replicas"}, pairs=pairs
    )


def _blatant_dissent(
    records: Sequence[UpdateRecord],
    dist: list[list[float]],
    largest: set[tuple[int, ...]],
    quorum: int,
    spec: VerificationSpec,
    slice_elems: int,
) -> bool:
    """Does every update outside the strict-majority cluster differ from it in a way no
    honest hardware noise can (cosine < cosine_min, or norm ratio beyond norm_ratio_max
    either way)? Subtle differences (half a shard, poisoned labels) are not blatant."""
    n = len(records)
    if len(largest) != 1:
        return False
    members = next(iter(largest))
    if len(members) < quorum or 2 * len(members) <= n:
        return False
    cosine_min = float(spec.cosine_min)
    ratio_max = float(spec.norm_ratio_max)
    ref = min(members, key=lambda i: (sum(dist[i][j] for j in members), records[i].update_id))
    for i in range(n):
        if i in members:
            continue
        cos, ni, nr = cosine_and_norms(
            records[i].delta, records[ref].delta, slice_elems=slice_elems
        )
        ratio = ni / max(nr, EPS)
        if not (cos < cosine_min or ratio > ratio_max or ratio < 1.0 / ratio_max):
            return False
    return True
