"""Pipeline execution on loopback: this engine, directly between stages and over the hub's relay,
against torch.distributed.pipelining.

All run the same model (an MLP of ``--layers`` Linear+GELU units of width ``--width``), cut into
the same ``--stages`` contiguous stages, over the same ``--micro`` micro-batches of ``--batch``
samples a step, with the same schedule (GPipe and 1F1B), each stage in its own process:

- torch: ``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` over gloo (process group on
  127.0.0.1);
- gpuflex direct: ``node/pipeline`` stage runners whose tensors go straight from stage to stage
  (node/pipeline/direct.py: each stage listens on 127.0.0.1, every message signed, hashed and
  checked by its receiver);
- gpuflex relay: the same runners, their tensors through the relay of a hub (the app factory, in
  its own process on 127.0.0.1), every message signed, hashed and checked by the hub and the
  receiver.

Each run trains 1 warm-up step and ``--steps`` timed steps with the node's optimizer (Adam);
throughput is samples per second over the timed steps, measured on the last stage; CPU is every
process's user + system time over the timed steps (the relay's with the hub's). The engine's
parameters after every step are compared with single-process gradient accumulation over the same
micro-batches (``figures.equivalence_max_rel_diff``, the largest relative difference of any
parameter tensor, over both schedules and both paths). ``ratios.throughput_vs_torch_pipelining``
is the direct path's samples/s over torch's, ``ratios.throughput_relay_vs_torch_pipelining`` the
relay's, each the worse of the two schedules and the median over ``--repeat`` runs.

Then the planner against measured pipelines (bench/pipeline_planner.py): its configurations are
planned by the product's planner from what the node processes measured of themselves and of the
relay, run through a hub's relay, and ``ratios.step_time_predicted_vs_measured`` holds each one's
predicted over measured step time (``figures.step_time_ratio_median`` / ``_worst``);
``figures.peak_bytes_over_cap_max`` is the largest measured stage peak over its memory offer and
``figures.model_bytes_over_largest_cap`` the model's state over the largest offer. Two more
passes plan the configurations as the hub's offers would: on each node's benchmark speed
(``figures.step_time_ratio_median_benchmarks`` / ``_worst_benchmarks``), then on the speed
hub/policy/stage_speed.py measures from that pass's stages (``..._stage_speeds``);
``ratios.measured_step_stage_speeds_vs_benchmarks`` is each configuration's measured step on the
second over the first.

Usage: python bench/pipeline.py [--stages 4] [--micro 8] [--batch 64] [--width 512] [--layers 8]
    [--steps 10] [--repeat 1] [--planner-steps 4] [--planner-configs 0,3] [--planner-only | --no-planner]
    [--out bench/results/pipeline.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
JOB = "bench-pipeline"
SCHEDULES = ("gpipe", "1f1b")


# -- the shared workload ---------------------------------------------------------------------------


def units(cfg: dict[str, Any]) -> list[nn.Module]:
    """The model as an ordered list of units, identical in every process (seeded)."""
    torch.manual_seed(0)
    width, layers = cfg["width"], cfg["layers"]
    out: list[nn.Module] = []
    for i in range(layers):
        out.append(nn.Linear(width, width if i < layers - 1 else 10))
        if i < layers - 1:
            out.append(nn.GELU())
    return out


def starts(cfg: dict[str, Any]) -> list[int]:
    """Stage boundaries: every stage holds the same number of Linear layers (with their GELU)."""
    per = cfg["layers"] // cfg["stages"]
    return [2 * per * s for s in range(cfg["stages"])]


def step_data(cfg: dict[str, Any]) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    g = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(cfg["steps"] + 1):
        xs = [torch.randn(cfg["batch"], cfg["width"], generator=g) for _ in range(cfg["micro"])]
        ys = [torch.randint(0, 10, (cfg["batch"],), generator=g) for _ in range(cfg["micro"])]
        steps.append((xs, ys))
    return steps


def train_config() -> Any:
    from gpuflex.protocol.messages import TrainConfig

    return TrainConfig(1, 32, "adam", 1e-3, 0.0, 0.0, 0.9, 0.999, "cross_entropy", 0.0)


def reference(cfg: dict[str, Any]) -> list[torch.Tensor]:
    """Single-process gradient accumulation over the same micro-batches: the parameters after."""
    from gpuflex.node.trainer import make_optimizer

    torch.set_num_threads(1)  # the stages' kernels: one thread each
    model = nn.Sequential(*units(cfg))
    opt = make_optimizer(list(model.parameters()), train_config())
    loss_fn = nn.CrossEntropyLoss()
    for xs, ys in step_data(cfg):
        opt.zero_grad()
        for x, y in zip(xs, ys, strict=True):
            (loss_fn(model(x), y) / len(xs)).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def max_rel_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    if len(got) != len(want):
        raise SystemExit(f"{len(got)} parameter tensors came back, the model has {len(want)}")
    return max(
        float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
        for a, b in zip(got, want, strict=True)
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- torch.distributed.pipelining (one process per rank) ----------------------------------------


def torch_rank(cfg: dict[str, Any], rank: int, port: int, result: str) -> None:
    """One rank of torch's pipeline: each schedule in turn, on a fresh copy of its stage."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    world = cfg["stages"]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    bounds = [*starts(cfg), 2 * cfg["layers"] - 1]
    for schedule_name in SCHEDULES:
        module = nn.Sequential(*units(cfg)[bounds[rank] : bounds[rank + 1]])
        stage = PipelineStage(module, rank, world, torch.device("cpu"))
        kind = ScheduleGPipe if schedule_name == "gpipe" else Schedule1F1B
        # scale_grads (the default) divides the summed gradients by the micro-batches: the step's mean
        schedule = kind(stage, n_microbatches=cfg["micro"], loss_fn=nn.CrossEntropyLoss())
        opt = make_optimizer_for(module)
        started = 0.0
        for n, (xs, ys) in enumerate(step_data(cfg)):
            if n == 1:
                started = _timed_from_here()
            opt.zero_grad()
            if rank == 0:
                schedule.step(torch.cat(xs))
            elif rank == world - 1:
                schedule.step(target=torch.cat(ys), losses=[])
            else:
                schedule.step()
            opt.step()
        _write_stage(
            Path(result.format(schedule=schedule_name)), module, time.perf_counter() - started
        )
    dist.destroy_process_group()


