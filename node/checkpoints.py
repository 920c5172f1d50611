"""Checkpoint commitments: the node's side of the referee's segment re-execution.

While an assignment trains, ``CheckpointRecorder`` (the trainer's per-step hook) records the
full training state (protocol/checkpoint.py: model + optimizer state + step + RNG) every
``every`` steps, plus the first and the last. Each state is hashed in the canonical GFT1
encoding; the hashes and each segment's update norm go into the signed update header
(messages.Commitment). The states themselves are written to ``<data dir>/checkpoints/<assignment
id>/<step>.gft`` so the node can hand them over when the hub's referee asks
(messages.StateRequest).

What is kept (``CheckpointStore.prune``): the referee asks for the states of an update while the
round that update belongs to is open, and a node-local job's straggler counts in the round after
it. Once the hub hands this node an assignment of round R of a job, no round before R - 1 of that
job can be asked about again, so the states of every assignment of rounds R - 1 and R are kept,
however many there were, and older ones of that job are dropped. States older than ``max_age_s``
(a job this node no longer trains) go too, and while the total is over ``max_bytes`` the oldest
folders go first. A state that was dropped is declared at once when asked for
(messages.StateUnavailable): the hub decides without waiting.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from gpuflex.protocol.checkpoint import (
    FEEDBACK_PREFIX,
    auto_every,
    canonical_bytes,
    checkpoint_steps,
    segment_norm,
)
from gpuflex.protocol.lossscale import LossScaler
from gpuflex.protocol.messages import Assignment, Commitment
from gpuflex.protocol.tensors import sha256_hex
from gpuflex.protocol.workload import assignment_steps
from torch import Tensor, nn

from .errors import TrainError
from .optim import SGD, Adam, LocalOptimizer

__all__ = ["CheckpointRecorder", "CheckpointStore", "optimizer_buffers", "state_layout", "training_state"]

_ID_RE = re.compile(r"[0-9A-Za-z_-]{1,64}")


def training_state(model: nn.Module, optimizer: LocalOptimizer, step: int,
                   scaler: LossScaler | None = None) -> dict[str, Tensor]:
    """The full training state in the layout of protocol/checkpoint.py (CPU copies)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if len(names) != len(optimizer.params):
        raise TrainError("optimizer parameters do not match the model's")
    return state_layout(model.state_dict(), names, optimizer_buffers(optimizer), step, scaler)


def optimizer_buffers(optimizer: LocalOptimizer) -> dict[str, Sequence[Tensor] | None]:
    """The optimizer's state by its checkpoint name (``momentum``; ``exp_avg``, ``exp_avg_sq``),
    one tensor per parameter in the optimizer's order, None before the first step; and ``t``
    (Adam's step count) as a one-element tensor."""
    if isinstance(optimizer, SGD):
        return {"momentum": optimizer.bufs}
    if isinstance(optimizer, Adam):
        t = [torch.tensor([optimizer.t], dtype=torch.int64)] if optimizer.t else None
        return {"exp_avg": optimizer.exp_avg, "exp_avg_sq": optimizer.exp_avg_sq, "t": t}
    return {}


def state_layout(model_state: Mapping[str, Tensor], names: Sequence[str],
                 buffers: Mapping[str, Sequence[Tensor] | None], step: int,
                 scaler: LossScaler | None = None) -> dict[str, Tensor]:
    """protocol/checkpoint.py's layout from the module's full state, its trained parameters'
    ``names`` and ``optimizer_buffers`` (full tensors, not shards): CPU copies."""
    out: dict[str, Tensor] = {f"model.{k}": v.detach().to("cpu", copy=True) for k, v in model_state.items()}
    for kind, bufs in buffers.items():
        if bufs is None:
            continue
        if kind == "t":
            out["opt.t"] = bufs[0].to("cpu", copy=True)
            continue
        if len(bufs) != len(names):  # a parameter without a gradient: the layout cannot name the buffers
            raise TrainError("optimizer state does not cover every parameter; cannot checkpoint it")
        for n, b in zip(names, bufs, strict=True):
            out[f"opt.{kind}.{n}"] = b.detach().to("cpu", copy=True)
    if scaler is not None:  # fp16: the scale decides which steps are skipped
        out.update(scaler.state())
    out["step"] = torch.tensor([step], dtype=torch.int64)
    out["rng"] = torch.get_rng_state()
    return out


