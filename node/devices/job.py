"""What the node hands its worker processes, and what rank 0 hands back: a folder of files.

No pickle crosses the process boundary: the job is JSON, the tensors are GFT1
(protocol/tensors.py), written by the node (the supervisor) and read by each worker.

    job.json       WorkerJob: the model spec, the training config, the seed, the engine...
    state.gft      the round's global state
    data.gft       the shard, stacked: ``x`` and ``y``
    feedback.gft   error feedback's residual, committed in the last checkpoint (optional)
    delta.gft      rank 0's answer: the update (trained - global)
    result.json    rank 0's answer: samples, loss, seconds, steps, the commitment's hashes

Progress travels as JSON lines on rank 0's stdout (``{"step": s, "loss": l}``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuflex.protocol.messages import Commitment, TrainConfig
from gpuflex.protocol.tensors import decode_state, encode_state
from torch import Tensor

__all__ = ["CommitSettings", "WorkerJob", "read_result", "read_tensors", "write_result", "write_tensors"]

JOB, STATE, DATA, FEEDBACK, DELTA, RESULT = (
    "job.json", "state.gft", "data.gft", "feedback.gft", "delta.gft", "result.json")


@dataclass(frozen=True)
class CommitSettings:
    """The checkpoint commitment rank 0 records (node/checkpoints.CheckpointRecorder's settings)."""

    root: str  # the node's checkpoint folder
    assignment_id: str
    total_steps: int
    every: int
    precision: str


@dataclass(frozen=True)
class WorkerJob:
    """One assignment's training, as every worker reads it."""

    spec: dict[str, Any]  # ModelSpec.to_dict()
    train: dict[str, Any]  # TrainConfig's fields
    seed: int
    engine: str  # ddp | fsdp
    devices: list[str]  # rank r trains on devices[r]
    store_port: int  # the supervisor's TCPStore on 127.0.0.1
    offload: bool = False
    threads: int = 1  # torch threads per CPU worker
    commit: CommitSettings | None = None
    timeout_s: float = 600.0  # a collective that waits longer fails
    compute_share: float = 1.0  # the node's --compute-share: rest after each step

    @property
    def world(self) -> int:
        return len(self.devices)

    def train_config(self) -> TrainConfig:
        return TrainConfig(**self.train)

    def write(self, folder: Path) -> None:
        _write_atomic(folder / JOB, json.dumps(dataclasses.asdict(self)).encode())

    @classmethod
    def read(cls, folder: Path) -> WorkerJob:
        d = json.loads((folder / JOB).read_text(encoding="utf-8"))
        commit = d.pop("commit")
        return cls(**d, commit=None if commit is None else CommitSettings(**commit))


def write_tensors(path: Path, tensors: Mapping[str, Tensor]) -> None:
    _write_atomic(path, encode_state({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}))


def read_tensors(path: Path) -> dict[str, Tensor]:
    """The tensors of a GFT1 file (writable copies: the file's bytes are not kept)."""
    data = bytearray(path.read_bytes())
    return decode_state(data, max_total_bytes=len(data) + 1)


def write_result(folder: Path, *, sample_count: int, loss: float, train_s: float, steps: int,
                 commitment: Commitment | None, held_bytes: int = 0) -> None:
    """``held_bytes``: the most training state any worker held on its device (parameters or their
    shards, gradients, optimizer state), measured after the first step."""
    body = {"sample_count": sample_count, "loss": loss, "train_s": train_s, "steps": steps,
            "held_bytes": held_bytes, "commitment": None if commitment is None else dataclasses.asdict(commitment)}
    _write_atomic(folder / RESULT, json.dumps(body).encode())


def read_result(folder: Path) -> tuple[dict[str, Any], Commitment | None]:
    body = json.loads((folder / RESULT).read_text(encoding="utf-8"))
    c = body.pop("commitment")
    if c is None:
        return body, None
    return body, Commitment(every=c["every"], steps=c["steps"], precision=c["precision"],
                            hashes=tuple(c["hashes"]), norms=tuple(c["norms"]))


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)
