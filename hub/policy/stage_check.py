"""The referee's check of one pipeline stage's work on one micro-batch (docs/pipeline.md).

At a step whose parameters are durable on the hub (a checkpoint step: every unit's state after
that many steps is stored, or a generation's first step), a stage runs its forward and its
backward with exactly those parameters. For one micro-batch of such a step the relay kept what
the stage received (its input activation; on stage 0 the job's samples) and what it sent (its
output activation; its input's gradient), and the gradient of its output that came back. The
referee rebuilds the stage's units from their states, runs the forward under the same keyed
dropout (protocol/dropout.py) and the vector-Jacobian product with the gradient it received, and
compares:

- ``forward``: ||sent output - recomputed output|| / ||recomputed output|| (every stage but the
  last);
- ``backward``: ||sent input gradient - recomputed|| / ||recomputed|| (every stage but the first;
  the last stage's is the gradient of its weighted loss on the step's targets).

A distance over ``tolerance`` (or a tensor of another shape, or a non-finite one) is a mismatch.

With an encoded boundary (``[pipeline] boundary``, protocol/boundary.py) what the relay kept is
the wire form. The referee decodes the input and the gradient that came back exactly as the
receiving stage did, re-runs the stage on those, and measures each tensor the stage sent by
``BoundaryCode.distance``: the least change of the recomputed tensor after which the same code
(same basis, same cut) encodes it to what was sent, over the recomputed tensor's norm. Honest
work is a recomputed tensor within the class's deviation of one that encodes to the wire, so the
threshold stays the class tolerance, and a value that the two sides round to neighbouring levels
costs only its distance to the level's edge; what the code throws away (below a level, outside
the subspace) cannot be seen in the wire.

Where the stage sketched what it sent (protocol/stagesketch.py: the raw tensor's largest entries
and signed sums over all of it, before any code), the referee also compares its recomputed raw
tensor with each part, whatever the code:

- ``*_sketch_distance``: ||sketched values - recomputed values at those indices|| / ||recomputed
  values there||;
- ``*_sketch_rank_distance``: how far the largest recomputed magnitude outside the sketch's
  indices exceeds the smallest inside them, over the recomputed tensor's largest magnitude (0
  when the indices are its largest entries, as honest work's are up to near-ties);
- ``*_sketch_projection_distance``: ||sketched sums - the recomputed tensor's sums (the buckets
  and signs the sketch's entries draw)|| / ||the recomputed sums||: about the whole tensor's
  relative distance, which the largest entries alone understate.

Each is held against the same threshold on its own (a part's distance is not averaged into
another's); a sketch covering another number of elements is infinitely far. A sketch of the first
layout (GFS1) has no sums and is judged by its entries; without a sketch (an older node) the wire
distances alone decide.

Pure: tensors in, a verdict out; blocking (the hub runs it in a worker thread).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from gpuflex.protocol.boundarycodec import BoundaryCode
from gpuflex.protocol.dropout import dropout_step
from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.modelspec import ModelSpec
from gpuflex.protocol.moe import routers_aux_loss
from gpuflex.protocol.pipeline import Unit, load_unit
from gpuflex.protocol.stagesketch import StageSketch, sketch_projections
from gpuflex.protocol.transformer import NextTokenLoss
from torch import Tensor, nn

from .suspension import STAGE_MISMATCH

__all__ = [
    "STAGE_MISMATCH",
    "StageEvidence",
    "StageVerdict",
    "judge_stage",
    "relative_distance",
    "sketch_distances",
    "stage_loss",
    "stage_tolerance",
]


@dataclass(frozen=True)
class StageEvidence:
    """What the relay kept of one micro-batch of one stage. ``x``: its input (the activation it
    received, or stage 0's samples); ``out``: the activation it sent on (None on the last stage);
    ``grad_out``: the gradient of its output it received (None on the last stage); ``grad_in``:
    its input's gradient it sent back (None on stage 0); ``y``: the targets (last stage).
    ``inbound``/``outbound``: the codes of the cuts before and after the stage (None: fp32, or no
    such cut): ``x`` and ``grad_in`` are then in ``inbound``'s wire form, ``out`` and ``grad_out``
    in ``outbound``'s. ``out_sketch``/``grad_in_sketch``: the stage's sketches of the raw
    tensors it sent (None: it sent none)."""

    x: Tensor
    out: Tensor | None = None
    grad_out: Tensor | None = None
    grad_in: Tensor | None = None
    y: Tensor | None = None
    #: the micro-batch's share of the step's samples: the last stage's loss weight, and every
    #: stage's weight of its routers' balancing loss (a mixture of experts)
    weight: float = 1.0
    inbound: BoundaryCode | None = None
    outbound: BoundaryCode | None = None
    out_sketch: StageSketch | None = None
    grad_in_sketch: StageSketch | None = None


@dataclass(frozen=True)
class StageVerdict:
    """``ok``: every check reproduced; ``evidence``: the distances, the threshold and what was checked."""

    ok: bool
    evidence: Mapping[str, Any] = field(default_factory=dict)


def stage_tolerance(precision: str, tolerance: float, low_tolerance: float) -> float:
    """The threshold for a stage training in ``precision``: the job's strict ``tolerance`` for
    fp32 (one micro-batch's forward and backward differ by about 1e-7 between CPU compute
    classes), ``low_tolerance`` for tf32 (a 10-bit mantissa in every matmul)."""
    return tolerance if precision == "fp32" else low_tolerance


def stage_loss(spec: ModelSpec, loss: str) -> nn.Module:
    """The job's loss, as the node's trainer picks it (node/trainer.loss_for)."""
    if spec.task == "language_model":
        return NextTokenLoss()
    return nn.CrossEntropyLoss() if loss == "cross_entropy" else nn.MSELoss()


def relative_distance(sent: Tensor, recomputed: Tensor, code: BoundaryCode | None = None) -> float:
    """||what was sent - recomputed|| / ||recomputed||; with ``code``, ``sent`` is its wire form
    and the gap is ``code.distance`` (module docstring)."""
    if code is not None:
        diff = code.distance(sent, recomputed)
    elif sent.shape != recomputed.shape or not bool(torch.isfinite(sent).all()):
        return math.inf
    else:
        diff = float(torch.linalg.vector_norm((sent.double() - recomputed.double()).flatten()))
    if not math.isfinite(diff):
        return math.inf
    scale = float(torch.linalg.vector_norm(recomputed.double().flatten()))
    if scale == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / scale


def sketch_distances(sketch: StageSketch, recomputed: Tensor) -> dict[str, float]:
    """The distances of ``sketch`` from the recomputed raw tensor by part (module docstring):
    ``sketch`` (its entries' values), ``sketch_rank`` (where they are) and, for a sketch with
    projections, ``sketch_projection``; infinite for a sketch of another size or a non-finite
    recomputation."""
    parts = ("sketch", "sketch_rank", "sketch_projection")
    if sketch.projections is None:  # a GFS1 sketch: entries only
        parts = parts[:2]
    flat = recomputed.detach().reshape(-1).double()
    if int(flat.numel()) != sketch.numel or not bool(torch.isfinite(flat).all()):
        return dict.fromkeys(parts, math.inf)
    if sketch.numel == 0:
        return dict.fromkeys(parts, 0.0)
    at = flat[sketch.indices]
    found = {"sketch": _relative(sketch.values.double(), at)}
    magnitude = flat.abs()
    largest = float(magnitude.max())
    magnitude[sketch.indices] = 0.0
    gap = max(0.0, float(magnitude.max()) - float(at.abs().min()))
    found["sketch_rank"] = gap / largest if largest else 0.0
    if sketch.projections is not None:
        sums = sketch_projections(flat.cpu().numpy(), sketch.seed)  # float64 holds float32 exactly
        found["sketch_projection"] = _relative(sketch.projections.double(), torch.from_numpy(sums))
    return found


def _relative(sent: Tensor, recomputed: Tensor) -> float:
    """||sent - recomputed|| / ||recomputed|| of two float64 vectors (0 for two zeros)."""
    diff = float(torch.linalg.vector_norm(sent - recomputed))
    scale = float(torch.linalg.vector_norm(recomputed))
    return diff / scale if scale else (0.0 if diff == 0.0 else math.inf)


def _sketched(found: dict[str, Any], name: str, sketch: StageSketch | None, raw: Tensor) -> None:
    if sketch is not None:
        for part, distance in sketch_distances(sketch, raw).items():
            found[f"{name}_{part}_distance"] = distance


def _received(evidence: StageEvidence) -> tuple[Tensor, Tensor | None]:
    """The stage's input and its output's gradient as the stage had them: decoded from their
    wire forms as the receiving stage decodes them (ProtocolError or RuntimeError for a form no
    encoder makes)."""
    x, grad_out = evidence.x, evidence.grad_out
    if evidence.inbound is not None and evidence.grad_in is not None:  # not stage 0
        x = evidence.inbound.decode(x)
    if evidence.outbound is not None and grad_out is not None:
        grad_out = evidence.outbound.decode(grad_out)
    return x.clone(), grad_out


def judge_stage(
    units: Sequence[Unit],
    states: Sequence[Mapping[str, Tensor]],
    evidence: StageEvidence,
    *,
    seed: int,
    step: int,
    micro_batch: int,
    tolerance: float,
    loss_fn: nn.Module | None = None,
) -> StageVerdict:
    """Re-execute one stage (``units`` holding ``states``, their own names) on one micro-batch of
    ``step`` and compare with what it sent (see the module docstring). ``loss_fn``: the last
    stage's (None elsewhere)."""
    try:
        module = nn.Sequential(*(load_unit(u, s) for u, s in zip(units, states, strict=True)))
    except (RuntimeError, ValueError) as exc:
        return StageVerdict(False, {"why": f"the stage's states do not load: {exc}"[:200]})
    module.train()
    first = evidence.grad_in is None
    try:
        x, grad_out = _received(evidence)
    except (ProtocolError, RuntimeError) as exc:  # a wire form no encoder makes
        why = f"a received tensor does not decode: {exc}"[:200]
        return StageVerdict(False, {"threshold": tolerance, "why": why})
    if not first:
        x.requires_grad_(True)
    with torch.random.fork_rng(devices=[]), dropout_step(seed, step, part=micro_batch):
        out = module(x)
    aux = routers_aux_loss(module)  # a mixture of experts' routers: their balancing loss
    found: dict[str, Any] = {"threshold": tolerance}
    if loss_fn is not None:
        if evidence.y is None:
            return StageVerdict(False, {**found, "why": "the last stage's targets are missing"})
        root = loss_fn(out, evidence.y) * evidence.weight
        grad: Tensor | None = None
    else:
        if evidence.out is None or evidence.grad_out is None:
            return StageVerdict(
                False, {**found, "why": "the stage's output or its gradient is missing"}
            )
        found["forward_distance"] = relative_distance(evidence.out, out.detach(), evidence.outbound)
        _sketched(found, "forward", evidence.out_sketch, out)
        root, grad = out, grad_out
    if not first and evidence.grad_in is not None:
        if grad is not None and grad.shape != out.shape:
            found["backward_distance"] = math.inf
        else:
            roots, grads = [root], [grad if grad is not None else torch.ones_like(root)]
            if aux is not None:  # weighted as the stage weighs it: the micro-batch's share
                roots.append(aux * evidence.weight)
                grads.append(torch.ones_like(aux))
            torch.autograd.backward(roots, grads)
            recomputed = x.grad if x.grad is not None else torch.zeros_like(x)
            found["backward_distance"] = relative_distance(
                evidence.grad_in, recomputed, evidence.inbound
            )
            _sketched(found, "backward", evidence.grad_in_sketch, recomputed)
    distances = [v for k, v in found.items() if k.endswith("_distance")]
    ok = all(d <= tolerance for d in distances)
    shown = {k: (v if math.isfinite(v) else 1e300) for k, v in found.items()}
    return StageVerdict(ok, shown)
