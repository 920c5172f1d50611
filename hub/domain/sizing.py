"""Shard sizing: how many of a round's free chunks a node's new shard takes.

A new shard is the node's share of the chunks the round still needs, in proportion to its
throughput, among the nodes that want work now (its *gathering*), so that every node of the round
finishes at about the same time; `round_target_s` caps a shard; cached chunks first.

The gathering's capacity counts each node's throughput divided by the replicas a shard of its is
expected to get (an untrusted node's shard is trained twice), so the chunks are spread over the
distinct shards the round will really have. The first carve of a round takes a snapshot of the
gathering; every node served from it (shard or replica) takes its part out, so a round of N nodes
costs O(N), not O(N^2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..model.job import JobState, ShardState, shard_seed, silo_seed
from ..model.node import NodeState
from .presence import Presence
from .replicas import Replicas

MAX_CHUNKS_PER_ASSIGNMENT = 4096


@dataclass
class Gathering:
    """A snapshot of who wants work in a job's round: node id -> its distinct capacity
    (samples/s divided by the replicas its shard is expected to get)."""

    round: int
    at: float
    members: dict[str, float]
    capacity: float
    #: how many nodes it held when it was taken (members leave it as they take their shards)
    size: int = 1

    def take(self, node_id: str) -> None:
        self.capacity = max(0.0, self.capacity - self.members.pop(node_id, 0.0))


class ShardSizing:
    """Cuts new shards from a job's free chunks (all state lives on the event loop)."""

    def __init__(self, presence: Presence, replicas: Replicas, *, unproven_max_chunks: int) -> None:
        self.presence = presence
        self.replicas = replicas
        #: chunks a node that has delivered nothing may hold (0 = no cap); doubles per delivery
        self.unproven_max_chunks = unproven_max_chunks
        self._gatherings: dict[str, Gathering] = {}  # job id -> this round's snapshot

    def _gathering(self, job: JobState, node: NodeState, now: float) -> Gathering:
        p = self.presence
        g = self._gatherings.get(job.id)
        if g is None or g.round != job.round or node.id not in g.members or now - g.at > p.gather_s:
            members = {
                n.id: p.throughput(job, n) / p.expected_replicas(job, n)
                for n in p.wants_work(now)
                if p.can_run(job, n)
            }
            if node.id not in members:
                members[node.id] = p.throughput(job, node) / p.expected_replicas(job, node)
            if len(members) == 1:  # alone: nobody else could take a replica either
                members[node.id] = p.throughput(job, node)
            g = Gathering(job.round, now, members, sum(members.values()), len(members))
            self._gatherings[job.id] = g
        return g

    def took_replica(self, job: JobState, node_id: str) -> None:
        """`node_id` was given a replica in `job`: its time goes to it, not to a shard of its own."""
        g = self._gatherings.get(job.id)
        if g is not None and g.round == job.round:
            g.take(node_id)

    def chunk_cap(self, node: NodeState) -> int:
        """The most chunks one shard of `node` may hold: an unproven node's shard is capped (its
        self-reported benchmark is only a claim), and the cap doubles with every delivery, and is
        at least twice the largest shard it has delivered (a fresh node that took its equal part
        of a round among several goes on from there, not from the ramp's small shards)."""
        if self.unproven_max_chunks <= 0 or node.updates_accepted >= 16:
            return MAX_CHUNKS_PER_ASSIGNMENT
        return min(
            MAX_CHUNKS_PER_ASSIGNMENT,
            max(self.unproven_max_chunks << node.updates_accepted, 2 * node.proven_chunks),
        )

    def _pick(
        self, job: JobState, node: NodeState, cached: frozenset[str], now: float
    ) -> tuple[list[int], int]:
        """The node's share of the free chunks (see the module docstring), at most what it trains
        in round_target_s, at least one chunk; cached chunks first, then the lowest free chunk
        indices (a stable order). Returns the chunk indices, sorted, and their samples."""
        train = job.spec.train
        chunks = job.chunks  # chunks[i].idx == i
        g = self._gathering(job, node, now)
        free_samples = job.free_samples()
        speed = self.presence.throughput(job, node)
        share = free_samples * speed / g.capacity if g.capacity > 0 else free_samples
        g.take(node.id)
        # what it trains in round_target_s: passes over the shard, or a fixed number of steps (then
        # the time does not grow with the shard, and its share alone sizes it)
        cap_samples = (
            math.inf
            if train.local_steps > 0
            else speed * train.round_target_s / max(1, train.local_epochs)
        )
        want_samples = min(share, cap_samples)
        picked: list[int] = []
        samples = 0
        cap = self.chunk_cap(node)
        if node.updates_accepted == 0 and g.size >= 2 and cap < MAX_CHUNKS_PER_ASSIGNMENT:
            # A node that has delivered nothing, among several, gets at most its equal part of the
            # round's chunks (by count, whatever speed it claims) instead of climbing the ramp
            # shard by shard: the ramp made every fresh node's first round 3 or more round trips of
            # small shards (bench/scaling.py: round 0 took 1.24 s against 0.9 after). Alone, it
            # climbs it; after its first delivery the ramp goes on from there.
            cap = min(MAX_CHUNKS_PER_ASSIGNMENT, max(cap, math.ceil(job.pool_chunks / g.size)))

        def full() -> bool:
            return bool(picked) and (samples >= want_samples or len(picked) >= cap)

        for idx in sorted(job.by_sha[sha] for sha in cached if job.by_sha.get(sha) in job.free):
            if full():
                break
            picked.append(idx)
            samples += chunks[idx].samples
        taken = set(picked)
        i = job.cursor
        while i < len(chunks) and not full():
            if i in job.free and i not in taken:
                picked.append(i)
                samples += chunks[i].samples
            i += 1
        picked.sort()  # stable chunk order inside the assignment
        return picked, samples

    def carve(
        self, job: JobState, node: NodeState, cached: frozenset[str], now: float
    ) -> ShardState:
        """Cut the node's share of the free chunks into a new shard of the job's round, replicated
        as `Replicas.replicate` draws."""
        picked, samples = self._pick(job, node, cached, now)
        chunks = job.chunks
        job.take(picked)
        while job.cursor < len(chunks) and job.cursor not in job.free:
            job.cursor += 1
        seq = job.next_seq
        job.next_seq += 1
        wanted = 1
        if self.replicas.replicate(job, node, now):
            wanted = max(2, int(job.spec.verification.quorum))
        shard = ShardState(
            id=f"{job.id}-r{job.round}-s{seq}",
            job_id=job.id,
            round=job.round,
            seq=seq,
            seed=shard_seed(job.spec.train.seed, job.round, seq),
            chunk_idxs=tuple(picked),
            samples=samples,
            replica_group="",
            wanted=wanted,
            carved_at=now,
        )
        if wanted > 1:
            shard.replica_group = shard.id
            job.replicated[shard.id] = shard
        job.shards[shard.id] = shard
        return shard

    @staticmethod
    def silo_shard(job: JobState, node: NodeState, now: float) -> ShardState | None:
        """A node-local job's shard for ``node``: its own silo, once a round, never replicated
        (no other node holds that data). None when it has no silo in the job or trained it."""
        idx = job.silo_of.get(node.id)
        if idx is None or idx not in job.free:
            return None
        if job.secagg is not None and job.secagg.phase != "keys":
            return None  # the round's secure aggregation fixed its roster: the next round takes this silo
        job.take([idx])
        seq = job.next_seq
        job.next_seq += 1
        # the seed names the silo (its blob id), not the order nodes attached or asked in: a round
        # trains the same batches whoever comes first (a run can be repeated, an auditor replay it)
        shard = ShardState(
            id=f"{job.id}-r{job.round}-s{seq}",
            job_id=job.id,
            round=job.round,
            seq=seq,
            seed=silo_seed(job.spec.train.seed, job.round, job.chunks[idx].sha),
            chunk_idxs=(idx,),
            samples=job.chunks[idx].samples,
            replica_group="",
            wanted=1,
            carved_at=now,
        )
        job.shards[shard.id] = shard
        return shard
