"""Silos: one federated job over data that stays on its nodes, on Flower and on GPUFlex (issue 18).

The job (issue 18's bench): scikit-learn digits, stratified 80/20 split with random_state=0,
features / 16; the 80 % split over 10 silos with a Dirichlet(0.5) label split
(tests/tooling/partition.py, flwr-datasets' DirichletPartitioner rule); MLP 64-128-10 ReLU,
SGD lr 0.05 momentum 0.9, batch 32, 1 local epoch, torch 1 thread per process; FedAvg over
every silo (weighted by sample count) for 30 rounds; accuracy on the 20 % test split after each
round, held by the job's owner.

Systems, each as real processes over 127.0.0.1, in one run:
- Flower 1.42's deployment runtime (bench/vs_flower.py's `run_flower`: flower-superlink, one
  flower-supernode per silo, `flwr run bench/flower_app`), each supernode loading its silo;
- GPUFlex: `gpuflex-hub serve` and 10 `gpuflex-node run` processes; the owner submits a
  `[data] source = "node-local"` job with only the test split as its validation set, and each
  node's operator attaches its silo with `gpuflex-node data add` (the hub never gets a row);
- GPUFlex again with secure aggregation (`[privacy] secure_aggregation = true`): the hub learns
  only each round's sum; accuracy against the plain run and the time it adds per round;
- GPUFlex again with central differential privacy (`[privacy] dp = "central"`) at three noise
  multipliers: final accuracy against the job's ε at δ = 1e-5 (the hub's own accountant, read
  from `job status`), as a JSON table and bench/results/silos_dp.png.

The GPUFlex wall time runs from the job's submission to its last round, the 10 `data add` calls
included; Flower's from `flwr run` to its last round (bench/vs_flower.py's convention).

Run (2 cores: Flower's 10 supernodes take about 15-20 min, GPUFlex about 1 min a run):
    .venv/bin/python bench/silos.py [--rounds 30] [--nodes 10] [--alpha 0.5] [--skip-flower] [--skip-dp]
Flower lives in its own venv (bench/.peers/flower-venv): `bench/vs_flower.py --setup-help`.
-> bench/results/silos.json (+ silos_dp.png), and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.tooling
sys.path.insert(0, str(REPO / "bench"))

import vs_flower as vsf  # noqa: E402

from tests.tooling.partition import dirichlet_split  # noqa: E402

RESULTS = REPO / "bench" / "results" / "silos.json"
PLOT = REPO / "bench" / "results" / "silos_dp.png"
TARGETS = {"accuracy_margin": 0.005, "wall_time_vs_flower": 0.1, "secagg_accuracy_margin": 0.005}
DP_DELTA = 1e-5
#: noise multipliers of the privacy curve; the clip is about the size of an honest update here
DP_NOISE = (0.05, 0.2, 1.0)
DP_CLIP = 1.0


def prepare(root: Path, nodes: int, alpha: float, seed: int) -> tuple[Path, list[list[int]]]:
    """train/test .npz as vs_flower's, and ``nodes`` silos of the train split by Dirichlet(alpha)
    over the labels (shard_i.npz: Flower's supernode i and GPUFlex's node i load the same file)."""
    out = root / f"silos-{nodes}-a{alpha}"
    xtr, ytr = vsf.write_split(out)
    hist = []
    for i, idx in enumerate(dirichlet_split(ytr, nodes, alpha, seed=seed, min_size=10)):
        np.savez(out / f"shard_{i}.npz", x=xtr[idx], y=ytr[idx])
        hist.append(np.bincount(ytr[idx], minlength=10).tolist())
    return out, hist


def silo_spec(job: vsf.Job, *, noise: float | None, secagg: bool = False) -> str:
    privacy = "" if noise is None else (
        f'\n[privacy]\ndp = "central"\nclip_norm = {DP_CLIP}\nnoise_multiplier = {noise}\ndelta = {DP_DELTA}\n')
    if secagg:
        privacy = "\n[privacy]\nsecure_aggregation = true\n"
    return vsf.job_head(job, f"silos-{job.name}") + f"""
[data]
source = "node-local"
min_samples = 1
max_samples = 100000
quorum = {job.nodes}             # every silo, every round: FedAvg over all nodes, as Flower runs it
round_deadline_s = 600.0

