"""The ledger: every change of the hub's state happens in its rooms, and nowhere else.

Each use case is one method of the room that owns it:

- ``registry`` (registry.py): node registration and presence;
- ``assignments`` (assignments.py): issuing assignments and their life (heartbeat, abandon, expiry),
  and the blobs a live assignment lets its node read;
- ``uploads`` (uploads.py): an update's upload and its acceptance;
- ``states`` (states.py): the checkpoint states the referee asks a node for;
- ``silos`` (silos.py): node-local data attached to a job;
- ``secagg`` (secagg.py): secure aggregation's steps;
- ``jobs`` (jobs.py): submitting and cancelling a job;
- ``flags`` (flags.py): an auditor's verdict on a flag;
- ``cooldowns`` (cooldowns.py): a ban's block cooldowns, listed and lifted by the operator.
- ``rollbacks`` (rollbacks.py): a job rolled back to a kept model.
- ``pipelines`` (hub/domain/pipelines/): a pipelined job's generations, checkpoints and reports.

A use case checks what it is given, asks the pure policy for a decision (hub/domain/scheduler.py:
which shard; hub/policy/settlement.py: does a lone update settle its shard; hub/policy/verification.py:
which verdict), writes the decision through ONE `Store` call (one transaction) and then applies it
to the in-memory working state (`Scheduler`: jobs, nodes, live assignments). When the write fails,
memory is left as it was (or put back), so memory never runs ahead of what survives a restart.
Routes, the console, the CLI and the benches call these methods; none of them writes state itself.

Settling a replica group and closing a round are the round engine's (hub/domain/rounds.py), which
the ledger owns and which writes through the same store. `Ledger` builds the rooms over the one
working state and loads that state at start.

Everything here runs on the event loop; blocking work (ingest, hashing, fsync, aggregation) is
handed to threads by the callers of the store or by the engine.
"""

from __future__ import annotations

import logging
import time

from gpuflex.protocol.signing import SigningKey

from ...base.config import HubConfig
from ...model.relay import RelayRegistry
from ...policy.admission import Admission
from ...storage.auditlog import AuditLog
from ...storage.blobs import BlobStore
from ...storage.hub_key import audit_secret
from ...storage.store import Store
from ..metrics import HubMetrics
from ..pipelines import Pipelines
from ..rounds import RoundEngine
from ..scheduler import Scheduler
from ..worksignal import WorkSignal
from .assignments import Assignments, Issued
from .cooldowns import Cooldowns
from .flags import MOOT, Flags, Verdict
from .jobs import Jobs
from .registry import BANNED, Registry
from .rollbacks import AutoRollback, Rollbacks
from .secagg import SecureAggregation
from .silos import Silos
from .states import StateRequests
from .uploads import Uploads

__all__ = ["BANNED", "MOOT", "Issued", "Ledger", "Verdict"]

log = logging.getLogger("gpuflex.hub.ledger")


class Ledger:
    """The hub's working state (scheduler, round engine, admission) and the rooms that change it."""

    def __init__(self, *, config: HubConfig, store: Store, blobs: BlobStore, key: SigningKey,
                 scheduler: Scheduler, signal: WorkSignal, metrics: HubMetrics, audit: AuditLog,
                 relay: RelayRegistry | None = None) -> None:
        self.config = config
        self.store = store
        self.blobs = blobs
        self.key = key
        self.scheduler = scheduler
        self.signal = signal
        self.metrics = metrics
        self.audit = audit
        self.rounds = RoundEngine(store=store, blobs=blobs, scheduler=scheduler, metrics=metrics,
                                  signal=signal, audit=audit, audit_secret=audit_secret(key))
        self.admission = Admission(config)
        self.registry = Registry(config=config, store=store, scheduler=scheduler, admission=self.admission)
        self.assignments = Assignments(config=config, store=store, key=key, scheduler=scheduler, signal=signal,
                                       metrics=metrics)
        self.uploads = Uploads(config=config, store=store, scheduler=scheduler, metrics=metrics,
                               rounds=self.rounds, assignments=self.assignments)
        self.states = StateRequests(key=key, store=store, scheduler=scheduler, rounds=self.rounds)
        self.silos = Silos(store=store, scheduler=scheduler, signal=signal, rounds=self.rounds,
                           assignments=self.assignments)
        self.secagg = SecureAggregation(config=config, store=store, scheduler=scheduler, signal=signal,
                                        rounds=self.rounds, assignments=self.assignments, uploads=self.uploads)
        self.jobs = Jobs(store=store, blobs=blobs, scheduler=scheduler, signal=signal, rounds=self.rounds)
        self.flags = Flags(store=store, scheduler=scheduler, signal=signal, audit=audit, admission=self.admission)
        self.cooldowns = Cooldowns(config=config, store=store, audit=audit, admission=self.admission)
        self.rollbacks = Rollbacks(store=store, scheduler=scheduler, signal=signal, rounds=self.rounds, audit=audit)
        self.rounds.after_advance = AutoRollback(self.rollbacks)
        self.pipelines = Pipelines(config=config, store=store, blobs=blobs, key=key, scheduler=scheduler,
                                   signal=signal, relay=relay if relay is not None else RelayRegistry())

    async def load(self) -> None:
        """Rebuild the working state from the store: nodes, then every active job's round."""
        loaded = await self.store.load()
        now = time.time()
        for node in loaded.nodes:
            self.registry.restore(node, now)
        self.cooldowns.restore(loaded.lifts)
        for job in loaded.jobs:
            if job.secagg is not None and job.shards:
                # what the protocol held was in memory: the round closes unchanged, the next one starts
                job.secagg.abort("the hub restarted during this round's secure aggregation; the round closes "
                                 "with the model unchanged")
            self.scheduler.add_job(job)
            self.rounds.poke(job.id)  # a round with every update in aggregates now
        for job_id, reason in loaded.broken:
            log.error("job %s cannot be resumed: %s", job_id, reason)
            await self.store.fail_job(job_id, f"cannot resume: {reason}")
        self.rounds.resume_referee(await self.store.referee_requests())
        await self.pipelines.load()
