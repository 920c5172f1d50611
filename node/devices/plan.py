"""Which local devices a node trains on (``--devices``), and how a model is spread over them.

``--devices`` names one worker process per device: ``all`` (every CUDA device; the CPU where
there is none), ``0,1`` or ``cuda:0,cuda:1`` (those CUDA devices), ``cpu`` or ``cpu:N`` (N
worker processes on the CPU: a CPU box, or tests). The engine is chosen per assignment from
the bytes its training state takes (parameters, gradients, optimizer state, all float32):

- ``ddp``: every worker holds the whole model (it fits one device's budget);
- ``fsdp``: parameters, gradients and optimizer state are sharded over the workers
  (``torch.distributed.fsdp.fully_shard``), each holding about 1/N.

A device's budget is ``--max-memory`` split evenly over the workers when given, else what the
device has free (a CPU worker: its share of the host's available memory). ``--offload
optimizer`` keeps the optimizer state in host memory, so it does not count against a device.
Everything here is checked before any work starts, or before an assignment trains.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass

import torch
from gpuflex.protocol.messages import TrainConfig
from torch import Tensor

from ..errors import ConfigError, TrainError
from ..hostinfo import available_memory_bytes

__all__ = ["DevicePlan", "check_offload", "choose_engine", "device_budget", "parse_devices", "training_bytes"]

#: the most worker processes one node starts
MAX_WORKERS = 64
OFFLOAD_CHOICES = ("optimizer",)


@dataclass(frozen=True)
class DevicePlan:
    """The node's devices, one worker process each, and where the optimizer state lives."""

    devices: tuple[torch.device, ...]
    offload: bool = False

    @property
    def workers(self) -> int:
        return len(self.devices)

    @property
    def backend(self) -> str:
        """torch.distributed's backend: NCCL between CUDA devices, gloo on the CPU."""
        return "nccl" if self.devices[0].type == "cuda" else "gloo"

    def names(self) -> list[str]:
        return [str(d) for d in self.devices]


def parse_devices(text: str, *, offload: str | None = None, cuda_count: int | None = None) -> DevicePlan:
    """The plan ``--devices text`` (and ``--offload``) names; ConfigError, one line, for a device
    this machine does not have, a repeated one, or a malformed list."""
    flag = f"--devices {text[:60]!r}"
    cuda_count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if offload is not None and offload not in OFFLOAD_CHOICES:
        raise ConfigError(f"--offload {offload[:40]!r}: allowed values are {', '.join(OFFLOAD_CHOICES)}")
    choice = text.strip().lower()
    if choice == "all":
        devices = (tuple(torch.device("cuda", i) for i in range(cuda_count)) if cuda_count
                   else (torch.device("cpu"),))
    elif choice == "cpu" or choice.startswith("cpu:"):
        devices = (torch.device("cpu"),) * _count(choice[4:] or "1", flag)  # more than the cores: they share
    else:
        devices = tuple(torch.device("cuda", _cuda_index(part, flag, cuda_count)) for part in choice.split(","))
        if len(set(devices)) != len(devices):
            raise ConfigError(f"{flag}: a device is named twice")
    return DevicePlan(devices, offload=offload == "optimizer")


def _count(text: str, flag: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= MAX_WORKERS:
        raise ConfigError(f"{flag}: cpu:N takes a worker count from 1 to {MAX_WORKERS}")
    return int(text)


def _cuda_index(part: str, flag: str, cuda_count: int) -> int:
    part = part.strip().removeprefix("cuda:")
    if not part.isdigit():
        raise ConfigError(f"{flag}: expected all, cpu, cpu:N, or CUDA device indices like 0,1")
    index = int(part)
    if index >= cuda_count:
        there = f"only {cuda_count} CUDA device(s) present" if cuda_count else "CUDA is not available"
        raise ConfigError(f"{flag}: there is no CUDA device {index} ({there})")
    return index


def training_bytes(state: Mapping[str, Tensor], cfg: TrainConfig,
                   trained: Container[str] | None = None) -> tuple[int, int]:
    """(the model's state + gradients, optimizer state) in bytes for training ``state`` with
    ``cfg``: every tensor as held (a LoRA job's frozen int8 weights at a byte each), float32
    gradients and SGD's momentum buffer or Adam's two moments for the ``trained`` tensors (None:
    every floating one)."""
    held = sum(t.numel() * t.element_size() for t in state.values())
    floats = sum(t.numel() for k, t in state.items() if t.is_floating_point() and (trained is None or k in trained))
    copies = 2 if cfg.optimizer in ("adam", "adamw") else (1 if cfg.momentum else 0)
    return held + 4 * floats, copies * 4 * floats


def device_budget(plan: DevicePlan, max_memory_bytes: int | None) -> int:
    """The bytes each worker may hold: ``--max-memory`` over the workers, else the least any of
    the devices has free (CPU workers share the host's available memory)."""
    if max_memory_bytes is not None:
        return max_memory_bytes // plan.workers
    free = []
    for d in plan.devices:
        if d.type == "cuda":
            free.append(int(torch.cuda.mem_get_info(d)[0]))
        else:
            free.append(available_memory_bytes() // plan.workers)
    return min(free)


def choose_engine(model_bytes: int, optimizer_bytes: int, *, workers: int, budget: int, offload: bool,
                  host_free: int | None = None) -> str:
    """``ddp`` when one device holds the whole training state, ``fsdp`` when the N workers hold
    it sharded; TrainError when not even that fits (or offloaded state has no room on the host)."""
    on_device = model_bytes + (0 if offload else optimizer_bytes)
    if offload:
        host_free = available_memory_bytes() if host_free is None else host_free
        if optimizer_bytes > host_free:
            raise TrainError(f"--offload optimizer: the optimizer state needs {_gib(optimizer_bytes)}, "
                             f"the host has {_gib(host_free)} available")
    if on_device <= budget:
        return "ddp"
    if on_device <= budget * workers:
        return "fsdp"
    raise TrainError(f"the training state needs {_gib(on_device)}; {workers} device(s) of {_gib(budget)} "
                     "each cannot hold it even sharded")


def check_offload(plan: DevicePlan, budget: int, host_free: int | None = None) -> None:
    """``--offload optimizer`` needs room on the host: the optimizer state of the largest model
    the devices take (Adam's two moments are half of parameters, gradients and moments together),
    that is half of what the workers offer in all. ConfigError, one line, when the host has less."""
    if not plan.offload:
        return
    host_free = available_memory_bytes() if host_free is None else host_free
    needed = budget * plan.workers // 2
    if needed > host_free:
        raise ConfigError(f"--offload optimizer: the host has {_gib(host_free)} available, the optimizer state "
                          f"of what {plan.workers} device(s) offer needs up to {_gib(needed)}; lower --max-memory "
                          "or drop --offload")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
