"""Stepping aside while another process uses the GPU (``--yield-gpu``, on by default).

Every two seconds NVML is asked whether a process other than this node holds a context on
the node's GPU; if so the node pauses (reason ``gpu_busy``: the assignment in hand goes
back to the hub at once), and it resumes when the GPU is free again. A pause the volunteer
asked for is never lifted here. Without nvidia-ml-py or NVML the node does not yield.
"""

from __future__ import annotations

import asyncio

import torch

from .device import GpuWatcher
from .pause import EventSink, PauseState

REASON = "gpu_busy"
EVERY_S = 2.0


async def yield_gpu_while_busy(pause: PauseState, device: torch.device, output: EventSink) -> None:
    """Pause and resume ``pause`` with the GPU's other users, until the node exits."""
    watcher = await asyncio.to_thread(GpuWatcher, device)
    if not watcher.available:
        output.event("note", detail="GPU yielding off (nvidia-ml-py missing or NVML unavailable)")
        return
    while not pause.exited.is_set():
        await pause.tick(EVERY_S)
        busy = await asyncio.to_thread(watcher.others_busy)
        if busy and not pause.paused:
            pause.pause(REASON)
        elif not busy and pause.paused and pause.reason == REASON:
            pause.resume()


__all__ = ["yield_gpu_while_busy"]
