"""A pipelined job losing and gaining nodes, on real processes: a real `gpuflex-hub serve` and
real `gpuflex-node run` processes (gpuflex.hub.ops.localcluster), a 4-stage transformer trained
on the Python standard library's own sources read from disk, every node capped below the model's
training state (`--max-memory 6MB`).

Three jobs of the same spec, one after another, on one hub, in one run:

1. **uninterrupted**: four nodes, no failure: the baseline model and loss;
2. **leave**: a spare node online; kill -9 of the node of stage 1 once a step is committed.
   ``recovery_s`` is the kill to the pipeline's first completed step in the new generation;
   ``steps_applied_twice`` counts steps inside the committed ranges of two generations (each
   generation counts the steps from its first step up to the next one's, which resumes from
   the committed step); the final model's loss is compared with the uninterrupted one's;
3. **join**: three nodes and a slow one (`gpuflex-node run --compute-share 0.1`: it rests nine
   times as long as each piece of its training took, and offers a tenth of its benchmark) run
   the job; once a step is committed, a fifth node (started with them, paused) resumes asking
   for work, and the hub, which by then measured the slow stage from its step reports, re-plans
   the fifth node in.

After each re-plan, ``resharding_bytes_vs_minimum`` is the unit-state bytes the new
generation's nodes downloaded from the hub (``state_bytes_served``: the hub counts each blob
GET of a unit state a StageAssignment names) over the bytes of the unit states whose node
changed (``state_bytes_moved``), read once the new generation completed a step.

    python bench/pipeline_recovery.py [--stage-timeout 12] [--out bench/results/pipeline_recovery.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpuflex.hub.ops.localcluster import LocalCluster  # noqa: E402
from gpuflex.node.trainer import loss_for  # noqa: E402
from gpuflex.protocol.jobspec import parse_job_spec  # noqa: E402
from gpuflex.protocol.modelspec import build_for_state  # noqa: E402
from gpuflex.protocol.tensors import decode_state  # noqa: E402

from tests.tooling.text import stdlib_text, transformer_pipeline_spec  # noqa: E402

STEPS, EVERY, BATCH, MICRO = 24, 4, 16, 8
SPEC = transformer_pipeline_spec("stdlib-pipeline-recovery", batch=BATCH, micro=MICRO, steps=STEPS, every=EVERY)
CAP = "6MB"
TEXT_BYTES = 24_000
#: how long the hub counts a node as asking for work after its last poll (--long-poll-max 2, the
#: nodes' poll interval 5 s, 5 s of grace), and a second
ASK_WINDOW_S = 13.0
#: the slow node's --compute-share
SLOW_SHARE = 0.1


# -- the hub, as its owner sees it --------------------------------------------------------------


class Owner:
    def __init__(self, cluster: LocalCluster, work: Path) -> None:
        self.cluster = cluster
        self.token = cluster.create_token("owner", "bench")
        self.spec = work / "spec.toml"
        self.spec.write_text(SPEC)
        self.corpus = work / "corpus.txt"
        self.corpus.write_bytes(stdlib_text(TEXT_BYTES))

    def submit(self) -> str:
        argv = [
            sys.executable, "-m", "gpuflex.hub", "job", "submit", str(self.spec),
            "--train", str(self.corpus), "--hub", self.cluster.url, "--token", self.token, "--json",
        ]  # fmt: skip
        out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=str(ROOT))
        return str(json.loads(out.stdout)["id"])

    def get(self, path: str) -> bytes:
        req = urllib.request.Request(
            f"{self.cluster.url}{path}", headers={"Authorization": f"Bearer {self.token}"}
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            return bytes(r.read())

    def job(self, job_id: str) -> dict[str, Any]:
        return dict(json.loads(self.get(f"/v1/jobs/{job_id}")))

    def wait(
        self, job_id: str, what: str, test: Callable[[dict[str, Any]], Any], timeout_s: float
    ) -> dict[str, Any]:
        give_up = time.monotonic() + timeout_s
        while True:
            doc = self.job(job_id)
            if test(doc):
                return doc
            if time.monotonic() > give_up:
                raise SystemExit(f"waited {timeout_s:g} s for {what}: {doc.get('pipeline')}")
            time.sleep(0.1)


def _generation(doc: dict[str, Any]) -> dict[str, Any]:
    return dict((doc.get("pipeline") or {}).get("generation") or {})


def _stepped(doc: dict[str, Any], after: int) -> bool:
    """The live generation is past ``after`` and has completed a step."""
    g = _generation(doc)
    return bool(g) and g["number"] > after and g["steps_done"] > g["first_step"]


# -- what the hub stored ------------------------------------------------------------------------


def _rows(hub_dir: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(f"{(hub_dir / 'hub.sqlite3').as_uri()}?mode=ro", uri=True)
    try:
        return list(conn.execute(sql, args).fetchall())
    finally:
        conn.close()


def _blob(hub_dir: Path, sha: str) -> bytes:
    path = hub_dir / "blobs" / sha[:2] / sha
    if path.is_file():
        return path.read_bytes()
    conn = sqlite3.connect(f"{(hub_dir / 'blobs' / 'pack.sqlite3').as_uri()}?mode=ro", uri=True)
    try:
        (data,) = conn.execute("SELECT data FROM blobs WHERE sha = ?", (sha,)).fetchone()
        return bytes(data)
    finally:
        conn.close()


def final_loss(hub_dir: Path, job_id: str) -> tuple[float, dict[str, torch.Tensor]]:
    """The job's final model's mean loss on the job's whole text, and its tensors."""
    job = parse_job_spec(SPEC)
    ((model_sha,),) = _rows(
        hub_dir, "SELECT sha FROM models WHERE job_id = ? ORDER BY version DESC LIMIT 1", job_id
    )
    chunks = _rows(hub_dir, "SELECT sha FROM chunks WHERE job_id = ? ORDER BY idx", job_id)
    states = [decode_state(_blob(hub_dir, sha)) for (sha,) in chunks]
    x = torch.cat([s["x"] for s in states])
    y = torch.cat([s["y"] for s in states])
    tensors = {k: v.clone() for k, v in decode_state(_blob(hub_dir, model_sha)).items()}
    model = build_for_state(job.model, tensors).eval()
    with torch.no_grad():
        loss = float(loss_for(job.model, job.train.train_config("fp32"))(model(x), y))
    return loss, tensors


