"""Dynamic loss scaling for fp16 training: the node's trainer and the hub's referee, which
replays a node's fp16 segment step for step (skipped steps included), run this one class."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from .errors import TensorError

__all__ = ["LossScaler"]


class LossScaler:
    """Dynamic loss scaling for fp16, with ``torch.amp.GradScaler``'s rules (initial scale
    2**16, x2 after 2000 finite steps, x0.5 and the step skipped on an inf/NaN gradient).

    Why not GradScaler itself: it drives a ``torch.optim`` optimizer (see node/optim.py).
    Deterministic: the scale depends only on the gradients seen. Its state (``state`` /
    ``from_state``) is part of a training checkpoint, so the referee replays the skipped steps.
    """

    #: the scale a new scaler starts from (GradScaler's)
    INIT_SCALE = 2.0**16

    def __init__(self, device: torch.device, *, init_scale: float = INIT_SCALE, growth_interval: int = 2000) -> None:
        self.scale = torch.full((), init_scale, dtype=torch.float32, device=device)
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.growth_interval = growth_interval

    def unscale(self, params: Sequence[Tensor]) -> bool:
        """Divide the gradients by the scale; True when every one is finite (step it)."""
        grads = [p.grad for p in params if p.grad is not None]
        self.found_inf.zero_()
        if grads:
            inv = self.scale.reciprocal()
            try:
                torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, inv)
            except (RuntimeError, NotImplementedError):  # a backend without the fused kernel (MPS)
                for g in grads:
                    g.mul_(inv)
                    if not bool(torch.isfinite(g).all()):
                        self.found_inf.fill_(1.0)
        return not bool(self.found_inf.item())

    def update(self) -> None:
        try:
            torch._amp_update_scale_(self.scale, self.growth_tracker, self.found_inf, 2.0, 0.5, self.growth_interval)
        except (RuntimeError, NotImplementedError):  # the same rule, step by step
            if bool(self.found_inf.item()):
                self.scale.mul_(0.5)
                self.growth_tracker.zero_()
            else:
                self.growth_tracker.add_(1)
                if int(self.growth_tracker.item()) >= self.growth_interval:
                    self.scale.mul_(2.0)
                    self.growth_tracker.zero_()

    def state(self) -> dict[str, Tensor]:
        """The checkpoint's ``amp.scale`` (float32 (1,)) and ``amp.growth`` (int32 (1,))."""
        return {"amp.scale": self.scale.detach().to("cpu", copy=True).reshape(1),
                "amp.growth": self.growth_tracker.detach().to("cpu", copy=True).reshape(1)}

    @classmethod
    def from_state(cls, state: Mapping[str, Tensor], device: torch.device) -> LossScaler:
        """The scaler a checkpoint recorded; a fresh one where it has none (step 0)."""
        scaler = cls(device)
        scale, growth = state.get("amp.scale"), state.get("amp.growth")
        if scale is not None and growth is not None:
            if scale.numel() != 1 or growth.numel() != 1 or not bool(torch.isfinite(scale).all()) or float(scale) <= 0:
                raise TensorError("checkpoint amp.scale/amp.growth: expected one finite positive scale and a count")
            scaler.scale.fill_(float(scale.reshape(())))
            scaler.growth_tracker.fill_(int(growth.reshape(())))
        return scaler

