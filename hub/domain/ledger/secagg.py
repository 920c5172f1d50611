"""Secure aggregation's steps, as the nodes of a round take them (hub/policy/secagg.py holds the
protocol; the round engine, hub/domain/rounds.py, moves it on when a step is in or its deadline
passed). The nodes' long-polls wait here for the protocol's next phase."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from gpuflex.protocol.messages import (
    SecAggKeys,
    SecAggMasked,
    SecAggShares,
    SecAggState,
    SecAggUnmask,
    UpdateHeader,
)

from ...base.config import HubConfig
from ...base.errors import Conflict, NotFound
from ...model.job import AssignmentState, JobState
from ...model.node import NodeState
from ...policy.secagg import SecAggRound
from ...storage.store import Store
from ..rounds import RoundEngine
from ..scheduler import Scheduler
from ..worksignal import WorkSignal
from .assignments import Assignments
from .uploads import Uploads


class SecureAggregation:
    """A member node's steps: its keys, its shares, its masked update (recorded as the shard's
    update, ``Uploads.accept_update``), its unmasking shares; and the long-poll for the next phase."""

    def __init__(self, *, config: HubConfig, store: Store, scheduler: Scheduler, signal: WorkSignal,
                 rounds: RoundEngine, assignments: Assignments, uploads: Uploads) -> None:
        self.config = config
        self.store = store
        self.scheduler = scheduler
        self.signal = signal
        self.rounds = rounds
        self.assignments = assignments
        self.uploads = uploads
        #: how long a long-poll waits before it pokes the engine again (a step's deadline); the
        #: engine's own changes wake it at once (``wait``)
        self.recheck_s = 1.0

    def _round(self, node: NodeState, assignment_id: str) -> tuple[AssignmentState | None, JobState, SecAggRound]:
        """The round protocol the node's assignment is in, and the assignment while it is live (a
        member's assignment is delivered once its masked update is in); 404/409 otherwise."""
        a = self.assignments.owned_live(node, assignment_id)
        if a is not None:
            job = self.scheduler.jobs.get(a.job_id)
            if job is None or job.secagg is None or job.round != a.round:
                raise Conflict("this assignment's round has no secure aggregation running", code="no_secagg")
            return a, job, job.secagg
        for job in self.scheduler.jobs.values():
            for sa in (job.secagg, job.secagg_last):
                if sa is not None and (m := sa.members.get(node.id)) is not None and m.assignment_id == assignment_id:
                    return None, job, sa
        raise NotFound(f"no live assignment or secure aggregation holds {assignment_id}", code="unknown_assignment")

    def _live(self, a: AssignmentState | None) -> AssignmentState:
        if a is None:
            raise Conflict("this assignment delivered its masked update already", code="secagg_phase")
        return a

    async def _keep_alive(self, job: JobState, a: AssignmentState) -> None:
        """A member's assignment lives through the protocol's steps (its training is done)."""
        deadline = time.time() + 5 * float(job.spec.privacy.secagg_phase_s)
        if deadline > a.deadline:
            await self.store.extend_deadline(a.id, deadline)
            a.deadline = deadline

    async def keys(self, node: NodeState, msg: SecAggKeys) -> SecAggState:
        a, job, sa = self._round(node, msg.assignment_id)
        a = self._live(a)
        sa.add_keys(node.id, a.id, bytes(msg.c_pk), bytes(msg.s_pk))
        await self._keep_alive(job, a)
        self._moved(job)
        return sa.state_for(node.id, a.id)

    def state(self, node: NodeState, assignment_id: str) -> SecAggState:
        _, job, sa = self._round(node, assignment_id)
        self.rounds.poke(job.id)  # a step may have timed out: the engine moves it on
        return sa.state_for(node.id, assignment_id)

    def _moved(self, job: JobState) -> None:
        """A member's step is in: the engine moves the protocol on, and the members' long-polls
        (``wait``) look again."""
        self.rounds.poke(job.id)
        self.rounds.secagg_moved.fire()

    async def wait(self, node: NodeState, assignment_id: str, after: str, wait_s: float) -> SecAggState:
        """The node's SecAggState once its phase is no longer ``after`` (at once when ``after`` is
        empty), or after ``wait_s`` (capped by the hub's long-poll limit) or at shutdown. Wakes on the
        engine's ``secagg_moved``, and looks again every ``recheck_s`` at the latest, so that the
        engine moves a step whose deadline passed (``state`` pokes it)."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + min(max(wait_s, 0.0), float(self.config.long_poll_max_s))
        while True:
            moved = self.rounds.secagg_moved.event  # before looking: a change after this wakes us
            st = self.state(node, assignment_id)
            left = give_up - loop.time()
            if not after or st.phase != after or left <= 0 or self.signal.closing:
                return st
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(moved.wait(), min(left, self.recheck_s))

    async def shares(self, node: NodeState, msg: SecAggShares) -> SecAggState:
        a, job, sa = self._round(node, msg.assignment_id)
        a = self._live(a)
        sa.add_shares(node.id, a.id, msg.shares)
        await self._keep_alive(job, a)
        self._moved(job)
        return sa.state_for(node.id, a.id)

    def may_mask(self, node: NodeState, hdr: SecAggMasked) -> tuple[AssignmentState, JobState, SecAggRound]:
        """Before the body is read: is this masked update expected, and of that size?"""
        a, job, sa = self._round(node, hdr.assignment_id)
        a = self._live(a)
        sa.may_mask(node.id, a.id, hdr.size)
        return a, job, sa

    async def masked(self, node: NodeState, hdr: SecAggMasked, vector: Any) -> SecAggState:
        """The masked update's blob is stored (durably): record it as the shard's update (with
        its plain figures: samples, loss, time) and hand the vector to the protocol."""
        a, job, sa = self.may_mask(node, hdr)
        await self.uploads.accept_update(node, a, job, UpdateHeader(
            assignment_id=a.id, update_sha256=hdr.sha256, update_size=hdr.size, sample_count=hdr.sample_count,
            metrics={"loss": hdr.loss}, timings={"train_s": hdr.train_s}, timestamp=hdr.timestamp,
            nonce=hdr.nonce))
        sa.add_masked(node.id, a.id, vector)
        self._moved(job)
        return sa.state_for(node.id, a.id)

    def unmask(self, node: NodeState, msg: SecAggUnmask) -> SecAggState:
        _, job, sa = self._round(node, msg.assignment_id)
        sa.add_unmask(node.id, msg.assignment_id, msg.shares)
        self._moved(job)
        return sa.state_for(node.id, msg.assignment_id)
