"""A pipeline stage the hub hands this node: the node's checks on the signed StageAssignment, the
hub as the stage's ``StageHub`` (node/pipeline/worker.py), and the run itself.

The protocol checked the signature (the pinned hub key) and every field's type and bounds; here
are the checks only the node can make: it is for this node, its fields agree with each other (the
stage is one of the plan's, the unit range is the stage's share of the model's units, the
micro-batches divide the batch, the steps run forward, unit states exactly when resuming), the
node trains its precision, and it is not a stage already run. Then the stage runs in a worker
thread (its compute blocks), while the agent's event loop keeps answering heartbeats and the
control endpoint, and carries the stage's calls to the hub.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import mmap
import time
from collections.abc import Awaitable, Container, Sequence
from typing import Any, Protocol, TypeVar

import torch
from gpuflex.protocol.boundary import check_boundary
from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.messages import (
    Ack,
    ComputeClass,
    StageAssignment,
    StageReport,
    UnitCheckpoint,
)
from gpuflex.protocol.modelspec import ModelSpec
from gpuflex.protocol.pipeline import lane_counts, lane_place, pipeline_units
from gpuflex.protocol.signing import new_nonce
from gpuflex.protocol.tensors import Buffer

from .cache import BlobCache
from .client import Backoff, HubClient
from .errors import (
    AssignmentRejected,
    BlobError,
    HubError,
    HubUnavailable,
    PipelineError,
    StaleGeneration,
)
from .output import Output
from .pause import PauseState
from .pipeline.relay import RelayTransport
from .pipeline.unitstate import stage_starts_ok
from .pipeline.worker import StageOutcome, StageWorker
from .stagelinks import stage_links
from .transfers import Transfers

T = TypeVar("T")

#: the precisions a pipeline stage trains in (its master weights and what crosses are float32)
STAGE_PRECISIONS = ("fp32", "tf32")
#: how long a report or a checkpoint is offered to a hub that does not answer
HUB_PATIENCE_S = 60.0


def stage_line(a: StageAssignment) -> str:
    """``stage 1 of 4 (units 2-3) of job J, steps 20-99``: what the node says it runs (with
    ``of pipeline 1 of 2`` when pipelines share the steps)."""
    try:
        place = lane_place(a.stage_starts, a.lanes, a.stage)
    except ValueError:
        return f"stage {a.stage} of job {a.job_id} (a plan this node refuses)"
    lanes = f" of pipeline {place.lane} of {a.lanes}" if a.lanes > 1 else ""
    return (
        f"stage {place.stage} of {place.stages}{lanes} (units {a.unit_start}-{a.unit_end - 1})"
        f" of job {a.job_id}, steps {a.first_step}-{a.end_step - 1}"
    )


def check_stage_assignment(
    a: StageAssignment,
    *,
    node_id: str,
    precisions: Sequence[str] = ("fp32",),
    seen: Container[tuple[str, int, int]] = frozenset(),
) -> ModelSpec:
    """The stage's model spec when every check passes; AssignmentRejected in one line otherwise.
    ``seen``: the (job, generation, stage) this node already ran (the same again is a replay)."""
    what = f"stage assignment for job {a.job_id} generation {a.generation}"
    if a.node_id != node_id:
        raise AssignmentRejected(f"{what} is for {a.node_id}, not this node")
    if (a.job_id, a.generation, a.stage) in seen:
        raise AssignmentRejected(f"{what} stage {a.stage} was already run (replay)")
    stages = len(a.stage_starts)
    if not (a.stage < len(a.stage_nodes) == len(a.stage_keys) == stages):
        raise AssignmentRejected(
            f"{what}: stage {a.stage} of {len(a.stage_nodes)} nodes, {len(a.stage_keys)} keys and "
            f"{stages} stage starts"
        )
    if a.stage_nodes[a.stage] != node_id:
        raise AssignmentRejected(
            f"{what}: its plan gives stage {a.stage} to {a.stage_nodes[a.stage]}"
        )
    try:
        spec = ModelSpec.from_dict(a.model_spec)
        units = len(pipeline_units(spec))
    except ProtocolError as exc:
        raise AssignmentRejected(f"{what}: model spec refused: {exc}") from exc
    try:
        place = lane_place(a.stage_starts, a.lanes, a.stage)
    except ValueError as exc:
        raise AssignmentRejected(f"{what}: {exc}") from None
    bounds = [*place.starts, units]
    if not stage_starts_ok(place.starts, units) or (a.unit_start, a.unit_end) != (
        bounds[place.stage],
        bounds[place.stage + 1],
    ):
        raise AssignmentRejected(
            f"{what}: units {a.unit_start}-{a.unit_end - 1} are not stage {a.stage} of a "
            f"{units}-unit model cut at {list(a.stage_starts)}"
        )
    _check_lanes(a, what, place.lane)
    _check_steps(a, what, reads_data=place.stage in (0, place.stages - 1))
    if a.train.precision not in STAGE_PRECISIONS or a.train.precision not in precisions:
        raise AssignmentRejected(
            f"{what} asks for precision {a.train.precision}; a pipeline stage on this node trains "
            f"in {', '.join(p for p in STAGE_PRECISIONS if p in precisions) or 'none'}"
        )
    if a.train.grad_clip > 0:
        raise AssignmentRejected(
            f"{what} asks for gradient clipping, which a pipeline stage cannot do alone (the norm "
            "spans every stage)"
        )
    try:  # each cut's width is checked when the stage is built (its shapes come from a meta run)
        check_boundary(a.boundary, a.boundary_rank)
    except ProtocolError as exc:
        raise AssignmentRejected(f"{what}: {exc}") from None
    return spec


def _check_lanes(a: StageAssignment, what: str, lane: int) -> None:
    counts = lane_counts(a.micro_batches, a.lanes, a.lane_micro_batches)
    if len(counts) != a.lanes or counts[lane] != a.micro_batches:
        raise AssignmentRejected(
            f"{what}: micro-batch counts {list(counts)} for {a.lanes} pipeline(s) do not give"
            f" pipeline {lane} its {a.micro_batches}"
        )
    if a.batch_size % sum(counts):
        raise AssignmentRejected(
            f"{what}: {sum(counts)} micro-batches"
            + (f" ({a.lanes} pipelines)" if a.lanes > 1 else "")
            + f" do not divide the batch of {a.batch_size}"
        )


def _check_steps(a: StageAssignment, what: str, *, reads_data: bool) -> None:
    if a.end_step <= a.first_step:
        raise AssignmentRejected(f"{what}: steps {a.first_step} up to {a.end_step} run backwards")
    held = sorted(s.unit for s in a.unit_states)
    if a.first_step == 0 and held:
        raise AssignmentRejected(f"{what}: step 0 starts from the model, yet it names unit states")
    if a.first_step > 0 and held != list(range(a.unit_start, a.unit_end)):
        raise AssignmentRejected(
            f"{what}: resuming at step {a.first_step} needs the states of units "
            f"{a.unit_start}-{a.unit_end - 1}, it names {held}"
        )
    if reads_data != bool(a.chunks):
        raise AssignmentRejected(
            f"{what}: stage {a.stage} {'needs' if reads_data else 'reads no'} chunks, it names "
            f"{len(a.chunks)}"
        )


class HubStage:
    """The hub as a stage's ``StageHub``: blocking calls from the stage's thread, carried out on
    the agent's event loop ``loop``. Blobs come through the node's cache (downloaded into it
    when missing); a report or a checkpoint is offered again, freshly signed, while the hub
    is unreachable or busy (429, 5xx) for up to ``patience_s``."""

    def __init__(
        self,
        client: HubClient,
        transfers: Transfers,
        cache: BlobCache,
        loop: asyncio.AbstractEventLoop,
        *,
        patience_s: float = HUB_PATIENCE_S,
        backoff_base_s: float = 0.5,
    ) -> None:
        self.client = client
        self.transfers = transfers
        self.cache = cache
        self.loop = loop
        self.patience_s = patience_s
        self.backoff_base_s = backoff_base_s
        self.fetched = 0

    def _call(self, aw: Awaitable[T]) -> T:
        async def run() -> T:
            return await aw

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result()

    def blob(self, sha256: str, size: int) -> Buffer:
        cache = self.cache
        try:
            if not (cache.has(sha256, size) and cache.verify(sha256)):
                self.fetched += self._call(self.transfers.download(self.client, sha256, size))
            with open(cache.touch(sha256), "rb") as handle:
                return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (HubError, HubUnavailable, BlobError, OSError, ValueError) as exc:
            raise PipelineError(f"blob {sha256[:12]}… cannot be had: {exc}") from None

    def keep(self, sha256: str, body: bytes) -> None:
        if self.cache.has(sha256, len(body)):
            self.cache.touch(sha256)
            return
        try:
            writer = self.cache.writer(sha256, len(body), resume=False)
            writer.write(body)
            writer.commit()
        except (BlobError, OSError) as exc:
            raise PipelineError(f"the unit state {sha256[:12]}… cannot be cached: {exc}") from None

    def checkpoint(self, header: UnitCheckpoint, body: bytes) -> None:
        ack = self._offer(header, lambda h: self.client.stage_message(h, body), "unit checkpoint")
        if not ack.ok:  # taken, yet the hub says the generation is over
            raise StaleGeneration(f"unit checkpoint: the hub ended this generation: {ack.detail}")

    def report(self, report: StageReport) -> bool:
        return self._offer(report, self.client.stage_message, "stage report").ok

    def _offer(self, msg: Any, send: Any, what: str) -> Ack:
        """``send(msg)`` until the hub answers; each try signed afresh (the hub refuses replays)."""
        backoff = Backoff(self.backoff_base_s, 10.0)
        give_up = time.monotonic() + self.patience_s
        while True:
            fresh = dataclasses.replace(msg, timestamp=self.client.now(), nonce=new_nonce())
            try:
                ack: Ack = self._call(send(fresh))
                return ack
            except HubUnavailable as exc:
                if time.monotonic() >= give_up:
                    raise PipelineError(f"{what}: the hub did not answer: {exc}") from None
                time.sleep(backoff.next_delay())
            except HubError as exc:
                if exc.code == "stale_generation":
                    raise StaleGeneration(f"{what}: {exc}") from None
                raise PipelineError(f"{what} refused: {exc}") from None


class StageHost(Protocol):
    """What a stage's run reads and updates of the node (node/agent.NodeAgent)."""

    state: str
    node_id: str
    device: torch.device
    compute: ComputeClass
    output: Output
    transfers: Transfers
    cache: BlobCache
    pause_state: PauseState
    seen_stages: set[tuple[str, int, int]]
    stage_in_hand: StageAssignment | None
    compute_share: float

    def _client(self) -> HubClient: ...