def steps_applied(hub_dir: Path, job_id: str) -> dict[str, int]:
    """Steps inside the committed ranges of two generations (must be 0), and the steps a stage
    ran past the step its generation's successor resumed from (rolled back, redone once)."""
    gens = _rows(
        hub_dir,
        "SELECT generation, first_step, end_step FROM pipeline_generations WHERE job_id = ?"
        " ORDER BY generation",
        job_id,
    )
    ranges = [
        (first, gens[i + 1][1] if i + 1 < len(gens) else end)
        for i, (_, first, end) in enumerate(gens)
    ]
    counted: dict[int, int] = {}
    for first, last in ranges:
        for step in range(first + 1, last + 1):
            counted[step] = counted.get(step, 0) + 1
    redone = 0
    for i, (number, _, _) in enumerate(gens[:-1]):
        ((ran,),) = _rows(
            hub_dir,
            "SELECT COALESCE(MAX(steps_done), 0) FROM stage_reports WHERE job_id = ?"
            " AND generation = ?",
            job_id,
            number,
        )
        redone += max(0, int(ran) - gens[i + 1][1])
    return {
        "steps_applied_twice": sum(1 for n in counted.values() if n > 1),
        "steps_missing": sum(1 for s in range(1, STEPS + 1) if s not in counted),
        "steps_redone": redone,
    }


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in b)


# -- the three runs ------------------------------------------------------------------------------


def start_nodes(cluster: LocalCluster, names: list[str], extra: tuple[str, ...] = ()) -> None:
    procs = [cluster.start_node(n, extra=("--max-memory", CAP, *extra)) for n in names]
    cluster.wait_registered(procs)


def resharding(doc: dict[str, Any]) -> dict[str, Any]:
    g = _generation(doc)
    moved, served = g["state_bytes_moved"], g["state_bytes_served"]
    return {
        "generation": g["number"],
        "reason": g["reason"],
        "state_bytes_moved": moved,
        "state_bytes_served": served,
        "vs_minimum": round(served / moved, 3) if moved else None,
    }


def run_uninterrupted(cluster: LocalCluster, owner: Owner) -> dict[str, Any]:
    start_nodes(cluster, ["a", "b", "c", "d"])
    started = time.monotonic()
    job_id = owner.submit()
    owner.wait(job_id, "the job to end", lambda d: d["state"] == "done", 600)
    p = owner.job(job_id)["pipeline"]
    loss, tensors = final_loss(cluster.hub_dir, job_id)
    return {
        "job": job_id,
        "wall_s": round(time.monotonic() - started, 1),
        "generations": len(p["generations"]),
        "measured_step_s": p["generations"][0]["measured_step_s"],
        "final_loss": loss,
        "tensors": tensors,
    }


