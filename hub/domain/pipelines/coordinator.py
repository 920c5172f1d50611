"""The pipeline coordinator: the ledger's room for pipelined jobs (the ``pipelines`` room).

A running pipelined job with no live generation is planned (planning.py) over the idle online
nodes; the planned nodes are handed their signed StageAssignment on their next ``/v1/work``; the
relay's plan (``RelayRegistry``) follows the live generation. Stages report each step (their
liveness) and checkpoint their units' states; the committed step advances when every unit has
a state at a step, and at the last step the final model is assembled and the job is done. A
lost stage (silent past ``stage_timeout_s``, a ``failed`` report, its node barred) ends the
generation, and the next one resumes from the committed step. After a restart the store holds
the committed step and the unit states; the pipeline resumes in a new generation.

Each use case checks, writes through ONE store call, then changes memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

from gpuflex.protocol.jobspec import TrainSpec
from gpuflex.protocol.messages import Ack, StageReport, UnitCheckpoint
from gpuflex.protocol.signing import SigningKey, seal

from ...base.config import HubConfig
from ...base.errors import BadRequest, Conflict, Forbidden, NotFound, PayloadTooLarge
from ...model.job import JobState
from ...model.node import NodeState, RelayLink
from ...model.pipeline import Generation, PipelineState, StepReport, UnitRecord
from ...model.relay import RelayRegistry
from ...policy.pipeline_plan import NodeOffer
from ...storage.blobs import BlobStore
from ...storage.store import Store
from ..scheduler import Scheduler
from ..worksignal import WorkSignal
from .assembly import assemble_model
from .checkpoints import Entries, committed_after, is_checkpoint_step, max_state_bytes
from .generations import new_generation, relay_plan, stage_assignment, stage_units
from .joins import JoinWatch
from .liveness import lost_stage
from .offers import ModelCut, benchmark_flops, cut_model, offer_of, reference_flops_per_sample
from .planning import choose_pipeline
from .resharding import state_bytes_moved
from .speeds import note_step
from .verify import StageChecks

log = logging.getLogger("gpuflex.hub.pipelines")
#: the finished jobs whose last generation's reports are still recorded
FINISHED_KEPT = 256
#: a node counts as asking for work this long past its poll's longest wait and the retry it is told
ASK_GRACE_S = 5.0


def relay_gone(nodes: Mapping[str, NodeState], node_id: str) -> float | None:
    """When the node's relay connections went away with no request of it since
    (``RelayLink.gone_at``), or None."""
    node = nodes.get(node_id)
    return None if node is None else node.relay.gone_at(node.last_seen)


@dataclass(frozen=True)
class CheckpointTarget:
    """What a unit's checkpoint body must be: the unit's name, entries, the job's training
    settings (its optimizer's state) and the most bytes it can take."""

    unit_name: str
    entries: Entries
    train: TrainSpec
    max_bytes: int


class Pipelines:
    """Every running pipelined job's pipeline (``jobs``: job id -> its working state)."""

    def __init__(
        self,
        *,
        config: HubConfig,
        store: Store,
        blobs: BlobStore,
        key: SigningKey,
        scheduler: Scheduler,
        signal: WorkSignal,
        relay: RelayRegistry,
    ) -> None:
        self.config = config
        self.store = store
        self.blobs = blobs
        self.key = key
        self.scheduler = scheduler
        self.signal = signal
        self.relay = relay
        self.jobs: dict[str, PipelineState] = {}
        self._cuts: dict[str, ModelCut | str] = {}
        self._lost: dict[str, float] = {}  # node id -> until when it is not planned again
        #: node id -> when it last asked for work (a node that asks is one a stage can be handed to)
        self._asked: dict[str, float] = {}
        #: job id -> the generation that finished it: its stages' last reports still count
        self._finished: dict[str, Generation] = {}
        self.joins = JoinWatch(gain=config.replan_gain)
        self._wake = asyncio.Event()
        self._due = math.inf  # a moment a poke asked to tick at
        self._lock = asyncio.Lock()
        #: the sampled stages' work re-executed by the referee (verify.py)
        self.checks = StageChecks(store=store, blobs=blobs, scheduler=scheduler, on_flag=self.poke)

    # -- start and the loop ------------------------------------------------------------------
    async def load(self) -> None:
        """The running pipelined jobs' durable state: each resumes from its committed step in a
        new generation (the one before ended with the hub)."""
        for loaded in await self.store.load_pipelines():
            job = self.scheduler.jobs.get(loaded.job_id)
            if job is None or job.spec.pipeline is None:
                continue
            state = self._track(job)
            state.committed_step = loaded.committed_step
            state.generations = loaded.generations
            state.previous = loaded.last
            for r in loaded.states:
                state.states.setdefault(r.step, {})[r.unit] = r
            if loaded.last is not None:
                state.replan_reason = (
                    f"the hub restarted: generation {loaded.last.number} ended with it; resuming"
                    f" from step {loaded.committed_step}"
                )

    def poke(self, at: float | None = None) -> None:
        """Tick now; or at ``at`` (``time.time()``), when that comes before the next sweep (a
        node's relay connections closed: its stage is lost once they have been closed GONE_S)."""
        if at is not None:
            self._due = min(self._due, at)
        self._wake.set()

    async def run(self) -> None:
        """Background loop: find lost stages and plan the jobs that wait, every sweep interval,
        whenever poked, and at the moment a poke asked for."""
        while True:
            wait = min(self.config.sweep_interval_s, max(0.0, self._due - time.time()))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            self._wake.clear()
            if self._due <= time.time():
                self._due = math.inf
            await self.tick()

    async def tick(self, now: float | None = None) -> None:
        async with self._lock:
            for job in list(self.scheduler.jobs.values()):
                if job.spec.pipeline is None:
                    continue
                if not job.active:
                    self._drop(job.id)
                    continue
                try:
                    await self._tick_job(
                        job,
                        self.jobs.get(job.id) or self._track(job),
                        time.time() if now is None else now,
                    )
                except Exception as exc:  # one job's trouble must not stop the others
                    log.exception("the pipeline of job %s failed to plan", job.id)
                    self.jobs[job.id].refusal = f"planning failed: {exc}".splitlines()[0]

    async def _tick_job(self, job: JobState, state: PipelineState, now: float) -> None:
        # every unit's last state is committed, but the job did not finish (a restart between)
        if state.committed_step >= state.end_step:
            await self._finish(job, state)
            return
        g = state.generation
        if g is not None:
            spec = job.spec.pipeline
            lost = lost_stage(
                g,
                state.last_report,
                state.reports,
                now,
                self.config.stage_timeout_s,
                self._barred,
                checkpoint_every=spec.checkpoint_every if spec is not None else 0,
                seen=self._seen,
                gone=partial(relay_gone, self.scheduler.nodes),
            )
            if lost is not None:
                await self._end_generation(job, state, lost[1], now, lost_node=lost[0])
            elif (
                joined := await self.joins.due(
                    job,
                    state,
                    g,
                    self.known_cut(job.id),
                    self.idle_offers,
                    self.scheduler.nodes,
                    now,
                )
            ) is not None:
                # the joining node and the live generation's nodes: planned at once
                await self._end_generation(job, state, joined.reason, now)
                g = new_generation(job, state, joined.pipeline, reason=joined.reason, now=now)
                await self.store.save_generation(g, now=now)
                cut = await self.cut(job)
                if isinstance(cut, ModelCut):
                    self._start(job, state, g, cut, now)
                return
            else:
                return
        await self._plan(job, state, now)

    def _track(self, job: JobState) -> PipelineState:
        if job.spec.pipeline is None:
            raise ValueError(f"job {job.id} is not pipelined")
        state = self.jobs[job.id] = PipelineState(job.id, 0, job.spec.pipeline.steps)
        return state

    def _drop(self, job_id: str) -> None:
        self._cuts.pop(job_id, None)
        self.joins.forget(job_id)
        if self.jobs.pop(job_id, None) is not None:
            self.relay.drop(job_id)
            self.checks.drop(job_id)

    def _seen(self, node_id: str) -> float:
        node = self.scheduler.nodes.get(node_id)
        return 0.0 if node is None else node.last_seen

    def _barred(self, node_id: str) -> bool:
        node = self.scheduler.nodes.get(node_id)
        return node is None or node.barred

    # -- planning ------------------------------------------------------------------------------
    async def cut(self, job: JobState) -> ModelCut | str:
        """The job's model cut into units (kept: a spec never changes), or why it does not cut."""
        cut = self._cuts.get(job.id)
        if cut is None:
            cut = self._cuts[job.id] = await asyncio.to_thread(cut_model, job.spec)
        return cut

    def known_cut(self, job_id: str) -> ModelCut | None:
        """The job's model cut, once planning made it (None before, or when it does not cut)."""
        cut = self._cuts.get(job_id)
        return cut if isinstance(cut, ModelCut) else None

    def idle_offers(self, flops_per_sample: float, now: float) -> list[NodeOffer]:
        """The offers of the idle nodes: online and asking for work (a ``/v1/work`` poll within
        ``long_poll_max_s + node_poll_s + ASK_GRACE_S``), not barred, with no live data-parallel
        assignment, no stage of a live generation, not lost moments ago, and a memory offer."""
        busy = {
            s.node_id for st in self.jobs.values() if st.generation for s in st.generation.stages
        }
        asking = self.config.long_poll_max_s + self.config.node_poll_s + ASK_GRACE_S
        for node_id in [n for n, until in self._lost.items() if until <= now]:
            del self._lost[node_id]
        return [
            offer_of(n, flops_per_sample)
            for n in sorted(self.scheduler.nodes.values(), key=lambda n: n.id)
            if not n.barred
            and not n.live
            and n.id not in busy
            and n.max_memory_bytes > 0
            and now - self._asked.get(n.id, -math.inf) <= asking
            and self._lost.get(n.id, 0.0) <= now
        ]

    async def _plan(self, job: JobState, state: PipelineState, now: float) -> None:
        spec = job.spec.pipeline
        cut = await self.cut(job)
        if spec is None or isinstance(cut, str):
            state.refusal = cut if isinstance(cut, str) else "the job is not pipelined"
            return
        state.units = len(cut.costs)
        flops = await asyncio.to_thread(reference_flops_per_sample)
        offers = self.idle_offers(benchmark_flops(self.scheduler.nodes.values(), flops), now)
        over = tuple((o.node_id, o.memory_bytes) for o in offers)
        if state.refusal is not None and over == state.refused_over:
            return  # the same nodes the planner refused a moment ago
        chosen = await asyncio.to_thread(
            choose_pipeline,
            cut.costs,
            offers,
            spec,
            batch_size=job.spec.train.batch_size,
            previous=state.previous,
        )
        if isinstance(chosen, str):
            state.refusal, state.refused_over = chosen, over
            return
        if state.generation is not None or not job.active:
            return
        g = new_generation(job, state, chosen, reason=state.replan_reason, now=now)
        await self.store.save_generation(g, now=now)
        self._start(job, state, g, cut, now)

    def _start(
        self, job: JobState, state: PipelineState, g: Generation, cut: ModelCut, now: float
    ) -> None:
        """Generation ``g`` (stored) goes live: its stages' signed assignments, the relay's plan."""
        nodes = self.scheduler.nodes
        state.sealed = {
            slot.node_id: seal(self.key, stage_assignment(job, state, g, s, nodes, now=now))
            for s, slot in enumerate(g.stages)
        }
        committed = state.committed_states()
        state.named = {
            slot.node_id: frozenset(
                committed[u].sha for u in range(slot.unit_start, slot.unit_end) if u in committed
            )
            for slot in g.stages
        }
        state.state_bytes_moved = state_bytes_moved(state.previous, g, committed)
        state.state_bytes_served = 0
        state.generation = state.previous = g
        state.generations = g.number
        state.refusal, state.refused_over = None, None
        state.handed = set()
        state.reports = {}
        state.last_report = dict.fromkeys(range(len(g.stages)), now)
        spec = job.spec.pipeline
        boundary = (spec.boundary, spec.boundary_rank) if spec is not None else ("fp32", 0)
        self.relay.assign(job.id, relay_plan(g, cut, *boundary))
        self.checks.start(job, g, committed if g.first_step > 0 else {})
        self.signal.notify()  # the planned nodes' long-polls take their stages now
        log.info(
            "job %s: pipeline generation %d from step %d (%s)",
            job.id,
            g.number,
            g.first_step,
            g.reason,
        )

    async def _end_generation(
        self,
        job: JobState,
        state: PipelineState,
        reason: str,
        now: float,
        *,
        lost_node: str | None = None,
    ) -> None:
        """The live generation is over (a lost or failed stage); the next resumes from the
        committed step."""
        g = state.generation
        if g is None:
            return
        await self.store.end_generation(job.id, g.number, now=now)
        state.generation = None
        state.sealed = {}
        state.named = {}
        state.reports = {}
        state.last_report = {}
        state.replan_reason = reason
        self.relay.drop(job.id)
        self.checks.drop(job.id)
        if lost_node is not None:
            self._lost[lost_node] = now + self.config.stage_timeout_s
        self.poke()
        log.warning("job %s: pipeline generation %d ended: %s", job.id, g.number, reason)

    # -- the work poll -------------------------------------------------------------------------
    def stage_for(self, node: NodeState) -> bytes | None:
        """``node``'s signed StageAssignment of a live generation, handed once; None otherwise.
        Called on each of the node's ``/v1/work`` polls: the node is asking for work."""
        now = time.time()
        self._asked[node.id] = now
        for state in self.jobs.values():
            g = state.generation
            if g is None or node.id not in state.sealed:
                self.poke()  # a job waits for nodes, or may run faster with this one
            if g is None:
                continue
            if node.id in state.sealed and node.id not in state.handed:
                state.handed.add(node.id)
                node.relay = RelayLink()  # the takes of its last stage do not count for this one
                stage = g.stage_of(node.id)
                if stage is not None:
                    state.last_report[stage] = now  # its silence counts from now
                return state.sealed[node.id]
        return None

    def holds_stage(self, node: NodeState) -> bool:
        """Does ``node`` run a stage of a live generation (it gets no data-parallel work)?"""
        return any(st.generation is not None and node.id in st.sealed for st in self.jobs.values())

    def may_read_blob(self, node: NodeState, sha: str) -> bool:
        """A stage's node reads its job's model and chunks, and the unit states its
        StageAssignment names."""
        for state in self.jobs.values():
            job = self.scheduler.jobs.get(state.job_id)
            if state.generation is None or node.id not in state.sealed or job is None:
                continue
            if sha == job.model_hash or sha in job.by_sha or sha in state.named.get(node.id, ()):
                return True
        return False

    # -- checkpoints ---------------------------------------------------------------------------
    def _live(self, job_id: str, generation: int) -> tuple[JobState, PipelineState, Generation]:
        """The running pipelined job and its live generation ``generation``: NotFound for a job
        this hub has no pipeline of, Conflict (``stale_generation``) for another generation."""
        job = self.scheduler.jobs.get(job_id)
        if job is None or job.spec.pipeline is None:
            raise NotFound(f"no pipelined job {job_id} on this hub", code="unknown_job")
        state = self.jobs.get(job_id)
        g = None if state is None else state.generation
        if not job.active or state is None or g is None or g.number != generation:
            now = (
                "the job is over"
                if not job.active
                else ("it waits for nodes" if g is None else f"it runs generation {g.number}")
            )
            raise Conflict(
                f"generation {generation} of job {job_id}'s pipeline is over ({now}):"
                " stop the stage and ask for work",
                code="stale_generation",
            )
        return job, state, g

    def checkpoint_target(self, node: NodeState, msg: UnitCheckpoint) -> CheckpointTarget:
        """What ``msg``'s body must be, once ``node`` may send it (checked before the body is read)."""
        job, _, g = self._live(msg.job_id, msg.generation)
        if msg.stage >= len(g.stages) or g.stages[msg.stage].node_id != node.id:
            raise Forbidden(
                f"this node does not run stage {msg.stage} of generation {g.number}",
                code="not_your_stage",
            )
        if g.lane_of(msg.stage)[0] > 0:
            raise Forbidden(
                f"stage {msg.stage} is in pipeline {g.lane_of(msg.stage)[0]} of {g.lanes}: every"
                " pipeline holds the same state, and pipeline 0 checkpoints it",
                code="not_your_unit",
            )
        if msg.unit not in stage_units(g, msg.stage):
            raise Forbidden(
                f"unit {msg.unit} is not in stage {msg.stage} (units"
                f" {g.stages[msg.stage].unit_start} to {g.stages[msg.stage].unit_end - 1})",
                code="not_your_unit",
            )
        pipeline = job.spec.pipeline
        every = 1 if pipeline is None else pipeline.checkpoint_every
        if not is_checkpoint_step(
            msg.step, first_step=g.first_step, end_step=g.end_step, every=every
        ):
            raise BadRequest(
                f"step {msg.step} is not a checkpoint step of generation {g.number} (a"
                f" multiple of {every}, or {g.end_step}, after {g.first_step})",
                code="not_a_checkpoint_step",
            )
        cut = self._cuts.get(job.id)
        if not isinstance(cut, ModelCut):
            raise Conflict("the job's model is not cut yet", code="stale_generation")
        limit = max_state_bytes(cut.entries[msg.unit], job.spec.train)
        if msg.size > limit:
            raise PayloadTooLarge(
                f"unit {msg.unit}'s state is at most {limit} bytes, not {msg.size}",
                code="too_large",
            )
        return CheckpointTarget(cut.names[msg.unit], cut.entries[msg.unit], job.spec.train, limit)

    async def accept_checkpoint(self, node: NodeState, msg: UnitCheckpoint) -> str:
        """Record a unit's state (its blob is stored, checked, durable); the committed step moves
        when it completes a step; at the last step the job is done."""
        job, state, g = self._live(msg.job_id, msg.generation)
        if g.stages[msg.stage].node_id != node.id:
            raise Forbidden(f"this node does not run stage {msg.stage}", code="not_your_stage")
        at = state.states.setdefault(msg.step, {})
        before = at.get(msg.unit)
        at[msg.unit] = UnitRecord(msg.unit, msg.step, msg.sha256, msg.size)
        committed = committed_after(state, msg.step)
        try:
            await self.store.save_unit_state(
                job.id,
                at[msg.unit],
                generation=g.number,
                node_id=node.id,
                now=time.time(),
                committed=committed,
            )
        except BaseException:
            if before is None:
                at.pop(msg.unit, None)
            else:
                at[msg.unit] = before
            raise
        if committed is None:
            return f"unit {msg.unit}'s state at step {msg.step} is stored"
        state.committed_step = committed
        self.checks.durable(job.id, g.number, committed, state.states[committed])
        if self.joins.waiting(job.id):
            self.poke()  # a joining node's re-plan goes ahead now, redoing the least
        for step in [s for s in state.states if s < committed]:
            del state.states[step]
        if committed >= state.end_step:
            await self._finish(job, state)
            return f"step {committed} is committed: the pipeline is done and the model assembled"
        return f"step {committed} is committed"

    async def _finish(self, job: JobState, state: PipelineState) -> None:
        """Every unit has its state at the last step: the model is assembled and the job done."""
        sha, size = await asyncio.to_thread(
            assemble_model, self.blobs, job, state.states[state.end_step]
        )
        await self.store.finish_pipeline(job.id, sha, size, now=time.time())
        job.model_hash, job.model_size = sha, size
        job.note_model(1, sha)
        job.end("done")
        if state.generation is not None:
            self._finished[job.id] = state.generation
            while len(self._finished) > FINISHED_KEPT:
                del self._finished[next(iter(self._finished))]
        self._drop(job.id)
        self.signal.notify()

    # -- reports -------------------------------------------------------------------------------
    async def report(self, node: NodeState, msg: StageReport) -> Ack:
        """A stage's report of a step: recorded, and its liveness. ok=False: the generation is
        over (or the stage failed and the hub re-plans): stop and ask for work."""
        try:
            job, state, g = self._live(msg.job_id, msg.generation)
        except Conflict as exc:
            done = self._finished.get(msg.job_id)
            if done is not None and done.number == msg.generation:
                await self._record_last(node, msg, done)
            return Ack(ok=False, detail=exc.detail[:256], deadline=0.0)
        if msg.stage >= len(g.stages) or g.stages[msg.stage].node_id != node.id:
            raise Forbidden(
                f"this node does not run stage {msg.stage} of generation {g.number}",
                code="not_your_stage",
            )
        if not g.first_step <= msg.steps_done <= g.end_step:
            raise BadRequest(
                f"steps_done {msg.steps_done} is outside generation {g.number}'s steps"
                f" ({g.first_step} to {g.end_step})",
                code="bad_step",
            )
        if msg.update_s > msg.compute_s:
            raise BadRequest(
                f"update_s {msg.update_s:g} is more than the step's compute_s {msg.compute_s:g}",
                code="bad_report",
            )
        now = time.time()
        if msg.failed:
            await self._end_generation(
                job, state, f"stage {msg.stage} ({node.id}) stopped: {msg.failed}", now
            )
            return Ack(
                ok=False, detail="the stage stopped; the hub re-plans: ask for work", deadline=0.0
            )
        report = StepReport(
            g.number,
            msg.stage,
            node.id,
            msg.steps_done,
            msg.step_s,
            msg.compute_s,
            g.step_s,
            msg.loss,
            now,
            msg.update_s,
            msg.unit_overhead_s,
        )
        await self.store.save_stage_report(job.id, report)
        if state.generation is not g:
            return Ack(
                ok=False, detail=f"generation {g.number} is over: ask for work", deadline=0.0
            )
        state.reports[msg.stage] = report
        state.last_report[msg.stage] = now
        note_step(node, self.known_cut(job.id), g, report)
        return Ack(ok=True, detail=f"step {msg.steps_done} recorded", deadline=0.0)

    async def _record_last(self, node: NodeState, msg: StageReport, g: Generation) -> None:
        """A stage's report of the last step, which came after the step finished the job."""
        owns = msg.stage < len(g.stages) and g.stages[msg.stage].node_id == node.id
        if (
            owns
            and msg.steps_done == g.end_step
            and not msg.failed
            and (msg.loss is None or math.isfinite(msg.loss))
        ):
            await self.store.save_stage_report(
                msg.job_id,
                StepReport(
                    g.number,
                    msg.stage,
                    node.id,
                    msg.steps_done,
                    msg.step_s,
                    msg.compute_s,
                    g.step_s,
                    msg.loss,
                    time.time(),
                ),
            )


__all__ = ["CheckpointTarget", "Pipelines"]
