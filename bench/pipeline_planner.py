"""The planner's predictions against measured pipelines (bench/pipeline.py runs this part too).

For each configuration in ``CONFIGS`` (which nodes are offered, the memory each offers, the
micro-batch count and the schedule), the product's planner (``plan_pipelines`` over
``analyse_units``) chooses the stages, their nodes and their units; the stages then train that
plan, each in its own process, through the relay of a real hub on 127.0.0.1, and the measured
step time is compared with the planner's prediction.

What the planner is given is measured, the way the hub would measure it:

- a node's speed: each node process times forward + backward of the job's own units (the whole
  model) at two micro-batch sizes under its own throttle, and the slope and intercept give its
  FLOP/s and its fixed time per unit and micro-batch; it times the node's Adam step on the
  model's state too (bytes of state per second);
- the link: one message's time through this hub's relay, timed at two sizes by two node
  processes sending a tensor back and forth, each waiting in its GET for the other's POST (as a
  pipeline's stages do); the intercept is split into the two nodes' round trips and the slope
  gives the bandwidth.

The configurations run three times: planned on the speeds probed above, on each node's
benchmark speed as the hub offers it before a node ran a stage, and on the speeds the hub
measures from the stages of the benchmark-planned pass (``stage_speeds``), the last two priced
as the hub's offers are (no fixed time per unit, the update in FLOPs).

A node is slowed by a throttle (``Throttle``): every aten op it runs takes ``factor`` times as
long, the difference slept. A throttled node uses no more CPU than an unthrottled one, so the
stages of a pipeline on this 2-core machine slow each other less than equally busy processes
would, and what the planner is tested on is its model of a pipeline, not the machine's sharing.

A stage's memory is measured as the bytes of the tensors it holds: its parameters, gradients and
optimizer state, plus every tensor autograd saves for a backward pass and every activation it
keeps until its gradient comes back (each storage once; ``Meter``), sampled at every save, every
activation sent, every gradient accumulated and every step's end. docs/pipeline.md says why
this and not the process's RSS.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

#: the model: ``LAYERS`` Linear units of ``WIDTH`` (each but the last followed by a GELU unit)
WIDTH = 512
LAYERS = 16
BATCH = 128
OPTIMIZER = "adam"
#: each node's throttle: every aten op takes this many times as long
THROTTLES = (10.0, 10.0, 15.0, 15.0, 20.0, 25.0)
#: micro-batch sizes a node's speed probe times (the slope between them is its FLOP/s)
PROBE_SIZES = (16, 64)
#: activation sizes (samples of WIDTH floats) the relay's link probe times
LINK_SIZES = (16, 64)


@dataclass(frozen=True)
class Config:
    """One pipeline to plan and run: the nodes offered (by index into ``THROTTLES``) with the
    memory each offers, as a fraction of the model's state (parameters, gradients, Adam's two
    moments), the micro-batch count and the schedule."""

    name: str
    nodes: tuple[int, ...]
    caps: tuple[float, ...]
    micro: int
    schedule: str


CONFIGS: tuple[Config, ...] = (
    Config("4 even caps, m4 gpipe", (0, 1, 2, 3), (0.333, 0.333, 0.333, 0.333), 4, "gpipe"),
    Config("4 even caps, m4 1f1b", (0, 1, 2, 3), (0.333, 0.333, 0.333, 0.333), 4, "1f1b"),
    Config("4 even caps, m8 1f1b", (0, 1, 2, 3), (0.333, 0.333, 0.333, 0.333), 8, "1f1b"),
    Config("4 slow, m2 gpipe", (2, 3, 4, 5), (0.333, 0.333, 0.333, 0.333), 2, "gpipe"),
    Config("5 mixed caps, m4 gpipe", (0, 1, 2, 4, 5), (0.33, 0.2, 0.33, 0.33, 0.25), 4, "gpipe"),
    Config("5 mixed caps, m8 1f1b", (0, 1, 2, 4, 5), (0.33, 0.2, 0.33, 0.33, 0.25), 8, "1f1b"),
    Config("5 fast small, m4 1f1b", (0, 1, 3, 4, 5), (0.2, 0.2, 0.333, 0.333, 0.333), 4, "1f1b"),
    Config("6 tight, m2 1f1b", (0, 1, 2, 3, 4, 5), (0.25, 0.25, 0.2, 0.2, 0.25, 0.25), 2, "1f1b"),
    Config("6 tight, m4 gpipe", (0, 1, 2, 3, 4, 5), (0.25, 0.25, 0.2, 0.2, 0.25, 0.25), 4, "gpipe"),
    Config("6 tight, m8 1f1b", (0, 1, 2, 3, 4, 5), (0.25, 0.25, 0.2, 0.2, 0.25, 0.25), 8, "1f1b"),
    Config(
        "6 uneven, m8 gpipe", (0, 1, 2, 3, 4, 5), (0.333, 0.17, 0.2, 0.333, 0.2, 0.25), 8, "gpipe"
    ),
    Config("5 slowest first, m2 1f1b", (5, 4, 3, 2, 1), (0.25, 0.25, 0.25, 0.25, 0.25), 2, "1f1b"),
)


def units() -> list[nn.Module]:
    """The model as an ordered list of units, identical in every process (seeded)."""
    torch.manual_seed(0)
    out: list[nn.Module] = []
    for i in range(LAYERS):
        out.append(nn.Linear(WIDTH, WIDTH if i < LAYERS - 1 else 10))
        if i < LAYERS - 1:
            out.append(nn.GELU())
    return out


def unit_costs() -> tuple[Any, ...]:
    """The units' measured costs (protocol/modelanalysis.py), as the hub would analyse the job."""
    return _costs(WIDTH, LAYERS)


