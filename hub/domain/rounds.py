"""Rounds: settle replicated shards, close a covered round, aggregate, evaluate.

One `RoundEngine` per hub. Its `advance(job)` is serialized by a lock (aggregation
never runs twice at once) and does the heavy work (opening update blobs with
mmap, comparing replicas, aggregating, evaluating) in a worker thread. The referee's
segment replays, the heaviest, run without the lock: their inputs are taken under it,
the re-execution runs in a task of the loop's own, and the verdicts are recorded under
the lock again, or dropped when the shard moved on meanwhile (replays.py ``apply``).

The round policy (hub/policy/round_policy.py: decide_shard for each shard, judge_round when the
round closes; both pure, built on hub/policy/verification.py) decides what is aggregated, and the
job's aggregation strategy (hub/policy/strategy.py) how. The engine drives collaborators that
gather their inputs and apply their decisions, the store first, then memory:

- settling.py ``ShardSettling``: a shard's replicas, decided and applied;
- replays.py ``RefereeReplays``: the referee's state requests and segment replays;
- closing.py ``RoundClosing``: a covered round closed and the next one opened, its aggregation
  (aggregating.py ``RoundAggregation``) in a worker thread;
- reputations.py ``Reputations``: the nodes' reputations those decisions move;
- updates.py: the update blobs opened without a copy, and verification's view of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

from ..model.job import JobState, ShardState, StateRequestState
from ..policy import round_policy as policy
from ..storage.auditlog import AuditLog
from ..storage.blobs import BlobStore
from ..storage.store import Store
from .aggregating import RoundAggregation
from .closing import RoundClosing
from .metrics import HubMetrics
from .replays import RefereeReplays, Replay, segment_draw, spot_draw
from .reputations import Reputations
from .scheduler import Scheduler
from .settling import ShardSettling
from .updates import open_deltas
from .worksignal import Pulse, WorkSignal

__all__ = ["RoundEngine", "open_deltas", "segment_draw", "spot_draw"]

log = logging.getLogger("gpuflex.hub.rounds")


def _secagg_phases(job: JobState) -> tuple[int, str | None, str | None]:
    """Where a job's secure aggregation stands: a member's SecAggState changes only when this does
    (a round closed or opened, a step ended)."""
    return (job.round, None if job.secagg is None else job.secagg.phase,
            None if job.secagg_last is None else job.secagg_last.phase)


class RoundEngine:
    def __init__(
        self,
        *,
        store: Store,
        blobs: BlobStore,
        scheduler: Scheduler,
        metrics: HubMetrics,
        signal: WorkSignal,
        audit: AuditLog,
        audit_secret: bytes,
    ) -> None:
        self.store = store
        self.scheduler = scheduler
        self.signal = signal
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._pending: set[str] = set()
        self._replays: asyncio.TaskGroup | None = None  # open while ``run`` is
        #: one replay computes at a time (they take turns on torch's process-wide oneDNN switch in
        #: any case): the others wait here, not in worker threads the settling and closing need
        self._replay_turn = asyncio.Semaphore(1)
        #: the job the loop is advancing right now (None between jobs)
        self.current: JobState | None = None
        reputations = Reputations(scheduler)
        self.referee = RefereeReplays(store=store, blobs=blobs, scheduler=scheduler, metrics=metrics,
                                      signal=signal, audit_secret=audit_secret, poke=self.poke)
        self.settling = ShardSettling(store=store, blobs=blobs, scheduler=scheduler, signal=signal,
                                      reputations=reputations, referee=self.referee, poke=self.poke)
        self.closing = RoundClosing(store=store, scheduler=scheduler, metrics=metrics, signal=signal,
                                    reputations=reputations,
                                    aggregation=RoundAggregation(blobs=blobs, scheduler=scheduler,
                                                                 reputations=reputations, audit=audit))
        #: called (outside the engine's lock) after each job the loop advanced: the ledger's
        #: automatic rollback looks there (hub/domain/ledger/rollbacks.py)
        self.after_advance: Callable[[JobState], Awaitable[None]] | None = None
        #: fired whenever a round's secure aggregation may have moved on (a step's answers, a step's
        #: deadline, a round closed or opened): the members' long-polls look again
        self.secagg_moved = Pulse()

    @property
    def state_requests(self) -> dict[str, StateRequestState]:
        """The referee's open state requests, by id (hub/policy/referee.py; the ledger answers nodes from it)."""
        return self.referee.state_requests

    @property
    def on_new_model(self) -> Callable[[str, str], None] | None:
        """Called (on the loop) with (last model, new model) when a round makes a model the next
        round trains, as soon as its blob is durable: the app starts making the delta nodes will
        download (hub/storage/deltas.py)."""
        return self.closing.on_new_model

    @on_new_model.setter
    def on_new_model(self, start: Callable[[str, str], None] | None) -> None:
        self.closing.on_new_model = start

    @property
    def last_close_ms(self) -> float | None:
        return self.closing.last_close_ms

    def spot_draw(self, job_id: str, shard_id: str) -> float:
        """The shard's spot-check draw (``spot_draw`` under this hub's audit secret)."""
        return self.referee.spot_draw(job_id, shard_id)

    def resume_referee(self, rows: Sequence[tuple[StateRequestState, str, Mapping[str, Any]]]) -> None:
        """After a restart: the open requests wait on (with the states already handed over), the
        verdicts already given stand, for the shards still open."""
        self.referee.resume(rows)

    # -- driving ---------------------------------------------------------------------------
    def poke(self, job_id: str) -> None:
        self._pending.add(job_id)
        self._wake.set()

    async def run(self) -> None:
        """Background loop: advance jobs that something happened to.

        One job's failure fails that job, not the loop. If failing it fails too (the store
        is down), the exception leaves the loop: its supervisor (hub/server/loops.py) logs it, turns
        /healthz 503, notes the error on `self.current` and starts the loop again, which
        looks at every running job once more.
        """
        self._pending.update(j.id for j in self.scheduler.jobs.values() if j.state == "running")
        self._wake.set()
        try:
            async with asyncio.TaskGroup() as replays:  # the referee's replays live as long as the loop
                self._replays = replays
                await self._loop()
        except ExceptionGroup as group:  # the supervisor reports the one error, not its group
            raise group.exceptions[0] if len(group.exceptions) == 1 else group from None
        finally:
            self._replays = None

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                job = self.scheduler.jobs.get(self._pending.pop())
                if job is None or job.state != "running" or job.spec.pipeline is not None:
                    continue  # a pipelined job has no rounds (hub/domain/pipelines/)
                self.current = job
                try:
                    await self.advance(job)
                except Exception as exc:  # one job's failure must not stop the others
                    log.exception("advancing job %s failed", job.id)
                    await self.fail_job(job, f"round {job.round} failed: {exc}")
                self.current = None
                if self.after_advance is not None:
                    await self.after_advance(job)

    async def advance(self, job: JobState, now: float | None = None) -> None:
        async with self._lock:
            now = time.time() if now is None else now
            before = _secagg_phases(job)
            if job.secagg is not None and not job.secagg.settled:
                job.secagg.advance(now, self._secagg_expected(job))
            await self.settling.hold_out_suspended(job)
            for shard in sorted(job.shards.values(), key=lambda s: s.seq):
                if shard.state != "open" or not shard.accepted:
                    continue
                if shard.requests:  # the referee waits for states, or replays them
                    if (job.id, shard.id) in self.referee.replaying or not all(
                            r.complete or now >= r.deadline for r in shard.requests.values()):
                        continue
                    replay = await self.referee.prepare(job, shard)
                    if replay.items:  # re-executed without the lock; the verdicts come back under it
                        self._start_replay(replay)
                        continue
                    await self.referee.apply(replay, {})
                await self._settle(job, shard, now)
            await self.settling.hold_out_suspended(job)
            if job.state == "running" and job.round_complete(now, self.scheduler.presence.is_online):
                await self._close(job)
            if _secagg_phases(job) != before:  # only a move: a waiting poll pokes the engine when it looks
                self.secagg_moved.fire()

    async def _settle(self, job: JobState, shard: ShardState, now: float) -> None:
        """Decide an open shard whose updates are in (under the lock)."""
        vspec = job.spec.verification
        for _ in range(3):  # a referee verdict given at once (no commitment) decides again
            state = self.settling.replica_state(job, shard, now)
            if shard.state != "open" or shard.requests or not policy.shard_due(len(shard.accepted), vspec, state):
                break
            if not await self.settling.settle(job, shard, state):
                break

    def _start_replay(self, replay: Replay) -> None:
        if self._replays is None:
            raise RuntimeError("a segment replay starts only from the engine's loop (run)")
        self.referee.replaying.add((replay.job.id, replay.shard.id))
        self._replays.create_task(self._replay(replay), name=f"gpuflex-replay-{replay.shard.id}")

    async def _replay(self, replay: Replay) -> None:
        """Re-execute a shard's segments in a worker thread, the lock free meanwhile (uploads,
        other shards and other jobs' rounds go on), then record the verdicts under it, if the shard
        is still where the replay found it (``RefereeReplays.apply``; dropped otherwise)."""
        job, shard = replay.job, replay.shard
        try:
            try:
                async with self._replay_turn:
                    verdicts = await asyncio.to_thread(self.referee.replay, replay)
            except Exception as exc:
                if self.referee.current(replay):
                    raise
                log.info("the replay of shard %s of job %s failed after the shard moved on: %s", shard.id, job.id, exc)
                return
            async with self._lock:  # recorded and decided in one hold, as the loop would
                if not await self.referee.apply(replay, verdicts):
                    log.info("the replay of shard %s of job %s is dropped: the shard moved on meanwhile",
                             shard.id, job.id)
                    return
                await self._settle(job, shard, time.time())
        except Exception as exc:  # as the loop does: one job's failure fails that job
            log.exception("replaying shard %s of job %s failed", shard.id, job.id)
            await self.fail_job(job, f"round {job.round} failed: {exc}")
        finally:
            self.referee.replaying.discard((job.id, replay.shard.id))
            self.poke(job.id)

    def _secagg_expected(self, job: JobState) -> set[str]:
        """Who the round's secure aggregation waits for at its keys: every silo whose node is online."""
        return {c.owner for c in job.chunks if c.owner is not None and self.scheduler.presence.is_online(c.owner)}

    async def _close(self, job: JobState) -> None:
        await self.closing.close(job)

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """No shard settles and no round closes meanwhile (a rollback changes the round under it)."""
        async with self._lock:
            yield

    # -- failure / cancel ------------------------------------------------------------------
    async def fail_job(self, job: JobState, reason: str) -> None:
        await self.end_job(job, "failed", reason)

    async def end_job(self, job: JobState, state: str, reason: str | None = None) -> None:
        async with self._lock:
            await self._end_job(job, state, reason)

    async def _end_job(self, job: JobState, state: str, reason: str | None) -> None:
        if job.state not in ("queued", "running"):
            return
        leftovers = [a for s in job.shards.values() for a in s.live.values()]
        await self.store.end_job(job.id, state, reason, [a.id for a in leftovers])
        for a in leftovers:
            self.scheduler.detach(a)
        self.referee.forget_job(job.id)  # nobody is asked for a state of a job that ended
        job.end(state)
        job.error = reason
        self.signal.notify()