def make_optimizer_for(module: nn.Module) -> Any:
    from gpuflex.node.trainer import make_optimizer

    return make_optimizer(list(module.parameters()), train_config())


#: this process's CPU seconds when its timed steps began
_CPU_FROM = [0.0]


def _timed_from_here() -> float:
    """Mark the start of the timed steps: the wall clock (returned) and this process's CPU time."""
    _CPU_FROM[0] = time.process_time()
    return time.perf_counter()


def _write_stage(out: Path, module: nn.Module, elapsed: float) -> None:
    from gpuflex.protocol.tensors import encode_state

    cpu_s = time.process_time() - _CPU_FROM[0]
    state = {f"p{i:03d}": p.detach() for i, p in enumerate(module.parameters())}
    (out.with_suffix(".gft")).write_bytes(encode_state(state))
    out.write_text(json.dumps({"elapsed_s": elapsed, "cpu_s": cpu_s}))


def _read_stages(outs: list[Path]) -> tuple[list[torch.Tensor], float]:
    from gpuflex.protocol.tensors import decode_state

    params: list[torch.Tensor] = []
    for out in outs:
        state = decode_state(out.with_suffix(".gft").read_bytes())
        params += [state[name].clone() for name in sorted(state)]
    return params, float(json.loads(outs[-1].read_text())["elapsed_s"])


def run_torch(cfg: dict[str, Any], work: Path) -> dict[str, tuple[list[torch.Tensor], float]]:
    port = free_port()
    result = str(work / "torch-{schedule}-%d.json")
    procs = [
        _child(["--torch-rank", str(r), "--port", str(port), "--result", result % r], cfg)
        for r in range(cfg["stages"])
    ]
    _wait_all(procs, "torch.distributed.pipelining")
    return {
        s: _read_stages([Path(result.format(schedule=s) % r) for r in range(cfg["stages"])])
        for s in SCHEDULES
    }


# -- gpuflex: a hub with the relay, and one process per stage ------------------------------------------


async def _serve_hub(data_dir: Path, jobs: Path, port_file: Path) -> None:
    """A hub on 127.0.0.1 whose relay serves every job written to ``jobs`` as ``<job>.json``
    (its stages' node ids, micro-batch count and boundary shapes), before it starts or after."""
    from aiohttp import web
    from gpuflex.hub.base.config import HubConfig
    from gpuflex.hub.server.app import create_app
    from gpuflex.hub.server.appkeys import RELAY

    app = create_app(
        HubConfig(
            data_dir=data_dir,
            port=0,
            long_poll_max_s=10.0,
            registrations_per_block=1000,
            probation_per_block=1000,
        )
    )
    _assign_jobs(app[RELAY].registry, jobs, set())
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port_file.write_text(str(site._server.sockets[0].getsockname()[1]))  # type: ignore[union-attr]
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    seen: set[str] = set()
    while not stop.is_set():
        _assign_jobs(app[RELAY].registry, jobs, seen)
        try:
            await asyncio.wait_for(stop.wait(), 0.05)
        except TimeoutError:
            pass
    await runner.cleanup()


def _assign_jobs(registry: Any, jobs: Path, seen: set[str]) -> None:
    from gpuflex.hub.model.relay import Crossing, RelayPlan

    for path in sorted(jobs.glob("*.json")):
        if path.stem in seen:
            continue
        plan = json.loads(path.read_text())
        registry.assign(
            path.stem,
            RelayPlan(
                stages=tuple(plan["stages"]),
                micro_batches=plan["micro"],
                boundaries=tuple(Crossing("float32", tuple(shape)) for shape in plan["boundaries"]),
            ),
        )
        seen.add(path.stem)


def write_job(
    jobs: Path, job: str, seeds: list[bytes], micro: int, boundaries: list[list[int]]
) -> None:
    """The relay plan of ``job`` for the hub: stage i run by the node of ``seeds[i]``."""
    from gpuflex.protocol.signing import SigningKey

    doc = {
        "stages": [SigningKey.from_seed(seed).fingerprint for seed in seeds],
        "micro": micro,
        "boundaries": boundaries,
    }
    tmp = jobs / f".{job}.tmp"
    tmp.write_text(json.dumps(doc))
    tmp.rename(jobs / f"{job}.json")  # whole, or not there: the hub reads it as it appears


