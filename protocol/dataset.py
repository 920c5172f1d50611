"""Dataset files and the arrays they hold: one implementation for the hub and the node.

A training or validation set (uploaded to the hub) and a silo (kept on a node, docs/silos.md "Data
that stays on its node") are the same thing: an ``.npz`` archive holding arrays ``x`` and
``y`` (``numpy.savez``), or a ``.csv`` file with a header row naming a label column. Both are
read here, told apart by content (:func:`sniff`), checked against the model spec
(:func:`validate_arrays`) and encoded the same way (:func:`encode_arrays`):

    encode_state({"x": ..., "y": ...})   x float32 (n, *input_shape), or int64 token ids in
                                         [0, num_embeddings) when the model's first layer is an
                                         Embedding (ModelSpec.input_dtype);
                                         y int64 (n,) for classification, float32 (n, outputs)
                                         for regression;
                                         a language model: x and y int64 (n, context) token ids
                                         in [0, vocab), y[i, t] the token after x[i, t]

which is what the node's trainer requires of a chunk.

Never unpickles: ``np.load(..., allow_pickle=False)``; object arrays are refused. Every
refusal is a :class:`DatasetError` with one line naming the file (``what``) and a ``code``.

Light to import: numpy and torch load inside the functions that need them, so a command line
that only checks a file's name and first bytes (:func:`check_dataset_file`) starts at once.
"""

from __future__ import annotations

import csv
import io
import math
import os
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from .errors import DatasetError

if TYPE_CHECKING:
    import numpy as np

    from .modelspec import ModelSpec

ACCEPTED: Final = ".npz (arrays x and y, from numpy.savez) or .csv (a header row with a label column)"
SUFFIXES: Final = {".npz": "npz", ".csv": "csv"}
SNIFF_BYTES: Final = 512
MAX_SAMPLES: Final = 50_000_000
MAX_CSV_COLUMNS: Final = 100_000

#: what each content kind is called in a message
KIND_NAMES: Final = {
    "npz": "an .npz archive",
    "npy": "a single .npy array",
    "zip": "a zip archive that is not an .npz (whose members are .npy arrays)",
    "parquet": "a Parquet file",
    "json": "JSON",
    "csv": "CSV text",
    "binary": "binary data that is neither .npz nor CSV",
    "empty": "empty",
}

#: what np.load may raise on a damaged or hostile archive (bad zip, bad deflate stream,
#: an encrypted member, a header declaring an absurd shape, a truncated member)
_NPZ_ERRORS: Final = (OSError, zipfile.BadZipFile, EOFError, KeyError, zlib.error, NotImplementedError,
                      RuntimeError, struct.error, OverflowError, TypeError, MemoryError)


@dataclass(frozen=True)
class Arrays:
    """Validated samples: ``x`` (n, *input_shape) float32, or int64 token ids for an
    Embedding-first model; ``y`` (n,) int64 labels or (n, outputs) float32 targets."""

    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return int(self.x.shape[0])


# --------------------------------------------------------------------------- file kinds


def sniff(head: bytes) -> str:
    """The content kind of a file from its first bytes: npz (a zip archive whose first member is
    an .npy array), zip (any other zip archive), parquet, npy, json, csv, binary or empty."""
    if not head:
        return "empty"
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return "npz" if _first_member(head).endswith(".npy") else "zip"
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if text[:1] in (b"{", b"["):
        return "json"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.reason != "unexpected end of data":  # a character cut at the end is still text
            return _binary(head)
    if b"\x00" in head:
        return _binary(head)
    return "csv"


def _binary(head: bytes) -> str:
    """The kind of binary content: a Parquet file (its magic, then binary metadata) or other."""
    return "parquet" if head.startswith(b"PAR1") else "binary"


def _first_member(head: bytes) -> str:
    """The name of a zip archive's first member, from its local file header ("" when the
    archive is empty or the name is cut off): numpy.savez writes x.npy and y.npy."""
    if not head.startswith(b"PK\x03\x04") or len(head) < 30:
        return ""
    (name_len,) = struct.unpack_from("<H", head, 26)
    return head[30 : 30 + name_len].decode("utf-8", errors="replace") if len(head) >= 30 + name_len else ""


def content_problem(kind: str, what: str, head: bytes = b"") -> str | None:
    """The one-line refusal for content the protocol does not read, or None for npz/csv;
    ``head`` (the file's first bytes) lets it name a zip archive's first member."""
    if kind in ("npz", "csv"):
        return None
    if kind == "npy":
        return (f"{what}: this is a single .npy array; save x and y together with "
                f"numpy.savez(path, x=x, y=y). Accepted: {ACCEPTED}")
    if kind in ("zip", "parquet"):
        first = _first_member(head) if kind == "zip" else ""
        found = f" (its first member is {first!r})" if first else ""
        return (f"{what}: the file is {KIND_NAMES[kind]}{found}; save x and y with numpy.savez(path, x=x, y=y) "
                f"or write a CSV. Accepted: {ACCEPTED}")
    return f"{what}: the file is {KIND_NAMES[kind]}. Accepted: {ACCEPTED}"