@functools.cache
def _costs(width: int, layers: int) -> tuple[Any, ...]:
    from gpuflex.protocol.modelanalysis import analyse_units

    return analyse_units(units(), (width,), torch.float32, optimizer=OPTIMIZER)


def state_bytes() -> int:
    return sum(c.state_bytes for c in unit_costs())


def step_batches(
    micro: int, steps: int, seed: int = 1
) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """``steps`` steps of ``BATCH`` samples, each cut into ``micro`` micro-batches."""
    g = torch.Generator().manual_seed(seed)
    b = BATCH // micro
    return [
        (
            [torch.randn(b, WIDTH, generator=g) for _ in range(micro)],
            [torch.randint(0, 10, (b,), generator=g) for _ in range(micro)],
        )
        for _ in range(steps)
    ]


def optimizer_for(module: nn.Module) -> Any:
    """The node's Adam (node/trainer.py) over ``module``'s parameters."""
    from gpuflex.node.trainer import make_optimizer
    from gpuflex.protocol.messages import TrainConfig

    config = TrainConfig(1, 32, OPTIMIZER, 1e-3, 0.0, 0.0, 0.9, 0.999, "cross_entropy", 0.0)
    return make_optimizer(list(module.parameters()), config)


# -- the throttle and the memory meter -------------------------------------------------------------


class Throttle(TorchDispatchMode):
    """Every aten op run under it takes ``factor`` times its CPU time longer: the difference is
    slept, in slices of at least 2 ms (what a slice over- or undersleeps is carried to the next).
    CPU time, not wall time: time an op waits for a core another process holds is not stretched."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor
        self._owed = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        started = time.thread_time()
        out = func(*args, **(kwargs or {}))
        self._owed += (self.factor - 1.0) * (time.thread_time() - started)
        if self._owed > 0.002:
            slept = time.perf_counter()
            time.sleep(self._owed)
            self._owed -= time.perf_counter() - slept
        return out


class _Saved:
    """What the meter's pack hook hands autograd: the saved tensor, counted while autograd keeps it."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class Meter:
    """The peak bytes a stage holds in tensors: its module's parameters and gradients, its
    optimizer's state, and the activations it keeps (tensors saved for backward and outputs
    held until their gradient comes back), each storage counted once."""

    def __init__(self, module: nn.Module, optimizer: Any) -> None:
        self.module = module
        self.optimizer = optimizer
        self.params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self._live: dict[int, list[int]] = {}  # storage -> [bytes, holders]
        self.peak = 0
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(lambda _p: self.sample())

    def state(self) -> int:
        total = 0
        for p in self.module.parameters():
            total += p.nbytes + (p.grad.nbytes if p.grad is not None else 0)
        for name, value in vars(self.optimizer).items():
            if isinstance(value, list) and name != "params":  # its state, not the parameters again
                total += sum(t.nbytes for t in value if isinstance(t, torch.Tensor))
        return total

    def sample(self) -> None:
        self.peak = max(self.peak, self.state() + sum(b for b, _ in self._live.values()))

    def hold(self, tensor: torch.Tensor, holder: object) -> None:
        """Count ``tensor``'s storage for as long as ``holder`` lives."""
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.params:
            return
        entry = self._live.setdefault(key, [storage.nbytes(), 0])
        entry[1] += 1
        weakref.finalize(holder, self._release, key)
        self.sample()

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[1] -= 1
        if not entry[1]:
            del self._live[key]

    def hooks(self) -> Any:
        def pack(t: torch.Tensor) -> _Saved:
            saved = _Saved(t)
            self.hold(t, saved)
            return saved

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s.tensor)


