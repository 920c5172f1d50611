"""Robustness: every attack at 10/20/30 % of nodes on real digits training.

This SIMULATES the hub's round loop in-process (no HTTP, no DB), calling exactly
the verification functions the hub calls (gpuflex.hub.verification:
should_replicate, replica_candidates, compare_replicas, review_round,
record_agreement/record_flag/record_verdict; gpuflex.hub.aggregation.aggregate)
and the node's real trainer (gpuflex.node.trainer.train_assignment, through
tests/tooling/attacks.contribute). Each "node" is a reputation + an optional
attack from the catalogue; training is real and deterministic.

Round loop (per round): the training set (digits, 80 %, stratified 64-sample
chunks) is shuffled and cut into shards of 2 chunks; shard j goes to a random
active node. A shard is replicated when ``should_replicate`` says so (adaptive:
new nodes always, trusted ones with p = max(0.05, 1/run)); replicas go to
``replica_candidates`` (trusted nodes first) until ``compare_replicas`` settles
the group. The agreed canonical update of each group plus unreplicated updates
go through ``review_round``; flagged ones are quarantined, the rest are
FedAvg-aggregated. Policy the hub should mirror: if review flags a group's
canonical update, every majority member vouched for it and is flagged too, and
the group's replica_mismatch flags on the minority are withdrawn (the minority
was right). An auditor is simulated with ground truth: flags on malicious
updates are confirmed (3 confirmed -> banned), others dismissed.

Metrics per (attack, fraction):
- detection_rate: malicious updates flagged or outvoted (not aggregated) /
  malicious updates submitted (stale replay's first, honest, update is not malicious);
- honest_flagged: flags that stand on honest nodes' updates (after withdrawal);
- accuracy_drop_points: clean-run accuracy - this run's, in points (same seeds);
- replication_overhead: extra replica trainings / shards, over the whole run and
  over the rounds after every honest node is trusted (``_trusted``).

``review_only_at_20`` repeats 20 % with replication off: what review_round
(outlier / free rider / implausible) catches on its own. Every row of the main
table is caught by replica disagreement first, and the schedule is seeded the
same for every attack, so those rows coincide except for stale replay (whose
first update is honest).

Run: .venv/bin/python bench/robustness.py [--quick] -> bench/results/robustness.json
"""

from __future__ import annotations

import argparse
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
from types import SimpleNamespace
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.tooling

from gpuflex.hub import verification as vf  # noqa: E402
from gpuflex.hub.aggregation import aggregate  # noqa: E402
from gpuflex.protocol.jobspec import VerificationSpec  # noqa: E402

from tests.tooling import attacks as atk  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "robustness.json"
N_NODES = 10
CHUNKS_PER_SHARD = 2
FRACTIONS = (0.1, 0.2, 0.3)
VSPEC = VerificationSpec(cosine_min=-0.3)  # calibrated defaults (hub/verification.py, "Calibration")
AGG = SimpleNamespace(method="fedavg", clip_norm=0.0)


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
    malicious: bool


