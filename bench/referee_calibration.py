"""Calibrate the referee's short-segment threshold (``[verification] segment_tolerance``).

A node trains one assignment with the node's own trainer and checkpoint recorder in one
numeric class; the referee (hub/policy/referee.py) re-executes every segment in another class, in
the precision the node claims. Classes on this CPU: fp32 / bf16 autocast, 1 / 2 torch
threads, oneDNN on / off. Also measured: the whole-update distance between two honest
replicas of different classes (what the strict tolerance 1e-4 sees), and lies (a node that
trains bf16 and claims fp32, and the reverse). Writes bench/results/referee_calibration.json.

    python bench/referee_calibration.py [--epochs 5]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpuflex.hub.policy.referee import replay_segment, segment_distance  # noqa: E402
from gpuflex.node.checkpoints import CheckpointRecorder, training_state  # noqa: E402
from gpuflex.node.trainer import train_assignment  # noqa: E402
from gpuflex.protocol.checkpoint import auto_every, model_part  # noqa: E402
from gpuflex.protocol.jobspec import parse_job_spec  # noqa: E402
from gpuflex.protocol.modelspec import build_model  # noqa: E402
from gpuflex.protocol.tensors import decode_state  # noqa: E402

from tests.helpers import digits_arrays  # noqa: E402

MODELS = {
    "mlp": '[model]\nkind = "mlp"\ninput = 64\nhidden = [128]\noutputs = 10\n',
    "cnn": '[model]\nkind = "cnn"\nimage = [1, 8, 8]\nchannels = [16, 32]\nhidden = [64]\noutputs = 10\n',
}
CLASSES = {  # name -> (threads, onednn)
    "t2": (2, True),
    "t1": (1, True),
    "t2-nodnn": (2, False),
    "t1-nodnn": (1, False),
}


@contextlib.contextmanager
def numeric_class(threads: int, onednn: bool) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.backends.mkldnn.flags(enabled=onednn):
            yield
    finally:
        torch.set_num_threads(before)


class Keeper(CheckpointRecorder):
    """A recorder that keeps the states in memory (the node writes them to its data dir)."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, step, model, optimizer, scaler=None):  # type: ignore[no-untyped-def]
        if step in self._wanted:
            self.states[step] = training_state(model, optimizer, step, scaler)
        super().__call__(step, model, optimizer, scaler)


def run(kind: str, epochs: int, n: int) -> dict[str, object]:
    spec = parse_job_spec(f'[job]\nname = "c"\n{MODELS[kind]}[train]\nlocal_epochs = {epochs}\nbatch_size = 32\n'
                          'optimizer = "sgd"\nlr = 0.05\nmomentum = 0.9\n')
    xtr, ytr, _, _ = digits_arrays()
    x = torch.from_numpy(xtr[:n].copy())
    if kind == "cnn":
        x = x.reshape(-1, 1, 8, 8)
    y = torch.from_numpy(ytr[:n].copy())
    cfg = spec.train.train_config()
    model = build_model(spec.model, seed=0)
    global_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    total = math.ceil(n / 32) * epochs
    every = auto_every(total)
    trained: dict[tuple[str, str], Keeper] = {}
    deltas: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for prec in ("fp32", "bf16"):
        for cname, (threads, dnn) in CLASSES.items():
            rec = Keeper(total_steps=total, every=every, precision=prec)
            with numeric_class(threads, dnn):
                res = train_assignment(spec.model, global_state, [{"x": x, "y": y}],
                                       dataclasses.replace(cfg, precision=prec), 7,
                                       device=torch.device("cpu"), on_step=rec)
            trained[(prec, cname)] = rec
            deltas[(prec, cname)] = res.delta

    def whole(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        num = math.sqrt(sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a))
        den = math.sqrt(sum(float((a[k].double() ** 2).sum()) for k in a))
        return num / den

    base = ("fp32", "t2")
    replica = {f"{p}/{c}": whole(deltas[base], deltas[(p, c)]) for (p, c) in deltas if (p, c) != base}
    honest: dict[str, float] = {}
    lies: dict[str, float] = {}
    t0 = time.perf_counter()
    replay_steps = 0
    grid = trained[base].steps
    for (prec, node_class), rec in trained.items():
        for ref_class, (threads, dnn) in CLASSES.items():
            worst = 0.0
            worst_lie = 0.0
            for i in range(len(grid) - 1):
                s, e = grid[i], grid[i + 1]
                start, end = rec.states[s], rec.states[e]
                with numeric_class(threads, dnn):
                    out = replay_segment(spec.model, start, x, y, cfg, 7, s, e, prec)
                    lie = replay_segment(spec.model, start, x, y, cfg, 7, s, e,
                                         "fp32" if prec == "bf16" else "bf16")
                replay_steps += 2 * (e - s)
                worst = max(worst, segment_distance(model_part(start), model_part(end), out))
                worst_lie = max(worst_lie, segment_distance(model_part(start), model_part(end), lie))
            honest[f"node {prec}/{node_class} <- referee {ref_class}"] = worst
            lies[f"node trains {prec}/{node_class}, claims {'fp32' if prec == 'bf16' else 'bf16'}"
                 f" <- referee {ref_class}"] = worst_lie
    _ = decode_state
    return {
        "samples": n, "epochs": epochs, "steps": total, "checkpoint_every": every,
        "replica_whole_update_distance_vs_fp32_t2": replica,
        "segment_distance_honest_max": max(honest.values()),
        "segment_distance_lie_min": min(lies.values()),
        "segment_distance_honest": honest,
        "segment_distance_precision_lie": lies,
        "replay_s_per_step": (time.perf_counter() - t0) / max(replay_steps, 1),
    }