def check_dataset_file(path: Path, what: str) -> str:
    """Check a local dataset file before it is used; return its kind ("npz" or "csv").

    DatasetError with one line for a missing file, a directory, an unreadable file, content
    that is not read here, and a suffix that is not .npz/.csv or disagrees with the content.
    """
    label = f"{what} {path}"
    if not path.exists():
        raise DatasetError(f"{label}: no such file")
    if path.is_dir():
        raise DatasetError(f"{label}: is a directory; give a file. Accepted: {ACCEPTED}")
    if not os.access(path, os.R_OK):
        raise DatasetError(f"{label}: not readable (permission denied)")
    try:
        with open(path, "rb") as fh:
            head = fh.read(SNIFF_BYTES)
    except OSError as exc:
        raise DatasetError(f"{label}: cannot read it ({exc.strerror or exc})") from None
    kind = sniff(head)
    problem = content_problem(kind, label, head)
    if problem is not None:
        raise DatasetError(problem)
    suffix = path.suffix.lower()
    named = SUFFIXES.get(suffix)
    if named is None:
        raise DatasetError(
            f"{label}: the name ends in {suffix or '(no suffix)'!r}, which is not a dataset format; "
            f"the content is {KIND_NAMES[kind]}, so name it .{kind}. Accepted: {ACCEPTED}"
        )
    if named != kind:
        raise DatasetError(
            f"{label}: the name says {suffix} but the content is {KIND_NAMES[kind]}; "
            f"rename it to .{kind} or export the data again. Accepted: {ACCEPTED}"
        )
    return kind


# --------------------------------------------------------------------------- reading


def read_arrays(path: Path, *, label_column: str, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Read x and y from an .npz or a CSV with a header row, told apart by content
    (:func:`sniff`); JSON, a bare .npy and other binary data are refused by name. The arrays
    are as stored: :func:`validate_arrays` checks and converts them."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(SNIFF_BYTES)
    except OSError as exc:
        raise DatasetError(f"{what}: cannot read it ({exc.strerror or exc.__class__.__name__})") from None
    kind = sniff(head)
    problem = content_problem(kind, what, head)
    if problem is not None:
        raise DatasetError(problem)
    if kind == "npz":
        return _read_npz(path, what)
    return _read_csv(path, label_column, what)


def _read_npz(path: Path, what: str) -> tuple[np.ndarray, np.ndarray]:
    import numpy as np

    try:
        with np.load(path, allow_pickle=False) as npz:
            names = set(npz.files)
            if not {"x", "y"} <= names:
                raise DatasetError(f"{what}: .npz must hold arrays 'x' and 'y' (found {sorted(names)[:8]})")
            x = npz["x"]
            y = npz["y"]
    except DatasetError:
        raise
    except ValueError as exc:  # object arrays need pickle: refused (and numpy's header errors)
        detail = " ".join(str(exc).split())[:200]
        raise DatasetError(f"{what}: cannot read .npz without pickle ({detail}); save numeric arrays only") from None
    except _NPZ_ERRORS as exc:
        raise DatasetError(f"{what}: not a readable .npz file ({exc.__class__.__name__})") from None
    if not isinstance(x, np.ndarray) or not isinstance(y, np.ndarray):
        raise DatasetError(f"{what}: .npz must hold arrays 'x' and 'y'")
    return x, y


def _read_csv(path: Path, label_column: str, what: str) -> tuple[np.ndarray, np.ndarray]:
    import numpy as np

    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DatasetError(f"{what}: neither an .npz nor a UTF-8 CSV file") from None
    except OSError as exc:
        raise DatasetError(f"{what}: cannot read it ({exc.strerror or exc.__class__.__name__})") from None
    reader = csv.reader(io.StringIO(text))
    try:
        header = next(reader)
    except StopIteration:
        raise DatasetError(f"{what}: CSV file is empty") from None
    except csv.Error as exc:
        raise DatasetError(f"{what}: malformed CSV ({exc})") from None
    header = [h.strip() for h in header]
    if len(header) > MAX_CSV_COLUMNS:
        raise DatasetError(f"{what}: CSV has too many columns")
    if label_column not in header:
        raise DatasetError(f"{what}: CSV has no label column {label_column!r} (set [data] label_column);"
                           f" its columns: {_column_list(header)}")
    li = header.index(label_column)
    xs: list[list[float]] = []
    ys: list[float] = []
    try:
        for lineno, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != len(header):
                raise DatasetError(f"{what}: CSV line {lineno} has {len(row)} fields, header has {len(header)}")
            values = [float(v) for v in row]
            ys.append(values[li])
            xs.append(values[:li] + values[li + 1 :])
            if len(xs) > MAX_SAMPLES:
                raise DatasetError(f"{what}: too many rows")
    except ValueError as exc:
        raise DatasetError(f"{what}: CSV holds a non-numeric value ({' '.join(str(exc).split())[:120]})") from None
    except csv.Error as exc:
        raise DatasetError(f"{what}: malformed CSV ({exc})") from None
    return np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)


