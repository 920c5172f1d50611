"""Robustness: every attack at 10/20/30 % of nodes on real digits training.

The hub's round policy, driven in-process: no HTTP and no database, but the very
functions the hub's RoundEngine (gpuflex.hub.domain.rounds) calls, in the order it calls them,
and the node's real trainer (gpuflex.node.trainer.train_assignment, through
tests/tooling/attacks.contribute). Each "node" is a reputation + an optional attack
from the catalogue; training is real and deterministic. Nothing of the policy is
copied here.

Per round: the training set (digits, 80 %, stratified 64-sample chunks) is shuffled
and cut into shards of 2 chunks; shard j goes to a random active node. As the
scheduler does, a shard is replicated when ``verification.should_replicate`` says so
(``wanted = max(2, quorum)``) and each further replica goes to a node drawn from
``verification.replica_candidates``. Every time something changes the shard is put to
``policy.decide_shard`` (the engine's settle step) with its updates in the hub's fixed
order (update sha, then id) and the replica state: ``WaitForMore`` hands out another
replica while a node can take one, otherwise the replica window is taken to run out
(``waited_s = replica_wait_s``), as it would on the hub. ``Settle`` moves reputations
at once (agreement credit, flags), as the engine does; ``Drop`` returns the shard's
chunks to the pool, and they are trained again as a new shard (new seed) by another
node in the same round (capped at MAX_ISSUES issues; beyond that the shard is
``lost``). When every shard is settled, ``policy.judge_round`` reviews the
representatives (review_round + the vouching rule), flagged nodes get their
reputation flag, and the included updates are aggregated with the job's
``aggregate`` and ``ServerOptimizer`` (FedAvg, server optimizer none). An auditor is
simulated with ground truth: every standing flag on a malicious update is confirmed
(3 confirmed -> banned), every other one dismissed (withdrawn flags get no verdict,
as on the hub).

Metrics per (attack, fraction):
- detection_rate: malicious updates flagged or not aggregated / malicious updates
  submitted (stale replay's first, honest, update is not malicious);
- honest_flagged: flags that stand on honest nodes' updates (after withdrawal);
- accuracy_drop_points: clean-run accuracy - this run's, in points (same seeds);
- replication_overhead: extra trainings (replicas and re-issued dropped shards) /
  shards, as the hub's job history counts it, over the whole run and over the rounds
  after every honest node is trusted (``_trusted``);
- dropped_shards: shards the policy dropped (inconclusive or no majority), each
  trained again; lost_shards: those still unsettled after MAX_ISSUES issues.

``review_only_at_20`` repeats 20 % with replication off: what review_round
(outlier / free rider / implausible) catches on its own.

The referee (issue 14; on unless ``--no-referee``): every node records the checkpoint
commitments the shipped node records (gpuflex.node.checkpoints.CheckpointRecorder, states
kept in memory: the node hands them over), the updates carry them into ``decide_shard``
(``committed``, ``verdicts`` and the shard's spot-check draw, which the policy holds against
``verification.spot_check`` or ``spot_check_trusted``, as RefereeReplays.inputs passes them (hub/domain/replays.py)), and a ``Referee`` decision is answered with
``gpuflex.hub.policy.referee.judge_segment`` on the segment ``pick_segment`` chooses, as
RefereeReplays.judge does. ``verification_cost_fraction``: re-executed steps / trained steps.

Run: .venv/bin/python bench/robustness.py [--quick] [--rounds N] [--attacks a,b]
-> bench/results/robustness.json (not written with --quick)
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
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.tooling

from gpuflex.hub.policy import round_policy as policy  # noqa: E402
from gpuflex.hub.policy import verification as vf  # noqa: E402
from gpuflex.hub.policy.aggregation import aggregate  # noqa: E402
from gpuflex.hub.policy.referee import (  # noqa: E402
    SegmentVerdict,
    fetch_steps,
    judge_segment,
    pick_segment,
    referee_grid_ok,
    replay_onednn,
    request_steps,
    stack_data,
)
from gpuflex.hub.policy.server_optimizer import ServerOptimizer  # noqa: E402
from gpuflex.hub.policy.strategy import Contribution, aggregation_weights  # noqa: E402
from gpuflex.node.checkpoints import CheckpointRecorder, training_state  # noqa: E402
from gpuflex.node.trainer import train_assignment  # noqa: E402
from gpuflex.protocol.checkpoint import auto_every  # noqa: E402
from gpuflex.protocol.jobspec import AggregationSpec, VerificationSpec  # noqa: E402
from gpuflex.protocol.messages import Commitment, ComputeClass  # noqa: E402
from gpuflex.protocol.modelspec import param_count  # noqa: E402
from gpuflex.protocol.tensors import encode_state  # noqa: E402
from gpuflex.protocol.workload import assignment_steps  # noqa: E402

from tests.tooling import attacks as atk  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "robustness.json"
N_NODES = 10
CHUNKS_PER_SHARD = 2
FRACTIONS = (0.1, 0.2, 0.3)
MAX_ISSUES = 5  # a shard dropped this many times in one round is counted lost
VSPEC = VerificationSpec()  # the job spec's defaults
AGG = AggregationSpec()  # fedavg, no clipping, server optimizer none


def seed_of(*parts: Any) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@dataclass
class Node:
    node_id: str
    attack: atk.Attack | None
    rep: vf.Reputation = field(default_factory=vf.Reputation)


@dataclass
class Work:
    rec: vf.UpdateRecord
    sha: str  # of the update's bytes, as the hub names the blob
    malicious: bool
    commitment: Commitment | None = None
    states: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # what the node hands over
    chunks: list = field(default_factory=list)
    seed: int = 0
    global_state: dict = field(default_factory=dict)


class _Keeper(CheckpointRecorder):
    """The node's recorder, keeping the states in memory instead of its data dir."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, step: int, model: Any, optimizer: Any, scaler: Any = None) -> None:
        if step in self._wanted:
            self.states[step] = training_state(model, optimizer, step, scaler)
        super().__call__(step, model, optimizer, scaler)


