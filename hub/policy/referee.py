"""The referee: re-execute one committed segment of a node's training and judge it.

Why: two honest replicas on numerically different hardware (fp32 vs bf16, other kernels,
thread counts, oneDNN) drift apart over a whole round, so a whole-update comparison cannot
tell them from a cheat. A SHORT segment started from the SAME state stays close
(proof-of-learning, Jia et al. 2021; Gensyn's Verde). A node commits to its full training
state every k steps (protocol/checkpoint.py, node/checkpoints.py); the referee (the hub, in a
worker thread) asks for the states around one segment, re-executes that segment with the
same seed, data order and claimed precision, and compares the end state it gets with the
one the node committed to.

Pure functions (tensors in, a verdict out); the round engine (hub/domain/rounds.py) gathers the
inputs and the policy (hub/policy/round_policy.py) applies the verdicts.

- ``pick_segment``: which segment to re-execute. Beside a disagreeing replica of the same compute
  class with the same checkpoint grid (``same_class``, every member's class key known and equal):
  the first segment whose committed end hash differs from the replica's. One class key means the
  same device, kernels, versions and threads, and the node's trainer runs deterministically, so
  the two trajectories agree bit for bit up to the step where one of them left honest training:
  that segment is the one replayed, wherever the change sits and whatever norm it claims. An
  honest node loses nothing by it (any of its segments reproduces). Beside a replica of another class (its
  states differ from the first step on) or one of another grid: the first segment whose
  committed norms differ by more than ``NORM_SPLIT`` (Verde's first diverging step, found from
  the commitments without a download). Else the
  segment whose committed norm stands out (over ``STANDOUT`` x the median of the others: a
  change injected into one segment and claimed truthfully; PoL replays the largest updates).
  Else a segment drawn uniformly under the hub's secret (``draw``, rounds.segment_draw). Not
  always the largest committed norm: a norm is the node's own claim, and a node that injects
  its change into one segment and claims that segment's honest norm would never be picked; a
  secret uniform draw meets such a segment 1 time in the segment count, whatever the node
  claims, and the path-length check (round_review.py) caps what an understated claim can hide.
- ``fetch_steps``: the segment's start and end and the last state; ``request_steps``: what the
  referee asks for: every checkpoint state of the commitment while they add up to at most
  ``ALL_STATES_MAX_BYTES``, else those three. With every state, every committed segment norm
  is tested (``judge_segment``), so no norm is the node's word alone: a change injected into one
  segment either shows in that segment's norm (it stands out and is the one replayed) or is
  small against the segments around it.
- ``replay_onednn``: the oneDNN setting the replay runs with: a CPU node's own (its class key
  names it; oneDNN's convolutions and ATen's own sum in different orders, which a short segment
  of a small shard does not average out: a 2-step CNN segment measured 7.0e-3 apart on an
  AVX2 host), the referee's default for a GPU node. Process-wide in torch, so replays take turns.
- ``judge_segment``: checks, in order: the states say the steps they were asked for; a
  segment that starts at step 0 starts from the round's model with a fresh optimizer; the
  last state minus the round's model IS the uploaded update, bit for bit (so the commitment
  binds the update); every segment whose two states were handed over has the norm the node
  committed for it (within ``NORM_CHECK``, relative: a claim the referee can test is tested;
  where it holds fewer states, the untested ones are bounded all together by the path-length
  check, round_review.py); the re-executed segment end lies within ``tolerance`` of the committed
  one: distance = ||committed end - re-executed end|| / ||re-executed end - start|| over the
  model's floating tensors. With error feedback, the residual the last state commits must be
  what encoding one of the node's latest earlier uploads left (``residual_chain``; an upload
  decoded plus its residual encodes to it again), or zero: without that check a node could
  commit any residual and so send any code the encoding can carry.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from gpuflex.protocol.checkpoint import feedback_part, model_part, segment_norm, step_of
from gpuflex.protocol.dropout import dropout_step
from gpuflex.protocol.encoding import UpdateEncoding
from gpuflex.protocol.errors import TensorError
from gpuflex.protocol.lossscale import LossScaler
from gpuflex.protocol.messages import Commitment, ComputeClass, TrainConfig
from gpuflex.protocol.modelspec import ModelSpec, build_for_state, update_manifest
from gpuflex.protocol.tensors import Manifest, manifest_of
from gpuflex.protocol.transformer import NextTokenLoss
from torch import Tensor, nn

__all__ = [
    "ALL_STATES_MAX_BYTES",
    "NORM_CHECK",
    "NORM_SPLIT",
    "RESIDUAL_LOOKBACK",
    "STANDOUT",
    "SegmentVerdict",
    "commitment_refusal",
    "fetch_steps",
    "judge_segment",
    "largest_segment",
    "pick_segment",
    "referee_grid_ok",
    "replay_onednn",
    "replay_segment",
    "request_steps",
    "residual_chain",
    "segment_distance",
    "stack_data",
]

#: relative difference of two replicas' committed segment norms taken as "diverged here"
NORM_SPLIT = 1e-3
#: relative difference allowed between a segment's committed norm and the norm of the states the
#: node hands over (the same float32 function of the same tensors; only the summation order of a
#: vectorised norm can differ between machines, about 1e-7)
NORM_CHECK = 1e-4
#: the referee asks for every checkpoint state of an update while they come to at most this many
#: bytes together (a digits model's 9 states are about 0.5 MB; a 1.1M-parameter MLP's with momentum
#: about 80 MB); above it, only the replayed segment's two and the last
ALL_STATES_MAX_BYTES = 256 << 20
#: a committed segment norm this many times the median of the others stands out: that segment is
#: the one replayed. Honest trajectories measured 1.08-1.66 (the largest over the median of the
#: rest; 54 trainings of bench/heterogeneity.py's three jobs from their initial model, fp32 and
#: bf16, 1-4 chunks); it only chooses a segment, it accuses nobody
STANDOUT = 2.0
#: how many of a node's latest earlier uploads in a job the residual's chain is checked against
#: (the newest first): an upload whose acknowledgement never reached the node did not move its
#: residual on, so the node may be an upload or two behind what the hub stored
RESIDUAL_LOOKBACK = 3

#: torch's oneDNN switch is one flag for the whole process: replays that set it take turns
_ONEDNN_TURN = threading.Lock()


def replay_onednn(cc: ComputeClass | None) -> bool:
    """Whether the referee re-executes a segment of a node of class ``cc`` with oneDNN's CPU
    kernels: a CPU node's own setting (part of its class key), else on (torch's default; the
    referee runs on the hub's CPU, and a GPU node's kernels are not reproducible there anyway)."""
    return bool(cc.onednn) if cc is not None and cc.device_kind == "cpu" else True


@contextlib.contextmanager
def _onednn(enabled: bool) -> Iterator[None]:
    """Run the body with torch's oneDNN CPU kernels on or off, restored after; one at a time."""
    with _ONEDNN_TURN:
        before = torch.backends.mkldnn.enabled
        torch.backends.mkldnn.enabled = enabled
        try:
            yield
        finally:
            torch.backends.mkldnn.enabled = before