def cost(kind: str, epochs: int, n: int, repeats: int = 3) -> dict[str, float]:
    """What the commitments cost the node (recording + writing every checkpoint) and what one
    spot-check costs the referee (re-executing one segment), against the training itself."""
    import tempfile

    from gpuflex.node.checkpoints import CheckpointStore

    spec = parse_job_spec(f'[job]\nname = "c"\n{MODELS[kind]}[train]\nlocal_epochs = {epochs}\nbatch_size = 32\n'
                          'optimizer = "sgd"\nlr = 0.05\nmomentum = 0.9\n')
    xtr, ytr, _, _ = digits_arrays()
    x = torch.from_numpy(xtr[:n].copy())
    if kind == "cnn":
        x = x.reshape(-1, 1, 8, 8)
    y = torch.from_numpy(ytr[:n].copy())
    cfg = spec.train.train_config()
    g = {k: v.detach().clone() for k, v in build_model(spec.model, seed=0).state_dict().items()}
    total = math.ceil(n / 32) * epochs
    every = auto_every(total)
    plain, committed, replay = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        train_assignment(spec.model, g, [{"x": x, "y": y}], cfg, 7, device=torch.device("cpu"))
        plain.append(time.perf_counter() - t0)
        with tempfile.TemporaryDirectory() as tmp:
            store = CheckpointStore(Path(tmp))
            rec = CheckpointRecorder(total_steps=total, every=every, store=store, assignment_id="a")
            t0 = time.perf_counter()
            train_assignment(spec.model, g, [{"x": x, "y": y}], cfg, 7, device=torch.device("cpu"), on_step=rec)
            rec.commitment()  # every checkpoint hashed and written
            committed.append(time.perf_counter() - t0)
            seg = max(range(len(rec.norms)), key=lambda i: rec.norms[i])
            s, e = rec.steps[seg], rec.steps[seg + 1]
            start = decode_state(bytearray(store.read("a", s) or b""))
        t0 = time.perf_counter()
        replay_segment(spec.model, start, x, y, cfg, 7, s, e)
        replay.append(time.perf_counter() - t0)
    p, c, r = min(plain), min(committed), min(replay)
    return {"steps": total, "checkpoint_every": every, "train_s": p, "train_with_commitments_s": c,
            "commitment_overhead": c / p - 1.0, "replay_one_segment_s": r, "replay_fraction_of_training": r / p}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--samples", type=int, default=704)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "referee_calibration.json")
    ap.add_argument("--cost-only", action="store_true", help="measure only the costs; keep the calibration")
    args = ap.parse_args()
    costs = {kind: cost(kind, args.epochs, args.samples) for kind in MODELS}
    for kind, c in costs.items():
        print(f"{kind} cost: {json.dumps({k: round(v, 4) for k, v in c.items()})}")
    if args.cost_only and args.out.exists():
        doc = json.loads(args.out.read_text())
        doc["cost"] = costs
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.out}")
        return
    results = {kind: run(kind, args.epochs, args.samples) for kind in MODELS}
    for kind, r in results.items():
        print(f"{kind}: honest segment max {r['segment_distance_honest_max']:.3g}, "
              f"precision lie min {r['segment_distance_lie_min']:.3g}, "
              f"replicas (whole update) {json.dumps({k: float(f'{v:.3g}') for k, v in r['replica_whole_update_distance_vs_fp32_t2'].items()})}")  # type: ignore[union-attr]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"torch": torch.__version__, "results": results, "cost": costs}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
