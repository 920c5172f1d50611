"""Evaluate a global model on the job's validation set (loss; accuracy for classification)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from gpuflex.protocol.jobspec import JobSpec
from gpuflex.protocol.modelspec import build_for_state
from torch import Tensor

_BATCH = 1024


@torch.no_grad()
def evaluate(spec: JobSpec, state: Mapping[str, Tensor], val: Mapping[str, Tensor]) -> dict[str, float]:
    """Returns {"loss": ..., "accuracy": ...} (accuracy only for classification)."""
    model = build_for_state(spec.model, state, share=True)  # read-only use: no copy, no random init
    model.eval()
    x, y = val["x"], val["y"]
    x = x.to(spec.model.input_dtype)  # int64 token ids for Embedding-first models
    n = int(x.shape[0])
    total_loss = 0.0
    correct = 0
    classification = spec.model.task == "classification"
    mse = spec.train.loss == "mse"
    for start in range(0, n, _BATCH):
        xb = x[start : start + _BATCH]  # (batch, *input_shape)
        yb = y[start : start + _BATCH]
        out = model(xb)  # (batch, outputs)
        if classification and not mse:
            total_loss += float(F.cross_entropy(out, yb, reduction="sum"))
        elif classification:
            target = F.one_hot(yb, out.shape[-1]).to(out.dtype)
            total_loss += float(F.mse_loss(out, target, reduction="sum")) / out.shape[-1]
        else:
            total_loss += float(F.mse_loss(out, yb.reshape(out.shape), reduction="sum")) / out.shape[-1]
        if classification:
            correct += int((out.argmax(dim=-1) == yb).sum())
    metrics = {"loss": total_loss / max(1, n)}
    if classification:
        metrics["accuracy"] = correct / max(1, n)
    return {k: (v if math.isfinite(v) else float("nan")) for k, v in metrics.items()}
