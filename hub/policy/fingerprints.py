"""Fingerprints of updates: a small sketch that settles most replica pairs without the full distance.

An update's fingerprint is computed once (``fingerprint_of``) and compared with another's in a
few vector operations (``distance_bounds``). The update's floating tensors, laid end to end, are
cut into ``BLOCKS`` contiguous blocks; for each block B the fingerprint keeps its squared norm
||x_B||^2 and its sum over a seeded pattern of signs, <s_B, x_B> / sqrt|B| (a projection onto a
unit vector). With the
sha256 digest of the tensors' bytes and the update's norm, that bounds the relative distance
(``distances.relative_distance``) of two updates for EVERY pair, with no probability in it:

- equal digests (and finite norms): the same bytes, so the distance is exactly 0;
- a lower bound: per block, ||a_B - b_B|| >= | ||a_B|| - ||b_B|| | (the triangle inequality) and
  ||a_B - b_B|| >= |<s_B, a_B - b_B>| / sqrt|B| (Cauchy-Schwarz against the unit vector
  s_B / sqrt|B|); the larger of the two, summed in squares over the blocks, is at most
  ||a - b||^2. An update of at most ``BLOCKS`` elements has blocks of one element, where both
  terms ARE the distance.

So a pair with equal digests agrees at any tolerance, and a pair whose lower bound exceeds the
tolerance disagrees; only a pair whose bound lies at or under the tolerance (near it, or a
difference the sketch cannot see) is measured in full. The bound is an inequality, not an
estimate: a node cannot steer a difference into the sketch's blind spot to get an AGREE (agreement
is only ever read from equal bytes or from the full distance), only make the hub measure in full.
In expectation the sign term keeps (blocks / n) of a difference spread evenly over n elements
(the Johnson-Lindenstrauss scaling); the norm term catches a scaled or shrunk update at once.

Float rounding: the fingerprint's float64 sums and the full distance's are computed in different
orders; their relative errors stay under n x 2^-53 (1e-7 at 10^9 elements), so a lower bound is
trusted only beyond ``SLACK`` (relative and absolute) of the tolerance.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from .aggregation import DEFAULT_SLICE_ELEMS, floating_keys

__all__ = ["BLOCKS", "SEED", "SLACK", "Fingerprint", "distance_bounds", "fingerprint_of"]

#: blocks of an update: a fingerprint holds 2 x BLOCKS floats
BLOCKS = 256
#: the sign pattern is drawn in chunks of this many signs (chunk c seeded SEED + c)
PATTERN_CHUNK = 1 << 16
#: the sign patterns' seed (public: the bound holds whatever the pattern)
SEED = 0x6F1D
#: margin for float rounding, relative and absolute, in units of the relative distance
SLACK = 1e-6


@dataclass(frozen=True)
class Fingerprint:
    """A sketch of one update's floating tensors (see the module docstring).

    ``layout``: (name, shape) of each floating tensor in the update's order; ``digest``: sha256
    of their names, dtypes, shapes and bytes; ``sums`` / ``squares``: per block, float64; ``norm``: the update's L2 norm."""

    layout: tuple[tuple[str, tuple[int, ...]], ...]
    digest: str
    sums: Tensor
    squares: Tensor
    norm: float


@functools.lru_cache(maxsize=64)
def _pattern(chunk: int) -> Tensor:
    """Chunk ``chunk`` of the seeded sign pattern (``PATTERN_CHUNK`` signs, +-1 in float64), the
    same in every process; read only."""
    g = torch.Generator().manual_seed(SEED + chunk)
    bits = torch.randint(0, 2, (PATTERN_CHUNK,), generator=g, dtype=torch.int8)
    return bits.to(torch.float64) * 2.0 - 1.0


def _signs(lo: int, hi: int) -> Tensor:
    """Signs ``lo``..``hi`` of the pattern."""
    first, last = lo // PATTERN_CHUNK, (hi - 1) // PATTERN_CHUNK
    parts = [_pattern(c) for c in range(first, last + 1)]
    whole = parts[0] if len(parts) == 1 else torch.cat(parts)
    return whole[lo - first * PATTERN_CHUNK : hi - first * PATTERN_CHUNK]


