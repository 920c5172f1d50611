"""The torch codec of a pipeline cut's encoding (protocol/boundary.py says what each one is).

``BoundaryCode.encode`` turns an activation or a gradient into its encoded form before it is
sent; ``decode`` turns the received, checked form back into a tensor of the raw shape and dtype;
``distance`` says how far a raw tensor lies from every tensor that encodes to a given wire form
(what the hub's referee compares a recomputed stage output with).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from .boundary import (
    CASTS,
    LOG_SCALE_BYTES,
    LOG_SCALE_STEPS,
    LOG_SCALE_ZERO,
    LOG_SCALED,
    SCALE_BYTES,
    SUBSPACE_BITS,
    check_boundary,
    encoded_crossing,
)
from .errors import TensorError
from .tensors import DTYPES, ITEMSIZE, TensorSpec


def subspace_basis(seed: int, cut: int, width: int, rank: int) -> Tensor:
    """A ``width`` x ``rank`` float32 matrix with orthonormal columns, the same on every machine
    for (``seed``, ``cut``): numpy's PCG64 normals, orthonormalised in float64 by QR with the
    signs fixed (each column's R diagonal positive)."""
    check_boundary("subspace", rank, width)
    return _orthonormal([seed & 0xFFFFFFFFFFFFFFFF, cut, width, rank], width, rank)


def shared_basis(seed: int, width: int, rank: int) -> Tensor:
    """The basis of subspace_log and subspace_scaled: ``subspace_basis`` of cut 0, at every cut
    of the same width, so what the residual stream carries through one cut's directions passes
    the next."""
    check_boundary("subspace_log", rank, width)
    return _orthonormal([seed & 0xFFFFFFFFFFFFFFFF, 0, width, rank], width, rank)


def _orthonormal(key: list[int], width: int, rank: int) -> Tensor:
    rng = np.random.default_rng(key)
    q, r = np.linalg.qr(rng.standard_normal((width, rank)))
    q = q * np.where(np.diag(r) < 0, -1.0, 1.0)
    return torch.from_numpy(np.ascontiguousarray(q, dtype=np.float32))


def _int8_rows(x: Tensor, bits: int = 8) -> Tensor:
    """(..., w) float -> (..., ceil(w * bits / 8) + 4) int8: each row rounded to the
    2**(bits-1) - 1 levels either side of zero of its largest magnitude (two 4-bit values a byte,
    offset by 8, the first in the high half), then its float32 scale's bytes."""
    levels = float((1 << (bits - 1)) - 1)
    width = x.shape[-1]
    rows = x.detach().reshape(-1, width).to(torch.float32)
    scale = rows.abs().amax(dim=1, keepdim=True) / levels  # (rows, 1)
    out = torch.cat([_levels(rows, scale, bits), scale.contiguous().view(torch.int8)], dim=1)
    return out.reshape(*x.shape[:-1], out.shape[1])


def _levels(rows: Tensor, scale: Tensor, bits: int) -> Tensor:
    """(rows, w) float32 over (rows, 1) scales -> the rounded values' bytes, int8 (two 4-bit
    values a byte, offset by 8, the first in the high half)."""
    levels = float((1 << (bits - 1)) - 1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (rows / safe).round_().clamp_(-levels, levels).to(torch.int16)
    if bits == 4:
        q = torch.nn.functional.pad(q + 8, (0, rows.shape[1] % 2))  # (rows, even): 1..15, pad 0
        q = (q[:, 0::2] << 4) | q[:, 1::2]  # 0..255
        q = torch.where(q > 127, q - 256, q)  # the same bytes, as int8
    return q.to(torch.int8)


def _log_scaled_rows(x: Tensor) -> Tensor:
    """(..., r) float -> (..., ceil(r / 2) + 1) int8: 4-bit values like ``_int8_rows``, over the
    row's scale rounded up to a power of 2**(1/4), sent as one byte (255 for a non-finite row)."""
    width = x.shape[-1]
    rows = x.detach().reshape(-1, width).to(torch.float32)
    need = rows.abs().amax(dim=1, keepdim=True) / float((1 << (SUBSPACE_BITS - 1)) - 1)
    exponent = (need.log2() * LOG_SCALE_STEPS).ceil_().clamp_(-LOG_SCALE_ZERO, 254 - LOG_SCALE_ZERO)
    byte = torch.where(torch.isfinite(need), exponent + LOG_SCALE_ZERO, torch.full_like(need, 255))
    scale = torch.exp2((byte - LOG_SCALE_ZERO) / LOG_SCALE_STEPS)  # (rows, 1)
    byte = byte.to(torch.int16)
    byte = torch.where(byte > 127, byte - 256, byte).to(torch.int8)  # the byte, as int8
    out = torch.cat([_levels(rows, scale, SUBSPACE_BITS), byte], dim=1)
    return out.reshape(*x.shape[:-1], out.shape[1])


def _int8_values(wire: Tensor, width: int, bits: int = 8) -> Tensor:
    """The inverse of ``_int8_rows`` (float32, rows ``width`` wide); TensorError for a scale
    that is not a finite, non-negative number (bytes no encoder makes)."""
    kept = wire.shape[-1] - SCALE_BYTES
    rows = wire.reshape(-1, kept + SCALE_BYTES)
    scale = rows[:, kept:].contiguous().view(torch.float32)  # (rows, 1)
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise TensorError("an int8 boundary row carries a scale that is negative, NaN or infinite")
    return _values(rows[:, :kept], scale, width, bits).reshape(*wire.shape[:-1], width)


def _log_scaled_values(wire: Tensor, width: int, boundary: str) -> Tensor:
    """The inverse of ``_log_scaled_rows`` (float32, rows ``width`` wide); TensorError for the
    scale byte 255 (a row the sender could not scale)."""
    kept = wire.shape[-1] - LOG_SCALE_BYTES
    rows = wire.reshape(-1, kept + LOG_SCALE_BYTES)
    byte = rows[:, kept:].to(torch.int16) & 0xFF  # (rows, 1): 0..255
    if bool((byte == 255).any()):
        raise TensorError(f"a {boundary} row carries the scale byte 255 (NaN or infinite)")
    scale = torch.exp2((byte.to(torch.float32) - LOG_SCALE_ZERO) / LOG_SCALE_STEPS)
    values = _values(rows[:, :kept], scale, width, SUBSPACE_BITS)
    return values.reshape(*wire.shape[:-1], width)


def _values(packed: Tensor, scale: Tensor, width: int, bits: int) -> Tensor:
    """(rows, bytes) int8 of ``_levels`` over (rows, 1) scales -> (rows, ``width``) float32."""
    q = packed.to(torch.int16)
    if bits == 4:
        q = q & 0xFF  # the byte, 0..255
        q = torch.stack([(q >> 4) - 8, (q & 0xF) - 8], dim=2).reshape(q.shape[0], -1)[:, :width]
    return q.to(torch.float32) * scale


def _outside(v: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """Each value's distance to its interval [lo, hi] (0 inside)."""
    return (lo - v).clamp_min(0) + (v - hi).clamp_min(0)


def _cast_cells(wire: Tensor) -> tuple[Tensor, Tensor]:
    """The float64 interval of raw values that round (to nearest) to each finite half-precision
    value of ``wire``: half the spacing to each neighbour, which is half as far below a power
    of two as above it, and never under the format's smallest subnormal spacing."""
    info = torch.finfo(wire.dtype)
    w = wire.to(torch.float64)
    mantissa, exponent = torch.frexp(w)  # |w| = |mantissa| * 2**exponent, |mantissa| in [0.5, 1)
    smallest = info.smallest_normal * info.eps
    above = (torch.exp2(exponent.to(torch.float64) - 1) * info.eps).clamp_min(smallest)
    below = torch.where(mantissa.abs() == 0.5, above / 2, above).clamp_min(smallest)
    up, down = torch.where(w < 0, below, above), torch.where(w < 0, above, below)
    return w - down / 2, w + up / 2


#: the bytes of a subspace_log scale that mark the ends of its range: the smallest scale (a row
#: may be smaller still) and the largest (a larger row saturates)
_LOG_FLOOR, _LOG_CEILING = 0, 254


def _row_cells(
    wire: Tensor, boundary: str, width: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, float]:
    """An int8-rows wire's (rows, ``width``) levels, each row's (rows, 1) scale, smallest and
    largest possible largest magnitude (float64), and the outermost level; TensorError for bytes
    no encoder makes."""
    if boundary in LOG_SCALED:
        kept = wire.shape[-1] - LOG_SCALE_BYTES
        rows = wire.reshape(-1, kept + LOG_SCALE_BYTES)
        byte = rows[:, kept:].to(torch.int16) & 0xFF  # (rows, 1): 0..255
        if bool((byte == 255).any()):
            raise TensorError(f"a {boundary} row carries the scale byte 255")
        scale = torch.exp2((byte.to(torch.float64) - LOG_SCALE_ZERO) / LOG_SCALE_STEPS)
    else:
        kept = wire.shape[-1] - SCALE_BYTES
        rows = wire.reshape(-1, kept + SCALE_BYTES)
        scale = rows[:, kept:].contiguous().view(torch.float32).to(torch.float64)
        if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
            raise TensorError("an int8 boundary row carries a bad scale")
    bits = 8 if boundary == "int8" else SUBSPACE_BITS
    top = float((1 << (bits - 1)) - 1)
    levels = _values(rows[:, :kept], torch.ones_like(scale, dtype=torch.float32), width, bits)
    if bool((levels.abs() > top).any()):
        raise TensorError("a boundary row carries a level out of range")
    high, low = top * scale, top * scale  # the row's largest magnitude: exactly ``top`` levels
    if boundary in LOG_SCALED:  # the scale rounds the largest magnitude up, to 2**(1/4)
        low = torch.where(byte == _LOG_FLOOR, 0.0, high * 2.0 ** (-1 / LOG_SCALE_STEPS))
        high = torch.where(byte == _LOG_CEILING, math.inf, high)
    return levels.to(torch.float64), scale, low, high, top


def _cells_distance(
    v: Tensor, levels: Tensor, scale: Tensor, low: Tensor, high: Tensor, top: float
) -> float:
    """The least L2 change of ``v`` (rows, n) after which each value rounds to its level (the
    outermost, +-``top``, takes every value out to +-high) and each row's largest magnitude lies
    in [low, high]: every value moved into its level's cell (clipped to +-high), plus, per row,
    the least extra cost of one value reaching ``low``."""
    lo = torch.where(levels <= -top, -high, (levels - 0.5) * scale).maximum(-high)
    hi = torch.where(levels >= top, high, (levels + 0.5) * scale).minimum(high)
    gap = _outside(v, lo, hi)  # (rows, n)
    # one value of the row at least ``low`` in magnitude, within its cell
    up_lo, down_hi = lo.maximum(low), hi.minimum(-low)
    up = torch.where(hi >= up_lo, _outside(v, up_lo, hi), math.inf)
    down = torch.where(down_hi >= lo, _outside(v, lo, down_hi), math.inf)
    reach = torch.minimum(up, down)
    extra = (reach.square() - gap.square()).amin(dim=1, keepdim=True)
    extra = torch.where(low > 0, extra, 0.0)
    return math.sqrt(float(gap.square().sum() + extra.sum()))


class BoundaryCode:
    """The encoding of one cut (``cut``: between stage ``cut`` and ``cut + 1``) for a raw tensor
    like ``raw``: ``encode`` before a tensor is sent (either way), ``decode`` after it is received
    and checked against ``wire``. "fp32" hands the very tensors through."""

    def __init__(self, boundary: str, rank: int, *, raw: TensorSpec, seed: int, cut: int) -> None:
        dtype, shape = encoded_crossing(raw.shape, raw.dtype, boundary, rank)
        self.boundary = boundary
        self.raw = raw
        self.wire = TensorSpec(raw.name, dtype, shape)
        self._basis: dict[torch.device, Tensor] = {}
        #: what the decoder multiplies by: subspace_scaled's width / rank, 1 for the others
        self.gain = raw.shape[-1] / rank if boundary == "subspace_scaled" else 1.0
        if boundary == "subspace":
            self._basis[torch.device("cpu")] = subspace_basis(seed, cut, raw.shape[-1], rank)
        elif boundary in LOG_SCALED:
            self._basis[torch.device("cpu")] = shared_basis(seed, raw.shape[-1], rank)

    def _on(self, device: torch.device) -> Tensor:
        basis = self._basis.get(device)
        if basis is None:
            basis = self._basis[device] = self._basis[torch.device("cpu")].to(device)
        return basis

    def encode(self, x: Tensor) -> Tensor:
        if self.boundary == "fp32":
            return x
        x = x.detach()
        if self.boundary in CASTS:
            return x.to(DTYPES[CASTS[self.boundary]])
        if self.boundary == "subspace":
            x = x.to(torch.float32) @ self._on(x.device)  # (..., rank)
            return _int8_rows(x, SUBSPACE_BITS)
        if self.boundary in LOG_SCALED:
            return _log_scaled_rows(x.to(torch.float32) @ self._on(x.device))
        return _int8_rows(x)

    def decode(self, wire: Tensor) -> Tensor:
        """The raw-shaped, raw-dtype tensor ``wire`` stands for (TensorError for a malformed one)."""
        if self.boundary == "fp32":
            return wire
        raw_dtype = DTYPES[self.raw.dtype]
        if self.boundary in CASTS:
            return wire.to(raw_dtype)
        if self.boundary == "subspace":
            basis = self._on(wire.device)
            values = _int8_values(wire, basis.shape[1], SUBSPACE_BITS)
            return (values @ basis.T).to(raw_dtype)  # (..., width)
        if self.boundary in LOG_SCALED:
            basis = self._on(wire.device)
            values = _log_scaled_values(wire, basis.shape[1], self.boundary)
            if self.gain != 1.0:
                values = values * self.gain
            return (values @ basis.T).to(raw_dtype)  # (..., width)
        return _int8_values(wire, self.raw.shape[-1]).to(raw_dtype)

    def distance(self, wire: Tensor, raw: Tensor) -> float:
        """How far ``raw`` lies from the nearest raw tensor this code encodes to ``wire``: the L2
        norm of the least change of ``raw`` after which ``encode`` gives ``wire`` (0 when it does
        already; a value rounded to the next level costs only its distance to the level's edge).
        The subspace codes measure in their basis's coordinates (what lies outside the subspace
        is not sent). Infinite for a wire or raw tensor of another shape, or a wire no encoder
        makes (a non-finite value, a bad scale, a level out of range). Float64, on the CPU."""
        if tuple(wire.shape) != self.wire.shape or tuple(raw.shape) != self.raw.shape:
            return math.inf
        v = raw.detach().to("cpu", torch.float64)
        w = wire.detach().to("cpu")
        if self.boundary == "fp32":
            gap = (w.to(torch.float64) - v).flatten()
            return (
                float(torch.linalg.vector_norm(gap))
                if bool(torch.isfinite(gap).all())
                else math.inf
            )
        if self.boundary in CASTS:
            if not bool(torch.isfinite(w).all()):
                return math.inf
            lo, hi = _cast_cells(w)
            return float(torch.linalg.vector_norm(_outside(v, lo, hi).flatten()))
        if self.boundary in ("subspace", *LOG_SCALED):
            v = v @ self._basis[torch.device("cpu")].to(torch.float64)  # (..., rank)
        try:
            cells = _row_cells(w, self.boundary, v.shape[-1])
        except TensorError:
            return math.inf
        return _cells_distance(v.reshape(-1, v.shape[-1]), *cells)

    def ratio(self) -> float:
        """The raw tensor's bytes over the encoded one's."""
        raw = math.prod(self.raw.shape) * ITEMSIZE[self.raw.dtype]
        return raw / (math.prod(self.wire.shape) * ITEMSIZE[self.wire.dtype])


__all__ = ["BoundaryCode", "shared_basis", "subspace_basis"]