def _register(url: str, seed: bytes) -> None:
    import http.client

    from gpuflex.protocol.messages import Benchmark, DeviceInfo, Hello
    from gpuflex.protocol.signing import SigningKey, new_nonce, seal
    from gpuflex.protocol.version import PROTOCOL_VERSION

    hello = Hello(
        software_version="0.1.0",
        protocol_version=PROTOCOL_VERSION,
        device=DeviceInfo(kind="cpu", name="bench", memory_bytes=1, threads=1),
        benchmark=Benchmark(
            samples_per_s=100.0,
            matmul_tflops_fp32=0.1,
            matmul_tflops_bf16=None,
            matmul_tflops_fp16=None,
            mem_bandwidth_gbs=1.0,
            h2d_gbs=None,
            d2h_gbs=None,
            reference_model="bench",
        ),
        timestamp=time.time(),
        nonce=new_nonce(),
    )
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(
        "POST",
        "/v1/nodes/register",
        body=seal(SigningKey.from_seed(seed), hello),
        headers={"Content-Type": "application/x-msgpack"},
    )
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(
            f"the hub refused a stage's registration: {resp.status} {resp.read()[:200]!r}"
        )
    conn.close()


def gpuflex_stage(cfg: dict[str, Any], stage: int, url: str, result: str) -> None:
    """One stage of this engine: each schedule in turn (its own job), on a fresh copy of its stage."""
    from gpuflex.node.pipeline.prefetch import Prefetch
    from gpuflex.node.pipeline.relay import RelayTransport
    from gpuflex.node.pipeline.stage import StageRunner, boundary_specs, cut
    from gpuflex.node.pipeline.transport import SendAhead
    from gpuflex.node.stagelinks import RECEIVE_AHEAD, SEND_POOL
    from gpuflex.protocol.signing import SigningKey

    torch.set_num_threads(1)
    last = stage == cfg["stages"] - 1
    for schedule in SCHEDULES:
        stages = cut(units(cfg), starts(cfg))
        specs = boundary_specs(stages, torch.zeros(cfg["batch"], cfg["width"]))
        module = stages[stage]

        def relay(schedule: str = schedule) -> RelayTransport:
            key = SigningKey.from_seed(_seed(stage))
            return RelayTransport(url, key, f"{JOB}-{schedule}", wait_s=5.0)

        # the node's relay links (node/stagelinks.py): sends on a pool, receives asked ahead
        senders = [relay() for _ in range(SEND_POOL)]
        receiver = Prefetch(relay, depth=RECEIVE_AHEAD)
        transport = SendAhead(senders, receiver)
        runner = StageRunner(
            module=module,
            stage=stage,
            stages=cfg["stages"],
            transport=transport,
            optimizer=make_optimizer_for(module),
            inbound=specs[stage - 1] if stage else None,
            outbound=None if last else specs[stage],
            loss_fn=nn.CrossEntropyLoss() if last else None,
            schedule=schedule,
        )
        started = 0.0
        for n, (xs, ys) in enumerate(step_data(cfg)):
            if n == 1:
                started = _timed_from_here()
            runner.run_step(
                n, cfg["micro"], inputs=xs if stage == 0 else (), targets=ys if last else ()
            )
            transport.flush()  # a node's step ends once what it sent has gone
        elapsed = time.perf_counter() - started
        transport.close()
        for sender in senders:
            sender.close()
        receiver.close()
        _write_stage(Path(result.format(schedule=schedule)), module, elapsed)


def _seed(stage: int) -> bytes:
    return bytes([stage + 1]) * 32


def start_hub(work: Path, cfg: dict[str, Any]) -> tuple[subprocess.Popen[bytes], str, Path]:
    """A hub process, its URL and the folder its relay's jobs are written to."""
    jobs, port_file = work / "jobs", work / "port"
    jobs.mkdir(exist_ok=True)
    hub = _child(
        ["--hub", str(work / "hub"), "--jobs", str(jobs), "--port-file", str(port_file)], cfg
    )
    give_up = time.monotonic() + 90
    while not port_file.exists() or not port_file.read_text():
        if hub.poll() is not None or time.monotonic() > give_up:
            hub.terminate()
            raise SystemExit("the hub did not start")
        time.sleep(0.1)
    return hub, f"http://127.0.0.1:{port_file.read_text()}", jobs


