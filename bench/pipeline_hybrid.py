"""Hybrid data + pipeline parallelism on real processes: several pipelines sharing each step.

A real `gpuflex-hub serve` and real `gpuflex-node run` processes (gpuflex.hub.ops.localcluster),
one thread each, train the 4-block byte-level transformer on the Python standard library's own
sources, cut into 2 stages, through the hub's relay. Three jobs of the same model, data and
steps, one after another, on one hub, in one run:

1. **one pipeline** (`pipelines = 1`) on 2 nodes: the baseline;
2. **two pipelines** (`pipelines = 2`) on 4 nodes: each pipeline runs half of every step's
   micro-batches, and each stage sums its units' gradients with the other pipeline's same stage
   (relay messages of kind "replica") before its optimizer steps;
3. **auto** (`pipelines = 0`) on the same 4 nodes: what the planner chooses by itself;
4. **kill**: `pipelines = 2` on the 4 nodes with a spare online; once a step is committed, kill -9
   of the node of the second pipeline's first stage (``stall_s``: the kill to the first step of
   the new generation; the hub runs `--stage-timeout 8`).

Figures: each run's samples per second (the step's samples over the mean step time its stages
reported; each stage's mean step and compute time, the rest being waits on other stages and
the gradient exchange), the ratio of two pipelines to one, the planner's predicted step beside the measured
one, and the largest relative difference between the final models of runs 1 and 2 (the same
steps over the same micro-batches: it must be rounding only, <= 1e-5). On this 2-core machine
the four node processes share 2 cores, so the ratio is bounded by the cores, not by the design.

    python bench/pipeline_hybrid.py [--steps 16] [--out bench/results/pipeline_hybrid.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpuflex.hub.ops.localcluster import LocalCluster  # noqa: E402

from bench.pipeline_recovery import _generation, _rows, _stepped, final_loss, max_rel_diff  # noqa: E402
from tests.tooling.text import stdlib_text, transformer_pipeline_spec  # noqa: E402

BATCH, MICRO, EVERY = 16, 8, 4
CAP = "12MB"
TEXT_BYTES = 24_000


def spec_for(pipelines: int, steps: int) -> str:
    return transformer_pipeline_spec(
        f"stdlib-hybrid-{pipelines}",
        batch=BATCH,
        micro=MICRO,
        steps=steps,
        every=EVERY,
        stages=2,
        tail=f"pipelines = {pipelines}\n",
    )


class Owner:
    """The job owner: submits specs and reads the job documents."""

    def __init__(self, cluster: LocalCluster, work: Path) -> None:
        self.cluster = cluster
        self.work = work
        self.token = cluster.create_token("owner", "bench")
        self.corpus = work / "corpus.txt"
        self.corpus.write_bytes(stdlib_text(TEXT_BYTES))

    def submit(self, spec: str) -> str:
        path = self.work / f"spec-{time.monotonic_ns()}.toml"
        path.write_text(spec)
        argv = [
            sys.executable, "-m", "gpuflex.hub", "job", "submit", str(path),
            "--train", str(self.corpus), "--hub", self.cluster.url, "--token", self.token, "--json",
        ]  # fmt: skip
        out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=str(ROOT))
        return str(json.loads(out.stdout)["id"])

    def job(self, job_id: str) -> dict[str, Any]:
        req = urllib.request.Request(
            f"{self.cluster.url}/v1/jobs/{job_id}",
            headers={"Authorization": f"Bearer {self.token}"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            return dict(json.loads(r.read()))

    def run(self, spec: str, timeout_s: float = 900.0) -> dict[str, Any]:
        """Submit ``spec``, wait for the job to end; its generation, step times and model."""
        started = time.monotonic()
        job_id = self.submit(spec)
        give_up = started + timeout_s
        while (doc := self.job(job_id))["state"] not in ("done", "failed", "cancelled"):
            if time.monotonic() > give_up:
                raise SystemExit(f"waited {timeout_s:g} s for job {job_id}: {doc.get('pipeline')}")
            time.sleep(0.2)
        if doc["state"] != "done":
            raise SystemExit(f"job {job_id} ended {doc['state']}: {doc.get('error')}")
        gens = doc["pipeline"]["generations"]
        loss, tensors = final_loss(self.cluster.hub_dir, job_id)
        stages = _rows(
            self.cluster.hub_dir,
            "SELECT stage, AVG(step_s), AVG(compute_s) FROM stage_reports WHERE job_id = ?"
            " AND steps_done > 1 GROUP BY stage ORDER BY stage",
            job_id,
        )
        step_s = gens[-1]["measured_step_s"]
        return {
            "job": job_id,
            "wall_s": round(time.monotonic() - started, 1),
            "generations": len(gens),
            "pipelines": gens[-1]["pipelines"],
            "stages_per_pipeline": gens[-1]["stages"],
            "predicted_step_s": gens[-1]["predicted_step_s"],
            "measured_step_s": step_s,
            "samples_per_s": round(BATCH / step_s, 2) if step_s else None,
            "final_loss": loss,
            "stage_step_and_compute_s": [
                [stage, round(step, 4), round(compute, 4)] for stage, step, compute in stages
            ],
            "tensors": tensors,
        }


def start_nodes(cluster: LocalCluster, names: list[str]) -> None:
    procs = [cluster.start_node(n, extra=("--max-memory", CAP)) for n in names]
    cluster.wait_registered(procs)
    time.sleep(6.0)  # every node has polled since: the hub counts it as asking for work


def run_kill(cluster: LocalCluster, owner: Owner, steps: int) -> dict[str, Any]:
    """Two pipelines and a spare node online; once a step is committed, kill -9 of the node of
    the second pipeline's first stage. ``stall_s``: the kill to the first step done by the new
    generation (the hub notices the silence after --stage-timeout, re-plans on the survivors and
    the spare, which fetches the lost units' committed state)."""
    start_nodes(cluster, ["spare"])
    job_id = owner.submit(spec_for(2, steps))
    give_up = time.monotonic() + 600
    while True:
        doc = owner.job(job_id)
        g = _generation(doc)
        if doc["pipeline"]["committed_step"] >= EVERY and g and g.get("pipelines") == 2:
            break
        if time.monotonic() > give_up:
            raise SystemExit(f"no committed step with two pipelines: {doc.get('pipeline')}")
        time.sleep(0.1)
    committed = doc["pipeline"]["committed_step"]
    victim = g["stages"][g["stages"].__len__() // 2]["node_id"]
    (proc,) = [n for n in cluster.nodes() if n.node_id == victim]
    killed = time.monotonic()
    proc.signal(signal.SIGKILL)
    while not _stepped(doc := owner.job(job_id), g["number"]):
        if time.monotonic() > give_up:
            raise SystemExit(f"no step after the kill: {doc.get('pipeline')}")
        time.sleep(0.05)
    stall = time.monotonic() - killed
    after = _generation(doc)
    while (doc := owner.job(job_id))["state"] != "done":
        if time.monotonic() > give_up:
            raise SystemExit(f"the job did not end: {doc.get('pipeline')}")
        time.sleep(0.2)
    loss, tensors = final_loss(cluster.hub_dir, job_id)
    return {
        "job": job_id,
        "killed_after_committed_step": committed,
        "resumed_from_step": after["first_step"],
        "pipelines_after": after.get("pipelines", 1),
        "reason": after["reason"],
        "stall_s": round(stall, 2),
        "final_loss": loss,
        "tensors": tensors,
    }


def measure(steps: int, work: Path, stage_timeout_s: float) -> dict[str, Any]:
    hub_args = (
        "--long-poll-max",
        "2",
        "--min-deadline",
        "4",
        "--stage-timeout",
        f"{stage_timeout_s:g}",
    )
    with LocalCluster(workdir=work, hub_args=hub_args) as cluster:
        cluster.start_hub()
        owner = Owner(cluster, work)
        start_nodes(cluster, ["a", "b"])
        one = owner.run(spec_for(1, steps))
        start_nodes(cluster, ["c", "d"])
        two = owner.run(spec_for(2, steps))
        auto = owner.run(spec_for(0, steps))
        kill = run_kill(cluster, owner, steps)
    kill["final_model_max_rel_diff_vs_uninterrupted"] = max_rel_diff(
        kill.pop("tensors"), two["tensors"]
    )
    diff = max_rel_diff(two.pop("tensors"), one.pop("tensors"))
    auto.pop("tensors")
    return {
        "one_pipeline": one,
        "two_pipelines": two,
        "auto": auto,
        "kill": kill,
        "max_rel_diff": diff,
    }


def report(result: dict[str, Any]) -> list[str]:
    runs, f = result["runs"], result["figures"]
    lines = [
        f"{'run':<14} {'nodes':>5} {'pipelines':>9} {'predicted step':>14} {'measured step':>13}"
        f" {'samples/s':>10} {'final loss':>10}"
    ]
    for name, nodes in (("one_pipeline", 2), ("two_pipelines", 4), ("auto", 4)):
        r = runs[name]
        lines.append(
            f"{name:<14} {nodes:>5} {r['pipelines']:>9} {r['predicted_step_s']:>13.3f}s"
            f" {r['measured_step_s']:>12.3f}s {r['samples_per_s']:>10} {r['final_loss']:>10.4f}"
        )
    lines += [
        "",
        f"{'figure':<48} {'value':>10} {'target':>8}",
        f"{'two pipelines / one, samples per second':<48}"
        f" {result['ratios']['hybrid_vs_one_pipeline_throughput']:>10} {'':>8}",
        f"{'final model, two pipelines vs one (max rel diff)':<48}"
        f" {f['equivalence_max_rel_diff']:>10.2e} {'<= 1e-5':>8}",
        f"{'pipelines the planner chose on its own (auto)':<48} {f['auto_pipelines']:>10} {'':>8}",
        f"{'kill -9 of a second-pipeline node: stall s':<48}"
        f" {f['stall_s_after_replica_kill']:>10} {'<= 10':>8}",
        f"{'  pipelines after it (a spare online)':<48} {f['pipelines_after_kill']:>10} {'':>8}",
        f"{'  final model vs uninterrupted (max rel diff)':<48}"
        f" {f['final_model_after_kill_max_rel_diff']:>10.2e} {'':>8}",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--stage-timeout", type=float, default=8.0, metavar="S")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "pipeline_hybrid.json"))
    args = parser.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpuflex-pipeline-hybrid-") as tmp:
        measured = measure(args.steps, Path(tmp), args.stage_timeout)
    runs = {k: measured[k] for k in ("one_pipeline", "two_pipelines", "auto")}
    one, two = runs["one_pipeline"], runs["two_pipelines"]
    kill = measured["kill"]
    result: dict[str, Any] = {
        "name": "pipeline_hybrid",
        "figures": {
            "stall_s_after_replica_kill": kill["stall_s"],
            "stage_timeout_s": args.stage_timeout,
            "pipelines_after_kill": kill["pipelines_after"],
            "final_model_after_kill_max_rel_diff": kill[
                "final_model_max_rel_diff_vs_uninterrupted"
            ],
            "equivalence_max_rel_diff": measured["max_rel_diff"],
            "auto_pipelines": runs["auto"]["pipelines"],
            "predicted_vs_measured_step": {
                k: round(r["predicted_step_s"] / r["measured_step_s"], 3) for k, r in runs.items()
            },
        },
        "ratios": {
            "hybrid_vs_one_pipeline_throughput": round(
                two["samples_per_s"] / one["samples_per_s"], 3
            ),
            "hybrid_vs_one_pipeline_predicted": round(
                one["predicted_step_s"] / two["predicted_step_s"], 3
            ),
            "final_loss_hybrid_vs_one": round(two["final_loss"] / one["final_loss"], 5),
        },
        "runs": runs,
        "kill": kill,
        "setup": {
            "spec_two_pipelines": spec_for(2, args.steps),
            "nodes": f"one thread each, --max-memory {CAP}, relay only",
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
            "seconds": round(time.monotonic() - started, 1),
        },
    }
    print("\n".join(report(result)))
    Path(args.out).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