def train_committed(spec: Any, state: dict, chunks: list, cfg: Any, seed: int) -> tuple[Any, dict]:
    """The node's training with its checkpoint commitments: (TrainResult with commitment, states)."""
    n = sum(int(c["x"].shape[0]) for c in chunks)
    total = math.ceil(n / cfg.batch_size) * cfg.local_epochs
    # the precision it trains in (cfg.precision) goes into the commitment, as the node's agent does
    rec = _Keeper(total_steps=total, every=auto_every(total, cfg.checkpoint_every),
                  precision=str(getattr(cfg, "precision", "fp32")))
    res = train_assignment(spec, state, chunks, cfg, seed, device=torch.device("cpu"), on_step=rec)
    return replace(res, commitment=rec.commitment()), rec.states


def global_norm(state: dict[str, torch.Tensor]) -> float:
    """L2 norm of the model's floating tensors, as RoundAggregation.aggregate computes it (hub/domain/aggregating.py)."""
    return math.sqrt(
        sum(float((t.double() ** 2).sum()) for t in state.values() if t.is_floating_point())
    )


class Simulation:
    def __init__(
        self,
        world: dict[str, Any],
        attack: str | None,
        n_attackers: int,
        rounds: int,
        seed: int = 0,
        vspec: VerificationSpec = VSPEC,
        referee: bool = True,
    ):
        # the checkpoint interval reaches the nodes' training settings as the hub sends it
        self.w = dict(world, cfg=dataclasses.replace(world["cfg"], checkpoint_every=int(vspec.checkpoint_every)))
        self.referee = referee
        self.vspec = vspec
        self.rounds = rounds
        self.seed = seed
        ids = [f"n{i:02d}" for i in range(N_NODES)]
        bad = set(ids[N_NODES - n_attackers :]) if attack else set()
        self.nodes = {n: Node(n, atk.make_attack(attack) if n in bad else None) for n in ids}
        self.stats: dict[str, Any] = {
            "malicious": 0,
            "caught": 0,
            "honest_flagged": 0,
            "shards": 0,
            "trainings": 0,
            "shards_trusted": 0,
            "trainings_trusted": 0,
            "dropped_shards": 0,
            "lost_shards": 0,
            "banned": [],
            "steps_trained": 0,
            "steps_replayed": 0,
            "referee_checks": 0,
            "referee_by_reason": {},  # "<reason>/honest|malicious" -> re-executions
        }
        self.trusted_from: int | None = None

    # ------------------------------------------------------------------ one node's work
    def _honest(self, cache: dict, state: dict, key: Any, chunks: list, seed: int) -> Any:
        if key not in cache:
            cache[key] = train_committed(self.w["spec"], state, chunks, self.w["cfg"], seed)
        return cache[key]

    def work(
        self, node: Node, uid: str, key: Any, chunks: list, seed: int, state: dict, cache: dict
    ) -> Work:
        samples = sum(int(c["x"].shape[0]) for c in chunks)
        a = node.attack
        malicious = a is not None
        if a is None:
            res, states = self._honest(cache, state, key, chunks, seed)
        elif a.name in ("label_flip", "half_shard"):  # data attacks: their own training
            if (a.name, key) not in cache:
                data = a.prepare(chunks, int(self.w["spec"].outputs))
                trained, kept = train_committed(self.w["spec"], state, data, self.w["cfg"], seed)
                cache[(a.name, key)] = (a.finish(trained, claimed_samples=samples, seed=seed), kept)
            res, states = cache[(a.name, key)]
        else:
            honest, states = self._honest(cache, state, key, chunks, seed)
            res = a.finish(honest, claimed_samples=samples, seed=seed)
            if a.name == "stale_replay" and a.state["count"] == 1:
                malicious = False  # its first update is honest (it is what it replays later)
        rec = vf.UpdateRecord(
            update_id=uid,
            node_id=node.node_id,
            shard_id=f"s{key}",
            samples_claimed=res.sample_count,
            shard_samples=samples,
            loss=res.loss,
            train_s=res.train_s,
            node_samples_per_s=0.0,
            delta=res.delta,
            # the hub's path-length check (hub/domain/updates.py update_records): an uncoded, committed update
            path_length=math.fsum(res.commitment.norms) if self.referee and res.commitment else None,
        )
        sha = hashlib.sha256(encode_state(res.delta)).hexdigest()
        self.stats["steps_trained"] += res.steps
        return Work(rec, sha, malicious, res.commitment if self.referee else None, states, chunks, seed, state)

    def compute_of(self, node_id: str) -> ComputeClass | None:
        """The node's compute class from its hello, as the hub's scheduler holds it (None here:
        this bench's nodes all train in the bench's own class; bench/heterogeneity.py says)."""
        return None

    def judge(self, decision: policy.Referee, group: list[Work], verdicts: dict) -> None:
        """What RefereeReplays.ask / judge do, the node handing its states over at once."""
        cfg = self.w["cfg"]
        for uid in decision.update_ids:
            g = next(x for x in group if x.rec.update_id == uid)
            c = g.commitment
            n_steps = assignment_steps(g.rec.shard_samples, cfg.batch_size, cfg.local_epochs, cfg.local_steps)
            if c is None or not referee_grid_ok(c, n_steps):
                verdicts[uid] = SegmentVerdict(uid, g.rec.node_id, "unverifiable", {"why": "no usable commitment"})
                continue
            # beside a disagreeing replica whose trajectory differs, as RefereeReplays.ask picks it; this
            # bench's nodes carry no class keys (compute_of), so the hub never reads them as same_class
            others = [o.commitment for o in group if o is not g and o.commitment is not None]
            other = next((o for o in others if o.hashes != c.hashes), others[0]) if others else None
            seg = pick_segment(c, other if decision.reason == "disagreement" else None,
                               draw=seed_of(self.seed, "segment", uid) / float(1 << 63),  # replays.segment_draw
                               same_class=False)
            steps = fetch_steps(c, seg)
            wanted = request_steps(c, seg, 12 * param_count(self.w["spec"]))  # RefereeReplays.ask's
            x, y = stack_data(g.chunks)
            tol = self.vspec.segment_tolerance if c.precision == "fp32" else self.vspec.segment_tolerance_low
            verdicts[uid] = judge_segment(
                update_id=uid, node_id=g.rec.node_id, round=0, spec=self.w["spec"], cfg=cfg, seed=g.seed,
                commitment=c, segment=seg, states={st: g.states[st] for st in wanted if st in g.states},
                global_state=g.global_state, delta=g.rec.delta, x=x, y=y, tolerance=tol,
                onednn=replay_onednn(self.compute_of(g.rec.node_id)))
            self.stats["steps_replayed"] += steps[1] - steps[0]
            self.stats["referee_checks"] += 1
            why = f"{decision.reason}/{'malicious' if g.malicious else 'honest'}"
            self.stats["referee_by_reason"][why] = self.stats["referee_by_reason"].get(why, 0) + 1

    # ------------------------------------------------------------------ one shard
    def replica_state(
        self, wanted: int, waited: float, taker: bool, members: set[str]
    ) -> policy.ReplicaState:
        """What ShardSettling.replica_state hands the policy (no replica assignment is ever
        out here: ``live`` False). No compute classes in this bench: every group is
        same-class; bench/heterogeneity.py adds the members' class keys."""
        return policy.ReplicaState(wanted=wanted, waited_s=waited, live=False, taker=taker)

    def settle_shard(
        self, group: list[Work], wanted: int, active: list[Node], issue: Any
    ) -> tuple[policy.Settle | policy.Drop, list[Work]]:
        """Ask decide_shard until it settles or drops the shard; hand out the replicas it
        wants while a node can take one, else let the replica window run out."""
        waited = 0.0
        verdicts: dict[str, SegmentVerdict] = {}
        spot_draw = seed_of(self.seed, "spot", issue.rnd, issue.key) / float(1 << 63)  # the engine's draw, in [0, 1)
        while True:
            ordered = sorted(group, key=lambda g: (g.sha, g.rec.update_id))  # the engine's order
            members = {g.rec.node_id for g in group}
            takers = vf.replica_candidates({n.node_id: n.rep for n in active}, members, self.vspec)
            state = self.replica_state(wanted, waited, bool(takers), members)
            reps = {m: self.nodes[m].rep for m in members}
            referee: dict[str, Any] = {}
            if self.referee:
                referee = {"committed": frozenset(g.rec.update_id for g in group if g.commitment is not None),
                           "verdicts": dict(verdicts), "spot_draw": spot_draw, "trend": self.trend(group, issue)}
            decision = policy.decide_shard([g.rec for g in ordered], self.vspec, state, reps, **referee)
            if isinstance(decision, policy.Referee):
                self.judge(decision, group, verdicts)
                continue
            if not isinstance(decision, policy.WaitForMore):
                return decision, group
            wanted = decision.wanted
            if len(group) < wanted and takers:
                pick = self.nodes[issue.rng.choice(takers)]
                group.append(issue.train(pick, len(group)))
                continue
            if waited >= self.vspec.replica_wait_s:
                raise RuntimeError("decide_shard still waits after the replica window ran out")
            waited = float(self.vspec.replica_wait_s)  # nobody else comes: the window runs out

    def trend(self, group: list[Work], issue: Any) -> dict[str, tuple[float, str]]:
        """What ShardSettling._decide measures: each update against the model's trend (the
        current model minus the one ``policy.trend_base_round`` names), with the hub's function."""
        base = policy.trend_base_round(issue.rnd, self.vspec)
        if base is None:
            return {}
        then = self.models[base]
        return {g.rec.update_id: vf.trend_alignment(g.rec.delta, issue.state, then) for g in group}

    # ------------------------------------------------------------------ the round loop
    def run(self) -> dict[str, Any]:
        w = self.w
        state = {k: v.clone() for k, v in w["state0"].items()}
        self.models = [state]  # the global model by round (the trend's base is one of them)
        opt = ServerOptimizer.from_spec(AGG)
        chunks = w["chunks"]
        s = self.stats
        for rnd in range(self.rounds):
            rng = random.Random(seed_of(self.seed, "round", rnd))
            active = [n for n in self.nodes.values() if not n.rep.banned]
            honest_ids = [n.node_id for n in self.nodes.values() if n.attack is None]
            trusted_phase = all(vf.is_trusted(self.nodes[h].rep, self.vspec) for h in honest_ids)
            if trusted_phase and self.trusted_from is None:
                self.trusted_from = rnd
            order = list(range(len(chunks)))
            rng.shuffle(order)
            shards = [
                order[i : i + CHUNKS_PER_SHARD] for i in range(0, len(order), CHUNKS_PER_SHARD)
            ]
            perm = rng.sample(active, len(active))
            cache: dict = {}
            settled: list[tuple[policy.Settle, list[Work]]] = []
            flags: dict[tuple[str, str], tuple[vf.Flag, bool]] = {}  # (update, reason) -> flag
            all_work: list[Work] = []
            for j, shard in enumerate(shards):
                sh_chunks = [chunks[c] for c in shard]
                s["shards"] += 1
                s["shards_trusted"] += trusted_phase
                primary = perm[j % len(perm)]
                for attempt in range(MAX_ISSUES):
                    key = f"{j}.{attempt}"  # a re-issued shard is a new shard: new seed
                    sh_seed = seed_of(self.seed, rnd, j, attempt)
                    issue = _Issue(self, rng, key, sh_chunks, sh_seed, state, cache, rnd)
                    wanted = (
                        max(2, int(self.vspec.quorum))
                        if vf.should_replicate(primary.rep, self.vspec, rng)
                        else 1
                    )
                    group = [issue.train(primary, 0)]
                    decision, group = self.settle_shard(group, wanted, active, issue)
                    all_work.extend(group)
                    s["trainings"] += len(group)
                    s["trainings_trusted"] += trusted_phase * len(group)
                    if isinstance(decision, policy.Settle):
                        for nid in decision.agreed_nodes:
                            self.nodes[nid].rep = vf.record_agreement(self.nodes[nid].rep)
                    for nid in decision.flagged_nodes:
                        self.nodes[nid].rep = vf.record_flag(self.nodes[nid].rep)
                    for nid in decision.missed_nodes:  # (none here: every node hands its states over)
                        self.nodes[nid].rep = vf.record_missed(self.nodes[nid].rep)
                    by_id = {g.rec.update_id: g for g in group}
                    for f in decision.flags:
                        flags[(f.update_id, f.reason)] = (f, by_id[f.update_id].malicious)
                    if isinstance(decision, policy.Settle):
                        settled.append((decision, group))
                        break
                    s["dropped_shards"] += 1
                    primary = rng.choice(active)  # the chunks go back to the pool
                else:
                    s["lost_shards"] += 1
            # Close the round: what RoundClosing.close / RoundAggregation.aggregate do, in that order.
            reps_w: list[Work] = []
            groups: dict[str, tuple[policy.GroupMember, ...]] = {}
            for d, grp in settled:
                reps_w.append(next(g for g in grp if g.rec.update_id == d.representative))
                groups[d.representative] = tuple(
                    policy.GroupMember(
                        g.rec.update_id, g.rec.node_id, d.statuses.get(g.rec.update_id, "accepted")
                    )
                    for g in grp
                    if g.rec.update_id != d.representative
                )
            reps_w.sort(key=lambda g: (g.sha, g.rec.update_id))
            gnorm = global_norm(state) if reps_w else 0.0
            dissent = {g.rec.update_id: g.rec for d, grp in settled for g in grp
                       if d.statuses.get(g.rec.update_id) == "quarantined"}
            judgement = policy.judge_round([g.rec for g in reps_w], gnorm, self.vspec, groups, dissent=dissent)
            by_uid = {g.rec.update_id: g for g in all_work}
            for nid in judgement.flagged_nodes:
                self.nodes[nid].rep = vf.record_flag(self.nodes[nid].rep)
            for f in judgement.flags:
                flags[(f.update_id, f.reason)] = (f, by_uid[f.update_id].malicious)
            # The minority was right: its replica_mismatch flag is dismissed (no verdict).
            for uid in judgement.withdrawn:
                flags.pop((uid, "replica_mismatch"), None)
            keep = set(judgement.review.included)
            aggregated = set(keep)  # an included representative carries its redundant replicas
            for d, _grp in settled:
                if d.representative in keep:
                    aggregated.update(u for u, st in d.statuses.items() if st == "redundant")
            flagged_updates = {uid for uid, _ in flags}
            for g in all_work:
                if g.malicious:
                    s["malicious"] += 1
                    if g.rec.update_id not in aggregated or g.rec.update_id in flagged_updates:
                        s["caught"] += 1
                    else:
                        s.setdefault("escaped", []).append(g.rec.update_id)
            for f, malicious in flags.values():
                node = self.nodes[f.node_id]
                if not malicious:
                    s["honest_flagged"] += node.attack is None
                # The auditor (ground truth): confirm flags on malicious updates, dismiss the rest.
                node.rep = vf.record_verdict(node.rep, "confirm" if malicious else "dismiss")
                if node.rep.banned and f.node_id not in s["banned"]:
                    s["banned"].append(f.node_id)
            use = [g for g in reps_w if g.rec.update_id in keep]
            if use:
                # the hub's weighting rule (hub/policy/strategy.py): samples x the round's weight
                # factor, each delta scaled by the round's norm bound
                weighting = aggregation_weights([
                    Contribution(g.rec.update_id, g.rec.node_id, g.rec.shard_samples,
                                 judgement.weight_factors.get(g.rec.update_id, 1.0),
                                 judgement.scales.get(g.rec.update_id, 1.0)) for g in use], central_dp=False)
                agg = aggregate(
                    [g.rec.delta for g in use], list(weighting.weights), AGG,
                    scales=list(weighting.scales) if any(x < 1.0 for x in weighting.scales) else None,
                )
                state = opt.step(state, agg)
            self.models.append(state)
        acc = atk.accuracy(w["spec"], state, w["xva"], w["yva"])
        extra_trusted = s["trainings_trusted"] - s["shards_trusted"]
        return {
            "accuracy": acc,
            "malicious_updates": s["malicious"],
            "detection_rate": (s["caught"] / s["malicious"]) if s["malicious"] else None,
            "honest_flagged": s["honest_flagged"],
            "replication_overhead": (s["trainings"] - s["shards"]) / max(s["shards"], 1),
            "replication_overhead_trusted": (extra_trusted / s["shards_trusted"])
            if s["shards_trusted"]
            else None,
            "trusted_from_round": self.trusted_from,
            "dropped_shards": s["dropped_shards"],
            "lost_shards": s["lost_shards"],
            "banned": s["banned"],
            "escaped": s.get("escaped", []),
            "referee_checks": s["referee_checks"],
            "verification_cost_fraction": s["steps_replayed"] / max(s["steps_trained"], 1),
        }