def run_gpuflex(cfg: dict[str, Any], work: Path) -> dict[str, tuple[list[torch.Tensor], float]]:
    from gpuflex.node.pipeline.stage import boundary_specs, cut

    specs = boundary_specs(cut(units(cfg), starts(cfg)), torch.zeros(cfg["batch"], cfg["width"]))
    hub, url, jobs = start_hub(work, cfg)
    result = str(work / "gpuflex-{schedule}-%d.json")
    try:
        for schedule in SCHEDULES:  # one job per schedule, the same stages
            seeds = [_seed(s) for s in range(cfg["stages"])]
            write_job(
                jobs, f"{JOB}-{schedule}", seeds, cfg["micro"], [list(spec.shape) for spec in specs]
            )
        for s in range(cfg["stages"]):
            _register(url, _seed(s))
        hub_cpu = _cpu_s(hub.pid)
        procs = [
            _child(["--stage", str(s), "--url", url, "--result", result % s], cfg)
            for s in range(cfg["stages"])
        ]
        _wait_all(procs, "gpuflex stages")
        (work / "hub-cpu.json").write_text(json.dumps({"cpu_s": _cpu_s(hub.pid) - hub_cpu}))
    finally:
        hub.terminate()
        hub.wait(30)
    return {
        s: _read_stages([Path(result.format(schedule=s) % r) for r in range(cfg["stages"])])
        for s in SCHEDULES
    }


def run_planner(work: Path, steps: int, configs: list[int] | None = None) -> dict[str, Any]:
    """bench/pipeline_planner.py's configurations: each node process probes its speed, the
    relay's link is probed, the product's planner plans every configuration, and the nodes run
    them one after another; the figures of the predictions against the measurements."""
    import pipeline_planner as pp

    nodes = len(pp.THROTTLES)
    cfg = {"steps": steps}
    hub, url, jobs = start_hub(work, cfg)
    try:
        for k in range(nodes):
            _register(url, _seed(k))
        for samples in pp.LINK_SIZES:
            write_job(jobs, f"link-{samples}", [_seed(0), _seed(1)], 1, [[samples, pp.WIDTH]])
        procs = [
            _child(["--node", str(k), "--url", url, "--work", str(work)], cfg) for k in range(nodes)
        ]
        speeds = [
            json.loads(_wait_file(work / f"speed-{k}.json", procs).read_text())
            for k in range(nodes)
        ]
        link = pp.fit_link([json.loads(_wait_file(work / "link-0.json", procs).read_text())])
        state = pp.state_bytes()
        chosen = [pp.CONFIGS[i] for i in configs] if configs else pp.CONFIGS
        benchmarked = {k: s["bench_flops_per_s"] for k, s in enumerate(speeds)}
        first = [pp.plan_doc(c, pp.plan(c, speeds, link, benchmarked), state) for c in chosen]
        results0 = _run_pass(work, jobs, procs, "bench", first)
        plans = [pp.plan_doc(c, pp.plan(c, speeds, link), state) for c in chosen]
        results = _run_pass(work, jobs, procs, "plan", plans)
        # the same configurations planned on the speeds the hub measures from the first pass
        measured, updates, overheads = pp.stage_speeds(first, results0)
        replans = [
            pp.plan_doc(c, pp.plan(c, speeds, link, measured, updates, overheads), state)
            for c in chosen
        ]
        results2 = _run_pass(work, jobs, procs, "replan", replans)
        _wait_all(procs, "planner configurations")
    finally:
        hub.terminate()
        hub.wait(30)
    out = pp.figures(plans, results, state)
    out["link"] = link
    out["speeds"] = speeds
    out["stage_speeds"] = {f"node{k}": f for k, f in sorted(measured.items())}
    out["stage_update_bytes_per_s"] = {f"node{k}": u for k, u in sorted(updates.items())}
    out["stage_unit_overhead_s"] = {f"node{k}": o for k, o in sorted(overheads.items())}
    out["replan"] = pp.figures(replans, results2, state)
    out["bench"] = pp.figures(first, results0, state)
    return out


def _run_pass(
    work: Path, jobs: Path, procs: list[subprocess.Popen[bytes]], tag: str, plans: list[Any]
) -> dict[tuple[int, int], Any]:
    """The node processes run ``plans`` (relay jobs ``<tag>-<n>``): each stage's result."""
    import pipeline_planner as pp

    for n, doc in enumerate(plans):
        b = pp.BATCH // doc["micro"]
        write_job(
            jobs,
            f"{tag}-{n}",
            [_seed(k) for k in doc["nodes"]],
            doc["micro"],
            [[b, pp.WIDTH]] * (len(doc["nodes"]) - 1),
        )
    time.sleep(0.2)
    (work / f"{tag}s.tmp").write_text(json.dumps(plans))
    (work / f"{tag}s.tmp").rename(work / f"{tag}s.json")
    return {
        (n, k): json.loads(_wait_file(work / f"stage-{tag}-{n}-{k}.json", procs).read_text())
        for n, doc in enumerate(plans)
        for k in doc["nodes"]
    }


def _wait_file(path: Path, procs: list[subprocess.Popen[bytes]]) -> Path:
    give_up = time.monotonic() + 240
    while not path.exists():
        if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > give_up:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            raise SystemExit(f"a node process ended, or {path.name} did not appear")
        time.sleep(0.05)
    return path


# -- gpuflex, direct: each stage listens, the stages connect to each other (no hub) ------------------


