"""Replicas: which node may train another copy of a shard, and whether a new shard is replicated.

A replica of a shard never goes twice to the same node, and goes to nodes verification's
`replica_candidates` allows (trusted nodes when any are online, else the upper half by their run of
agreements). Homogeneous redundancy first: while a node of the shard's compute class
(protocol/compute.class_key for the job's precision) that could take the replica is online, only
such a node gets it, for up to half of `replica_wait_s` after the shard was cut; then, or at once
when no node of that class is online, any eligible node (a cross-class replica, judged by
cross_class_tolerance). Half: the other half leaves the cross-class replica time to train before the
round policy's replica wait (counted from the first update) runs out. With `separate_replicas`,
replicas of a shard never go to two nodes sharing an address block or an operator.
"""

from __future__ import annotations

import random

from ..model.job import JobState, ShardState
from ..model.node import NodeState
from ..policy.verification import (
    ReplicaPool,
    Reputation,
    is_trusted,
    replica_candidates,
    should_replicate,
)
from .presence import Presence


class Replicas:
    """Replica placement over the online nodes of `presence` (all state lives on the event loop)."""

    def __init__(self, presence: Presence, *, rng: random.Random, separate_replicas: bool) -> None:
        self.presence = presence
        self.nodes = presence.nodes
        #: replicas of a shard never go to two nodes sharing an address block or an operator
        self.separate_replicas = separate_replicas
        self._rng = rng
        #: the online reputations the pools below were built from (a rebuild drops them)
        self._pools_of: dict[str, Reputation] | None = None
        self._pools: dict[tuple[int, int], ReplicaPool] = {}
        #: job precision -> (the online reputations it was built from, class key -> online node ids)
        self._classes: dict[str, tuple[dict[str, Reputation], dict[str, list[str]]]] = {}

    def pending(self, job: JobState, node: NodeState, now: float) -> ShardState | None:
        """A shard still short of replicas that this node may take.
        `job.replicated` holds the open replicated shards that may still want one."""
        if not job.replicated:
            return None
        pool = self.pool(job, now)
        # A node that no shard with at most `most_holders` holders could take skips the scan:
        # without it every work request cost O(open replicated shards), and a round of n
        # nodes O(n^2) (bench/simulation.py at 1,000 nodes).
        if pool.ruled_out(node.id, job.most_holders):
            return None
        for sid, shard in list(job.replicated.items()):
            if shard.state != "open" or shard.replicas_needed() <= 0:
                # served (or settled): a detach or more `wanted` puts it back
                del job.replicated[sid]
                continue
            if (
                node.id not in shard.nodes
                and pool.eligible(node.id, shard.nodes)
                and self.separated(node, shard.nodes)
                and self._class_allows(job, shard, node, pool, now)
            ):
                return shard
        return None

    def _class_allows(
        self, job: JobState, shard: ShardState, node: NodeState, pool: ReplicaPool, now: float
    ) -> bool:
        """Homogeneous redundancy first (module docstring)."""
        mine = node.class_key(job.spec.train.precision)
        keys = {k for n in shard.nodes if (k := self.presence.class_key(job, n)) is not None}
        if mine is None or not keys or mine in keys:
            return True
        started = shard.carved_at if shard.carved_at is not None else shard.first_update_at
        if started is None or now - started >= float(job.spec.verification.replica_wait_s) / 2:
            return True
        return not self._same_class_taker(job, shard, keys, pool, now)

    def _same_class_taker(
        self, job: JobState, shard: ShardState, keys: set[str], pool: ReplicaPool, now: float
    ) -> bool:
        """Is an online node of one of `keys` that may take a replica of `shard` there?"""
        index = self._class_index(job.spec.train.precision, now)
        return any(
            pool.eligible(nid, shard.nodes)
            and (n := self.nodes.get(nid)) is not None
            and self.separated(n, shard.nodes)
            for k in keys
            for nid in index.get(k, ())
            if nid not in shard.nodes
        )

    def _class_index(self, requested: str, now: float) -> dict[str, list[str]]:
        """Online nodes by class key for a job precision (rebuilt with the online reputations)."""
        reps = self.presence.online_reputations(now)
        cached = self._classes.get(requested)
        if cached is None or cached[0] is not reps:
            index: dict[str, list[str]] = {}
            for nid in reps:
                node = self.nodes.get(nid)
                key = None if node is None else node.class_key(requested)
                if key is not None:
                    index.setdefault(key, []).append(nid)
            cached = self._classes[requested] = (reps, index)
        return cached[1]

    def separated(self, node: NodeState, holders: set[str]) -> bool:
        """True when `node` shares no address block and no operator with any of `holders`
        (always True when separate_replicas is off)."""
        if not self.separate_replicas:
            return True
        blocks, operator = node.blocks, node.operator
        for nid in holders:
            other = self.nodes.get(nid)
            if other is None or nid == node.id:
                continue
            if blocks & other.blocks or (operator is not None and operator == other.operator):
                return False
        return True

    @staticmethod
    def want_replica(job: JobState, shard: ShardState) -> None:
        """`shard` may want a replica again (a holder left, or more replicas are wanted)."""
        if shard.state == "open" and shard.wanted > 1:
            job.replicated[shard.id] = shard
            job.most_holders = max(job.most_holders, len(shard.nodes))

    def can_take_replica(self, job: JobState, shard: ShardState, now: float) -> bool:
        """Could an online node take another replica of `shard` right now (the pool's rule, and,
        with separate replicas, another block and operator than every holder)?"""
        pool = self.pool(job, now)
        if not pool.anyone(shard.nodes):
            return False
        if not self.separate_replicas:
            return True
        return any(
            self.separated(n, shard.nodes) and pool.eligible(nid, shard.nodes)
            for nid in pool.reps
            if nid not in shard.nodes and (n := self.nodes.get(nid)) is not None
        )

    def may_take_replica(self, job: JobState, shard: ShardState, node_id: str, now: float) -> bool:
        """Could node ``node_id`` take another replica of ``shard`` now (the pool's rule: not a
        member, trusted nodes first; and, with separate replicas, another block and operator)?"""
        node = self.nodes.get(node_id)
        if (
            node is None
            or node_id in shard.nodes
            or not self.pool(job, now).eligible(node_id, shard.nodes)
        ):
            return False
        return not self.separate_replicas or self.separated(node, shard.nodes)

    def replica_takers(self, job: JobState, shard: ShardState, now: float) -> list[str]:
        """Online nodes that could take another replica of `shard` right now."""
        ids = replica_candidates(
            self.presence.online_reputations(now), shard.nodes, job.spec.verification
        )
        return [
            i
            for i in ids
            if (n := self.nodes.get(i)) is not None and self.separated(n, shard.nodes)
        ]

    def pool(self, job: JobState, now: float) -> ReplicaPool:
        """The online nodes' reputations, indexed for replica questions (rebuilt with them)."""
        reps = self.presence.online_reputations(now)
        if reps is not self._pools_of:
            self._pools.clear()
            self._pools_of = reps
        key = (id(reps), job.spec.verification.trust_after)
        cached = self._pools.get(key)
        if cached is None:
            if len(self._pools) > 16:
                self._pools.clear()
            cached = self._pools[key] = ReplicaPool(reps, job.spec.verification)
        return cached

    def replicate(self, job: JobState, node: NodeState, now: float) -> bool:
        """Is a new shard of `node` replicated? As verification's rule draws. Under adaptive
        replication an untrusted node's shard is always replicated: a node that may hold the replica
        can still come before the update does; when none can by then, the shard does not wait for
        one (hub/policy/round_policy.py `replica_hopeless`: the referee re-executes the lone update
        instead). A trusted node's spot check is skipped when nobody else is online to take it."""
        v = job.spec.verification
        if not should_replicate(node.reputation, v, self._rng):
            return False
        if v.replication == "adaptive" and not is_trusted(node.reputation, v):
            return True
        return self.presence.anyone_else_online(node.id, now)
