"""A job rolled back to a kept model, the project owner's use case: the one path for the API, the
console and the CLI. Which model, and when it is refused, is hub/policy/rollback.py's; here the
store records it (one transaction), the audit log gets its entry first (as a verdict's), and
memory follows: the open round's live assignments are let go and the next round opens on the
restored model, under the round engine's lock, so no shard settles and no round closes meanwhile."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ...base.errors import BadRequest, Conflict, HubError, NotFound
from ...model.job import JobState
from ...policy import rollback
from ...storage.auditlog import AuditLog
from ...storage.store import Store
from ...storage.tokens import Principal
from ..rounds import RoundEngine
from ..scheduler import Scheduler
from ..worksignal import WorkSignal

log = logging.getLogger("gpuflex.hub.ledger")

#: refusals that are the request's fault (400); the others are the job's state (409)
_BAD_REQUEST = ("bad_rollback", "bad_round")


class Rollbacks:
    """Rolling a job back, before a node's first unverified update or to a round."""

    def __init__(self, *, store: Store, scheduler: Scheduler, signal: WorkSignal, rounds: RoundEngine,
                 audit: AuditLog) -> None:
        self.store = store
        self.scheduler = scheduler
        self.signal = signal
        self.rounds = rounds
        self.audit = audit

    async def roll_back(self, who: Principal, job_id: str, *, before_node: str | None = None,
                        to_round: int | None = None, oldest_kept: bool = False) -> dict[str, Any]:
        """Restore the kept model (policy.decide says which; ``oldest_kept``: fall back to the oldest
        kept model when the one before the node's first unverified round is gone) and continue the
        job from it. The caller has checked that ``who`` may act on the job. Returns what was done,
        as the API shows it (``partial``: some of the node's unverified rounds, ``unverified_left``,
        stay in the model)."""
        who.require("owner")
        if before_node is not None and before_node not in self.scheduler.nodes:
            raise NotFound(f"no node {before_node}", code="unknown_node")
        async with self.rounds.held():
            history = await self.store.rollback_history(job_id)
            if history is None:
                raise NotFound(f"no job {job_id}", code="unknown_job")
            plan = rollback.decide(history, before_node=before_node, to_round=to_round, oldest_kept=oldest_kept)
            if isinstance(plan, rollback.Refused):
                raise (BadRequest if plan.code in _BAD_REQUEST else Conflict)(plan.detail, code=plan.code)
            kept = await self.store.kept_model(job_id, plan.to_round)
            if kept is None:  # let go since the history was read (not under this lock: a close prunes)
                raise Conflict(f"the model of round {plan.to_round} of job {job_id} is no longer kept",
                               code="round_not_kept")
            model_hash, opt_state_sha = kept
            job = self.scheduler.jobs.get(job_id)
            leftovers = [a for s in job.shards.values() for a in s.live.values()] if job is not None else []
            done = {"job_id": job_id, "restored_round": plan.to_round, "round": plan.new_round,
                    "rounds": plan.rounds, "rolled_back": list(plan.undone), "model_hash": model_hash,
                    "before_node": plan.node_id, "partial": plan.partial,
                    "unverified_left": list(plan.unverified_left), "by": who.name}
            await asyncio.to_thread(self.audit.append, "rollback", done)
            await self.store.roll_back(job_id, plan, model_hash=model_hash, opt_state_sha=opt_state_sha,
                                       cancelled=[a.id for a in leftovers], now=time.time())
            for a in leftovers:
                self.scheduler.detach(a)
            self.rounds.referee.forget_job(job_id)  # nobody is asked for a state of the abandoned round
            if job is None:  # a done job this hub did not load: it is running again
                loaded = await self.store.load_job(job_id)
                if loaded is not None:
                    self.scheduler.add_job(loaded)
            else:
                _reopen(job, plan, model_hash, opt_state_sha)
        self.rounds.poke(job_id)
        self.signal.notify()
        return done


class AutoRollback:
    """``[verification] auto_rollback``: after the engine advanced a job that opted in, a node
    suspended or banned since it last looked whose unverified updates are in the model has the
    job rolled back before its first one, by the hub (the audit entry says so). The job opted in
    to have forged work undone, so when that round's model is no longer kept it falls back to the
    oldest kept model (``oldest_kept``: a partial rollback, logged with the rounds it leaves in).
    One look per change of the set of stopped nodes, at the node whose unverified work starts
    earliest (and, when no kept model undoes any of it, at the next one); a refusal is logged, never
    the job's failure."""

    #: who an automatic rollback is recorded as
    HUB = Principal(token_id=0, role="admin", name="hub (auto_rollback)")

    def __init__(self, rollbacks: Rollbacks) -> None:
        self.rollbacks = rollbacks
        self._seen: dict[str, frozenset[str]] = {}  # job id -> the stopped nodes it was checked against

    async def __call__(self, job: JobState) -> None:
        if not job.spec.verification.auto_rollback or job.state not in ("running", "done"):
            return
        nodes = self.rollbacks.scheduler.nodes.values()
        stopped = frozenset(n.id for n in nodes if n.suspended or n.reputation.banned)
        if self._seen.get(job.id) == stopped:
            return
        self._seen[job.id] = stopped
        history = await self.rollbacks.store.rollback_history(job.id)
        if history is None:
            return
        first = sorted((rounds[0], node) for node in stopped if (rounds := rollback.unverified_rounds(history, node)))
        for round_, node in first:  # the earliest first: it undoes the later ones' rounds after it too
            try:
                done = await self.rollbacks.roll_back(self.HUB, job.id, before_node=node, oldest_kept=True)
            except HubError as exc:
                log.warning("automatic rollback of job %s before node %s refused: %s", job.id, node, exc)
                if exc.code == "round_not_kept":
                    continue  # none of its rounds within a kept model's reach: the next node's may be
                return
            if done["partial"]:
                log.warning("automatic rollback of job %s before node %s is partial: round %d's model is no longer"
                            " kept, restored round %d's; its unverified rounds %s stay in the model", job.id,
                            node, round_, done["restored_round"], done["unverified_left"])
            return


def _reopen(job: JobState, plan: rollback.Rollback, model_hash: str, opt_state_sha: str | None) -> None:
    """Memory follows the store: the job runs round ``plan.new_round`` on the restored model."""
    job.state = "running"
    job.error = None
    job.round, job.rounds = plan.new_round, plan.rounds
    job.model_hash, job.opt_state_sha = model_hash, opt_state_sha
    job.note_model(job.round, model_hash)
    job.open_round()