def gpuflex_direct_stage(cfg: dict[str, Any], stage: int, addresses: str, result: str) -> None:
    """One stage over direct connections (node/pipeline/direct.py): its listener on its address,
    each schedule in turn (its own job), on a fresh copy of its stage."""
    from gpuflex.node.pipeline.direct import DirectTransport, StageListener, parse_address
    from gpuflex.node.pipeline.stage import StageRunner, boundary_specs, cut
    from gpuflex.node.pipeline.transport import SendAhead
    from gpuflex.protocol.signing import SigningKey
    from gpuflex.protocol.tensors import max_encoded_size

    torch.set_num_threads(1)
    where = {int(s): a for s, a in json.loads(addresses).items()}
    listener = StageListener(*parse_address(where[stage]))
    peers = {s: SigningKey.from_seed(_seed(s)).public_bytes for s in range(cfg["stages"])}
    last = stage == cfg["stages"] - 1
    for schedule in SCHEDULES:
        stages = cut(units(cfg), starts(cfg))
        specs = boundary_specs(stages, torch.zeros(cfg["batch"], cfg["width"]))
        module = stages[stage]
        direct = DirectTransport(
            SigningKey.from_seed(_seed(stage)),
            f"{JOB}-{schedule}",
            stage,
            addresses=where,
            peers=peers,
            listener=listener,
            max_message_bytes=max(max_encoded_size((spec,)) for spec in specs),
        )
        transport = SendAhead([direct], direct)  # a node's direct links send on their own thread
        runner = StageRunner(
            module=module,
            stage=stage,
            stages=cfg["stages"],
            transport=transport,
            optimizer=make_optimizer_for(module),
            inbound=specs[stage - 1] if stage else None,
            outbound=None if last else specs[stage],
            loss_fn=nn.CrossEntropyLoss() if last else None,
            schedule=schedule,
        )
        started = 0.0
        for n, (xs, ys) in enumerate(step_data(cfg)):
            if n == 1:
                started = _timed_from_here()
            runner.run_step(
                n, cfg["micro"], inputs=xs if stage == 0 else (), targets=ys if last else ()
            )
            transport.flush()  # a node's step ends once what it sent has gone
        elapsed = time.perf_counter() - started
        transport.close()
        direct.close()
        _write_stage(Path(result.format(schedule=schedule)), module, elapsed)
    listener.close()


def run_gpuflex_direct(
    cfg: dict[str, Any], work: Path
) -> dict[str, tuple[list[torch.Tensor], float]]:
    addresses = json.dumps({s: f"127.0.0.1:{free_port()}" for s in range(cfg["stages"])})
    result = str(work / "direct-{schedule}-%d.json")
    procs = [
        _child(["--direct-stage", str(s), "--addresses", addresses, "--result", result % s], cfg)
        for s in range(cfg["stages"])
    ]
    _wait_all(procs, "gpuflex direct stages")
    return {
        s: _read_stages([Path(result.format(schedule=s) % r) for r in range(cfg["stages"])])
        for s in SCHEDULES
    }


