"""Dataset ingest: read .npz or .csv, validate against the model spec, cut into chunks.

Reading, validation and the blob format are the protocol's (``protocol/dataset.py``), shared
with the node's silos: this module turns their DatasetError into the hub's Unprocessable (422,
its ``code``), and keeps what only the hub does: the split and the chunks.

A chunk blob (and the validation set) is `encode_state({"x": ..., "y": ...})`: x is
float32 (n, *input_shape), or int64 token ids in [0, num_embeddings) when the model's
first layer is an Embedding (ModelSpec.input_dtype, what the node's trainer requires);
y is int64 (n,) for classification, float32 (n, outputs) for regression, and for a language
model int64 (n, context) next tokens beside x's int64 (n, context) tokens.
Never unpickles: `np.load(..., allow_pickle=False)`; object arrays are refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gpuflex.protocol import dataset as _dataset
from gpuflex.protocol.dataset import (
    MAX_CSV_COLUMNS,
    MAX_SAMPLES,
    Arrays,
    DatasetError,
    encode_arrays,
)

from ..base.errors import Unprocessable

__all__ = ["MAX_CSV_COLUMNS", "MAX_SAMPLES", "Arrays", "encode_arrays", "make_chunks", "read_arrays",
           "split_validation", "validate_arrays"]


def _bad(detail: str, code: str = "bad_dataset") -> Unprocessable:
    return Unprocessable(detail, code=code)


@contextlib.contextmanager
def _unprocessable() -> Iterator[None]:
    """The protocol's DatasetError as the hub's 422, with its code."""
    try:
        yield
    except DatasetError as exc:
        raise _bad(str(exc), exc.code) from None


def read_arrays(path: Path, *, label_column: str, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Read x and y from an .npz or a CSV with a header row, told apart by content
    (protocol/dataset.py sniff); JSON, a bare .npy and other binary data are refused by name."""
    with _unprocessable():
        return _dataset.read_arrays(path, label_column=label_column, what=what)


def validate_arrays(x: Any, y: Any, spec: Any, *, what: str) -> Arrays:
    """Check dtypes, shapes, label range and finiteness against the ModelSpec."""
    with _unprocessable():
        return _dataset.validate_arrays(x, y, spec, what=what)


def _order(y: np.ndarray, stratified: bool, rng: np.random.Generator) -> np.ndarray:
    """A deterministic sample order; stratified spreads every class evenly along it."""
    n = y.shape[0]
    if not stratified or y.ndim != 1:
        return rng.permutation(n)
    keys = np.empty(n, dtype=np.float64)
    for label in np.unique(y):
        idx = np.flatnonzero(y == label)
        idx = idx[rng.permutation(idx.size)]
        # position within its class, spread over [0, 1): interleaves classes
        keys[idx] = (np.arange(idx.size) + rng.random()) / idx.size
    return np.argsort(keys, kind="stable")


def split_validation(data: Arrays, fraction: float, *, stratified: bool, seed: int) -> tuple[Arrays, Arrays | None]:
    """Hold back `fraction` of the samples (per class when stratified), deterministically."""
    if fraction <= 0:
        return data, None
    n = len(data)
    rng = np.random.default_rng([seed, 1])
    groups = [np.flatnonzero(data.y == c) for c in np.unique(data.y)] if stratified and data.y.ndim == 1 \
        else [np.arange(n)]
    picked = [g[rng.permutation(g.size)[: round(g.size * fraction)]] for g in groups]
    val_idx = np.sort(np.concatenate(picked))
    if val_idx.size < 1 or val_idx.size >= n:
        raise _bad(f"validation_fraction {fraction} leaves no training or no validation samples")
    mask = np.zeros(n, dtype=bool)
    mask[val_idx] = True
    return Arrays(data.x[~mask], data.y[~mask]), Arrays(data.x[mask], data.y[mask])


def make_chunks(data: Arrays, chunk_size: int, *, stratified: bool, seed: int) -> list[tuple[bytes, int]]:
    """Cut the training set into fixed-size chunk blobs (the last may be smaller)."""
    if chunk_size < 1:
        raise _bad("[data] chunk_size must be >= 1")
    order = _order(data.y, stratified, np.random.default_rng([seed, 2]))
    out: list[tuple[bytes, int]] = []
    for start in range(0, len(data), chunk_size):
        idx = order[start : start + chunk_size]
        out.append((encode_arrays(Arrays(data.x[idx], data.y[idx])), int(idx.size)))
    return out
