"""Closing a covered round: aggregate it in a worker thread (aggregating.py), then apply the
round's judgement and open the next round, the store first (one transaction), then memory, so
memory never runs ahead of what survives a restart. The stragglers still training are cancelled
or carried into the next round as hub/policy/late.py decides."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from ..model.job import AssignmentState, JobState, ShardState, UpdateState
from ..policy import rollback
from ..policy import round_policy as policy
from ..policy import verification as vf
from ..policy.late import Straggler, carry_late
from ..storage.blobs import HOT_BLOB_MAX
from ..storage.store import RoundResult, Store
from .aggregating import ClosedRound, RoundAggregation
from .metrics import HubMetrics
from .reputations import Reputations
from .scheduler import Scheduler
from .worksignal import WorkSignal

log = logging.getLogger("gpuflex.hub.rounds")


def _representatives(job: JobState) -> tuple[list[UpdateState], dict[str, ShardState],
                                              dict[str, tuple[policy.GroupMember, ...]]]:
    """The round's settled shards' representatives (in the fixed order: sha, then id), the shard
    of each, and the other members of each one's replica group."""
    shards = [s for s in job.shards.values() if s.state == "settled" and s.representative]
    reps: list[UpdateState] = []
    shard_of: dict[str, ShardState] = {}
    for s in shards:
        for u in s.accepted:
            if u.id == s.representative:
                reps.append(u)
                shard_of[u.id] = s
    reps.sort(key=lambda u: (u.sha, u.id))
    groups = {s.representative: tuple(policy.GroupMember(u.id, u.node_id, u.status)
                                      for u in s.accepted if u.id != s.representative)
              for s in shards if s.representative}
    return reps, shard_of, groups


def _carried(job: JobState, leftovers: list[AssignmentState], last: bool,
             now: float) -> list[tuple[AssignmentState, ShardState]]:
    """The live assignments of the closing round that count in the next one (late.carry_late),
    each with its shard there: the same data, seed and samples, numbered in order."""
    decision = carry_late([Straggler(a.id, a.carried_from, a.shard_id in job.shards) for a in leftovers],
                          node_local=job.node_local, late=job.spec.data.late,
                          secure_aggregation=job.secagg is not None, last_round=last)
    by_id = {a.id: a for a in leftovers}
    carry = [by_id[aid] for aid in decision.carried]
    return [(a, ShardState(
        id=f"{job.id}-r{job.round + 1}-s{seq}", job_id=job.id, round=job.round + 1, seq=seq,
        seed=job.shards[a.shard_id].seed, chunk_idxs=job.shards[a.shard_id].chunk_idxs,
        samples=job.shards[a.shard_id].samples, replica_group="", wanted=1, carved_at=now,
        carried_from=job.round)) for seq, a in enumerate(carry)]


