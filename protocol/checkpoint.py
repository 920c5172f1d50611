"""Training-state checkpoints: the layout both the node (which commits to them) and the hub's
referee (which re-executes a segment between two of them) rely on.

A checkpoint is the FULL training state after ``step`` optimizer steps of one assignment,
as one flat state dict in the GFT1 codec (protocol/tensors.py; never pickle):

- ``model.<name>``: every tensor of the module's state dict (parameters and buffers);
- ``opt.momentum.<param>`` (SGD with momentum, once the first step made the buffer),
  ``opt.exp_avg.<param>`` / ``opt.exp_avg_sq.<param>`` and ``opt.t`` (Adam/AdamW, once
  stepped): the optimizer's state, by parameter name;
- ``amp.scale`` (float32 (1,)) and ``amp.growth`` (int32 (1,)), fp16 only: the loss scaler's
  state (protocol/lossscale.py), which decides the steps an overflow skips;
- ``step``: int64 (1,), the number of optimizer attempts taken (a skipped fp16 step counts);
- ``rng``: uint8, the CPU generator's state (in-model randomness other than dropout, whose
  masks are keyed by seed and step: protocol/dropout.py; the epoch's shuffle is re-derived
  from ``seed + epoch`` and needs no state);
- ``feedback.<name>`` (the last checkpoint only, when the job's encoding carries error
  feedback): the residual the node added to this update. Committing it lets the referee check
  that the upload is exactly the encoding of (last state - round model + residual).

The commitment to a checkpoint is ``state_hash``: the sha256 of its canonical encoding
(tensors in sorted name order, contiguous, CPU). A node records one every ``every`` steps
(``checkpoint_steps``), plus the first and the last, and signs the list of hashes into its
update header (messages.Commitment), together with each segment's update norm.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Final

import torch

from .errors import TensorError
from .messages import MAX_CHECKPOINTS
from .tensors import encode_state, sha256_hex

__all__ = [
    "DEFAULT_SEGMENTS",
    "MAX_SEGMENT_STEPS",
    "auto_every",
    "canonical_bytes",
    "checkpoint_steps",
    "model_part",
    "segment_norm",
    "state_hash",
    "step_of",
]

#: without ``[verification] checkpoint_every``, an assignment is cut into this many segments ...
DEFAULT_SEGMENTS: Final = 8
#: ... of at most this many steps (honest numeric classes drift apart with the segment's length:
#: bench/referee_calibration.py), while the commitment stays within MAX_CHECKPOINTS hashes
MAX_SEGMENT_STEPS: Final = 16
MODEL_PREFIX: Final = "model."
FEEDBACK_PREFIX: Final = "feedback."


def auto_every(total_steps: int, every: int = 0) -> int:
    """The checkpoint interval for ``total_steps`` steps: ``every`` when set (> 0), else about
    ``DEFAULT_SEGMENTS`` segments of at most ``MAX_SEGMENT_STEPS`` steps; never so small that
    the commitment would hold more than ``MAX_CHECKPOINTS`` hashes."""
    total = max(total_steps, 1)
    if every < 1:
        every = min(math.ceil(total / DEFAULT_SEGMENTS), MAX_SEGMENT_STEPS)
    return max(1, every, math.ceil(total / (MAX_CHECKPOINTS - 1)))


def checkpoint_steps(total_steps: int, every: int) -> list[int]:
    """The steps a node checkpoints: 0, every, 2*every, ..., and total_steps (always last)."""
    if total_steps < 0 or every < 1:
        raise TensorError(f"checkpoint_steps: need total_steps >= 0 and every >= 1, got {total_steps}, {every}")
    steps = list(range(0, total_steps, every))
    steps.append(total_steps)
    return steps


def canonical_bytes(state: Mapping[str, torch.Tensor]) -> bytes:
    """The GFT1 encoding with tensors in sorted name order (what ``state_hash`` hashes)."""
    return encode_state({k: state[k].detach().contiguous() for k in sorted(state)})


def state_hash(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 hex of ``canonical_bytes(state)``."""
    return sha256_hex(canonical_bytes(state))


def model_part(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The module's tensors of a checkpoint, under their module names."""
    n = len(MODEL_PREFIX)
    return {k[n:]: v for k, v in state.items() if k.startswith(MODEL_PREFIX)}


def feedback_part(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The error-feedback residual a last checkpoint commits (``feedback.<name>``: what the node
    added to this update, protocol/encoding.py), under the model's names."""
    n = len(FEEDBACK_PREFIX)
    return {k[n:]: v for k, v in state.items() if k.startswith(FEEDBACK_PREFIX)}


def step_of(state: Mapping[str, torch.Tensor]) -> int:
    """The ``step`` a checkpoint says it was taken at."""
    t = state.get("step")
    if t is None or t.dtype != torch.int64 or t.numel() != 1:
        raise TensorError("checkpoint has no int64 'step' tensor of one element")
    return int(t.reshape(-1)[0])


def segment_norm(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor],
                 names: Sequence[str] | None = None) -> float:
    """L2 norm of (b - a) over the floating tensors both hold (``names`` restricts them).

    Per tensor in float32 (a fused norm, no float64 copies: this runs at every checkpoint),
    summed across tensors in float64."""
    keys = names if names is not None else sorted(set(a) & set(b))
    total = 0.0
    for k in keys:
        x, y = a[k], b[k]
        if x.is_floating_point():
            n = float(torch.linalg.vector_norm(y.float() - x.float()))
            total += n * n
    return math.sqrt(total)