def run_leave(cluster: LocalCluster, owner: Owner) -> dict[str, Any]:
    start_nodes(cluster, ["spare"])
    job_id = owner.submit()
    doc = owner.wait(
        job_id,
        "a committed step",
        lambda d: d["pipeline"]["committed_step"] >= EVERY and _generation(d),
        300,
    )
    g = _generation(doc)
    committed = doc["pipeline"]["committed_step"]
    victim = g["stages"][1]["node_id"]
    (proc,) = [n for n in cluster.nodes() if n.node_id == victim]
    if not proc.alive():
        raise SystemExit(f"stage 1's node {proc.name} is not running: see {proc.log}")
    killed = time.monotonic()
    proc.signal(signal.SIGKILL)
    doc = owner.wait(job_id, "a step in a new generation", lambda d: _stepped(d, g["number"]), 300)
    recovery_s = time.monotonic() - killed
    moved = resharding(doc)
    owner.wait(job_id, "the job to end", lambda d: d["state"] == "done", 600)
    loss, tensors = final_loss(cluster.hub_dir, job_id)
    return {
        "job": job_id,
        "killed_stage": 1,
        "killed_after_committed_step": committed,
        "resumed_from_step": _generation(doc)["first_step"],
        "recovery_s": round(recovery_s, 2),
        "resharding": moved,
        **steps_applied(cluster.hub_dir, job_id),
        "final_loss": loss,
        "tensors": tensors,
    }


def node_control(cluster: LocalCluster, name: str, command: str) -> None:
    """``gpuflex-node pause`` or ``resume`` of node ``name`` (its local control endpoint)."""
    (proc,) = [p for p in cluster.nodes() if p.name == name]
    argv = [sys.executable, "-m", "gpuflex.node", command, "--data-dir", str(proc.data_dir)]
    subprocess.run(argv, capture_output=True, check=True, cwd=str(ROOT))


def run_join(cluster: LocalCluster, owner: Owner) -> dict[str, Any]:
    """Three of the four nodes online and a slow one; then a fifth joins: it started with them (a
    process takes seconds to start) and waited paused, asking for nothing."""
    idle = [p for p in cluster.nodes() if p.alive()]
    for proc in idle[3:]:
        proc.signal(signal.SIGTERM)
        proc.popen.wait(30)
    start_nodes(cluster, ["slow"], ("--compute-share", str(SLOW_SHARE)))
    start_nodes(cluster, ["late"])
    node_control(cluster, "late", "pause")
    time.sleep(ASK_WINDOW_S)  # the stopped and the paused node no longer count as asking for work
    job_id = owner.submit()
    doc = owner.wait(
        job_id,
        "a committed step",
        lambda d: d["pipeline"]["committed_step"] >= EVERY and _generation(d),
        300,
    )
    number = _generation(doc)["number"]
    committed = doc["pipeline"]["committed_step"]
    joined = time.monotonic()
    node_control(cluster, "late", "resume")
    doc = owner.wait(job_id, "a step in a new generation", lambda d: _stepped(d, number), 300)
    replan_s = time.monotonic() - joined
    moved = resharding(doc)
    owner.wait(job_id, "the job to end", lambda d: d["state"] == "done", 600)
    loss, tensors = final_loss(cluster.hub_dir, job_id)
    return {
        "job": job_id,
        "joined_after_committed_step": committed,
        "resumed_from_step": _generation(doc)["first_step"],
        "join_to_first_step_s": round(replan_s, 2),
        "resharding": moved,
        **steps_applied(cluster.hub_dir, job_id),
        "final_loss": loss,
        "tensors": tensors,
    }


def measure(stage_timeout_s: float, work: Path, *, join: bool = True) -> dict[str, Any]:
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
        base = run_uninterrupted(cluster, owner)
        leave = run_leave(cluster, owner)
        runs = {"uninterrupted": base, "leave": leave}
        if join:
            runs["join"] = run_join(cluster, owner)
    for name in [n for n in ("leave", "join") if n in runs]:
        runs[name]["final_model_max_rel_diff_vs_uninterrupted"] = max_rel_diff(
            runs[name].pop("tensors"), base["tensors"]
        )
    base.pop("tensors")
    return runs