@dataclass(frozen=True)
class SegmentVerdict:
    """The referee's verdict on one update. ``outcome``: "reproduced" | "mismatch" |
    "unverifiable". ``evidence``: round, step range, whose states, the distance(s) and
    the threshold; shown to the auditor."""

    update_id: str
    node_id: str
    outcome: str
    evidence: Mapping[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.outcome == "reproduced"


def _grid(c: Commitment) -> list[int]:
    return [*range(0, c.steps, c.every), c.steps]


def referee_grid_ok(c: Commitment, steps: int) -> bool:
    """The commitment covers exactly the assignment's ``steps`` (protocol/workload.py), one hash
    per checkpoint of its grid and one norm per segment."""
    return c.steps == steps and c.every >= 1 and len(c.hashes) == len(_grid(c)) == len(c.norms) + 1


def commitment_refusal(c: Commitment | None, *, required: bool, steps: int) -> tuple[str, str] | None:
    """Why an uploaded update's commitment cannot be taken, as (code, one line); None when it can.

    Verification is not optional for the one verified: where the assignment asks for a commitment
    (``TrainConfig.commit``: the job may ask the referee), an update without one, or with one that
    does not cover the assignment's ``steps``, could never be re-executed, and a client that left it
    out would meet nothing but the plain rules. Where none is asked for, whatever came is ignored."""
    if not required:
        return None
    if c is None:
        return ("commitment_required", "this assignment asks for a checkpoint commitment (its training settings"
                " say commit = true) and the update header carries none; upload it with the commitment"
                " its training recorded")
    if not referee_grid_ok(c, steps):
        return ("bad_commitment", f"the update's checkpoint commitment covers {c.steps} steps in {len(c.hashes)}"
                f" checkpoints every {c.every} with {len(c.norms)} segment norms; this assignment trains"
                f" {steps} steps: commit one hash per checkpoint of its grid and one norm per segment")
    return None


def largest_segment(c: Commitment) -> int:
    """The segment with the largest committed norm (the first of equals)."""
    return max(range(len(c.norms)), key=lambda i: (c.norms[i], -i)) if c.norms else 0


def pick_segment(c: Commitment, other: Commitment | None = None, *, draw: float | None = None,
                 same_class: bool = False) -> int:
    """Index i of the segment [grid[i], grid[i+1]] to re-execute (see the module docstring):
    the first whose end hash differs from ``other``'s when the two are of one compute class
    (``same_class``), else the first where ``other``'s committed norms diverge from ``c``'s, else
    one whose norm stands out (``STANDOUT``), else the one ``draw`` (in [0, 1), secret to the
    node) lands on. Without a draw (tests, tools): the largest norm."""
    if not c.norms:
        return 0
    if other is not None and other.every == c.every and other.steps == c.steps and len(other.norms) == len(c.norms):
        if same_class and len(other.hashes) == len(c.hashes):
            for i, (a, b) in enumerate(zip(c.hashes[1:], other.hashes[1:], strict=True)):
                if a != b:
                    return i
        for i, (a, b) in enumerate(zip(c.norms, other.norms, strict=True)):
            if abs(a - b) > NORM_SPLIT * max(a, b, 1e-30):
                return i
    top = largest_segment(c)
    rest = [n for i, n in enumerate(c.norms) if i != top]
    if len(rest) >= 2 and c.norms[top] > STANDOUT * statistics.median(rest):
        return top
    if draw is not None:
        return min(int(draw * len(c.norms)), len(c.norms) - 1)
    return top


def fetch_steps(c: Commitment, segment: int) -> tuple[int, int, int]:
    """(start, end, last) steps of ``segment`` (the last state binds the update)."""
    grid = _grid(c)
    return grid[segment], grid[segment + 1], grid[-1]


def request_steps(c: Commitment, segment: int, state_bytes: int) -> tuple[int, ...]:
    """The states the referee asks for to judge ``segment`` (``state_bytes``: about one state's
    size): every checkpoint while they fit ``ALL_STATES_MAX_BYTES``, else ``fetch_steps``."""
    grid = _grid(c)
    if len(grid) * max(int(state_bytes), 1) <= ALL_STATES_MAX_BYTES:
        return tuple(grid)
    return tuple(sorted(set(fetch_steps(c, segment))))


def stack_data(chunks: Sequence[Mapping[str, Tensor]]) -> tuple[Tensor, Tensor]:
    """The shard's samples in assignment order, as the node's trainer stacks them."""
    xs = [c["x"] for c in chunks]
    ys = [c["y"] for c in chunks]
    return (xs[0] if len(xs) == 1 else torch.cat(xs)), (ys[0] if len(ys) == 1 else torch.cat(ys))


def _optimizer(model: nn.Module, cfg: TrainConfig, start: Mapping[str, Tensor]) -> torch.optim.Optimizer:
    """torch.optim's optimizer for ``cfg`` holding the optimizer state of checkpoint ``start``
    (the node's fused optimizer follows torch.optim's rules; the referee uses torch's own)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    opt: torch.optim.Optimizer
    if cfg.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        for n, p in named:
            buf = start.get(f"opt.momentum.{n}")
            if buf is not None:
                opt.state[p]["momentum_buffer"] = buf.clone()
        return opt
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    opt = cls(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay, eps=1e-8)
    t = start.get("opt.t")
    if t is not None:
        for n, p in named:
            opt.state[p]["step"] = torch.tensor(float(int(t.reshape(-1)[0])))
            opt.state[p]["exp_avg"] = start[f"opt.exp_avg.{n}"].clone()
            opt.state[p]["exp_avg_sq"] = start[f"opt.exp_avg_sq.{n}"].clone()
    return opt


def replay_segment(spec: ModelSpec, start: Mapping[str, Tensor], x: Tensor, y: Tensor, cfg: TrainConfig,
                   seed: int, start_step: int, end_step: int, precision: str = "fp32",
                   onednn: bool = True) -> dict[str, Tensor]:
    """Re-execute steps [start_step, end_step) from checkpoint ``start``; the module state at
    ``end_step``. Same contract as the node's trainer (node/trainer.py): the epoch's shuffle is
    ``randperm(n, Generator().manual_seed(seed + epoch))``, batches are its consecutive slices,
    dropout draws the step's keyed masks (protocol/dropout.py; any other in-model randomness from
    the checkpoint's CPU RNG state), ``precision`` "bf16" / "fp16" runs the forward under that
    autocast, and "fp16" scales the loss with the checkpoint's loss scaler, skipping the steps
    whose gradients overflow, as the node's trainer does, ``onednn`` says whether oneDNN's CPU kernels run (``replay_onednn``)."""
    model = build_for_state(spec, model_part(start))
    model.train()
    n = int(x.shape[0])
    bs = int(cfg.batch_size)
    per_epoch = math.ceil(n / bs)
    loss_fn: nn.Module = (NextTokenLoss() if spec.task == "language_model"  # the node's loss (node/trainer.py)
                          else nn.CrossEntropyLoss() if cfg.loss == "cross_entropy" else nn.MSELoss())
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _optimizer(model, cfg, start)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    autocast = torch.autocast("cpu", dtype=low or torch.bfloat16, enabled=low is not None)
    # fp16: the node's loss scaler, from the start state, skips the steps the node skipped
    scaler = LossScaler.from_state(start, torch.device("cpu")) if precision == "fp16" else None
    perm = torch.empty(0, dtype=torch.int64)
    perm_epoch = -1
    with torch.random.fork_rng(devices=[]), _onednn(onednn):
        rng = start.get("rng")
        if rng is not None:
            torch.set_rng_state(rng.clone())
        for step in range(start_step, end_step):
            epoch, b = divmod(step, per_epoch)
            if epoch != perm_epoch:
                perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
                perm_epoch = epoch
            idx = perm[b * bs : (b + 1) * bs]
            xb = x.index_select(0, idx)  # (batch, *input_shape)
            yb = y.index_select(0, idx)  # (batch,) or (batch, outputs)
            opt.zero_grad(set_to_none=True)
            with autocast, dropout_step(seed, step):
                loss = loss_fn(model(xb), yb)
            if scaler is None:
                loss.backward()
            else:
                (loss.float() * scaler.scale).backward()
                finite = scaler.unscale(params)
                scaler.update()
                if not finite:
                    continue
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _fresh_scaler(start: Mapping[str, Tensor]) -> bool:
    """Step 0's loss scaler (fp16) is a new one: the initial scale, no finite steps counted."""
    scale, growth = start.get("amp.scale"), start.get("amp.growth")
    if scale is None and growth is None:
        return True
    return (scale is not None and growth is not None and scale.numel() == 1 and growth.numel() == 1
            and float(scale.reshape(())) == LossScaler.INIT_SCALE and int(growth.reshape(())) == 0)


def segment_distance(start: Mapping[str, Tensor], committed_end: Mapping[str, Tensor],
                     replayed_end: Mapping[str, Tensor]) -> float:
    """||committed - replayed|| / ||replayed - start|| over the module's floating tensors: 0.0
    without a norm taken when the two ends hold the same values (what the norms would give)."""
    names = sorted(k for k, v in replayed_end.items() if v.is_floating_point())
    if all((c := committed_end.get(k)) is not None and c.dtype == replayed_end[k].dtype
           and c.shape == replayed_end[k].shape and torch.equal(c, replayed_end[k]) for k in names):
        return 0.0
    diff = segment_norm(replayed_end, committed_end, names)
    scale = segment_norm(start, replayed_end, names)
    if scale == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / scale


def residual_chain(encoding: UpdateEncoding, residual: Mapping[str, Tensor],
                   previous: Sequence[Mapping[str, Tensor]], model: Manifest) -> str:
    """Where the error-feedback residual a node committed comes from: "zero" (a node starting
    over), "upload <i>" (what encoding its i-th latest earlier upload left, 0 = the latest; a
    lost acknowledgement leaves the node one upload behind the hub, so a few are tried),
    "no_upload" (not zero, and no earlier upload) or "forged" (none of them left it)."""
    if all(not bool(r.any()) for r in residual.values()):
        return "zero"
    if not previous:
        return "no_upload"
    for i, wire in enumerate(previous):
        if encoding.residual_fits(wire, residual, model):
            return f"upload {i}"
    return "forged"


def _verdict(update_id: str, node_id: str, outcome: str, base: Mapping[str, Any], **more: Any) -> SegmentVerdict:
    return SegmentVerdict(update_id, node_id, outcome, {**base, **more})


def _untrue_norm(c: Commitment, states: Mapping[int, Mapping[str, Tensor]],
                 global_state: Mapping[str, Tensor]) -> tuple[dict[str, Any] | None, int]:
    """Test the committed norm of every segment whose two states were handed over: (evidence of
    the first that is not its states', or None; how many were tested)."""
    grid = _grid(c)
    tested = 0
    for i, claimed in enumerate(c.norms):
        a, b = states.get(grid[i]), states.get(grid[i + 1])
        if a is None or b is None:
            continue
        try:
            if step_of(a) != grid[i] or step_of(b) != grid[i + 1]:
                return {"why": f"the states handed over for steps {grid[i]}-{grid[i + 1]} say other steps"}, tested
        except TensorError as exc:
            return {"why": f"states of steps {grid[i]}-{grid[i + 1]}: {exc}"[:200]}, tested
        am, bm = model_part(a), model_part(b)
        if any(set(m) != set(global_state) or any(m[k].shape != v.shape or m[k].dtype != v.dtype
                                                  for k, v in global_state.items()) for m in (am, bm)):
            return {"why": f"the states of steps {grid[i]}-{grid[i + 1]} do not fit the model"}, tested
        actual = segment_norm(am, bm)
        tested += 1
        if not abs(float(claimed) - actual) <= NORM_CHECK * max(float(claimed), actual, 1e-30):
            return {"states_norm": actual, "norm_steps": [grid[i], grid[i + 1]],
                    "why": f"the committed norm of steps {grid[i]}-{grid[i + 1]} is {float(claimed):.6g};"
                           f" its states are {actual:.6g} apart"}, tested
    return None, tested


def judge_segment(
    *,
    update_id: str,
    node_id: str,
    round: int,
    spec: ModelSpec,
    cfg: TrainConfig,
    seed: int,
    commitment: Commitment,
    segment: int,
    states: Mapping[int, Mapping[str, Tensor]],
    global_state: Mapping[str, Tensor],
    delta: Mapping[str, Tensor],
    x: Tensor,
    y: Tensor,
    tolerance: float,
    onednn: bool = True,
    encoding: UpdateEncoding | None = None,
    previous: Sequence[Mapping[str, Tensor]] | None = None,
) -> SegmentVerdict:
    """Judge one update from its committed states (already checked against the commitment's
    hashes) by re-executing ``segment`` (with oneDNN's kernels or not: ``replay_onednn``).
    ``previous``: with error feedback, the node's latest earlier uploads in this job (newest
    first, up to ``RESIDUAL_LOOKBACK``; None: the residual's chain is not checked)."""
    s, e, last = fetch_steps(commitment, segment)
    base: dict[str, Any] = {"check": "segment_replay", "round": round, "node": node_id, "update": update_id,
                            "steps": [s, e], "last_step": last, "precision": commitment.precision,
                            "threshold": tolerance, "segments": len(commitment.norms), "onednn": onednn,
                            "segment_norm": commitment.norms[segment] if commitment.norms else 0.0}
    # what the update carries: the model, or a LoRA job's adapters (the rest stays the round's)
    carried = {t.name: global_state[t.name] for t in update_manifest(spec) if t.name in global_state}
    unfit = _unfit_states((s, e, last), states, global_state, carried)
    if unfit is not None:
        outcome, why = unfit
        return _verdict(update_id, node_id, outcome, base, why=why)
    start, final = states[s], states[last]
    start_m, end_m = model_part(start), model_part(states[e])
    binding = _binding(final, carried, delta, encoding, previous)
    base.update(binding.evidence)
    if binding.failure is not None:
        return _verdict(update_id, node_id, "mismatch", base, **binding.failure)
    untrue, tested = _untrue_norm(commitment, states, global_state)
    base["norms_tested"] = tested
    if untrue is not None:
        return _verdict(update_id, node_id, "mismatch", base, **untrue)
    replayed = replay_segment(spec, start, x, y, cfg, seed, s, e, commitment.precision, onednn)
    dist = segment_distance(start_m, end_m, replayed)
    outcome = "reproduced" if dist <= tolerance else "mismatch"
    return _verdict(update_id, node_id, outcome, base, distance=dist if math.isfinite(dist) else 1e300)


def _unfit_states(steps: tuple[int, int, int], states: Mapping[int, Mapping[str, Tensor]],
                  global_state: Mapping[str, Tensor], carried: Mapping[str, Tensor]) -> tuple[str, str] | None:
    """(outcome, why) when the states of ``steps`` (start, end, last) cannot be judged further:
    one not handed over ("unverifiable"), one that says another step, does not fit the model,
    changed a tensor the update does not carry (a LoRA job's frozen base), or a step 0 that is
    not the round's model with a fresh optimizer ("mismatch"). None: they fit."""
    for step in steps:
        st = states.get(step)
        if st is None:
            return "unverifiable", f"state of step {step} not handed over"
        try:
            if step_of(st) != step:
                return "mismatch", f"the state of step {step} says step {step_of(st)}"
        except Exception as exc:
            return "mismatch", f"state of step {step}: {exc}"[:200]
    names = set(global_state)
    for label, step in zip(("start", "end", "last"), steps, strict=True):
        m = model_part(states[step])
        if set(m) != names or any(m[k].shape != global_state[k].shape or m[k].dtype != global_state[k].dtype
                                  for k in names):
            return "mismatch", f"the {label} state does not fit the model"
        if any(not torch.equal(m[k], global_state[k]) for k in names if k not in carried):
            return "mismatch", f"the {label} state changed the frozen base weights"
    if steps[0] == 0:
        start = states[0]
        start_m = model_part(start)
        fresh = not any(k.startswith("opt.") for k in start) and _fresh_scaler(start)
        same = all(torch.equal(start_m[k], global_state[k]) for k in names)
        if not (fresh and same):
            return "mismatch", "step 0 is not the round's model with a fresh optimizer"
    return None


@dataclass(frozen=True)
class _Binding:
    """Is the uploaded update the committed last state minus the round's model? ``failure``: the
    mismatch verdict's evidence (None: it is); ``evidence``: what the check adds to the verdict's
    evidence either way (the encoding, the residual's chain)."""

    failure: dict[str, Any] | None
    evidence: dict[str, Any] = field(default_factory=dict)


def _binding(final: Mapping[str, Tensor], global_state: Mapping[str, Tensor], delta: Mapping[str, Tensor],
             encoding: UpdateEncoding | None, previous: Sequence[Mapping[str, Tensor]] | None) -> _Binding:
    """The commitment binds the update: last state - round model == the uploaded delta, exactly;
    for an encoded update, its encoding (with the residual the last state commits) == the upload."""
    names = set(global_state)
    final_m = model_part(final)
    # in the model's order: topk lays the model's tensors end to end in it (protocol/encoding.py)
    dense = {k: final_m[k].to(v.dtype) - v if v.is_floating_point() else final_m[k] for k, v in global_state.items()}
    if encoding is not None and not encoding.identity:
        return _encoded_binding(final, dense, global_state, delta, encoding, previous)
    if set(delta) == names and all(torch.equal(dense[k], delta[k]) for k in names):
        return _Binding(None)
    off = segment_norm(delta, {k: final_m[k].double() - global_state[k].double() for k in names
                               if global_state[k].is_floating_point()},
                       sorted(k for k in names if global_state[k].is_floating_point()))
    return _Binding({"why": "the update is not the committed last state minus the round's model",
                     "binding_distance": off})


def _encoded_binding(final: Mapping[str, Tensor], dense: Mapping[str, Tensor], global_state: Mapping[str, Tensor],
                     delta: Mapping[str, Tensor], encoding: UpdateEncoding,
                     previous: Sequence[Mapping[str, Tensor]] | None) -> _Binding:
    """``_binding`` for an encoded update; with error feedback, the committed residual's chain too."""
    try:
        expected = encoding.encode(dense, feedback_part(final) if encoding.error_feedback else None).wire
    except TensorError as exc:
        return _Binding({"why": f"the last state cannot be encoded: {exc}"[:200]})
    evidence: dict[str, Any] = {"encoding": encoding.kind}
    if not encoding.same_code(expected, delta):
        layout = manifest_of(global_state)
        floating = sorted(k for k in global_state if global_state[k].is_floating_point())
        try:
            off = segment_norm(encoding.decode(delta, layout), encoding.decode(expected, layout), floating)
        except (TensorError, KeyError):
            off = math.inf
        return _Binding({"binding_distance": off if math.isfinite(off) else 1e300,
                         "why": f"the update is not the {encoding.kind} encoding of the committed last state"
                                " minus the round's model"}, evidence)
    if encoding.error_feedback and previous is not None:
        chain = residual_chain(encoding, feedback_part(final), previous, manifest_of(global_state))
        evidence["residual_chain"] = chain
        if chain == "forged":
            return _Binding({"why": "the committed residual is not what error feedback left after any of the"
                                    f" node's last {len(previous)} uploads of this job"}, evidence)
        if chain == "no_upload":
            return _Binding({"why": "the committed residual is not zero, and the node has no earlier upload"
                                    " of this job for it to come from"}, evidence)
    return _Binding(None, evidence)
