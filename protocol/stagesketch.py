"""A stage's sketch of a raw tensor it sends across a pipeline cut: its largest entries, and
projections of the whole tensor.

What crosses a cut may travel encoded (protocol/boundarycodec.py): int8 levels, or a few
directions at 4 bits. A referee that re-executes the stage sees, through such a code, only the
part of a fault that moves a value across a level's edge or a row's scale. So at the steps the
hub may check, the sending stage also commits to the tensor *before* it is encoded, in two parts
that the referee compares, each on its own, with the raw tensor it recomputes
(hub/policy/stage_check.py), at full precision, whatever the code threw away:

- the *entries*: the flat indices of the tensor's ``SKETCH_ENTRIES`` largest magnitudes and
  their float32 values. Knowing where a tensor's largest entries are needs every entry, so a
  stage cannot sketch a cheap part (one row it computed honestly) or values near zero;
- the *projections*: ``SKETCH_PROJECTIONS`` signed sums that together cover every entry (a count
  sketch: entry i goes into one sum, ``bucket(i)``, with a sign, ``sign(i)``). The largest
  entries are where a relative fault shows least (in a residual stream they carry the stage's
  input passed through); the sums' relative change is about the whole tensor's, as the fp32
  wire shows it, in 512 bytes.

The buckets and signs come from the sketch's own entries: byte i of SHAKE-256 over the SHA-256
of the sketch's bytes up to its projections (header, indices, values); its low 7 bits are entry
i's bucket, its high bit the sign (set: minus). They are fixed only once the tensor's largest
entries are, so the sender cannot pick them before the tensor, and any machine draws the same
ones. Each sum is taken in float64 over the float32 entries and sent as float32. A stage that
computed the tensor (it needs the largest entries first) can still choose a change of the other
entries that the sums do not see; what they catch is a fault that does not know them.

The bytes (little-endian), ``b"GFS2"``: the raw tensor's element count (uint32), the count of
entries (uint16: ``min(SKETCH_ENTRIES, numel)``, exactly), the count of projections (uint16:
``SKETCH_PROJECTIONS``, exactly), the indices (uint32, strictly increasing, each below the
element count), their values (float32, finite), then the projections (float32, finite).
``sketch_size`` bytes, at most ``MAX_SKETCH_BYTES`` (1 KiB).

The decoder still takes the first layout, ``b"GFS1"`` (the element count and the count of
entries as uint32, ``min(126, numel)`` entries, no projections), which a node of the same
protocol version may send: a sketch rides in the relay header's opaque ``sketch`` bytes, so a
new layout needs no new protocol version, and the referee judges a GFS1 sketch by its entries
alone. Decoding is strict; every refusal is one DecodeError line.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch

from .errors import DecodeError, EncodeError
from .relaymessages import MAX_SKETCH_BYTES

#: the largest entries a sketch holds (fewer only when the tensor has fewer elements)
SKETCH_ENTRIES: Final = 62
#: the signed sums over the whole tensor a sketch holds
SKETCH_PROJECTIONS: Final = 128
#: the entries of the first layout (GFS1), which holds no projections
GFS1_ENTRIES: Final = 126
_MAGIC: Final = b"GFS2"
_HEAD: Final = struct.Struct("<4sIHH")
_GFS1: Final = b"GFS1"
_GFS1_HEAD: Final = struct.Struct("<4sII")
_LIMIT: Final = 1 << 32
_CHUNK: Final = 1 << 20  # entries summed at a time, so that memory stays small for any tensor


@dataclass(frozen=True)
class StageSketch:
    """``indices`` (int64, strictly increasing) of a tensor of ``numel`` elements, flattened,
    and its float32 ``values`` there; ``projections`` (float32, ``SKETCH_PROJECTIONS``) the
    signed sums over all its elements, whose buckets and signs ``seed`` draws (None for a GFS1
    sketch, which has neither)."""

    numel: int
    indices: torch.Tensor
    values: torch.Tensor
    projections: torch.Tensor | None = None
    seed: bytes = b""


def sketch_size(numel: int) -> int:
    """The bytes of the sketch of a tensor of ``numel`` elements."""
    return _HEAD.size + 8 * min(SKETCH_ENTRIES, numel) + 4 * SKETCH_PROJECTIONS


def sketch_projections(flat: npt.NDArray[np.floating[Any]], seed: bytes) -> npt.NDArray[np.float64]:
    """The ``SKETCH_PROJECTIONS`` signed sums (float64) of a flat tensor's elements, their
    buckets and signs drawn from ``seed`` (module docstring)."""
    draws = np.frombuffer(hashlib.shake_256(seed).digest(int(flat.size)), dtype=np.uint8)
    sums = np.zeros(SKETCH_PROJECTIONS, dtype=np.float64)
    for at in range(0, int(flat.size), _CHUNK):
        part = flat[at : at + _CHUNK].astype(np.float64)
        drawn = draws[at : at + _CHUNK]
        part[drawn >= 128] *= -1.0
        sums += np.bincount(drawn & 127, weights=part, minlength=SKETCH_PROJECTIONS)
    return sums


def encode_sketch(tensor: torch.Tensor) -> bytes:
    """The sketch of ``tensor`` (any device; its values as float32). EncodeError for a tensor
    of 2^32 elements or more, or one holding NaN or infinity."""
    flat = tensor.detach().reshape(-1)
    numel = int(flat.numel())
    if numel >= _LIMIT:
        raise EncodeError(f"a sketch covers fewer than 2^32 elements, not {numel}")
    values: npt.NDArray[np.float32] = flat.float().cpu().numpy()
    if not np.isfinite(values).all():
        raise EncodeError("a sketched tensor holds NaN or infinite values")
    count = min(SKETCH_ENTRIES, numel)
    top = torch.topk(torch.from_numpy(values).abs(), count, sorted=False).indices
    indices: npt.NDArray[np.int64] = top.sort().values.numpy()
    head = _HEAD.pack(_MAGIC, numel, count, SKETCH_PROJECTIONS)
    entries = head + indices.astype("<u4").tobytes() + values[indices].astype("<f4").tobytes()
    seed = hashlib.sha256(entries).digest()
    return entries + sketch_projections(values, seed).astype("<f4").tobytes()


def decode_sketch(data: bytes, *, numel: int | None = None) -> StageSketch:
    """The sketch in ``data`` (GFS2, or GFS1), checked: its form (module docstring); with
    ``numel``, that it covers a tensor of that many elements."""
    if len(data) >= 4 and data[:4] == _GFS1:
        return _decode_gfs1(data, numel)
    if len(data) < _HEAD.size:
        raise DecodeError(f"a sketch is at least {_HEAD.size} bytes, not {len(data)}")
    magic, total, count, projections = _HEAD.unpack_from(data)
    if magic != _MAGIC:
        raise DecodeError("a sketch starts with b'GFS2' (or b'GFS1')")
    _check_counts(total, count, min(SKETCH_ENTRIES, total), numel)
    if projections != SKETCH_PROJECTIONS:
        raise DecodeError(f"a sketch holds {SKETCH_PROJECTIONS} projections, not {projections}")
    if len(data) != sketch_size(total):
        raise DecodeError(
            f"a sketch of {count} entries is {sketch_size(total)} bytes, not {len(data)}"
        )
    indices, values = _entries(data, _HEAD.size, total, count)
    end = _HEAD.size + 8 * count
    sums = np.frombuffer(data, dtype="<f4", count=projections, offset=end).astype(np.float32)
    if not bool(np.isfinite(sums).all()):
        raise DecodeError("a sketch's projections hold NaN or infinite values")
    seed = hashlib.sha256(data[:end]).digest()
    return StageSketch(total, indices, values, torch.from_numpy(sums), seed)


def _decode_gfs1(data: bytes, numel: int | None) -> StageSketch:
    if len(data) < _GFS1_HEAD.size:
        raise DecodeError(f"a GFS1 sketch is at least {_GFS1_HEAD.size} bytes, not {len(data)}")
    _, total, count = _GFS1_HEAD.unpack_from(data)
    _check_counts(total, count, min(GFS1_ENTRIES, total), numel)
    size = _GFS1_HEAD.size + 8 * count
    if len(data) != size:
        raise DecodeError(f"a GFS1 sketch of {count} entries is {size} bytes, not {len(data)}")
    indices, values = _entries(data, _GFS1_HEAD.size, total, count)
    return StageSketch(total, indices, values)


def _check_counts(total: int, count: int, want: int, numel: int | None) -> None:
    if numel is not None and total != numel:
        raise DecodeError(f"the sketch covers {total} elements, the tensor has {numel}")
    if count != want:
        raise DecodeError(f"a sketch of {total} elements holds {want} entries, not {count}")


def _entries(data: bytes, at: int, total: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The indices and values of a sketch whose size is checked, checked in their turn."""
    indices = np.frombuffer(data, dtype="<u4", count=count, offset=at).astype(np.int64)
    values = np.frombuffer(data, dtype="<f4", count=count, offset=at + 4 * count).astype(np.float32)
    if count and int(indices[-1]) >= total:
        raise DecodeError(f"a sketch's index {int(indices[-1])} is out of its {total} elements")
    if count > 1 and not bool((np.diff(indices) > 0).all()):
        raise DecodeError("a sketch's indices are not strictly increasing")
    if not bool(np.isfinite(values).all()):
        raise DecodeError("a sketch holds NaN or infinite values")
    return torch.from_numpy(indices), torch.from_numpy(values)


__all__ = [
    "GFS1_ENTRIES",
    "MAX_SKETCH_BYTES",
    "SKETCH_ENTRIES",
    "SKETCH_PROJECTIONS",
    "StageSketch",
    "decode_sketch",
    "encode_sketch",
    "sketch_projections",
    "sketch_size",
]