class CheckpointStore:
    """``root/<assignment id>/<step>.gft`` files, and ``round`` (the job id and round) beside them."""

    OWNER_FILE = "round"

    def __init__(self, root: Path, *, max_bytes: int = 2 << 30, max_age_s: float = 7 * 86_400.0) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s

    def folder(self, assignment_id: str) -> Path:
        if not _ID_RE.fullmatch(assignment_id):
            raise TrainError(f"bad assignment id {assignment_id[:80]!r}")
        return self.root / assignment_id

    def begin(self, assignment_id: str, job_id: str, round: int) -> None:
        """Name the job and round an assignment's states belong to (before the first is written)."""
        folder = self.folder(assignment_id)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        (folder / self.OWNER_FILE).write_text(f"{job_id}\n{int(round)}\n", encoding="ascii")

    def write(self, assignment_id: str, step: int, data: bytes) -> None:
        folder = self.folder(assignment_id)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, folder / f"{step}.gft")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def read(self, assignment_id: str, step: int) -> bytes | None:
        """The bytes of a stored checkpoint, or None when it is not (or no longer) kept."""
        try:
            return (self.folder(assignment_id) / f"{int(step)}.gft").read_bytes()
        except (OSError, TrainError):
            return None

    def held(self, assignment_id: str, steps: Sequence[int]) -> list[int]:
        """Those of ``steps`` whose states are kept."""
        try:
            folder = self.folder(assignment_id)
        except TrainError:
            return []
        return [s for s in steps if (folder / f"{int(s)}.gft").is_file()]

    def recorder(self, assignment: Assignment, samples: int,
                 feedback: Mapping[str, Tensor] | None = None) -> CheckpointRecorder:
        """The trainer's step hook for ``assignment`` (``samples`` in its chunks), writing here;
        what the hub can no longer ask about is dropped first."""
        total, every = self.prepare(assignment, samples)
        return CheckpointRecorder(total_steps=total, every=every, precision=assignment.train.precision,
                                  store=self, assignment_id=assignment.assignment_id, feedback=feedback)

    def prepare(self, assignment: Assignment, samples: int) -> tuple[int, int]:
        """Make room for ``assignment``'s states (dropping what the hub can no longer ask about)
        and name its round; its (total steps, checkpoint interval)."""
        t = assignment.train
        total = assignment_steps(samples, t.batch_size, t.local_epochs, t.local_steps)
        self.begin(assignment.assignment_id, assignment.job_id, assignment.round)
        self.prune(keep_id=assignment.assignment_id, job_id=assignment.job_id, round=assignment.round)
        return total, auto_every(total, t.checkpoint_every)

    def _owner(self, folder: Path) -> tuple[str, int] | None:
        try:
            job_id, round_text = folder.joinpath(self.OWNER_FILE).read_text(encoding="ascii").split()
            return job_id, int(round_text)
        except (OSError, ValueError):
            return None

    def prune(self, keep_id: str | None = None, *, job_id: str | None = None, round: int | None = None,
              now: float | None = None) -> list[str]:
        """Drop what the hub can no longer ask for: ``job_id``'s assignments of rounds before
        ``round - 1``, and anything older than ``max_age_s``; then the oldest while the total is
        over ``max_bytes``. ``keep_id``'s folder is never dropped. The dropped assignment ids."""
        if not self.root.is_dir():
            return []
        now = time.time() if now is None else now
        folders = sorted((p for p in self.root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime,
                         reverse=True)
        dropped: list[str] = []
        kept: list[Path] = []
        for p in folders:
            owner = self._owner(p)
            settled = (owner is not None and owner[0] == job_id and round is not None and owner[1] < round - 1)
            if p.name != keep_id and (settled or now - p.stat().st_mtime > self.max_age_s):
                dropped.append(p.name)
            else:
                kept.append(p)
        sizes = {p: sum(f.stat().st_size for f in p.iterdir() if f.is_file()) for p in kept}
        total = sum(sizes.values())
        for p in reversed(kept):  # the oldest go first while over the bound
            if total <= self.max_bytes:
                break
            if p.name != keep_id:
                dropped.append(p.name)
                total -= sizes[p]
        for name in dropped:
            shutil.rmtree(self.root / name, ignore_errors=True)
        return dropped


class CheckpointRecorder:
    """The trainer's step hook: ``recorder(step, model, optimizer)`` after every step (and at 0).

    Keeps the hashes and the per-segment update norms (of the model's floating tensors);
    writes each state to ``store`` when one is given.
    """

    def __init__(self, *, total_steps: int, every: int, precision: str = "fp32",
                 store: CheckpointStore | None = None, assignment_id: str = "",
                 feedback: Mapping[str, Tensor] | None = None) -> None:
        self.every = every
        self.feedback = feedback  # error feedback's residual: committed in the last state
        self.total_steps = total_steps
        self.precision = precision
        self.steps = checkpoint_steps(total_steps, every)
        self._wanted = set(self.steps)
        self.store = store
        self.assignment_id = assignment_id
        self.hashes: list[str] = []
        self.norms: list[float] = []
        self._prev: dict[str, Tensor] | None = None
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gpuflex-checkpoints")
        self._pending: list[concurrent.futures.Future[None]] = []

    def __call__(self, step: int, model: nn.Module, optimizer: LocalOptimizer,
                 scaler: LossScaler | None = None) -> None:
        if step in self._wanted:
            self.record(step, training_state(model, optimizer, step, scaler))  # a copy: training goes on

    def wants(self, step: int) -> bool:
        return step in self._wanted

    def record(self, step: int, state: dict[str, Tensor]) -> None:
        """Commit to ``state`` (protocol/checkpoint.py's layout, CPU), the state after ``step``."""
        if step == self.steps[-1] and self.feedback:
            state.update({f"{FEEDBACK_PREFIX}{k}": v.detach().to("cpu", copy=True) for k, v in self.feedback.items()})
        # Encoding, hashing, the norm and the write overlap the next steps (one writer, in order).
        self._pending.append(self._writer.submit(self._commit, step, state))

    def _commit(self, step: int, state: dict[str, Tensor]) -> None:
        data = canonical_bytes(state)
        self.hashes.append(sha256_hex(data))
        current = {k: v for k, v in state.items() if k.startswith("model.")}
        if self._prev is not None:
            self.norms.append(segment_norm(self._prev, current))
        self._prev = current
        if self.store is not None:
            self.store.write(self.assignment_id, step, data)

    def abandon(self) -> None:
        """Training stopped: let the writer finish what it has and go."""
        self._writer.shutdown(wait=True, cancel_futures=True)

    def commitment(self) -> Commitment:
        """The signed commitment's content, once every checkpoint is hashed and written."""
        for f in self._pending:
            f.result()  # re-raises a failed write
        self._pending.clear()
        self._writer.shutdown(wait=True)
        if len(self.hashes) != len(self.steps):
            raise TrainError(f"recorded {len(self.hashes)} checkpoints of {len(self.steps)}")
        return Commitment(every=self.every, steps=self.total_steps, precision=self.precision,
                          hashes=tuple(self.hashes), norms=tuple(self.norms))
