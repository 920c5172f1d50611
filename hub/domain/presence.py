"""Node presence and throughput estimates: who is online, who wants work now, and how fast a
node trains a job.

The gathering a shard is sized from (hub/domain/sizing.py) is the nodes waiting in a long-poll or
between two polls (within `gather_s`), plus the requester. A node never gets work of a job whose
precision it cannot train (its compute class lists what it trains); its throughput for a job is its
delivered EMA scaled by its benchmark's figure for the job's precision against fp32
(`NodeState.precision_factor`). All state here lives on the event loop.
"""

from __future__ import annotations

import time
from dataclasses import replace

from ..model.job import JobState, ShardState
from ..model.node import NodeState, clamp_sps
from ..policy.verification import Reputation, replication_probability


class Presence:
    """The nodes the hub knows (node id -> NodeState, shared with the scheduler), their polls,
    and the online nodes' reputations (rebuilt at most once a second)."""

    def __init__(
        self,
        nodes: dict[str, NodeState],
        *,
        online_window_s: float,
        gather_s: float,
        trust_min_age_s: float,
    ) -> None:
        self.nodes = nodes
        self.online_window_s = online_window_s
        self.gather_s = gather_s
        #: a node younger than this is on probation (verification.Reputation.probation)
        self.trust_min_age_s = trust_min_age_s
        self.polling: dict[str, int] = {}  # node id -> long-polls it has open now
        self.last_poll: dict[str, float] = {}  # node id -> when its last poll ended
        self._reps_cache: tuple[float, dict[str, Reputation]] = (0.0, {})

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

    def between_polls(self, node_id: str, now: float) -> None:
        """A node left with no work counts as between two polls from `now` on."""
        node = self.nodes.get(node_id)
        if node is not None and not node.live:
            self.last_poll[node.id] = now

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
            if node is not None and not node.barred and not node.live:
                out.append(node)
        return out

    # -- who is online ------------------------------------------------------------------------
    def is_online(self, node_id: str) -> bool:
        """Was the node seen within the online window (and is it neither banned nor suspended)?"""
        node = self.nodes.get(node_id)
        return (
            node is not None
            and not node.barred
            and time.time() - node.last_seen <= self.online_window_s
        )

    def online_nodes(self, now: float) -> int:
        return sum(
            1
            for n in self.nodes.values()
            if now - n.last_seen <= self.online_window_s and not n.barred
        )

    def anyone_else_online(self, node_id: str, now: float) -> bool:
        """Exact, and O(1) in the usual case: stops at the first other online node."""
        window = self.online_window_s
        return any(
            n.id != node_id and not n.barred and now - n.last_seen <= window
            for n in self.nodes.values()
        )

    def online_reputations(self, now: float) -> dict[str, Reputation]:
        """The online nodes' reputations; the same dict until it is rebuilt (once a second)."""
        stamp, reps = self._reps_cache
        if now - stamp > 1.0:
            for n in self.nodes.values():
                self.refresh_probation(n, now)
            reps = {
                n.id: n.reputation
                for n in self.nodes.values()
                if not n.barred and now - n.last_seen <= self.online_window_s
            }
            self._reps_cache = (now, reps)
        return reps

    def refresh_probation(self, node: NodeState, now: float) -> None:
        """A node is on probation (cannot be trusted) until it is trust_min_age_s old."""
        on = now - node.registered_at < self.trust_min_age_s
        if node.reputation.probation != on:
            node.reputation = replace(node.reputation, probation=on)

    # -- compute classes, precision and throughput --------------------------------------------
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

    def expected_s(self, job: JobState, samples: int, node: NodeState) -> float:
        return job.spec.train.processed(samples) / self.throughput(job, node)

    @staticmethod
    def expected_replicas(job: JobState, node: NodeState) -> float:
        """How many nodes are expected to train a shard carved for `node` (1 = unreplicated)."""
        v = job.spec.verification
        return 1.0 + (max(2, int(v.quorum)) - 1) * replication_probability(node.reputation, v)

    def class_key(self, job: JobState, node_id: str) -> str | None:
        node = self.nodes.get(node_id)
        return None if node is None else node.class_key(job.spec.train.precision)

    @staticmethod
    def observe_throughput(
        node: NodeState, processed: int, elapsed_s: float, alpha: float, factor: float = 1.0
    ) -> None:
        """``processed``: the samples the assignment ran through (TrainSpec.processed);
        ``factor``: the node's precision factor for the job (the EMA is kept fp32-equivalent)."""
        if elapsed_s <= 0 or processed <= 0:
            return
        seen = clamp_sps(processed / elapsed_s / factor)
        node.ema_sps = (1 - alpha) * node.ema_sps + alpha * seen

    @staticmethod
    def observe_rtt(node: NodeState, rtt_s: float, alpha: float = 0.2) -> None:
        """A round trip the hub measured on the node's connection: a moving average, the first
        sample taken whole."""
        if not rtt_s > 0:
            return
        node.rtt_s = rtt_s if node.rtt_s <= 0 else (1 - alpha) * node.rtt_s + alpha * rtt_s

    @staticmethod
    def observe_uplink(node: NodeState, bytes_per_s: float | None, alpha: float = 0.2) -> None:
        """The rate a body of the node's came in at (None: too small to say): a moving average,
        the first sample taken whole."""
        if bytes_per_s is None or not 0 < bytes_per_s < float("inf"):
            return
        old = node.uplink_bytes_per_s
        node.uplink_bytes_per_s = bytes_per_s if old <= 0 else (1 - alpha) * old + alpha * bytes_per_s

    @staticmethod
    def count_delivery(node: NodeState, shard: ShardState) -> None:
        """A node's update of ``shard`` was accepted: what its chunk cap grows by."""
        node.updates_accepted += 1
        node.proven_chunks = max(node.proven_chunks, len(shard.chunk_idxs))