def _span(flats: list[Tensor], starts: list[int], lo: int, hi: int) -> Tensor:
    """Elements ``lo``..``hi`` of the update's floating tensors laid end to end, as float64."""
    parts = [
        f if lo <= at and at + f.numel() <= hi else f[max(lo - at, 0) : min(hi - at, f.numel())]
        for f, at in zip(flats, starts, strict=True)
        if at < hi and at + f.numel() > lo
    ]
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).to(torch.float64)


def fingerprint_of(
    delta: Mapping[str, Tensor], *, sha: str | None = None, slice_elems: int = DEFAULT_SLICE_ELEMS
) -> Fingerprint:
    """The fingerprint of an update (a state dict of tensor name -> tensor; only read).

    Its floating tensors are laid end to end (the update's order) and cut into ``BLOCKS``
    contiguous blocks (one element each when there are fewer); read in slices of whole blocks,
    so a large update never has a float64 copy in memory. ``sha``: the sha256 of the update's
    bytes as uploaded (its blob), when known: the digest, instead of hashing the tensors again."""
    h = hashlib.sha256() if sha is None else None
    layout = []
    flats: list[Tensor] = []
    starts: list[int] = []
    n = 0
    for k in floating_keys(delta):
        t = delta[k].detach().contiguous()
        shape = tuple(int(s) for s in t.shape)
        layout.append((k, shape))
        flat = t.reshape(-1)
        if h is not None:
            h.update(f"{k}\0{t.dtype}\0{shape}\0".encode())
            h.update(flat.view(torch.uint8).numpy().data if flat.numel() else b"")
        if flat.numel():
            flats.append(flat)
            starts.append(n)
            n += flat.numel()
    blocks = max(min(n, BLOCKS), 1)
    # elements per block (the last blocks may hold fewer, or none)
    m = max(math.ceil(n / blocks), 1)
    rows = max(slice_elems // m, 1)
    sums: list[Tensor] = []
    squares: list[Tensor] = []
    for lo in range(0, blocks * m, rows * m):  # whole blocks; past the update's end, zeros
        hi = min(lo + rows * m, blocks * m)
        x = _span(flats, starts, lo, min(hi, n)) if lo < n else torch.zeros(0, dtype=torch.float64)
        x = torch.nn.functional.pad(x, (0, hi - lo - x.numel())).view(-1, m)
        squares.append((x * x).sum(1))
        sums.append((x * _signs(lo, hi).view(-1, m)).sum(1))
    sq = squares[0] if len(squares) == 1 else torch.cat(squares)
    su = sums[0] if len(sums) == 1 else torch.cat(sums)
    counts = (n - torch.arange(blocks, dtype=torch.float64) * m).clamp(1, m)
    digest = h.hexdigest() if h is not None else f"blob:{sha}"
    return Fingerprint(tuple(layout), digest, su / counts.sqrt(), sq, math.sqrt(float(sq.sum())))


def distance_bounds(a: Fingerprint, b: Fingerprint) -> tuple[float, bool] | None:
    """(lower, exact): a lower bound of the two updates' relative distance, with rounding's
    ``SLACK`` taken off, and whether it is the distance itself (equal bytes: 0.0, exactly what
    ``relative_distance`` returns). None: the fingerprints bound nothing (the layouts differ, or
    an update holds a NaN or an infinity); measure in full."""
    if a.layout != b.layout or not (math.isfinite(a.norm) and math.isfinite(b.norm)):
        return None
    if a.digest == b.digest:
        return 0.0, True
    denom = max(a.norm, b.norm, 1e-12)
    gap = torch.maximum((a.sums - b.sums).abs(), (a.squares.sqrt() - b.squares.sqrt()).abs())
    lower = math.sqrt(float(torch.dot(gap, gap))) / denom
    return max(lower * (1.0 - SLACK) - SLACK, 0.0), False
