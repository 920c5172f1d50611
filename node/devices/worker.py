"""One worker process of a node that trains on several devices: ``python -m
gpuflex.node.devices.worker FOLDER RANK``, started by the supervisor (node/devices/supervisor.py).

It trains the assignment the way node/trainer.py does in one process, with one difference:
each step's batch (the same samples, from the same permutation) is split into contiguous
slices, one per worker. A worker's loss is its slice's mean weighted by ``world x slice /
batch``, so the gradients the workers average are the batch mean's; dropout draws its slice's
rows of the step's masks (protocol/dropout.py). The update, the checkpoints and the loss are
therefore one process's, to the rounding of the sums' order.

The worker leaves when its stdin closes (the node went away) and exits non-zero on any error;
the supervisor treats either as a lost worker.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from gpuflex.protocol.dropout import dropout_step
from gpuflex.protocol.lossscale import LossScaler
from gpuflex.protocol.messages import TrainConfig
from gpuflex.protocol.modelspec import ModelSpec, update_manifest
from gpuflex.protocol.workload import assignment_steps
from torch import Tensor, nn

from ..checkpoints import CheckpointRecorder, CheckpointStore
from ..computeshare import ComputeShare
from ..errors import NodeError
from ..trainer import AUTOCAST_DTYPES, _batches, _load_model, loss_for, prepare_device
from .job import DATA, DELTA, FEEDBACK, STATE, WorkerJob, read_tensors, write_result, write_tensors
from .sharded import WorkerOptimizer, full_tensor, gathered_state, wrap_model

#: exit status when the node (the worker's stdin) went away
EXIT_ORPHANED = 3
#: exit status when the assignment cannot train (a NodeError): the supervisor refuses it
EXIT_TRAIN_ERROR = 4


@dataclass
class _Worker:
    job: WorkerJob
    rank: int
    device: torch.device
    model: nn.Module  # the module itself: its state dict names the model's tensors
    run: nn.Module  # what the forward pass calls (DDP's wrapper, or the sharded module)
    optimizer: WorkerOptimizer
    loss_fn: nn.Module
    scaler: LossScaler | None
    cfg: TrainConfig

    def slice_of(self, idx: Tensor) -> tuple[Tensor, int]:
        """This worker's contiguous share of a step's sample indices, and its first row."""
        sizes = [len(part) for part in torch.tensor_split(torch.arange(len(idx)), self.job.world)]
        start = sum(sizes[: self.rank])
        return idx[start : start + sizes[self.rank]], start

    def step(self, x: Tensor, y: Tensor, idx: Tensor, step: int) -> Tensor:
        """One optimizer step on this worker's slice of ``idx``; the slice's loss sum (float64)."""
        cfg = self.cfg
        mine, row = self.slice_of(idx)
        empty = mine.numel() == 0  # a last batch smaller than the workers: a weightless sample
        xb, yb = (x.index_select(0, idx[:1]), y.index_select(0, idx[:1])) if empty else (
            x.index_select(0, mine), y.index_select(0, mine))
        weight = 0.0 if empty else self.job.world * mine.numel() / idx.numel()
        self.optimizer.zero_grad()
        dtype = AUTOCAST_DTYPES.get(cfg.precision)
        with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None), \
                dropout_step(self.job.seed, step, row=row):
            loss = self.loss_fn(self.run(xb), yb)
        scaled = loss.float() * weight
        (scaled if self.scaler is None else scaled * self.scaler.scale).backward()
        self.optimizer.load_grads()
        finite = True
        if self.scaler is not None:
            finite = self.optimizer.unscale(self.scaler)
            self.scaler.update()
        if cfg.grad_clip > 0 and finite:
            self.optimizer.clip(float(cfg.grad_clip))
        if finite:
            self.optimizer.step()
        return loss.detach().double() * (0 if empty else mine.numel())


def _setup(job: WorkerJob, rank: int, folder: Path) -> tuple[_Worker, Tensor, Tensor, dict[str, Tensor]]:
    device = torch.device(job.devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, job.threads))
    cfg = job.train_config()
    prepare_device(device, cfg.precision)
    store = dist.TCPStore("127.0.0.1", job.store_port, job.world, is_master=False,
                          timeout=timedelta(seconds=job.timeout_s))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=job.world, timeout=timedelta(seconds=job.timeout_s))
    spec = ModelSpec.from_dict(job.spec)
    global_state = read_tensors(folder / STATE)
    data = read_tensors(folder / DATA)
    model = _load_model(spec, global_state, device)
    model.train()
    run = wrap_model(model, job.engine, device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = WorkerOptimizer(params, cfg, sharded=job.engine == "fsdp", offload=job.offload)
    scaler = LossScaler(device) if cfg.precision == "fp16" else None
    worker = _Worker(job, rank, device, model, run, optimizer, loss_for(spec, cfg), scaler, cfg)
    return worker, data["x"].to(device), data["y"].to(device), global_state


def _recorder(job: WorkerJob, folder: Path) -> CheckpointRecorder | None:
    c = job.commit
    if c is None:
        return None
    feedback = read_tensors(folder / FEEDBACK) if (folder / FEEDBACK).is_file() else None
    return CheckpointRecorder(total_steps=c.total_steps, every=c.every, precision=c.precision,
                              store=CheckpointStore(Path(c.root)), assignment_id=c.assignment_id,
                              feedback=feedback)


def train(folder: Path, rank: int) -> None:
    """Train the folder's job as worker ``rank``; rank 0 writes the update and the result."""
    job = WorkerJob.read(folder)
    w, x, y, global_state = _setup(job, rank, folder)
    cfg = job.train_config()
    n, bs = int(x.shape[0]), int(cfg.batch_size)
    total = assignment_steps(n, bs, int(cfg.local_epochs), int(cfg.local_steps))
    epochs = math.ceil(total / math.ceil(n / bs))
    report_every = max(1, min(total // 100, 16))
    recorder = _recorder(job, folder) if rank == 0 else None
    torch.manual_seed(job.seed)  # as the one-process trainer: the checkpoints' ``rng``
    wanted = _wanted(job)

    def checkpoint(step: int) -> None:
        if step not in wanted:
            return
        state = gathered_state(w.model, w.optimizer, step, w.scaler)  # every worker gathers
        if recorder is not None:
            recorder.record(step, state)

    started = time.perf_counter()
    checkpoint(0)
    loss_sum = torch.zeros((), dtype=torch.float64, device=w.device)
    last_seen = step = 0
    held = torch.zeros(1, dtype=torch.int64)
    pace = ComputeShare(job.compute_share, w.device)
    for idx, last_epoch in _batches(n, bs, epochs, total, job.seed, w.device):
        with pace.computing():
            summed = w.step(x, y, idx, step)
        step += 1
        if step == 1:  # the state is whole now (gradients held, optimizer state made): its size
            held = torch.tensor([w.optimizer.held_bytes()], dtype=torch.int64, device=w.device)
            dist.all_reduce(held, op=dist.ReduceOp.MAX)
        if last_epoch:
            loss_sum += summed
            last_seen += int(idx.numel())
        checkpoint(step)
        if step % report_every == 0 or step == total:
            dist.all_reduce(summed)
            if rank == 0:
                print(json.dumps({"step": step, "loss": float(summed) / idx.numel()}), flush=True)
    dist.all_reduce(loss_sum)
    trained = {k: full_tensor(v) for k, v in w.model.state_dict().items()}
    train_s = time.perf_counter() - started
    if rank == 0:
        carried = [t.name for t in update_manifest(ModelSpec.from_dict(job.spec))]  # LoRA: the adapters
        delta = {k: (trained[k].detach().to("cpu").to(ref.dtype) - ref) if ref.is_floating_point()
                 else trained[k].detach().to("cpu").clone() for k in carried for ref in (global_state[k],)}
        write_tensors(folder / DELTA, delta)
        write_result(folder, sample_count=n, loss=float(loss_sum) / max(last_seen, 1), train_s=train_s,
                     steps=step, commitment=recorder.commitment() if recorder is not None else None,
                     held_bytes=int(held[0]))
    dist.barrier()
    dist.destroy_process_group()


def _wanted(job: WorkerJob) -> set[int]:
    from gpuflex.protocol.checkpoint import checkpoint_steps

    c = job.commit
    return set() if c is None else set(checkpoint_steps(c.total_steps, c.every))


def _leave_with_the_node() -> None:
    """Exit at once when stdin closes: the node that started this worker is gone."""
    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(0, 4096):  # the raw descriptor: no buffer lock held at interpreter exit
                pass
        os._exit(EXIT_ORPHANED)

    threading.Thread(target=watch, daemon=True, name="gpuflex-worker-stdin").start()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        print("usage: python -m gpuflex.node.devices.worker FOLDER RANK", file=sys.stderr)
        return 2
    _leave_with_the_node()
    try:
        train(Path(args[0]), int(args[1]))
    except NodeError as exc:  # the assignment cannot train: the node refuses it, no retry
        print(" ".join(str(exc).split()), file=sys.stderr, flush=True)
        return EXIT_TRAIN_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
