"""The fixed time a stage's units take per micro-batch whatever its size: kernel launches, the
framework's cost per op and per autograd node. A stage measures it of itself before its first
step and says it in every report (``StageReport.unit_overhead_s``), so that the hub reads the
node's speed apart from it (hub/policy/stage_speed.py) and the planner adds it back per unit and
micro-batch (hub/policy/pipeline_plan.py). Without it, a speed measured at one micro-batch size
mispredicts another: too slow for larger micro-batches, too fast for smaller ones.

The measure is the intercept of the stage's forward and backward time over the micro-batch size:
the median of a few timed passes at one sample and at ``size`` samples (the stage's own
micro-batch size, at least 2), extrapolated to none, over the stage's units. It runs the stage's
own modules on zeros of its input, in eval mode (no dropout drawn, no batch-norm statistics
moved, the routers' balancing losses dropped), under a forked random state, and leaves every
parameter's gradient as it found it: the training that follows is exactly what it would have
been. A mixture of experts' routing on zeros sends every token to the same experts, so a stage
of them measures its fixed time on that routing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from gpuflex.protocol.moe import routers_aux_loss
from torch import Tensor, nn

__all__ = ["REPEATS", "unit_overhead_s"]

#: timed passes at each size (after one untimed pass); the median is kept
REPEATS = 3


def unit_overhead_s(
    module: nn.Module, example: Tensor, *, units: int, repeats: int = REPEATS
) -> float:
    """Seconds per unit and micro-batch that ``module`` (``units`` units) takes whatever the
    micro-batch's size, from its forward and backward on zeros like ``example`` (one
    micro-batch of its input, batch first), at least 0. Blocking (it computes)."""
    if units < 1 or example.dim() == 0:
        return 0.0
    size = max(int(example.shape[0]), 2)
    shape, dtype, device = tuple(example.shape[1:]), example.dtype, example.device
    modes = [(m, m.training) for m in module.modules()]
    grads = [(p, p.grad) for p in module.parameters()]
    forked = [device] if device.type == "cuda" else []
    try:
        module.eval()
        with torch.random.fork_rng(devices=forked):
            times = {
                n: _median_s(
                    _pass(module, torch.zeros((n, *shape), dtype=dtype, device=device)),
                    device,
                    repeats,
                )
                for n in (1, size)
            }
    finally:
        routers_aux_loss(module)  # a router's balancing loss of the last pass: taken, dropped
        for m, training in modes:
            m.training = training
        for p, grad in grads:
            p.grad = grad
    per_sample = (times[size] - times[1]) / (size - 1)
    return max(0.0, times[1] - per_sample) / units


def _pass(module: nn.Module, x: Tensor) -> Callable[[], None]:
    """One forward and backward of ``module`` on ``x`` (its input's gradient too, as a stage
    computes it to send back), the output's gradient all ones."""
    wants_grad = x.is_floating_point()

    def once() -> None:
        for p in module.parameters():
            p.grad = None
        inp = x.detach().requires_grad_(wants_grad)
        out = module(inp)
        if isinstance(out, Tensor) and out.requires_grad:
            out.backward(torch.ones_like(out))

    return once


def _median_s(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    fn()  # the first pass allocates and warms up
    times = []
    for _ in range(max(repeats, 1)):
        _sync(device)
        started = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
