"""Dataset ingest: parse .npz or .csv, validate against the model spec, cut into chunks.

A chunk blob (and the validation set) is `encode_state({"x": ..., "y": ...})`: x is
float32 (n, *input_shape), or int64 token ids in [0, num_embeddings) when the model's
first layer is an Embedding (ModelSpec.input_dtype, what the node's trainer requires);
y is int64 (n,) for classification or float32 (n, outputs) for regression.
Never unpickles: `np.load(..., allow_pickle=False)`; object arrays are refused.
"""

from __future__ import annotations

import csv
import io
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gpuflex.protocol.tensors import encode_state

from .datafiles import SNIFF_BYTES, content_problem, sniff
from .errors import Unprocessable

MAX_SAMPLES = 50_000_000
MAX_CSV_COLUMNS = 100_000


@dataclass(frozen=True)
class Arrays:
    x: np.ndarray  # (n, *input_shape) float32, or int64 token ids for an Embedding-first model
    y: np.ndarray  # (n,) int64 or (n, outputs) float32

    def __len__(self) -> int:
        return int(self.x.shape[0])


def _bad(detail: str, code: str = "bad_dataset") -> Unprocessable:
    return Unprocessable(detail, code=code)


def read_arrays(path: Path, *, label_column: str, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Read x and y from an .npz or a CSV with a header row, told apart by content
    (datafiles.sniff); JSON, a bare .npy and other binary data are refused by name."""
    with open(path, "rb") as fh:
        head = fh.read(SNIFF_BYTES)
    kind = sniff(head)
    problem = content_problem(kind, what)
    if problem is not None:
        raise _bad(problem)
    if kind == "npz":
        return _read_npz(path, what)
    return _read_csv(path, label_column, what)


def _read_npz(path: Path, what: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as npz:
            names = set(npz.files)
            if not {"x", "y"} <= names:
                raise _bad(f"{what}: .npz must hold arrays 'x' and 'y' (found {sorted(names)[:8]})")
            x = npz["x"]
            y = npz["y"]
    except Unprocessable:
        raise
    except ValueError as exc:  # object arrays need pickle: refused
        raise _bad(f"{what}: cannot read .npz without pickle ({exc}); save numeric arrays only") from None
    except (OSError, zipfile.BadZipFile, EOFError, KeyError) as exc:
        raise _bad(f"{what}: not a readable .npz file ({exc.__class__.__name__})") from None
    return x, y


def _read_csv(path: Path, label_column: str, what: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise _bad(f"{what}: neither an .npz nor a UTF-8 CSV file") from None
    reader = csv.reader(io.StringIO(text))
    try:
        header = next(reader)
    except StopIteration:
        raise _bad(f"{what}: CSV file is empty") from None
    except csv.Error as exc:
        raise _bad(f"{what}: malformed CSV ({exc})") from None
    header = [h.strip() for h in header]
    if len(header) > MAX_CSV_COLUMNS:
        raise _bad(f"{what}: CSV has too many columns")
    if label_column not in header:
        raise _bad(f"{what}: CSV has no label column {label_column!r} (set [data] label_column)")
    li = header.index(label_column)
    xs: list[list[float]] = []
    ys: list[float] = []
    try:
        for lineno, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != len(header):
                raise _bad(f"{what}: CSV line {lineno} has {len(row)} fields, header has {len(header)}")
            values = [float(v) for v in row]
            ys.append(values[li])
            xs.append(values[:li] + values[li + 1 :])
            if len(xs) > MAX_SAMPLES:
                raise _bad(f"{what}: too many rows")
    except ValueError as exc:
        raise _bad(f"{what}: CSV holds a non-numeric value ({exc})") from None
    except csv.Error as exc:
        raise _bad(f"{what}: malformed CSV ({exc})") from None
    return np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)


def validate_arrays(x: Any, y: Any, spec: Any, *, what: str) -> Arrays:
    """Check dtypes, shapes, label range and finiteness against the ModelSpec."""
    if not isinstance(x, np.ndarray) or not isinstance(y, np.ndarray):
        raise _bad(f"{what}: x and y must be arrays")
    for name, arr in (("x", x), ("y", y)):
        if arr.dtype.kind not in "biuf":
            raise _bad(f"{what}: {name} has dtype {arr.dtype}; only numeric arrays are accepted")
    n = int(x.shape[0]) if x.ndim >= 1 else 0
    if n == 0:
        raise _bad(f"{what}: no samples")
    if n > MAX_SAMPLES:
        raise _bad(f"{what}: {n} samples is more than the limit {MAX_SAMPLES}")
    if y.ndim == 0 or y.shape[0] != n:
        raise _bad(f"{what}: x has {n} samples but y has shape {tuple(y.shape)}")
    input_shape = tuple(int(d) for d in spec.input_shape)
    want = math.prod(input_shape)
    if x[0].size != want:
        raise _bad(
            f"{what}: each sample of x has shape {tuple(x.shape[1:])} but the model takes {input_shape}",
            "bad_shape",
        )
    if spec.input_dtype == torch.int64:
        xf = _token_ids(x.reshape((n, *input_shape)), _num_embeddings(spec), what)
    else:
        xf = np.ascontiguousarray(x.reshape((n, *input_shape)), dtype=np.float32)
        if not np.isfinite(xf).all():
            raise _bad(f"{what}: x contains NaN or Inf", "non_finite")
    if spec.task == "classification":
        if y.ndim != 1:
            raise _bad(f"{what}: classification labels y must be 1-D, got shape {tuple(y.shape)}", "bad_shape")
        if y.dtype.kind == "f":
            if not np.isfinite(y).all():
                raise _bad(f"{what}: y contains NaN or Inf", "non_finite")
            if not np.all(np.floor(y) == y):
                raise _bad(f"{what}: classification labels must be whole numbers")
        yi = y.astype(np.int64)
        if yi.min() < 0 or yi.max() >= spec.outputs:
            raise _bad(
                f"{what}: labels must be in 0..{spec.outputs - 1} for {spec.outputs} classes "
                f"(found {int(yi.min())}..{int(yi.max())})",
                "bad_labels",
            )
        return Arrays(xf, np.ascontiguousarray(yi))
    yf = np.asarray(y, dtype=np.float32)
    if yf.ndim == 1:
        yf = yf.reshape(n, 1)
    if yf.shape[1:] != (spec.outputs,):
        raise _bad(f"{what}: regression targets must have shape (n, {spec.outputs})", "bad_shape")
    if not np.isfinite(yf).all():
        raise _bad(f"{what}: y contains NaN or Inf", "non_finite")
    return Arrays(xf, np.ascontiguousarray(yf))


def _num_embeddings(spec: Any) -> int:
    return int(spec.layers[0].kwargs()["num_embeddings"])


def _token_ids(x: np.ndarray, vocab: int, what: str) -> np.ndarray:
    """x as int64 token ids for an Embedding-first model: whole numbers in [0, vocab).
    Checked before the cast, so 1e30 or -0.5 is refused rather than wrapped or truncated."""
    if x.dtype.kind == "f":
        if not np.isfinite(x).all():
            raise _bad(f"{what}: x contains NaN or Inf", "non_finite")
        if not np.all(np.floor(x) == x):
            raise _bad(f"{what}: x holds token ids for the Embedding layer, which must be whole numbers",
                       "bad_tokens")
    lo, hi = x.min(), x.max()
    if lo < 0 or hi >= vocab:
        raise _bad(
            f"{what}: token ids in x must be in 0..{vocab - 1} for Embedding(num_embeddings={vocab})"
            f" (found {float(lo):.15g}..{float(hi):.15g})",
            "bad_tokens",
        )
    return np.ascontiguousarray(x, dtype=np.int64)


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


def encode_arrays(data: Arrays) -> bytes:
    return encode_state({"x": torch.from_numpy(np.ascontiguousarray(data.x)), "y": torch.from_numpy(np.ascontiguousarray(data.y))})


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
