"""Pipelines over home links: what each boundary encoding saves in bytes and costs in loss.

One workload, run once per ``[pipeline] boundary`` in the same process: a small byte-level
transformer (``--width`` wide, ``--layers`` blocks) trained on real text (the Python standard
library's sources, tests/tooling/text.py), cut into 3 stages, each a node's ``StageWorker``
(node/pipeline/worker.py) in its own thread over the in-memory transport, with a hub made of
plain objects holding the model, the chunks and the checkpoints. Every run trains the same
``--steps`` steps from the same seed and the same initial model.

Per encoding it records the bytes of activations and gradients that cross the cuts (each sent
tensor's GFT1 encoding: what the relay carries), the bytes of tied-gradient messages apart, the
mean training loss of the last 10% of steps, and the held-out loss of the model the checkpoints
assemble, run two ways: through the encoded cuts (the function the pipeline trained) and as
assembled (the model the job hands its owner, with no encoding anywhere).

``ratios.boundary_bytes_vs_fp32``: the smallest boundary bytes over fp32's among the encodings
at most 1/16 of fp32's bytes whose held-out loss through their cuts is within 2% of fp32's (of
equal bytes, such as subspace_log's and subspace_scaled's, the lower loss), and
``ratios.final_loss_vs_fp32_boundaries``: that encoding's held-out loss over fp32's (targets
<= 1/16 and <= 1.02). When none is within both, the encoding of at most 1/16 of the bytes with
the lowest held-out loss is reported and the target shows as missed.
``figures.other_seeds``: that encoding against fp32 again from ``--check-seeds`` (another initial
model, samples and basis), since a margin of a fraction of a percent is within what one seed
decides. ``throughput_shaped_vs_loopback`` is not measured here yet (it needs the netns links).

Usage: python bench/pipeline_wan.py [--steps 300] [--rank 16] [--log-rank 28]
    [--scaled-rank 28] [--encodings fp32,int8,subspace,subspace_log,subspace_scaled]
    [--out bench/results/pipeline_wan.json]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpuflex.node.pipeline.transport import MemoryNetwork, MessageKey  # noqa: E402
from gpuflex.node.pipeline.worker import StageWorker  # noqa: E402
from gpuflex.node.trainer import loss_for  # noqa: E402
from gpuflex.protocol.boundary import BOUNDARIES  # noqa: E402
from gpuflex.protocol.boundarycodec import BoundaryCode  # noqa: E402
from gpuflex.protocol.dataset import text_windows  # noqa: E402
from gpuflex.protocol.messages import (  # noqa: E402
    ChunkRef,
    StageAssignment,
    StageReport,
    TrainConfig,
    UnitCheckpoint,
)
from gpuflex.protocol.modelspec import ModelSpec, build_model  # noqa: E402
from gpuflex.protocol.pipeline import cut_state, load_unit, pipeline_units, put_state  # noqa: E402
from gpuflex.protocol.tensors import TensorSpec, decode_state, encode_state, sha256_hex  # noqa: E402

from tests.tooling.text import stdlib_text  # noqa: E402

SEED, BATCH, MICRO, CONTEXT = 7, 16, 4, 32
STARTS = [0, 2, 4]  # embed + block 0 | blocks 1-2 | block 3 + head


class BenchHub:
    """The hub as stages see it (StageHub), for every stage: blobs, checkpoints, reports."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.checkpoints: dict[tuple[int, int], str] = {}
        self.losses: list[float] = []
        self.lock = threading.Lock()

    def put(self, body: bytes) -> tuple[str, int]:
        sha = sha256_hex(body)
        self.blobs[sha] = body
        return sha, len(body)

    def blob(self, sha256: str, size: int) -> bytes:
        return self.blobs[sha256]

    def keep(self, sha256: str, body: bytes) -> None:
        pass

    def checkpoint(self, header: UnitCheckpoint, body: bytes) -> None:
        with self.lock:
            self.blobs[header.sha256] = body
            self.checkpoints[(header.step, header.unit)] = header.sha256

    def report(self, report: StageReport) -> bool:
        if report.loss is not None:
            self.losses.append(report.loss)
        return True


