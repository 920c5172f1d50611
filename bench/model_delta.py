"""Model downloads as deltas (protocol/blobdelta.py) against the whole model and plain zlib.

For each job, real FedAvg rounds with the node's own trainer (6 shards a round, the mean of
their updates added to the model), then, between every two consecutive models, in one process:
the bytes of the whole model, of the model deflated by zlib (the obvious baseline), and of the
GFD1 delta the hub serves; the time to make and apply the delta against a memcpy of the model;
and a check that applying it gives the next model bit for bit. Jobs: the digits MLP and CNN, and
a wide MLP (64-2048-2048-10, 4.3M parameters, 17 MB). Prints a table and writes
bench/results/model_delta.json (ratios: model bytes / delta bytes, zlib bytes / delta bytes).

    python bench/model_delta.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.tooling

from gpuflex.node.trainer import train_assignment  # noqa: E402
from gpuflex.protocol.blobdelta import LEVEL, apply_delta, make_delta  # noqa: E402
from gpuflex.protocol.modelspec import ModelSpec  # noqa: E402
from gpuflex.protocol.tensors import encode_state  # noqa: E402

from tests.tooling import attacks as atk  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "model_delta.json"
SHARDS = 6


def job(name: str) -> tuple[ModelSpec, Any, Any]:
    xtr, ytr, _, _ = atk.digits_data()
    if name == "mlp":
        return atk.digits_spec(), xtr, ytr
    if name == "cnn":
        spec = ModelSpec.from_dict({"kind": "cnn", "image": [1, 8, 8], "channels": [8, 16], "kernel": 3,
                                    "pool": "max", "hidden": [32], "outputs": 10})
        return spec, xtr.reshape(-1, 1, 8, 8), ytr
    spec = ModelSpec.from_dict({"kind": "mlp", "input": 64, "hidden": [2048, 2048], "outputs": 10})
    return spec, xtr, ytr


def best(fn: Any, repeats: int = 3) -> float:
    out = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def run_job(name: str, rounds: int) -> dict[str, Any]:
    spec, x, y = job(name)
    cfg = atk.train_config(local_epochs=1)
    g = atk.initial_state(spec)
    n = int(x.shape[0]) // SHARDS
    chunks = [{"x": x[i * n:(i + 1) * n], "y": y[i * n:(i + 1) * n]} for i in range(SHARDS)]
    prev = bytes(encode_state(g))
    rows = []
    for r in range(rounds):
        deltas = [train_assignment(spec, g, [c], cfg, 100 * r + i, device=torch.device("cpu")).delta
                  for i, c in enumerate(chunks)]
        g = {k: (g[k] + sum(d[k] for d in deltas) / len(deltas)) if g[k].is_floating_point() else g[k] for k in g}
        cur = bytes(encode_state(g))
        delta = make_delta(prev, cur)
        assert delta is not None and apply_delta(prev, delta) == cur, "a delta that does not give the model"
        rows.append({
            "round": r + 1, "model_bytes": len(cur), "zlib_bytes": len(zlib.compress(cur, LEVEL)),
            "delta_bytes": len(delta),
            "make_s": best(lambda p=prev, c=cur: make_delta(p, c)),
            "apply_s": best(lambda p=prev, d=delta: apply_delta(p, d)),
            "memcpy_s": best(lambda c=cur: bytearray(c)),
        })
        prev = cur
    model = rows[-1]["model_bytes"]
    mean = {k: sum(row[k] for row in rows) / len(rows) for k in ("zlib_bytes", "delta_bytes", "make_s", "apply_s",
                                                                 "memcpy_s")}
    return {"model_bytes": model, "rounds": rows,
            "delta_vs_model": model / mean["delta_bytes"], "delta_vs_zlib": mean["zlib_bytes"] / mean["delta_bytes"],
            "zlib_vs_model": model / mean["zlib_bytes"],
            "make_vs_memcpy": mean["make_s"] / mean["memcpy_s"], "apply_vs_memcpy": mean["apply_s"] / mean["memcpy_s"],
            "make_mb_per_s": model / mean["make_s"] / 1e6, "apply_mb_per_s": model / mean["apply_s"] / 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--jobs", default="mlp,cnn,wide")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    jobs = {name: run_job(name, args.rounds) for name in args.jobs.split(",")}
    print(f"{'job':<5} {'model MB':>9} {'zlib x':>7} {'delta x':>8} {'delta/zlib':>10} {'make MB/s':>10} "
          f"{'apply MB/s':>10} {'make/memcpy':>11}")
    for name, j in jobs.items():
        print(f"{name:<5} {j['model_bytes'] / 1e6:>9.2f} {j['zlib_vs_model']:>7.2f} {j['delta_vs_model']:>8.2f} "
              f"{j['delta_vs_zlib']:>10.2f} {j['make_mb_per_s']:>10.0f} {j['apply_mb_per_s']:>10.0f} "
              f"{j['make_vs_memcpy']:>11.1f}")
    result = {
        "bench": "model_delta",
        "ratios": {f"{name}_model_bytes_vs_delta": round(j["delta_vs_model"], 3) for name, j in jobs.items()}
        | {f"{name}_zlib_bytes_vs_delta": round(j["delta_vs_zlib"], 3) for name, j in jobs.items()}
        | {f"{name}_make_time_vs_memcpy": round(j["make_vs_memcpy"], 2) for name, j in jobs.items()},
        "figures": jobs,
        "config": {"rounds": args.rounds, "shards": SHARDS, "train": "SGD lr 0.05 momentum 0.9 batch 32, 1 epoch",
                   "zlib_level": LEVEL},
        "machine": {"cpu": platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
                    "python": platform.python_version()},
        "elapsed_s": round(time.perf_counter() - t0, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} ({result['elapsed_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
