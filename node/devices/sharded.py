"""The worker's model and optimizer under torch.distributed: DDP (each worker holds the whole
model) or FSDP2 (``fully_shard``: each holds a shard of every parameter, its gradient and its
optimizer state), the node's own optimizer (node/optim.py) over what this worker updates, and
the full state gathered back for the checkpoint commitment and the update.

Gradients are averaged over the workers by DDP's all-reduce or FSDP's reduce-scatter; the
worker's loss is weighted so that the average is the single process's batch mean
(node/devices/worker.py). What needs every gradient, not one shard (the clipping norm, fp16's
overflow check), is reduced across the workers here, so every worker takes the same decision.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from gpuflex.protocol.lossscale import LossScaler
from gpuflex.protocol.messages import TrainConfig
from torch import Tensor, nn

from ..checkpoints import optimizer_buffers, state_layout
from ..optim import clip_grad_norm
from ..trainer import make_optimizer

__all__ = ["WorkerOptimizer", "full_tensor", "gathered_state", "wrap_model"]


def wrap_model(model: nn.Module, engine: str, device: torch.device) -> nn.Module:
    """``model`` ready for the workers: DDP around it, or sharded in place by FSDP2 (each module
    that owns parameters is a unit, so only one unit is gathered whole at a time; a model that
    shares a parameter between modules is one unit)."""
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    owners = [m for m in model.modules() if m is not model and any(True for _ in m.parameters(recurse=False))]
    owned = [id(p) for m in owners for p in m.parameters(recurse=False)]
    if len(owned) == len(set(owned)):
        for m in reversed(owners):  # children before their parents
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_tensor(t: Tensor) -> Tensor:
    """A sharded parameter's (a DTensor's) whole value, gathered from every worker (a collective:
    every worker calls it, in the same order); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class WorkerOptimizer:
    """The node's optimizer over what this worker updates: the parameters themselves (DDP), their
    local shards (FSDP), or host copies of either (``offload``: the optimizer state lives in host
    memory, the update is copied back to the device after each step)."""

    def __init__(self, params: Sequence[Tensor], cfg: TrainConfig, *, sharded: bool, offload: bool) -> None:
        self.params = list(params)
        self.sharded = sharded
        self.offload = offload
        local = [p.to_local() if sharded else p for p in self.params]  # type: ignore[attr-defined]
        self.views = [v.detach() for v in local]  # the device's storage, written in place
        #: the device tensors whose ``.grad`` the scaler and the clipping act on
        self.graded = self.views if sharded else self.params
        self.targets = [v.to("cpu", copy=True) for v in self.views] if offload else self.graded
        self.optimizer = make_optimizer(self.targets, cfg)

    def zero_grad(self) -> None:
        for group in (self.params, self.views, self.targets):
            for t in group:
                t.grad = None

    def load_grads(self) -> None:
        """The gradients the backward pass left (averaged over the workers) onto ``graded``: a
        sharded parameter's gradient is a DTensor, its shard is what this worker steps."""
        if self.sharded:
            for v, p in zip(self.views, self.params, strict=True):
                v.grad = None if p.grad is None else p.grad.to_local()  # type: ignore[attr-defined]

    def unscale(self, scaler: LossScaler) -> bool:
        """fp16: divide the gradients by the scale; True when every worker's are finite."""
        scaler.unscale(self.graded)
        if self.sharded:
            dist.all_reduce(scaler.found_inf, op=dist.ReduceOp.MAX)
        return not bool(scaler.found_inf.item())

    def clip(self, max_norm: float) -> None:
        """clip_grad_norm over the whole gradient (the shards' squares summed across workers)."""
        if not self.sharded:
            clip_grad_norm(self.graded, max_norm)
            return
        grads = [t.grad for t in self.graded if t.grad is not None]
        squares = torch.zeros((), dtype=torch.float32, device=self.params[0].device)
        for g in grads:
            squares += torch.linalg.vector_norm(g.float(), 2.0) ** 2
        dist.all_reduce(squares)
        coef = torch.clamp(max_norm / (squares.sqrt() + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)

    @torch.no_grad()
    def step(self) -> None:
        if self.offload:  # the gradients to the host, the step there, the parameters back
            for t, g in zip(self.targets, self.graded, strict=True):
                t.grad = None if g.grad is None else g.grad.to(t.device)
        self.optimizer.step()
        if self.offload:
            for v, t in zip(self.views, self.targets, strict=True):
                v.copy_(t)

    def held_bytes(self) -> int:
        """The training state this worker holds on its device, in bytes: its parameters (or their
        shards), their gradients, and the optimizer state unless it lives on the host."""
        def size(ts: Sequence[Tensor | None]) -> int:
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        bufs = [] if self.offload else [b for kind, v in optimizer_buffers(self.optimizer).items()
                                        if kind != "t" and v for b in v]
        grads = [None if p.grad is None else (p.grad.to_local() if self.sharded else p.grad)  # type: ignore[attr-defined]
                 for p in self.params]
        return size(self.views) + size(grads) + size(bufs)

    def full_buffers(self) -> dict[str, Sequence[Tensor] | None]:
        """``optimizer_buffers`` with every buffer whole (gathered from the shards: a collective)."""
        out = optimizer_buffers(self.optimizer)
        if not self.sharded:
            return out
        return {kind: None if bufs is None else (bufs if kind == "t" else self._gather(bufs))
                for kind, bufs in out.items()}

    def _gather(self, bufs: Sequence[Tensor]) -> list[Tensor]:
        from torch.distributed.tensor import DTensor

        whole = []
        for b, p in zip(bufs, self.params, strict=True):
            d = DTensor.from_local(b.to(p.device), p.device_mesh, p.placements,  # type: ignore[attr-defined]
                                   shape=p.shape, stride=p.stride(), run_check=False)
            whole.append(d.full_tensor())
        return whole


def gathered_state(model: nn.Module, optimizer: WorkerOptimizer, step: int,
                   scaler: LossScaler | None) -> dict[str, Tensor]:
    """The full training state in protocol/checkpoint.py's layout, as one process would hold it
    (every worker calls it; the shards are gathered)."""
    model_state = {k: full_tensor(v) for k, v in model.state_dict().items()}
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return state_layout(model_state, names, optimizer.full_buffers(), step, scaler)