def _cpu_s(pid: int) -> float:
    """A process's CPU seconds so far (user + system, Linux's /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_figures(cfg: dict[str, Any], work: Path) -> dict[str, dict[str, float]]:
    """CPU milliseconds per timed step, all stage processes together, per path and schedule; the
    relay's includes the hub's (measured over both schedules' warm-up and timed steps)."""
    hub = json.loads((work / "hub-cpu.json").read_text())["cpu_s"]
    out: dict[str, dict[str, float]] = {}
    for schedule in SCHEDULES:
        row = {}
        for path, prefix in (("torch", "torch"), ("relay", "gpuflex"), ("direct", "direct")):
            files = [work / f"{prefix}-{schedule}-{r}.json" for r in range(cfg["stages"])]
            cpu = sum(float(json.loads(f.read_text())["cpu_s"]) for f in files)
            if path == "relay":
                cpu += hub / len(SCHEDULES) * cfg["steps"] / (cfg["steps"] + 1)
            row[f"{path}_cpu_ms_per_step"] = round(1000 * cpu / cfg["steps"], 1)
        row["relay_hub_cpu_ms_per_step"] = round(
            1000 * hub / len(SCHEDULES) / (cfg["steps"] + 1), 1
        )
        out[schedule] = row
    return out


def message_costs(cfg: dict[str, Any], repeat: int = 500) -> dict[str, float]:
    """Microseconds of CPU each piece of one message takes in this process (one activation of
    the bench's shape): what the stages pay per message beyond torch's copy onto the wire."""
    import hashlib

    from gpuflex.node.pipeline.sealed import encode_tensor, open_body, open_header, seal_header
    from gpuflex.node.pipeline.transport import MessageKey
    from gpuflex.protocol.signing import SigningKey
    from gpuflex.protocol.tensors import TensorSpec

    torch.set_num_threads(1)
    signer = SigningKey.from_seed(_seed(0))
    key = MessageKey(1, 0, "activation", 0, 1)
    tensor = torch.randn(cfg["batch"], cfg["width"])
    spec = TensorSpec("activation", "float32", tuple(tensor.shape))
    body = encode_tensor(key, tensor)
    sealed = seal_header(signer, JOB, key, body)
    hdr, _ = open_header(sealed, job_id=JOB, peers={0: signer.public_bytes})
    pieces = {
        "encode": lambda: encode_tensor(key, tensor),
        "sha256": lambda: hashlib.sha256(body).digest(),
        "seal_header": lambda: seal_header(signer, JOB, key, body),
        "open_header": lambda: open_header(sealed, job_id=JOB, peers={0: signer.public_bytes}),
        "open_body": lambda: open_body(hdr, bytearray(body), key, spec),
        "torch_copy": lambda: tensor.clone(),
    }
    out = {}
    for name, fn in pieces.items():
        fn()
        began = time.process_time()
        for _ in range(repeat):
            fn()
        out[f"message_{name}_us"] = round(1e6 * (time.process_time() - began) / repeat, 1)
    return out


def direct_figures(rows: dict[str, Any]) -> dict[str, Any]:
    """The ratios of the direct path (the product's best) and of the relay path, per schedule and
    the worse schedule's."""
    direct = {
        s: r["gpuflex_direct_samples_per_s"] / r["torch_samples_per_s"] for s, r in rows.items()
    }
    relay = {s: r["gpuflex_samples_per_s"] / r["torch_samples_per_s"] for s, r in rows.items()}
    return {
        "throughput_vs_torch_pipelining": round(min(direct.values()), 3),
        **{f"throughput_vs_torch_pipelining_{s}": round(v, 3) for s, v in direct.items()},
        "throughput_relay_vs_torch_pipelining": round(min(relay.values()), 3),
        **{f"throughput_relay_vs_torch_pipelining_{s}": round(v, 3) for s, v in relay.items()},
    }


def median_ratios(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Each ratio's median over the runs, each run's ratio taken between figures measured minutes
    apart (the load of a shared machine moves less within a run than across runs)."""
    import statistics

    each = [direct_figures(run) for run in runs]
    return {name: round(statistics.median(r[name] for r in each), 3) for name in each[0]}


def cpu_bounds(rows: dict[str, Any]) -> dict[str, float]:
    """Torch's CPU per step over ours, per path and schedule: the throughput ratio when every core
    is busy (the stages and the hub share them) and the CPU a step takes decides."""
    return {
        f"{s}_{path}_cpu_bound_vs_torch": round(
            r["torch_cpu_ms_per_step"] / r[f"{path}_cpu_ms_per_step"], 3
        )
        for s, r in rows.items()
        for path in ("direct", "relay")
    }


def median_rows(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the repeated runs (the largest difference for the equivalence)."""
    import statistics

    out: dict[str, Any] = {}
    for schedule in runs[0]:
        row = {}
        for name in runs[0][schedule]:
            values = [run[schedule][name] for run in runs]
            row[name] = (
                max(values)
                if name.endswith("max_rel_diff")
                else round(statistics.median(values), 1)
            )
        out[schedule] = row
    return out


# -- orchestration ------------------------------------------------------------------------------------


def _child(args: list[str], cfg: dict[str, Any]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, __file__, "--cfg", json.dumps(cfg), *args], env=env)


def _wait_all(procs: list[subprocess.Popen[bytes]], what: str) -> None:
    give_up = time.monotonic() + 240
    for p in procs:
        try:
            code = p.wait(max(1.0, give_up - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None
        if code != 0:
            for q in procs:
                if q.poll() is None:
                    q.kill()
                    q.wait()
            raise SystemExit(f"{what}: a process ended with {code}")


def measure(base: dict[str, Any]) -> dict[str, Any]:
    want = reference(base)
    samples = base["steps"] * base["micro"] * base["batch"]
    with tempfile.TemporaryDirectory(prefix="gpuflex-bench-pipeline-") as tmp:
        theirs = run_torch(base, Path(tmp))
        ours = run_gpuflex(base, Path(tmp))
        direct = run_gpuflex_direct(base, Path(tmp))
        cpu = cpu_figures(base, Path(tmp))
    return {
        schedule: {
            **cpu[schedule],
            "torch_samples_per_s": round(samples / theirs[schedule][1], 1),
            "gpuflex_samples_per_s": round(samples / ours[schedule][1], 1),
            "gpuflex_direct_samples_per_s": round(samples / direct[schedule][1], 1),
            "gpuflex_max_rel_diff": max(
                max_rel_diff(ours[schedule][0], want), max_rel_diff(direct[schedule][0], want)
            ),
            "torch_max_rel_diff": max_rel_diff(theirs[schedule][0], want),
        }
        for schedule in SCHEDULES
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=1, help="runs; each figure is their median")
    parser.add_argument(
        "--planner-steps",
        type=int,
        default=4,
        help="timed steps of each planner configuration (after 1 warm-up step)",
    )
    parser.add_argument(
        "--planner-configs",
        type=lambda text: [int(i) for i in text.split(",")],
        help="only these of bench/pipeline_planner.py's CONFIGS (indices, comma-separated)",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--planner-only",
        action="store_true",
        help="only the planner's predictions (the throughput figures already in --out are kept)",
    )
    which.add_argument("--no-planner", action="store_true", help="only the throughput comparison")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "pipeline.json"
    )
    for hidden in (
        "--cfg",
        "--torch-rank",
        "--port",
        "--result",
        "--hub",
        "--jobs",
        "--port-file",
        "--stage",
        "--url",
        "--node",
        "--work",
        "--direct-stage",
        "--addresses",
    ):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cfg is not None:
        _run_child(args)
        return
    if args.layers % args.stages:
        raise SystemExit(f"--layers {args.layers} does not split into {args.stages} equal stages")
    base = {k: getattr(args, k) for k in ("stages", "micro", "batch", "width", "layers", "steps")}
    if not args.planner_only:
        started = time.monotonic()
        runs = [measure(base) for _ in range(max(1, args.repeat))]
        report(base, median_rows(runs), args.out, time.monotonic() - started, runs=runs)
    if not args.no_planner:
        result = json.loads(args.out.read_text()) if args.out.exists() else {"name": "pipeline"}
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="gpuflex-bench-planner-") as tmp:
            planner = run_planner(Path(tmp), args.planner_steps, args.planner_configs)
        report_planner(result, planner, time.monotonic() - started)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


def _run_child(args: argparse.Namespace) -> None:
    cfg = json.loads(args.cfg)
    if args.torch_rank is not None:
        torch_rank(cfg, int(args.torch_rank), int(args.port), args.result)
    elif args.direct_stage is not None:
        gpuflex_direct_stage(cfg, int(args.direct_stage), args.addresses, args.result)
    elif args.hub is not None:
        asyncio.run(_serve_hub(Path(args.hub), Path(args.jobs), Path(args.port_file)))
    elif args.node is not None:
        import pipeline_planner as pp

        pp.run_node(int(args.node), args.url, Path(args.work), _seed, int(cfg["steps"]))
    else:
        gpuflex_stage(cfg, int(args.stage), args.url, args.result)


def report(
    base: dict[str, Any],
    rows: dict[str, Any],
    out: Path,
    wall_s: float,
    *,
    runs: list[dict[str, Any]] | None = None,
) -> None:
    print(
        f"{base['stages']} stages of an MLP ({base['layers']} Linear {base['width']}-wide), {base['micro']} "
        f"micro-batches of {base['batch']}, {base['steps']} timed steps, Adam; every stage its own process"
    )
    print(
        f"{'schedule':<9} {'torch samples/s':>16} {'direct samples/s':>17} {'ratio':>6} "
        f"{'relay samples/s':>16} {'ratio':>6} {'max rel diff':>13}"
    )
    for schedule, row in rows.items():
        torch_sps = row["torch_samples_per_s"]
        print(
            f"{schedule:<9} {torch_sps:>16.1f} {row['gpuflex_direct_samples_per_s']:>17.1f} "
            f"{row['gpuflex_direct_samples_per_s'] / torch_sps:>6.2f} "
            f"{row['gpuflex_samples_per_s']:>16.1f} {row['gpuflex_samples_per_s'] / torch_sps:>6.2f} "
            f"{row['gpuflex_max_rel_diff']:>13.2e}"
        )
    for schedule, row in rows.items():
        print(
            f"{schedule:<9} CPU ms a step, every process: torch {row['torch_cpu_ms_per_step']:.0f}, "
            f"direct {row['direct_cpu_ms_per_step']:.0f}, relay {row['relay_cpu_ms_per_step']:.0f} "
            "(stages and hub)"
        )
    ratios = median_ratios(runs or [rows])
    # figures other parts of this bench write stay as they are
    result = json.loads(out.read_text()) if out.exists() else {}
    result["name"] = "pipeline"
    result["figures"] = {
        **result.get("figures", {}),
        "equivalence_max_rel_diff": max(r["gpuflex_max_rel_diff"] for r in rows.values()),
        "torch_pipelining_max_rel_diff": max(r["torch_max_rel_diff"] for r in rows.values()),
        **{
            f"{s}_{k}": v
            for s, r in rows.items()
            for k, v in r.items()
            if k.endswith(("per_s", "per_step"))
        },
        **base,
        "wall_s": round(wall_s, 1),
    }
    result["figures"].update(cpu_bounds(rows))
    each = [direct_figures(run) for run in runs or [rows]]
    result["figures"].update(
        {f"each_run_{name}": [r[name] for r in each] for name in ratios if name.endswith(SCHEDULES)}
    )
    result["figures"].update(message_costs(base))
    result["ratios"] = {**result.get("ratios", {}), **ratios}
    result["machine"] = (
        f"{platform.machine()}, {os.cpu_count()} cpus, load avg {os.getloadavg()[0]:.1f}, "
        f"python {platform.python_version()}, torch {torch.__version__}"
    )
    result["notes"] = (
        "loopback, CPU, one torch thread per stage process; gpuflex direct: each stage listens and the "
        "stages send each other their tensors over kept TCP connections (node/pipeline/direct.py), every "
        "message sealed by its node and checked by the receiver; gpuflex relay: through the hub's relay "
        "(POST then long-poll GET, each message sealed by its node and checked by the hub and the "
        "receiver); torch's over gloo point-to-point; throughput_vs_torch_pipelining = the direct path's "
        "ratio, throughput_relay_vs_torch_pipelining = the relay's, each the worse schedule's; figures "
        "are medians over --repeat runs; equivalence = the largest relative difference of any parameter "
        "tensor after 1 + steps steps vs single-process gradient accumulation over the same "
        "micro-batches, both paths"
    )
    print(
        f"throughput vs torch.distributed.pipelining: direct {ratios['throughput_vs_torch_pipelining']:.2f}, "
        f"relay {ratios['throughput_relay_vs_torch_pipelining']:.2f}; equivalence max rel diff "
        f"{result['figures']['equivalence_max_rel_diff']:.2e}; {wall_s:.0f} s"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


def _planner_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'configuration':<26} {'stages':>6} {'nodes':<14} {'predicted s':>11} {'measured s':>10}"
        f" {'ratio':>6} {'peak/cap':>8}"
    )
    for row in rows:
        print(
            f"{row['name']:<26} {row['stages']:>6} {','.join(map(str, row['nodes'])):<14}"
            f" {row['predicted_step_s']:>11.3f} {row['measured_step_s']:>10.3f} {row['ratio']:>6.2f}"
            f" {row['peak_over_cap']:>8.2f}"
        )


