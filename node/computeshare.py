"""``--compute-share F``: a node that computes at most a share F of its wall time.

A volunteer who wants the node to run cooler and quieter, or to leave the machine room for its
own work, gives it a share (BOINC's "use at most N % of CPU time"). After each piece of training
(a data-parallel step, a stage's forward or backward of one micro-batch, its optimizer step) the
node rests ``(1/F - 1)`` times as long as the piece took, so over any stretch of training it
computes about F of the time. The rest is taken in the thread that trains, where the piece ran:
transfers, heartbeats and the hub's long polls go on while it rests.

On a GPU the host only queues kernels, so a piece is timed after the device finished it
(``torch.cuda.synchronize``); that costs nothing a share below 1 does not already give away,
and a share of 1 (the default) times and synchronizes nothing.

What the node offers the hub is its measured speed times F (``offered``): the hub plans with
the node as it will run, and the hub's own measurement of the node's stage steps agrees.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from gpuflex.protocol.messages import Benchmark

from .errors import ConfigError

#: the least share a node may be given: below it a node is too slow to be worth a stage
MIN_SHARE = 0.05
#: rests shorter than this are carried to the next piece (a sleep's own cost and granularity)
MIN_REST_S = 0.002


def check_share(share: float) -> float:
    """``share`` when it is a share a node can run at; ConfigError, one line, otherwise."""
    if not (math.isfinite(share) and MIN_SHARE <= share <= 1.0):
        raise ConfigError(f"--compute-share {share}: expected a fraction from {MIN_SHARE} to 1")
    return share


@dataclass
class ComputeShare:
    """Rests a training thread so it computes ``share`` of its wall time. One per training run
    (it carries the rest still owed from piece to piece); not shared between threads."""

    share: float = 1.0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    #: seconds of rest owed and not yet taken (less than `MIN_REST_S`, or overslept: negative)
    owed_s: float = 0.0
    #: seconds rested so far (what the share has cost this run)
    rested_s: float = 0.0

    def __post_init__(self) -> None:
        check_share(self.share)

    @property
    def full(self) -> bool:
        """A share of 1: nothing is timed, nothing rested."""
        return self.share >= 1.0

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """Time the piece of training inside, then rest for it."""
        if self.full:
            yield
            return
        started = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.rest_for(time.perf_counter() - started)

    def rest_for(self, computed_s: float) -> None:
        """Rest ``(1/share - 1)`` times ``computed_s``, with what is still owed."""
        self.owed_s += max(computed_s, 0.0) * (1.0 / self.share - 1.0)
        if self.owed_s < MIN_REST_S:
            return
        started = time.perf_counter()
        time.sleep(self.owed_s)
        slept = time.perf_counter() - started
        self.rested_s += slept
        self.owed_s -= slept  # an oversleep is paid back by the next piece


def offered(benchmark: Benchmark, share: float) -> Benchmark:
    """The benchmark a node computing ``share`` of its time offers: every training and matmul
    speed times the share (memory and transfer bandwidths are what they are)."""
    if share >= 1.0:
        return benchmark

    def scaled(value: float | None) -> float | None:
        return None if value is None else value * share

    return dataclasses.replace(
        benchmark,
        samples_per_s=benchmark.samples_per_s * share,
        matmul_tflops_fp32=benchmark.matmul_tflops_fp32 * share,
        matmul_tflops_bf16=scaled(benchmark.matmul_tflops_bf16),
        matmul_tflops_fp16=scaled(benchmark.matmul_tflops_fp16),
        precision_sps={k: v * share for k, v in benchmark.precision_sps.items()},
    )


__all__ = ["MIN_SHARE", "ComputeShare", "check_share", "offered"]
