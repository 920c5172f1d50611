"""Deterministic local training of one assignment.

The contract, which the hub's chunk format (hub/policy/dataset.py) and verification's replica
comparison rely on: build the module from the declarative spec
(shape only, seed 0), load the global state, concatenate the chunks in assignment order,
shuffle every epoch with ``torch.Generator().manual_seed(seed + epoch)``, use a fresh
optimizer, draw dropout masks keyed by ``seed`` and the step (protocol/dropout.py: any
device draws them alike), and return the DELTA (trained - global for floating
tensors, the node's value otherwise) as CPU tensors.

Same inputs on the same kind of device give bit-identical deltas: every source of
randomness is derived from ``seed``, the shuffle is drawn on the CPU whatever the device,
and on CUDA deterministic algorithms are requested.

Precision (``cfg.precision``, the hub's choice for this node): the master weights and the
optimizer stay float32 whatever it is. "bf16" / "fp16" run the forward pass and the loss
under ``torch.autocast``; "fp16" adds dynamic loss scaling (``LossScaler``: GradScaler's
rules); "tf32" turns on CUDA's TF32 matmul/cuDNN flags and nothing else; "fp32" turns them off.

Speed: the whole shard lives in one tensor on the device; a batch is one ``index_select``
with a slice of the epoch's permutation; the loop does nothing per step beyond the step
itself, a flag check and (in the last epoch) one tensor add for the loss.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from gpuflex.protocol.dropout import dropout_step
from gpuflex.protocol.lossscale import LossScaler
from gpuflex.protocol.modelspec import build_for_state, update_manifest
from gpuflex.protocol.transformer import NextTokenLoss
from gpuflex.protocol.workload import assignment_steps
from torch import Tensor, nn

from .computeshare import ComputeShare
from .errors import TrainError, TrainingStopped
from .optim import SGD, Adam, LocalOptimizer, clip_grad_norm

if TYPE_CHECKING:
    from gpuflex.protocol.messages import Commitment, TrainConfig
    from gpuflex.protocol.modelspec import ModelSpec
    from gpuflex.protocol.tensors import Manifest

__all__ = ["AUTOCAST_DTYPES", "LossScaler", "TrainResult", "loss_for", "make_optimizer", "prepare_device", "stack_chunks",
           "train_assignment"]


@dataclass(frozen=True)
class TrainResult:
    """What one assignment's training produced. ``delta`` holds CPU tensors."""

    delta: dict[str, Tensor]
    sample_count: int
    loss: float
    train_s: float
    steps: int
    #: the checkpoint commitment of this training (node/checkpoints.py), set by the agent
    commitment: Commitment | None = None


def make_optimizer(params: Sequence[Tensor], cfg: TrainConfig) -> LocalOptimizer:
    """A fresh optimizer for ``cfg`` (torch.optim's update rules; see node/optim.py)."""
    name = cfg.optimizer
    if name == "sgd":
        return SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if name in ("adam", "adamw"):
        return Adam(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay,
                    decoupled=name == "adamw")
    raise TrainError(f"unknown optimizer {name!r}; allowed: sgd, adam, adamw")


def stack_chunks(
    spec: ModelSpec, chunks: Sequence[Mapping[str, Tensor]]
) -> tuple[Tensor, Tensor]:
    """Concatenate the chunks in order into (x, y), checking them against the spec.

    x: float32 (n, *input_shape) (int64 token ids for Embedding-first models and transformers); y: int64 (n,) with
    labels in [0, outputs) for classification, float32 (n, outputs) for regression, int64 (n, context) next tokens
    in [0, vocab) for a language model.
    """
    if not chunks:
        raise TrainError("assignment has no chunks")
    input_shape = tuple(spec.input_shape)
    x_dtype = getattr(spec, "input_dtype", torch.float32)  # int64 token ids for Embedding models
    labels = spec.task in ("classification", "language_model")  # int64 class ids: labels or next tokens
    target_shape = tuple(spec.target_shape)
    xs: list[Tensor] = []
    ys: list[Tensor] = []
    for i, chunk in enumerate(chunks):
        if set(chunk) != {"x", "y"}:
            raise TrainError(f"chunk {i} must hold exactly tensors 'x' and 'y', has {sorted(chunk)}")
        x, y = chunk["x"], chunk["y"]
        if x.dtype != x_dtype or tuple(x.shape[1:]) != input_shape:
            raise TrainError(
                f"chunk {i}: x is {x.dtype} {tuple(x.shape)}, expected {x_dtype} (n, {input_shape})"
            )
        n = x.shape[0]
        if n and spec.takes_tokens and (int(x.min()) < 0 or int(x.max()) >= spec.vocab):
            raise TrainError(f"chunk {i}: token ids outside [0, {spec.vocab})")
        if labels:
            if y.dtype != torch.int64 or tuple(y.shape) != (n, *target_shape):
                raise TrainError(f"chunk {i}: y is {y.dtype} {tuple(y.shape)}, expected int64 {(n, *target_shape)}")
            if n and (int(y.min()) < 0 or int(y.max()) >= spec.outputs):
                raise TrainError(f"chunk {i}: labels outside [0, {spec.outputs})")
        elif y.dtype != torch.float32 or tuple(y.shape) != (n, spec.outputs):
            raise TrainError(
                f"chunk {i}: y is {y.dtype} {tuple(y.shape)}, expected float32 ({n}, {spec.outputs})"
            )
        xs.append(x)
        ys.append(y)
    x_all = xs[0] if len(xs) == 1 else torch.cat(xs)
    y_all = ys[0] if len(ys) == 1 else torch.cat(ys)
    if x_all.shape[0] == 0:
        raise TrainError("assignment has no samples")
    return x_all, y_all


