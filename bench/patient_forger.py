"""The patient forger coalition: how many crafted updates a forger gets aggregated before it is stopped.

A coalition holds 30 % of the identities. Each member trains honestly until the hub trusts it
(``reputation.is_trusted``: ``trust_after`` agreeing replicas in a row, past the hub's
``trust_min_age_s`` probation), then, while it is trusted (a flag that resets its run sends it back
to honest work until it is trusted again), forges every update it trains as a shard's primary, under
every threshold it can see: the crafted update passes the round's review (norm bound, cosine, trend
audit: bench/heterogeneity.py measures those with real training), and its checkpoint commitment is
forged consistently (heterogeneity.py's ``forge``): the hashes bind the crafted update, every
committed segment norm is true and matches the honest replica's norm within ``referee.NORM_SPLIT``
and stands out of none (``referee.STANDOUT``). So no check short of re-executing the forged
segment tells it: it is caught when the referee re-executes one of its forged segments, which is a
``referee_mismatch`` that suspends it at once (hub/policy/suspension.py). A member asked for a
replica forges it too when the shard's primary is a member (they craft the same update and agree);
otherwise it trains honestly (a forged replica beside an honest primary only risks a check).
``--forged-segments`` says how many of an update's segments the crafted change sits in: 1 (the
default, the hardest to catch: a re-execution meets it one time in the segment count) or all.

The count runs on a simulated clock (``--round-s`` seconds a round; every active identity trains
one shard a round) and drives the hub's own policy code for every decision, never a copy of it:

- which shards are replicated: ``reputation.should_replicate`` (adaptive replication), and who
  takes the replica: ``reputation.ReplicaPool.eligible`` (trusted nodes first), with each node's
  reputation as the hub reads it (``probation`` from its age, ``unchecked_s`` from when an
  agreement last counted for it, as ``model.node.NodeState.reputation_at``);
- how the shard settles: ``round_policy.decide_shard`` on ``UpdateRecord``s (small tensors: an
  honest update per shard, the coalition's crafted one differs from it), with every update
  committed, the shard's spot-check draw, and the referee's verdicts fed back as the round engine
  does until it settles or drops; spot-check rates are ``round_policy.spot_rate`` /
  ``spot_checks.trusted_rate`` (decaying trust) inside it;
- which segment a re-execution replays: ``referee.pick_segment`` on the update's ``Commitment``
  (for a disagreement, beside the replica's: one class here, so the first checkpoint whose hash
  differs, which is the forged segment; a uniform secret draw otherwise); the
  verdict is "mismatch" when that segment is a forged one, else "reproduced" (an honest segment
  re-executed reproduces: referee_calibration.py);
- the node's record: ``reputation.record_agreement`` / ``record_flag`` for the nodes a decision
  names, and ``suspension.suspends`` on every flag (a suspended node gets no further work);
- what a rollback would undo: ``rollback.decide(before_node=...)`` on the forger's aggregated
  updates, each verified or not and by whom as hub/domain/aggregating.py records it
  (``rollback.verifier_of``: the referee's verdict, on the whole update or one segment, else the
  nodes of the agreeing replicas), with the nodes stopped by then, when it is suspended.

Not modelled: the round's review (``judge_round``: the forger is built to pass it), compute
classes (one class: honest replicas agree bit for bit), nodes going offline.

Each run is repeated at every ``spot_check_trusted`` of ``--rates`` (a job spec setting; the
default 0.1 gives the figures) and with the crafted change in one segment and in all of them.

Figures (``figures``, at the job spec's defaults and ``--forged-segments``):
``forged_aggregated_per_forger_mean`` / ``_p99`` (crafted updates that reached an aggregate, per
forger that became trusted, whether or not it was stopped: one never stopped counts all of its
own), ``forgers_stopped_fraction`` (suspended by the end, of the forgers that became trusted),
``honest_flagged`` (flags on honest nodes), ``verification_cost_fraction`` (re-executed steps over
trained steps: one segment of ``--segments`` per re-execution, every training including replicas
and the three-replica groups that earn trust; not CPU time); the same with every segment forged
(``*_every_segment_forged``), at ``spot_check_trusted = 1`` (``*_full_audit``), and with a
disagreement's segment found from the committed norms alone, as for replicas of different
classes (``*_norms_pointer``, ``--no-hash-pointer``: what the hashes add). Each run
(``runs``) also has ``replication_overhead`` (replica trainings / shards, the trust-earning
rounds included), ``forged_aggregated_verified`` (crafted updates aggregated and marked verified:
a fellow member's replica agreed, or a replay drew one of its honest segments),
``forged_aggregated_unlisted`` (those of stopped forgers that ``rollback.unverified_rounds`` still
does not list, with the nodes stopped when the forger was; ``_end``: with the nodes stopped by the
end of the run, as a later rollback or ``auto_rollback``'s next look sees them),
``forged_kept_after_rollback`` (crafted updates the rollback at the forger's suspension leaves in
the model: those before the round it restores, or all when it is refused). That rollback is
``auto_rollback``'s: ``rollback.decide(before_node=..., oldest_kept=True)``, which falls back to
the oldest kept model when the one before the forger's first unverified round is older than
``keep_rounds`` (``rollback_partial``: rollbacks that left some of the forger's unverified rounds in
the model). Beside it, a plain ``job rollback --before-node`` (no fallback):
``forged_kept_after_rollback_without_fallback`` and ``rollback_refused_without_fallback``
(``round_not_kept``). ``rollback_rounds_undone_mean`` / ``_total`` and ``rollback_refused`` count
what the rollbacks with the fallback do; the figures repeat them for the default run.

``accuracy_after_rollback_vs_clean_points`` comes from a small real run (``rollback_accuracy``):
10 nodes, 3 of them forgers, train the digits MLP with the node's own trainer
(``train_assignment``) for 30 rounds, FedAvg by the hub's ``aggregate``; the forgers send
heterogeneity.py's crafted update (``craft``) from round 8, 15 of them each (the p99 target),
the first 2 verified by a fellow forger's agreeing replica and the rest unverified, and are then
suspended; ``rollback.decide(before_node=..., oldest_kept=True)`` picks the model to restore, and
the job continues on it with the honest nodes for the rounds the rollback gives back
(``*_partners_active``: the same with only the first forger stopped, its partners' word still
standing). Beside it: the clean run (all 10 honest), the clean run of the 7 honest nodes alone
(fewer, larger shards a round: what the job after a rollback trains like), and the forged run
continued without a rollback. One seed of it is noisy at the 1-point level, so it runs at
``--rollback-seeds`` seeds (initial model, chunk order, training seeds) and the
figure is their mean; ``rollback_run.runs`` has each seed's values.

Run (2 cores, 4-7 min): .venv/bin/python bench/patient_forger.py [--identities 700]
    [--rounds 160] [--round-s 300] [--segments 8] [--forged-segments 1|all] [--rates 0.1,0.3,1]
    [--no-hash-pointer] [--no-rollback] [--rollback-seeds 5] [--seed 1] [--out PATH]
-> bench/results/patient_forger.json, and a table on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from gpuflex.hub.base.config import HubConfig
from gpuflex.hub.policy import reputation as rp
from gpuflex.hub.policy import rollback, suspension
from gpuflex.hub.policy import round_policy as policy
from gpuflex.hub.policy.aggregation import aggregate
from gpuflex.hub.policy.referee import SegmentVerdict, fetch_steps, pick_segment
from gpuflex.hub.policy.update_record import UpdateRecord
from gpuflex.node.trainer import train_assignment
from gpuflex.protocol.jobspec import AggregationSpec, VerificationSpec
from gpuflex.protocol.messages import Commitment

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.tooling
sys.path.insert(0, str(ROOT / "bench"))  # heterogeneity

from heterogeneity import craft  # noqa: E402  (the coalition's crafted update, as that bench sends it)

from tests.tooling import attacks as atk  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "patient_forger.json"
VSPEC = VerificationSpec()  # the job spec's defaults, as the hub runs them
TRUST_MIN_AGE_S = HubConfig.__dataclass_fields__["trust_min_age_s"].default
COALITION = 0.3
STEPS_PER_SEGMENT = 4
TARGETS: dict[str, tuple[str, Any]] = {
    "forged_aggregated_per_forger_mean": ("<= 3", lambda v: v <= 3),
    "forged_aggregated_per_forger_p99": ("<= 15", lambda v: v <= 15),
    "forgers_stopped_fraction": (">= 0.99", lambda v: v >= 0.99),
    "honest_flagged": ("= 0", lambda v: v == 0),
    "verification_cost_fraction": (
        "<= 0.10 (re-executed steps / trained steps)",
        lambda v: v <= 0.10,
    ),
}


@dataclass
class Identity:
    node_id: str
    forger: bool
    joined: float
    rep: rp.Reputation = field(default_factory=rp.Reputation)
    checked_at: float = 0.0
    suspended: bool = False
    trusted_at: int | None = None  # the round it was first trusted in
    run_at_trust: int = 0  # its run of agreements then
    forged_aggregated: int = 0
    forged_verified: int = 0
    forged_caught_at: int | None = None
    aggregated: list[rollback.Aggregated] = field(default_factory=list)
    crafted: set[str] = field(default_factory=set)  # its crafted updates that were aggregated

    def reputation_at(self, now: float) -> rp.Reputation:
        """As the hub reads it (NodeState.reputation_at, and the probation its age sets)."""
        return dataclasses.replace(
            self.rep,
            probation=now - self.joined < TRUST_MIN_AGE_S,
            unchecked_s=max(0.0, now - self.checked_at),
        )


@dataclass
class Tally:
    shards: int = 0
    trainings: int = 0
    replicas: int = 0
    reexecutions: int = 0
    reexec_by_reason: dict[str, int] = field(default_factory=dict)
    honest_flags: int = 0
    forged_submitted: int = 0
    forged_aggregated: int = 0
    decide_s: float = 0.0
    forged_spot_rates: list[float] = field(default_factory=list)


def _h(*parts: object) -> str:
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()


class World:
    """The shards' honest updates and commitments, and the coalition's crafted ones."""

    def __init__(self, segments: int, forged: int, seed: int) -> None:
        self.segments, self.forged, self.seed = segments, forged, seed

    def delta(self, shard: str, crafted: bool) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(int(_h(self.seed, shard)[:12], 16))
        hidden, out = torch.randn(24, generator=g), torch.randn(8, generator=g)
        return {"hidden": hidden, "out": -2.2 * out if crafted else out}  # (24,), (8,)

    def forged_segments(self) -> range:
        return range(self.segments - self.forged, self.segments)  # the last ones

    def commitment(self, shard: str, crafted: bool) -> Commitment:
        """The honest trajectory's hashes and norms; a crafted one's hashes differ from its first
        forged checkpoint on, its norms are the honest ones (matched within NORM_SPLIT). The norms
        fall slowly over the segments, the largest about 1.4 x the median of the others (honest
        trajectories measured 1.08-1.66: referee.STANDOUT), so no segment stands out."""
        rng = random.Random(_h(self.seed, shard, "norms"))
        norms = tuple(1.0 / (1 + 0.1 * i) * rng.uniform(0.9, 1.1) for i in range(self.segments))
        first = self.segments - self.forged if crafted else self.segments + 1
        hashes = tuple(
            _h(shard, i, "forged" if i > first else "") for i in range(self.segments + 1)
        )
        return Commitment(
            every=STEPS_PER_SEGMENT,
            steps=STEPS_PER_SEGMENT * self.segments,
            precision="fp32",
            hashes=hashes,
            norms=norms,
        )


@dataclass(frozen=True)
class Work:
    update_id: str
    node: Identity
    crafted: bool
    commitment: Commitment


def _record(w: Work, shard: str, world: World) -> UpdateRecord:
    return UpdateRecord(
        update_id=w.update_id,
        node_id=w.node.node_id,
        shard_id=shard,
        samples_claimed=64,
        shard_samples=64,
        loss=1.0,
        train_s=1.0,
        node_samples_per_s=100.0,
        delta=world.delta(shard, w.crafted),
    )


class Simulation:
    def __init__(self, spec: VerificationSpec, args: argparse.Namespace) -> None:
        self.spec, self.args = spec, args
        self.rng = random.Random(args.seed)
        forged = args.segments if args.forged_segments == "all" else int(args.forged_segments)
        self.world = World(args.segments, forged, args.seed)
        n_bad = round(COALITION * args.identities)
        self.nodes = [
            Identity(f"n{i:04d}", forger=i < n_bad, joined=0.0) for i in range(args.identities)
        ]
        self.tally = Tally()

    def run(self) -> dict[str, Any]:
        for r in range(self.args.rounds):
            self.round(r, r * float(self.args.round_s))
        return self.summary()

    def round(self, r: int, now: float) -> None:
        active = [n for n in self.nodes if not n.suspended and not n.rep.banned]
        reps = {n.node_id: n.reputation_at(now) for n in active}
        pool = rp.ReplicaPool(reps, self.spec)
        by_id = {n.node_id: n for n in active}
        for n in active:
            if n.forger and n.trusted_at is None and rp.is_trusted(reps[n.node_id], self.spec):
                n.trusted_at, n.run_at_trust = r, reps[n.node_id].consecutive_agreements
        for node in active:
            if node.suspended:  # suspended earlier in this round
                continue
            self.shard(r, now, node, reps, pool, by_id)

    def _replica_holder(
        self, members: set[str], pool: rp.ReplicaPool, by_id: dict[str, Identity]
    ) -> Identity | None:
        """A node that may take the shard's next replica (ReplicaPool.eligible), drawn at random."""
        ids = list(by_id)
        for _ in range(200):
            other = by_id[ids[self.rng.randrange(len(ids))]]
            if not other.suspended and pool.eligible(other.node_id, members):
                return other
        return None

    def _replica(
        self,
        shard: str,
        forging: bool,
        works: list[Work],
        pool: rp.ReplicaPool,
        by_id: dict[str, Identity],
    ) -> bool:
        """One more replica of the shard, when a node may take it; the coalition agrees on its crafted update."""
        holder = self._replica_holder({w.node.node_id for w in works}, pool, by_id)
        if holder is None:
            return False
        crafted = forging and holder.forger
        works.append(
            Work(f"{shard}-{len(works)}", holder, crafted, self.world.commitment(shard, crafted))
        )
        self.tally.replicas += 1
        return True

    def shard(
        self,
        r: int,
        now: float,
        node: Identity,
        reps: dict[str, rp.Reputation],
        pool: rp.ReplicaPool,
        by_id: dict[str, Identity],
    ) -> None:
        t, world = self.tally, self.world
        shard = f"s{r}-{node.node_id}"
        t.shards += 1
        forging = node.forger and rp.is_trusted(
            reps[node.node_id], self.spec
        )  # honest until trusted, and again after a flag
        works = [Work(f"{shard}-0", node, forging, world.commitment(shard, forging))]
        if rp.should_replicate(reps[node.node_id], self.spec, self.rng):
            self._replica(shard, forging, works, pool, by_id)
        t.forged_submitted += forging
        if forging:  # the spot-check rate its crafted update meets when it stands alone
            t.forged_spot_rates.append(policy.spot_rate(True, self.spec, reps[node.node_id]))
        wanted, taker = len(works), True
        verdicts: dict[str, SegmentVerdict] = {}
        spot_draw = self.rng.random()
        for _ in range(16):
            state = policy.ReplicaState(wanted=wanted, waited_s=0.0, live=False, taker=taker)
            records = [_record(w, shard, world) for w in works]
            members = {w.node.node_id: reps[w.node.node_id] for w in works}
            committed = frozenset(w.update_id for w in works)
            t0 = time.thread_time()
            decision = policy.decide_shard(
                records,
                self.spec,
                state,
                members,
                committed=committed,
                verdicts=verdicts,
                spot_draw=spot_draw,
            )
            t.decide_s += time.thread_time() - t0
            if isinstance(decision, policy.WaitForMore):
                # one more replica, while a node may take it
                wanted = decision.wanted
                if wanted > len(works):
                    taker = self._replica(shard, forging, works, pool, by_id)
                    wanted = len(works) if not taker else wanted
                continue
            if not isinstance(decision, policy.Referee):
                break
            work_of = {w.update_id: w for w in works}
            for uid in decision.update_ids:
                verdicts[uid] = self.reexecute(work_of[uid], works, decision.reason)
        else:
            raise RuntimeError(f"shard {shard} never settled")
        t.trainings += len(works)
        self.apply(r, now, decision, {w.update_id: w for w in works}, verdicts)

    def reexecute(self, w: Work, works: Sequence[Work], reason: str) -> SegmentVerdict:
        """The referee replays the segment pick_segment chooses, as the round engine asks it."""
        self.tally.reexecutions += 1
        self.tally.reexec_by_reason[reason] = self.tally.reexec_by_reason.get(reason, 0) + 1
        # as RefereeReplays.ask: beside a disagreeing replica whose trajectory differs, of one class here
        others = [o.commitment for o in works if o.update_id != w.update_id]
        other = (
            next((o for o in others if o.hashes != w.commitment.hashes), others[0])
            if others
            else None
        )
        seg = pick_segment(
            w.commitment,
            other if reason == "disagreement" else None,
            draw=self.rng.random(),
            same_class=self.args.hash_pointer,
        )
        bad = w.crafted and seg in self.world.forged_segments()
        start, end, last = fetch_steps(w.commitment, seg)  # as judge_segment's evidence says them
        return SegmentVerdict(
            w.update_id,
            w.node.node_id,
            "mismatch" if bad else "reproduced",
            {"segment": seg, "reason": reason, "steps": [start, end], "last_step": last},
        )

    def apply(
        self,
        r: int,
        now: float,
        decision: policy.ShardDecision,
        work_of: dict[str, Work],
        verdicts: dict[str, SegmentVerdict],
    ) -> None:
        nodes = {w.node.node_id: w.node for w in work_of.values()}
        if isinstance(decision, policy.Settle):
            for nid in decision.agreed_nodes:
                nodes[nid].rep = rp.record_agreement(nodes[nid].rep)
                nodes[nid].checked_at = now
            rep = work_of[decision.representative]
            # who verified it, as hub/domain/aggregating.py records it: the referee's verdict on it
            # (the whole update or one segment), else the nodes of the replicas that agreed
            agreed = (
                work_of[u].node.node_id
                for u, st in decision.statuses.items()
                if st == "redundant" and u != rep.update_id
            )
            by = rollback.verifier_of(
                verdicts.get(rep.update_id), agreed, unverified=decision.unverified is not None
            )
            rep.node.aggregated.append(
                rollback.Aggregated(r, rep.update_id, rep.node.node_id, by is not None, by)
            )
            if rep.crafted:
                self.tally.forged_aggregated += 1
                rep.node.forged_aggregated += 1
                rep.node.forged_verified += by is not None
                rep.node.crafted.add(rep.update_id)
        flags = () if isinstance(decision, policy.WaitForMore) else decision.flags
        for f in flags:
            n = nodes[f.node_id]
            n.rep = rp.record_flag(n.rep)
            if not n.forger:
                self.tally.honest_flags += 1
            if suspension.suspends(f.reason, f.evidence) and not n.suspended:
                n.suspended, n.forged_caught_at = True, r

    def stopped_by(self, r: int) -> frozenset[str]:
        """The nodes suspended by the end of round ``r``."""
        return frozenset(
            n.node_id
            for n in self.nodes
            if n.forged_caught_at is not None and n.forged_caught_at <= r
        )

    def history_of(self, n: Identity, stopped: frozenset[str]) -> rollback.JobHistory:
        """The job's rollback history as the store gives it when the forger is stopped: its
        aggregated updates, the models kept then, and the nodes ``stopped``."""
        at = n.forged_caught_at if n.forged_caught_at is not None else self.args.rounds
        keep = int(self.spec.keep_rounds)
        return rollback.JobHistory(
            job_id="job",
            state="running",
            round=at + 1,
            rounds=self.args.rounds,
            keep_rounds=keep,
            aggregated=tuple(n.aggregated),
            kept=frozenset({0, *range(max(1, at - keep + 1) if keep else 1, at + 1)}),
            rolled_back=frozenset(),
            stopped=stopped,
        )

    def unlisted(self, n: Identity, stopped: frozenset[str]) -> int:
        """The forger's crafted updates that ``rollback.unverified_rounds`` does not list."""
        listed = set(rollback.unverified_rounds(self.history_of(n, stopped), n.node_id))
        return sum(a.update_id in n.crafted and a.round not in listed for a in n.aggregated)

    def rollback_of(
        self, n: Identity, *, oldest_kept: bool
    ) -> tuple[rollback.Rollback | rollback.Refused, int]:
        """What a rollback before the forger would do when it is stopped (seeing the nodes stopped
        by then): ``auto_rollback``'s (``oldest_kept``: the oldest kept model when the one before
        its first unverified round is gone) or a plain ``job rollback --before-node``'s, and how
        many of its crafted updates stay in the model after it (all of them when refused)."""
        at = n.forged_caught_at if n.forged_caught_at is not None else self.args.rounds
        d = rollback.decide(
            self.history_of(n, self.stopped_by(at)), before_node=n.node_id, oldest_kept=oldest_kept
        )
        first = d.to_round if isinstance(d, rollback.Rollback) else at + 1
        return d, sum(a.update_id in n.crafted and a.round < first for a in n.aggregated)

    def summary(self) -> dict[str, Any]:
        t = self.tally
        forgers = [n for n in self.nodes if n.forger and n.trusted_at is not None]
        counts = sorted(n.forged_aggregated for n in forgers)
        undone: list[int] = []
        refused: dict[str, int] = {}
        refused_plain: dict[str, int] = {}
        unlisted = unlisted_end = kept_after = kept_after_plain = partial = 0
        for n in forgers:
            if n.forged_aggregated and n.suspended:
                d, left = self.rollback_of(n, oldest_kept=True)
                kept_after += left
                unlisted += self.unlisted(n, self.stopped_by(n.forged_caught_at or 0))
                unlisted_end += self.unlisted(n, self.stopped_by(self.args.rounds))
                if isinstance(d, rollback.Rollback):
                    undone.append(len(d.undone))
                    partial += d.partial
                else:
                    refused[d.code] = refused.get(d.code, 0) + 1
                plain, left = self.rollback_of(n, oldest_kept=False)
                kept_after_plain += left
                if isinstance(plain, rollback.Refused):
                    refused_plain[plain.code] = refused_plain.get(plain.code, 0) + 1
        trained_steps = t.trainings * self.args.segments * STEPS_PER_SEGMENT
        replayed_steps = t.reexecutions * STEPS_PER_SEGMENT
        caught = [
            n.forged_caught_at - n.trusted_at
            for n in forgers
            if n.forged_caught_at is not None and n.trusted_at is not None
        ]
        return {
            "forgers": sum(n.forger for n in self.nodes),
            "forgers_trusted": len(forgers),
            "forged_aggregated_per_forger_mean": statistics.fmean(counts) if counts else 0.0,
            "forged_aggregated_per_forger_p99": _quantile(counts, 0.99),
            "forged_aggregated_per_forger_max": counts[-1] if counts else 0,
            "forgers_stopped_fraction": sum(n.suspended for n in forgers) / max(1, len(forgers)),
            "rounds_trusted_to_stopped_median": statistics.median(caught) if caught else None,
            "run_at_trust_median": statistics.median(n.run_at_trust for n in forgers)
            if forgers
            else None,
            "forged_spot_rate_mean": statistics.fmean(t.forged_spot_rates)
            if t.forged_spot_rates
            else None,
            "honest_flagged": t.honest_flags,
            "honest_suspended": sum(n.suspended for n in self.nodes if not n.forger),
            "verification_cost_fraction": replayed_steps / max(1, trained_steps),
            "replication_overhead": t.replicas / max(1, t.shards),
            "forged_submitted": t.forged_submitted,
            "forged_aggregated": t.forged_aggregated,
            "forged_aggregated_verified": sum(n.forged_verified for n in forgers),
            "forged_aggregated_unlisted": unlisted,
            "forged_aggregated_unlisted_end": unlisted_end,
            "forged_kept_after_rollback": kept_after,
            "forged_kept_after_rollback_without_fallback": kept_after_plain,
            "reexecutions_by_reason": dict(sorted(t.reexec_by_reason.items())),
            "rollback_rounds_undone_mean": statistics.fmean(undone) if undone else None,
            "rollback_rounds_undone_total": sum(undone),
            "rollback_partial": partial,
            "rollback_refused": refused,
            "rollback_refused_without_fallback": refused_plain,
            "shards": t.shards,
            "trainings": t.trainings,
            "policy_cpu_s": round(t.decide_s, 2),
        }