@dataclass
class _Issue:
    """One issue of a shard: who trains it is the only thing that varies."""

    sim: Simulation
    rng: random.Random
    key: str
    chunks: list
    seed: int
    state: dict
    cache: dict
    rnd: int

    def train(self, node: Node, n: int) -> Work:
        uid = f"u{self.rnd}-{self.key}-{n}"
        return self.sim.work(node, uid, self.key, self.chunks, self.seed, self.state, self.cache)


def make_world() -> dict[str, Any]:
    spec = atk.digits_spec()
    xtr, ytr, xva, yva = atk.digits_data()
    return {
        "spec": spec,
        "cfg": atk.train_config(),
        "xva": xva,
        "yva": yva,
        "chunks": atk.make_chunks(xtr, ytr, split="stratified"),
        "state0": atk.initial_state(spec),
    }


def n_attackers(attack: str, fraction: float) -> int:
    k = max(1, round(fraction * N_NODES))
    return max(2, k) if attack == "colluding" else k  # a colluding "pair" needs two


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer rounds, 20 %% only")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--attacks", default=",".join(atk.ATTACKS))
    ap.add_argument("--referee", action=argparse.BooleanOptionalAction, default=True,
                    help="checkpoint commitments and the referee's segment re-execution (default on, as the hub)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rounds = args.rounds or (6 if args.quick else 15)
    fractions = (0.2,) if args.quick else FRACTIONS
    t0 = time.perf_counter()
    world = make_world()
    clean = Simulation(world, None, 0, rounds, referee=args.referee).run()
    print(
        f"clean: accuracy {clean['accuracy']:.4f} overhead {clean['replication_overhead']:.3f} "
        f"trusted from round {clean['trusted_from_round']} ({time.perf_counter() - t0:.0f} s)",
        flush=True,
    )
    rows = []
    for attack in args.attacks.split(","):
        for fraction in fractions:
            k = n_attackers(attack, fraction)
            r = Simulation(world, attack, k, rounds, referee=args.referee).run()
            row = {
                "attack": attack,
                "attacker_fraction": fraction,
                "attackers": k,
                "detection_rate": r["detection_rate"],
                "honest_flagged": r["honest_flagged"],
                "accuracy_drop_points": round(100 * (clean["accuracy"] - r["accuracy"]), 2),
                "replication_overhead": round(r["replication_overhead"], 4),
                "replication_overhead_trusted": None
                if r["replication_overhead_trusted"] is None
                else round(r["replication_overhead_trusted"], 4),
                "malicious_updates": r["malicious_updates"],
                "dropped_shards": r["dropped_shards"],
                "lost_shards": r["lost_shards"],
                "banned": r["banned"],
                "accuracy": round(r["accuracy"], 4),
                "referee_checks": r["referee_checks"],
                "verification_cost_fraction": round(r["verification_cost_fraction"], 4),
            }
            rows.append(row)
            print(json.dumps(row), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    # Second line of defence alone: no replication at all, review_round only (20 %).
    review_only = []
    no_replicas = replace(VSPEC, replication=0.0)
    for attack in args.attacks.split(","):
        k = n_attackers(attack, 0.2)
        r = Simulation(world, attack, k, rounds, vspec=no_replicas, referee=args.referee).run()
        review_only.append(
            {
                "attack": attack,
                "attacker_fraction": 0.2,
                "detection_rate": r["detection_rate"],
                "honest_flagged": r["honest_flagged"],
                "accuracy_drop_points": round(100 * (clean["accuracy"] - r["accuracy"]), 2),
            }
        )
        print(
            "review only:",
            json.dumps(review_only[-1]),
            f"({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    at20 = [r for r in rows if r["attacker_fraction"] == 0.2]
    summary = {
        "min_detection_rate_at_20": min(
            (r["detection_rate"] for r in at20 if r["detection_rate"] is not None), default=None
        ),
        "honest_flagged_at_20": sum(r["honest_flagged"] for r in at20),
        "max_accuracy_drop_points_at_20": max(
            (r["accuracy_drop_points"] for r in at20), default=None
        ),
        "max_replication_overhead_trusted_at_20": max(
            (
                r["replication_overhead_trusted"]
                for r in at20
                if r["replication_overhead_trusted"] is not None
            ),
            default=None,
        ),
    }
    summary["max_verification_cost_fraction_at_20"] = max(
        (r["verification_cost_fraction"] for r in at20), default=None)
    result = {
        "bench": "robustness",
        "referee": args.referee,
        "mode": "in-process: the hub's round policy (gpuflex.hub.policy.round_policy.decide_shard, judge_round),"
        " aggregate and ServerOptimizer in the order RoundEngine calls them, real node training",
        "machine": {
            "cpu": platform.machine(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "threads": 1,
            "python": platform.python_version(),
            "loadavg_at_end": list(os.getloadavg()),
        },
        "config": {
            "nodes": N_NODES,
            "rounds": rounds,
            "chunks_per_shard": CHUNKS_PER_SHARD,
            "chunk_size": 64,
            "train": "SGD lr 0.05 momentum 0.9 batch 32, 1 local epoch",
            "aggregation": "fedavg",
            "aggregation_spec": dataclasses.asdict(AGG),
            "verification": dataclasses.asdict(VSPEC),
            "max_issues_per_shard": MAX_ISSUES,
        },
        "clean": {
            "accuracy": round(clean["accuracy"], 4),
            "replication_overhead": round(clean["replication_overhead"], 4),
            "replication_overhead_trusted": clean["replication_overhead_trusted"],
            "trusted_from_round": clean["trusted_from_round"],
            "honest_flagged": clean["honest_flagged"],
            "dropped_shards": clean["dropped_shards"],
        },
        "targets_at_20": {
            "detection_rate": ">= 0.99",
            "honest_flagged": 0,
            "accuracy_drop_points": "<= 1",
            "replication_overhead_trusted": "< 0.15",
        },
        "summary": summary,
        "rows": rows,
        "review_only_at_20": review_only,
        "elapsed_s": round(time.perf_counter() - t0, 1),
    }
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary), f"elapsed {result['elapsed_s']} s")


if __name__ == "__main__":
    main()