class MeteredTransport:
    """A transport that counts each activation it sends for as long as the stage keeps it, and
    the time the stage spends sending and receiving (waiting included)."""

    def __init__(self, inner: Any, meter: Meter) -> None:
        self.inner = inner
        self.meter = meter
        self.send_s = 0.0
        self.receive_s = 0.0

    def send(self, key: Any, tensor: torch.Tensor) -> None:
        if key.carries == "activation":
            self.meter.hold(tensor, tensor)
        started = time.perf_counter()
        self.inner.send(key, tensor)
        self.send_s += time.perf_counter() - started

    def receive(self, key: Any, expected: Any, *, timeout_s: float) -> torch.Tensor:
        started = time.perf_counter()
        try:
            return self.inner.receive(key, expected, timeout_s=timeout_s)
        finally:
            self.receive_s += time.perf_counter() - started


# -- what a node measures of itself ----------------------------------------------------------------


def probe_node(factor: float, repeats: int = 5) -> dict[str, Any]:
    """This process's speed on the model under a ``factor`` throttle: FLOP/s (the slope of
    forward + backward time over the micro-batch size), the fixed time per unit and micro-batch
    (the intercept over the units) and the optimizer's bytes of state per second."""
    model = nn.Sequential(*units())
    flops = sum(c.flops for c in unit_costs())
    opt = optimizer_for(model)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(7)
    times = {}
    with Throttle(factor):
        for b in PROBE_SIZES:
            x, y = torch.randn(b, WIDTH, generator=g), torch.randint(0, 10, (b,), generator=g)

            def once(x: torch.Tensor = x, y: torch.Tensor = y) -> None:
                opt.zero_grad()
                loss_fn(model(x), y).backward()

            times[b] = _median_s(once, repeats)
        update = _median_s(opt.step, repeats)
        bench_flops = benchmark_flops_per_s()
    small, large = PROBE_SIZES
    per_sample = (times[large] - times[small]) / (large - small)
    overhead = max(0.0, times[small] - small * per_sample)
    return {
        "flops_per_s": flops / per_sample,
        "unit_overhead_s": overhead / len(model),
        "update_bytes_per_s": state_bytes() / update,
        "bench_flops_per_s": bench_flops,
        "probe_s": times,
    }


def benchmark_flops_per_s() -> float:
    """The speed the hub offers a node that has run no stage: its benchmark's training samples/s
    on the reference model (node/benchmark.py, on the CPU as ``gpuflex-node bench`` runs it)
    times that model's FLOPs per sample (hub/domain/pipelines/offers.py)."""
    from gpuflex.hub.domain.pipelines.offers import REFERENCE_SPEC, reference_flops_per_sample
    from gpuflex.node.benchmark import training_samples_per_s

    sps = training_samples_per_s(torch.device("cpu"), dict(REFERENCE_SPEC), 2048, 32, 3)
    return sps * reference_flops_per_sample()


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def probe_link(node: int, url: str, seed: Callable[[int], bytes], repeats: int = 9) -> Any:
    """One relayed message's time at each of ``LINK_SIZES``, as a pipeline's messages travel:
    node 0 sends an activation (job ``link-<samples>``) to node 1, waiting in its GET, which
    sends it back as a gradient to node 0, waiting in its; half the round trip is one message
    (the sender's POST, the hub handing it to the waiting GET, the GET's answer). Node 0 returns
    its times by size (bytes); node 1 returns None; the other nodes take no part."""
    from gpuflex.node.pipeline.relay import RelayTransport
    from gpuflex.node.pipeline.transport import MessageKey, spec_of
    from gpuflex.protocol.signing import SigningKey

    if node > 1:
        return None
    times: dict[str, list[float]] = {}
    for samples in LINK_SIZES:
        relay = RelayTransport(url, SigningKey.from_seed(seed(node)), f"link-{samples}", wait_s=5.0)
        tensor = torch.randn(samples, WIDTH)
        spec = spec_of(tensor, "activation")
        for step in range(repeats + 1):
            there = MessageKey(step, 0, "activation", 0, 1)
            back = MessageKey(step, 0, "gradient", 1, 0)
            if node == 0:
                started = time.perf_counter()
                relay.send(there, tensor)
                relay.receive(back, spec, timeout_s=30.0)
                if step:  # the first opens the connections
                    times.setdefault(str(samples * WIDTH * 4), []).append(
                        (time.perf_counter() - started) / 2
                    )
            else:
                relay.send(back, relay.receive(there, spec, timeout_s=30.0))
        relay.close()
    return times if node == 0 else None


