"""Update uploads: checking an update's header against its assignment, holding the assignment
while the bytes stream in, and accepting the stored update.

Whether a lone update settles its shard at once is hub/policy/settlement.py's decision; this
room records it in the same transaction as the update and applies it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from gpuflex.protocol.messages import UpdateHeader

from ...base.config import HubConfig
from ...base.errors import BadRequest, Conflict, Forbidden, LengthRequired, NotFound
from ...model.job import AssignmentState, JobState, ShardState, UpdateState
from ...model.node import NodeState
from ...policy.referee import commitment_refusal
from ...policy.settlement import Settlement, settle_at_upload
from ...storage.store import Store
from ..metrics import HubMetrics
from ..rounds import RoundEngine
from ..scheduler import Scheduler
from .assignments import Assignments


class Uploads:
    """The upload of an update, from its header (``begin_upload``) to its record
    (``accept_update``); the round engine hears of every accepted update."""

    def __init__(self, *, config: HubConfig, store: Store, scheduler: Scheduler, metrics: HubMetrics,
                 rounds: RoundEngine, assignments: Assignments) -> None:
        self.config = config
        self.store = store
        self.scheduler = scheduler
        self.metrics = metrics
        self.rounds = rounds
        self.assignments = assignments

    async def begin_upload(self, node: NodeState, hdr: UpdateHeader,
                           content_length: int | None) -> tuple[AssignmentState, JobState]:
        """Check an update's header against its assignment and hold the assignment for the upload
        (`end_upload` or `accept_update` lets go)."""
        a = self.assignments.owned_live(node, hdr.assignment_id)
        if a is None:
            fate = await self.store.assignment_fate(hdr.assignment_id)
            if fate is None:
                raise NotFound(f"no assignment {hdr.assignment_id}", code="unknown_assignment")
            if fate.node_id != node.id:
                raise Forbidden("that assignment belongs to another node", code="not_your_assignment")
            if fate.update_id is not None:
                raise Conflict("an update for this assignment was already accepted", code="duplicate_update")
            raise Conflict(f"assignment is {fate.state}; the update came too late", code="late_update")
        if a.uploading:
            raise Conflict("an update for this assignment is already being uploaded", code="duplicate_update")
        job = self.scheduler.jobs[a.job_id]
        shard = job.shards.get(a.shard_id)
        if shard is not None:  # else the round moved on: accept_update says so
            refused = commitment_refusal(hdr.commitment, required=job.spec.verification.asks_referee(),
                                         steps=job.spec.train.steps(shard.samples))
            if refused is not None:  # before any byte: the assignment stays live for a committed upload
                raise BadRequest(refused[1], code=refused[0])
        if content_length is None:
            raise LengthRequired("send the update with a Content-Length header", code="length_required")
        if hdr.offset > hdr.update_size:
            raise BadRequest(f"offset {hdr.offset} is past update_size {hdr.update_size}", code="size_mismatch")
        if content_length != hdr.update_size - hdr.offset:
            raise BadRequest(f"Content-Length {content_length} differs from update_size - offset"
                             f" ({hdr.update_size - hdr.offset})", code="size_mismatch")
        a.uploading = True
        return a, job

    def upload_target(self, node: NodeState, hdr: UpdateHeader) -> AssignmentState:
        """The live assignment an interrupted upload of ``node`` was for (POST /v1/updates/offset)."""
        a = self.assignments.owned_live(node, hdr.assignment_id)
        if a is None:
            theirs = self.scheduler.assignments.get(hdr.assignment_id)
            if theirs is not None:
                raise Forbidden("that assignment belongs to another node", code="not_your_assignment")
            raise NotFound(f"no live assignment {hdr.assignment_id}", code="unknown_assignment")
        if a.uploading:
            raise Conflict("an upload of this update is still in progress", code="busy")
        return a

    def stale_partials(self, held: Sequence[tuple[str, Path]]) -> list[Path]:
        """Of the interrupted uploads the blob store holds, those whose assignment is over."""
        return [path for aid, path in held if aid not in self.scheduler.assignments]

    @staticmethod
    def end_upload(a: AssignmentState) -> None:
        a.uploading = False

    async def accept_update(self, node: NodeState, a: AssignmentState, job: JobState,
                            hdr: UpdateHeader) -> UpdateState:
        """The update's blob is stored (durably): record it, and settle its shard when the policy
        says a lone update stands for it now (one transaction). Raises Conflict when the round
        moved on."""
        if a.id not in self.scheduler.assignments or job.round != a.round or job.state != "running":
            raise Conflict("the round closed while the update was uploading", code="late_update")
        shard = job.shards.get(a.shard_id)
        if shard is None:
            raise Conflict("the shard of this assignment is no longer open", code="late_update")
        now = time.time()
        upd = UpdateState(
            id="u-" + a.id.removeprefix("a-"), assignment_id=a.id, shard_id=shard.id, node_id=node.id,
            sha=hdr.update_sha256, size=hdr.update_size, sample_count=hdr.sample_count,
            loss=float(hdr.metrics["loss"]), train_s=float(hdr.timings["train_s"]), received_at=now,
            elapsed_s=now - a.issued_at, commitment=hdr.commitment,
        )
        before = (node.ema_sps, node.updates_accepted, node.proven_chunks)
        self.scheduler.presence.observe_throughput(node, job.spec.train.processed(shard.samples), now - a.issued_at,
                                          self.config.throughput_alpha, self.scheduler.presence.precision_factor(job, node))
        self.scheduler.presence.count_delivery(node, shard)
        first = shard.first_update_at is None
        decision = self._settlement(job, shard, node)
        try:
            await self.store.accept_update(upd, job_id=job.id, round=a.round, metrics=dict(hdr.metrics),
                                           timings=dict(hdr.timings), node=node, first_update=first,
                                           settles=decision.settles)
        except BaseException:
            node.ema_sps, node.updates_accepted, node.proven_chunks = before
            raise
        self.assignments.delivered(a, node, now)
        shard.accepted.append(upd)
        if first:
            shard.first_update_at = now
        if decision.settles:
            shard.state = "settled"
            shard.representative = upd.id
        self.metrics.updates_accepted += 1
        self.rounds.poke(job.id)
        return upd

    def _settlement(self, job: JobState, shard: ShardState, node: NodeState) -> Settlement:
        """The policy's decision on ``shard`` as ``node``'s update of it arrives, from the shard as
        it stands before the update is added."""
        return settle_at_upload(wanted=shard.wanted, accepted=len(shard.accepted), shard_state=shard.state,
                                trend_measured=job.trend_base() is not None, reputation=node.reputation_at(time.time()),
                                spec=job.spec.verification, spot_draw=self.rounds.spot_draw(job.id, shard.id))
