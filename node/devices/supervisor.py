"""The node's side of training on several devices: start one worker process per device, watch
them, and turn what rank 0 writes into the node's one ``TrainResult``.

The workers meet at a ``torch.distributed.TCPStore`` this process hosts on a free loopback port
(the port is the operating system's choice, so no two nodes race for one). A worker that dies
(``kill -9``, an out-of-memory kill, a crash) ends the attempt: the others are killed at once,
nothing is read from the folder, and the assignment is trained again from its start by fresh
workers, up to ``restarts`` times; then ``WorkersLost`` hands it back (the agent's abandon
path). The update exists only once every worker exited cleanly and rank 0's files are complete,
so a lost worker never leads to a half-made upload. A pause or an exit kills the workers
(``TrainingStopped``, as in one process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import torch
from gpuflex.protocol.messages import Assignment, TrainConfig
from gpuflex.protocol.modelspec import ModelSpec, update_manifest
from gpuflex.protocol.workload import assignment_steps
from torch import Tensor

from ..checkpoints import CheckpointStore
from ..errors import TrainError, TrainingStopped, WorkersLost
from ..trainer import TrainResult, loss_for, stack_chunks
from .job import (
    DATA,
    DELTA,
    FEEDBACK,
    STATE,
    CommitSettings,
    WorkerJob,
    read_result,
    read_tensors,
    write_tensors,
)
from .plan import (
    DevicePlan,
    check_offload,
    choose_engine,
    device_budget,
    parse_devices,
    training_bytes,
)

__all__ = ["WorkerGroup", "batch_statistics", "worker_group"]

#: a worker's exit status when its assignment cannot train (node/devices/worker.py): not retried
EXIT_TRAIN_ERROR = 4


class _Lost(Exception):
    """One attempt's worker died."""


def batch_statistics(state: Mapping[str, Tensor]) -> bool:
    """True when the model normalises by batch statistics (BatchNorm): a batch split over workers
    would normalise each slice by its own, so such a model trains in one process."""
    return any(k.endswith("running_mean") for k in state)


@dataclass
class WorkerGroup:
    """The node's devices, trained on together (``train``); one per node, reused per assignment."""

    plan: DevicePlan
    work_dir: Path  # the run folders (the node's data dir)
    max_memory_bytes: int | None = None
    threads: int = 1  # torch threads of the whole node on the CPU, shared out over CPU workers
    restarts: int = 1
    engine: str = "auto"  # auto (from the model's size), or ddp / fsdp
    on_event: Callable[..., None] | None = None
    timeout_s: float = 600.0
    compute_share: float = 1.0  # --compute-share: every worker rests after each step (node/computeshare.py)
    #: the most training state (bytes) a worker held on its device in the last assignment
    held_bytes: int = 0

    def choose(self, global_state: Mapping[str, Tensor], cfg: TrainConfig, spec: ModelSpec | None = None) -> str:
        if self.engine != "auto":
            return self.engine
        trained = None if spec is None else {t.name for t in update_manifest(spec)}  # LoRA: the adapters
        model_bytes, optimizer_bytes = training_bytes(global_state, cfg, trained)
        return choose_engine(model_bytes, optimizer_bytes, workers=self.plan.workers, offload=self.plan.offload,
                             budget=device_budget(self.plan, self.max_memory_bytes))

    def train(self, spec: ModelSpec, global_state: Mapping[str, Tensor], chunks: Sequence[Mapping[str, Tensor]],
              cfg: TrainConfig, seed: int, *, progress: Callable[[float], None] | None = None,
              should_stop: Callable[[], bool] | None = None, on_loss: Callable[[int, float], None] | None = None,
              commit: CommitSettings | None = None, feedback: Mapping[str, Tensor] | None = None) -> TrainResult:
        """Train one assignment on every device; the same contract as node/trainer.train_assignment."""
        loss_for(spec, cfg)  # a loss that does not fit the model is refused here, not in N workers
        x, y = stack_chunks(spec, chunks)
        engine = self.choose(global_state, cfg, spec)
        self.work_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        folder = Path(tempfile.mkdtemp(prefix="train-", dir=self.work_dir))
        try:
            write_tensors(folder / STATE, global_state)
            write_tensors(folder / DATA, {"x": x, "y": y})
            if feedback:
                write_tensors(folder / FEEDBACK, feedback)
            total = assignment_steps(int(x.shape[0]), cfg.batch_size, cfg.local_epochs, cfg.local_steps)
            job = WorkerJob(spec=spec.to_dict(), train=_fields(cfg), seed=seed, engine=engine,
                            devices=self.plan.names(), store_port=0, offload=self.plan.offload,
                            threads=max(1, self.threads // self.plan.workers), commit=commit,
                            timeout_s=self.timeout_s, compute_share=self.compute_share)
            watch = _Watch(total, progress, should_stop or (lambda: False), on_loss)
            for attempt in range(self.restarts + 1):
                try:
                    return self._attempt(folder, job, watch)
                except _Lost as exc:
                    self._event("workers_lost", detail=str(exc), attempt=attempt + 1,
                                action="retry" if attempt < self.restarts else "abandon")
                    if attempt == self.restarts:
                        raise WorkersLost(f"worker process lost: {exc}") from None
            raise AssertionError("unreachable")
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def train_assignment(self, assignment: Assignment, spec: ModelSpec, chunks: Sequence[Mapping[str, Tensor]],
                         global_state: Mapping[str, Tensor], *, checkpoints: CheckpointStore,
                         feedback: Mapping[str, Tensor] | None = None,
                         progress: Callable[[float], None] | None = None,
                         should_stop: Callable[[], bool] | None = None,
                         on_loss: Callable[[int, float], None] | None = None) -> TrainResult:
        """``train`` for a signed assignment, with its checkpoint commitment (rank 0 records it in
        ``checkpoints``, from the gathered full state) when the job asks for one."""
        commit = None
        if assignment.train.commit:
            samples = sum(int(c["x"].shape[0]) for c in chunks)
            total, every = checkpoints.prepare(assignment, samples)
            commit = CommitSettings(root=str(checkpoints.root), assignment_id=assignment.assignment_id,
                                    total_steps=total, every=every, precision=assignment.train.precision)
        return self.train(spec, global_state, chunks, assignment.train, assignment.seed, progress=progress,
                          should_stop=should_stop, on_loss=on_loss, commit=commit,
                          feedback=feedback if commit is not None else None)

    def _event(self, name: str, **fields: Any) -> None:
        if self.on_event is not None:
            self.on_event(name, **fields)

    def _attempt(self, folder: Path, job: WorkerJob, watch: _Watch) -> TrainResult:
        import torch.distributed as dist

        for name in (DELTA, "result.json"):
            (folder / name).unlink(missing_ok=True)
        store = dist.TCPStore("127.0.0.1", 0, job.world, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=job.timeout_s))
        job = dataclasses.replace(job, store_port=store.port)
        job.write(folder)
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(job.world):
                procs.append(_start(folder, rank))
            self._event("workers", engine=job.engine, devices=job.devices, pids=[p.pid for p in procs])
            reader = threading.Thread(target=watch.read, args=(procs[0].stdout,), daemon=True)
            reader.start()
            _supervise(procs, watch, folder)
            reader.join(timeout=5)
        finally:
            for p in procs:
                _end(p)
            del store
        body, commitment = read_result(folder)
        self.held_bytes = int(body.get("held_bytes", 0))
        delta = read_tensors(folder / DELTA)
        return TrainResult(delta=delta, sample_count=int(body["sample_count"]), loss=float(body["loss"]),
                           train_s=float(body["train_s"]), steps=int(body["steps"]), commitment=commitment)


