"""The scheduler: who trains what next.

Each work request gets, in this order of preference:
1. a replica of a shard that still needs one (never twice to the same node; which node may take
   one: hub/domain/replicas.py),
2. a new shard carved from the chunks the round still needs: the node's share of them, in
   proportion to its throughput, among the nodes that want work now (hub/domain/sizing.py),
3. nothing ("retry after").

Jobs share nodes fairly: the job with the fewest live assignments goes first. A pipelined job
(``[pipeline]``) gets no shard: its stages are hub/domain/pipelines/'s. A node never gets
work of a job whose precision it cannot train (hub/domain/presence.py: who is online, who wants
work, how fast a node trains a job).
The scheduler holds the work queue (jobs, live assignments) and the collaborators it asks:
`presence`, `replicas`, `sizing`. All state here lives on the event loop; the ledger persists what
it returns.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from ..model.job import AssignmentState, JobState, ShardState
from ..model.node import NodeState
from .presence import Presence
from .replicas import Replicas
from .sizing import ShardSizing


@dataclass(frozen=True)
class Plan:
    """What the scheduler decided; the caller signs and persists it."""

    job: JobState
    shard: ShardState
    new_shard: bool
    expected_s: float
    deadline: float


class Scheduler:
    def __init__(
        self,
        *,
        min_deadline_s: float,
        online_window_s: float,
        rng: random.Random | None = None,
        gather_s: float = 2.0,
        separate_replicas: bool = False,
        trust_min_age_s: float = 0.0,
        unproven_max_chunks: int = 0,
    ) -> None:
        self.jobs: dict[str, JobState] = {}
        self.nodes: dict[str, NodeState] = {}
        self.assignments: dict[str, AssignmentState] = {}
        self.min_deadline_s = min_deadline_s
        self.presence = Presence(
            self.nodes,
            online_window_s=online_window_s,
            gather_s=gather_s,
            trust_min_age_s=trust_min_age_s,
        )
        self.replicas = Replicas(
            self.presence, rng=rng or random.Random(0), separate_replicas=separate_replicas
        )
        self.sizing = ShardSizing(
            self.presence, self.replicas, unproven_max_chunks=unproven_max_chunks
        )

    # -- bookkeeping ---------------------------------------------------------------------
    def add_job(self, job: JobState) -> None:
        self.jobs[job.id] = job
        job.live_n = 0
        for shard in job.shards.values():
            job.live_n += len(shard.live)
            for a in shard.live.values():
                self.assignments[a.id] = a
                node = self.nodes.get(a.node_id)
                if node is not None:
                    node.live.add(a.id)

    def in_flight(self) -> int:
        return len(self.assignments)

    def live_for(self, node_id: str) -> list[AssignmentState]:
        node = self.nodes.get(node_id)
        if node is None:
            return []
        return [self.assignments[a] for a in node.live if a in self.assignments]

    def deadline_for(self, job: JobState, expected_s: float, now: float) -> float:
        return now + max(self.min_deadline_s, expected_s * job.spec.train.deadline_slack)

    def precision_refusal(self, node: NodeState) -> str | None:
        """Why a node gets no work when every running job asks for a precision it cannot train."""
        running = [j for j in self.jobs.values() if j.state == "running"]
        if not running or any(self.presence.can_run(j, node) for j in running):
            return None
        asks = ", ".join(sorted({j.spec.train.precision for j in running}))
        return (
            f"every running job asks for a precision this node cannot train ({asks}); "
            f"it trains {', '.join(node.compute.precisions) or 'nothing'}"
        )

    # -- choosing work -------------------------------------------------------------------
    def plan(
        self, node: NodeState, cached: frozenset[str], now: float | None = None
    ) -> Plan | None:
        now = time.time() if now is None else now
        if node.stall_until > now:  # its last assignment expired undelivered: others first
            return None
        presence = self.presence
        jobs = [
            j
            for j in self.jobs.values()
            if j.state == "running" and not j.closing and j.spec.pipeline is None
            and presence.can_run(j, node)
        ]
        jobs.sort(key=lambda j: (j.live_count(), j.created_at, j.id))
        for job in jobs:
            shard = self.replicas.pending(job, node, now)
            if shard is not None:
                self.sizing.took_replica(job, node.id)
                exp = presence.expected_s(job, shard.samples, node)
                return Plan(job, shard, False, exp, self.deadline_for(job, exp, now))
        for job in jobs:
            if job.node_local:
                silo = self.sizing.silo_shard(job, node, now)
                if silo is None:
                    continue
                exp = presence.expected_s(job, silo.samples, node)
                return Plan(job, silo, True, exp, self.deadline_for(job, exp, now))
            if job.free:
                shard = self.sizing.carve(job, node, cached, now)
                exp = presence.expected_s(job, shard.samples, node)
                return Plan(job, shard, True, exp, self.deadline_for(job, exp, now))
        return None

    # -- lifecycle of an assignment ---------------------------------------------------------
    def attach(self, a: AssignmentState, shard: ShardState) -> None:
        job = self.jobs.get(a.job_id)
        if job is not None:
            job.live_n += 1
        shard.live[a.id] = a
        shard.nodes.add(a.node_id)
        if job is not None and len(shard.nodes) > job.most_holders:
            job.most_holders = len(shard.nodes)
        self.assignments[a.id] = a
        node = self.nodes.get(a.node_id)
        if node is not None:
            node.live.add(a.id)

    def delivered(self, a: AssignmentState, now: float) -> ShardState | None:
        """An update for ``a`` was accepted: forget the assignment (``detach``), and a node left
        with no other work counts as between two polls from now on, in the gathering of the round
        its upload may just have closed: a node asks for work again as soon as the
        acknowledgement reaches it, a round trip later. Without this, on a real line (measured:
        30 ms round trip) the node whose upload closed a round was never in the next round's
        gathering: the node already waiting carved the whole round, and rounds alternated
        between the two nodes of bench/bandwidth.py, one shard each, instead of splitting."""
        shard = self.detach(a)
        self.presence.between_polls(a.node_id, now)
        return shard

    def detach(self, a: AssignmentState) -> ShardState | None:
        """Forget a live assignment; returns its shard (None when the job or shard is gone)."""
        self.assignments.pop(a.id, None)
        node = self.nodes.get(a.node_id)
        if node is not None:
            node.live.discard(a.id)
        job = self.jobs.get(a.job_id)
        if job is None or job.round != a.round:
            return None
        shard = job.shards.get(a.shard_id)
        if shard is None:
            return None
        if shard.live.pop(a.id, None) is not None:
            job.live_n -= 1
            self.replicas.want_replica(job, shard)
        return shard

    def release_if_empty(self, shard: ShardState) -> bool:
        """A shard nobody holds and nobody delivered goes back to the pool."""
        job = self.jobs.get(shard.job_id)
        if job is None or shard.state != "open" or shard.live or shard.accepted:
            return False
        shard.state = "dropped"
        job.shards.pop(shard.id, None)
        job.replicated.pop(shard.id, None)
        job.release(shard.chunk_idxs)
        return True

    def expired(self, now: float) -> list[AssignmentState]:
        return [a for a in self.assignments.values() if a.deadline < now and not a.uploading]
