"""A node that trains on every device it has (node/devices): memory per device under FSDP,
equivalence with one process, and throughput of 2 workers against 1, in one run.

Every configuration trains the same assignment (a GELU MLP of ``--width`` x ``--layers``, Adam,
``--steps`` steps of ``--batch`` samples, dropout on) through the node's own worker group
(gloo worker processes on the CPU, or NCCL on ``--devices cuda``):

- ``figures.fsdp_peak_bytes_per_device_over_model``: for 2 and 4 FSDP workers, the most training
  state any worker held on its device (its shards of the parameters, their gradients and Adam's
  two moments, measured on the worker's tensors after the first step, when all exist) over the
  whole model's (the same three, in one process). Ideal 1/N.
- ``figures.ddp_fsdp_equivalence_max_rel_diff``: the update's relative difference
  (||update - one process's|| / ||one process's||, over all its tensors), the largest of DDP on 2
  and FSDP on 2 and 4 workers, against one process training the same shard. The workers sum a
  batch's gradient in another order than one matmul does; Adam turns the rounding of an element
  whose gradient is near zero into a whole step of either sign, so the largest difference of one
  element (``figures.elementwise_max_rel_diff``, over its tensor's largest) grows with the steps,
  while the update as a whole stays within rounding. The MLP uses GELU: with ReLU, a
  pre-activation that one order of sums rounds to just above 0 and the other to just below turns
  that sample's whole gradient for the unit on or off (measured with ReLU: one unit of 512 in 60
  steps moved the update by 2.6e-4 on 2 DDP workers, and none on 4).
- ``ratios.node_throughput_2_workers_vs_1``: training samples/s of 2 DDP workers over 1 worker
  (the same worker code, a one-process group), each worker one torch thread: the baseline is
  measured in the same run. Start-up (importing torch in each worker, the rendezvous) is
  reported apart (``figures.worker_start_s``): the node pays it once per assignment.

Usage: python bench/node_devices.py [--width 512] [--layers 3] [--steps 60] [--batch 128]
    [--devices cpu] [--out bench/results/node_devices.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def _workload(args: argparse.Namespace) -> tuple[Any, dict[str, torch.Tensor], list[dict[str, torch.Tensor]], Any]:
    from gpuflex.protocol.messages import TrainConfig
    from gpuflex.protocol.modelspec import ModelSpec, build_model

    spec = ModelSpec.from_dict({"kind": "mlp", "input": args.width, "hidden": [args.width] * args.layers,
                                "outputs": 10, "dropout": 0.1, "activation": "gelu"})
    state = build_model(spec, seed=1).state_dict()
    g = torch.Generator().manual_seed(0)
    n = args.batch * 8
    x, y = torch.randn(n, args.width, generator=g), torch.randint(0, 10, (n,), generator=g)
    chunks = [{"x": x[i : i + 256], "y": y[i : i + 256]} for i in range(0, n, 256)]
    cfg = TrainConfig(local_epochs=1, local_steps=args.steps, batch_size=args.batch, optimizer="adam", lr=1e-3,
                      momentum=0.0, weight_decay=0.0, beta1=0.9, beta2=0.999, loss="cross_entropy", grad_clip=1.0)
    return spec, state, chunks, cfg


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over every floating tensor of the update together."""
    keys = [k for k in b if b[k].is_floating_point()]
    num = sum(float((a[k].double() - b[k].double()).norm() ** 2) for k in keys)
    return (num / max(sum(float(b[k].double().norm() ** 2) for k in keys), 1e-300)) ** 0.5