def prepare_device(device: torch.device, precision: str = "fp32") -> None:
    if device.type == "cuda":
        # Must be set before cuBLAS creates its handle; the CLI sets it at start-up too.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        tf32 = precision == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32


AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _load_model(spec: ModelSpec, global_state: Mapping[str, Tensor], device: torch.device) -> nn.Module:
    """A private copy of the global model on ``device`` (no random init: it is overwritten)."""
    try:
        return build_for_state(spec, global_state, device=device)
    except (RuntimeError, ValueError) as exc:  # missing/unexpected keys or shape mismatch
        first = str(exc).strip().splitlines()
        raise TrainError(f"global model does not fit the spec: {' '.join(first)[:300]}") from exc


def train_assignment(
    spec: ModelSpec,
    global_state: Mapping[str, Tensor],
    chunks: Sequence[Mapping[str, Tensor]],
    cfg: TrainConfig,
    seed: int,
    *,
    device: torch.device,
    progress: Callable[[float], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_step: Callable[[int, nn.Module, LocalOptimizer, LossScaler | None], None] | None = None,
    on_loss: Callable[[int, float], None] | None = None,
    pace: ComputeShare | None = None,
) -> TrainResult:
    """Train ``cfg.local_epochs`` epochs on the concatenated chunks (or exactly ``cfg.local_steps``
    steps through the same per-epoch permutations when it is set, protocol/workload.py); the delta.

    Raises TrainError when the data or the state does not fit the spec, TrainingStopped
    when ``should_stop()`` turns true (checked between batches). ``on_step(step, model,
    optimizer, scaler)`` (the fp16 loss scaler, else None), before the first step (0) and after
    each one, is the checkpoint commitments' hook (node/checkpoints.py); ``on_loss(step, loss)``,
    at each progress report, the heartbeats' proof of progress (protocol.messages.progress_digest).
    ``cfg.precision``: what the forward pass runs in (autocast over fp32 master weights); ``pace``:
    the node's compute share, rested for after each step (node/computeshare.py)."""
    if cfg.local_epochs < 1 or cfg.batch_size < 1:
        raise TrainError("local_epochs and batch_size must be >= 1")
    loss_fn = loss_for(spec, cfg)
    precision = cfg.precision
    prepare_device(device, precision)
    autocast_dtype = AUTOCAST_DTYPES.get(precision)
    x_cpu, y_cpu = stack_chunks(spec, chunks)
    n = int(x_cpu.shape[0])
    bs = int(cfg.batch_size)
    steps_per_epoch = math.ceil(n / bs)
    total_steps = assignment_steps(n, bs, int(cfg.local_epochs), int(cfg.local_steps))
    epochs = math.ceil(total_steps / steps_per_epoch) if steps_per_epoch else 0
    report_every = max(1, min(total_steps // 100, 16))

    model = _load_model(spec, global_state, device)
    model.train()
    x, y = x_cpu.to(device), y_cpu.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, cfg)
    stop, computing = should_stop or (lambda: False), pace.computing if pace else contextlib.nullcontext
    scaler = LossScaler(device) if precision == "fp16" else None

    batch_step = _Step(model, loss_fn, optimizer, params, device.type, autocast_dtype, scaler, float(cfg.grad_clip))
    fork_devices = [device] if device.type == "cuda" else []
    started, step = time.perf_counter(), 0
    acc_dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
    loss_sum = torch.zeros((), dtype=acc_dtype, device=device)
    with torch.random.fork_rng(devices=fork_devices, device_type=device.type):
        torch.manual_seed(seed)  # dropout and any other in-model randomness
        if on_step is not None:
            on_step(0, model, optimizer, scaler)
        last_seen = 0  # samples the last (possibly partial) epoch ran through: its mean loss
        for idx, last_epoch in _batches(n, bs, epochs, total_steps, seed, device):
            if stop():
                raise TrainingStopped("training stopped between batches")
            # x: (batch, *input_shape); y: (batch,) or (batch, outputs)
            with computing(), dropout_step(seed, step):  # the referee replays step ``step``'s masks
                loss = batch_step(x.index_select(0, idx), y.index_select(0, idx))
            if last_epoch:
                loss_sum += loss.detach().float() * idx.shape[0]
                last_seen += int(idx.shape[0])
            step += 1
            if on_step is not None:
                on_step(step, model, optimizer, scaler)
            if progress is not None and step % report_every == 0:
                progress(step / total_steps)
            if on_loss is not None and step % report_every == 0:  # (steps, loss): heartbeats' proof
                on_loss(step, float(loss.detach()))
    mean_loss = float(loss_sum) / max(last_seen, 1)  # synchronizes on CUDA
    train_s = time.perf_counter() - started
    if progress is not None and step % report_every != 0:
        progress(1.0)

    return TrainResult(delta=_delta(model, global_state, update_manifest(spec)), sample_count=n, loss=mean_loss, train_s=train_s,
                       steps=step)


def _batches(n: int, bs: int, epochs: int, total_steps: int, seed: int,
             device: torch.device) -> Iterator[tuple[Tensor, bool]]:
    """Each step's sample indices, and whether it is in the last epoch: every epoch a
    permutation drawn from ``seed + epoch`` (its own generator: the global RNG, which dropout
    draws from, is not touched), cut into batches; ``total_steps`` may end mid-epoch."""
    step = 0
    for epoch in range(epochs):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).to(device)
        for start in range(0, n, bs):
            if step >= total_steps:
                return
            yield perm[start : start + bs], epoch == epochs - 1
            step += 1


@dataclass
class _Step:
    """One optimizer step on a batch, returning its loss. The forward pass runs under autocast
    in the job's precision; an fp16 step whose scaled gradients overflowed is skipped (the
    scaler backs off)."""

    model: nn.Module
    loss_fn: nn.Module
    optimizer: LocalOptimizer
    params: list[Tensor]
    device_type: str
    autocast_dtype: torch.dtype | None
    scaler: LossScaler | None
    clip: float

    def __call__(self, xb: Tensor, yb: Tensor) -> Tensor:
        self.optimizer.zero_grad()
        with (torch.autocast(self.device_type, dtype=self.autocast_dtype) if self.autocast_dtype
              else contextlib.nullcontext()):
            loss = self.loss_fn(self.model(xb), yb)
        finite = True
        if self.scaler is None:
            loss.backward()
        else:
            (loss.float() * self.scaler.scale).backward()
            finite = self.scaler.unscale(self.params)
            self.scaler.update()
        if self.clip > 0 and finite:
            clip_grad_norm(self.params, self.clip)
        if finite:
            self.optimizer.step()
        return loss


def loss_for(spec: ModelSpec, cfg: TrainConfig) -> nn.Module:
    """The job's loss, checked against the model's task."""
    if cfg.loss not in ("cross_entropy", "mse"):
        raise TrainError(f"unknown loss {cfg.loss!r}; allowed: cross_entropy, mse")
    if cfg.loss == "cross_entropy":
        if spec.task == "language_model":
            return NextTokenLoss()
        if spec.task != "classification":
            raise TrainError("loss cross_entropy needs a classification model or a language model")
        return nn.CrossEntropyLoss()
    if spec.task != "regression":
        raise TrainError("loss mse needs a regression model")
    return nn.MSELoss()


def _delta(model: nn.Module, global_state: Mapping[str, Tensor], carried: Manifest) -> dict[str, Tensor]:
    """The trained state minus the round's (CPU, in the global state's dtypes) over the tensors
    an update carries (a LoRA job's: its adapters); a tensor that is not floating (a counter)
    travels as its new value."""
    delta: dict[str, Tensor] = {}
    trained = model.state_dict()
    for name in (t.name for t in carried):
        ref = global_state[name]
        value = trained[name].detach().to("cpu")
        if ref.is_floating_point():
            delta[name] = value.to(ref.dtype) - ref
        else:
            delta[name] = value.clone()
    return delta
