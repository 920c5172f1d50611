"""Reputation: a node's track record, and who replicates whom.

Transitions (``record_*``) are pure: they return a new ``Reputation``. ``is_trusted``,
``replication_probability``, ``should_replicate``, ``replica_candidates`` and ``ReplicaPool``
decide from it which shards are replicated and which nodes may take a replica.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from gpuflex.protocol.jobspec import VerificationSpec

from .update_record import VerificationError

__all__ = [
    "BAN_AFTER_CONFIRMED",
    "MIN_REPLICATION",
    "ReplicaPool",
    "Reputation",
    "is_trusted",
    "record_agreement",
    "record_flag",
    "record_missed",
    "record_verdict",
    "record_withdrawn",
    "replica_candidates",
    "replication_probability",
    "should_replicate",
]

MIN_REPLICATION = 0.05  # floor of a trusted node's replication probability
BAN_AFTER_CONFIRMED = 3  # confirmed flags that ban a node


class _Rng(Protocol):
    def random(self) -> float: ...


@dataclass(frozen=True)
class Reputation:
    """A node's track record. Transitions are the ``record_*`` functions."""

    consecutive_agreements: int = 0
    agreements_total: int = 0
    flags_total: int = 0
    confirmed_flags: int = 0
    dismissed_flags: int = 0
    banned: bool = False
    #: the node is younger than the hub's trust_min_age_s: it cannot be trusted yet, whatever its
    #: run (set and cleared by the hub from the node's age; not stored)
    probation: bool = False
    #: seconds since an agreement last counted for it (hub/policy/spot_checks.py; set by the hub
    #: from memory as it asks the policy, not stored: a restarted hub counts from its start)
    unchecked_s: float = 0.0

    @property
    def trusted_run(self) -> int:
        return self.consecutive_agreements


def record_agreement(rep: Reputation) -> Reputation:
    """The node's update was in an agreeing replica majority."""
    return replace(
        rep,
        consecutive_agreements=rep.consecutive_agreements + 1,
        agreements_total=rep.agreements_total + 1,
    )


def record_flag(rep: Reputation) -> Reputation:
    """Any flag (before any verdict) resets the run of agreements: trust is re-earned."""
    return replace(rep, consecutive_agreements=0, flags_total=rep.flags_total + 1)


def record_missed(rep: Reputation) -> Reputation:
    """The node did not come back for a referee's request (offline): its update was left out,
    and it must earn trust again (its run of agreements starts over); no flag, nothing counted
    against it. A cheater that goes quiet whenever it is checked gains nothing by it."""
    return replace(rep, consecutive_agreements=0)


def record_withdrawn(rep: Reputation, run_before: int) -> Reputation:
    """A flag was withdrawn (the node was the outvoted honest minority): the run of agreements
    the flag reset is given back, on top of any agreements earned since."""
    return replace(rep, consecutive_agreements=rep.consecutive_agreements + max(0, run_before))


def record_verdict(
    rep: Reputation, verdict: str, *, ban_after: int = BAN_AFTER_CONFIRMED
) -> Reputation:
    """An auditor's verdict on one of the node's flags.

    ``confirm`` counts against the node and bans it at ``ban_after`` confirmed
    flags; ``dismiss`` is recorded but does not restore the reset run (the run
    measures verified agreement, which a dismissed flag is not).
    """
    if verdict == "confirm":
        confirmed = rep.confirmed_flags + 1
        return replace(rep, confirmed_flags=confirmed, banned=rep.banned or confirmed >= ban_after)
    if verdict == "dismiss":
        return replace(rep, dismissed_flags=rep.dismissed_flags + 1)
    raise VerificationError(f"verdict must be 'confirm' or 'dismiss', got {verdict!r}")


def replication_probability(rep: Reputation, spec: VerificationSpec) -> float:
    """Probability that a shard given to this node is replicated.

    ``replication`` a float in [0, 1]: that fixed fraction. ``"adaptive"`` (BOINC's
    adaptive replication applied to updates): 1.0 until the node has
    ``trust_after`` consecutive agreeing replicas, then max(MIN_REPLICATION, 1/run)
    so trusted nodes still get spot-checked and overhead stays bounded.
    """
    mode = spec.replication
    if rep.banned:
        return 1.0
    if isinstance(mode, str):
        if mode != "adaptive":
            raise VerificationError(
                f"verification.replication must be 'adaptive' or 0..1, got {mode!r}"
            )
        run = rep.consecutive_agreements
        if run < int(spec.trust_after) or rep.probation:
            return 1.0
        return max(MIN_REPLICATION, 1.0 / run)
    p = float(mode)
    if not (0.0 <= p <= 1.0):
        raise VerificationError(
            f"verification.replication must be 'adaptive' or 0..1, got {mode!r}"
        )
    return p


