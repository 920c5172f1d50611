"""A job's submission and cancellation, the project owner's use cases (ingest itself, validating
and chunking the data, is hub/domain/jobs.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from ...base.errors import NotFound
from ...model.job import JobState
from ...storage.blobs import BlobStore
from ...storage.store import Store
from ..jobs import ingest_job
from ..rounds import RoundEngine
from ..scheduler import Scheduler
from ..worksignal import WorkSignal


class Jobs:
    """Submitting a job (its first round opens) and cancelling one."""

    def __init__(self, *, store: Store, blobs: BlobStore, scheduler: Scheduler, signal: WorkSignal,
                 rounds: RoundEngine) -> None:
        self.store = store
        self.blobs = blobs
        self.scheduler = scheduler
        self.signal = signal
        self.rounds = rounds

    async def submit_job(self, owner: str, spec_text: bytes, train_path: Path | None,
                         val_path: Path | None, *, base_path: Path | None = None) -> JobState:
        """Validate, chunk and store a job (in a worker thread), then open its first round."""
        job = await asyncio.to_thread(ingest_job, self.store, self.blobs, owner=owner, spec_text=spec_text,
                                      train_path=train_path, val_path=val_path, base_path=base_path,
                                      nodes_online=self.scheduler.presence.online_nodes(time.time()))
        self.scheduler.add_job(job)
        self.signal.notify()
        return job

    async def cancel_job(self, job_id: str, by: str) -> str:
        """Cancel a queued or running job; returns the state it ends in."""
        job = self.scheduler.jobs.get(job_id)
        if job is not None and job.active:
            await self.rounds.end_job(job, "cancelled", f"cancelled by {by}")
            return "cancelled"
        state = await self.store.job_state(job_id)
        if state is None:
            raise NotFound(f"no job {job_id}", code="unknown_job")
        if state in ("queued", "running"):  # stored as active but not loaded (it could not be resumed)
            await self.store.end_job(job_id, "cancelled", f"cancelled by {by}", ())
            return "cancelled"
        return state
