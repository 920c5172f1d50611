"""Heterogeneity: honest nodes in numerically different classes, attackers in every class.

Built on bench/robustness.py's Simulation (the hub's own round policy, decide_shard with the
referee's inputs, judge_segment on a Referee decision, judge_round, aggregate, in the order
the round engine calls them; real training with the node's trainer and checkpoint recorder).
Here every node has a numeric class, applied around its training: fp32 with 1 thread and
oneDNN on, fp32 with oneDNN off, bf16 autocast (claimed in its commitment, so the referee
re-executes in bf16). Replicas land on nodes of any class, so honest cross-class replicas meet
and disagree beyond the strict tolerance: the referee must settle them with no flag.

Figures (``figures``): cross_class_pairs (honest replica pairs of different classes that were
compared), honest_flagged, detection_rate (over every attack and class), replication overhead
once honest nodes are trusted, verification_cost_fraction (re-executed steps / trained steps),
per-class final accuracy against an all-fp32 clean run, colluder_inclusion_rate (colluding
attack at 30 % of identities: crafted updates aggregated / submitted).

A reduced run of the issue's bench (14, Bench): the digits MLP, the digits CNN and a model with
an Embedding and a LayerNorm on generated token sequences, default 10 rounds x 2 local epochs
(the issue asks 30 x 5), on this 2-core CPU.

Run: .venv/bin/python bench/heterogeneity.py [--rounds N] [--epochs E] [--jobs mlp,cnn,seq]
-> bench/results/heterogeneity.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import robustness as rb  # noqa: E402
from gpuflex.protocol.modelspec import ModelSpec  # noqa: E402

from tests.tooling import attacks as atk  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "heterogeneity.json"
CLASSES = {  # name -> (precision, threads, oneDNN)
    "fp32": ("fp32", 1, True),
    "fp32-nodnn": ("fp32", 1, False),
    "bf16": ("bf16", 1, True),
}


@contextlib.contextmanager
def numeric_class(name: str) -> Iterator[str]:
    precision, threads, onednn = CLASSES[name]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.backends.mkldnn.flags(enabled=onednn):
            yield precision
    finally:
        torch.set_num_threads(before)


def train_in_class(klass: str, spec: Any, state: dict, chunks: list, cfg: Any, seed: int) -> tuple[Any, dict]:
    import math

    from gpuflex.node.trainer import train_assignment
    from gpuflex.protocol.checkpoint import auto_every

    n = sum(int(c["x"].shape[0]) for c in chunks)
    total = math.ceil(n / cfg.batch_size) * cfg.local_epochs
    with numeric_class(klass) as precision:
        rec = rb._Keeper(total_steps=total, every=auto_every(total, cfg.checkpoint_every), precision=precision)
        res = train_assignment(spec, state, chunks, dataclasses.replace(cfg, precision=precision), seed,
                               device=torch.device("cpu"), on_step=rec)
    return dataclasses.replace(res, commitment=rec.commitment()), rec.states


class HeteroSimulation(rb.Simulation):
    """robustness.Simulation with a numeric class per node (round-robin, attackers included)."""

    def __init__(self, *args: Any, classes: list[str] | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        names = classes or list(CLASSES)
        self.klass = {nid: names[i % len(names)] for i, nid in enumerate(sorted(self.nodes))}
        self._current = names[0]
        self.stats["cross_class_pairs"] = 0
        self.stats["cross_class_flagged"] = 0
        self.stats["cross_class_disagreements"] = 0  # beyond the strict tolerance: the referee's work

    def _honest(self, cache: dict, state: dict, key: Any, chunks: list, seed: int) -> Any:
        ck = (self._current, key)
        if ck not in cache:
            cache[ck] = train_in_class(self._current, self.w["spec"], state, chunks, self.w["cfg"], seed)
        return cache[ck]

    def work(self, node: rb.Node, uid: str, key: Any, chunks: list, seed: int, state: dict, cache: dict) -> Any:
        self._current = self.klass[node.node_id]
        return super().work(node, uid, key, chunks, seed, state, cache)

    def settle_shard(self, group: list, wanted: int, active: list, issue: Any) -> Any:
        decision, group = super().settle_shard(group, wanted, active, issue)
        honest = [g for g in group if not g.malicious and self.nodes[g.rec.node_id].attack is None]
        flagged = {f.update_id for f in decision.flags}
        for a, b in itertools.combinations(honest, 2):
            if self.klass[a.rec.node_id] != self.klass[b.rec.node_id]:
                self.stats["cross_class_pairs"] += 1
                da, db = a.rec.delta, b.rec.delta
                num = sum(float(torch.linalg.vector_norm(da[k] - db[k])) ** 2 for k in da)
                den = sum(float(torch.linalg.vector_norm(da[k])) ** 2 for k in da)
                self.stats["cross_class_disagreements"] += num > (self.vspec.tolerance ** 2) * den
                self.stats["cross_class_flagged"] += (a.rec.update_id in flagged) + (b.rec.update_id in flagged)
        return decision, group

    def run(self) -> dict[str, Any]:
        out = super().run()
        out["cross_class_pairs"] = self.stats["cross_class_pairs"]
        out["cross_class_flagged"] = self.stats["cross_class_flagged"]
        out["cross_class_disagreements"] = self.stats["cross_class_disagreements"]
        return out


def make_world(job: str, epochs: int) -> dict[str, Any]:
    w = rb.make_world()
    w["cfg"] = atk.train_config(local_epochs=epochs)
    if job == "seq":  # an Embedding and a LayerNorm on generated token sequences (class = first token % 3)
        vocab, seq, classes = 40, 6, 3
        w["spec"] = ModelSpec.from_dict({"kind": "sequential", "input_shape": [seq], "outputs": classes, "layers": [
            {"type": "Embedding", "num_embeddings": vocab, "embedding_dim": 16},
            {"type": "LayerNorm", "normalized_shape": [16]},
            {"type": "Flatten"},
            {"type": "Linear", "in_features": seq * 16, "out_features": 32},
            {"type": "ReLU"},
            {"type": "Linear", "in_features": 32, "out_features": classes}]})
        gen = torch.Generator().manual_seed(0)
        x = torch.randint(0, vocab, (1440, seq), generator=gen)
        xv = torch.randint(0, vocab, (360, seq), generator=gen)
        w["chunks"] = atk.make_chunks(x, x[:, 0] % classes, split="stratified")
        w["xva"], w["yva"] = xv, xv[:, 0] % classes
        w["state0"] = atk.initial_state(w["spec"])
    if job == "cnn":
        w["spec"] = ModelSpec.from_dict({"kind": "cnn", "image": [1, 8, 8], "channels": [16, 32], "hidden": [64],
                                         "outputs": 10})
        w["chunks"] = [{"x": c["x"].reshape(-1, 1, 8, 8), "y": c["y"]} for c in w["chunks"]]
        w["xva"] = w["xva"].reshape(-1, 1, 8, 8)
        w["state0"] = atk.initial_state(w["spec"])
    return w


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--jobs", default="mlp,cnn,seq")
    ap.add_argument("--attacks", default=",".join(atk.ATTACKS))
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    t0 = time.perf_counter()
    jobs: dict[str, Any] = {}
    totals = {"cross_class_pairs": 0, "cross_class_disagreements": 0, "honest_flagged": 0, "malicious": 0, "caught": 0, "steps_replayed": 0,
              "steps_trained": 0}
    overheads: list[float] = []
    accuracy_gap: dict[str, float] = {}
    colluders: dict[str, float] = {}
    for job in args.jobs.split(","):
        world = make_world(job, args.epochs)
        per_class = {}
        for klass in CLASSES:  # a clean run with every node in one class: the class's own accuracy
            per_class[klass] = HeteroSimulation(world, None, 0, args.rounds, classes=[klass]).run()["accuracy"]
        mixed = HeteroSimulation(world, None, 0, args.rounds)
        clean = mixed.run()
        rows = [{"attack": None, **{k: clean[k] for k in ("accuracy", "honest_flagged", "cross_class_pairs",
                                                             "cross_class_flagged", "verification_cost_fraction",
                                                             "replication_overhead_trusted")}}]
        runs = [mixed]
        for attack in args.attacks.split(","):
            for fraction in ((0.2, 0.3) if attack == "colluding" else (0.2,)):
                sim = HeteroSimulation(world, attack, rb.n_attackers(attack, fraction), args.rounds)
                r = sim.run()
                runs.append(sim)
                rows.append({"attack": attack, "attacker_fraction": fraction,
                             **{k: r[k] for k in ("accuracy", "detection_rate", "honest_flagged", "cross_class_pairs",
                                                  "cross_class_disagreements",
                                                  "cross_class_flagged", "verification_cost_fraction",
                                                  "replication_overhead_trusted", "malicious_updates")}})
                if attack == "colluding" and fraction == 0.3:
                    s = sim.stats
                    colluders[job] = (s["malicious"] - s["caught"]) / max(s["malicious"], 1)
                print(job, json.dumps(rows[-1]), f"({time.perf_counter() - t0:.0f} s)", flush=True)
        for sim in runs:
            s = sim.stats
            totals["cross_class_pairs"] += s["cross_class_pairs"]
            totals["cross_class_disagreements"] += s["cross_class_disagreements"]
            totals["honest_flagged"] += s["honest_flagged"]
            totals["malicious"] += s["malicious"]
            totals["caught"] += s["caught"]
            totals["steps_replayed"] += s["steps_replayed"]
            totals["steps_trained"] += s["steps_trained"]
            if s["shards_trusted"]:
                overheads.append((s["trainings_trusted"] - s["shards_trusted"]) / s["shards_trusted"])
        for klass, acc in per_class.items():
            accuracy_gap[f"{job}/{klass}"] = round(100 * (acc - per_class["fp32"]), 2)
        jobs[job] = {"per_class_clean_accuracy": per_class, "rows": rows}
    figures = {
        "cross_class_pairs": totals["cross_class_pairs"],
        "cross_class_disagreements": totals["cross_class_disagreements"],
        "honest_flagged": totals["honest_flagged"],
        "detection_rate": totals["caught"] / max(totals["malicious"], 1),
        "replication_overhead_steady": max(overheads) if overheads else None,
        "verification_cost_fraction": totals["steps_replayed"] / max(totals["steps_trained"], 1),
        "accuracy_vs_fp32_points": accuracy_gap,
        "colluder_inclusion_rate": max(colluders.values()) if colluders else None,
    }
    result = {
        "bench": "heterogeneity",
        "mode": "in-process, bench/robustness.py's Simulation (the hub's round policy with the referee) with a"
                " numeric class per node",
        "classes": {k: dict(zip(("precision", "threads", "onednn"), v, strict=True)) for k, v in CLASSES.items()},
        "rounds": args.rounds, "local_epochs": args.epochs, "nodes": rb.N_NODES,
        "machine": {"cpu": platform.machine(), "torch": torch.__version__},
        "targets": {"cross_class_pairs": ">= 1000", "honest_flagged": 0, "detection_rate": ">= 0.99",
                    "replication_overhead_steady": "< 0.15", "verification_cost_fraction": "<= 0.10",
                    "accuracy_vs_fp32_points": "within 1", "colluder_inclusion_rate": "<= 0.01"},
        "figures": figures,
        "jobs": jobs,
        "elapsed_s": round(time.perf_counter() - t0, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(figures), f"elapsed {result['elapsed_s']} s")


if __name__ == "__main__":
    main()