def worker_group(devices: str, *, offload: str | None, work_dir: Path, max_memory_bytes: int | None,
                 threads: int, restarts: int = 1, compute_share: float = 1.0,
                 on_event: Callable[..., None] | None = None) -> tuple[torch.device, WorkerGroup | None]:
    """The node's first device and, when it trains on more than one (or offloads), its worker
    group; ConfigError, one line, for devices this machine lacks or an offload without room."""
    plan = parse_devices(devices, offload=offload)
    if plan.workers == 1 and not plan.offload:
        return plan.devices[0], None
    check_offload(plan, device_budget(plan, max_memory_bytes))
    group = WorkerGroup(plan, work_dir, max_memory_bytes=max_memory_bytes, threads=threads, restarts=restarts,
                        on_event=on_event, compute_share=compute_share)
    return plan.devices[0], group


@dataclass
class _Watch:
    """Rank 0's progress lines, turned into the trainer's callbacks; the node's stop flag."""

    total: int
    progress: Callable[[float], None] | None
    should_stop: Callable[[], bool]
    on_loss: Callable[[int, float], None] | None

    def read(self, stream: IO[bytes] | None) -> None:
        if stream is None:
            return
        with contextlib.suppress(ValueError, OSError):  # the stream closed under us: the attempt ended
            for line in stream:
                try:
                    d = json.loads(line)
                    step, loss = int(d["step"]), float(d["loss"])
                except (ValueError, KeyError, TypeError):
                    continue
                if self.progress is not None:
                    self.progress(step / max(self.total, 1))
                if self.on_loss is not None:
                    self.on_loss(step, loss)


def _fields(cfg: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _start(folder: Path, rank: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    log = open(folder / f"worker-{rank}.log", "wb")  # the child keeps its own copy; ours is closed below
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "gpuflex.node.devices.worker", str(folder), str(rank)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, stderr=log,
            env=env,
        )
    finally:
        log.close()


def _supervise(procs: Sequence[subprocess.Popen[bytes]], watch: _Watch, folder: Path) -> None:
    """Wait until every worker exited 0; raise at once when one dies or the node stops."""
    while True:
        if watch.should_stop():
            raise TrainingStopped("training stopped between batches")
        codes = [p.poll() for p in procs]
        failed = [(rank, rc) for rank, rc in enumerate(codes) if rc is not None and rc != 0]
        if failed:
            # a killed worker first: its peers then die of losing it, and may be seen in the same poll
            rank, rc = min(failed, key=lambda f: (f[1] >= 0, f[0]))
            tail = _log_tail(folder / f"worker-{rank}.log")
            if rc < 0:  # a signal; an abort (a C++ library's terminate) says why in its log first
                raise _Lost(f"worker {rank} ({procs[rank].pid}) killed by signal {-rc}"
                            + (f": {tail}" if tail and -rc != signal.SIGKILL else ""))
            if rc == EXIT_TRAIN_ERROR:
                raise TrainError(tail or f"worker {rank} could not train the assignment")
            raise _Lost(f"worker {rank} ({procs[rank].pid}) exited with status {rc}" + (f": {tail}" if tail else ""))
        if all(rc == 0 for rc in codes):
            return
        time.sleep(0.05)


def _end(p: subprocess.Popen[bytes]) -> None:
    """Stop a worker that still runs (its peers are gone) and reap it."""
    if p.poll() is None:
        p.kill()
    for stream in (p.stdin, p.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=10)


def _log_tail(path: Path) -> str:
    """The last line of a worker's stderr (its error), one line."""
    try:
        lines = [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " ".join(lines[-1].split())[:300] if lines else ""
