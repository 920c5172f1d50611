"""Update encodings over home lines: bytes, round time, accuracy and compute utilisation.

1. **Shaped links.** A real hub process and real node processes (hub/ops/localcluster.py), each
   node in its own network namespace behind a line shaped like a home line: ``tc … tbf`` to
   20 Mbit/s up, 100 Mbit/s down, and 30 ms round trip and 0.1% packet loss each way added by a
   packet relay between TUN devices (tests/tooling/netshape.py; this kernel has no netem). The
   same jobs run once per encoding, one after another on the same cluster, in one run, so every
   ratio compares runs on the same machine and links:

   * the digits MLP (64-128-10) and the digits CNN, 2 nodes, a balanced shard each per round;
   * the 25M-parameter MLP (1024-4096-4096-1024-10, 101 MB in fp32) on a synthetic
     1024-feature task, with DiLoCo settings (``big``): ``local_steps`` (500, as DiLoCo) per round, outer
     Nesterov (``server_lr`` 0.7, momentum 0.9, as OpenDiLoCo); once more with
     ``download = "topk"`` (hub/policy/downlink.py: the model's change sparse, so the next model
     downloads as a small delta); and again with a few local steps (``brief``, 10), where moving
     the model is most of a round.

   Per job and encoding: the bytes of an update as the hub received them (job status,
   ``transfer``), the final accuracy and the mean of the last 5 rounds' (the difference to fp32
   is taken on that mean: one round's accuracy on 360 digits moves in steps of 0.28 points), the
   median round time (first round left out: it carries
   the first full model download) and each node's compute utilisation (its training time over
   the round's wall time). The digits jobs run 3 times per encoding (``--repeats``) and the
   figures are the means: which node trains which chunks depends on timing, and one run's
   accuracy moves by about a point. Verification is off in these jobs (replication 0, no spot checks):
   what is measured is the cost of moving updates.

2. **Honest replicas and the attack inside the noise** (in process, the product's encoder and
   the hub's ``relative_distance``): two honest replicas of one shard on one class, with error
   feedback histories of their own, and a replica nudged one quantization step everywhere
   (tests/tooling/attacks.quant_nudge), against each encoding's default allowance
   (protocol/encoding.DEFAULT_TOLERANCE).

Writes bench/results/bandwidth.json (ratios against fp32 measured in the same run).

    python bench/bandwidth.py [--rounds 20] [--big-rounds 4] [--local-steps 200] [--skip-big]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.tooling

import numpy as np  # noqa: E402
import torch  # noqa: E402
from gpuflex.hub.policy.distances import relative_distance  # noqa: E402
from gpuflex.protocol.encoding import DEFAULT_TOLERANCE, UpdateEncoding  # noqa: E402
from gpuflex.protocol.modelspec import ModelSpec  # noqa: E402
from gpuflex.protocol.tensors import encode_state, manifest_of  # noqa: E402

from tests.tooling import attacks as atk  # noqa: E402
from tests.tooling import netshape  # noqa: E402
from tests.tooling.cluster import LocalCluster  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "bandwidth.json"
UP_MBIT, DOWN_MBIT = 20.0, 100.0
#: the home line's round trip (half each way) and packet loss (each way), tests/tooling/netshape.py
RTT_MS, LOSS = 30.0, 0.001
NODES = 2
#: (label, update, topk_fraction, error_feedback, download_fraction: 0 = whole model changes)
DIGITS_ENCODINGS = [("fp32", "fp32", 0.01, False, 0.0), ("fp16", "fp16", 0.01, False, 0.0),
                    ("bf16", "bf16", 0.01, False, 0.0), ("int8", "int8", 0.01, False, 0.0),
                    ("int8+ef", "int8", 0.01, True, 0.0), ("topk5%+ef", "topk", 0.05, True, 0.0),
                    ("topk2%+ef", "topk", 0.02, True, 0.0), ("sign+ef", "sign", 0.01, True, 0.0)]
BIG_ENCODINGS = [("fp32", "fp32", 0.01, False, 0.0), ("int8", "int8", 0.01, False, 0.0),
                 ("topk1%+ef", "topk", 0.01, True, 0.0), ("topk1%+ef+down2%", "topk", 0.01, True, 0.02)]
#: the same model with a few local steps a round: where moving the model is most of a round
BRIEF_ENCODINGS = [BIG_ENCODINGS[0], BIG_ENCODINGS[3]]
CNN = {"kind": "cnn", "image": [1, 8, 8], "channels": [8, 16], "kernel": 3, "pool": "max", "hidden": [32],
       "outputs": 10}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, str):
        return f'"{v}"'
    return json.dumps(v)


def write_job(directory: Path, name: str, rounds: int, local_steps: int) -> tuple[Path, Path, Path]:
    """The job's train/val npz and a spec template ({update} etc. filled per encoding)."""
    directory.mkdir(parents=True, exist_ok=True)
    if name == "big":
        from sklearn.datasets import make_classification

        x, y = make_classification(n_samples=6000, n_features=1024, n_informative=64, n_redundant=0,
                                   n_classes=10, n_clusters_per_class=1, class_sep=2.0, random_state=0)
        x = ((x - x.mean(0)) / x.std(0)).astype(np.float32)
        cut = 5000
        xtr, ytr, xva, yva = x[:cut], y[:cut], x[cut:], y[cut:]
        model = {"kind": "mlp", "input": 1024, "hidden": [4096, 4096, 1024], "outputs": 10}
        train = {"rounds": rounds, "local_steps": local_steps, "batch_size": 32, "lr": 0.02, "momentum": 0.9,
                 "optimizer": "sgd", "seed": 0, "round_target_s": 86_400.0}
        agg = {"server_optimizer": "nesterov", "server_lr": 0.7, "server_momentum": 0.9}
        chunk = 256
    else:
        xtr_t, ytr_t, xva_t, yva_t = atk.digits_data()
        xtr, ytr, xva, yva = (t.numpy() for t in (xtr_t, ytr_t, xva_t, yva_t))
        if name == "cnn":
            xtr, xva = xtr.reshape(-1, 1, 8, 8), xva.reshape(-1, 1, 8, 8)
            model = CNN
        else:
            model = {"kind": "mlp", "input": 64, "hidden": [128], "outputs": 10}
        train = {"rounds": rounds, "local_epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.9,
                 "optimizer": "sgd", "seed": 0, "round_target_s": 3600.0}
        agg = {}
        chunk = 64
    np.savez(directory / "train.npz", x=xtr.astype(np.float32), y=ytr.astype(np.int64))
    np.savez(directory / "val.npz", x=xva.astype(np.float32), y=yva.astype(np.int64))
    sections = {"model": model, "train": train, "aggregation": agg, "data": {"chunk_size": chunk},
                "verification": {"replication": 0.0, "spot_check": 0.0, "spot_check_trusted": 0.0}}
    text = f'[job]\nname = "bandwidth-{name}"\n'
    for sec, kv in sections.items():
        text += f"\n[{sec}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in kv.items())
    (directory / "spec.template").write_text(text)
    return directory / "spec.template", directory / "train.npz", directory / "val.npz"


