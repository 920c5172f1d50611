"""Evaluate a global model on the job's validation set: the loss, and the accuracy of a
classifier (the share of labels it ranks first) or of a language model (the share of
positions whose next token it ranks first). A language model's loss is the mean next-token
cross-entropy per position."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from gpuflex.protocol.jobspec import JobSpec
from gpuflex.protocol.modelspec import build_for_state
from torch import Tensor, nn

_BATCH = 1024
_LOGITS_PER_BATCH = 1 << 24  # a language model's batch: at most this many logits at once


@torch.no_grad()
def evaluate(
    spec: JobSpec, state: Mapping[str, Tensor], val: Mapping[str, Tensor]
) -> dict[str, float]:
    """Returns {"loss": ..., "accuracy": ...} (accuracy for classification and language models)."""
    model = build_for_state(spec.model, state, share=True)  # read-only use: no copy, no random init
    model.eval()
    x, y = val["x"], val["y"]
    x = x.to(spec.model.input_dtype)  # int64 token ids for Embedding-first models and transformers
    if spec.model.task == "language_model":
        metrics = _next_token(model, x, y, spec.model.vocab)
    else:
        metrics = _per_sample(spec, model, x, y)
    return {k: (v if math.isfinite(v) else float("nan")) for k, v in metrics.items()}


def _per_sample(spec: JobSpec, model: nn.Module, x: Tensor, y: Tensor) -> dict[str, float]:
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
            total_loss += (
                float(F.mse_loss(out, yb.reshape(out.shape), reduction="sum")) / out.shape[-1]
            )
        if classification:
            correct += int((out.argmax(dim=-1) == yb).sum())
    metrics = {"loss": total_loss / max(1, n)}
    if classification:
        metrics["accuracy"] = correct / max(1, n)
    return metrics


def _next_token(model: nn.Module, x: Tensor, y: Tensor, vocab: int) -> dict[str, float]:
    """Mean next-token cross-entropy and accuracy over every position of every window."""
    n, context = int(x.shape[0]), int(x.shape[1])
    batch = max(1, _LOGITS_PER_BATCH // max(1, context * vocab))
    total_loss = 0.0
    correct = 0
    for start in range(0, n, batch):
        xb = x[start : start + batch]  # (batch, context)
        yb = y[start : start + batch]  # (batch, context)
        logits = model(xb)  # (batch, context, vocab)
        total_loss += float(F.cross_entropy(logits.flatten(0, 1), yb.flatten(), reduction="sum"))
        correct += int((logits.argmax(dim=-1) == yb).sum())
    positions = max(1, n * context)
    return {"loss": total_loss / positions, "accuracy": correct / positions}
