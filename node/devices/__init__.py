"""Training on every device a node has: one worker process per device under torch.distributed
(NCCL between CUDA devices, gloo on the CPU), started and supervised by the node.

    plan.py        --devices / --offload parsing; DDP or FSDP from the model's training bytes
    job.py         the files the node hands its workers, and rank 0's answer (no pickle)
    supervisor.py  the node's side: start, watch, retry or give up, read the update
    worker.py      one worker process: the trainer's loop over its slice of every batch
    sharded.py     DDP / FSDP2 wrapping, the optimizer over local shards, gathering full state
"""

from .plan import DevicePlan, parse_devices
from .supervisor import WorkerGroup, batch_statistics, worker_group

__all__ = ["DevicePlan", "WorkerGroup", "batch_statistics", "parse_devices", "worker_group"]