async def take_stage(host: StageHost, a: StageAssignment) -> bool:
    """Check the stage the hub handed the node and run it; whether it ran to its last step.
    AssignmentRejected, in one line, when a check fails (nothing is downloaded)."""
    check_stage_assignment(
        a, node_id=host.node_id, precisions=host.compute.precisions, seen=host.seen_stages
    )
    host.seen_stages.add((a.job_id, a.generation, a.stage))
    host.pause_state.new_assignment()
    host.stage_in_hand = a
    try:
        outcome = await run_stage(host, a, should_stop=host.pause_state.stop_training.is_set)
    finally:
        host.stage_in_hand = None
        with contextlib.suppress(OSError):
            host.cache.evict()
    return outcome.ended == "done"


async def run_stage(host: StageHost, a: StageAssignment, *, should_stop: Any) -> StageOutcome:
    """Run the checked stage ``a`` in a worker thread; how it ended. Says a line when it starts
    and one when it ends."""
    client = host._client()
    host.state = "stage"
    host.output.event(
        "stage",
        detail=stage_line(a),
        job_id=a.job_id,
        generation=a.generation,
        stage=a.stage,
        first_step=a.first_step,
        end_step=a.end_step,
    )
    links = stage_links(
        a,
        lambda: RelayTransport(
            client.base_url,
            client.key,
            a.job_id,
            hub_public_key=client.hub_public_key,
            peers=dict(enumerate(a.stage_keys)),
            clock=client.now,
            generation=a.generation,
        ),
        key=client.key,
    )
    transport = links.transport
    hub = HubStage(client, host.transfers, host.cache, asyncio.get_running_loop())
    worker = StageWorker(
        a,
        hub=hub,
        transport=transport,
        device=host.device,
        should_stop=should_stop,
        clock=client.now,
        compute_share=host.compute_share,
    )
    try:
        outcome = await asyncio.to_thread(worker.run)
    finally:
        await asyncio.to_thread(links.close)  # a send on its way may take a while
    detail = (
        f"stage {a.stage} of job {a.job_id} generation {a.generation}: {outcome.ended} after "
        f"{outcome.steps_done} steps" + (f" ({outcome.detail})" if outcome.detail else "")
    )
    host.output.event(
        "stage_ended",
        detail=detail[:400],
        job_id=a.job_id,
        generation=a.generation,
        stage=a.stage,
        ended=outcome.ended,
        steps_done=outcome.steps_done,
        fetched_bytes=hub.fetched,
    )
    return outcome


__all__ = [
    "STAGE_PRECISIONS",
    "HubStage",
    "StageHost",
    "check_stage_assignment",
    "run_stage",
    "stage_line",
    "take_stage",
]