def _quantile(xs: Sequence[int], q: float) -> float:
    """The nearest-rank quantile (0 for no values)."""
    if not xs:
        return 0.0
    return float(xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))])


# --------------------------------------------------------------------------- accuracy after a rollback


@dataclass(frozen=True)
class RollbackRun:
    """The small real run: ``nodes`` nodes (30 % forgers) train the digits MLP with the node's own
    trainer, one shard each a round, FedAvg by the hub's ``aggregate``; the forgers train honestly
    until round ``forge_from``, then send heterogeneity.py's crafted update (output layer
    sign-flipped, x COLLUDE_SCALE) until they are suspended after ``forged`` of them each: the
    first ``vouched`` of each aggregated as verified by a fellow forger's agreeing replica (as the
    coalition's replicas do in the simulation), the rest unverified."""

    nodes: int = 10
    rounds: int = 30
    forge_from: int = 8
    forged: int = 15
    vouched: int = 2


def _fedavg_round(
    world: dict[str, Any],
    state: dict[str, torch.Tensor],
    r: int,
    active: Sequence[int],
    forging: set[int],
) -> dict[str, torch.Tensor]:
    """One round: the chunks cut over the active nodes, each trains its shard, FedAvg of the deltas."""
    chunks = world["chunks"]
    deltas, weights = [], []
    for i, n in enumerate(active):
        shard = chunks[i :: len(active)]
        res = train_assignment(
            world["spec"],
            state,
            shard,
            world["cfg"],
            100_000 * world["seed"] + 1000 * r + n,
            device=torch.device("cpu"),
        )
        deltas.append(craft(dict(res.delta)) if n in forging else dict(res.delta))
        weights.append(float(sum(int(c["x"].shape[0]) for c in shard)))
    agg = aggregate(deltas, weights, AggregationSpec())
    return {k: (v + agg[k]) if k in agg else v for k, v in state.items()}


