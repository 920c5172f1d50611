"""Node-local data (silos): a node attaches its own data to a node-local job, and withdraws it.
The hub never sees a row: it knows a silo's blob id, size, sample count and, when the job asks
for it and the node shares it, its label histogram (docs/silos.md)."""

from __future__ import annotations

import time

from gpuflex.protocol.messages import SiloRegistration, SiloSchema, SiloWithdrawal

from ...base.errors import Conflict, NotFound, Unprocessable
from ...model.job import ChunkInfo, JobState
from ...model.node import NodeState
from ...storage.store import Store
from ..jobs import silo_size_bounds
from ..rounds import RoundEngine
from ..scheduler import Scheduler
from ..worksignal import WorkSignal
from .assignments import Assignments


class Silos:
    """The silos of node-local jobs: what one must hold (``silo_schema``), attaching one
    (``attach_silo``) and withdrawing it (``withdraw_silo``)."""

    def __init__(self, *, store: Store, scheduler: Scheduler, signal: WorkSignal, rounds: RoundEngine,
                 assignments: Assignments) -> None:
        self.store = store
        self.scheduler = scheduler
        self.signal = signal
        self.rounds = rounds
        self.assignments = assignments

    def _silo_job(self, job_id: str) -> JobState:
        """A running node-local job; NotFound / Conflict otherwise."""
        job = self.scheduler.jobs.get(job_id)
        if job is None or not job.active:
            raise NotFound(f"no running job {job_id}", code="unknown_job")
        if not job.node_local:
            raise Conflict(f"job {job_id} trains on data uploaded to the hub; it takes no silos",
                           code="not_node_local")
        return job

    def silo_schema(self, node: NodeState, job_id: str) -> SiloSchema:
        """What a silo of ``job_id`` must hold (its model's input and outputs, the sample bounds)."""
        job = self._silo_job(job_id)
        d = job.spec.data
        idx = job.silo_of.get(node.id)
        return SiloSchema(job_id=job.id, model_spec=job.spec.model.to_dict(), min_samples=d.min_samples,
                          max_samples=d.max_samples, label_column=d.label_column,
                          label_histogram=d.label_histogram, attached="" if idx is None else job.chunks[idx].sha)

    async def attach_silo(self, node: NodeState, msg: SiloRegistration) -> str:
        """A node's silo joins a node-local job (durably, before the 2xx); what the hub knows of
        it is the blob id, the size, the sample count and, if shared, the label histogram."""
        job = self._silo_job(msg.job_id)
        d, mspec = job.spec.data, job.spec.model
        if not d.min_samples <= msg.samples <= d.max_samples:
            raise Unprocessable(f"a silo of job {job.id} holds {d.min_samples}..{d.max_samples} samples; "
                                f"this one claims {msg.samples}", code="bad_silo")
        low, high = silo_size_bounds(mspec, msg.samples)
        if not low <= msg.size <= high:
            raise Unprocessable(f"a silo of {msg.samples} samples encodes to {low}..{high} bytes for this "
                                f"model; this one claims {msg.size}", code="bad_silo")
        histogram: tuple[int, ...] | None = None
        if msg.label_histogram:
            if not d.label_histogram:
                raise Unprocessable(f"job {job.id} does not ask for label histograms; send none",
                                    code="bad_silo")
            if mspec.task != "classification" or len(msg.label_histogram) != mspec.outputs \
                    or sum(msg.label_histogram) != msg.samples:
                raise Unprocessable(f"a label histogram has {mspec.outputs} counts that sum to the sample "
                                    f"count ({msg.samples})", code="bad_silo")
            histogram = tuple(msg.label_histogram)
        owner = job.chunks[i].owner if (i := job.by_sha.get(msg.sha256)) is not None else None
        if owner is not None and owner != node.id:
            raise Conflict("another node attached a silo with this blob id to the job", code="silo_taken")
        current = job.silo_of.get(node.id)
        if current is not None and job.chunks[current].sha == msg.sha256:
            return "attached already"
        if current is not None and current not in job.free and any(
                current in s.chunk_idxs and s.state == "open" for s in job.shards.values()):
            raise Conflict("this node's silo is being trained in the current round; attach the new one "
                           "after its update is in", code="silo_busy")
        idx = len(job.chunks) if current is None else current
        await self.store.save_silo(job.id, ChunkInfo(idx, msg.sha256, msg.samples, msg.size, node.id),
                                   histogram=histogram, now=time.time())
        job.attach_silo(node.id, msg.sha256, msg.samples, msg.size)
        self.signal.notify()
        return "replaced" if current is not None else "attached"

    async def withdraw_silo(self, node: NodeState, msg: SiloWithdrawal) -> str:
        """The node's operator removed its silo ``msg.sha256`` (durably, before the 2xx): the hub
        stops assigning it, ends the node's live assignment of it (as an abandon does: a round with
        secure aggregation counts the node as dropped), and no round waits for it. Idempotent; a
        blob id that is not the node's current silo of the job changes nothing."""
        job = self._silo_job(msg.job_id)
        idx = job.silo_of.get(node.id)
        if idx is None or job.chunks[idx].sha != msg.sha256:
            return "not attached: nothing to withdraw"
        live = [a for a in self.scheduler.assignments.values()
                if a.node_id == node.id and a.job_id == job.id and msg.sha256 in a.chunk_shas]
        if any(a.uploading for a in live):
            raise Conflict("this silo's update is being uploaded; withdraw it once the upload ends",
                           code="busy")
        await self.store.withdraw_silo(job.id, idx, [a.id for a in live])
        for a in live:
            self.assignments.release(a)
        job.withdraw_silo(node.id)
        self.rounds.poke(job.id)  # a round that waited for this silo may close now
        self.signal.offer()
        return "withdrawn" + (f"; its assignment {live[0].id} ended" if live else "")