def run_job(cluster: LocalCluster, token: str, template: Path, train: Path, val: Path,
            enc: tuple[str, str, float, bool, float], timeout_s: float) -> dict[str, Any]:
    label, update, fraction, feedback, down = enc
    spec = template.parent / f"spec-{label}.toml"
    download = f'download = "topk"\ndownload_fraction = {down}\n' if down else ""
    spec.write_text(template.read_text() + f'\n[communication]\nupdate = "{update}"\ntopk_fraction = {fraction}\n'
                    f"error_feedback = {str(feedback).lower()}\n{download}")
    env = dict(os.environ, GPUFLEX_HUB=cluster.url, GPUFLEX_TOKEN=token)
    out = subprocess.run([sys.executable, "-m", "gpuflex.hub", "job", "submit", str(spec), "--train", str(train),
                          "--val", str(val)], env=env, capture_output=True, text=True, timeout=300, check=True)
    job_id = out.stdout.strip().splitlines()[-1]
    doc: dict[str, Any] = cluster.wait_job(job_id, token, timeout_s=timeout_s)
    if doc.get("state") != "done":
        raise RuntimeError(f"{label}: job ended {doc.get('state')}: {doc.get('error')}")
    return doc


def summarise(doc: dict[str, Any]) -> dict[str, Any]:
    hist = sorted(doc["history"], key=lambda h: h["round"])
    per_update = [h["transfer"]["bytes_up"] / h["transfer"]["updates"] for h in hist if h["transfer"]["updates"]]
    later = hist[1:] or hist
    walls = [h["closed_at"] - h["opened_at"] for h in later]
    util: list[float] = []
    for h in later:
        wall = h["closed_at"] - h["opened_at"]
        per_node: dict[str, float] = {}
        for s in h["shards"]:
            for nid in s["nodes"]:
                per_node[nid] = per_node.get(nid, 0.0) + s["train_s"]
        util += [t / wall for t in per_node.values() if wall > 0]
    down = [h["transfer"]["bytes_down"] for h in later if h["transfer"].get("bytes_down") is not None]
    return {"bytes_per_update": statistics.fmean(per_update), "accuracy": hist[-1]["accuracy"],
            # a single round's accuracy on 360 validation samples moves in steps of 0.28 points
            "accuracy_last5": statistics.fmean(h["accuracy"] for h in hist[-5:]),
            "round_s": statistics.median(walls), "utilisation": statistics.fmean(util) if util else None,
            "bytes_down_per_round": statistics.fmean(down) if down else None, "rounds": len(hist),
            "compression_ratio": statistics.fmean(h["transfer"]["compression_ratio"] for h in hist
                                                  if h["transfer"]["compression_ratio"])}


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One job and encoding run several times: the means (round time: the median), and each
    run's accuracy (the digits jobs' accuracy moves by about a point from run to run: which node
    trains which chunks depends on timing)."""
    if len(runs) == 1:
        return runs[0]
    out = {k: statistics.fmean(r[k] for r in runs) for k in ("bytes_per_update", "accuracy", "accuracy_last5",
                                                             "compression_ratio")}
    out["round_s"] = statistics.median(r["round_s"] for r in runs)
    utils = [r["utilisation"] for r in runs if r["utilisation"] is not None]
    out["utilisation"] = statistics.fmean(utils) if utils else None
    downs = [r["bytes_down_per_round"] for r in runs if r["bytes_down_per_round"] is not None]
    out["bytes_down_per_round"] = statistics.fmean(downs) if downs else None
    out["rounds"] = runs[0]["rounds"]
    out["runs_accuracy_last5"] = [round(r["accuracy_last5"], 4) for r in runs]
    return out


def shaped_runs(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    jobs = [("mlp", args.rounds, 0, DIGITS_ENCODINGS), ("cnn", args.rounds, 0, DIGITS_ENCODINGS)]
    if not args.skip_big:
        jobs.append(("big", args.big_rounds, args.local_steps, BIG_ENCODINGS))
        jobs.append(("brief", args.big_rounds, args.brief_steps, BRIEF_ENCODINGS))
    out: dict[str, Any] = {}
    with netshape.HomeLines(NODES, up_mbit=UP_MBIT, down_mbit=DOWN_MBIT, rtt_ms=RTT_MS, loss=LOSS) as lines, \
            LocalCluster(workdir / "cluster", hub_args=["--long-poll-max", "10"], hub_host="0.0.0.0") as cluster:
        cluster.start_hub()
        procs = [cluster.start_node(f"home{i}", prefix=line.prefix(), hub_url=f"http://{line.hub_ip}:{cluster.port}")
                 for i, line in enumerate(lines)]
        cluster.wait_registered(procs, timeout_s=300)
        token = cluster.create_token("owner", "bench")
        for name, rounds, steps, encodings in jobs:
            template, train, val = write_job(workdir / name, "big" if name == "brief" else name, rounds, steps)
            out[name] = {}
            repeats = args.repeats if name in ("mlp", "cnn") else 1
            for enc in encodings:
                t0 = time.perf_counter()
                runs = [summarise(run_job(cluster, token, template, train, val, enc, timeout_s=args.timeout))
                        for _ in range(repeats)]
                out[name][enc[0]] = s = combine(runs)
                print(f"  {name:5} {enc[0]:16} {s['bytes_per_update']:>13,.0f} B  acc {s['accuracy_last5']:.4f}"
                      f" (last 5, {repeats} run{'s' if repeats > 1 else ''})  round {s['round_s']:7.2f} s  "
                      f"util {s['utilisation'] or 0:.2f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return out


def replica_distances() -> dict[str, Any]:
    """Honest same-class replicas with their own feedback histories, and the nudged one."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    xtr, ytr, _, _ = atk.digits_data()
    for job in ("mlp", "cnn"):
        spec = atk.digits_spec() if job == "mlp" else ModelSpec.from_dict(CNN)
        x = xtr if job == "mlp" else xtr.reshape(-1, 1, 8, 8)
        chunks = atk.make_chunks(x, ytr, split="stratified")
        shards = [chunks[i:i + 3] for i in range(0, 21, 3)]
        state, cfg = atk.initial_state(spec), atk.train_config()
        rounds = []
        for r in range(6):
            deltas = [atk.contribute(None, spec, state, sh, cfg, seed=r * 100 + j).delta for j, sh in enumerate(shards)]
            rounds.append(deltas)
            mean = {k: sum(d[k] for d in deltas) / len(deltas) for k in deltas[0]}
            state = atk.apply_delta(state, mean)
        man = manifest_of(rounds[0][0])
        out[job] = {}
        for label, update, fraction, feedback, _down in DIGITS_ENCODINGS:
            enc = UpdateEncoding(update, fraction, feedback)
            ra = rb = None
            honest, nudged = [], []
            for deltas in rounds:
                # node a trained shard 0 and node b shard 1 before; now both replicate shard 2
                ra = enc.encode(deltas[0], ra).residual
                rb = enc.encode(deltas[1], rb).residual
                wa, wb = enc.encode(deltas[2], ra).wire, enc.encode(deltas[2], rb).wire
                da, db = enc.decode(wa, man), enc.decode(wb, man)
                honest.append(relative_distance(da, db)[0])
                bad = enc.decode(atk.quant_nudge(wa, update), man)
                nudged.append(relative_distance(da, bad)[0])
            allowance = DEFAULT_TOLERANCE[(update, feedback)] + 1e-4
            out[job][label] = {"honest_max": max(honest), "nudged_min": min(nudged), "allowance": allowance,
                               "honest_within": max(honest) <= allowance,
                               # fp32 has no quantization step to hide in: nothing to nudge
                               "nudge_caught": None if update == "fp32" else min(nudged) > allowance,
                               "bytes": len(encode_state(enc.encode(rounds[0][2]).wire))}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20, help="rounds of the digits jobs")
    ap.add_argument("--big-rounds", type=int, default=4)
    ap.add_argument("--local-steps", type=int, default=500, help="inner steps of the 25M job (DiLoCo: 500)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each digits job and encoding")
    ap.add_argument("--brief-steps", type=int, default=10, help="local steps of the 25M job's brief rounds")
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument("--timeout", type=float, default=3600.0)
    args = ap.parse_args(argv)
    # a SIGTERM unwinds like Ctrl+C, so the namespaces and processes are removed on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    why = netshape.unavailable()
    if why:
        print(f"bandwidth bench needs network namespaces: {why}", file=sys.stderr)
        return 2
    print("honest replicas and the nudge inside the quantization noise (relative distance)")
    replicas = replica_distances()
    for job, rows in replicas.items():
        for label, r in rows.items():
            print(f"  {job:4} {label:10} honest max {r['honest_max']:.2e}  nudged min {r['nudged_min']:.2e}  "
                  f"allowance {r['allowance']:.1e}  {'ok' if r['honest_within'] else 'HONEST FLAGGED'}  "
                  f"{ {True: 'caught', False: 'not caught by replicas', None: '(no step to nudge)'}[r['nudge_caught']]}")
    print(f"\nshaped home lines: {UP_MBIT:g} Mbit/s up, {DOWN_MBIT:g} Mbit/s down, {RTT_MS:g} ms round trip, "
          f"{LOSS:.1%} loss each way, {NODES} nodes")
    with tempfile.TemporaryDirectory(prefix="gpuflex-bandwidth-") as tmp:
        shaped = shaped_runs(args, Path(tmp))
    ratios: dict[str, Any] = {"bytes_per_round_vs_fp32": {}, "round_time_vs_fp32": {}, "accuracy_points_vs_fp32": {}}
    print(f"\n{'job':5} {'encoding':16} {'bytes/update':>13} {'vs fp32':>8} {'accuracy':>9} {'last 5':>7} "
          f"{'Δ points':>9} {'round s':>8} {'vs fp32':>8} {'util':>5} {'down/round':>12}")
    for job, rows in shaped.items():
        base = rows["fp32"]
        for key in ratios:
            ratios[key][job] = {}
        for label, r in rows.items():
            b = r["bytes_per_update"] / base["bytes_per_update"]
            t = r["round_s"] / base["round_s"]
            d = 100.0 * (r["accuracy_last5"] - base["accuracy_last5"])  # the less noisy of the two
            ratios["bytes_per_round_vs_fp32"][job][label] = round(b, 4)
            ratios["round_time_vs_fp32"][job][label] = round(t, 3)
            ratios["accuracy_points_vs_fp32"][job][label] = round(d, 2)
            print(f"{job:5} {label:16} {r['bytes_per_update']:>13,.0f} {b:>8.4f} {r['accuracy']:>9.4f} "
                  f"{r['accuracy_last5']:>7.4f} {d:>+9.2f} "
                  f"{r['round_s']:>8.2f} {t:>8.3f} {r['utilisation'] or 0:>5.2f} "
                  f"{r['bytes_down_per_round'] or 0:>12,.0f}")
    best = {job: min((ratios["bytes_per_round_vs_fp32"][job][lab], lab) for lab in rows if lab != "fp32")
            for job, rows in shaped.items()}
    figures: dict[str, Any] = {
        "best_encoding": {job: {"encoding": lab, "bytes_vs_fp32": b,
                                "accuracy_points_vs_fp32": ratios["accuracy_points_vs_fp32"][job][lab]}
                          for job, (b, lab) in best.items()},
        "per_job": shaped,
    }
    if "big" in shaped:
        figures["compute_utilisation"] = {lab: r["utilisation"] for lab, r in shaped["big"].items()}
    result = {
        "bench": "bandwidth",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "links": {"up_mbit": UP_MBIT, "down_mbit": DOWN_MBIT, "rtt_ms": RTT_MS, "loss": LOSS,
                              "delay_and_loss": "tests/tooling/packetrelay.py (TUN packet relay)", "nodes": NODES},
                    "big_local_steps": args.local_steps, "brief_local_steps": args.brief_steps,
                    "rounds": args.rounds, "big_rounds": args.big_rounds, "digits_repeats": args.repeats},
        "baseline": "fp32 updates on the same cluster, links and jobs, in the same run",
        "ratios": ratios,
        "figures": figures,
        "replicas": replicas,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
