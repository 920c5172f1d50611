"""The scheduler: who trains what next.

Each work request gets, in this order of preference:
1. a replica of a shard that still needs one (never twice to the same node); homogeneous
   redundancy first: while a node of the shard's compute class (protocol/compute.class_key for
   the job's precision) that could take the replica is online, only such a node gets it, for up
   to half of `replica_wait_s` after the shard was cut; then, or at once when no node of that
   class is online, any eligible node (a cross-class replica, judged by cross_class_tolerance).
   Half: the other half leaves the cross-class replica time to train before the round policy's
   replica wait (counted from the first update) runs out,
2. a new shard carved from the chunks the round still needs: the node's share of
   them, in proportion to its throughput, among the nodes that want work now (its
   *gathering*), so that every node of the round finishes at about the same time;
   `round_target_s` caps a shard; cached chunks first,
3. nothing ("retry after").

The gathering is the nodes waiting in a long-poll or between two polls (within
`gather_s`), plus the requester. Its capacity counts each node's throughput divided
by the replicas a shard of its is expected to get (an untrusted node's shard is
trained twice), so the chunks are spread over the distinct shards the round will
really have. The first carve of a round takes a snapshot of the gathering; every
node served from it (shard or replica) takes its part out, so a round of N nodes
costs O(N), not O(N^2).

Jobs share nodes fairly: the job with the fewest live assignments goes first. A node never gets
work of a job whose precision it cannot train (its compute class lists what it trains); its
throughput for a job is its delivered EMA scaled by its benchmark's figure for the job's
precision against fp32 (`NodeState.precision_factor`).
All state here lives on the event loop; the ledger persists what it returns.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, replace

from ..model.job import AssignmentState, JobState, ShardState, shard_seed, silo_seed
from ..model.node import NodeState, clamp_sps
from ..policy.verification import (
    ReplicaPool,
    Reputation,
    is_trusted,
    replica_candidates,
    replication_probability,
    should_replicate,
)

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


@dataclass(frozen=True)
class Plan:
    """What the scheduler decided; the caller signs and persists it."""

    job: JobState
    shard: ShardState
    new_shard: bool
    expected_s: float
    deadline: float


class Scheduler:
    def __init__(self, *, min_deadline_s: float, online_window_s: float, rng: random.Random | None = None,
                 gather_s: float = 2.0, separate_replicas: bool = False, trust_min_age_s: float = 0.0,
                 unproven_max_chunks: int = 0) -> None:
        self.jobs: dict[str, JobState] = {}
        self.nodes: dict[str, NodeState] = {}
        self.assignments: dict[str, AssignmentState] = {}
        self.min_deadline_s = min_deadline_s
        self.online_window_s = online_window_s
        self.gather_s = gather_s
        self._rng = rng or random.Random(0)
        self._reps_cache: tuple[float, dict[str, Reputation]] = (0.0, {})
        self._pools: dict[tuple[int, int], ReplicaPool] = {}
        self.polling: dict[str, int] = {}  # node id -> long-polls it has open now
        self.last_poll: dict[str, float] = {}  # node id -> when its last poll ended
        self._gatherings: dict[str, Gathering] = {}  # job id -> this round's snapshot
        #: job precision -> (the online reputations it was built from, class key -> online node ids)
        self._classes: dict[str, tuple[dict[str, Reputation], dict[str, list[str]]]] = {}
        #: replicas of a shard never go to two nodes sharing an address block or an operator
        self.separate_replicas = separate_replicas
        #: a node younger than this is on probation (verification.Reputation.probation)
        self.trust_min_age_s = trust_min_age_s
        #: chunks a node that has delivered nothing may hold (0 = no cap); doubles per delivery
        self.unproven_max_chunks = unproven_max_chunks

    # -- who wants work ---------------------------------------------------------------------
    def poll_started(self, node_id: str) -> None:
        self.polling[node_id] = self.polling.get(node_id, 0) + 1

    def poll_ended(self, node_id: str, now: float) -> None:
        left = self.polling.get(node_id, 0) - 1
        if left > 0:
            self.polling[node_id] = left
        else:
            self.polling.pop(node_id, None)
        node = self.nodes.get(node_id)
        if node is not None and not node.live:  # came back empty-handed: it will poll again at once
            self.last_poll[node_id] = now
        else:  # it went off with work
            self.last_poll.pop(node_id, None)

    def wants_work(self, now: float) -> list[NodeState]:
        """Nodes in a long-poll now, or between two polls, that hold no live assignment."""
        ids = set(self.polling)
        stale = [nid for nid, t in self.last_poll.items() if now - t > self.gather_s]
        for nid in stale:
            del self.last_poll[nid]
        ids.update(self.last_poll)
        out = []
        for nid in ids:
            node = self.nodes.get(nid)
            if node is not None and not node.banned and not node.live:
                out.append(node)
        return out

    def expected_replicas(self, job: JobState, node: NodeState) -> float:
        """How many nodes are expected to train a shard carved for `node` (1 = unreplicated)."""
        v = job.spec.verification
        return 1.0 + (max(2, int(v.quorum)) - 1) * replication_probability(node.reputation, v)

    def _gathering(self, job: JobState, node: NodeState, now: float) -> Gathering:
        g = self._gatherings.get(job.id)
        if g is None or g.round != job.round or node.id not in g.members or now - g.at > self.gather_s:
            members = {n.id: self.throughput(job, n) / self.expected_replicas(job, n)
                       for n in self.wants_work(now) if self.can_run(job, n)}
            if node.id not in members:
                members[node.id] = self.throughput(job, node) / self.expected_replicas(job, node)
            if len(members) == 1:  # alone: nobody else could take a replica either
                members[node.id] = self.throughput(job, node)
            g = Gathering(job.round, now, members, sum(members.values()), len(members))
            self._gatherings[job.id] = g
        return g

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

    def is_online(self, node_id: str) -> bool:
        """Was the node seen within the online window (and is it not banned)?"""
        node = self.nodes.get(node_id)
        return node is not None and not node.banned and time.time() - node.last_seen <= self.online_window_s

    def online_nodes(self, now: float) -> int:
        return sum(1 for n in self.nodes.values() if now - n.last_seen <= self.online_window_s and not n.banned)

    def in_flight(self) -> int:
        return len(self.assignments)

    def live_for(self, node_id: str) -> list[AssignmentState]:
        node = self.nodes.get(node_id)
        if node is None:
            return []
        return [self.assignments[a] for a in node.live if a in self.assignments]

    def deadline_for(self, job: JobState, expected_s: float, now: float) -> float:
        return now + max(self.min_deadline_s, expected_s * job.spec.train.deadline_slack)

    def expected_s(self, job: JobState, samples: int, node: NodeState) -> float:
        return job.spec.train.processed(samples) / self.throughput(job, node)

    # -- compute classes and precision ----------------------------------------------------------
    @staticmethod
    def can_run(job: JobState, node: NodeState) -> bool:
        return node.precision_for(job.spec.train.precision) is not None

    @staticmethod
    def precision_for(job: JobState, node: NodeState) -> str:
        """The precision `node` trains `job` in (fp32 for a node that cannot: never planned)."""
        return node.precision_for(job.spec.train.precision) or "fp32"

    def precision_factor(self, job: JobState, node: NodeState) -> float:
        return node.precision_factor(self.precision_for(job, node))

    def throughput(self, job: JobState, node: NodeState) -> float:
        """The node's samples/s on `job`: its EMA (fp32-equivalent) scaled to the job's precision."""
        return node.throughput * self.precision_factor(job, node)

    def class_key(self, job: JobState, node_id: str) -> str | None:
        node = self.nodes.get(node_id)
        return None if node is None else node.class_key(job.spec.train.precision)

    def precision_refusal(self, node: NodeState) -> str | None:
        """Why a node gets no work when every running job asks for a precision it cannot train."""
        running = [j for j in self.jobs.values() if j.state == "running"]
        if not running or any(self.can_run(j, node) for j in running):
            return None
        asks = ", ".join(sorted({j.spec.train.precision for j in running}))
        return (f"every running job asks for a precision this node cannot train ({asks}); "
                f"it trains {', '.join(node.compute.precisions) or 'nothing'}")

    # -- choosing work -------------------------------------------------------------------
    def plan(self, node: NodeState, cached: frozenset[str], now: float | None = None) -> Plan | None:
        now = time.time() if now is None else now
        if node.stall_until > now:  # its last assignment expired undelivered: others first
            return None
        jobs = [j for j in self.jobs.values() if j.state == "running" and not j.closing and self.can_run(j, node)]
        jobs.sort(key=lambda j: (j.live_count(), j.created_at, j.id))
        for job in jobs:
            shard = self._pending_replica(job, node, now)
            if shard is not None:
                g = self._gatherings.get(job.id)
                if g is not None and g.round == job.round:
                    g.take(node.id)  # its time goes to this replica, not to a shard of its own
                exp = self.expected_s(job, shard.samples, node)
                return Plan(job, shard, False, exp, self.deadline_for(job, exp, now))
        for job in jobs:
            if job.node_local:
                silo = self._silo_shard(job, node, now)
                if silo is None:
                    continue
                exp = self.expected_s(job, silo.samples, node)
                return Plan(job, silo, True, exp, self.deadline_for(job, exp, now))
            if job.free:
                shard = self._carve(job, node, cached, now)
                exp = self.expected_s(job, shard.samples, node)
                return Plan(job, shard, True, exp, self.deadline_for(job, exp, now))
        return None

    def _pending_replica(self, job: JobState, node: NodeState, now: float) -> ShardState | None:
        """A shard still short of replicas that this node may take (verification.replica_candidates:
        trusted nodes when any are online, else the upper half by their run of agreements).
        `job.replicated` holds the open replicated shards that may still want one."""
        if not job.replicated:
            return None
        pool = self.replica_pool(job, now)
        # A node that no shard with at most `most_holders` holders could take skips the scan:
        # without it every work request cost O(open replicated shards), and a round of n
        # nodes O(n^2) (bench/simulation.py at 1,000 nodes).
        if pool.ruled_out(node.id, job.most_holders):
            return None
        for sid, shard in list(job.replicated.items()):
            if shard.state != "open" or shard.replicas_needed() <= 0:
                del job.replicated[sid]  # served (or settled): a detach or more `wanted` puts it back
                continue
            if (node.id not in shard.nodes and pool.eligible(node.id, shard.nodes)
                    and self.separated(node, shard.nodes) and self._class_allows(job, shard, node, pool, now)):
                return shard
        return None

    def _class_allows(self, job: JobState, shard: ShardState, node: NodeState, pool: ReplicaPool,
                      now: float) -> bool:
        """Homogeneous redundancy first (module docstring, rule 1)."""
        mine = node.class_key(job.spec.train.precision)
        keys = {k for n in shard.nodes if (k := self.class_key(job, n)) is not None}
        if mine is None or not keys or mine in keys:
            return True
        started = shard.carved_at if shard.carved_at is not None else shard.first_update_at
        if started is None or now - started >= float(job.spec.verification.replica_wait_s) / 2:
            return True
        return not self._same_class_taker(job, shard, keys, pool, now)

    def _same_class_taker(self, job: JobState, shard: ShardState, keys: set[str], pool: ReplicaPool,
                          now: float) -> bool:
        """Is an online node of one of `keys` that may take a replica of `shard` there?"""
        index = self._class_index(job.spec.train.precision, now)
        return any(pool.eligible(nid, shard.nodes) and (n := self.nodes.get(nid)) is not None
                   and self.separated(n, shard.nodes)
                   for k in keys for nid in index.get(k, ()) if nid not in shard.nodes)

    def _class_index(self, requested: str, now: float) -> dict[str, list[str]]:
        """Online nodes by class key for a job precision (rebuilt with the online reputations)."""
        reps = self._online_reputations(now)
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
    def count_delivery(node: NodeState, shard: ShardState) -> None:
        """A node's update of ``shard`` was accepted: what its chunk cap grows by."""
        node.updates_accepted += 1
        node.proven_chunks = max(node.proven_chunks, len(shard.chunk_idxs))

    def chunk_cap(self, node: NodeState) -> int:
        """The most chunks one shard of `node` may hold: an unproven node's shard is capped (its
        self-reported benchmark is only a claim), and the cap doubles with every delivery, and is
        at least twice the largest shard it has delivered (a fresh node that took its equal part
        of a round among several goes on from there, not from the ramp's small shards)."""
        if self.unproven_max_chunks <= 0 or node.updates_accepted >= 16:
            return MAX_CHUNKS_PER_ASSIGNMENT
        return min(MAX_CHUNKS_PER_ASSIGNMENT,
                   max(self.unproven_max_chunks << node.updates_accepted, 2 * node.proven_chunks))

    @staticmethod
    def want_replica(job: JobState, shard: ShardState) -> None:
        """`shard` may want a replica again (a holder left, or more replicas are wanted)."""
        if shard.state == "open" and shard.wanted > 1:
            job.replicated[shard.id] = shard
            job.most_holders = max(job.most_holders, len(shard.nodes))

    def can_take_replica(self, job: JobState, shard: ShardState, now: float) -> bool:
        """Could an online node take another replica of `shard` right now (the pool's rule, and,
        with separate replicas, another block and operator than every holder)?"""
        pool = self.replica_pool(job, now)
        if not pool.anyone(shard.nodes):
            return False
        if not self.separate_replicas:
            return True
        return any(self.separated(n, shard.nodes) and pool.eligible(nid, shard.nodes) for nid in pool.reps
                   if nid not in shard.nodes and (n := self.nodes.get(nid)) is not None)

    def may_take_replica(self, job: JobState, shard: ShardState, node_id: str, now: float) -> bool:
        """Could node ``node_id`` take another replica of ``shard`` now (the pool's rule: not a
        member, trusted nodes first; and, with separate replicas, another block and operator)?"""
        node = self.nodes.get(node_id)
        if node is None or node_id in shard.nodes or not self.replica_pool(job, now).eligible(node_id, shard.nodes):
            return False
        return not self.separate_replicas or self.separated(node, shard.nodes)

    def replica_takers(self, job: JobState, shard: ShardState, now: float) -> list[str]:
        """Online nodes that could take another replica of `shard` right now."""
        ids = replica_candidates(self._online_reputations(now), shard.nodes, job.spec.verification)
        return [i for i in ids if (n := self.nodes.get(i)) is not None and self.separated(n, shard.nodes)]

    def replica_pool(self, job: JobState, now: float) -> ReplicaPool:
        """The online nodes' reputations, indexed for replica questions (rebuilt once a second)."""
        reps = self._online_reputations(now)
        key = (id(reps), job.spec.verification.trust_after)
        cached = self._pools.get(key)
        if cached is None:
            if len(self._pools) > 16:
                self._pools.clear()
            cached = self._pools[key] = ReplicaPool(reps, job.spec.verification)
        return cached

    def _online_reputations(self, now: float) -> dict[str, Reputation]:
        stamp, reps = self._reps_cache
        if now - stamp > 1.0:
            for n in self.nodes.values():
                self.refresh_probation(n, now)
            reps = {n.id: n.reputation for n in self.nodes.values()
                    if not n.banned and now - n.last_seen <= self.online_window_s}
            self._reps_cache = (now, reps)
            self._pools.clear()
        return reps

    def refresh_probation(self, node: NodeState, now: float) -> None:
        """A node is on probation (cannot be trusted) until it is trust_min_age_s old."""
        on = now - node.registered_at < self.trust_min_age_s
        if node.reputation.probation != on:
            node.reputation = replace(node.reputation, probation=on)

    def _carve(self, job: JobState, node: NodeState, cached: frozenset[str], now: float) -> ShardState:
        """Cut the node's share of the free chunks (see the module docstring), at most what it
        trains in round_target_s, at least one chunk; cached chunks first, then the lowest free
        chunk indices (a stable order)."""
        train = job.spec.train
        chunks = job.chunks  # chunks[i].idx == i
        g = self._gathering(job, node, now)
        free_samples = job.free_samples()
        speed = self.throughput(job, node)
        share = free_samples * speed / g.capacity if g.capacity > 0 else free_samples
        g.take(node.id)
        # what it trains in round_target_s: passes over the shard, or a fixed number of steps (then
        # the time does not grow with the shard, and its share alone sizes it)
        cap_samples = math.inf if train.local_steps > 0 else speed * train.round_target_s / max(1, train.local_epochs)
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
        job.take(picked)
        while job.cursor < len(chunks) and job.cursor not in job.free:
            job.cursor += 1
        seq = job.next_seq
        job.next_seq += 1
        wanted = 1
        if self._replicate(job, node, now):
            wanted = max(2, int(job.spec.verification.quorum))
        shard = ShardState(
            id=f"{job.id}-r{job.round}-s{seq}", job_id=job.id, round=job.round, seq=seq,
            seed=shard_seed(train.seed, job.round, seq), chunk_idxs=tuple(picked), samples=samples,
            replica_group="", wanted=wanted, carved_at=now,
        )
        if wanted > 1:
            shard.replica_group = shard.id
            job.replicated[shard.id] = shard
        job.shards[shard.id] = shard
        return shard

    @staticmethod
    def _silo_shard(job: JobState, node: NodeState, now: float) -> ShardState | None:
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
            id=f"{job.id}-r{job.round}-s{seq}", job_id=job.id, round=job.round, seq=seq,
            seed=silo_seed(job.spec.train.seed, job.round, job.chunks[idx].sha), chunk_idxs=(idx,),
            samples=job.chunks[idx].samples, replica_group="", wanted=1, carved_at=now,
        )
        job.shards[shard.id] = shard
        return shard

    def _replicate(self, job: JobState, node: NodeState, now: float) -> bool:
        """Replicate as verification's rule draws. Under adaptive replication an untrusted node's
        shard is always replicated: a node that may hold the replica can still come before the
        update does; when none can by then, the shard does not wait for one (hub/policy/round_policy.py
        `replica_hopeless`: the referee re-executes the lone update instead). A trusted node's
        spot check is skipped when nobody else is online to take it."""
        v = job.spec.verification
        if not should_replicate(node.reputation, v, self._rng):
            return False
        if v.replication == "adaptive" and not is_trusted(node.reputation, v):
            return True
        return self.anyone_else_online(node.id, now)

    def anyone_else_online(self, node_id: str, now: float) -> bool:
        """Exact, and O(1) in the usual case: stops at the first other online node."""
        window = self.online_window_s
        return any(n.id != node_id and not n.banned and now - n.last_seen <= window for n in self.nodes.values())

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
        node = self.nodes.get(a.node_id)
        if node is not None and not node.live:
            self.last_poll[node.id] = now
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
            self.want_replica(job, shard)
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

    def observe_throughput(self, node: NodeState, processed: int, elapsed_s: float, alpha: float,
                           factor: float = 1.0) -> None:
        """``processed``: the samples the assignment ran through (TrainSpec.processed);
        ``factor``: the node's precision factor for the job (the EMA is kept fp32-equivalent)."""
        if elapsed_s <= 0 or processed <= 0:
            return
        seen = clamp_sps(processed / elapsed_s / factor)
        node.ema_sps = (1 - alpha) * node.ema_sps + alpha * seen