def is_trusted(rep: Reputation, spec: VerificationSpec) -> bool:
    """A run of ``trust_after`` consecutive agreeing replicas, past probation, and not banned."""
    return (
        not rep.banned and not rep.probation and rep.consecutive_agreements >= int(spec.trust_after)
    )


def replica_candidates(
    reps: Mapping[str, Reputation],
    exclude: Collection[str],
    spec: VerificationSpec,
) -> list[str]:
    """Nodes that may take the next replica of a group (``exclude`` = its members),
    sorted by id. Push model: ``rng.choice`` of it; pull model: give the replica to a
    requesting node only if it is in this list (computed over the online nodes).

    Replicas exist to check untrusted work, and two untrusted nodes that agree
    prove little (a deterministic attack agrees with itself, colluders agree on
    purpose). So: trusted nodes only, when any is available; before anyone is
    trusted, the upper half of nodes by their run of agreements (honest nodes
    build runs from the first round; caught nodes sit at 0).
    """
    pool = {n: r for n, r in reps.items() if n not in exclude and not r.banned}
    trusted = sorted(n for n, r in pool.items() if is_trusted(r, spec))
    if trusted:
        return trusted
    if not pool:
        return []
    runs = sorted((r.consecutive_agreements for r in pool.values()), reverse=True)
    cut = runs[(len(runs) - 1) // 2]  # the median run: ties at the cut stay eligible
    return sorted(n for n, r in pool.items() if r.consecutive_agreements >= cut)


class ReplicaPool:
    """``replica_candidates`` over one set of online reputations, asked many times.

    ``eligible(node, exclude)`` equals ``node in replica_candidates(reps, exclude, spec)`` and
    ``anyone(exclude)`` equals ``bool(replica_candidates(reps, exclude, spec))``, each in
    O(|exclude| log n) instead of O(n log n): the scheduler asks once per pending replica per
    work request, which made a round of n nodes cost O(n^2 log n) (bench/simulation.py).
    """

    def __init__(self, reps: Mapping[str, Reputation], spec: VerificationSpec) -> None:
        self.reps = {n: r for n, r in reps.items() if not r.banned}
        self.trusted = frozenset(n for n, r in self.reps.items() if is_trusted(r, spec))
        self.runs = sorted(r.consecutive_agreements for r in self.reps.values())  # ascending

    def _members(self, exclude: Collection[str]) -> list[str]:
        return [e for e in exclude if e in self.reps]

    def anyone(self, exclude: Collection[str]) -> bool:
        return len(self.reps) > len(self._members(exclude))

    def ruled_out(self, node_id: str, most_excluded: int) -> bool:
        """True when ``eligible(node_id, exclude)`` is False for every ``exclude`` of at most
        ``most_excluded`` nodes: a pre-filter that lets a caller skip asking shard by shard.

        Untrusted while more trusted nodes are online than can be excluded: the first rule
        always applies. Otherwise the cut is the median of the runs left after removing at
        most ``most_excluded``; removing g values never lowers the k-th smallest, so the cut
        is at least ``runs[k(g)]``, and k(g) shrinks as g grows: below ``runs[k(most)]``, never.
        """
        rep = self.reps.get(node_id)
        if rep is None:
            return True
        if node_id in self.trusted:
            return False
        if len(self.trusted) > most_excluded:
            return True
        m = len(self.runs) - max(0, most_excluded)
        if m < 1:
            return False
        return rep.consecutive_agreements < self.runs[m - 1 - (m - 1) // 2]

    def eligible(self, node_id: str, exclude: Collection[str]) -> bool:
        rep = self.reps.get(node_id)
        if rep is None or node_id in exclude:
            return False
        gone = self._members(exclude)
        if len(self.trusted) > sum(1 for e in gone if e in self.trusted):
            return node_id in self.trusted
        # the median run of the pool without `gone`: replica_candidates' cut, found in the sorted runs
        m = len(self.runs) - len(gone)
        k = m - 1 - (m - 1) // 2  # its index in ascending order
        taken: list[int] = []
        for v in sorted(self.reps[e].consecutive_agreements for e in gone):
            pos = bisect.bisect_left(self.runs, v)
            while pos in taken:
                pos += 1
            taken.append(pos)
        j = k
        for p in sorted(taken):
            if p <= j:
                j += 1
        while j in taken:
            j += 1
        return rep.consecutive_agreements >= self.runs[j]


def should_replicate(rep: Reputation, spec: VerificationSpec, rng: _Rng) -> bool:
    """Draw once from ``rng`` (e.g. random.Random seeded by the hub) against
    ``replication_probability``. A new node (run 0) is always replicated in
    adaptive mode, without consuming a draw."""
    p = replication_probability(rep, spec)
    if p >= 1.0:
        return True
    if p <= 0.0:
        return False
    return rng.random() < p
