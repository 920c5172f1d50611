"""Assignments: issuing a node its signed share of a round, and the assignment's life until its
update is in (heartbeats that prove progress, abandon, expiry), with the blobs it lets the node read.

The scheduler (hub/domain/scheduler.py) decides which shard; hub/policy/progress.py how far a
heartbeat moves a deadline. Each use case writes through one store call before memory changes."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

from gpuflex.protocol.messages import Assignment, ChunkRef
from gpuflex.protocol.signing import SigningKey, seal

from ...base.config import HubConfig
from ...base.errors import Conflict, Forbidden, NotFound
from ...model.job import AssignmentState, new_id
from ...model.node import NodeState
from ...policy.progress import Progress, heartbeat_deadline, stall_backoff
from ...storage.store import Store
from ..metrics import HubMetrics
from ..scheduler import Plan, Scheduler
from ..worksignal import WorkSignal
from .registry import BANNED


@dataclass(frozen=True)
class Issued:
    """An assignment for a node: the signed bytes as sent, and the model it names."""

    sealed: bytes
    model_hash: str


class Assignments:
    """The live assignments' use cases. Holds what each live assignment last proved of its
    progress (heartbeats), which ends with the assignment (``release``, ``delivered``)."""

    def __init__(self, *, config: HubConfig, store: Store, key: SigningKey, scheduler: Scheduler,
                 signal: WorkSignal, metrics: HubMetrics) -> None:
        self.config = config
        self.store = store
        self.key = key
        self.scheduler = scheduler
        self.signal = signal
        self.metrics = metrics
        self._progress: dict[str, Progress] = {}  # live assignment id -> the last progress proved

    # -- issue ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def polling(self, node: NodeState) -> Iterator[None]:
        """The node waits for work while inside: it counts in the gathering a round is cut for."""
        self.scheduler.presence.poll_started(node.id)
        try:
            yield
        finally:
            self.scheduler.presence.poll_ended(node.id, time.time())

    async def next_assignment(self, node: NodeState, cached: frozenset[str]) -> Issued | None:
        """The node's live assignment if it still holds one, else a new one, else None."""
        node.last_seen = time.time()
        if node.banned:
            raise Forbidden(BANNED, code="banned")
        if node.suspended is not None:  # no new work, nor a held assignment handed out again
            return None
        held = [a for a in self.scheduler.live_for(node.id) if not a.uploading]
        if held:
            first = min(held, key=lambda a: a.issued_at)
            return Issued(first.sealed, first.model_hash)
        plan = self.scheduler.plan(node, cached)
        if plan is None:
            return None
        return await self._issue(node, plan)

    async def _issue(self, node: NodeState, plan: Plan) -> Issued:
        """Sign and store an assignment for `plan`; the row is committed before it is sent."""
        job, shard = plan.job, plan.shard
        chunks = job.chunks_at(shard.chunk_idxs)
        now = time.time()
        aid = new_id("a")
        msg = Assignment(
            assignment_id=aid, job_id=job.id, round=job.round, node_id=node.id, model_hash=job.model_hash,
            model_size=job.model_size, model_spec=job.spec.model.to_dict(),
            chunks=tuple(ChunkRef(sha256=c.sha, size=c.size, samples=c.samples) for c in chunks),
            seed=shard.seed, issued_at=now, deadline=plan.deadline,
            train=job.train_config(shard.samples, self.scheduler.presence.precision_for(job, node)),
            # Never the shard's replica group: a node that knew its work is checked could behave
            # only then.
            replica_group="",
        )
        sealed = seal(self.key, msg)
        a = AssignmentState(
            id=aid, shard_id=shard.id, job_id=job.id, round=job.round, node_id=node.id, issued_at=now,
            expected_s=plan.expected_s, deadline=plan.deadline, sealed=sealed, model_hash=job.model_hash,
            chunk_shas=frozenset(c.sha for c in chunks),
        )
        # Attached before the write so that a concurrent poll cannot be planned the same chunks;
        # taken back if the write fails.
        self.scheduler.attach(a, shard)
        try:
            await self.store.issue_assignment(a, shard if plan.new_shard else None, chunks)
        except BaseException:
            self.release(a)
            raise
        self.metrics.assignments_issued += 1
        return Issued(sealed, job.model_hash)

    # -- the live assignment -------------------------------------------------------------------
    def owned_live(self, node: NodeState, assignment_id: str) -> AssignmentState | None:
        """The live assignment ``assignment_id`` when it is ``node``'s; None when it is not live;
        403 when it is another node's."""
        a = self.scheduler.assignments.get(assignment_id)
        if a is not None and a.node_id != node.id:
            raise Forbidden("that assignment belongs to another node", code="not_your_assignment")
        return a

    async def closed_state(self, node: NodeState, assignment_id: str) -> str:
        """State of an assignment that is not live; 404 if unknown, 403 if someone else's."""
        fate = await self.store.assignment_fate(assignment_id)
        if fate is None:
            raise NotFound(f"no assignment {assignment_id}", code="unknown_assignment")
        if fate.node_id != node.id:
            raise Forbidden("that assignment belongs to another node", code="not_your_assignment")
        return fate.state

    def release(self, a: AssignmentState) -> None:
        """Forget a live assignment; its shard goes back to the pool if nobody else holds it."""
        self._progress.pop(a.id, None)
        shard = self.scheduler.detach(a)
        if shard is not None:
            self.scheduler.release_if_empty(shard)

    def delivered(self, a: AssignmentState, node: NodeState, now: float) -> None:
        """``a``'s update was accepted (and committed): the assignment ends, and its node, which
        delivered, is no longer stalled."""
        a.uploading = False
        self._progress.pop(a.id, None)
        node.stalls = 0
        self.scheduler.delivered(a, now)

    async def heartbeat(self, node: NodeState, assignment_id: str, steps: int = 0,
                        digest: bytes = b"") -> tuple[bool, str, float]:
        """(still live, detail, deadline): a live assignment's deadline moves on when the heartbeat
        proves new progress, within a bound (hub/policy/progress.py)."""
        a = self.owned_live(node, assignment_id)
        if a is None:
            state = await self.closed_state(node, assignment_id)
            return False, f"assignment is {state}; stop and ask for work", 0.0
        job = self.scheduler.jobs[a.job_id]
        now = time.time()
        train = job.spec.train
        window = max(self.config.min_deadline_s, a.expected_s * train.deadline_slack)
        shard = job.shards.get(a.shard_id)
        total = train.steps(shard.samples if shard is not None else 0)
        last = self._progress.get(a.id, Progress())
        new_deadline, detail = heartbeat_deadline(
            now=now, issued_at=a.issued_at, deadline=a.deadline, window_s=window, steps=steps,
            digest=digest if any(digest) else b"", last=last, total_steps=total,
            extension_max=self.config.progress_extension_max, max_assignment_s=self.config.max_assignment_s)
        if steps > last.steps and any(digest) and steps <= total:
            self._progress[a.id] = Progress(steps, bytes(digest))
        if new_deadline > a.deadline:
            await self.store.extend_deadline(a.id, new_deadline)
            a.deadline = new_deadline
        return True, detail, a.deadline

    async def abandon(self, node: NodeState, assignment_id: str) -> str:
        a = self.owned_live(node, assignment_id)
        if a is None:
            state = await self.closed_state(node, assignment_id)
            return f"assignment was already {state}"
        if a.uploading:
            raise Conflict("an update for this assignment is being uploaded", code="busy")
        await self.store.end_assignments([a.id], "abandoned")
        self.release(a)
        self.signal.offer()  # its chunks, for some waiting node
        return "abandoned; the shard goes back to the pool"

    async def expire_overdue(self, now: float) -> int:
        """Overdue assignments expire; their chunks go back to the pool."""
        expired = self.scheduler.expired(now)
        if not expired:
            return 0
        await self.store.end_assignments([a.id for a in expired], "expired")
        for a in expired:
            self.release(a)
            node = self.scheduler.nodes.get(a.node_id)
            if node is not None and node.updates_accepted == 0:
                # an unproven node held a shard and delivered nothing: others get the chunks first
                node.stalls += 1
                node.stall_until = now + stall_backoff(node.stalls, self.config.stall_backoff_s)
        self.metrics.assignments_expired += len(expired)
        if expired:
            self.signal.offer()  # their chunks, for the waiting nodes (the offer travels while they take work)
        return len(expired)

    # -- what a live assignment lets its node read ----------------------------------------------
    def may_read_blob(self, node: NodeState, sha: str) -> bool:
        """A node reads the model and the chunks of its live assignments, nothing else."""
        return any(a.model_hash == sha or sha in a.chunk_shas for a in self.scheduler.live_for(node.id))

    def delta_base_ok(self, node: NodeState, sha: str, base: str) -> bool:
        """May ``node`` have model ``sha`` as a delta from ``base``? Only when ``sha`` is the model of
        one of its live assignments and ``base`` an earlier model of that job (a delta from any
        other blob would let a node read what it was never sent)."""
        for a in self.scheduler.live_for(node.id):
            if a.model_hash == sha:
                job = self.scheduler.jobs.get(a.job_id)
                return job is not None and base != sha and base in job.models.values()
        return False

    def count_served(self, node: NodeState, sha: str, nbytes: int) -> None:
        """``nbytes`` of ``sha`` went to ``node``: they count for the round of the live assignment
        that names it (the round's bytes down, in its job status)."""
        for a in self.scheduler.live_for(node.id):
            if a.model_hash == sha or sha in a.chunk_shas:
                job = self.scheduler.jobs.get(a.job_id)
                if job is not None and job.round == a.round:
                    job.bytes_down += nbytes
                return