def _column_list(header: list[str], most: int = 20) -> str:
    """The header's column names for a message: the first ``most`` of them, and how many in all."""
    names = ", ".join(repr(h) for h in header[:most])
    return names if len(header) <= most else f"{names}, ... ({len(header)} in all)"


# --------------------------------------------------------------------------- validation


def validate_arrays(x: Any, y: Any, spec: ModelSpec, *, what: str) -> Arrays:
    """Check dtypes, shapes, label range and finiteness against the model spec; the arrays in
    the dtypes and shapes the trainer takes (see the module docstring)."""
    import numpy as np
    import torch

    if not isinstance(x, np.ndarray) or not isinstance(y, np.ndarray):
        raise DatasetError(f"{what}: x and y must be arrays")
    for name, arr in (("x", x), ("y", y)):
        if arr.dtype.kind not in "biuf":
            raise DatasetError(f"{what}: {name} has dtype {arr.dtype}; only numeric arrays are accepted")
    n = int(x.shape[0]) if x.ndim >= 1 else 0
    if n == 0:
        raise DatasetError(f"{what}: no samples")
    if n > MAX_SAMPLES:
        raise DatasetError(f"{what}: {n} samples is more than the limit {MAX_SAMPLES}")
    if y.ndim == 0 or y.shape[0] != n:
        raise DatasetError(f"{what}: x has {n} samples but y has shape {tuple(y.shape)}")
    if spec.task == "language_model":
        return _token_windows(x, y, spec, what)
    input_shape = tuple(int(d) for d in spec.input_shape)
    want = math.prod(input_shape)
    if x[0].size != want:
        raise DatasetError(
            f"{what}: each sample of x has shape {tuple(x.shape[1:])} but the model takes {input_shape}",
            code="bad_shape",
        )
    if spec.input_dtype == torch.int64:
        xf = _token_ids(x.reshape((n, *input_shape)), spec.vocab, what)
    else:
        with np.errstate(over="ignore", invalid="ignore"):  # float64 beyond float32 becomes inf: refused below
            xf = np.ascontiguousarray(x.reshape((n, *input_shape)), dtype=np.float32)
        if not np.isfinite(xf).all():
            raise DatasetError(f"{what}: x contains NaN or Inf", code="non_finite")
    if spec.task == "classification":
        if y.ndim != 1:
            raise DatasetError(f"{what}: classification labels y must be 1-D, got shape {tuple(y.shape)}",
                               code="bad_shape")
        if y.dtype.kind == "f":
            if not np.isfinite(y).all():
                raise DatasetError(f"{what}: y contains NaN or Inf", code="non_finite")
            if not np.all(np.floor(y) == y):
                raise DatasetError(f"{what}: classification labels must be whole numbers")
        lo, hi = y.min(), y.max()  # before the cast: 1e30 must not wrap into range
        if lo < 0 or hi >= spec.outputs:
            raise DatasetError(
                f"{what}: labels must be in 0..{spec.outputs - 1} for {spec.outputs} classes "
                f"(found {int(lo)}..{int(hi)})",
                code="bad_labels",
            )
        return Arrays(xf, np.ascontiguousarray(y, dtype=np.int64))
    with np.errstate(over="ignore", invalid="ignore"):
        yf = np.asarray(y, dtype=np.float32)
    if yf.ndim == 1:
        yf = yf.reshape(n, 1)
    if yf.shape[1:] != (spec.outputs,):
        raise DatasetError(f"{what}: regression targets must have shape (n, {spec.outputs})", code="bad_shape")
    if not np.isfinite(yf).all():
        raise DatasetError(f"{what}: y contains NaN or Inf", code="non_finite")
    return Arrays(xf, np.ascontiguousarray(yf))