def _max_elementwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest |a - b| of any element, over the largest |b| of its tensor, of any tensor."""
    return max(float((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp_min(1e-12))
               for k in b if b[k].is_floating_point())


def _run(args: argparse.Namespace, work: Path, workers: int, engine: str) -> dict[str, Any]:
    """One assignment on ``workers`` worker processes: its update, timings and held bytes."""
    from gpuflex.node.devices import WorkerGroup
    from gpuflex.node.devices.plan import DevicePlan

    spec, state, chunks, cfg = _workload(args)
    device = torch.device(args.devices, 0) if args.devices == "cuda" else torch.device("cpu")
    devices = tuple(torch.device("cuda", i) for i in range(workers)) if args.devices == "cuda" else (device,) * workers
    group = WorkerGroup(DevicePlan(devices), work, engine=engine, threads=workers, restarts=0)
    t0 = time.perf_counter()
    result = group.train(spec, state, chunks, cfg, seed=3)
    wall = time.perf_counter() - t0
    samples = cfg.local_steps * cfg.batch_size
    print(f"  {engine} x{workers}: {samples / result.train_s:8.1f} samples/s, train {result.train_s:.2f} s, "
          f"wall {wall:.2f} s, held {group.held_bytes / 2**20:.2f} MiB/device", file=sys.stderr)
    return {"delta": result.delta, "train_s": result.train_s, "wall_s": wall, "held": group.held_bytes,
            "samples_per_s": samples / result.train_s}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from gpuflex.node.trainer import train_assignment

    torch.set_num_threads(1)
    spec, state, chunks, cfg = _workload(args)
    device = torch.device("cuda", 0) if args.devices == "cuda" else torch.device("cpu")
    ref = train_assignment(spec, state, chunks, cfg, seed=3, device=device)
    one_process_s = ref.train_s
    floats = sum(t.numel() for t in state.values() if t.is_floating_point()) * 4
    whole = 4 * floats  # parameters, gradients, Adam's two moments, in one process
    with tempfile.TemporaryDirectory(prefix="gpuflex-bench-devices-") as tmp:
        work = Path(tmp)
        runs = {("ddp", 1): _run(args, work, 1, "ddp"), ("ddp", 2): _run(args, work, 2, "ddp"),
                ("fsdp", 2): _run(args, work, 2, "fsdp"), ("fsdp", 4): _run(args, work, 4, "fsdp")}
    diffs = {f"{e}_{n}": _rel(r["delta"], ref.delta) for (e, n), r in runs.items()}
    elementwise = {f"{e}_{n}": _max_elementwise(r["delta"], ref.delta) for (e, n), r in runs.items()}
    per_device = {str(n): round(runs[("fsdp", n)]["held"] / whole, 4) for n in (2, 4)}
    base, two = runs[("ddp", 1)], runs[("ddp", 2)]
    table = [{"engine": e, "workers": n, "samples_per_s": round(r["samples_per_s"], 1),
              "train_s": round(r["train_s"], 3), "wall_s": round(r["wall_s"], 2),
              "held_bytes_per_device": r["held"], "held_over_model": round(r["held"] / whole, 4),
              "rel_diff_vs_one_process": float(f"{diffs[f'{e}_{n}']:.3g}"),
              "max_elementwise_rel_diff": float(f"{elementwise[f'{e}_{n}']:.3g}")}
             for (e, n), r in runs.items()]
    return {
        "name": "node_devices",
        "figures": {
            "fsdp_peak_bytes_per_device_over_model": per_device,
            "fsdp_bound_1_over_n_plus_0_2": {str(n): round(1 / n + 0.2, 4) for n in (2, 4)},
            "ddp_fsdp_equivalence_max_rel_diff": float(f"{max(diffs.values()):.3g}"),
            "equivalence_by_run": {k: float(f"{v:.3g}") for k, v in diffs.items()},
            "elementwise_max_rel_diff": float(f"{max(elementwise.values()):.3g}"),
            "model_state_bytes": whole,
            "one_process_samples_per_s": round(cfg.local_steps * cfg.batch_size / one_process_s, 1),
            "worker_1_samples_per_s": round(base["samples_per_s"], 1),
            "workers_2_samples_per_s": round(two["samples_per_s"], 1),
            "worker_start_s": round(two["wall_s"] - two["train_s"], 2),
            "width": args.width, "layers": args.layers, "steps": args.steps, "batch": args.batch,
        },
        "ratios": {
            "node_throughput_2_workers_vs_1": round(two["samples_per_s"] / base["samples_per_s"], 3),
            "node_throughput_2_workers_vs_one_process": round(
                two["samples_per_s"] / (cfg.local_steps * cfg.batch_size / one_process_s), 3),
        },
        "table": table,
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, load avg {os.getloadavg()[0]:.1f}, "
                   f"python {platform.python_version()}, torch {torch.__version__}",
        "notes": (f"{args.devices} workers, one torch thread each; GELU MLP, Adam, dropout 0.1, grad clip 1.0; held bytes "
                  "= the largest worker's parameters (or shards) + gradients + optimizer state after step 1, "
                  "over the same in one process; equivalence = ||update - one process's|| / ||one process's|| "
                  "over the whole update, the largest of the three sharded runs; throughput = training loop samples/s (rank 0's clock), "
                  "start-up apart; the ideal 2-vs-1 ratio is 2 only where the machine has 2 idle cores"),
    }


def _print_table(result: dict[str, Any]) -> None:
    print(f"{'engine':<6} {'workers':>7} {'samples/s':>10} {'train s':>8} {'wall s':>7} {'held/model':>10} "
          f"{'rel diff':>9} {'elementwise':>11}")
    for row in result["table"]:
        print(f"{row['engine']:<6} {row['workers']:>7} {row['samples_per_s']:>10} {row['train_s']:>8} "
              f"{row['wall_s']:>7} {row['held_over_model']:>10} {row['rel_diff_vs_one_process']:>9} "
              f"{row['max_elementwise_rel_diff']:>11}")
    print(json.dumps({"figures": {k: v for k, v in result["figures"].items() if k != "equivalence_by_run"},
                      "ratios": result["ratios"]}, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--devices", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "node_devices.json"))
    args = p.parse_args(argv)
    result = measure(args)
    _print_table(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