def fit_link(times: Sequence[dict[str, list[float]]]) -> dict[str, Any]:
    """The relay's cost of one message, fixed and per byte, from the medians of the probes by size."""
    costs = {
        int(size): statistics.median([t for pair in times for t in pair[size]]) for size in times[0]
    }
    (small, t_small), (large, t_large) = sorted(costs.items())
    per_byte = max((t_large - t_small) / (large - small), 1e-12)
    return {
        "message_s": max(0.0, t_small - small * per_byte),
        "per_byte_s": per_byte,
        "costs_s": {str(k): v for k, v in costs.items()},
    }


# -- planning ---------------------------------------------------------------------------------------


def offers(
    config: Config,
    speeds: Sequence[dict[str, float]],
    link: dict[str, float],
    state: int,
    measured: dict[int, float] | None = None,
    updates: dict[int, float] | None = None,
    overheads: dict[int, float] | None = None,
) -> list[Any]:
    """The planner's offers for ``config``'s nodes: the memory the config gives each, the speed
    its probe measured, and the relay's measured link (its fixed cost split into two round trips,
    its cost per byte into the two crossings of the sender's and receiver's links). A node in
    ``measured`` offers the speed the hub measured on its stages instead, with the fixed time per
    unit its stages said in ``overheads`` (0 where none) and the update rate in ``updates`` (the
    update priced in FLOPs where it has none), as the hub's offers are."""
    from gpuflex.hub.policy.pipeline_plan import NodeOffer

    measured = measured or {}
    updates = updates or {}
    overheads = overheads or {}
    return [
        NodeOffer(
            node_id=f"node{k}",
            memory_bytes=int(cap * state),
            flops_per_s=measured.get(k, speeds[k]["flops_per_s"]),
            bandwidth_bytes_per_s=2.0 / link["per_byte_s"],
            rtt_s=link["message_s"] / 2.0,
            unit_overhead_s=overheads.get(k, 0.0)
            if k in measured
            else speeds[k]["unit_overhead_s"],
            update_bytes_per_s=updates.get(k, 0.0)
            if k in measured
            else speeds[k]["update_bytes_per_s"],
        )
        for k, cap in zip(config.nodes, config.caps, strict=True)
    ]


def stage_speeds(
    plans: Sequence[dict[str, Any]], results: dict[tuple[int, int], Any]
) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
    """Each node's speed, update rate and fixed time per unit and micro-batch as the hub
    measures them from its stages' reports (hub/policy/stage_speed.py: each step's compute time,
    the part its end took, ``update_s``, and the stage's ``unit_overhead_s``), over the
    configurations it ran in order (each a generation): node index -> FLOP/s, node index ->
    bytes of state per second, node index -> seconds, for the nodes with enough steps."""
    from gpuflex.hub.policy.stage_speed import StageSpeed, stage_step_flops, with_step

    speeds: dict[int, StageSpeed] = {}
    costs = unit_costs()
    for n, doc in enumerate(plans):
        ends = [*doc["starts"][1:], len(costs)]
        for s, k in enumerate(doc["nodes"]):
            work = stage_step_flops(costs, doc["starts"][s], ends[s], BATCH)
            state = sum(c.state_bytes for c in costs[doc["starts"][s] : ends[s]])
            run = results[(n, k)]
            for i, (compute_s, update_s) in enumerate(
                zip(run["compute_s"], run["update_s"], strict=True)
            ):
                speeds[k] = with_step(
                    speeds.get(k, StageSpeed()), step_flops=work, compute_s=compute_s, step=i + 1,
                    update_s=update_s, state_bytes=state,
                    unit_overhead_s=run["unit_overhead_s"], unit_calls=doc["micro"] * (ends[s] - doc["starts"][s]),
                )  # fmt: skip
    return (
        {k: f for k, speed in speeds.items() if (f := speed.flops_per_s) is not None},
        {k: u for k, speed in speeds.items() if (u := speed.update_bytes_per_s) is not None},
        {k: o for k, speed in speeds.items() if (o := speed.unit_overhead_s) is not None},
    )