def report_planner(result: dict[str, Any], planner: dict[str, Any], wall_s: float) -> None:
    """Prints the planner's predictions against the measurements and adds them to ``result``:
    planned on the probed speeds, then again on the speeds the hub measured from those stages."""
    print("planned on each node's benchmark speed (the hub's offer before it measured a stage):")
    _planner_table(planner["bench"]["rows"])
    print("planned on each node's probed speed:")
    _planner_table(planner["rows"])
    replan, bench = planner["replan"], planner["bench"]
    print(
        "planned again on each node's speed measured from its stages (hub/policy/stage_speed.py):"
    )
    _planner_table(replan["rows"])
    figures = result.setdefault("figures", {})
    ratios = result.setdefault("ratios", {})
    figures["step_time_ratio_median_benchmarks"] = bench["step_time_ratio_median"]
    figures["step_time_ratio_worst_benchmarks"] = bench["step_time_ratio_worst"]
    ratios["step_time_predicted_vs_measured_benchmarks"] = bench["ratios"]
    figures["step_time_ratio_median_stage_speeds"] = replan["step_time_ratio_median"]
    figures["step_time_ratio_worst_stage_speeds"] = replan["step_time_ratio_worst"]
    ratios["step_time_predicted_vs_measured_stage_speeds"] = replan["ratios"]
    # the measured step of each configuration planned on stage speeds over planned on benchmarks
    faster = [
        round(b["measured_step_s"] / a["measured_step_s"], 3)
        for a, b in zip(bench["rows"], replan["rows"], strict=True)
    ]
    ratios["measured_step_stage_speeds_vs_benchmarks"] = faster
    figures["measured_step_stage_speeds_vs_benchmarks_median"] = statistics.median(faster)
    for key in (
        "step_time_ratio_median",
        "step_time_ratio_worst",
        "model_bytes_over_largest_cap",
        "peak_bytes_over_cap_max",
    ):
        figures[key] = planner[key]
    figures["planner_wall_s"] = round(wall_s, 1)
    ratios["step_time_predicted_vs_measured"] = planner["ratios"]
    result["planner"] = {
        "configurations": planner["rows"],
        "configurations_on_benchmarks": bench["rows"],
        "configurations_on_stage_speeds": replan["rows"],
        "link": planner["link"],
        "node_speeds": planner["speeds"],
        "stage_speeds": planner["stage_speeds"],
        "notes": PLANNER_NOTES,
    }
    print(
        f"predicted / measured step time: median {planner['step_time_ratio_median']:.2f}, worst"
        f" {planner['step_time_ratio_worst']:.2f}; on benchmarks: median"
        f" {bench['step_time_ratio_median']:.2f}, worst {bench['step_time_ratio_worst']:.2f};"
        f" on stage speeds: median"
        f" {replan['step_time_ratio_median']:.2f}, worst {replan['step_time_ratio_worst']:.2f};"
        f" measured step on stage speeds / on benchmarks: median"
        f" {figures['measured_step_stage_speeds_vs_benchmarks_median']:.2f}; model state / largest cap"
        f" {planner['model_bytes_over_largest_cap']:.2f}; peak / cap at most"
        f" {planner['peak_bytes_over_cap_max']:.2f}; {wall_s:.0f} s"
    )


