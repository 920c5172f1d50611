"""Settling a shard: gather the round policy's inputs about its replicas, ask it
(hub/policy/round_policy.py ``decide_shard``) and apply its decision, the store first, then
memory. A decision may be to ask the referee (replays.py) or to wait for more replicas."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence

from torch import Tensor

from ..model.job import JobState, ShardState, UpdateState
from ..policy import round_policy as policy
from ..policy import suspension
from ..policy import verification as vf
from ..policy.fingerprints import Fingerprint, fingerprint_of
from ..storage.blobs import BlobStore
from ..storage.store import Store
from .replays import RefereeReplays
from .reputations import Reputations
from .scheduler import Scheduler
from .updates import open_deltas, update_records
from .worksignal import WorkSignal

#: fingerprints kept at most (the oldest go first): a shard that never reaches a decision here (its job
#: cancelled, say) leaves its members' behind
FINGERPRINTS_KEPT = 4096


class ShardSettling:
    """Decides the open shards of a round whose updates are in (see ``RoundEngine.advance``)."""

    def __init__(self, *, store: Store, blobs: BlobStore, scheduler: Scheduler, signal: WorkSignal,
                 reputations: Reputations, referee: RefereeReplays, poke: Callable[[str], None]) -> None:
        self.store = store
        self.blobs = blobs
        self.scheduler = scheduler
        self.signal = signal
        self.reputations = reputations
        self.referee = referee
        self.poke = poke  # the round engine looks at a job again
        #: update id -> its fingerprint, taken the first time its shard's members are compared
        #: (committed, and not all the same bytes), kept while the shard is open (a shard is
        #: decided again as replicas and verdicts come in)
        self.fingerprints: dict[str, Fingerprint] = {}

    def replica_state(self, job: JobState, shard: ShardState, now: float) -> policy.ReplicaState:
        """The policy's view of a shard's replicas (hub/policy/round_policy.py ``ReplicaState``)."""
        waited = None if shard.first_update_at is None else now - shard.first_update_at
        live = bool(shard.live)
        # The policy reads `taker` only with no replica out and fewer updates than wanted, or two or
        # more: ask the scheduler only then.
        n = len(shard.accepted)
        taker = live or (shard.wanted <= n < 2) or self.scheduler.replicas.can_take_replica(job, shard, now)
        keys = {u.node_id: self.scheduler.presence.class_key(job, u.node_id) for u in shard.accepted}
        return policy.ReplicaState(wanted=shard.wanted, waited_s=waited, live=live, taker=taker,
                                   comparison=policy.comparison_of(keys.values()),
                                   class_keys={n: k for n, k in keys.items() if k is not None})

    async def settle(self, job: JobState, shard: ShardState, state: policy.ReplicaState) -> bool:
        """Decide the shard and apply it; True when the referee gave verdicts at once (decide again)."""
        ups = sorted(shard.accepted, key=lambda u: (u.sha, u.id))
        if len(ups) == 1 and job.trend_base() is None:
            # A lone update is never compared, nor measured against a trend: its delta is not
            # opened (no thread, no mmap).
            records = update_records(job, self.scheduler.nodes, {ups[0].id: shard}, ups, [{}])
            ref = self.referee.inputs(job, shard, ups)
            decision = policy.decide_shard(records, job.spec.verification, state, self.reputations.of(ups),
                                           committed=ref.committed, verdicts=ref.verdicts, spot_draw=ref.spot_draw)
        else:
            decision = await asyncio.to_thread(self._decide, job, shard, ups, state)
        if isinstance(decision, policy.Referee):
            # one class, every member's key known: their replicas train bit for bit alike
            same_class = state.comparison == "same_class" and len(state.class_keys) == len(shard.accepted)
            return await self.referee.ask(job, shard, decision, same_class=same_class)
        await self._apply(job, shard, decision, state)
        return False

    def _decide(self, job: JobState, shard: ShardState, ups: list[UpdateState],
                state: policy.ReplicaState) -> policy.ShardDecision:
        """Worker thread: open the replicas' deltas (and the models the trend is measured on)
        and ask the policy."""
        base = job.trend_base()
        with (open_deltas(self.blobs, [u.sha for u in ups], job.layout) as deltas,
              open_deltas(self.blobs, [job.model_hash, base] if base else []) as models):
            ref = self.referee.inputs(job, shard, ups)
            # where the referee may settle a disagreement, the fingerprints spare the full distances
            prints = ({u.id: self._fingerprint(u, d) for u, d in zip(ups, deltas, strict=True)}
                      if ref.committed and len({u.sha for u in ups}) > 1 else None)
            records = update_records(job, self.scheduler.nodes, {u.id: shard for u in ups}, ups, deltas, prints)
            trend = {u.id: vf.trend_alignment(d, models[0], models[1]) for u, d in zip(ups, deltas, strict=True)
                     } if models else {}
            decision = policy.decide_shard(records, job.spec.verification, state, self.reputations.of(ups),
                                           committed=ref.committed, verdicts=ref.verdicts, spot_draw=ref.spot_draw,
                                           trend=trend)
            del records
        return decision

    def _fingerprint(self, u: UpdateState, delta: Mapping[str, Tensor]) -> Fingerprint:
        fp = self.fingerprints.get(u.id)
        if fp is None:
            fp = self.fingerprints[u.id] = fingerprint_of(delta, sha=u.sha)
            # list() and pop() are single steps for another thread (the loop pops in _apply)
            for old in list(self.fingerprints)[: len(self.fingerprints) - FINGERPRINTS_KEPT]:
                self.fingerprints.pop(old, None)
        return fp

    # -- applying a shard decision: the store, then memory ------------------------------------
    async def _apply(self, job: JobState, shard: ShardState, decision: policy.ShardDecision,
                     state: policy.ReplicaState | None = None) -> None:
        if isinstance(decision, policy.WaitForMore):
            if decision.wanted == shard.wanted:
                return
            await self.store.want_replicas(shard.id, decision.wanted, dict(decision.evidence))
            shard.wanted = decision.wanted
            self.scheduler.replicas.want_replica(job, shard)
            # a replica, for the longest-waiting node that may take it
            self.signal.offer(to=lambda nid: self.scheduler.replicas.may_take_replica(job, shard, nid, time.time()))
            return
        settled = isinstance(decision, policy.Settle)
        representative = decision.representative if isinstance(decision, policy.Settle) else None
        agreed_nodes = decision.agreed_nodes if isinstance(decision, policy.Settle) else ()
        statuses = dict(decision.statuses)
        cancelled = list(shard.live.values())
        touched = self.reputations.after(agreed_nodes, decision.flagged_nodes, decision.missed_nodes)
        await self.store.settle_shard(
            shard, state="settled" if settled else "dropped", evidence=dict(decision.evidence),
            statuses=statuses, cancelled=[a.id for a in cancelled], flags=list(decision.flags),
            round=job.round, reputations=touched, now=time.time())
        for a in cancelled:
            self.scheduler.detach(a)
        shard.state = "settled" if settled else "dropped"
        shard.representative = representative
        shard.unverified = decision.unverified if isinstance(decision, policy.Settle) else None
        if state is not None and len(shard.accepted) > 1:
            shard.comparison = state.comparison
        for u in shard.accepted:
            self.fingerprints.pop(u.id, None)  # the shard is decided: never compared again
            if u.id in statuses:
                u.status = statuses[u.id]
        self.reputations.apply(touched)
        self._suspend(decision.flags)
        job.replicated.pop(shard.id, None)
        if not settled:
            job.shards.pop(shard.id, None)
            job.release(shard.chunk_idxs)
        if not settled or cancelled:
            self.signal.offer()  # the chunks back in the pool

    # -- a proven mismatch suspends its node (hub/policy/suspension.py) -------------------------
    def _suspend(self, flags: Sequence[policy.Flag]) -> None:
        """Memory follows the store, which wrote the suspension with the flag: the node gets no
        more work, and every running job holds its pending updates out (``hold_out_suspended``)."""
        for f in flags:
            node = self.scheduler.nodes.get(f.node_id)
            if node is None or node.suspended is not None or not suspension.flag_suspends(f):
                continue
            node.suspended = suspension.why(f.reason, f.update_id)
            for j in self.scheduler.jobs.values():
                if j.state == "running":
                    self.poke(j.id)

    def _held(self, node_id: str) -> bool:
        node = self.scheduler.nodes.get(node_id)
        return node is not None and node.suspended is not None

    async def hold_out_suspended(self, job: JobState) -> None:
        """A suspended node's work in the open round counts for nothing: a shard that waits on
        one of its updates (with no referee request open), stands on one, or is out only to it
        (a live assignment and nothing else) is dropped like any dropped shard, and its chunks go
        out again."""
        for shard in list(job.shards.values()):
            if shard.state == "open" and not shard.requests:
                held = {u.node_id for u in shard.accepted if u.status == "accepted" and self._held(u.node_id)}
                if not shard.accepted and shard.live and all(self._held(a.node_id) for a in shard.live.values()):
                    held = {a.node_id for a in shard.live.values()}
            elif shard.state == "settled":
                held = {u.node_id for u in shard.accepted if u.id == shard.representative and self._held(u.node_id)}
            else:
                continue
            if not held:
                continue
            left_out = {u.id for u in shard.accepted if u.status in ("accepted", "redundant")}
            await self._apply(job, shard, policy.Drop(
                "suspended", dict.fromkeys(sorted(left_out), "excluded"), (), (),
                {"dropped": "suspended", "nodes": sorted(held)}))
