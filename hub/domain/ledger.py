"""The ledger: every change of the hub's state happens here, and nowhere else.

Each use case is one method. It checks what it is given, asks the pure policy for
a decision (hub/domain/scheduler.py: which shard; hub/policy/verification.py: which verdict),
writes the decision through ONE `Store` call (one transaction) and then applies it
to the in-memory working state (`Scheduler`: jobs, nodes, live assignments). When
the write fails, memory is left as it was (or put back), so memory never runs
ahead of what survives a restart. Routes, the console, the CLI and the benches call
these methods; none of them writes state itself.

Settling a replica group and closing a round are the round engine's
(hub/domain/rounds.py), which the ledger owns and which writes through the same store.

Everything here runs on the event loop; blocking work (ingest, hashing, fsync,
aggregation) is handed to threads by the callers of the store or by the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuflex.protocol.messages import (
    Assignment,
    ChunkRef,
    Hello,
    SecAggKeys,
    SecAggMasked,
    SecAggShares,
    SecAggState,
    SecAggUnmask,
    SiloRegistration,
    SiloSchema,
    SiloWithdrawal,
    StateRequest,
    StateUnavailable,
    StateUpload,
    UpdateHeader,
    nested_to_dict,
)
from gpuflex.protocol.signing import SigningKey, fingerprint, seal
from gpuflex.protocol.version import PROTOCOL_VERSION

from ..base.config import HubConfig
from ..base.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    LengthRequired,
    NotFound,
    Unauthorized,
    Unprocessable,
)
from ..model.job import (
    AssignmentState,
    ChunkInfo,
    JobState,
    ShardState,
    StateRequestState,
    UpdateState,
    new_id,
)
from ..model.node import NodeState, clamp_sps, peak_flops
from ..policy import round_policy as policy
from ..policy.admission import Admission, address_block
from ..policy.progress import Progress, heartbeat_deadline, stall_backoff
from ..policy.secagg import SecAggRound
from ..policy.verification import is_trusted, record_verdict
from ..storage.auditlog import AuditLog, verdict_body
from ..storage.blobs import BlobStore
from ..storage.hub_key import audit_secret
from ..storage.store import FlagRecord, NodeProfile, Store
from ..storage.tokens import Principal
from .jobs import ingest_job, silo_size_bounds
from .metrics import HubMetrics
from .rounds import RoundEngine
from .scheduler import Plan, Scheduler
from .worksignal import WorkSignal

log = logging.getLogger("gpuflex.hub.ledger")

BANNED = "this node is banned from the hub after confirmed flags"
MOOT = "moot: the node was banned after confirmed flags; no verdict is needed"


@dataclass(frozen=True)
class Issued:
    """An assignment for a node: the signed bytes as sent, and the model it names."""

    sealed: bytes
    model_hash: str


@dataclass(frozen=True)
class Verdict:
    flag: FlagRecord
    node_banned: bool  # the node is banned now
    banned_by_this_verdict: bool  # ... and this verdict is what banned it


def _secagg_settings(job: JobState) -> dict[str, Any]:
    """An assignment's secure-aggregation settings (none unless the job asks for it)."""
    p = job.spec.privacy
    if not p.secure_aggregation:
        return {}
    return {"secagg": True, "secagg_clip": p.secagg_clip, "secagg_bits": p.secagg_bits,
            "secagg_max_samples": job.spec.data.max_samples}


