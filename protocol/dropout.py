"""Dropout that every device draws the same way, so the hub's referee can replay it.

``torch.nn.Dropout`` draws its mask from the device's generator: the CPU's Mersenne Twister on a
CPU, Philox on a GPU. The referee re-executes a node's segment on the hub's CPU, so a GPU node
that trains with dropout could never be reproduced there. ``KeyedDropout`` draws its mask from
a counter-based hash instead: the mask is a pure function of (training seed, step, part,
slot, element index), computed with 64-bit integer tensor arithmetic that gives the same bits
on any device. The trainer names the step (``dropout_step``); ``part`` is a pipeline's
micro-batch (0 otherwise); ``slot`` is the layer's place in the model, fixed when it is built.

Outside a ``dropout_step`` block (code that trains a built model by itself) the layer falls
back to torch's own dropout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from torch import Tensor, nn

_M32 = 0xFFFFFFFF
#: multipliers under 2**31, so a 32-bit value times one stays under 2**63: exact in int64
_C1 = 0x7FEB352D
_C2 = 0x5BD1E995

_STEP: ContextVar[tuple[int, int, int] | None] = ContextVar("gpuflex_dropout_step", default=None)
_ROW: ContextVar[int] = ContextVar("gpuflex_dropout_row", default=0)


def _mix(h: int) -> int:
    h ^= h >> 16
    h = (h * _C1) & _M32
    h ^= h >> 15
    h = (h * _C2) & _M32
    return h ^ (h >> 16)


def _mix_tensor(h: Tensor) -> Tensor:
    # h: int64 values in [0, 2**32); every product stays under 2**63
    h = h ^ (h >> 16)
    h = (h * _C1) & _M32
    h = h ^ (h >> 15)
    h = (h * _C2) & _M32
    return h ^ (h >> 16)


@contextlib.contextmanager
def dropout_step(seed: int, step: int, part: int = 0, row: int = 0) -> Iterator[None]:
    """Dropout inside the block draws the masks of (``seed``, ``step``, ``part``); its inputs
    are the batch's rows from ``row`` on."""
    token = _STEP.set((int(seed), int(step), int(part)))
    row_token = _ROW.set(int(row))
    try:
        yield
    finally:
        _ROW.reset(row_token)
        _STEP.reset(token)


def step_key() -> tuple[int, int, int] | None:
    """The (seed, step, part) of the enclosing ``dropout_step`` block; None outside one."""
    return _STEP.get()


def _keyed_bits(shape: torch.Size | tuple[int, ...], seed: int, step: int, part: int, slot: int,
                device: torch.device, start: int = 0) -> Tensor:
    """One 32-bit hash per element (int64 values in [0, 2**32)): a pure function of the key;
    ``start``: the flat index of the first element (a slice of a larger batch)."""
    k1 = _mix((seed & _M32) ^ _mix((step & _M32) ^ _mix(part & _M32)))
    k2 = _mix(k1 ^ _mix((slot & _M32) ^ _mix((seed >> 32) & _M32)))
    numel = 1
    for n in shape:
        numel *= int(n)
    idx = torch.arange(start, start + numel, dtype=torch.int64, device=device) & _M32
    return _mix_tensor(_mix_tensor(idx ^ k1) ^ k2).reshape(shape)


def keep_mask(shape: torch.Size | tuple[int, ...], p: float, seed: int, step: int, part: int, slot: int,
              device: torch.device, start: int = 0) -> Tensor:
    """The elements kept (True) by a layer at ``slot`` dropping a share ``p``; ``start``: the
    flat index of the first element (a slice of a larger batch)."""
    threshold = min(round(p * (_M32 + 1)), _M32 + 1)
    return _keyed_bits(shape, seed, step, part, slot, device, start) >= threshold


def keyed_uniform(shape: torch.Size | tuple[int, ...], seed: int, step: int, part: int, slot: int,
                  device: torch.device) -> Tensor:
    """float32 values in [0, 1), a pure function of the key (24 bits each: exact in float32)."""
    bits = _keyed_bits(shape, seed, step, part, slot, device) >> 8
    return bits.to(torch.float32) * (1.0 / (1 << 24))


class KeyedDropout(nn.Dropout):
    """``nn.Dropout`` whose mask depends on the step and the layer's ``slot``, not on a device's
    generator (module docstring). Same scaling as torch: kept elements times 1 / (1 - p)."""

    def __init__(self, p: float = 0.5, slot: int = 0) -> None:
        super().__init__(p)
        self.slot = int(slot)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        key = _STEP.get()
        if key is None:
            return super().forward(x)
        if self.p >= 1.0:
            return x * 0.0
        row = _ROW.get()
        start = row * (x.numel() // x.shape[0]) if row and x.dim() and x.shape[0] else 0
        mask = keep_mask(x.shape, self.p, *key, self.slot, x.device, start)
        return x * mask.to(x.dtype) * (1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}, slot={self.slot}"