def rollback_accuracy(run: RollbackRun = RollbackRun(), seed: int = 0) -> dict[str, Any]:
    """Final accuracy of a clean run, of a run where the forgers wrote ``run.forged`` crafted updates
    each before their suspension (no rollback), and of that run rolled back by the hub's
    ``rollback.decide(before_node=..., oldest_kept=True)`` (as ``auto_rollback`` asks) to the model
    of the round before a forger's first unverified update and continued, honest nodes only, for
    the rounds the rollback gives back. ``seed``: the initial model, the chunks' order and every
    training's seed."""
    spec = atk.digits_spec()
    xtr, ytr, xva, yva = atk.digits_data()
    world = {
        "spec": spec,
        "cfg": atk.train_config(),
        "chunks": atk.make_chunks(xtr, ytr, split="stratified", seed=seed),
        "seed": seed,
    }
    state0 = atk.initial_state(spec, seed)
    everyone = list(range(run.nodes))
    forgers = set(everyone[: round(COALITION * run.nodes)])
    honest = [n for n in everyone if n not in forgers]

    def accuracy(state: dict[str, torch.Tensor]) -> float:
        return 100.0 * atk.accuracy(spec, state, xva, yva)

    clean, clean_honest = state0, state0
    for r in range(run.rounds):
        clean = _fedavg_round(world, clean, r, everyone, set())
        clean_honest = _fedavg_round(world, clean_honest, r, honest, set())
    # the forged run, every model kept (keep_rounds = 0 in this short job) and every aggregate recorded
    models, aggregated, state = {0: state0}, [], state0
    stop = run.forge_from + run.forged
    ring = sorted(forgers)
    partner = {n: f"n{ring[(i + 1) % len(ring)]}" for i, n in enumerate(ring)}
    for r in range(stop):
        forging = forgers if r >= run.forge_from else set()
        state = _fedavg_round(world, state, r, everyone, forging)
        for n in everyone:
            if n not in forging:  # honest work: an honest node's replica agreed
                by: rollback.Verifier | None = rollback.Verifier(
                    (f"n{next(h for h in honest if h != n)}",)
                )
            else:  # the coalition vouches for the first ones, the rest go in unverified
                by = rollback.Verifier((partner[n],)) if r < run.forge_from + run.vouched else None
            aggregated.append(rollback.Aggregated(r, f"u{r}-{n}", f"n{n}", by is not None, by))
        models[r + 1] = state
    # suspended at round `stop`: the rest of the job without them, no rollback
    kept_going = state
    for r in range(stop, run.rounds):
        kept_going = _fedavg_round(world, kept_going, r, honest, set())

    def rolled_back(stopped: frozenset[str]) -> tuple[rollback.Rollback, dict[str, torch.Tensor]]:
        """``rollback.decide(before_node=...)`` with the nodes ``stopped``, and the job continued from it."""
        history = rollback.JobHistory(
            job_id="job",
            state="running",
            round=stop,
            rounds=run.rounds,
            keep_rounds=0,
            aggregated=tuple(aggregated),
            kept=frozenset(models),
            rolled_back=frozenset(),
            stopped=stopped,
        )
        decision = rollback.decide(history, before_node=f"n{min(forgers)}", oldest_kept=True)
        if not isinstance(decision, rollback.Rollback):
            raise RuntimeError(f"rollback refused: {decision.detail}")
        restored = models[decision.to_round]
        for r in range(decision.new_round, decision.rounds):
            restored = _fedavg_round(world, restored, r, honest, set())
        return decision, restored

    # every forger suspended, and (beside it) only the first one: its partners' word still stands
    decision, restored = rolled_back(frozenset(f"n{n}" for n in forgers))
    alone, restored_alone = rolled_back(frozenset({f"n{min(forgers)}"}))
    return {
        "seed": seed,
        "rolled_back_to_round": decision.to_round,
        "rounds_undone": len(decision.undone),
        "rounds_after": decision.rounds,
        "rolled_back_to_round_partners_active": alone.to_round,
        "accuracy_after_rollback_partners_active": accuracy(restored_alone),
        "accuracy_clean": accuracy(clean),
        "accuracy_clean_honest_nodes_only": accuracy(clean_honest),
        "accuracy_forged_no_rollback": accuracy(kept_going),
        "accuracy_after_rollback": accuracy(restored),
        "accuracy_after_rollback_vs_clean_points": accuracy(restored) - accuracy(clean),
        "accuracy_forged_no_rollback_vs_clean_points": accuracy(kept_going) - accuracy(clean),
        "accuracy_after_rollback_vs_clean_honest_nodes_only_points": accuracy(restored)
        - accuracy(clean_honest),
    }


