"""Verified stage work: does the hub's stage check catch faulty stages, and never honest ones?

A small byte-level transformer (width 64, 4 blocks, dropout 0.1, Adam) on real text (the Python
standard library's sources), cut into 3 stages, each a node's ``StageWorker``
(node/pipeline/worker.py) in its own thread over the in-memory transport, checkpointing every
step, so that every (stage, step, micro-batch) can be checked. A recording transport keeps every
tensor a stage sends: what the hub's relay keeps for a drawn pick. Each check is the hub's own
``judge_stage`` (hub/policy/stage_check.py) on the units' states at the step's start, the way
hub/domain/pipelines/verify.py runs it (states decoded from their blobs, units built from the spec).

- honest: two trainings in two CPU compute classes (1 thread with oneDNN, 2 threads without),
  each checked in both classes: every (stage, step, micro-batch), ``figures.honest_flagged`` of
  ``figures.honest_checked``;
- faults, each kind injected into one stage (a different stage per run) and every faulty
  (step, micro-batch) checked, ``figures.fault_detection_rate`` per kind: weights perturbed by
  1e-3 relative (the stage trains the honest ones and checkpoints them perturbed), a skipped
  block, stale parameters (each step computed with the previous step's), a bf16 forward and
  backward (autocast), crafted gradients sent back (negated, scaled by 1.1, or 1% noise added);
  the honest stages of those runs are checked too;
- ``figures.verification_cost_fraction``: the referee's time per check (decoding the states,
  building the units, forward and backward of one micro-batch) over the pipeline's compute
  (every stage's compute per step, from its reports), at the default ``verify_rate`` (0.05 of
  (stage, checkpoint step) pairs) and ``checkpoint_every`` (10), and at the worst (1.0 and 1).

``--boundary`` (int8, subspace, ...; ``--rank`` for the subspace codes) runs it all with the cuts
encoded, as a job's ``[pipeline] boundary``: the recorder keeps the wire forms, the check gets
each cut's code (as hub/domain/pipelines/verify.py builds it) and writes
``bench/results/stage_checks_<boundary>.json``.

Every stage sketches what it sends at the steps the hub may check (here every step:
protocol/stagesketch.py, the raw tensor's largest entries and signed sums over all of it, before
the code), and each check gets those sketches as the relay keeps them; the sums' distance
(``*_sketch_projection_distance``) is counted on its own too (``smallest_projection_distance``,
``largest_projection_distance``). The same checks judged on the wire distances alone (what
the referee has of a node that sends no sketch) are counted beside them: ``caught_wire_only`` per
kind and ``figures.fault_detection_rate_wire_only``, the baseline of the same run.

Usage: python bench/stage_checks.py [--steps 30] [--boundary int8] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpuflex.hub.policy.stage_check import StageEvidence, judge_stage, stage_loss  # noqa: E402
from gpuflex.node.pipeline.transport import MemoryNetwork, MessageKey  # noqa: E402
from gpuflex.node.pipeline.worker import StageWorker  # noqa: E402
from gpuflex.protocol.boundarycodec import BoundaryCode  # noqa: E402
from gpuflex.protocol.dataset import text_windows  # noqa: E402
from gpuflex.protocol.messages import ChunkRef, StageAssignment, TrainConfig  # noqa: E402
from gpuflex.protocol.modelspec import ModelSpec, build_model  # noqa: E402
from gpuflex.protocol.pipeline import (  # noqa: E402
    cut_state,
    micro_batch_slices,
    pipeline_units,
    step_samples,
)
from gpuflex.protocol.stagesketch import decode_sketch  # noqa: E402
from gpuflex.protocol.tensors import TensorSpec, decode_state, encode_state  # noqa: E402

from bench.pipeline_wan import BenchHub  # noqa: E402
from tests.tooling.text import stdlib_text  # noqa: E402

SEED, BATCH, MICRO, CONTEXT = 7, 16, 4, 32
STARTS = [0, 2, 4]  # embed + block 0 | blocks 1-2 | block 3 + head
TOLERANCE = 1e-4  # the job's [verification] tolerance: the threshold of an fp32 stage
TIGHTER = (1e-5, 1e-6)  # tolerances a job may set instead: the faults each would catch
CLASSES = {"1 thread, oneDNN on": (1, True), "2 threads, oneDNN off": (2, False)}
FAULTS = (
    "perturbed_1e-3",
    "skipped_block",
    "stale_parameters",
    "bf16_forward",
    "crafted_gradients",
)


@contextlib.contextmanager
def compute_class(name: str) -> Iterator[None]:
    threads, onednn = CLASSES[name]
    before = torch.get_num_threads(), torch.backends.mkldnn.enabled
    torch.set_num_threads(threads)
    torch.backends.mkldnn.enabled = onednn
    try:
        yield
    finally:
        torch.set_num_threads(before[0])
        torch.backends.mkldnn.enabled = before[1]


class Recorder:
    """The in-memory transport, keeping a copy of every tensor sent (what the relay sees: the
    wire form under an encoded boundary)."""

    def __init__(
        self,
        network: MemoryNetwork,
        sent: dict[MessageKey, torch.Tensor],
        sketches: dict[MessageKey, bytes],
    ) -> None:
        self.inner = network.transport()
        self.sent = sent
        self.sketches = sketches

    def send(self, key: MessageKey, tensor: torch.Tensor, sketch: bytes = b"") -> None:
        t = tensor.detach().to("cpu").clone()
        self.sent[key] = t
        if sketch:
            self.sketches[key] = sketch
        self.inner.send(key, t)

    def receive(self, key: MessageKey, expected: TensorSpec, *, timeout_s: float) -> torch.Tensor:
        return self.inner.receive(key, expected, timeout_s=timeout_s)


class Stale:
    """Each step computed with the previous step's parameters, its gradients applied to the
    current ones."""

    def __init__(self, inner: Any, params: list[torch.Tensor]) -> None:
        self.inner, self.params = inner, params
        self.previous = self.current = [p.detach().clone() for p in params]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def zero_grad(self) -> None:
        self.inner.zero_grad()
        self.current = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, old in zip(self.params, self.previous, strict=True):
                p.copy_(old)

    def step(self) -> None:
        with torch.no_grad():
            for p, now in zip(self.params, self.current, strict=True):
                p.copy_(now)
        self.inner.step()
        self.previous = self.current


class FaultyWorker(StageWorker):
    """A stage worker with one injected fault (None: honest)."""

    fault: str | None = None
    trial: int = 0
    #: crafted gradients: what the stage does to each input gradient before it is encoded and sent
    craft: Callable[[torch.Tensor], torch.Tensor] | None = None

    def prepare(self) -> None:
        super().prepare()
        runner = self.runner
        assert runner is not None
        if self.fault == "skipped_block":
            units = pipeline_units(ModelSpec.from_dict(self.a.model_spec)).units
            blocks = [
                i
                for i, u in enumerate(units[self.a.unit_start : self.a.unit_end])
                if u.name.startswith("block_")
            ]
            runner.module[blocks[self.trial % len(blocks)]].register_forward_hook(
                lambda m, args, out: args[0] + 0.0 * out
            )
        elif self.fault == "stale_parameters":
            runner.optimizer = Stale(runner.optimizer, list(runner.module.parameters()))  # type: ignore[assignment]
        elif self.craft is not None:
            send, craft = runner._send, self.craft

            def crafted(key: MessageKey, tensor: torch.Tensor, code: Any) -> None:
                send(key, craft(tensor) if key.carries == "gradient" else tensor, code)

            runner._send = crafted  # type: ignore[method-assign]

    def unit_states(self) -> list[dict[str, torch.Tensor]]:
        states = super().unit_states()
        if self.fault != "perturbed_1e-3":
            return states
        g = torch.Generator().manual_seed(self.trial)
        for state in states:
            for name, t in state.items():
                if not name.startswith("optim.") and t.is_floating_point():
                    signs = torch.randint(0, 2, t.shape, generator=g).float() * 2 - 1
                    state[name] = t * (1 + 1e-3 * signs)
        return states

    def _step(self, step: int) -> bool:
        if self.fault == "bf16_forward":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return super()._step(step)
        return super()._step(step)


CRAFTS: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = (
    lambda g: -g,
    lambda g: g * 1.1,
    lambda g: (
        g
        + 0.01
        * g.norm()
        / g.numel() ** 0.5
        * torch.randn(g.shape, generator=torch.Generator().manual_seed(0))
    ),
)


def train(
    spec: ModelSpec,
    cfg: TrainConfig,
    data: tuple[torch.Tensor, torch.Tensor],
    steps: int,
    fault: str | None = None,
    stage: int = -1,
    trial: int = 0,
    boundary: tuple[str, int] = ("fp32", 0),
) -> dict[str, Any]:
    """``steps`` steps over 3 stage workers (``fault`` in stage ``stage``), checkpointing each
    step, the cuts encoded by ``boundary`` (encoding, rank)."""
    hub = BenchHub()
    model_hash, model_size = hub.put(encode_state(build_model(spec, SEED).state_dict()))
    x, y = data
    chunk = ChunkRef(*hub.put(encode_state({"x": x, "y": y})), int(x.shape[0]))
    bounds = [*STARTS, len(pipeline_units(spec))]
    network, sent = MemoryNetwork(), dict[MessageKey, torch.Tensor]()
    sketches: dict[MessageKey, bytes] = {}
    compute: list[float] = []
    lock = threading.Lock()
    outcomes: list[Any] = [None] * len(STARTS)

    def work(s: int) -> None:
        a = StageAssignment(
            "bench-checks", 1, f"node-{s}", s, bounds[s], bounds[s + 1],
            tuple(f"node-{i}" for i in range(len(STARTS))),
            tuple(bytes([i + 1]) * 32 for i in range(len(STARTS))), tuple(STARTS),
            spec.to_dict(), model_hash, model_size, (),
            (chunk,) if s in (0, len(STARTS) - 1) else (), cfg, SEED, BATCH, MICRO, "1f1b",
            0, steps, 1, time.time(),
        )  # fmt: skip
        a = dataclasses.replace(a, boundary=boundary[0], boundary_rank=boundary[1])
        worker = FaultyWorker(a, hub=hub, transport=Recorder(network, sent, sketches))
        worker.fault, worker.trial = (fault, trial) if s == stage else (None, 0)
        if fault == "crafted_gradients" and s == stage:
            worker.craft = CRAFTS[trial % len(CRAFTS)]
        original = worker._report

        def report(
            step_s: float, compute_s: float, loss: float | None, failed: str = "", **more: Any
        ) -> Any:
            with lock:
                compute.append(compute_s)
            return original(step_s, compute_s, loss, failed, **more)

        worker._report = report  # type: ignore[method-assign]
        outcomes[s] = worker.run()

    threads = [threading.Thread(target=work, args=(s,)) for s in range(len(STARTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(o is None or o.ended != "done" for o in outcomes):
        raise SystemExit(f"{fault}: a stage did not finish: {outcomes}")
    return {
        "hub": hub,
        "sent": sent,
        "sketches": sketches,
        "model_hash": model_hash,
        "compute_s": compute[len(STARTS) :],
    }


def check(
    spec: ModelSpec,
    cfg: TrainConfig,
    run: dict[str, Any],
    data: tuple[torch.Tensor, torch.Tensor],
    stage: int,
    step: int,
    mb: int,
    boundary: tuple[str, int] = ("fp32", 0),
) -> tuple[bool, dict[str, Any], float]:
    """The hub's check of (stage, step, micro-batch): ok, evidence, seconds."""
    t0 = time.perf_counter()
    hub, sent = run["hub"], run["sent"]
    bounds = [*STARTS, len(pipeline_units(spec))]
    units = pipeline_units(spec).units[bounds[stage] : bounds[stage + 1]]
    states = []
    model = decode_state(hub.blobs[run["model_hash"]]) if step == 0 else {}
    for i, unit in enumerate(units, start=bounds[stage]):
        if step == 0:
            states.append(cut_state(unit, model))
        else:
            blob = decode_state(hub.blobs[hub.checkpoints[(step, i)]])
            states.append({k: v for k, v in blob.items() if not k.startswith("optim.")})
    last = stage == len(STARTS) - 1
    x, y, weight = data_of(data, step, mb) if stage == 0 or last else (None, None, 1.0)
    out_key = MessageKey(step, mb, "activation", stage, stage + 1)
    grad_in_key = MessageKey(step, mb, "gradient", stage, stage - 1)
    sketches = {
        k: decode_sketch(v) for k, v in run["sketches"].items() if k in (out_key, grad_in_key)
    }
    evidence = StageEvidence(
        x=sent[MessageKey(step, mb, "activation", stage - 1, stage)] if stage else x,
        out=None if last else sent[MessageKey(step, mb, "activation", stage, stage + 1)],
        grad_out=None if last else sent[MessageKey(step, mb, "gradient", stage + 1, stage)],
        grad_in=sent[MessageKey(step, mb, "gradient", stage, stage - 1)] if stage else None,
        y=y if last else None,
        weight=weight,
        inbound=code_of(boundary, stage - 1) if stage else None,
        outbound=None if last else code_of(boundary, stage),
        out_sketch=sketches.get(out_key),
        grad_in_sketch=sketches.get(grad_in_key),
    )
    verdict = judge_stage(
        units,
        states,
        evidence,
        seed=SEED,
        step=step,
        micro_batch=mb,
        tolerance=TOLERANCE,
        loss_fn=stage_loss(spec, cfg.loss) if last else None,
    )
    return verdict.ok, dict(verdict.evidence), time.perf_counter() - t0


