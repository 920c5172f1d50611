"""Fingerprints of updates: a small sketch that settles most replica pairs without the full distance.

An update's fingerprint is computed once (``fingerprint_of``) and compared with another's in a
few vector operations (``distance_bounds``). Each floating tensor is cut into at most ``BLOCKS``
contiguous blocks; for each block B the fingerprint keeps its squared norm ||x_B||^2 and its sum
over a seeded pattern of signs, <s_B, x_B> / sqrt|B| (a projection onto a unit vector). With the
sha256 digest of the tensors' bytes and the update's norm, that bounds the relative distance
(``distances.relative_distance``) of two updates for EVERY pair, with no probability in it:

- equal digests (and finite norms): the same bytes, so the distance is exactly 0;
- a lower bound: per block, ||a_B - b_B|| >= | ||a_B|| - ||b_B|| | (the triangle inequality) and
  ||a_B - b_B|| >= |<s_B, a_B - b_B>| / sqrt|B| (Cauchy-Schwarz against the unit vector
  s_B / sqrt|B|); the larger of the two, summed in squares over the blocks, is at most
  ||a - b||^2. A tensor of at most ``BLOCKS`` elements has blocks of one element, where both
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

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from .aggregation import DEFAULT_SLICE_ELEMS, floating_keys

__all__ = ["BLOCKS", "SEED", "SLACK", "Fingerprint", "distance_bounds", "fingerprint_of"]

#: blocks per tensor: a fingerprint holds 2 x BLOCKS floats per floating tensor
BLOCKS = 64
#: the sign patterns' seed (public: the bound holds whatever the pattern)
SEED = 0x6F1D
#: margin for float rounding, relative and absolute, in units of the relative distance
SLACK = 1e-6


@dataclass(frozen=True)
class Fingerprint:
    """A sketch of one update's floating tensors (see the module docstring).

    ``layout``: (name, shape) of each floating tensor in the update's order; ``digest``: sha256
    of their names, dtypes, shapes and bytes; ``sums`` / ``squares``: per block, float64, the
    blocks of every tensor end to end; ``norm``: the update's L2 norm."""

    layout: tuple[tuple[str, tuple[int, ...]], ...]
    digest: str
    sums: Tensor
    squares: Tensor
    norm: float


def _signs(name: str, n: int) -> Tensor:
    """The tensor's seeded pattern of +-1 (float64), the same in every process."""
    seed = SEED ^ int.from_bytes(hashlib.sha256(name.encode()).digest()[:7], "big")
    bits = torch.randint(
        0, 2, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int8
    )
    return bits.to(torch.float64) * 2.0 - 1.0


def _blocks(t: Tensor, name: str, slice_elems: int) -> tuple[Tensor, Tensor]:
    """(sums, squares) of one tensor's blocks: <s_B, x_B> / sqrt|B| and ||x_B||^2, float64,
    over slices of whole blocks so a large tensor never has a float64 copy in memory."""
    flat = t.reshape(-1)
    n = flat.numel()
    signs = _signs(name, n)
    if n <= BLOCKS:  # blocks of one element: the tensor itself, signed
        x = flat.to(torch.float64)
        return x * signs, x * x
    m = math.ceil(n / BLOCKS)  # elements per block (the last blocks may hold fewer, or none)
    sums = torch.zeros(BLOCKS, dtype=torch.float64)
    squares = torch.zeros(BLOCKS, dtype=torch.float64)
    rows = max(slice_elems // m, 1)
    for r0 in range(0, BLOCKS, rows):
        lo, hi = r0 * m, min((r0 + rows) * m, n)
        if lo >= hi:
            break
        x = flat[lo:hi].to(torch.float64)
        pad = (-(hi - lo)) % m
        got = (hi - lo + pad) // m
        squares[r0 : r0 + got] = torch.nn.functional.pad(x * x, (0, pad)).view(got, m).sum(1)
        sums[r0 : r0 + got] = (
            torch.nn.functional.pad(x * signs[lo:hi], (0, pad)).view(got, m).sum(1)
        )
    counts = (n - torch.arange(BLOCKS, dtype=torch.float64) * m).clamp(1, m)
    return sums / counts.sqrt(), squares


def fingerprint_of(
    delta: Mapping[str, Tensor], *, slice_elems: int = DEFAULT_SLICE_ELEMS
) -> Fingerprint:
    """The fingerprint of an update (a state dict of tensor name -> tensor; only read)."""
    h = hashlib.sha256()
    layout = []
    sums: list[Tensor] = []
    squares: list[Tensor] = []
    for k in floating_keys(delta):
        t = delta[k].detach().contiguous()
        shape = tuple(int(s) for s in t.shape)
        layout.append((k, shape))
        h.update(f"{k}\0{t.dtype}\0{shape}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b"")
        s, q = _blocks(t, k, slice_elems)
        sums.append(s)
        squares.append(q)
    sums_all = torch.cat(sums) if sums else torch.zeros(0, dtype=torch.float64)
    squares_all = torch.cat(squares) if squares else torch.zeros(0, dtype=torch.float64)
    return Fingerprint(
        tuple(layout), h.hexdigest(), sums_all, squares_all, math.sqrt(float(squares_all.sum()))
    )


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
