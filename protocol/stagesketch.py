"""A stage's sketch of a raw tensor it sends across a pipeline cut: its largest entries.

What crosses a cut may travel encoded (protocol/boundarycodec.py): int8 levels, or a few
directions at 4 bits. A referee that re-executes the stage sees, through such a code, only the
part of a fault that moves a value across a level's edge or a row's scale. So at the steps the
hub may check, the sending stage also commits to the tensor *before* it is encoded: the flat
indices of its ``SKETCH_ENTRIES`` largest magnitudes and their float32 values. The referee
recomputes the raw tensor and compares it there, at full precision, whatever the code threw
away (hub/policy/stage_check.py).

Why it cannot be met without computing the tensor: the values must be the recomputed tensor's
at those indices (within the compute class's tolerance), and the indices must be where the
recomputed tensor's largest magnitudes are (no entry outside them larger, beyond that
tolerance). Knowing where a tensor's largest entries are needs every entry, so a stage cannot
sketch a cheap part (one row it computed honestly) or values near zero.

The bytes (little-endian): ``b"GFS1"``, the raw tensor's element count (uint32), the count of
entries (uint32: ``min(SKETCH_ENTRIES, numel)``, exactly), the indices (uint32, strictly
increasing, each below the element count), then their values (float32, finite). At most
``MAX_SKETCH_BYTES`` (1 KiB). Decoding is strict; every refusal is one DecodeError line.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

import numpy as np
import torch

from .errors import DecodeError, EncodeError
from .relaymessages import MAX_SKETCH_BYTES

#: the entries a sketch holds (fewer only when the tensor has fewer elements)
SKETCH_ENTRIES: Final = 126
_MAGIC: Final = b"GFS1"
_HEAD: Final = struct.Struct("<4sII")
_LIMIT: Final = 1 << 32


@dataclass(frozen=True)
class StageSketch:
    """``indices`` (int64, strictly increasing) of a tensor of ``numel`` elements, flattened,
    and its float32 ``values`` there."""

    numel: int
    indices: torch.Tensor
    values: torch.Tensor


def sketch_size(numel: int) -> int:
    """The bytes of the sketch of a tensor of ``numel`` elements."""
    return _HEAD.size + 8 * min(SKETCH_ENTRIES, numel)


def encode_sketch(tensor: torch.Tensor) -> bytes:
    """The sketch of ``tensor`` (any device; its values as float32). EncodeError for a tensor
    of 2^32 elements or more, or one holding NaN or infinity among its largest entries."""
    flat = tensor.detach().reshape(-1)
    numel = int(flat.numel())
    if numel >= _LIMIT:
        raise EncodeError(f"a sketch covers fewer than 2^32 elements, not {numel}")
    count = min(SKETCH_ENTRIES, numel)
    indices = torch.sort(torch.topk(flat.abs(), count, sorted=False).indices).values
    values = flat[indices].float().cpu().numpy()
    if not np.isfinite(values).all():
        raise EncodeError("a sketched tensor holds NaN or infinite values")
    head = _HEAD.pack(_MAGIC, numel, count)
    return head + indices.cpu().numpy().astype("<u4").tobytes() + values.astype("<f4").tobytes()


def decode_sketch(data: bytes, *, numel: int | None = None) -> StageSketch:
    """The sketch in ``data``, checked: its form (above); with ``numel``, that it covers a
    tensor of that many elements."""
    if len(data) < _HEAD.size:
        raise DecodeError(f"a sketch is at least {_HEAD.size} bytes, not {len(data)}")
    magic, total, count = _HEAD.unpack_from(data)
    if magic != _MAGIC:
        raise DecodeError("a sketch starts with b'GFS1'")
    if numel is not None and total != numel:
        raise DecodeError(f"the sketch covers {total} elements, the tensor has {numel}")
    if count != min(SKETCH_ENTRIES, total):
        raise DecodeError(
            f"a sketch of {total} elements holds {min(SKETCH_ENTRIES, total)} entries, not {count}"
        )
    if len(data) != sketch_size(total):
        raise DecodeError(
            f"a sketch of {count} entries is {sketch_size(total)} bytes, not {len(data)}"
        )
    at = _HEAD.size
    indices = np.frombuffer(data, dtype="<u4", count=count, offset=at).astype(np.int64)
    values = np.frombuffer(data, dtype="<f4", count=count, offset=at + 4 * count).astype(np.float32)
    if count and int(indices[-1]) >= total:
        raise DecodeError(f"a sketch's index {int(indices[-1])} is out of its {total} elements")
    if count > 1 and not bool((np.diff(indices) > 0).all()):
        raise DecodeError("a sketch's indices are not strictly increasing")
    if not bool(np.isfinite(values).all()):
        raise DecodeError("a sketch holds NaN or infinite values")
    return StageSketch(total, torch.from_numpy(indices), torch.from_numpy(values))


__all__ = [
    "MAX_SKETCH_BYTES",
    "SKETCH_ENTRIES",
    "StageSketch",
    "decode_sketch",
    "encode_sketch",
    "sketch_size",
]
