"""One assignment's journey once it is checked: download, read the inputs, train, then upload
(in the clear, or masked for secure aggregation). ``NodeAgent._handle`` runs it and turns its
errors into hand-backs; the agent's overridable steps (``train``, ``transform_update``,
``encode_update``) are called through the agent, so misbehaving test nodes still reach them."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gpuflex.protocol.encoding import Encoded
from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.messages import Assignment
from gpuflex.protocol.modelspec import ModelSpec
from gpuflex.protocol.tensors import check_finite
from gpuflex.protocol.workload import samples_processed
from torch import Tensor

from . import secagg_flow
from .assignment import load_inputs
from .cache import BlobCache
from .client import HubClient
from .errors import TrainError, TrainingStopped
from .feedback import FeedbackStore
from .output import Output
from .pause import PauseState
from .silos import SiloStore
from .totals import Totals
from .trainer import TrainResult
from .transfers import Transfers

__all__ = ["AssignmentRun", "Current", "RunHost"]


@dataclass
class Current:
    """The assignment in hand, as the status endpoint shows it."""

    assignment: Assignment
    spec: ModelSpec
    phase: str = "verifying"  # verifying|downloading|training|uploading
    progress: float = 0.0
    steps: int = 0  # optimizer steps so far, and the running digest over them (heartbeats prove progress)
    digest: bytes = bytes(32)
    deadline: float = 0.0
    samples: int = 0
    started: float = field(default_factory=time.time)
    stop_reason: str = ""
    #: error feedback's residual this update adds (node/feedback.py); the last checkpoint commits it
    residual: dict[str, Tensor] | None = None



class RunHost(Protocol):
    """What a run reads and updates of the node that runs it (node/agent.NodeAgent), and the
    node's overridable steps."""

    state: str
    current: Current | None
    node_id: str
    last_samples_per_s: float
    seen_assignments: set[str]
    output: Output
    transfers: Transfers
    pause_state: PauseState
    cache: BlobCache
    silos: SiloStore
    feedback: FeedbackStore

    @property
    def totals(self) -> Totals: ...
    @property
    def stop_training(self) -> threading.Event: ...
    def _client(self) -> HubClient: ...
    async def _reregister(self) -> bool: ...
    def train(self, assignment: Assignment, chunks: Sequence[Mapping[str, Tensor]],
              global_state: Mapping[str, Tensor]) -> TrainResult: ...
    def transform_update(self, assignment: Assignment, result: TrainResult) -> TrainResult: ...
    def encode_update(self, assignment: Assignment, result: TrainResult,
                      residual: Mapping[str, Tensor] | None) -> Encoded: ...



@dataclass
class AssignmentRun:
    agent: RunHost
    a: Assignment
    spec: ModelSpec
    local: frozenset[str]
    cur: Current
    fetched: int = 0
    download_s: float = 0.0

    async def run(self, inline_model: bytes | None) -> bool:
        """Download, train and upload; True once the update is sent (or refused by the hub)."""
        global_state, chunks = await self._inputs(inline_model)
        result, processed = await self._train(chunks, global_state)
        if self.a.train.secagg:  # the update leaves masked (node/secagg_flow.py), never in the clear
            return await self._upload_masked(result, processed)
        return await self._upload(result, processed)

    def _phase(self, phase: str) -> None:
        self.cur.phase = phase
        self.agent.state = phase

    async def _inputs(self, inline_model: bytes | None) -> tuple[dict[str, Tensor], list[dict[str, Tensor]]]:
        agent, a = self.agent, self.a
        self._phase("downloading")
        t0 = time.perf_counter()
        if inline_model is not None:
            await agent.transfers.accept_inline_model(a, inline_model)
        self.fetched = await agent.pause_state.interruptible(
            agent.transfers.fetch_all(agent._client(), a, local=self.local))
        self.download_s = time.perf_counter() - t0
        global_state, chunks = await asyncio.to_thread(
            functools.partial(load_inputs, agent.cache, a, self.spec, silos=agent.silos, local=self.local))
        if a.train.error_feedback:
            shapes = {k: tuple(v.shape) for k, v in global_state.items() if v.is_floating_point()}
            self.cur.residual = await asyncio.to_thread(agent.feedback.load, a.job_id, shapes)
        return global_state, chunks

    async def _train(self, chunks: Sequence[Mapping[str, Tensor]],
                     global_state: Mapping[str, Tensor]) -> tuple[TrainResult, int]:
        """The agent's ``train`` in a worker thread, checked finite; the samples it processed."""
        agent, a = self.agent, self.a
        self._phase("training")
        agent.output.progress_start(f"training {a.assignment_id[:12]} r{a.round}")
        if agent.stop_training.is_set():
            raise TrainingStopped("stopped before training")
        try:
            result = await asyncio.to_thread(agent.train, a, chunks, global_state)
        finally:
            agent.output.progress_stop()
        try:
            check_finite(result.delta)
        except ProtocolError as exc:
            raise TrainError(f"training diverged: {exc}") from exc
        processed = samples_processed(result.sample_count, a.train.batch_size, a.train.local_epochs,
                                      a.train.local_steps)
        agent.last_samples_per_s = processed / max(result.train_s, 1e-9)
        agent.output.event(
            "trained", assignment_id=a.assignment_id, loss=result.loss, train_s=round(result.train_s, 4),
            steps=result.steps, samples_per_s=round(agent.last_samples_per_s, 1),
        )
        return agent.transform_update(a, result), processed

    def _count(self, result: TrainResult, processed: int) -> None:
        totals = self.agent.totals
        totals.uploaded += 1
        totals.samples_trained += processed
        totals.train_s += result.train_s

    async def _upload_masked(self, result: TrainResult, processed: int) -> bool:
        agent, a = self.agent, self.a
        self._phase("uploading")
        outcome = await secagg_flow.take_part(agent._client(), agent.node_id, a, result.delta,
                                              sample_count=result.sample_count, loss=result.loss,
                                              train_s=result.train_s)
        agent.seen_assignments.add(a.assignment_id)
        if outcome.phase == "unmasked":
            self._count(result, processed)
        agent.output.event("uploaded", assignment_id=a.assignment_id, update_sha256=outcome.sha256,
                           bytes=outcome.size, ok=outcome.phase == "unmasked", masked=True,
                           detail=outcome.detail or "secure aggregation: the hub sums the masked updates",
                           fetched_bytes=self.fetched)
        return True

    async def _upload(self, result: TrainResult, processed: int) -> bool:
        agent, a = self.agent, self.a
        try:
            encoded = await asyncio.to_thread(agent.encode_update, a, result, self.cur.residual)
        except ProtocolError as exc:
            raise TrainError(f"cannot encode the update as {a.train.update}: {exc}") from exc
        self._phase("uploading")
        sent = await agent.transfers.upload(
            agent._client(), a, dataclasses.replace(result, delta=encoded.wire), download_s=self.download_s,
            deadline=lambda: agent.current.deadline if agent.current else a.deadline,
            reregister=agent._reregister,
        )
        if sent is not None:
            agent.seen_assignments.add(a.assignment_id)  # done: the same one again is a replay
            if encoded.residual is not None and sent.ack.ok:  # only an accepted update moves it on
                await asyncio.to_thread(agent.feedback.save, a.job_id, encoded.residual)
            self._count(result, processed)
            agent.output.event(
                "uploaded", assignment_id=a.assignment_id, update_sha256=sent.sha256, bytes=sent.size,
                ok=sent.ack.ok, detail=sent.ack.detail, fetched_bytes=self.fetched,
            )
        return True