def _token_windows(x: np.ndarray, y: np.ndarray, spec: ModelSpec, what: str) -> Arrays:
    """A language model's samples: x and y int64 (n, context) token ids below the vocabulary
    (:func:`text_windows` makes them from text). Integer arrays only: a token id is not
    rounded from a float."""
    import numpy as np

    context, vocab = int(spec.input_shape[0]), spec.vocab
    for name, arr in (("x", x), ("y", y)):
        if arr.dtype.kind not in "iu":
            raise DatasetError(f"{what}: {name} holds token ids, an integer array; got {arr.dtype}",
                               code="bad_tokens")
        if arr.ndim != 2 or arr.shape[1] != context:
            raise DatasetError(f"{what}: {name} must have shape (n, {context}) for context {context},"
                               f" got {tuple(arr.shape)}", code="bad_shape")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= vocab:
            raise DatasetError(f"{what}: token ids in {name} must be in 0..{vocab - 1} for vocab {vocab}"
                               f" (found {lo}..{hi})", code="bad_tokens")
    return Arrays(np.ascontiguousarray(x, dtype=np.int64), np.ascontiguousarray(y, dtype=np.int64))


def text_windows(text: bytes, context: int, *, what: str) -> Arrays:
    """Byte-level language-model samples from UTF-8 ``text``: token i is byte i (vocab 256);
    non-overlapping windows of ``context`` tokens, x the window and y the same window one byte
    later (the next token at every position). The bytes after the last whole window are left
    out. DatasetError when the text is not UTF-8 or shorter than one window plus one byte."""
    import numpy as np

    try:
        text.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{what}: not UTF-8 text (byte {exc.start} cannot be decoded)") from None
    n = (len(text) - 1) // context if context > 0 else 0
    if n < 1:
        raise DatasetError(f"{what}: {len(text)} bytes of text hold no window of {context} tokens"
                           f" and its next token; give at least {context + 1} bytes")
    tokens = np.frombuffer(text, dtype=np.uint8).astype(np.int64)
    x = tokens[: n * context].reshape(n, context)
    y = tokens[1 : n * context + 1].reshape(n, context)
    return Arrays(np.ascontiguousarray(x), np.ascontiguousarray(y))


def _token_ids(x: np.ndarray, vocab: int, what: str) -> np.ndarray:
    """x as int64 token ids for an Embedding-first model: whole numbers in [0, vocab).
    Checked before the cast, so 1e30 or -0.5 is refused rather than wrapped or truncated."""
    import numpy as np

    if x.dtype.kind == "f":
        if not np.isfinite(x).all():
            raise DatasetError(f"{what}: x contains NaN or Inf", code="non_finite")
        if not np.all(np.floor(x) == x):
            raise DatasetError(f"{what}: x holds token ids for the Embedding layer, which must be whole numbers",
                               code="bad_tokens")
    lo, hi = x.min(), x.max()
    if lo < 0 or hi >= vocab:
        raise DatasetError(
            f"{what}: token ids in x must be in 0..{vocab - 1} for Embedding(num_embeddings={vocab})"
            f" (found {float(lo):.15g}..{float(hi):.15g})",
            code="bad_tokens",
        )
    return np.ascontiguousarray(x, dtype=np.int64)


# --------------------------------------------------------------------------- the blob


def encode_arrays(data: Arrays) -> bytes:
    """The arrays as one GFT1 blob (a chunk, a validation set, a silo)."""
    import numpy as np
    import torch

    from .tensors import encode_state

    return encode_state({"x": torch.from_numpy(np.ascontiguousarray(data.x)),
                         "y": torch.from_numpy(np.ascontiguousarray(data.y))})


def decode_arrays(blob: bytes | bytearray | memoryview, *, what: str) -> Arrays:
    """The arrays of an :func:`encode_arrays` blob (copied out of ``blob``); DatasetError when
    it is not a GFT1 blob holding exactly ``x`` and ``y`` with as many samples."""
    import torch

    from .errors import ProtocolError
    from .tensors import decode_state

    try:
        state = decode_state(blob)
    except ProtocolError as exc:
        raise DatasetError(f"{what}: not a dataset blob ({exc})") from None
    if set(state) != {"x", "y"}:
        raise DatasetError(f"{what}: a dataset blob holds x and y, this one {sorted(state)[:8]}")
    x, y = state["x"], state["y"]
    if x.dim() < 1 or y.dim() < 1 or x.shape[0] != y.shape[0]:
        raise DatasetError(f"{what}: x and y disagree on the sample count")
    if x.dtype not in (torch.float32, torch.int64) or y.dtype not in (torch.float32, torch.int64):
        raise DatasetError(f"{what}: a dataset blob holds float32 or int64 arrays, this one {x.dtype} and {y.dtype}")
    return Arrays(x.numpy().copy(), y.numpy().copy())


__all__ = [
    "ACCEPTED",
    "KIND_NAMES",
    "MAX_CSV_COLUMNS",
    "MAX_SAMPLES",
    "SNIFF_BYTES",
    "SUFFIXES",
    "Arrays",
    "DatasetError",
    "check_dataset_file",
    "content_problem",
    "decode_arrays",
    "encode_arrays",
    "read_arrays",
    "sniff",
    "text_windows",
    "validate_arrays",
]