#: the main run's rollback figures reported beside the targets
ROLLBACK_FIGURES = (
    "forged_kept_after_rollback",
    "forged_kept_after_rollback_without_fallback",
    "rollback_rounds_undone_total",
    "rollback_partial",
    "rollback_refused",
    "rollback_refused_without_fallback",
)

#: the per-seed figures averaged over the seeds of ``rollback_accuracy_seeds``
SEED_MEANS = (
    "accuracy_clean",
    "accuracy_clean_honest_nodes_only",
    "accuracy_forged_no_rollback",
    "accuracy_after_rollback",
    "accuracy_after_rollback_partners_active",
    "accuracy_after_rollback_vs_clean_points",
    "accuracy_forged_no_rollback_vs_clean_points",
    "accuracy_after_rollback_vs_clean_honest_nodes_only_points",
)


def rollback_accuracy_seeds(run: RollbackRun, seeds: Sequence[int]) -> dict[str, Any]:
    """``rollback_accuracy`` at each seed: one seed of a 30-round digits run is noisy at the 1-point
    level, so its figures are the means over the seeds (``runs``: each seed's own)."""
    runs = [rollback_accuracy(run, seed) for seed in seeds]
    means = {k: statistics.fmean(r[k] for r in runs) for k in SEED_MEANS}
    spread = {
        f"{k}_stdev": statistics.stdev(r[k] for r in runs) if len(runs) > 1 else 0.0
        for k in ("accuracy_after_rollback_vs_clean_points", "accuracy_clean")
    }
    return {
        "config": dataclasses.asdict(run),
        "seeds": list(seeds),
        **means,
        **spread,
        "runs": runs,
    }


