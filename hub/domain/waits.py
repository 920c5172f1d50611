"""Why a job's open round waits, in words, with what fixes it: one sentence per waiting shard
(a replica, the referee) and one for chunks no online node can take. `gpuflex-hub job status`
and the console's job page show these same sentences (hub/server/readmodel/ puts them in the status
document as ``waiting``). Read from the scheduler's memory on the event loop; nothing changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..model.job import JobState, ShardState
from ..model.node import NodeState
from ..policy.round_policy import NO_REPLICA_HOLDER
from .scheduler import Scheduler

#: how to get replicas for nodes of one machine or one network (README, "The contributor")
ONE_BLOCK_HINT = (
    "Nodes on one machine or behind one router share an address block, and the hub never gives two "
    "nodes of one block (or of one enrollment token) replicas of one shard: the referee re-executes a "
    "segment of such an update instead. For replicas, run nodes on other networks, or start each with "
    "its own --source-address in a distinct /24 where the machine has such addresses "
    "(README: The contributor)"
)

REASONS = {
    NO_REPLICA_HOLDER: "no replica can come",
    "spot_check": "a spot check",
    "disagreement": "its replicas disagree",
    "against_trend": "it points against the model's trend",
}


def round_waits(scheduler: Scheduler, job: JobState, now: float, *, names: bool = True) -> list[str]:
    """The sentences for ``job``'s open round (empty when nothing waits). ``names``: name nodes and
    address blocks (False for an owner who may not see node ids: "a node")."""
    def name(node_id: str) -> str:
        return f"node {node_id[:12]}" if names else "a node"

    out: list[str] = []
    for shard in sorted(job.shards.values(), key=lambda s: s.seq):
        if shard.state == "open" and shard.round == job.round:
            said = _shard_wait(scheduler, job, shard, now, name, names)
            if said:
                out.append(said)
    idle = _idle_chunks(scheduler, job, now)
    if idle:
        out.append(idle)
    return out


def _shard_wait(scheduler: Scheduler, job: JobState, shard: ShardState, now: float,
                name: Callable[[str], str], names: bool) -> str | None:
    head = f"shard {shard.seq}"
    r = min(shard.requests.values(), key=lambda r: r.requested_at, default=None)
    if r is not None:
        why = REASONS.get(r.reason, r.reason)
        if r.reason == NO_REPLICA_HOLDER:
            why += f": {no_holder_why(scheduler, shard, name, names)}"
        said = (f"{head} waits for the referee, which re-executes a segment of {name(r.node_id)}'s update "
                f"before it counts ({why}); the node hands over its checkpoint states when it next asks "
                f"for work (at most {max(0.0, r.deadline - now):.0f} s more)")
        return said + (f". {ONE_BLOCK_HINT}" if r.reason == NO_REPLICA_HOLDER else "")
    if not shard.accepted or len(shard.accepted) >= shard.wanted:
        return None
    if shard.live:
        holders = ", ".join(name(a.node_id) for a in shard.live.values())
        return f"{head} waits for its replica from {holders}, who is training it"
    if scheduler.replicas.can_take_replica(job, shard, now):
        left = float(job.spec.verification.replica_wait_s) - (now - (shard.first_update_at or now))
        return (f"{head} waits up to {max(0.0, left):.0f} s more for a replica: an online node may take it "
                "when it next asks for work")
    return f"{head} waits for a replica that cannot come: {no_holder_why(scheduler, shard, name, names)}. {ONE_BLOCK_HINT}"


def no_holder_why(scheduler: Scheduler, shard: ShardState, name: Callable[[str], str], names: bool) -> str:
    """Why no online node may hold a replica of ``shard``, e.g. "every other online node shares
    127.0.0.0/24 with node X"."""
    holders = [n for nid in sorted(shard.nodes) if (n := scheduler.nodes.get(nid)) is not None]
    others = [n for n in scheduler.nodes.values() if n.id not in shard.nodes and scheduler.presence.is_online(n.id)]
    if not others:
        return "no other node is online"
    holder = " and ".join(name(h.id) for h in holders) or "its holder"
    apart = {_apart_from(n, holders) if scheduler.replicas.separate_replicas else "" for n in others}
    if apart == {"block"}:
        shared = sorted({b for n in others for h in holders for b in n.blocks & h.blocks})
        return f"every other online node shares {', '.join(shared) if names else 'an address block'} with {holder}"
    words = {"block": "an address block", "operator": "an enrollment token (operator)"}
    shares = " or ".join(words[k] for k in sorted(apart - {""}))
    eligible = "is not eligible yet (replicas go to trusted nodes first)"
    if not shares:
        return f"no other online node {eligible}"
    return f"every other online node shares {shares} with {holder}" + (f", or {eligible}" if "" in apart else "")


def _apart_from(node: NodeState, holders: Sequence[NodeState]) -> str:
    """What keeps ``node`` from holding a replica beside ``holders``: "block", "operator" or ""."""
    if any(node.blocks & h.blocks for h in holders):
        return "block"
    if node.operator is not None and any(node.operator == h.operator for h in holders):
        return "operator"
    return ""


def _idle_chunks(scheduler: Scheduler, job: JobState, now: float) -> str | None:
    """Chunks of the round nobody trains because no online node can take them."""
    if not job.free or job.node_local or job.live_count():
        return None
    online = [n for n in scheduler.nodes.values() if scheduler.presence.is_online(n.id)]
    if not online:
        return f"{len(job.free)} chunks wait for a node: no node is online"
    if not any(scheduler.presence.can_run(job, n) for n in online):
        return (f"{len(job.free)} chunks wait for a node: no online node trains "
                f"{job.spec.train.precision} (start one whose device does)")
    return None