def figures_of(runs: dict[str, Any], stage_timeout_s: float) -> dict[str, Any]:
    base, leave = runs["uninterrupted"], runs["leave"]
    join = runs.get("join")  # None: not run (--no-join)
    return {
        "recovery_s": leave["recovery_s"],
        "stage_timeout_s": stage_timeout_s,
        "steps_applied_twice": leave["steps_applied_twice"]
        + (join["steps_applied_twice"] if join else 0),
        "steps_redone": leave["steps_redone"] + (join["steps_redone"] if join else 0),
        "final_loss_vs_uninterrupted": round(leave["final_loss"] / base["final_loss"], 5),
        "final_loss_vs_uninterrupted_join": (
            round(join["final_loss"] / base["final_loss"], 5) if join else None
        ),
        "resharding_bytes_vs_minimum": {
            "join": join["resharding"]["vs_minimum"] if join else None,
            "leave": leave["resharding"]["vs_minimum"],
        },
        "join_to_first_step_s": join["join_to_first_step_s"] if join else None,
        "baseline_step_s": base["measured_step_s"],
    }


def report(result: dict[str, Any]) -> list[str]:
    f, runs = result["figures"], result["runs"]
    lines = [
        f"{'figure':<42} {'value':>12} {'target':>10}",
        f"{'recovery_s (kill -9 -> first step)':<42} {f['recovery_s']:>12} {'<= 20':>10}",
        f"{'stage_timeout_s':<42} {f['stage_timeout_s']:>12} {'':>10}",
        f"{'steps_applied_twice':<42} {f['steps_applied_twice']:>12} {'0':>10}",
        f"{'steps_redone (rolled back, counted once)':<42} {f['steps_redone']:>12} {'':>10}",
        f"{'final_loss_vs_uninterrupted (leave)':<42} {f['final_loss_vs_uninterrupted']:>12} {'<= 1.02':>10}",
        f"{'final_loss_vs_uninterrupted (join)':<42} {f['final_loss_vs_uninterrupted_join']!s:>12} {'<= 1.02':>10}",
        f"{'resharding_bytes_vs_minimum (join)':<42} {f['resharding_bytes_vs_minimum']['join']!s:>12} {'<= 1.25':>10}",
        f"{'resharding_bytes_vs_minimum (leave)':<42} {f['resharding_bytes_vs_minimum']['leave']!s:>12} {'<= 1.25':>10}",
        f"{'join -> first step of the new generation s':<42} {f['join_to_first_step_s']!s:>12} {'':>10}",
    ]
    for name in [n for n in ("leave", "join") if n in runs]:
        r = runs[name]["resharding"]
        lines.append(
            f"{name}: generation {r['generation']} ({r['reason']}): {r['state_bytes_served']} bytes"
            f" served / {r['state_bytes_moved']} bytes moved"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage-timeout", type=float, default=12.0, metavar="S")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "pipeline_recovery.json"))
    parser.add_argument(
        "--no-join",
        action="store_true",
        help="leave the join run out (a quicker run: the uninterrupted and the leave runs only)",
    )
    args = parser.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpuflex-pipeline-recovery-") as tmp:
        runs = measure(args.stage_timeout, Path(tmp), join=not args.no_join)
    result: dict[str, Any] = {
        "name": "pipeline_recovery",
        "figures": figures_of(runs, args.stage_timeout),
    }
    base = runs["uninterrupted"]
    result["ratios"] = {
        "final_loss_vs_uninterrupted": result["figures"]["final_loss_vs_uninterrupted"],
        "recovery_s_vs_stage_timeout": round(
            result["figures"]["recovery_s"] / args.stage_timeout, 3
        ),
        "recovery_s_vs_baseline_step_s": round(
            result["figures"]["recovery_s"] / max(base["measured_step_s"] or 1e-9, 1e-9), 1
        ),
    }
    result["runs"] = runs
    result["setup"] = {
        "spec": SPEC,
        "nodes": "one thread each, --max-memory " + CAP,
        "text": f"the first {TEXT_BYTES} bytes of the standard library's sources (tests/tooling/text.py)",
        "slow_node": f"gpuflex-node run --compute-share {SLOW_SHARE}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "wall_s": round(time.monotonic() - started, 1),
    }
    result["table"] = report(result)
    print("\n".join(result["table"]))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
