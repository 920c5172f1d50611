"""What the pipeline planner reads: a job's model cut into units with their measured costs and
boundary tensors, and each online node's offer (memory, speed, link).

A node's offer is built from what the hub already keeps of it:

- memory: its ``--max-memory`` (``NodeState.max_memory_bytes``). A node that said 0 (an older
  node, which does not say) is left out, and the plan preview counts it.
- speed: measured on the pipeline stages it ran, once it has (``NodeState.stage_speed``: the
  median FLOP/s of its recent stage steps, speeds.py); else its benchmark's training samples/s on
  the reference model (``NodeState.bench_sps``, what ``gpuflex-node bench`` measures on
  ``REFERENCE_MODEL``) times that model's forward and backward FLOPs per sample, measured by the
  same analysis as the job's units, scaled to the measured nodes (``benchmark_flops``).
- update: the bytes of state per second its optimizer steps updated at on those stages, once it
  has reported them apart (``StageSpeed.update_bytes_per_s``); else the planner counts an update
  as ``UPDATE_FLOPS_PER_BYTE`` at its speed.
- fixed time per unit and micro-batch: what its stages measured (``StageSpeed.unit_overhead_s``,
  node/pipeline/overhead.py), its speed read without it; else 0 (a unit costs its FLOPs alone).
- link: its round trip is what the hub measured on its connection (``NodeState.rtt_s``, the
  kernel's TCP round trip, hub/server/linkmeter.py), else ``ASSUMED_LINK``'s; its bandwidth is
  the rate its bodies came in at (``NodeState.uplink_bytes_per_s``: relayed tensors, stage
  checkpoints and updates, timed as they arrive), taken for both directions, else
  ``ASSUMED_LINK``'s (a home line) until it has sent a body large enough to time.

``cut_model`` and ``reference_flops_per_sample`` block (torch on the meta device): callers run
them in a worker thread.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from gpuflex.protocol.errors import SpecError
from gpuflex.protocol.jobspec import JobSpec
from gpuflex.protocol.modelanalysis import UnitCost, analyse_units
from gpuflex.protocol.modelspec import ModelSpec
from gpuflex.protocol.pipeline import Units, pipeline_units

from ...model.node import NodeState
from ...policy.pipeline_plan import NodeOffer
from ...policy.stage_speed import MIN_STEPS, WARMUP_STEPS, WINDOW, benchmark_scale

if TYPE_CHECKING:
    import torch

#: the model every node's benchmark trains (node/benchmark.py's REFERENCE_MODEL, batch 32)
REFERENCE_MODEL: Final = "mlp-64-128-10"
REFERENCE_SPEC: Final = {"kind": "mlp", "input": 64, "hidden": [128], "outputs": 10}
#: the link every node is assumed to have: a home line of 20 Mbit/s with a 30 ms round trip
ASSUMED_LINK: Final = {"bandwidth_bytes_per_s": 2.5e6, "rtt_s": 0.03}

SPEED_DERIVATION: Final = (
    "a node whose pipeline stage has reported: the median FLOP/s of its last"
    f" {WINDOW} stage steps (the stage's units' forward + backward FLOPs of the step's samples and"
    f" its optimizer step, over the step's compute time; each generation's first {WARMUP_STEPS}"
    f' steps left out), once it has {MIN_STEPS} (nodes[].speed_from "stage_reports");'
    f" any other: its benchmark samples/s on the reference model {REFERENCE_MODEL} (batch 32) times"
    " that model's forward + backward FLOPs per sample, measured by the same analysis as the job's"
    " units, times benchmark_scale: the median over the measured nodes of their measured speed over"
    ' their benchmark\'s (1 while none is measured) (nodes[].speed_from "benchmark")'
)
LINK_ASSUMED: Final = (
    "a node's bandwidth is the rate the hub timed its bodies at (relayed tensors, stage"
    " checkpoints, updates: nodes[].bandwidth_measured), taken for both directions, else this"
    " one; its round trip is the kernel's TCP measure of its connection where the hub has one"
    " (nodes[].rtt_measured), else this one"
)


@dataclass(frozen=True)
class TiedCut:
    """A tied tensor held by several units (``units``), its shape and dtype (GFT1's name)."""

    units: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class ModelCut:
    """A job's model as the planner and the relay read it: its units' names and measured costs,
    each unit's output per sample (shape and dtype: what crosses a cut after it), the tied
    tensors, and each unit's state entries (name -> (shape, dtype)) a checkpoint must hold."""

    names: tuple[str, ...]
    costs: tuple[UnitCost, ...]
    outputs: tuple[tuple[tuple[int, ...], str], ...] = ()
    tied: tuple[TiedCut, ...] = ()
    entries: tuple[dict[str, tuple[tuple[int, ...], str, bool]], ...] = ()


def cut_model(spec: JobSpec) -> ModelCut | str:
    """The job's units and their costs, or one line saying why its model does not pipeline.
    Blocking (torch, on the meta device): called in a worker thread."""
    try:
        units = pipeline_units(spec.model)
        if len(units) < 2:
            return (
                f"the model is one pipeline unit ({units[0].name}): there is nothing to cut into"
                " stages, so it trains data-parallel (each node holds the whole model)"
            )
        costs = analyse_units(
            [u.module for u in units.units],
            spec.model.input_shape,
            spec.model.input_dtype,
            optimizer=spec.train.optimizer,
            momentum=spec.train.momentum,
        )
        outputs = unit_outputs(units, spec.model.input_shape, spec.model.input_dtype)
    except SpecError as exc:
        return f"the model cannot be cut into pipeline stages: {exc}"
    return ModelCut(
        tuple(u.name for u in units.units), costs, outputs, _tied(units), _entries(units)
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def unit_outputs(
    units: Units, input_shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[tuple[tuple[int, ...], str], ...]:
    """Each unit's output for one sample (its shape without the batch, its dtype), run on the
    meta device (nothing allocated); a unit torch cannot run there runs on a zero batch on the CPU."""
    import torch

    out = []
    x = torch.zeros((1, *input_shape), dtype=dtype, device="meta")
    with torch.no_grad():
        for unit in units.units:
            module = copy.deepcopy(unit.module).eval()
            try:
                y = module(x)
            except NotImplementedError:
                module = module.to_empty(device="cpu")
                y = module(torch.zeros(x.shape, dtype=x.dtype)).to("meta")
            if not isinstance(y, torch.Tensor):
                raise SpecError(f"pipeline unit {unit.name} does not return one tensor")
            out.append((tuple(int(d) for d in y.shape[1:]), _dtype_name(y.dtype)))
            x = y
    return tuple(out)


def _tied(units: Units) -> tuple[TiedCut, ...]:
    out = []
    for group in units.tied:
        index, name = group.members[0]
        tensor = units[index].module.state_dict()[name]
        out.append(
            TiedCut(
                tuple(sorted({i for i, _ in group.members})),
                tuple(int(d) for d in tensor.shape),
                _dtype_name(tensor.dtype),
            )
        )
    return tuple(out)


def _entries(units: Units) -> tuple[dict[str, tuple[tuple[int, ...], str, bool]], ...]:
    """Each unit's state entries: name -> (shape, dtype, trainable parameter)."""
    out = []
    for unit in units.units:
        params = {name for name, p in unit.module.named_parameters() if p.requires_grad}
        out.append(
            {
                name: (tuple(int(d) for d in t.shape), _dtype_name(t.dtype), name in params)
                for name, t in unit.module.state_dict(keep_vars=True).items()
            }
        )
    return tuple(out)


@functools.cache
def reference_flops_per_sample() -> float:
    """Forward + backward FLOPs of one sample of the benchmark's reference model, as training
    runs it (the first unit computes no gradient for its input)."""
    import torch

    spec = ModelSpec.from_dict(REFERENCE_SPEC)
    units = pipeline_units(spec)
    costs = analyse_units([u.module for u in units.units], spec.input_shape, torch.float32)
    return float(sum(c.flops for c in costs))


def node_offers(
    nodes: Iterable[NodeState], now: float, online_window_s: float, flops_per_sample: float
) -> tuple[list[NodeOffer], int, int]:
    """The online nodes' offers (by node id), how many nodes are online, and how many of them
    were left out for offering no memory."""
    online = sorted(
        (n for n in nodes if not n.banned and now - n.last_seen <= online_window_s),
        key=lambda n: n.id,
    )
    offers = [offer_of(n, flops_per_sample) for n in online if n.max_memory_bytes > 0]
    return offers, len(online), len(online) - len(offers)


def offer_of(node: NodeState, flops_per_sample: float) -> NodeOffer:
    """One node's offer (see the module docstring)."""
    return NodeOffer(
        node_id=node.id,
        memory_bytes=node.max_memory_bytes,
        flops_per_s=speed_of(node, flops_per_sample),
        bandwidth_bytes_per_s=node.uplink_bytes_per_s
        if node.uplink_bytes_per_s > 0
        else ASSUMED_LINK["bandwidth_bytes_per_s"],
        rtt_s=node.rtt_s if node.rtt_s > 0 else ASSUMED_LINK["rtt_s"],
        update_bytes_per_s=node.stage_speed.update_bytes_per_s or 0.0,
        unit_overhead_s=node.stage_speed.unit_overhead_s or 0.0,
    )


def benchmark_flops(nodes: Iterable[NodeState], flops_per_sample: float) -> float:
    """The FLOPs one sample of a node's benchmark stands for: the reference model's
    ``flops_per_sample`` times how far the measured nodes' stage speeds are from their
    benchmarks' (hub/policy/stage_speed.py's ``benchmark_scale``); ``flops_per_sample`` while no
    node is measured. What the offers of ``nodes`` take as their ``flops_per_sample``."""
    return flops_per_sample * benchmark_scale(
        (f, max(n.bench_sps, 1e-3) * flops_per_sample)
        for n in nodes
        if (f := n.stage_speed.flops_per_s) is not None
    )


def speed_of(node: NodeState, flops_per_sample: float) -> float:
    """The node's FLOP/s: measured on its stages once it has enough steps, else its benchmark's
    samples/s times the reference model's ``flops_per_sample``."""
    measured = node.stage_speed.flops_per_s
    return measured if measured is not None else max(node.bench_sps, 1e-3) * flops_per_sample


__all__ = [
    "ASSUMED_LINK",
    "LINK_ASSUMED",
    "REFERENCE_MODEL",
    "REFERENCE_SPEC",
    "SPEED_DERIVATION",
    "ModelCut",
    "TiedCut",
    "benchmark_flops",
    "cut_model",
    "node_offers",
    "offer_of",
    "reference_flops_per_sample",
    "speed_of",
]