class Simulation:
    def __init__(
        self,
        world: dict[str, Any],
        attack: str | None,
        n_attackers: int,
        rounds: int,
        seed: int = 0,
        vspec: Any = None,
    ):
        self.w = world
        self.vspec = vspec if vspec is not None else VSPEC
        self.rounds = rounds
        self.seed = seed
        ids = [f"n{i:02d}" for i in range(N_NODES)]
        bad = set(ids[N_NODES - n_attackers :]) if attack else set()
        self.nodes = {n: Node(n, atk.make_attack(attack) if n in bad else None) for n in ids}
        self.stats = {
            "malicious": 0,
            "caught": 0,
            "honest_flagged": 0,
            "shards": 0,
            "replicas": 0,
            "shards_trusted": 0,
            "replicas_trusted": 0,
            "lost_shards": 0,
            "banned": [],
        }
        self.trusted_from: int | None = None

    # ------------------------------------------------------------------ one node's work
    def _honest(self, cache: dict, state: dict, j: int, chunks: list, seed: int) -> Any:
        if j not in cache:
            cache[j] = atk.contribute(None, self.w["spec"], state, chunks, self.w["cfg"], seed)
        return cache[j]

    def work(
        self, node: Node, uid: str, j: int, chunks: list, seed: int, state: dict, cache: dict
    ) -> Work:
        samples = sum(int(c["x"].shape[0]) for c in chunks)
        a = node.attack
        malicious = a is not None
        if a is None:
            res = self._honest(cache, state, j, chunks, seed)
        elif a.name in (
            "label_flip",
            "half_shard",
        ):  # data attacks: their own (deterministic) training
            key = (a.name, j)
            if key not in cache:
                cache[key] = atk.contribute(a, self.w["spec"], state, chunks, self.w["cfg"], seed)
            res = cache[key]
        else:
            res = a.finish(
                self._honest(cache, state, j, chunks, seed), claimed_samples=samples, seed=seed
            )
            if a.name == "stale_replay" and a.state["count"] == 1:
                malicious = False  # its first update is honest (it is what it replays later)
        rec = vf.UpdateRecord(
            update_id=uid,
            node_id=node.node_id,
            shard_id=f"s{j}",
            samples_claimed=res.sample_count,
            shard_samples=samples,
            loss=res.loss,
            train_s=res.train_s,
            node_samples_per_s=0.0,
            delta=res.delta,
        )
        return Work(rec, malicious)

    # ------------------------------------------------------------------ the round loop
    def run(self) -> dict[str, Any]:
        w = self.w
        state = {k: v.clone() for k, v in w["state0"].items()}
        chunks = w["chunks"]
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
            candidates: list[Work] = []
            inconclusive: list[Work] = []
            groups: dict[str, tuple[vf.ReplicaOutcome, list[Work]]] = {}
            flags: dict[str, tuple[vf.Flag, bool]] = {}  # update_id -> (flag, malicious)
            all_work: list[Work] = []
            for j, shard in enumerate(shards):
                sh_chunks = [chunks[c] for c in shard]
                sh_seed = seed_of(self.seed, rnd, j)
                primary = perm[j % len(perm)]
                group = [self.work(primary, f"u{rnd}-{j}-0", j, sh_chunks, sh_seed, state, cache)]
                self.stats["shards"] += 1
                self.stats["shards_trusted"] += trusted_phase
                outcome = None
                if vf.should_replicate(primary.rep, self.vspec, rng):
                    while True:
                        if len(group) >= self.vspec.quorum:
                            trusted = {
                                n.node_id for n in active if vf.is_trusted(n.rep, self.vspec)
                            }
                            outcome = vf.compare_replicas(
                                [g.rec for g in group], self.vspec, trusted=trusted
                            )
                            if not outcome.needs_more:
                                break
                        members = {g.rec.node_id for g in group}
                        pool = vf.replica_candidates(
                            {n.node_id: n.rep for n in active}, members, self.vspec
                        )
                        if not pool:
                            break
                        pick = self.nodes[rng.choice(pool)]
                        group.append(
                            self.work(
                                pick,
                                f"u{rnd}-{j}-{len(group)}",
                                j,
                                sh_chunks,
                                sh_seed,
                                state,
                                cache,
                            )
                        )
                        self.stats["replicas"] += 1
                        self.stats["replicas_trusted"] += trusted_phase
                all_work.extend(group)
                if outcome is None:  # not replicated
                    candidates.append(group[0])
                    continue
                if outcome.needs_more:  # no replica to be had: use it unverified only if undisputed
                    if all(p["agree"] for p in outcome.evidence.get("pairs", [])):
                        candidates.append(group[0])
                    else:
                        self.stats["lost_shards"] += 1
                    continue
                by_id = {g.rec.update_id: g for g in group}
                for f in outcome.flags:
                    flags[f.update_id] = (f, by_id[f.update_id].malicious)
                if outcome.agreed:
                    for u in outcome.majority:  # the hub credits agreement when the group settles
                        n = self.nodes[by_id[u].rec.node_id]
                        n.rep = vf.record_agreement(n.rep)
                    canonical = by_id[outcome.canonical]
                    candidates.append(canonical)
                    groups[outcome.canonical] = (outcome, group)
                else:
                    self.stats["lost_shards"] += 1
                    if not outcome.flags:  # inconclusive: scored, never aggregated
                        inconclusive.extend(group)
            gnorm = math.sqrt(
                sum(float(v.double().pow(2).sum()) for v in state.values() if v.is_floating_point())
            )
            review = vf.review_round(
                [c.rec for c in candidates],
                gnorm,
                self.vspec,
                score_only=[g.rec for g in inconclusive],
            )
            by_uid = {g.rec.update_id: g for g in all_work}
            for f in review.flags:
                flags[f.update_id] = (f, by_uid[f.update_id].malicious)
                if f.update_id in groups:  # the majority vouched for a bad update
                    outcome, group = groups[f.update_id]
                    for u in outcome.majority:
                        if u != f.update_id:
                            g = by_uid[u]
                            flags[u] = (
                                vf.Flag(u, g.rec.node_id, f.reason, {"vouched_for": f.update_id}),
                                g.malicious,
                            )
                    for u in {g.rec.update_id for g in group} - set(outcome.majority):
                        flags.pop(u, None)  # the minority was right: withdraw its mismatch flag
            included = set(review.included)
            for uid in list(
                included
            ):  # an agreed group's majority is aggregated through its canonical
                if uid in groups:
                    included.update(groups[uid][0].majority)
            for g in all_work:
                if g.malicious:
                    self.stats["malicious"] += 1
                    if g.rec.update_id not in included or g.rec.update_id in flags:
                        self.stats["caught"] += 1
                    else:
                        self.stats.setdefault("escaped", []).append(g.rec.update_id)
            for f, malicious in flags.values():
                node = self.nodes[f.node_id]
                node.rep = vf.record_flag(node.rep)
                if not malicious:
                    self.stats["honest_flagged"] += node.attack is None
                # The auditor (ground truth): confirm flags on malicious updates, dismiss the rest.
                node.rep = vf.record_verdict(node.rep, "confirm" if malicious else "dismiss")
                if node.rep.banned and f.node_id not in self.stats["banned"]:
                    self.stats["banned"].append(f.node_id)
            inc = [c for c in candidates if c.rec.update_id in set(review.included)]
            if inc:
                agg = aggregate([c.rec.delta for c in inc], [c.rec.shard_samples for c in inc], AGG)
                state = atk.apply_delta(state, agg)
        acc = atk.accuracy(w["spec"], state, w["xva"], w["yva"])
        s = self.stats
        return {
            "accuracy": acc,
            "malicious_updates": s["malicious"],
            "detection_rate": (s["caught"] / s["malicious"]) if s["malicious"] else None,
            "honest_flagged": s["honest_flagged"],
            "replication_overhead": s["replicas"] / max(s["shards"], 1),
            "replication_overhead_trusted": (s["replicas_trusted"] / s["shards_trusted"])
            if s["shards_trusted"]
            else None,
            "trusted_from_round": self.trusted_from,
            "lost_shards": s["lost_shards"],
            "banned": s["banned"],
            "escaped": s.get("escaped", []),
        }


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
    ap.add_argument("--quick", action="store_true", help="fewer rounds, 20 % only")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--attacks", default=",".join(atk.ATTACKS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    rounds = args.rounds or (6 if args.quick else 15)
    fractions = (0.2,) if args.quick else FRACTIONS
    t0 = time.perf_counter()
    world = make_world()
    clean = Simulation(world, None, 0, rounds).run()
    print(
        f"clean: accuracy {clean['accuracy']:.4f} overhead {clean['replication_overhead']:.3f} "
        f"trusted from round {clean['trusted_from_round']} ({time.perf_counter() - t0:.0f} s)",
        flush=True,
    )
    rows = []
    for attack in args.attacks.split(","):
        for fraction in fractions:
            k = n_attackers(attack, fraction)
            r = Simulation(world, attack, k, rounds).run()
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
                "lost_shards": r["lost_shards"],
                "banned": r["banned"],
                "accuracy": round(r["accuracy"], 4),
            }
            rows.append(row)
            print(json.dumps(row), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    # Second line of defence alone: no replication at all, review_round only (20 %).
    review_only = []
    no_replicas = replace(VSPEC, replication=0.0)
    for attack in args.attacks.split(","):
        k = n_attackers(attack, 0.2)
        r = Simulation(world, attack, k, rounds, vspec=no_replicas).run()
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
    result = {
        "bench": "robustness",
        "mode": "in-process simulation of the hub round loop with the real verification functions and real node training",
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
            "verification": {
                k: getattr(VSPEC, k)
                for k in (
                    "replication",
                    "quorum",
                    "max_replicas",
                    "tolerance",
                    "trust_after",
                    "cosine_min",
                    "norm_ratio_max",
                    "free_rider_norm",
                )
            },
        },
        "clean": {
            "accuracy": round(clean["accuracy"], 4),
            "replication_overhead": round(clean["replication_overhead"], 4),
            "replication_overhead_trusted": clean["replication_overhead_trusted"],
            "trusted_from_round": clean["trusted_from_round"],
            "honest_flagged": clean["honest_flagged"],
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
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary), f"elapsed {result['elapsed_s']} s")


if __name__ == "__main__":
    main()