PLANNER_NOTES = (
    "bench/pipeline_planner.py: per configuration, hub/policy/pipeline_plan.plan_pipelines over"
    " protocol/modelanalysis.analyse_units chooses the stages, nodes and units (the configuration's"
    " micro-batch count and schedule, one pipeline); each node is a process slowed by a throttle"
    " (every aten op stretched, the difference slept), whose speed (FLOP/s, time per unit and"
    " micro-batch, optimizer bytes/s) it measured on the model's units under its throttle; the link"
    " is one message through this hub's relay (POST + GET) at two sizes; measured step = median of"
    " the last stage's timed steps; peak = the bytes of the tensors a stage holds (parameters,"
    " gradients, optimizer state, saved activations and held outputs, each storage once);"
    " configurations_on_benchmarks: the same configurations planned on the speed the hub offers"
    " before a node ran a stage (node/benchmark.py's reference-model samples/s under the node's"
    " throttle times the reference model's FLOPs per sample); configurations_on_stage_speeds:"
    " planned again, each node offering the speed hub/policy/stage_speed.py derives from its"
    " stages' compute times in the benchmark-planned pass (its stage steps' FLOPs over their time"
    " less sending and waiting; median, warm-up left out); both with no fixed time per unit and the"
    " update priced in FLOPs, as the hub's offers are"
)


if __name__ == "__main__":
    main()