def plan(
    config: Config,
    speeds: Sequence[dict[str, float]],
    link: dict[str, float],
    measured: dict[int, float] | None = None,
    updates: dict[int, float] | None = None,
    overheads: dict[int, float] | None = None,
) -> Any:
    """The product's plan for ``config`` (one pipeline, the config's micro-batch count and
    schedule); SystemExit when the planner refuses it (a configuration that cannot be run)."""
    from gpuflex.hub.policy.pipeline_plan import Plan, plan_pipelines

    state = state_bytes()
    result = plan_pipelines(
        unit_costs(),
        offers(config, speeds, link, state, measured, updates, overheads),
        batch_size=BATCH,
        micro_batches=(config.micro,),
        schedules=(config.schedule,),
        max_replicas=1,
    )
    if not isinstance(result, Plan):
        raise SystemExit(f"configuration {config.name!r}: the planner refused it: {result.reason}")
    return result.pipelines[0]


def plan_doc(config: Config, pipeline: Any, state: int) -> dict[str, Any]:
    """What the stage processes and the hub need of a plan, and what the report keeps."""
    return {
        "name": config.name,
        "schedule": pipeline.schedule,
        "micro": pipeline.micro_batches,
        "nodes": [int(s.node_id.removeprefix("node")) for s in pipeline.stages],
        "starts": [s.first_unit for s in pipeline.stages],
        "caps": [
            int(config.caps[config.nodes.index(int(s.node_id.removeprefix("node")))] * state)
            for s in pipeline.stages
        ],
        "predicted_memory": [s.memory_bytes for s in pipeline.stages],
        "predicted_step_s": pipeline.step_s,
        "predicted_stage_s": [
            {"compute_s": s.compute_s, "transfer_s": s.transfer_s, "update_s": s.update_s}
            for s in pipeline.stages
        ],
        "throttles": [THROTTLES[int(s.node_id.removeprefix("node"))] for s in pipeline.stages],
    }


# -- one node process --------------------------------------------------------------------------------


#: the passes: the configurations planned on the speeds the hub offers before a node ran a stage
#: (its benchmark's), on the probed speeds, then on the speeds the hub measures from the first
#: pass's stages
PASSES = ("bench", "plan", "replan")


def run_node(node: int, url: str, work: Path, seed: Callable[[int], bytes], steps: int) -> None:
    """Node ``node``: probe its speed, then run its stage of every planned configuration in turn
    (each configuration its own relay job ``<pass>-<n>``), waiting for every node between two;
    each of `PASSES` in turn."""
    torch.set_num_threads(1)
    if node:  # one node at a time, as each would measure itself on its own machine
        _wait_for(work / f"speed-{node - 1}.json")
    _write(work / f"speed-{node}.json", probe_node(THROTTLES[node]))
    _wait_for(work / f"speed-{len(THROTTLES) - 1}.json")
    _write(work / f"link-{node}.json", probe_link(node, url, seed))
    for tag in PASSES:
        plans = json.loads(_wait_for(work / f"{tag}s.json").read_text())
        for n, doc in enumerate(plans):
            if n:
                for other in range(len(THROTTLES)):
                    _wait_for(work / f"done-{tag}-{n - 1}-{other}")
            if node in doc["nodes"]:
                stage = doc["nodes"].index(node)
                result = run_stage(doc, stage, url, f"{tag}-{n}", seed(node), steps)
                _write(work / f"stage-{tag}-{n}-{node}.json", result)
            (work / f"done-{tag}-{n}-{node}").write_text("")