class CountingTransport:
    """A memory transport that counts the GFT1 bytes of what each stage sends, by kind."""

    def __init__(
        self, network: MemoryNetwork, counts: dict[str, int], lock: threading.Lock
    ) -> None:
        self.inner = network.transport()
        self.counts = counts
        self.lock = lock

    def send(self, key: MessageKey, tensor: torch.Tensor) -> None:
        size = len(encode_state({key.carries: tensor.detach().to("cpu").contiguous()}))
        with self.lock:  # every stage's thread adds to one count
            self.counts[key.carries] = self.counts.get(key.carries, 0) + size
        self.inner.send(key, tensor)

    def receive(self, key: MessageKey, expected: TensorSpec, *, timeout_s: float) -> torch.Tensor:
        return self.inner.receive(key, expected, timeout_s=timeout_s)


def model_spec(args: argparse.Namespace) -> ModelSpec:
    return ModelSpec.from_dict(
        {
            "kind": "transformer",
            "vocab": 256,
            "context": CONTEXT,
            "layers": args.layers,
            "width": args.width,
            "heads": 4,
        }
    )


def train(
    spec: ModelSpec, cfg: TrainConfig, data: Any, boundary: str, rank: int, steps: int,
    seed: int = SEED,
) -> dict[str, Any]:  # fmt: skip
    """Train ``steps`` steps over 3 stage workers; the bytes, losses and the assembled model."""
    hub = BenchHub()
    model_hash, model_size = hub.put(encode_state(build_model(spec, seed).state_dict()))
    x, y = data
    chunk = ChunkRef(*hub.put(encode_state({"x": x, "y": y})), int(x.shape[0]))
    units = len(pipeline_units(spec))
    bounds = [*STARTS, units]
    network, counts, lock = MemoryNetwork(), dict[str, int](), threading.Lock()
    outcomes: list[Any] = [None] * len(STARTS)

    def work(stage: int) -> None:
        a = StageAssignment(
            "bench-wan", 1, f"node-{stage}", stage, bounds[stage], bounds[stage + 1],
            tuple(f"node-{s}" for s in range(len(STARTS))),
            tuple(bytes([s + 1]) * 32 for s in range(len(STARTS))), tuple(STARTS),
            spec.to_dict(), model_hash, model_size, (),
            (chunk,) if stage in (0, len(STARTS) - 1) else (), cfg, seed, BATCH, MICRO, "1f1b",
            0, steps, steps, time.time(), boundary=boundary, boundary_rank=rank,
        )  # fmt: skip
        worker = StageWorker(a, hub=hub, transport=CountingTransport(network, counts, lock))
        outcomes[stage] = worker.run()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work, args=(s,)) for s in range(len(STARTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if any(o is None or o.ended != "done" for o in outcomes):
        raise SystemExit(f"{boundary}: a stage did not finish: {outcomes}")
    state: dict[str, torch.Tensor] = {}
    for i, unit in enumerate(pipeline_units(spec).units):
        blob = decode_state(hub.blobs[hub.checkpoints[(steps, i)]])
        put_state(unit, {k: v for k, v in blob.items() if not k.startswith("optim.")}, state)
    tail = hub.losses[-max(1, steps // 10) :]
    return {
        "state": state,
        "wall_s": round(wall, 2),
        "boundary_bytes": counts.get("activation", 0) + counts.get("gradient", 0),
        "tied_bytes": counts.get("tied", 0),
        "train_loss_tail": sum(tail) / len(tail),
    }


def held_out_loss(
    spec: ModelSpec, cfg: TrainConfig, state: dict[str, torch.Tensor], data: Any,
    boundary: str, rank: int, *, through_cuts: bool, seed: int = SEED,
) -> float:  # fmt: skip
    """The mean loss on ``data`` of the assembled model, the cuts' encoding applied when
    ``through_cuts`` (each cut's code as the stages built it)."""
    units = pipeline_units(spec).units
    modules = [load_unit(u, cut_state(u, state)).eval() for u in units]
    x, y = data
    with torch.no_grad():
        h = x
        for i, module in enumerate(modules):
            h = module(h)
            if through_cuts and boundary != "fp32" and i + 1 in STARTS[1:]:
                cut = STARTS.index(i + 1) - 1
                raw = TensorSpec("activation", "float32", tuple(h.shape))
                code = BoundaryCode(boundary, rank, raw=raw, seed=seed, cut=cut)
                h = code.decode(code.encode(h))
        return float(loss_for(spec, cfg)(h, y))


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    spec = model_spec(args)
    cfg = TrainConfig(1, BATCH, "adam", args.lr, 0.0, 0.0, 0.9, 0.999, "cross_entropy", 0.0)
    windows = text_windows(stdlib_text(args.text_bytes), CONTEXT, what="text")
    x, y = torch.from_numpy(windows.x), torch.from_numpy(windows.y)
    held = int(x.shape[0]) // 10
    train_data, val_data = (x[held:], y[held:]), (x[:held], y[:held])
    rows: dict[str, dict[str, Any]] = {}
    for boundary in ("fp32", *(b for b in args.encodings.split(",") if b != "fp32")):
        rank = ranks(args).get(boundary, 0)
        r = train(spec, cfg, train_data, boundary, rank, args.steps)
        state = r.pop("state")
        r["held_out_loss"] = held_out_loss(
            spec, cfg, state, val_data, boundary, rank, through_cuts=True
        )
        r["assembled_loss"] = held_out_loss(
            spec, cfg, state, val_data, boundary, rank, through_cuts=False
        )
        rows[boundary] = r
        print(f"{boundary:16s} {r['boundary_bytes']:>12,d} B  held-out {r['held_out_loss']:.4f}  "
              f"assembled {r['assembled_loss']:.4f}  train {r['train_loss_tail']:.4f}  {r['wall_s']} s",
              flush=True)  # fmt: skip
    base = rows["fp32"]
    for r in rows.values():
        r["bytes_vs_fp32"] = round(r["boundary_bytes"] / base["boundary_bytes"], 5)
        r["held_out_loss_vs_fp32"] = round(r["held_out_loss"] / base["held_out_loss"], 4)
        r["assembled_loss_vs_fp32"] = round(r["assembled_loss"] / base["assembled_loss"], 4)
    small = [b for b in rows if rows[b]["bytes_vs_fp32"] <= 1 / 16] or list(rows)
    within = [b for b in small if rows[b]["held_out_loss_vs_fp32"] <= 1.02]
    if within:  # the fewest bytes; of equal bytes, the lower loss
        best = min(within, key=lambda b: (rows[b]["boundary_bytes"], rows[b]["held_out_loss"]))
    else:
        best = min(small, key=lambda b: rows[b]["held_out_loss"])
    seeds = other_seeds(
        args, spec, cfg, (train_data, val_data), best, ranks(args).get(best, 0), rows
    )
    return {
        "name": "pipeline_wan",
        "ratios": {
            "boundary_bytes_vs_fp32": rows[best]["bytes_vs_fp32"],
            "final_loss_vs_fp32_boundaries": rows[best]["held_out_loss_vs_fp32"],
            "assembled_loss_vs_fp32_boundaries": rows[best]["assembled_loss_vs_fp32"],
        },
        "figures": {
            "best_encoding": best,
            "targets": {"boundary_bytes_vs_fp32": "<= 0.0625", "final_loss_vs_fp32_boundaries": "<= 1.02"},
            "met": rows[best]["bytes_vs_fp32"] <= 1 / 16 and rows[best]["held_out_loss_vs_fp32"] <= 1.02,
            "by_encoding": rows,
            "workload": {
                "model": spec.to_dict(), "stages": len(STARTS), "stage_starts": STARTS,
                "steps": args.steps, "batch": BATCH, "micro_batches": MICRO, "optimizer": "adam",
                "lr": args.lr, "subspace_rank": args.rank,
                "subspace_log_rank": args.log_rank, "subspace_scaled_rank": args.scaled_rank,
                "train_windows": int(x.shape[0]) - held,
                "held_out_windows": held, "transport": "in-process (MemoryNetwork)",
            },
            "other_seeds": seeds,
            "throughput_shaped_vs_loopback": "not measured yet (needs the netns links)",
        },
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "cpu": platform.processor() or platform.machine(), "threads": 1},
    }  # fmt: skip


def ranks(args: argparse.Namespace) -> dict[str, int]:
    """Each subspace encoding's rank (the others take none)."""
    return {
        "subspace": args.rank,
        "subspace_log": args.log_rank,
        "subspace_scaled": args.scaled_rank,
    }


def other_seeds(
    args: argparse.Namespace, spec: ModelSpec, cfg: TrainConfig, data: Any, best: str, rank: int,
    rows: dict[str, dict[str, Any]],
) -> dict[str, Any]:  # fmt: skip
    """The best encoding against fp32 again from other seeds (``--check-seeds``: another initial
    model, other samples per step, another basis): how much of its margin one seed decides."""
    (train_data, val_data), out = data, dict[str, Any]()
    ratios = {str(SEED): rows[best]["held_out_loss_vs_fp32"]}
    for seed in [int(s) for s in args.check_seeds.split(",") if s]:
        held, assembled = {}, {}
        for boundary in dict.fromkeys(("fp32", best)):
            r = 0 if boundary == "fp32" else rank
            state = train(spec, cfg, train_data, boundary, r, args.steps, seed)["state"]
            held[boundary] = held_out_loss(
                spec, cfg, state, val_data, boundary, r, through_cuts=True, seed=seed
            )
            assembled[boundary] = held_out_loss(
                spec, cfg, state, val_data, boundary, r, through_cuts=False, seed=seed
            )
        ratios[str(seed)] = round(held[best] / held["fp32"], 4)
        out[str(seed)] = {
            "held_out_loss": held,
            "held_out_loss_vs_fp32": ratios[str(seed)],
            "assembled_loss_vs_fp32": round(assembled[best] / assembled["fp32"], 4),
        }
        print(f"seed {seed}: {best} held-out {ratios[str(seed)]:.4f} of fp32's", flush=True)
    return {
        "encoding": best,
        "by_seed": out,
        "held_out_loss_vs_fp32": ratios,
        "mean": round(sum(ratios.values()) / len(ratios), 4),
        "max": max(ratios.values()),
    }


def table(result: dict[str, Any]) -> str:
    lines = [f"{'encoding':16s} {'boundary bytes':>15s} {'vs fp32':>8s} {'held-out':>9s} "
             f"{'vs fp32':>8s} {'assembled':>9s} {'vs fp32':>8s}"]  # fmt: skip
    for name, r in result["figures"]["by_encoding"].items():
        lines.append(
            f"{name:16s} {r['boundary_bytes']:>15,d} {r['bytes_vs_fp32']:>8.4f} "
            f"{r['held_out_loss']:>9.4f} {r['held_out_loss_vs_fp32']:>8.4f} "
            f"{r['assembled_loss']:>9.4f} {r['assembled_loss_vs_fp32']:>8.4f}"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rank", type=int, default=16, help="the subspace code's rank")
    p.add_argument("--log-rank", type=int, default=28, help="the subspace_log code's rank")
    p.add_argument("--scaled-rank", type=int, default=28, help="the subspace_scaled code's rank")
    p.add_argument(
        "--encodings", default=",".join(BOUNDARIES), help="fp32 always runs (the baseline)"
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--check-seeds", default="8,9", help="seeds the best encoding is trained again from"
    )
    p.add_argument("--text-bytes", type=int, default=200_000)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "pipeline_wan.json")
    args = p.parse_args()
    t0 = time.perf_counter()
    result = run(args)
    result["figures"]["wall_s"] = round(time.perf_counter() - t0, 1)
    result["table"] = table(result).splitlines()
    print(table(result))
    print(json.dumps(result["ratios"], indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=_finite) + "\n")


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


if __name__ == "__main__":
    main()