[aggregation]
method = "fedavg"
{privacy}"""


def run_gpuflex_silos(job: vsf.Job, work: Path, base_env: dict[str, str], timeout: float,
                      noise: float | None = None, secagg: bool = False) -> dict[str, Any]:
    label = f"gpuflex-{job.name}" + ("" if noise is None else f"-dp{noise}") + ("-secagg" if secagg else "")
    run_dir = work / label
    run_dir.mkdir(parents=True, exist_ok=True)
    env = dict(base_env)
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    procs = vsf.Tagged(label, env)
    res: dict[str, Any] = {"system": "gpuflex", "mode": "hub+nodes, node-local silos", "job": job.name,
                           "nodes": job.nodes, "rounds": job.rounds, "noise_multiplier": noise,
                           "secure_aggregation": secagg}
    procs.start_monitor()
    try:
        hub_bin, node_bin = vsf.gpuflex_bin("gpuflex-hub"), vsf.gpuflex_bin("gpuflex-node")
        hub_data = run_dir / "hub"
        cp = procs.run([*hub_bin, "token", "create", "--data", str(hub_data), "--role", "owner", "--name", "bench"])
        if cp.returncode != 0 or not cp.stdout.strip():
            raise RuntimeError(f"gpuflex-hub token create failed: {(cp.stdout + cp.stderr)[-400:]}")
        token = cp.stdout.strip().splitlines()[-1].strip()
        bench_cache = work / "node-bench-cache.json"
        if not bench_cache.exists():
            procs.run([*node_bin, "bench", "--bench-cache", str(bench_cache), "--threads", "1", "--device", "cpu",
                       "--json"], timeout=300)
        cache_args = ["--bench-cache", str(bench_cache)] if bench_cache.exists() else []
        hub_log = run_dir / "hub.log"
        procs.popen([*hub_bin, "serve", "--data", str(hub_data), "--host", "127.0.0.1", "--port", "0"], hub_log)
        vsf.wait_for(lambda: (hub_data / "hub.url").exists() and "listening on" in vsf.read_text(hub_log), 120,
                     "gpuflex-hub to listen")
        url = (hub_data / "hub.url").read_text().strip()
        node_logs = [run_dir / f"node{i}.log" for i in range(job.nodes)]
        for i, nlog in enumerate(node_logs):
            # each silo from its own address block (127.0.N.1; Linux routes 127/8 to loopback), as
            # hospitals on their own networks are: the hub's Sybil defences run at their defaults
            procs.popen([*node_bin, "run", "--hub", url, "--data-dir", str(run_dir / f"node{i}"), "--threads", "1",
                         "--device", "cpu", "--source-address", f"127.0.{i + 1}.1", *cache_args], nlog)
        vsf.wait_for(lambda: all('"registered"' in vsf.read_text(p) for p in node_logs), 300,
                     f"{job.nodes} gpuflex nodes to register")
        spec = silo_spec(job, noise=noise, secagg=secagg).encode()
        (run_dir / "job.toml").write_bytes(spec)
        body, ctype = vsf._multipart({
            "spec": ("job.toml", spec, "application/toml"),
            "val": ("val.npz", (job.data_dir / "test.npz").read_bytes(), "application/octet-stream"),
        })
        t_submit = time.time()
        job_id = vsf._http("POST", f"{url}/v1/jobs", token, body, ctype)["id"]
        res["job_id"] = job_id
        adds = [procs.popen([*node_bin, "data", "add", job_id, str(job.data_dir / f"shard_{i}.npz"), "--hub", url,
                             "--data-dir", str(run_dir / f"node{i}")], run_dir / f"data-add{i}.log")
                for i in range(job.nodes)]
        for i, p in enumerate(adds):
            if p.wait(timeout=300) != 0:
                raise RuntimeError(f"data add {i} failed: {vsf.read_text(run_dir / f'data-add{i}.log')[-400:]}")
        res["attach_s"] = time.time() - t_submit
        status: dict[str, Any] = {}
        end = time.time() + timeout
        while time.time() < end:
            status = vsf._http("GET", f"{url}/v1/jobs/{job_id}", token)
            if status.get("state") in ("done", "failed", "cancelled"):
                break
            time.sleep(0.5)
        (run_dir / "job_status.json").write_text(json.dumps(status, indent=1))
        if status.get("state") != "done":
            raise RuntimeError(f"job ended in state {status.get('state')}: {str(status.get('error'))[:400]}")
        hist = status["history"]
        res["wall_s"] = hist[-1]["closed_at"] - t_submit
        res["round_stats"] = vsf.round_stats([h["closed_at"] - h["opened_at"] for h in hist[1:]])
        res["accuracy_curve"] = [h["accuracy"] for h in hist]
        res["final_accuracy"] = hist[-1]["accuracy"]
        res["silos"] = [{"samples": s["samples"], "label_histogram": s["label_histogram"]} for s in status["silos"]]
        res["updates_per_round"] = [len(h["updates"]) for h in hist]
        if noise is not None:
            res["privacy"] = status.get("privacy")
        if secagg:
            res["secure_aggregation"] = [h.get("secure_aggregation") for h in hist]
        res["ok"] = True
    except Exception as exc:  # reported; the benchmark goes on
        res["ok"] = False
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()[-1500:]
        vsf.log(f"{label} FAILED: {res['error']}")
    finally:
        procs.shutdown()
        res.update(procs.monitor.summary())
        res["logs"] = run_dir.name  # the run's folder in the bench's work folder (no machine path in results)
    return res


def plot(curve: list[dict[str, Any]], plain: float | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = sorted((c["epsilon"], c["accuracy"], c["noise_multiplier"]) for c in curve
                 if c.get("epsilon") is not None and c.get("accuracy") is not None)
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=120)
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="central DP (GPUFlex)")
    for eps, acc, z in pts:
        ax.annotate(f"z={z:g}", (eps, acc), textcoords="offset points", xytext=(4, -12), fontsize=8)
    if plain is not None:
        ax.axhline(plain, color="grey", linestyle="--", label="no DP")
    ax.set_xscale("log")
    ax.set_xlabel(f"epsilon after the job (delta = {DP_DELTA:g})")
    ax.set_ylabel("final test accuracy")
    ax.set_title("digits MLP, 10 silos, Dirichlet(0.5)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--nodes", type=int, default=10)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--skip-flower", action="store_true")
    ap.add_argument("--skip-dp", action="store_true")
    ap.add_argument("--skip-secagg", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="gfbench-silos-"))
    data, hist = prepare(work, args.nodes, args.alpha, args.seed)
    job = vsf.Job(name=f"digits-{args.nodes}silos", nodes=args.nodes, rounds=args.rounds, hidden=[128],
                  data_dir=data)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV",)}
    vsf.log(f"silos: {[sum(h) for h in hist]} samples; work dir {work}")
    ours = run_gpuflex_silos(job, work, env, args.timeout)
    vsf.log(f"gpuflex: {ours.get('final_accuracy')} in {ours.get('wall_s')} s")
    masked: dict[str, Any] | None = None
    if not args.skip_secagg:
        masked = run_gpuflex_silos(job, work, env, args.timeout, secagg=True)
        vsf.log(f"gpuflex secure aggregation: {masked.get('final_accuracy')} in {masked.get('wall_s')} s")
    curve: list[dict[str, Any]] = []
    if not args.skip_dp:
        for z in DP_NOISE:
            r = run_gpuflex_silos(job, work, env, args.timeout, noise=z)
            priv = r.get("privacy") or {}
            curve.append({"noise_multiplier": z, "clip_norm": DP_CLIP, "delta": DP_DELTA,
                          "epsilon": priv.get("epsilon"), "accuracy": r.get("final_accuracy"),
                          "wall_s": r.get("wall_s"), "ok": r.get("ok"), "error": r.get("error")})
            vsf.log(f"gpuflex dp z={z}: accuracy {r.get('final_accuracy')} at epsilon {priv.get('epsilon')}")
    theirs: dict[str, Any] | None = None
    if not args.skip_flower:
        missing = vsf.flower_available()
        if missing:
            theirs = {"ok": False, "error": missing}
        else:
            theirs = vsf.run_flower(job, work, "deployment", env, args.timeout)
        vsf.log(f"flower: {theirs.get('final_accuracy')} in {theirs.get('wall_s')} s")
    acc_ours = ours.get("final_accuracy")
    acc_theirs = (theirs or {}).get("final_accuracy")
    figures: dict[str, Any] = {
        "accuracy_ours": acc_ours, "accuracy_flower": acc_theirs,
        "wall_s_ours": ours.get("wall_s"), "wall_s_flower": (theirs or {}).get("wall_s"),
        "round_s_ours": (ours.get("round_stats") or {}).get("mean"),
        "round_s_flower": ((theirs or {}).get("round_stats") or {}).get("mean"),
        "dp_curve": curve,
        "accuracy_secagg": (masked or {}).get("final_accuracy"),
        "round_s_secagg": ((masked or {}).get("round_stats") or {}).get("mean"),
        "wall_s_secagg": (masked or {}).get("wall_s"),
    }
    if masked and masked.get("round_stats") and ours.get("round_stats"):
        figures["secagg_overhead_per_round_s"] = masked["round_stats"]["mean"] - ours["round_stats"]["mean"]
    ratios: dict[str, Any] = {}
    if masked and masked.get("round_stats") and ours.get("round_stats"):
        ratios["secagg_round_time_vs_plain"] = masked["round_stats"]["mean"] / ours["round_stats"]["mean"]
    if ours.get("wall_s") and (theirs or {}).get("wall_s"):
        ratios["wall_time_vs_flower"] = ours["wall_s"] / theirs["wall_s"]  # type: ignore[index]
    acc_masked = (masked or {}).get("final_accuracy")
    verdicts = {
        "secagg_accuracy": {"target": ">= plain - 0.005",
                            "met": None if acc_masked is None or acc_ours is None else acc_masked >= acc_ours - 0.005},
        "accuracy": {"target": f">= flower - {TARGETS['accuracy_margin']}",
                     "met": None if acc_ours is None or acc_theirs is None
                     else acc_ours >= acc_theirs - TARGETS["accuracy_margin"]},
        "wall_time_vs_flower": {"target": f"<= {TARGETS['wall_time_vs_flower']}",
                                "met": None if "wall_time_vs_flower" not in ratios
                                else ratios["wall_time_vs_flower"] <= TARGETS["wall_time_vs_flower"]},
    }
    doc = {
        "bench": "silos", "setup": {"nodes": args.nodes, "rounds": args.rounds, "alpha": args.alpha,
                                    "silo_samples": [sum(h) for h in hist], "silo_label_histograms": hist,
                                    "model": "mlp 64-128-10", "train": "SGD lr 0.05 momentum 0.9 batch 32, 1 epoch"},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "figures": figures, "ratios": ratios, "verdicts": verdicts,
        "runs": {"gpuflex": ours, "flower": theirs, "gpuflex_secagg": masked, "gpuflex_dp": curve},
    }
    if curve and any(c.get("epsilon") is not None for c in curve):
        plot(curve, acc_ours, PLOT)
        doc["plot"] = str(PLOT.relative_to(REPO))
    print()
    print(f"{'system':<28}{'final acc':>10}{'wall s':>10}{'round s':>10}")
    print(f"{'GPUFlex (node-local)':<28}{vsf.fmt(acc_ours, '.4f'):>10}{vsf.fmt(ours.get('wall_s'), '.1f'):>10}"
          f"{vsf.fmt(figures['round_s_ours'], '.2f'):>10}")
    if masked is not None:
        print(f"{'GPUFlex + secure aggregation':<28}{vsf.fmt(acc_masked, '.4f'):>10}"
              f"{vsf.fmt(masked.get('wall_s'), '.1f'):>10}{vsf.fmt(figures['round_s_secagg'], '.2f'):>10}")
    if theirs is not None:
        print(f"{'Flower 1.42 deployment':<28}{vsf.fmt(acc_theirs, '.4f'):>10}"
              f"{vsf.fmt(theirs.get('wall_s'), '.1f'):>10}{vsf.fmt(figures['round_s_flower'], '.2f'):>10}")
    for c in curve:
        print(f"{'GPUFlex DP z=' + format(c['noise_multiplier'], 'g'):<28}{vsf.fmt(c['accuracy'], '.4f'):>10}"
              f"{vsf.fmt(c['wall_s'], '.1f'):>10}   epsilon {vsf.fmt(c['epsilon'], '.3g')}")
    for k, v in ratios.items():
        print(f"{k}: {v:.4f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
