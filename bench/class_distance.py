"""How far apart honest replicas of one shard land when they train in different compute classes.

The calibration of ``[verification] cross_class_tolerance`` and the figures docs/verification.md quotes.
On this CPU, classes that really differ numerically: fp32 against bf16 autocast, intra-op
threads 1 against 2, oneDNN on against off. For the digits MLP (64-128-10) and the digits CNN
(16/32 channels), one 704-sample shard (11 chunks of 64, the hub's stratified split) from the
initial model, SGD lr 0.05 momentum 0.9 batch 32, the node's own ``train_assignment``, for the
job's default epochs (1 in a spec that says nothing, 3 in the bundled digits job) and 5 (the
heterogeneity bench's minimum). For scale: the distance of the attack catalogue's ``half_shard``
(trained on half the shard) from the honest update of the same class.
The distance is the hub's: ``hub.verification.relative_distance`` between the two deltas.
Also: samples/s and the validation accuracy of the model after one round of the whole training
set per precision (fp32 vs bf16 autocast), to say what bf16 costs or gains on this CPU.

Run: .venv/bin/python bench/class_distance.py  -> bench/results/class_distance.json
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from gpuflex.hub.policy.distances import relative_distance  # noqa: E402
from gpuflex.node.trainer import train_assignment  # noqa: E402
from gpuflex.protocol.modelspec import ModelSpec  # noqa: E402
from tooling import attacks as atk  # noqa: E402

MODELS: dict[str, dict[str, Any]] = {
    "digits_mlp": {"kind": "mlp", "input": 64, "hidden": [128], "outputs": 10, "activation": "relu"},
    "digits_cnn": {"kind": "cnn", "image": [1, 8, 8], "channels": [16, 32], "kernel": 3, "pool": "max",
                   "hidden": [64], "outputs": 10},
}
#: (name, threads, oneDNN on, precision); the first is the reference class
CLASSES = [("fp32-t1-onednn", 1, True, "fp32"), ("fp32-t2-onednn", 2, True, "fp32"),
           ("fp32-t1-no-onednn", 1, False, "fp32"), ("bf16-t1-onednn", 1, True, "bf16"),
           ("bf16-t2-onednn", 2, True, "bf16")]


def _chunks(spec: ModelSpec, x: torch.Tensor, y: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    if spec.kind == "cnn":
        x = x.reshape(-1, 1, 8, 8)
    return atk.make_chunks(x, y, chunk_size=64)


def _train(spec: ModelSpec, state: Any, chunks: Any, epochs: int, threads: int, onednn: bool,
           precision: str, seed: int = 7) -> Any:
    torch.set_num_threads(threads)
    torch.backends.mkldnn.enabled = onednn
    cfg = atk.train_config(local_epochs=epochs, precision=precision)
    try:
        return train_assignment(spec, state, chunks, cfg, seed, device=torch.device("cpu"))
    finally:
        torch.backends.mkldnn.enabled = True


def main() -> int:
    xtr, ytr, xva, yva = atk.digits_data()
    out: dict[str, Any] = {"machine": {"cpu": platform.processor() or platform.machine(),
                                       "torch": torch.__version__}, "models": {}}
    for name, d in MODELS.items():
        spec = ModelSpec.from_dict(d)
        state = atk.initial_state(spec, seed=0)
        chunks = _chunks(spec, xtr, ytr)
        shard = chunks[:11]  # 704 samples
        per_model: dict[str, Any] = {"distances": {}, "repeat_same_class": {}, "precision": {}}
        per_model["half_shard_vs_honest"] = {}
        for epochs in (1, 3, 5):
            deltas = {c[0]: _train(spec, state, shard, epochs, c[1], c[2], c[3]).delta for c in CLASSES}
            again = _train(spec, state, shard, epochs, *CLASSES[0][1:]).delta
            per_model["repeat_same_class"][str(epochs)] = relative_distance(deltas[CLASSES[0][0]], again)[0]
            half = _train(spec, state, atk.half_of_chunks(shard), epochs, *CLASSES[0][1:]).delta
            per_model["half_shard_vs_honest"][str(epochs)] = relative_distance(deltas[CLASSES[0][0]], half)[0]
            per_model["distances"][str(epochs)] = {
                f"{a[0]} vs {b[0]}": relative_distance(deltas[a[0]], deltas[b[0]])[0]
                for i, a in enumerate(CLASSES) for b in CLASSES[i + 1:]
            }
        xv = xva.reshape(-1, 1, 8, 8) if spec.kind == "cnn" else xva
        for precision in ("fp32", "bf16"):
            t0 = time.perf_counter()
            result = _train(spec, state, chunks, 3, 1, True, precision)
            wall = time.perf_counter() - t0
            trained = atk.apply_delta(state, result.delta)
            per_model["precision"][precision] = {
                "samples_per_s": result.sample_count * 3 / result.train_s, "wall_s": wall,
                "val_accuracy_after_3_epochs": atk.accuracy(spec, trained, xv, yva), "loss": result.loss}
        out["models"][name] = per_model
    out["max_cross_class_distance"] = {
        e: max(v for m in out["models"].values() for v in m["distances"][e].values()) for e in ("1", "3", "5")}
    path = ROOT / "bench" / "results" / "class_distance.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