class Ledger:
    def __init__(self, *, config: HubConfig, store: Store, blobs: BlobStore, key: SigningKey,
                 scheduler: Scheduler, signal: WorkSignal, metrics: HubMetrics, audit: AuditLog) -> None:
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
        self._verdicts = asyncio.Lock()
        self.admission = Admission(config)
        #: how long a secure-aggregation long-poll waits before it pokes the engine again (a step's
        #: deadline); the engine's own changes wake it at once (``secagg_wait``)
        self.secagg_recheck_s = 1.0
        self._progress: dict[str, Progress] = {}  # live assignment id -> the last progress proved

    def block_of(self, address: str | None) -> str:
        """The address block of a peer address (hub/policy/admission.py)."""
        return address_block(address, ipv4_prefix=self.config.ipv4_block_prefix,
                             ipv6_prefix=self.config.ipv6_block_prefix)

    # -- start -------------------------------------------------------------------------------
    async def load(self) -> None:
        """Rebuild the working state from the store: nodes, then every active job's round."""
        loaded = await self.store.load()
        now = time.time()
        for node in loaded.nodes:
            self.scheduler.nodes[node.id] = node
            self.scheduler.refresh_probation(node, now)
            self.admission.admitted(node.block, node.operator, node.registered_at)
            if node.banned:
                self.admission.banned(node.blocks, node.operator, node.banned_at or node.last_seen)
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

    # -- nodes -------------------------------------------------------------------------------
    async def register(self, signer: bytes, hello: Hello, *, address: str | None = None,
                       operator: str | None = None) -> NodeState:
        """Register a node, or refresh a known node's registration. ``address``: the peer address
        the request came from; ``operator``: 'op-<token id>' of a valid enrollment token it gave.
        A NEW identity must pass hub/policy/admission.py (rate limits, probation cap, ban cooldown)."""
        if hello.protocol_version != PROTOCOL_VERSION:
            raise Conflict(f"node speaks protocol {hello.protocol_version}, this hub speaks {PROTOCOL_VERSION};"
                           " upgrade the older side", code="version_mismatch")
        node_id = fingerprint(signer)
        node = self.scheduler.nodes.get(node_id)
        if node is not None and node.banned:
            raise Forbidden(BANNED, code="banned")
        now = time.time()
        block = self.block_of(address)
        if node is None:
            if self.config.require_enrollment and operator is None:
                raise Forbidden("this hub admits nodes only with an enrollment token: ask the hub's operator"
                                " for one and start the node with --enroll-token", code="enrollment_required")
            self.admission.check(block, operator, now)
            self.admission.admitted(block, operator, now)  # before the write: concurrent hellos count
        bench_sps = clamp_sps(hello.benchmark.samples_per_s)
        b = hello.benchmark
        profile = NodeProfile(
            software_version=hello.software_version,
            device={"kind": hello.device.kind, "name": hello.device.name,
                    "memory_bytes": hello.device.memory_bytes, "threads": hello.device.threads,
                    "max_memory_bytes": hello.max_memory_bytes},
            benchmark={"samples_per_s": b.samples_per_s, "matmul_tflops_fp32": b.matmul_tflops_fp32,
                       "matmul_tflops_bf16": b.matmul_tflops_bf16, "matmul_tflops_fp16": b.matmul_tflops_fp16,
                       "mem_bandwidth_gbs": b.mem_bandwidth_gbs, "h2d_gbs": b.h2d_gbs, "d2h_gbs": b.d2h_gbs,
                       "reference_model": b.reference_model, "precision_sps": dict(b.precision_sps)},
            compute=nested_to_dict(hello.compute))
        await self.store.save_node(node_id, signer, profile, bench_sps=bench_sps, now=now, address_block=block,
                                   operator=operator)
        if node is None:
            # the self-reported benchmark only seeds a bounded guess; deliveries set the throughput
            seed = min(bench_sps, self.config.bench_seed_max_sps)
            node = NodeState(id=node_id, public_key=signer, bench_sps=bench_sps, ema_sps=seed, last_seen=now,
                             registered_at=now, block=block, last_block=block, operator=operator)
            self.scheduler.refresh_probation(node, now)
            self.scheduler.nodes[node_id] = node
        # a node registering again from elsewhere (--source-address, another network) is recorded
        # there: replicas keep apart from where it is, not from where it first came from
        node.block = node.last_block = block
        if node.operator is None:
            node.operator = operator
        node.bench_sps = bench_sps
        node.peak_flops = peak_flops(profile.benchmark)
        node.compute = hello.compute
        node.precision_sps = dict(b.precision_sps)
        node.max_memory_bytes = hello.max_memory_bytes
        node.last_seen = now
        return node

    def known_node(self, signer: bytes, address: str | None = None) -> NodeState:
        """The registered, unbanned node that signed a request (``address``: where it came from;
        its address block is noted, and replicas keep apart from it too)."""
        node = self.scheduler.nodes.get(fingerprint(signer))
        if node is None:
            raise Unauthorized("this node is not registered with the hub; register again", code="unknown_node")
        if node.public_key != signer:
            raise Unauthorized("node key does not match its registration", code="unknown_node")
        if node.banned:
            raise Forbidden(BANNED, code="banned")
        node.last_seen = time.time()
        if address is not None:
            node.last_block = self.block_of(address)
        return node

    # -- work --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def polling(self, node: NodeState) -> Iterator[None]:
        """The node waits for work while inside: it counts in the gathering a round is cut for."""
        self.scheduler.poll_started(node.id)
        try:
            yield
        finally:
            self.scheduler.poll_ended(node.id, time.time())

    async def next_assignment(self, node: NodeState, cached: frozenset[str]) -> Issued | None:
        """The node's live assignment if it still holds one, else a new one, else None."""
        node.last_seen = time.time()
        if node.banned:
            raise Forbidden(BANNED, code="banned")
        held = [a for a in self.scheduler.live_for(node.id) if not a.uploading]
        if held:
            first = min(held, key=lambda a: a.issued_at)
            return Issued(first.sealed, first.model_hash)
        plan = self.scheduler.plan(node, cached)
        if plan is None:
            return None
        return await self._issue(node, plan)

    async def _issue(self, node: NodeState, plan: Plan) -> Issued:
        """Sign and store an assignment for `plan`; the row is committed before it is sent."""
        job, shard = plan.job, plan.shard
        chunks = job.chunks_at(shard.chunk_idxs)
        now = time.time()
        aid = new_id("a")
        msg = Assignment(
            assignment_id=aid, job_id=job.id, round=job.round, node_id=node.id, model_hash=job.model_hash,
            model_size=job.model_size, model_spec=job.spec.model.to_dict(),
            chunks=tuple(ChunkRef(sha256=c.sha, size=c.size, samples=c.samples) for c in chunks),
            seed=shard.seed, issued_at=now, deadline=plan.deadline,
            train=dataclasses.replace(job.spec.train.train_config(self.scheduler.precision_for(job, node)),
                                      lr=job.spec.train.lr * job.lr_scale(shard.samples),
                                      checkpoint_every=int(job.spec.verification.checkpoint_every),
                                      commit=job.spec.verification.asks_referee(),
                                      update=job.spec.communication.update,
                                      topk_fraction=job.spec.communication.topk_fraction,
                                      error_feedback=job.spec.communication.error_feedback,
                                      **_secagg_settings(job)),
            # Never the shard's replica group: a node that knew its work is checked could behave
            # only then (a signed assignment looked different when replicated until 2026-11).
            replica_group="",
        )
        sealed = seal(self.key, msg)
        a = AssignmentState(
            id=aid, shard_id=shard.id, job_id=job.id, round=job.round, node_id=node.id, issued_at=now,
            expected_s=plan.expected_s, deadline=plan.deadline, sealed=sealed, model_hash=job.model_hash,
            chunk_shas=frozenset(c.sha for c in chunks),
        )
        # Attached before the write so that a concurrent poll cannot be planned the same chunks;
        # taken back if the write fails.
        self.scheduler.attach(a, shard)
        try:
            await self.store.issue_assignment(a, shard if plan.new_shard else None, chunks)
        except BaseException:
            self._release(a)
            raise
        self.metrics.assignments_issued += 1
        return Issued(sealed, job.model_hash)

    def _release(self, a: AssignmentState) -> None:
        """Forget a live assignment; its shard goes back to the pool if nobody else holds it."""
        self._progress.pop(a.id, None)
        shard = self.scheduler.detach(a)
        if shard is not None:
            self.scheduler.release_if_empty(shard)

    def _owned_live(self, node: NodeState, assignment_id: str) -> AssignmentState | None:
        a = self.scheduler.assignments.get(assignment_id)
        if a is not None and a.node_id != node.id:
            raise Forbidden("that assignment belongs to another node", code="not_your_assignment")
        return a

    async def _closed_state(self, node: NodeState, assignment_id: str) -> str:
        """State of an assignment that is not live; 404 if unknown, 403 if someone else's."""
        fate = await self.store.assignment_fate(assignment_id)
        if fate is None:
            raise NotFound(f"no assignment {assignment_id}", code="unknown_assignment")
        if fate.node_id != node.id:
            raise Forbidden("that assignment belongs to another node", code="not_your_assignment")
        return fate.state

    async def heartbeat(self, node: NodeState, assignment_id: str, steps: int = 0,
                        digest: bytes = b"") -> tuple[bool, str, float]:
        """(still live, detail, deadline): a live assignment's deadline moves on when the heartbeat
        proves new progress, within a bound (hub/policy/progress.py)."""
        a = self._owned_live(node, assignment_id)
        if a is None:
            state = await self._closed_state(node, assignment_id)
            return False, f"assignment is {state}; stop and ask for work", 0.0
        job = self.scheduler.jobs[a.job_id]
        now = time.time()
        train = job.spec.train
        window = max(self.config.min_deadline_s, a.expected_s * train.deadline_slack)
        shard = job.shards.get(a.shard_id)
        total = train.steps(shard.samples if shard is not None else 0)
        last = self._progress.get(a.id, Progress())
        new_deadline, detail = heartbeat_deadline(
            now=now, issued_at=a.issued_at, deadline=a.deadline, window_s=window, steps=steps,
            digest=digest if any(digest) else b"", last=last, total_steps=total,
            extension_max=self.config.progress_extension_max, max_assignment_s=self.config.max_assignment_s)
        if steps > last.steps and any(digest) and steps <= total:
            self._progress[a.id] = Progress(steps, bytes(digest))
        if new_deadline > a.deadline:
            await self.store.extend_deadline(a.id, new_deadline)
            a.deadline = new_deadline
        return True, detail, a.deadline

    async def abandon(self, node: NodeState, assignment_id: str) -> str:
        a = self._owned_live(node, assignment_id)
        if a is None:
            state = await self._closed_state(node, assignment_id)
            return f"assignment was already {state}"
        if a.uploading:
            raise Conflict("an update for this assignment is being uploaded", code="busy")
        await self.store.end_assignments([a.id], "abandoned")
        self._release(a)
        self.signal.offer()  # its chunks, for some waiting node
        return "abandoned; the shard goes back to the pool"

    async def expire_overdue(self, now: float) -> int:
        """Overdue assignments expire; their chunks go back to the pool."""
        expired = self.scheduler.expired(now)
        if not expired:
            return 0
        await self.store.end_assignments([a.id for a in expired], "expired")
        for a in expired:
            self._release(a)
            node = self.scheduler.nodes.get(a.node_id)
            if node is not None and node.updates_accepted == 0:
                # an unproven node held a shard and delivered nothing: others get the chunks first
                node.stalls += 1
                node.stall_until = now + stall_backoff(node.stalls, self.config.stall_backoff_s)
        self.metrics.assignments_expired += len(expired)
        if expired:
            self.signal.offer()  # their chunks, for the waiting nodes (the offer travels while they take work)
        return len(expired)

    def may_read_blob(self, node: NodeState, sha: str) -> bool:
        """A node reads the model and the chunks of its live assignments, nothing else."""
        return any(a.model_hash == sha or sha in a.chunk_shas for a in self.scheduler.live_for(node.id))

    def delta_base_ok(self, node: NodeState, sha: str, base: str) -> bool:
        """May ``node`` have model ``sha`` as a delta from ``base``? Only when ``sha`` is the model of
        one of its live assignments and ``base`` an earlier model of that job (a delta from any
        other blob would let a node read what it was never sent)."""
        for a in self.scheduler.live_for(node.id):
            if a.model_hash == sha:
                job = self.scheduler.jobs.get(a.job_id)
                return job is not None and base != sha and base in job.models.values()
        return False

    def count_served(self, node: NodeState, sha: str, nbytes: int) -> None:
        """``nbytes`` of ``sha`` went to ``node``: they count for the round of the live assignment
        that names it (the round's bytes down, in its job status)."""
        for a in self.scheduler.live_for(node.id):
            if a.model_hash == sha or sha in a.chunk_shas:
                job = self.scheduler.jobs.get(a.job_id)
                if job is not None and job.round == a.round:
                    job.bytes_down += nbytes
                return

    # -- updates -----------------------------------------------------------------------------
    async def begin_upload(self, node: NodeState, hdr: UpdateHeader,
                           content_length: int | None) -> tuple[AssignmentState, JobState]:
        """Check an update's header against its assignment and hold the assignment for the upload
        (`end_upload` or `accept_update` lets go)."""
        a = self._owned_live(node, hdr.assignment_id)
        if a is None:
            fate = await self.store.assignment_fate(hdr.assignment_id)
            if fate is None:
                raise NotFound(f"no assignment {hdr.assignment_id}", code="unknown_assignment")
            if fate.node_id != node.id:
                raise Forbidden("that assignment belongs to another node", code="not_your_assignment")
            if fate.update_id is not None:
                raise Conflict("an update for this assignment was already accepted", code="duplicate_update")
            raise Conflict(f"assignment is {fate.state}; the update came too late", code="late_update")
        if a.uploading:
            raise Conflict("an update for this assignment is already being uploaded", code="duplicate_update")
        job = self.scheduler.jobs[a.job_id]
        if content_length is None:
            raise LengthRequired("send the update with a Content-Length header", code="length_required")
        if hdr.offset > hdr.update_size:
            raise BadRequest(f"offset {hdr.offset} is past update_size {hdr.update_size}", code="size_mismatch")
        if content_length != hdr.update_size - hdr.offset:
            raise BadRequest(f"Content-Length {content_length} differs from update_size - offset"
                             f" ({hdr.update_size - hdr.offset})", code="size_mismatch")
        a.uploading = True
        return a, job

    def upload_target(self, node: NodeState, hdr: UpdateHeader) -> AssignmentState:
        """The live assignment an interrupted upload of ``node`` was for (POST /v1/updates/offset)."""
        a = self._owned_live(node, hdr.assignment_id)
        if a is None:
            theirs = self.scheduler.assignments.get(hdr.assignment_id)
            if theirs is not None:
                raise Forbidden("that assignment belongs to another node", code="not_your_assignment")
            raise NotFound(f"no live assignment {hdr.assignment_id}", code="unknown_assignment")
        if a.uploading:
            raise Conflict("an upload of this update is still in progress", code="busy")
        return a

    def stale_partials(self, held: Sequence[tuple[str, Path]]) -> list[Path]:
        """Of the interrupted uploads the blob store holds, those whose assignment is over."""
        return [path for aid, path in held if aid not in self.scheduler.assignments]

    @staticmethod
    def end_upload(a: AssignmentState) -> None:
        a.uploading = False

    async def accept_update(self, node: NodeState, a: AssignmentState, job: JobState,
                            hdr: UpdateHeader) -> UpdateState:
        """The update's blob is stored (durably): record it. Raises Conflict when the round moved on."""
        if a.id not in self.scheduler.assignments or job.round != a.round or job.state != "running":
            raise Conflict("the round closed while the update was uploading", code="late_update")
        shard = job.shards.get(a.shard_id)
        if shard is None:
            raise Conflict("the shard of this assignment is no longer open", code="late_update")
        now = time.time()
        upd = UpdateState(
            id="u-" + a.id.removeprefix("a-"), assignment_id=a.id, shard_id=shard.id, node_id=node.id,
            sha=hdr.update_sha256, size=hdr.update_size, sample_count=hdr.sample_count,
            loss=float(hdr.metrics["loss"]), train_s=float(hdr.timings["train_s"]), received_at=now,
            elapsed_s=now - a.issued_at, commitment=hdr.commitment,
        )
        before = (node.ema_sps, node.updates_accepted, node.proven_chunks)
        self.scheduler.observe_throughput(node, job.spec.train.processed(shard.samples), now - a.issued_at,
                                          self.config.throughput_alpha, self.scheduler.precision_factor(job, node))
        self.scheduler.count_delivery(node, shard)
        first = shard.first_update_at is None
        # an unreplicated shard is settled by its one update, in the same transaction, unless the
        # referee's draw picks it for a spot-check or its alignment with the model's trend is to be
        # measured first (then the round engine decides it, off the event loop: hub/policy/round_policy.py)
        settles = (shard.wanted == 1 and not shard.accepted and shard.state == "open"
                   and job.trend_base() is None and not self._spot_checked(job, shard, node))
        try:
            await self.store.accept_update(upd, job_id=job.id, round=a.round, metrics=dict(hdr.metrics),
                                           timings=dict(hdr.timings), node=node, first_update=first,
                                           settles=settles)
        except BaseException:
            node.ema_sps, node.updates_accepted, node.proven_chunks = before
            raise
        a.uploading = False
        self._progress.pop(a.id, None)
        node.stalls = 0
        self.scheduler.delivered(a, now)
        shard.accepted.append(upd)
        if first:
            shard.first_update_at = now
        if settles:
            shard.state = "settled"
            shard.representative = upd.id
        self.metrics.updates_accepted += 1
        self.rounds.poke(job.id)
        return upd

    def _spot_checked(self, job: JobState, shard: ShardState, node: NodeState) -> bool:
        """Will the referee re-execute this shard's lone update before it counts? The engine's
        draw for the shard against the rate for the node's trust (policy.spot_rate)."""
        vspec = job.spec.verification
        rate = policy.spot_rate(is_trusted(node.reputation, vspec), vspec)
        return rate > 0.0 and self.rounds.spot_draw(job.id, shard.id) < rate

    # -- the referee: checkpoint states a node is asked for (hub/policy/referee.py, hub/domain/rounds.py) ---
    def pending_state_request(self, node: NodeState) -> bytes | None:
        """The signed StateRequest the node must answer first, if the referee waits on it."""
        now = time.time()
        for r in self.rounds.state_requests.values():
            if r.node_id == node.id and not r.complete and now < r.deadline:
                r.asked = True
                return seal(self.key, StateRequest(request_id=r.id, job_id=r.job_id, round=r.round,
                                                   assignment_id=r.assignment_id, steps=r.steps, deadline=r.deadline))
        return None

    def _open_request(self, node: NodeState, request_id: str) -> StateRequestState:
        """The open state request ``request_id`` made of ``node``, before its deadline."""
        r = self.rounds.state_requests.get(request_id)
        if r is None:
            raise NotFound(f"no open state request {request_id}", code="unknown_request")
        if r.node_id != node.id:
            raise Forbidden("that state request was made of another node", code="not_your_request")
        if time.time() >= r.deadline:
            raise Conflict("the state request's deadline has passed", code="late_state")
        return r

    def begin_state(self, node: NodeState, hdr: StateUpload) -> tuple[StateRequestState, str, int]:
        """Check a state upload's header against its request and the node's commitment; the
        expected sha and the most bytes such a state may have."""
        r = self._open_request(node, hdr.request_id)
        if hdr.step not in r.steps:
            raise BadRequest(f"step {hdr.step} was not requested (requested: {list(r.steps)})", code="bad_step")
        if hdr.step in r.declined:
            raise Conflict(f"the state of step {hdr.step} was declared no longer held", code="declined_state")
        job = self.scheduler.jobs.get(r.job_id)
        shard = job.shards.get(r.shard_id) if job is not None else None
        upd = next((u for u in shard.accepted if u.id == r.update_id), None) if shard is not None else None
        if job is None or upd is None or upd.commitment is None:
            raise Conflict("the update this request was about is gone", code="late_state")
        c = upd.commitment
        index = len(c.hashes) - 1 if hdr.step == c.steps else hdr.step // c.every  # its place on the grid
        expected = c.hashes[index]
        if hdr.state_sha256 != expected:
            raise Unprocessable(f"state of step {hdr.step} is not the one committed to", code="not_committed")
        # params + optimizer state (<= 2 more copies) + error feedback's residual (one more, in the
        # last state) + step + RNG state: a bound, not a guess
        copies = 4 if job.spec.communication.error_feedback else 3
        return r, expected, copies * job.model_size + (1 << 20)

    async def accept_state(self, r: StateRequestState, step: int, sha: str) -> None:
        """The state's blob is stored (durably): record it; the engine judges once all are in."""
        await self.store.record_state(r.id, step, sha)
        r.states[step] = sha
        if r.complete:
            self.rounds.poke(r.job_id)

    async def decline_states(self, node: NodeState, msg: StateUnavailable) -> str:
        """The node no longer holds some of the states it was asked for: recorded (durably), and
        the engine judges at once once every step is answered, rather than at the deadline."""
        r = self._open_request(node, msg.request_id)
        steps = set(msg.steps)
        if not steps:
            raise BadRequest("name at least one step the node no longer holds", code="bad_step")
        if not steps <= set(r.steps):
            raise BadRequest(f"steps {sorted(steps - set(r.steps))} were not requested "
                             f"(requested: {list(r.steps)})", code="bad_step")
        if handed := sorted(steps & r.states.keys()):
            raise Conflict(f"the states of steps {handed} were handed over already", code="handed_over")
        await self.store.decline_states(r.id, sorted(steps))
        r.declined |= steps
        if r.complete:
            self.rounds.poke(r.job_id)
        return f"{len(steps)} step(s) recorded as no longer held; the referee decides without them"

    # -- node-local data (silos) -------------------------------------------------------------
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
            self._release(a)
        job.withdraw_silo(node.id)
        self.rounds.poke(job.id)  # a round that waited for this silo may close now
        self.signal.offer()
        return "withdrawn" + (f"; its assignment {live[0].id} ended" if live else "")

    # -- secure aggregation (hub/policy/secagg.py) -------------------------------------------
    def _secagg(self, node: NodeState, assignment_id: str) -> tuple[AssignmentState | None, JobState, SecAggRound]:
        """The round protocol the node's assignment is in, and the assignment while it is live (a
        member's assignment is delivered once its masked update is in); 404/409 otherwise."""
        a = self._owned_live(node, assignment_id)
        if a is not None:
            job = self.scheduler.jobs.get(a.job_id)
            if job is None or job.secagg is None or job.round != a.round:
                raise Conflict("this assignment's round has no secure aggregation running", code="no_secagg")
            return a, job, job.secagg
        for job in self.scheduler.jobs.values():
            for sa in (job.secagg, job.secagg_last):
                if sa is not None and (m := sa.members.get(node.id)) is not None and m.assignment_id == assignment_id:
                    return None, job, sa
        raise NotFound(f"no live assignment or secure aggregation holds {assignment_id}", code="unknown_assignment")

    def _live(self, a: AssignmentState | None) -> AssignmentState:
        if a is None:
            raise Conflict("this assignment delivered its masked update already", code="secagg_phase")
        return a

    async def _keep_alive(self, job: JobState, a: AssignmentState) -> None:
        """A member's assignment lives through the protocol's steps (its training is done)."""
        deadline = time.time() + 5 * float(job.spec.privacy.secagg_phase_s)
        if deadline > a.deadline:
            await self.store.extend_deadline(a.id, deadline)
            a.deadline = deadline

    async def secagg_keys(self, node: NodeState, msg: SecAggKeys) -> SecAggState:
        a, job, sa = self._secagg(node, msg.assignment_id)
        a = self._live(a)
        sa.add_keys(node.id, a.id, bytes(msg.c_pk), bytes(msg.s_pk))
        await self._keep_alive(job, a)
        self._secagg_moved(job)
        return sa.state_for(node.id, a.id)

    def secagg_state(self, node: NodeState, assignment_id: str) -> SecAggState:
        _, job, sa = self._secagg(node, assignment_id)
        self.rounds.poke(job.id)  # a step may have timed out: the engine moves it on
        return sa.state_for(node.id, assignment_id)

    def _secagg_moved(self, job: JobState) -> None:
        """A member's step is in: the engine moves the protocol on, and the members' long-polls
        (``secagg_wait``) look again."""
        self.rounds.poke(job.id)
        self.rounds.secagg_moved.fire()

    async def secagg_wait(self, node: NodeState, assignment_id: str, after: str, wait_s: float) -> SecAggState:
        """The node's SecAggState once its phase is no longer ``after`` (at once when ``after`` is
        empty), or after ``wait_s`` (capped by the hub's long-poll limit) or at shutdown. Wakes on the
        engine's ``secagg_moved``, and looks again every ``secagg_recheck_s`` at the latest, so that the
        engine moves a step whose deadline passed (``secagg_state`` pokes it)."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + min(max(wait_s, 0.0), float(self.config.long_poll_max_s))
        while True:
            moved = self.rounds.secagg_moved.event  # before looking: a change after this wakes us
            st = self.secagg_state(node, assignment_id)
            left = give_up - loop.time()
            if not after or st.phase != after or left <= 0 or self.signal.closing:
                return st
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(moved.wait(), min(left, self.secagg_recheck_s))

    async def secagg_shares(self, node: NodeState, msg: SecAggShares) -> SecAggState:
        a, job, sa = self._secagg(node, msg.assignment_id)
        a = self._live(a)
        sa.add_shares(node.id, a.id, msg.shares)
        await self._keep_alive(job, a)
        self._secagg_moved(job)
        return sa.state_for(node.id, a.id)

    def secagg_may_mask(self, node: NodeState, hdr: SecAggMasked) -> tuple[AssignmentState, JobState, SecAggRound]:
        """Before the body is read: is this masked update expected, and of that size?"""
        a, job, sa = self._secagg(node, hdr.assignment_id)
        a = self._live(a)
        sa.may_mask(node.id, a.id, hdr.size)
        return a, job, sa

    async def secagg_masked(self, node: NodeState, hdr: SecAggMasked, vector: Any) -> SecAggState:
        """The masked update's blob is stored (durably): record it as the shard's update (with
        its plain figures: samples, loss, time) and hand the vector to the protocol."""
        a, job, sa = self.secagg_may_mask(node, hdr)
        await self.accept_update(node, a, job, UpdateHeader(
            assignment_id=a.id, update_sha256=hdr.sha256, update_size=hdr.size, sample_count=hdr.sample_count,
            metrics={"loss": hdr.loss}, timings={"train_s": hdr.train_s}, timestamp=hdr.timestamp,
            nonce=hdr.nonce))
        sa.add_masked(node.id, a.id, vector)
        self._secagg_moved(job)
        return sa.state_for(node.id, a.id)

    def secagg_unmask(self, node: NodeState, msg: SecAggUnmask) -> SecAggState:
        _, job, sa = self._secagg(node, msg.assignment_id)
        sa.add_unmask(node.id, msg.assignment_id, msg.shares)
        self._secagg_moved(job)
        return sa.state_for(node.id, msg.assignment_id)

    # -- jobs --------------------------------------------------------------------------------
    async def submit_job(self, owner: str, spec_text: bytes, train_path: Path | None,
                         val_path: Path | None) -> JobState:
        """Validate, chunk and store a job (in a worker thread), then open its first round."""
        job = await asyncio.to_thread(ingest_job, self.store, self.blobs, owner=owner, spec_text=spec_text,
                                      train_path=train_path, val_path=val_path,
                                      nodes_online=self.scheduler.online_nodes(time.time()))
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

    # -- flags -------------------------------------------------------------------------------
    async def verdict(self, who: Principal, flag_id: str, verdict: str, note: str) -> Verdict:
        """Confirm or dismiss an open flag: the one path for the API and the console.

        Moves the node's reputation (verification.record_verdict; 3 confirmed flags ban it),
        and appends a `verdict` entry to the audit log before the verdict is committed (a crash
        in between leaves an entry for a verdict that can be given again, never a verdict
        without its entry). A verdict that bans the node makes its other open flags moot.
        """
        who.require("auditor")
        if verdict not in ("confirm", "dismiss"):
            raise BadRequest('verdict must be "confirm" or "dismiss"', code="bad_verdict")
        if not isinstance(note, str) or len(note) > 2000:
            raise BadRequest("note must be a string of at most 2000 characters", code="bad_verdict")
        status = "confirmed" if verdict == "confirm" else "dismissed"
        async with self._verdicts:
            flag = await self.store.flag(flag_id)
            if flag is None:
                raise NotFound(f"no flag {flag_id}", code="unknown_flag")
            if flag.status != "open":
                raise Conflict(f"flag {flag_id} already has a verdict ({flag.status})", code="already_decided")
            node = self.scheduler.nodes.get(flag.node_id)
            before = node.reputation if node is not None else None
            after = record_verdict(before, verdict) if before is not None else None
            newly_banned = bool(after and after.banned and before and not before.banned)
            banned = bool(after and after.banned)
            sha = await self.store.update_sha(flag.update_id)
            await asyncio.to_thread(self.audit.append, "verdict", verdict_body(
                flag_id=flag_id, node_id=flag.node_id, update=sha or flag.update_id, reason=flag.reason,
                verdict=verdict, auditor=who.name, note=note, job_id=flag.job_id, banned=banned))
            decided = await self.store.decide_flag(
                flag_id, status=status, note=note, auditor=who.name, now=time.time(),
                reputation=(flag.node_id, after) if after is not None else None,
                moot_note=MOOT if newly_banned else None)
            if decided is None:  # not under this lock's watch: another process decided it first
                raise Conflict(f"flag {flag_id} already has a verdict", code="already_decided")
            if node is not None and after is not None:
                node.reputation = after
                if newly_banned:  # its block and operator cool down (hub/policy/admission.py)
                    node.banned_at = time.time()
                    self.admission.banned(node.blocks, node.operator, node.banned_at)
        if newly_banned:
            self.signal.for_node(flag.node_id)  # its long-polls answer "banned" now
        return Verdict(decided, banned, newly_banned)

