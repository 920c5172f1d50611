"""Two replicas of every stage, 4x apart in speed: how much of their joint capacity a step uses.

The model is bench/pipeline_planner.py's (16 Linear units of width 512, batch 128, Adam), cut
into 2 stages. Two pipelines of those 2 stages share each step (the product's hybrid
parallelism: node/pipeline/stage.StageRunner with ``lane``/``lanes``, each stage summing its
units' gradients with the other pipeline's same stage before its optimizer steps). Pipeline A's
stages are slowed 5x, pipeline B's 20x (bench/pipeline_planner.Throttle: every aten op takes
that many times its CPU time, the difference slept), so B is 4x slower. Every stage runs in a
process of its own (a node, one thread) and the stages meet over the product's direct transport
(signed frames over TCP on 127.0.0.1, node/pipeline/direct.py): what is measured is the schedule,
the split and the gradient exchange on a fast link, not a home line (bench/pipeline_hybrid.py
measures the hub's relay).

In one run:

1. each pipeline alone trains the whole step (16 micro-batches of 8): its samples per second;
   the **capacity bound** is their sum (each replica of a stage as busy as it can be on its own);
2. both pipelines share each step, the micro-batches split evenly (8 + 8);
3. both share it, split by the product's planner (hub/domain/pipelines/planning.balance) from
   what each stage measured in step 1, as the hub splits it from its stages' reports: each
   step's compute time (wall time less the transport's waits, node/pipeline/worker.py's
   ``TimedTransport``), the part of it the step's end took (``StageRunner.update_s``: the
   optimizer step) and the fixed time per unit and micro-batch the stage measured before its
   first step (node/pipeline/overhead.py), read by hub/policy/stage_speed.py's ``with_step``
   into the node's speed, update rate and fixed time, and offered as
   hub/domain/pipelines/offers.py offers them;
4. the same with neither measured (each step's whole compute time at one speed: how the hub
   read reports before they said ``update_s`` and ``unit_overhead_s``), when its split differs.

The step holds ``--micro-batches`` micro-batches of 8 samples, for each count given (16 and 64 by
default: a slow replica's fixed costs per step, its optimizer step and the pipeline's fill and
drain, weigh less against a longer step). ``ratios.throughput_vs_capacity_bound`` is run 3's
samples per second over the bound at the first count (issue 36's target: >= 0.85 with 2
replicas per stage and a 4x speed spread), ``..._<count>mb`` at each count; the even split's and
the speed-only split's are beside them. Every pipeline's parameters after the shared steps equal
one process accumulating the same micro-batches (``equivalence_max_rel_diff``).

    python bench/pipeline_replicas.py [--steps 6] [--micro-batches 16,64]
        [--out bench/results/pipeline_replicas.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpuflex.hub.domain.pipelines.planning import balance  # noqa: E402
from gpuflex.hub.policy.pipeline_plan import NodeOffer, evaluate_pipeline  # noqa: E402
from gpuflex.hub.policy.stage_speed import StageSpeed, stage_step_flops, with_step  # noqa: E402
from gpuflex.node.pipeline.stage import StageRunner, boundary_specs, cut  # noqa: E402

from bench.pipeline_planner import (  # noqa: E402
    WIDTH,
    Throttle,
    optimizer_for,
    unit_costs,
    units,
)

#: samples in a micro-batch; a step holds ``micro`` of them
MICRO_SIZE = 8
STARTS = [0, 16]  # 31 units: 8 Linear+GELU pairs on each stage
THROTTLES = {"A": 5.0, "B": 20.0}


def _seed(slot: int) -> bytes:
    return bytes([slot + 1]) * 32


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def step_batches(
    micro: int, steps: int, seed: int = 1
) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """``steps`` steps of ``micro`` micro-batches of `MICRO_SIZE` samples (bench/pipeline_planner's
    data: random inputs, 10 classes)."""
    g = torch.Generator().manual_seed(seed)
    return [
        (
            [torch.randn(MICRO_SIZE, WIDTH, generator=g) for _ in range(micro)],
            [torch.randint(0, 10, (MICRO_SIZE,), generator=g) for _ in range(micro)],
        )
        for _ in range(steps)
    ]


def run_stage(
    slot: int, lanes: list[str], counts: list[int], ports: list[int], steps: int, out: Path
) -> None:
    """One stage in its own process (a node): its runner over the direct transport to the other
    stages (TCP on 127.0.0.1), under its pipeline's throttle. Writes its step ends (JSON) and
    its parameters (GFT1) under ``out``; waits for ``out/go`` before its first step."""
    from gpuflex.node.pipeline.direct import DirectTransport, StageListener
    from gpuflex.node.pipeline.overhead import unit_overhead_s
    from gpuflex.node.pipeline.transport import SendAhead
    from gpuflex.node.pipeline.worker import TimedTransport
    from gpuflex.protocol.signing import SigningKey
    from gpuflex.protocol.tensors import encode_state

    torch.set_num_threads(1)
    lane, s = divmod(slot, 2)
    stages = cut(units(), STARTS)
    specs = boundary_specs(stages, torch.zeros(MICRO_SIZE, WIDTH))
    module = stages[s]
    listener = StageListener("127.0.0.1", ports[slot])
    peers = {i: SigningKey.from_seed(_seed(i)).public_bytes for i in range(len(ports))}
    direct = DirectTransport(
        SigningKey.from_seed(_seed(slot)),
        "bench-replicas",
        slot,
        addresses={i: f"127.0.0.1:{port}" for i, port in enumerate(ports)},
        peers=peers,
        listener=listener,
        max_message_bytes=64 << 20,
    )
    # as a node's links: sends on a thread of their own, timed as a stage worker times them
    ahead = SendAhead([direct], direct)
    transport = TimedTransport(ahead)
    runner = StageRunner(
        module=module,
        stage=s,
        stages=2,
        transport=transport,
        optimizer=optimizer_for(module),
        inbound=specs[0] if s else None,
        outbound=None if s else specs[0],
        loss_fn=nn.CrossEntropyLoss() if s else None,
        schedule="1f1b",
        lane=lane,
        lanes=len(lanes),
        batch_samples=MICRO_SIZE * sum(counts),
        first_micro_batch=sum(counts[:lane]),
        timeout_s=600.0,
    )
    first, count = sum(counts[:lane]), counts[lane]
    data = step_batches(sum(counts), steps + 1)
    exchange = [0.0]
    summed = runner._sum_lanes

    def timed(step: int) -> None:  # the gradient exchange's share of the step, for the table
        t0 = time.perf_counter()
        summed(step)
        exchange[0] += time.perf_counter() - t0

    runner._sum_lanes = timed  # type: ignore[method-assign]
    (out / f"ready-{slot}").touch()
    while not (out / "go").exists():
        time.sleep(0.01)
    ends: list[float] = []
    # each step's (compute_s, update_s, unit_overhead_s), as reported
    reports: list[tuple[float, float, float]] = []
    try:
        with Throttle(THROTTLES[lanes[lane]]):
            # the stage's fixed time per unit and micro-batch, measured before its first step
            # as a stage worker measures it (node/pipeline/worker.py)
            overhead = unit_overhead_s(
                module, torch.zeros(specs[0].shape if s else (MICRO_SIZE, WIDTH)), units=len(module)
            )
            for n, (xs, ys) in enumerate(data):
                mine = slice(first, first + count)
                transport.waited = 0.0
                t0 = time.perf_counter()
                runner.run_step(
                    n, count, inputs=xs[mine] if s == 0 else (), targets=ys[mine] if s else ()
                )
                transport.flush()  # as a node ends a step: what it sent has gone
                ends.append(time.perf_counter())
                compute_s = max(ends[-1] - t0 - transport.waited, 0.0)
                reports.append((compute_s, min(runner.update_s, compute_s), overhead))
        params = {str(i): p.detach().contiguous() for i, p in enumerate(module.parameters())}
        (out / f"params-{slot}.gft").write_bytes(encode_state(params))
    finally:
        ahead.close()
        direct.close()
        listener.close()
    (out / f"ends-{slot}.json").write_text(
        json.dumps({"ends": ends, "exchange_s": exchange[0], "reports": reports})
    )


def train(lanes: list[str], counts: list[int], steps: int, work: Path) -> dict[str, Any]:
    """1 warm-up step and ``steps`` timed ones on ``lanes`` sharing each step as ``counts``,
    every stage a process of its own."""
    from gpuflex.protocol.tensors import decode_state

    out = work / f"run-{'-'.join(lanes)}-{'-'.join(map(str, counts))}"
    out.mkdir(parents=True)
    slots = 2 * len(lanes)
    ports = [_free_port() for _ in range(slots)]
    cfg = json.dumps({"lanes": lanes, "counts": counts, "ports": ports, "steps": steps})
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--stage", str(i), "--cfg", cfg, "--work", str(out)]
        )
        for i in range(slots)
    ]
    try:
        give_up = time.monotonic() + 300
        while not all((out / f"ready-{i}").exists() for i in range(slots)):
            if time.monotonic() > give_up or any(p.poll() is not None for p in procs):
                raise SystemExit("a stage process did not start")
            time.sleep(0.05)
        (out / "go").touch()
        for i, proc in enumerate(procs):
            if proc.wait(1800) != 0:
                raise SystemExit(f"stage process {i} failed (exit {proc.returncode})")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    timing = [json.loads((out / f"ends-{i}.json").read_text()) for i in range(slots)]
    ends = timing[1]["ends"]  # the first pipeline's last stage
    step_s = (ends[-1] - ends[0]) / steps
    params = [decode_state((out / f"params-{i}.gft").read_bytes()) for i in range(slots)]
    return {
        "counts": counts,
        "step_s": round(step_s, 4),
        "samples_per_s": round(MICRO_SIZE * sum(counts) / step_s, 2),
        "exchange_s_per_step": [round(t["exchange_s"] / (steps + 1), 4) for t in timing],
        "reports": [t["reports"] for t in timing],
        "params": [[p[str(k)] for k in range(len(p))] for p in params],
    }


def reference(data: list[Any]) -> list[torch.Tensor]:
    """One process accumulating every micro-batch of each step."""
    model = nn.Sequential(*copy.deepcopy(units()))
    optimizer = optimizer_for(model)
    for xs, ys in data:
        optimizer.zero_grad()
        batch = sum(int(y.shape[0]) for y in ys)
        for x, y in zip(xs, ys, strict=True):
            (nn.CrossEntropyLoss()(model(x), y) * (y.shape[0] / batch)).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def max_rel_diff(got: list[list[torch.Tensor]], want: list[torch.Tensor]) -> float:
    params = [p for stage in got for p in stage]
    return max(
        float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
        for a, b in zip(params, want, strict=True)
    )


def measured_offer(
    name: str,
    costs: Any,
    stage: int,
    reports: list[list[float]],
    batch: int,
    micro: int,
    *,
    update: bool,
) -> NodeOffer:
    """A stage node's offer as the hub makes it from the stage's reports of its steps alone
    (hub/domain/pipelines/speeds.py: ``with_step`` over each report, the first steps left out as
    warm-up; offers.py: the median speed, update rate and fixed time per unit and micro-batch).
    ``update``: the reports say ``update_s`` and ``unit_overhead_s`` (False: as reports that say
    neither, each step's compute at one speed). ``batch`` samples a step in ``micro``
    micro-batches."""
    start, end = (0, STARTS[1]) if stage == 0 else (STARTS[1], len(costs))
    state = sum(c.state_bytes for c in costs[start:end])
    speed = StageSpeed()
    for k, (compute_s, update_s, overhead) in enumerate(reports, 1):
        speed = with_step(
            speed,
            step_flops=stage_step_flops(costs, start, end, batch),
            compute_s=compute_s,
            step=k,
            update_s=update_s if update else 0.0,
            state_bytes=state,
            unit_overhead_s=overhead if update else 0.0,
            unit_calls=micro * (end - start),
        )
    if speed.flops_per_s is None:
        raise SystemExit(f"stage {stage} of pipeline {name} measured too few steps")
    return NodeOffer(
        f"{name}{stage}", 1 << 40, speed.flops_per_s, 1e12, 1e-4,
        unit_overhead_s=speed.unit_overhead_s or 0.0,
        update_bytes_per_s=speed.update_bytes_per_s or 0.0,
    )  # fmt: skip


def planner_counts(
    alone: dict[str, dict[str, Any]], micro: int, *, update: bool = True
) -> list[int]:
    """The product's split of the step between the two pipelines, from what their stages
    measured alone (``measured_offer``), by hub/domain/pipelines/planning.balance."""
    costs = unit_costs()
    offers = []
    lanes = []
    for name in ("A", "B"):
        run = alone[name]
        nodes = [
            measured_offer(
                name, costs, s, run["reports"][s], MICRO_SIZE * micro, micro, update=update
            )
            for s in range(2)
        ]
        offers += nodes
        lane = evaluate_pipeline(
            costs, nodes, [STARTS[1], len(costs)], micro_batches=micro // 2, schedule="1f1b",
            batch_size=MICRO_SIZE * micro // 2,
        )  # fmt: skip
        if lane is None:
            raise SystemExit("the model does not fit the offers")
        lanes.append(lane)
    return [p.micro_batches for p in balance(costs, offers, lanes)]


def measure(micro: int, steps: int, work: Path) -> dict[str, Any]:
    """Runs 1-4 of the module's docstring at ``micro`` micro-batches a step."""
    alone = {name: train([name], [micro], steps, work) for name in ("A", "B")}
    bound = alone["A"]["samples_per_s"] + alone["B"]["samples_per_s"]
    even = train(["A", "B"], [micro // 2, micro // 2], steps, work)
    counts = planner_counts(alone, micro)
    split = train(["A", "B"], counts, steps, work)
    runs = {"A_alone": alone["A"], "B_alone": alone["B"], "even": even, "planner": split}
    speed_only = planner_counts(alone, micro, update=False)
    if speed_only != counts:
        runs["planner_speed_only"] = train(["A", "B"], speed_only, steps, work)
    want = reference(step_batches(micro, steps + 1))
    diff = max(max_rel_diff(split["params"][:2], want), max_rel_diff(split["params"][2:], want))
    for run in runs.values():
        run.pop("params")
        run.pop("reports")
    return {
        "micro_batches": micro,
        "capacity_bound_samples_per_s": round(bound, 2),
        "planner_counts": counts,
        "planner_counts_speed_only": speed_only,
        "equivalence_max_rel_diff": diff,
        "speed_spread": round(alone["A"]["samples_per_s"] / alone["B"]["samples_per_s"], 2),
        "vs_bound": {name: round(run["samples_per_s"] / bound, 3) for name, run in runs.items()
                     if name in ("even", "planner", "planner_speed_only")},
        "runs": runs,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro-batches", default="16,64")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "pipeline_replicas.json"))
    parser.add_argument("--stage", type=int, help=argparse.SUPPRESS)  # a stage's own process
    parser.add_argument("--cfg", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage is not None:
        cfg = json.loads(args.cfg)
        run_stage(
            args.stage, cfg["lanes"], cfg["counts"], cfg["ports"], cfg["steps"], Path(args.work)
        )
        return
    micros = [int(m) for m in args.micro_batches.split(",")]
    if args.steps < 5 or any(m < 2 or m % 2 for m in micros):
        raise SystemExit("--steps must be at least 5 and --micro-batches even counts of at least 2")
    torch.set_num_threads(1)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpuflex-replicas-") as tmp:
        configs = {f"{m}mb": measure(m, args.steps, Path(tmp)) for m in micros}
    head = configs[f"{micros[0]}mb"]
    ratios: dict[str, float] = {
        "throughput_vs_capacity_bound": head["vs_bound"]["planner"],
        "throughput_vs_capacity_bound_even_split": head["vs_bound"]["even"],
        "planner_split_vs_even": round(
            head["runs"]["planner"]["samples_per_s"] / head["runs"]["even"]["samples_per_s"], 3
        ),
    }
    for name, c in configs.items():
        ratios[f"throughput_vs_capacity_bound_{name}"] = c["vs_bound"]["planner"]
        if "planner_speed_only" in c["vs_bound"]:
            ratios[f"throughput_vs_capacity_bound_{name}_speed_only"] = c["vs_bound"][
                "planner_speed_only"
            ]
    result = {
        "name": "pipeline_replicas",
        "figures": {
            "capacity_bound_samples_per_s": head["capacity_bound_samples_per_s"],
            "planner_counts": head["planner_counts"],
            "equivalence_max_rel_diff": max(c["equivalence_max_rel_diff"] for c in configs.values()),
            "speed_spread": head["speed_spread"],
            "configs": configs,
        },
        "ratios": ratios,
        "targets": {"throughput_vs_capacity_bound": ">= 0.85", "equivalence_max_rel_diff": "<= 1e-5"},
        "setup": {
            "model": f"16 Linear units of width 512 (GELU between), micro-batches of {MICRO_SIZE},"
            f" {' and '.join(map(str, micros))} a step, Adam, 2 stages per pipeline, 1F1B",
            "throttles": THROTTLES,
            "transport": "direct (TCP on 127.0.0.1, node/pipeline/direct.py), one process per stage",
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
            "seconds": round(time.monotonic() - started, 1),
        },
    }  # fmt: skip
    for c in configs.values():
        print(f"\n{c['micro_batches']} micro-batches a step")
        print(f"{'run':<20} {'micro-batches':>14} {'step':>9} {'samples/s':>10} {'vs bound':>9}")
        for run_name, run in c["runs"].items():
            share = c["vs_bound"].get(run_name)
            print(
                f"{run_name:<20} {'+'.join(map(str, run['counts'])):>14} {run['step_s']:>8.3f}s"
                f" {run['samples_per_s']:>10} {'' if share is None else share:>9}"
            )
        print(f"capacity bound (A alone + B alone): {c['capacity_bound_samples_per_s']} samples/s;"
              f" equivalence with one process (max rel diff) {c['equivalence_max_rel_diff']:.1e}")  # fmt: skip
    print()
    for key, value in ratios.items():
        print(f"{key:<58} {value:>7}")
    print("target: throughput / capacity bound >= 0.85")
    Path(args.out).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