ROWS = (
    "forgers_trusted",
    "forged_aggregated_per_forger_mean",
    "forged_aggregated_per_forger_p99",
    "forged_aggregated_per_forger_max",
    "forgers_stopped_fraction",
    "rounds_trusted_to_stopped_median",
    "run_at_trust_median",
    "forged_spot_rate_mean",
    "honest_flagged",
    "verification_cost_fraction",
    "replication_overhead",
    "forged_aggregated_verified",
    "forged_aggregated_unlisted",
    "forged_aggregated_unlisted_end",
    "forged_kept_after_rollback",
    "forged_kept_after_rollback_without_fallback",
    "rollback_rounds_undone_mean",
    "rollback_rounds_undone_total",
    "rollback_partial",
)


def _f(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--identities", type=int, default=700)
    ap.add_argument("--rounds", type=int, default=160)
    ap.add_argument("--round-s", type=float, default=300.0, help="simulated seconds a round")
    ap.add_argument(
        "--segments",
        type=int,
        default=8,
        help="committed segments an update (checkpoint_every = 0)",
    )
    ap.add_argument(
        "--forged-segments",
        default="1",
        help="segments of a crafted update that are forged: N or all",
    )
    ap.add_argument(
        "--rates",
        default="0.1,0.3,1",
        help="spot_check_trusted values run (the default's run gives the figures; 1: every trusted update)",
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--hash-pointer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replicas of one class: a disagreement replays the first segment whose hash differs",
    )
    ap.add_argument(
        "--rollback",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the small real run of a rollback (digits, the node's trainer; about 1-2 min)",
    )
    ap.add_argument(
        "--rollback-seeds",
        type=int,
        default=5,
        help="seeds of the small real run of a rollback (its figures are their means)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    runs: dict[str, dict[str, Any]] = {}
    rates = [float(x) for x in args.rates.split(",")]
    for rate in rates:
        spec = dataclasses.replace(VSPEC, spot_check_trusted=rate)
        for forged in dict.fromkeys((args.forged_segments, "all")):
            key = f"trusted{rate:g}_forged_{forged}"
            runs[key] = Simulation(
                spec, argparse.Namespace(**{**vars(args), "forged_segments": forged})
            ).run()
            print(f"{key}: {time.perf_counter() - t0:.0f} s", flush=True)
    default = f"trusted{float(VSPEC.spot_check_trusted):g}"
    # the same at the defaults with a disagreement's segment found from the norms alone (the rule
    # for replicas of different classes): what the checkpoint hashes add
    norms_only = f"{default}_forged_{args.forged_segments}_norms_pointer"
    runs[norms_only] = Simulation(
        VSPEC, argparse.Namespace(**{**vars(args), "hash_pointer": False})
    ).run()
    print(f"{norms_only}: {time.perf_counter() - t0:.0f} s", flush=True)
    main_run = runs[f"{default}_forged_{args.forged_segments}"]
    fig = {k: main_run[k] for k in TARGETS}
    fig |= {f"{k}_every_segment_forged": runs[f"{default}_forged_all"][k] for k in TARGETS}
    fig |= {f"{k}_norms_pointer": runs[norms_only][k] for k in TARGETS}
    if 1.0 in rates:
        fig |= {
            f"{k}_full_audit": runs[f"trusted1_forged_{args.forged_segments}"][k] for k in TARGETS
        }
    # what auto_rollback leaves in the model (the oldest kept model when the one it wants is gone),
    # beside a plain rollback's refusals
    fig |= {k: main_run[k] for k in ROLLBACK_FIGURES}
    seeds = range(args.rollback_seeds)
    rolled = rollback_accuracy_seeds(RollbackRun(), seeds) if args.rollback else None
    fig["accuracy_after_rollback_vs_clean_points"] = (
        None if rolled is None else rolled["accuracy_after_rollback_vs_clean_points"]
    )
    if rolled is not None:
        print(f"rollback run: {time.perf_counter() - t0:.0f} s", flush=True)
    met = {
        k: {"value": fig[k], "target": target, "met": bool(check(fig[k]))}
        for k, (target, check) in TARGETS.items()
    }
    width = max(map(len, ROWS))
    print(f"\n{'':<{width}} " + " ".join(f"{k:>20}" for k in runs))
    for row in ROWS:
        print(f"{row:<{width}} " + " ".join(f"{_f(r[row]):>20}" for r in runs.values()))
    if rolled is not None:
        acc = rolled["accuracy_after_rollback_vs_clean_points"]
        met["accuracy_after_rollback_vs_clean_points"] = {
            "value": acc,
            "target": "within 0.5 points",
            "met": abs(acc) <= 0.5,
        }
        print(
            f"\nrollback (digits, {rolled['config']['nodes']} nodes, {rolled['config']['rounds']} rounds,"
            f" mean of {len(rolled['runs'])} seeds): clean {rolled['accuracy_clean']:.2f}%,"
            f" honest nodes only {rolled['accuracy_clean_honest_nodes_only']:.2f}%,"
            f" forged without rollback {rolled['accuracy_forged_no_rollback']:.2f}%,"
            f" rolled back and continued {rolled['accuracy_after_rollback']:.2f}%"
            f" (with the partners not yet stopped: {rolled['accuracy_after_rollback_partners_active']:.2f}%)"
        )
        print(
            f"{'seed':>4} {'to round':>8} {'clean':>7} {'honest only':>11} {'rolled back':>11}"
            f" {'vs clean':>8} {'vs honest only':>14}"
        )
        for r in rolled["runs"]:
            print(
                f"{r['seed']:>4} {r['rolled_back_to_round']:>8} {r['accuracy_clean']:>7.2f}"
                f" {r['accuracy_clean_honest_nodes_only']:>11.2f} {r['accuracy_after_rollback']:>11.2f}"
                f" {r['accuracy_after_rollback_vs_clean_points']:>+8.2f}"
                f" {r['accuracy_after_rollback_vs_clean_honest_nodes_only_points']:>+14.2f}"
            )
    print()
    for k, c in met.items():
        print(
            f"{k:<36} {_f(c['value']):>8}  target {c['target']:<44} {'met' if c['met'] else 'NOT met'}"
        )
    result = {
        "bench": "patient_forger",
        "mode": "simulated clock; the hub's own policy code decides (reputation, round_policy.decide_shard with"
        " spot_checks, referee.pick_segment, suspension, rollback); see the module docstring",
        "machine": {
            "cpu": platform.machine(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "config": {
            "identities": args.identities,
            "coalition": COALITION,
            "rounds": args.rounds,
            "round_s": args.round_s,
            "segments": args.segments,
            "forged_segments": args.forged_segments,
            "trust_min_age_s": TRUST_MIN_AGE_S,
            "seed": args.seed,
            "verification": dataclasses.asdict(VSPEC),
            "verification_cost": "re-executed steps / trained steps (one segment per re-execution)",
        },
        "targets": {k: t for k, (t, _) in TARGETS.items()},
        "figures": fig,
        "met": met,
        "runs": runs,
        "rollback_run": rolled,
        "elapsed_s": round(time.perf_counter() - t0, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} ({result['elapsed_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