def code_of(boundary: tuple[str, int], cut: int) -> BoundaryCode | None:
    """Cut ``cut``'s code (None for fp32): every cut carries (micro-batch, context, width)."""
    if boundary[0] == "fp32":
        return None
    raw = TensorSpec("activation", "float32", (BATCH // MICRO, CONTEXT, 64))
    return BoundaryCode(*boundary, raw=raw, seed=SEED, cut=cut)


def data_of(
    data: tuple[torch.Tensor, torch.Tensor], step: int, mb: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    x, y = data
    index = torch.tensor(step_samples(SEED, step, BATCH, int(x.shape[0])))
    lo, hi = micro_batch_slices(BATCH, MICRO)[mb]
    return x[index[lo:hi]], y[index[lo:hi]], (hi - lo) / BATCH


def largest(evidence: dict[str, Any], *, sketch: bool | None = None, part: str = "") -> float:
    """The largest distance of a check (``sketch``: only the sketch's, only the wire's;
    ``part``: only those whose name holds it)."""
    return max(
        (
            v
            for k, v in evidence.items()
            if k.endswith("_distance")
            and (sketch is None or ("_sketch" in k) == sketch)
            and part in k
        ),
        default=0.0,
    )


def wire_only_ok(ok: bool, evidence: dict[str, Any]) -> bool:
    """The verdict on the wire distances alone: what the referee has of a node sending no sketch
    (a check refused for another reason, without distances, stays refused)."""
    wire = [v for k, v in evidence.items() if k.endswith("_distance") and "_sketch" not in k]
    if not wire:
        return ok
    return all(v <= evidence["threshold"] for v in wire)


def honest(
    spec: ModelSpec, cfg: TrainConfig, data: Any, steps: int, boundary: tuple[str, int]
) -> dict[str, Any]:
    checked = flagged = 0
    worst = worst_sketch = worst_projection = 0.0
    seconds: list[float] = []
    compute: list[float] = []
    for node_class in CLASSES:
        with compute_class(node_class):
            run = train(spec, cfg, data, steps, boundary=boundary)
        compute += run["compute_s"]
        for referee_class in CLASSES:
            with compute_class(referee_class):
                for step in range(steps):
                    for stage in range(len(STARTS)):
                        for mb in range(MICRO):
                            ok, ev, s = check(spec, cfg, run, data, stage, step, mb, boundary)
                            checked += 1
                            flagged += not ok
                            worst = max(worst, largest(ev))
                            worst_sketch = max(worst_sketch, largest(ev, sketch=True))
                            worst_projection = max(worst_projection, largest(ev, part="projection"))
                            seconds.append(s)
        print(
            f"honest, trained in {node_class}: {checked} checked, {flagged} flagged, "
            f"largest distance {worst:.3g}",
            flush=True,
        )
    return {
        "checked": checked,
        "flagged": flagged,
        "largest_distance": worst,
        "largest_sketch_distance": worst_sketch,
        "largest_projection_distance": worst_projection,
        "check_s": seconds,
        "stage_step_compute_s": compute,
    }


def faults(
    spec: ModelSpec,
    cfg: TrainConfig,
    data: Any,
    steps: int,
    per_kind: int,
    boundary: tuple[str, int],
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    beside = beside_flagged = 0
    beside_worst = 0.0
    for kind in FAULTS:
        caught = caught_wire = injected = trial = 0
        smallest = smallest_sketch = smallest_projection = float("inf")
        distances: list[float] = []
        while injected < per_kind:
            stage = (1, 2)[trial % 2] if kind == "crafted_gradients" else trial % len(STARTS)
            run = train(spec, cfg, data, steps, kind, stage, trial, boundary)
            # a perturbed or stale state exists only from step 1 on (step 0 is the job's model)
            first = 1 if kind in ("perturbed_1e-3", "stale_parameters") else 0
            for s in range(len(STARTS)):
                for step in range(first if s == stage else 0, steps):
                    for mb in range(MICRO):
                        ok, ev, _ = check(spec, cfg, run, data, s, step, mb, boundary)
                        if s == stage:
                            injected += 1
                            caught += not ok
                            caught_wire += not wire_only_ok(ok, ev)
                            smallest = min(smallest, largest(ev))
                            smallest_sketch = min(smallest_sketch, largest(ev, sketch=True))
                            smallest_projection = min(
                                smallest_projection, largest(ev, part="projection")
                            )
                            distances.append(largest(ev))
                        else:
                            beside += 1
                            beside_flagged += not ok
                            beside_worst = max(beside_worst, largest(ev))
            trial += 1
        out[kind] = {
            "injected": injected,
            "caught": caught,
            "rate": caught / injected,
            "caught_wire_only": caught_wire,
            "rate_wire_only": caught_wire / injected,
            "smallest_distance": smallest,
            "smallest_sketch_distance": smallest_sketch,
            "smallest_projection_distance": smallest_projection,
            "runs": trial,
            # what a job's tighter [verification] tolerance would catch (the honest side: the
            # largest honest distance in the figures)
            "caught_at": {f"{t:g}": sum(d > t for d in distances) for t in TIGHTER},
        }
        print(
            f"{kind:18s} caught {caught}/{injected} (by the wire alone {caught_wire})  "
            f"smallest distance {smallest:.3g} (the sums' {smallest_projection:.3g})",
            flush=True,
        )
    return {
        "by_kind": out,
        "honest_beside": beside,
        "honest_beside_flagged": beside_flagged,
        "honest_beside_largest_distance": beside_worst,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    spec = ModelSpec.from_dict(
        {
            "kind": "transformer",
            "vocab": 256,
            "context": CONTEXT,
            "layers": 4,
            "width": 64,
            "heads": 4,
            "dropout": 0.1,
        }
    )
    cfg = TrainConfig(1, BATCH, "adam", 1e-3, 0.0, 0.0, 0.9, 0.999, "cross_entropy", 0.0)
    windows = text_windows(stdlib_text(args.text_bytes), CONTEXT, what="text")
    data = (torch.from_numpy(windows.x), torch.from_numpy(windows.y))
    boundary = (args.boundary, args.rank)
    h = honest(spec, cfg, data, args.steps, boundary)
    f = faults(spec, cfg, data, args.fault_steps, args.per_kind, boundary)
    check_s = sorted(h.pop("check_s"))
    stage_s = h.pop("stage_step_compute_s")
    per_check = sum(check_s) / len(check_s)
    per_stage_step = sum(stage_s) / len(stage_s)
    # checks per generation: rate x stages x steps / every; compute: stages x steps x per_stage_step
    cost = {
        f"rate {rate}, every {every}": round(rate * per_check / (every * per_stage_step), 5)
        for rate, every in ((0.05, 10), (1.0, 10), (1.0, 1))
    }
    rates = [k["rate"] for k in f["by_kind"].values()]
    return {
        "name": "stage_checks" if args.boundary == "fp32" else f"stage_checks_{args.boundary}",
        "figures": {
            "fault_detection_rate": min(rates),
            "fault_detection_rate_wire_only": min(k["rate_wire_only"] for k in f["by_kind"].values()),
            "honest_flagged": h["flagged"] + f["honest_beside_flagged"],
            "honest_checked": h["checked"] + f["honest_beside"],
            "verification_cost_fraction": cost["rate 0.05, every 10"],
            "verification_cost_fraction_by_setting": cost,
            "check_s_mean": round(per_check, 5), "check_s_p99": round(check_s[int(0.99 * (len(check_s) - 1))], 5),
            "stage_step_compute_s_mean": round(per_stage_step, 5),
            "honest": h, "faults": f,
            "targets": {"fault_detection_rate": "= 1.0 (>= 50 of each kind)",
                        "honest_flagged": "= 0 (>= 1,000 honest micro-batches)",
                        "verification_cost_fraction": "<= 0.10"},
            "workload": {"model": spec.to_dict(), "stages": len(STARTS), "stage_starts": STARTS,
                         "batch": BATCH, "micro_batches": MICRO, "optimizer": "adam", "honest_steps": args.steps,
                         "fault_steps": args.fault_steps, "threshold": TOLERANCE,
                         "boundary": args.boundary, "boundary_rank": args.rank,
                         "classes": list(CLASSES), "transport": "in-process (MemoryNetwork)"},
        },
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "cpu": platform.processor() or platform.machine()},
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--steps",
        type=int,
        default=22,
        help="honest steps per training (x 3 stages x 4 micro-batches x 4)",
    )
    p.add_argument("--fault-steps", type=int, default=4)
    p.add_argument("--per-kind", type=int, default=50)
    p.add_argument("--text-bytes", type=int, default=200_000)
    p.add_argument("--boundary", default="fp32", help="the cuts' encoding (int8, subspace, ...)")
    p.add_argument("--rank", type=int, default=0, help="the subspace codes' rank")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.out is None:
        name = "stage_checks" if args.boundary == "fp32" else f"stage_checks_{args.boundary}"
        args.out = ROOT / "bench" / "results" / f"{name}.json"
    t0 = time.perf_counter()
    result = run(args)
    result["figures"]["wall_s"] = round(time.perf_counter() - t0, 1)
    shown = {k: v for k, v in result["figures"].items() if not isinstance(v, dict)}
    print(json.dumps(shown, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