class RoundClosing:
    """Closes a job's round once it is covered (see ``RoundEngine.advance``)."""

    def __init__(self, *, store: Store, scheduler: Scheduler, metrics: HubMetrics, signal: WorkSignal,
                 reputations: Reputations, aggregation: RoundAggregation) -> None:
        self.store = store
        self.scheduler = scheduler
        self.metrics = metrics
        self.signal = signal
        self.reputations = reputations
        self.aggregation = aggregation
        self.last_close_ms: float | None = None
        #: called (on the loop) with (last model, new model) when a round makes a model the next
        #: round trains, as soon as its blob is durable (the rest of the close still under way):
        #: the app starts making the delta nodes will download (hub/storage/deltas.py)
        self.on_new_model: Callable[[str, str], None] | None = None

    async def close(self, job: JobState) -> None:
        t0 = time.perf_counter()
        job.closing = True
        try:
            reps, shard_of, groups = _representatives(job)
            result = await asyncio.to_thread(self.aggregation.aggregate, job, reps, shard_of, groups,
                                             self.delta_starter(job))
        except BaseException:
            job.closing = False
            raise
        # live assignments of a finished round are void (replicas of settled shards were already
        # cancelled), except those hub/policy/late.py carries into the next round
        leftovers = [a for s in job.shards.values() for a in s.live.values()]
        now = time.time()
        last = job.round + 1 >= job.rounds
        carried = _carried(job, leftovers, last, now)
        touched = await self._commit(job, result, leftovers, carried, last, now)
        for a in leftovers:
            self.scheduler.detach(a)
        self.reputations.apply(touched)
        self._open_next(job, result, carried, last)
        self.last_close_ms = (time.perf_counter() - t0) * 1000
        self.signal.notify()
        await self._prune(job)

    async def _prune(self, job: JobState) -> None:
        """Let the models older than the job keeps go ([verification] keep_rounds,
        hub/policy/rollback.py): their rows, then the blobs nothing else refers to. A failure
        here costs disk, never the round: the next close prunes them."""
        below = rollback.prune_below(job.round, int(job.spec.verification.keep_rounds))
        if below is None:
            return
        try:
            gone = await self.store.prune_models(job.id, below)
            if gone:
                await asyncio.to_thread(self.aggregation.blobs.discard, gone)
        except Exception:
            log.exception("letting the old models of job %s go failed", job.id)

    async def _commit(self, job: JobState, result: ClosedRound, leftovers: list[AssignmentState],
                      carried: list[tuple[AssignmentState, ShardState]], last: bool,
                      now: float) -> list[tuple[str, vf.Reputation]]:
        """Apply the round's judgement (hub/policy.judge_round) in the store; the reputations it
        stored, for memory to follow."""
        judgement = result.judgement
        touched = self.reputations.after([], judgement.flagged_nodes)
        if judgement.withdrawn:  # the runs their flags reset, as the store kept them with the flags
            try:
                runs = await self.store.runs_before_flags(list(judgement.withdrawn))
            except BaseException:
                job.closing = False
                raise
            touched = self.reputations.withdraw(touched, runs)
        # what went down the wire for this round (its models and chunks; updates are in the store)
        metrics = {**result.metrics, "bytes_down": float(job.bytes_down)}
        outcome = RoundResult(
            model_hash=result.model_hash, opt_state_sha=result.opt_state_sha,
            statuses=dict(judgement.statuses), flags=list(judgement.flags), evidence=result.evidence,
            metrics=metrics, train_loss=result.train_loss, flagged_nodes=list(judgement.flagged_nodes))
        kept = {a.id for a, _ in carried}
        try:
            await self.store.close_round(job, outcome, flags=list(judgement.flags), withdrawn=list(judgement.withdrawn),
                                         cancelled=[a.id for a in leftovers if a.id not in kept], reputations=touched,
                                         last=last, now=now, carried=[(a.id, s) for a, s in carried])
        finally:
            job.closing = False
        return touched

    def _open_next(self, job: JobState, result: ClosedRound, carried: list[tuple[AssignmentState, ShardState]],
                   last: bool) -> None:
        """Memory follows the store: the new model, the next round (with its carried shards) or
        the job's end."""
        job.error = None  # a failure noted while this round could not close is over
        job.model_hash = result.model_hash
        job.opt_state_sha = result.opt_state_sha
        job.round += 1
        job.note_model(job.round, job.model_hash)
        self.metrics.rounds_closed += 1
        if last:
            job.end("done")
            return
        job.open_round()
        for a, shard in carried:
            job.take(shard.chunk_idxs)
            job.shards[shard.id] = shard
            job.next_seq = max(job.next_seq, shard.seq + 1)
            a.carried_from, a.round, a.shard_id = a.round, job.round, shard.id
            self.scheduler.attach(a, shard)

    def delta_starter(self, job: JobState) -> Callable[[str], None] | None:
        """What aggregating calls once the round's model blob is durable: a large model that the
        next round trains downloads as a delta from the last (hub/storage/deltas.py), and ``on_new_model``
        starts making it then, on the loop, while the blob of the server optimizer, the evaluation
        and the store's commit are still to come. A delta made for a round whose close then fails
        is only a spare: nothing announces that model, and a node is served a delta only to a model
        it is assigned."""
        if self.on_new_model is None or job.round + 1 >= job.rounds or job.model_size <= HOT_BLOB_MAX:
            return None
        start, previous, loop = self.on_new_model, job.model_hash, asyncio.get_running_loop()

        def started(model_hash: str) -> None:
            if model_hash != previous:
                with contextlib.suppress(RuntimeError):  # the loop closed (the hub stopping): no delta
                    loop.call_soon_threadsafe(start, previous, model_hash)

        return started