def run_stage(
    doc: dict[str, Any], stage: int, url: str, job: str, key_seed: bytes, steps: int
) -> dict[str, Any]:
    """One stage of a planned configuration: 1 warm-up step and ``steps`` timed ones; its step
    times (as this stage sees each step end) and its measured peak bytes."""
    from gpuflex.node.pipeline.overhead import unit_overhead_s
    from gpuflex.node.pipeline.relay import RelayTransport
    from gpuflex.node.pipeline.stage import StageRunner, boundary_specs, cut
    from gpuflex.protocol.signing import SigningKey

    count, micro = len(doc["nodes"]), doc["micro"]
    last = stage == count - 1
    stages = cut(units(), doc["starts"])
    specs = boundary_specs(stages, torch.zeros(BATCH // micro, WIDTH))
    module = stages[stage]
    optimizer = optimizer_for(module)
    meter = Meter(module, optimizer)
    relay = RelayTransport(url, SigningKey.from_seed(key_seed), job, wait_s=5.0)
    transport = MeteredTransport(relay, meter)
    runner = StageRunner(
        module=module,
        stage=stage,
        stages=count,
        transport=transport,
        optimizer=optimizer,
        inbound=specs[stage - 1] if stage else None,
        outbound=None if last else specs[stage],
        loss_fn=nn.CrossEntropyLoss() if last else None,
        schedule=doc["schedule"],
    )
    ends, compute, updates = [], [], []
    with Throttle(doc["throttles"][stage]), meter.hooks():
        # the fixed time per unit and micro-batch, as the stage worker measures it before its
        # first step (node/pipeline/worker.py) and says in each report
        example = specs[stage - 1] if stage else None
        overhead = unit_overhead_s(
            module,
            torch.zeros(example.shape) if example else torch.zeros(BATCH // micro, WIDTH),
            units=len(module),
        )
        for n, (xs, ys) in enumerate(step_batches(micro, steps + 1)):
            if n == 1:
                transport.send_s = transport.receive_s = 0.0
            waited, started = transport.send_s + transport.receive_s, time.perf_counter()
            runner.run_step(n, micro, inputs=xs if stage == 0 else (), targets=ys if last else ())
            # what a node reports as compute_s: the step less its sending and waiting
            took = time.perf_counter() - started
            compute.append(took - (transport.send_s + transport.receive_s - waited))
            updates.append(min(runner.update_s, compute[-1]))
            meter.sample()
            ends.append(time.perf_counter())
    relay.close()
    return {
        "step_s": [b - a for a, b in itertools.pairwise(ends)],
        "compute_s": compute,
        "update_s": updates,
        "unit_overhead_s": overhead,
        "send_s": transport.send_s / steps,
        "receive_s": transport.receive_s / steps,
        "peak_bytes": meter.peak,
    }


def _write(path: Path, doc: object) -> None:
    """``doc`` as JSON at ``path``, whole or not at all (a reader waits for the name)."""
    path.with_suffix(".tmp").write_text(json.dumps(doc))
    path.with_suffix(".tmp").rename(path)


def _wait_for(path: Path, give_up_s: float = 300.0) -> Path:
    deadline = time.monotonic() + give_up_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path.name} did not appear within {give_up_s:g} s")
        time.sleep(0.02)
    return path


# -- figures --------------------------------------------------------------------------------------


def figures(
    plans: Sequence[dict[str, Any]], stage_results: dict[tuple[int, int], Any], state: int
) -> dict[str, Any]:
    """Per configuration its predicted and measured step time (the median of the last stage's
    timed steps) and each stage's measured peak against its cap; and the figures over all."""
    rows = []
    for n, doc in enumerate(plans):
        last = stage_results[(n, doc["nodes"][-1])]
        measured = statistics.median(last["step_s"])
        peaks = [stage_results[(n, k)]["peak_bytes"] for k in doc["nodes"]]
        rows.append(
            {
                "name": doc["name"],
                "stages": len(doc["nodes"]),
                "micro": doc["micro"],
                "schedule": doc["schedule"],
                "nodes": doc["nodes"],
                "throttles": doc["throttles"],
                "starts": doc["starts"],
                "predicted_step_s": round(doc["predicted_step_s"], 4),
                "measured_step_s": round(measured, 4),
                "step_s": [round(t, 4) for t in last["step_s"]],
                "ratio": round(doc["predicted_step_s"] / measured, 3),
                "caps": doc["caps"],
                "predicted_bytes": doc["predicted_memory"],
                "peak_bytes": peaks,
                "send_s": [round(stage_results[(n, k)]["send_s"], 4) for k in doc["nodes"]],
                "receive_s": [round(stage_results[(n, k)]["receive_s"], 4) for k in doc["nodes"]],
                "peak_over_cap": round(
                    max(p / c for p, c in zip(peaks, doc["caps"], strict=True)), 3
                ),
            }
        )
    ratios = [r["ratio"] for r in rows]
    largest_cap = max(max(doc["caps"]) for doc in plans)
    return {
        "rows": rows,
        "ratios": ratios,
        "step_time_ratio_median": round(statistics.median(ratios), 3),
        "step_time_ratio_worst": max(ratios, key=lambda r: abs(math.log(r))),
        "model_bytes_over_largest_cap": round(state / largest_cap, 2),
        "peak_bytes_over_cap_max": max(r["peak_over_cap"] for r in rows),
    }
