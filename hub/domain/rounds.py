"""Rounds: settle replicated shards, close a covered round, aggregate, evaluate.

One `RoundEngine` per hub. Its `advance(job)` is serialized by a lock (aggregation
never runs twice at once) and does the heavy work (opening update blobs with
mmap, comparing replicas, aggregating, evaluating) in a worker thread. Updates are
visited in a fixed order (update sha, then id), so the same accepted updates give
the same model bytes, across restarts too.

The round policy (hub/policy/round_policy.py: decide_shard for each shard, judge_round when the
round closes; both pure, built on hub/policy/verification.py) decides what is aggregated;
this engine gathers its inputs and applies its decisions: the store first (hub/storage/store.py,
one transaction), then memory, so memory never runs ahead of what survives a restart.
Every aggregation is appended to the audit log (hub/storage/auditlog.py) before its round is committed, so a crash between the
two repeats the (deterministic, identical) entry rather than losing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import math
import mmap
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from gpuflex.protocol.jobspec import JobSpec
from gpuflex.protocol.modelspec import param_count
from gpuflex.protocol.tensors import decode_state, encode_state
from torch import Tensor

from ..model.job import JobState, ShardState, StateRequestState, UpdateLayout, UpdateState, new_id
from ..policy import downlink, privacy
from ..policy import round_policy as policy
from ..policy import verification as vf
from ..policy.aggregation import (
    AggregationError,
    ServerOptimizer,
    aggregate,
    readonly_mapping,
    update_norm,
)
from ..policy.evaluation import evaluate
from ..policy.referee import (
    RESIDUAL_LOOKBACK,
    SegmentVerdict,
    judge_segment,
    pick_segment,
    referee_grid_ok,
    replay_onednn,
    request_steps,
    stack_data,
)
from ..policy.secagg import SecAggRound
from ..storage.auditlog import AuditLog, aggregation_body
from ..storage.blobs import HOT_BLOB_MAX, BlobStore
from ..storage.store import RoundResult, Store
from .metrics import HubMetrics
from .scheduler import Scheduler
from .worksignal import Pulse, WorkSignal

#: rows of the owner's validation set each update of a node-local job is probed on (``_probe``)
PROBE_SAMPLES = 512

log = logging.getLogger("gpuflex.hub.rounds")


def _secagg_phases(job: JobState) -> tuple[int, str | None, str | None]:
    """Where a job's secure aggregation stands: a member's SecAggState changes only when this does
    (a round closed or opened, a step ended)."""
    return (job.round, None if job.secagg is None else job.secagg.phase,
            None if job.secagg_last is None else job.secagg_last.phase)


@contextlib.contextmanager
def open_deltas(blobs: BlobStore, shas: Sequence[str],
                layout: UpdateLayout | None = None) -> Iterator[list[dict[str, Tensor]]]:
    """Zero-copy views of update blobs (the hub's in-memory copy of a small one, else a
    read-only mmap, registered with the PageReleasers while open), closed on exit. With a
    ``layout`` whose encoding is not fp32, each update is decoded into the model's dense tensors
    (fp16, int8, topk and sign are not the model's bytes): in memory for a model of up to
    HOT_BLOB_MAX, else written to an unnamed temporary file (no fsync: it is gone when closed,
    or with the process) and mapped read-only like an fp32 update, so a round of many encoded
    updates streams through aggregation in O(model) memory as fp32 ones do, instead of holding
    every dense update at once."""
    maps: list[mmap.mmap] = []
    files: list[Any] = []
    states: list[dict[str, Tensor]] = []
    registered = contextlib.ExitStack()
    spill = layout if layout is not None and not layout.encoding.identity and layout.dense_bytes > HOT_BLOB_MAX \
        else None

    def mapped(fh: Any) -> mmap.mmap:
        files.append(fh)
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        maps.append(mm)
        registered.enter_context(readonly_mapping(mm))
        return mm

    try:
        for sha in shas:
            if spill is not None:
                states.append(decode_state(mapped(_spilled(blobs, sha, spill))))
                continue
            small = blobs.small(sha)
            source = small if small is not None else mapped(open(blobs.path(sha), "rb"))
            states.append(_dense(decode_state(source), layout))
        yield states
    finally:
        registered.close()  # out of the registry before anything is closed
        del states  # drop tensor views before closing their buffers
        for mm in maps:
            with contextlib.suppress(BufferError):
                mm.close()
        for fh in files:
            fh.close()


def _spilled(blobs: BlobStore, sha: str, layout: UpdateLayout) -> Any:
    """An unnamed temporary file holding the encoded update ``sha`` decoded to the model's
    tensors (a GFT1 blob). The encoded blob is read and let go here, so a round of N updates
    holds N open files, not 2N."""
    small = blobs.small(sha)
    if small is not None:
        dense = encode_state(layout.dense(decode_state(small)))
    else:
        with open(blobs.path(sha), "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            dense = encode_state(layout.dense(decode_state(mm)))  # a copy: no view of mm outlives this
    tmp = tempfile.TemporaryFile(dir=blobs.tmp)
    try:
        tmp.write(dense)
        tmp.flush()
    except BaseException:
        tmp.close()
        raise
    return tmp


def _dense(wire: dict[str, Tensor], layout: UpdateLayout | None) -> dict[str, Tensor]:
    return wire if layout is None or layout.encoding.identity else layout.dense(wire)


def spot_draw(secret: bytes, job_id: str, shard_id: str) -> float:
    """A shard's spot-check draw in [0, 1): an HMAC of its ids under the hub's audit secret
    (keys.audit_secret). The same after a restart (the secret comes from the hub's key), and
    unknowable to a node: shard ids are plain (job, round, sequence) and a node learns a
    replicated shard's id, so with a bare hash of the ids colluders could compute which shards
    the referee will check and craft only the others."""
    mac = hmac.new(secret, f"{job_id}/{shard_id}/spot".encode(), hashlib.sha256).digest()
    return int.from_bytes(mac[:6], "big") / float(1 << 48)


def segment_draw(secret: bytes, job_id: str, update_id: str) -> float:
    """Which segment of an update the referee re-executes when no replica's divergence points
    at one (referee.pick_segment): a draw in [0, 1) from an HMAC of the ids under the hub's audit
    secret, so the node cannot know which of its segments will be replayed."""
    mac = hmac.new(secret, f"{job_id}/{update_id}/segment".encode(), hashlib.sha256).digest()
    return int.from_bytes(mac[:6], "big") / float(1 << 48)


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _norm(state: Mapping[str, Tensor]) -> float:
    """The L2 norm of a state's floating tensors (summed in float64)."""
    return math.sqrt(sum(float(t.double().pow_(2).sum()) for t in state.values() if t.is_floating_point()))


def _all_finite(t: Tensor) -> bool:
    """``torch.isfinite(t).all()`` in one pass and without a mask: the least and the greatest
    element are finite only when every element is (both take a NaN when there is one)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _finite_or_none(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return float(value)


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
        #: keys the referee's spot-check draws (``spot_draw``); derived from the hub's signing key
        self.audit_secret = audit_secret
        self.store = store
        self.blobs = blobs
        self.scheduler = scheduler
        self.metrics = metrics
        self.signal = signal
        self.audit = audit
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._pending: set[str] = set()
        self.last_close_ms: float | None = None
        #: the job the loop is advancing right now (None between jobs)
        self.current: JobState | None = None
        #: update id -> (node id, its run of agreements before the update was flagged at settling)
        self._run_before_flag: dict[str, tuple[str, int]] = {}
        #: the referee's open state requests, by id (hub/policy/referee.py; the ledger answers nodes from it)
        self.state_requests: dict[str, StateRequestState] = {}
        #: called (on the loop) with (last model, new model) when a round makes a model the next
        #: round trains, as soon as its blob is durable (the rest of the close still under way):
        #: the app starts making the delta nodes will download (hub/storage/deltas.py)
        self.on_new_model: Callable[[str, str], None] | None = None
        #: fired whenever a round's secure aggregation may have moved on (a step's answers, a step's
        #: deadline, a round closed or opened): the members' long-polls look again
        self.secagg_moved = Pulse()

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
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                job = self.scheduler.jobs.get(self._pending.pop())
                if job is None or job.state != "running":
                    continue
                self.current = job
                try:
                    await self.advance(job)
                except Exception as exc:  # one job's failure must not stop the others
                    log.exception("advancing job %s failed", job.id)
                    await self.fail_job(job, f"round {job.round} failed: {exc}")
                self.current = None

    async def advance(self, job: JobState, now: float | None = None) -> None:
        async with self._lock:
            now = time.time() if now is None else now
            vspec = job.spec.verification
            before = _secagg_phases(job)
            if job.secagg is not None and not job.secagg.settled:
                job.secagg.advance(now, self._secagg_expected(job))
            for shard in sorted(job.shards.values(), key=lambda s: s.seq):
                if shard.state != "open" or not shard.accepted:
                    continue
                if shard.requests:  # the referee waits for states
                    if not all(r.complete or now >= r.deadline for r in shard.requests.values()):
                        continue
                    await self._judge(job, shard)
                for _ in range(3):  # a referee verdict given at once (no commitment) decides again
                    state = self._replica_state(job, shard, now)
                    if shard.state != "open" or shard.requests or not policy.shard_due(
                            len(shard.accepted), vspec, state):
                        break
                    if not await self._settle(job, shard, state):
                        break
            if job.state == "running" and job.round_complete(now, self.scheduler.presence.is_online):
                await self._close(job)
            if _secagg_phases(job) != before:  # only a move: a waiting poll pokes the engine when it looks
                self.secagg_moved.fire()

    def _secagg_expected(self, job: JobState) -> set[str]:
        """Who the round's secure aggregation waits for at its keys: every silo whose node is online."""
        return {c.owner for c in job.chunks if c.owner is not None and self.scheduler.presence.is_online(c.owner)}

    # -- replicas: gather the policy's inputs, ask it (hub/policy.decide_shard) ---------------
    def _replica_state(self, job: JobState, shard: ShardState, now: float) -> policy.ReplicaState:
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

    async def _settle(self, job: JobState, shard: ShardState, state: policy.ReplicaState) -> bool:
        """Decide the shard and apply it; True when the referee gave verdicts at once (decide again)."""
        ups = sorted(shard.accepted, key=lambda u: (u.sha, u.id))
        if len(ups) == 1 and job.trend_base() is None:
            # A lone update is never compared, nor measured against a trend: its delta is not
            # opened (no thread, no mmap).
            records = self._records(job, {ups[0].id: shard}, ups, [{}])
            decision = policy.decide_shard(records, job.spec.verification, state, self._reputations(ups),
                                           **self._referee_inputs(job, shard, ups))
        else:
            decision = await asyncio.to_thread(self._decide, job, shard, ups, state)
        if isinstance(decision, policy.Referee):
            return await self._ask_referee(job, shard, decision)
        await self._apply_shard_decision(job, shard, decision, state)
        return False

    # -- the referee (hub/policy/referee.py): ask nodes for committed states, re-execute a segment ----
    def spot_draw(self, job_id: str, shard_id: str) -> float:
        """The shard's spot-check draw (``spot_draw`` under this hub's audit secret)."""
        return spot_draw(self.audit_secret, job_id, shard_id)

    def _referee_inputs(self, job: JobState, shard: ShardState, ups: Sequence[UpdateState]) -> dict[str, Any]:
        return {"committed": frozenset(u.id for u in ups if u.commitment is not None),
                "verdicts": dict(shard.verdicts), "spot_draw": self.spot_draw(job.id, shard.id)}

    async def _ask_referee(self, job: JobState, shard: ShardState, decision: policy.Referee) -> bool:
        """Open a state request for each update the policy wants re-executed (persisted first);
        an update with no usable commitment gets its unverifiable verdict at once (True)."""
        now = time.time()
        vspec = job.spec.verification
        by_id = {u.id: u for u in shard.accepted}
        state_bytes = 12 * param_count(job.spec.model)  # fp32 weights and up to two optimizer buffers
        requests: list[StateRequestState] = []
        at_once: dict[str, SegmentVerdict] = {}
        for uid in decision.update_ids:
            u = by_id[uid]
            c = u.commitment
            base = {"check": "segment_replay", "round": job.round, "node": u.node_id, "update": uid,
                    "reason": decision.reason}
            if c is None or not referee_grid_ok(c, job.spec.train.steps(shard.samples)):
                at_once[uid] = SegmentVerdict(uid, u.node_id, "unverifiable", base | {
                    "why": "the update carries no usable checkpoint commitment"})
                continue
            others = [o.commitment for o in shard.accepted if o.id != uid and o.commitment is not None]
            seg = pick_segment(c, others[0] if decision.reason == "disagreement" and others else None,
                               draw=segment_draw(self.audit_secret, job.id, uid))
            steps = request_steps(c, seg, state_bytes)
            requests.append(StateRequestState(
                id=new_id("sr"), job_id=job.id, round=job.round, shard_id=shard.id, update_id=uid,
                node_id=u.node_id, assignment_id=u.assignment_id, reason=decision.reason, segment=seg,
                steps=steps, requested_at=now, deadline=now + float(vspec.state_wait_s)))
        if requests:
            await self.store.open_state_requests(requests)
        for r in requests:
            shard.requests[r.update_id] = r
            self.state_requests[r.id] = r
        shard.verdicts.update(at_once)
        self.metrics.referee_verdicts.update(v.outcome for v in at_once.values())
        if requests:
            self.metrics.referee_requests += len(requests)
            asyncio.get_running_loop().call_later(float(vspec.state_wait_s) + 0.05, self.poke, job.id)
            for r in requests:  # the nodes asked wake from their long-polls
                self.signal.for_node(r.node_id)
        return bool(at_once) and not requests

    def resume_referee(self, rows: Sequence[tuple[StateRequestState, str, Mapping[str, Any]]]) -> None:
        """After a restart: the open requests wait on (with the states already handed over), the
        verdicts already given stand, for the shards still open."""
        for r, status, evidence in rows:
            job = self.scheduler.jobs.get(r.job_id)
            shard = job.shards.get(r.shard_id) if job is not None else None
            if job is None or shard is None or shard.state != "open":
                continue
            if status == "open":
                shard.requests[r.update_id] = r
                self.state_requests[r.id] = r
            else:
                shard.verdicts[r.update_id] = SegmentVerdict(r.update_id, r.node_id, status, dict(evidence))
        loop = asyncio.get_running_loop()
        for r in self.state_requests.values():  # judged once every state is in, or at the deadline
            loop.call_later(max(0.0, r.deadline - time.time()) + 0.05, self.poke, r.job_id)

    async def _judge(self, job: JobState, shard: ShardState) -> None:
        """Every requested state is in (or its time ran out): re-execute the segments (worker
        thread), record the verdicts (store, then memory)."""
        reqs = list(shard.requests.values())
        by_id = {u.id: u for u in shard.accepted}
        # a request the node declined is decided without a replay: no model, chunks or states read
        verdicts = {r.update_id: _declined(r, by_id[r.update_id]) for r in reqs if r.declined}
        if replay := [r for r in reqs if not r.declined]:
            earlier = await self._earlier_uploads(job, [by_id[r.update_id] for r in replay])
            verdicts |= await asyncio.to_thread(self._judge_blocking, job, shard, replay, by_id, earlier)
        await self.store.close_state_requests([(r.id, verdicts[r.update_id].outcome,
                                                dict(verdicts[r.update_id].evidence)) for r in reqs])
        for r in reqs:
            shard.requests.pop(r.update_id, None)
            self.state_requests.pop(r.id, None)
            shard.verdicts[r.update_id] = verdicts[r.update_id]
        self.metrics.referee_verdicts.update(v.outcome for v in verdicts.values())

    async def _earlier_uploads(self, job: JobState, ups: Sequence[UpdateState]) -> dict[str, list[str]]:
        """For a job with error feedback: each update's node's latest earlier uploads in the job
        (blob ids, newest first, up to RESIDUAL_LOOKBACK), for the referee's residual chain."""
        enc = job.layout.encoding
        if enc.identity or not enc.error_feedback:
            return {}
        return {u.id: await self.store.uploads_before(job.id, u.node_id, u.received_at, but=u.id,
                                                      limit=RESIDUAL_LOOKBACK) for u in ups}

    def _judge_blocking(self, job: JobState, shard: ShardState, reqs: Sequence[StateRequestState],
                        by_id: Mapping[str, UpdateState],
                        earlier: Mapping[str, Sequence[str]] | None = None) -> dict[str, SegmentVerdict]:
        spec = job.spec
        vspec = spec.verification
        global_state = decode_state(self.blobs.read_private(job.model_hash))
        x, y = stack_data([decode_state(self.blobs.read_private(c.sha)) for c in job.chunks_at(shard.chunk_idxs)])
        out: dict[str, SegmentVerdict] = {}
        for r in reqs:
            u = by_id[r.update_id]
            c = u.commitment
            if c is None:  # not reached: requests are opened only for committed updates
                continue
            states = {step: decode_state(self.blobs.read_private(sha)) for step, sha in r.states.items()}
            tol = float(vspec.segment_tolerance if c.precision == "fp32" else vspec.segment_tolerance_low)
            delta = decode_state(self.blobs.read_private(u.sha))
            node = self.scheduler.nodes.get(u.node_id)
            previous = None
            if earlier is not None and u.id in earlier:
                previous = [decode_state(self.blobs.read_private(sha)) for sha in earlier[u.id]]
            v = judge_segment(update_id=u.id, node_id=u.node_id, round=r.round, spec=spec.model,
                              cfg=job.train_config(shard.samples),
                              seed=shard.seed, commitment=c, segment=r.segment, states=states,
                              global_state=global_state, delta=delta, x=x, y=y, tolerance=tol,
                              onednn=replay_onednn(None if node is None else node.compute),
                              encoding=job.layout.encoding, previous=previous)
            outcome, evidence = v.outcome, dict(v.evidence) | {"reason": r.reason, "request": r.id}
            if outcome == "unverifiable" and not r.asked:
                # it never polled for work again before the deadline: offline (a volunteer's laptop
                # closed after the upload), not a refusal. Left out and no longer trusted, no flag.
                outcome = "unreachable"
                evidence["why"] = "the node did not come back for the request before its deadline"
            out[u.id] = SegmentVerdict(v.update_id, v.node_id, outcome, evidence)
        return out

    def _reputations(self, ups: Sequence[UpdateState]) -> dict[str, vf.Reputation]:
        return {u.node_id: n.reputation for u in ups if (n := self.scheduler.nodes.get(u.node_id)) is not None}

    def _decide(self, job: JobState, shard: ShardState, ups: list[UpdateState],
                state: policy.ReplicaState) -> policy.ShardDecision:
        """Worker thread: open the replicas' deltas (and the models the trend is measured on)
        and ask the policy."""
        base = job.trend_base()
        with (open_deltas(self.blobs, [u.sha for u in ups], job.layout) as deltas,
              open_deltas(self.blobs, [job.model_hash, base] if base else []) as models):
            records = self._records(job, {u.id: shard for u in ups}, ups, deltas)
            trend = {u.id: vf.trend_alignment(d, models[0], models[1]) for u, d in zip(ups, deltas, strict=True)
                     } if models else {}
            decision = policy.decide_shard(records, job.spec.verification, state, self._reputations(ups),
                                           **self._referee_inputs(job, shard, ups), trend=trend)
            del records
        return decision

    # -- applying a shard decision: the store, then memory ------------------------------------
    async def _apply_shard_decision(self, job: JobState, shard: ShardState, decision: policy.ShardDecision,
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
        for f in decision.flags:  # the run a flag resets, restored if the round withdraws the flag
            if (n := self.scheduler.nodes.get(f.node_id)) is not None:
                self._run_before_flag[f.update_id] = (f.node_id, n.reputation.consecutive_agreements)
        touched = self._reputations_after(agreed_nodes, decision.flagged_nodes, decision.missed_nodes)
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
            if u.id in statuses:
                u.status = statuses[u.id]
        self._apply_reputations(touched)
        job.replicated.pop(shard.id, None)
        if not settled:
            job.shards.pop(shard.id, None)
            job.release(shard.chunk_idxs)
        if not settled or cancelled:
            self.signal.offer()  # the chunks back in the pool

    def _reputations_after(self, agreed: Sequence[str], flagged: Sequence[str],
                           missed: Sequence[str] = ()) -> list[tuple[str, vf.Reputation]]:
        """The nodes' reputations after verification's transitions (memory is not touched)."""
        after: dict[str, vf.Reputation] = {}
        steps = ([(n, vf.record_agreement) for n in agreed] + [(n, vf.record_flag) for n in flagged]
                 + [(n, vf.record_missed) for n in missed])
        for nid, step in steps:
            node = self.scheduler.nodes.get(nid)
            if node is not None:
                after[nid] = step(after.get(nid, node.reputation))
        return list(after.items())

    def _vouched(self, job: JobState, reps: Sequence[UpdateState],
                 groups: Mapping[str, Sequence[policy.GroupMember]]) -> set[str]:
        """The representatives a trusted node delivered, or agreed with (a redundant member)."""
        v = job.spec.verification

        def trusted(node_id: str) -> bool:
            node = self.scheduler.nodes.get(node_id)
            return node is not None and vf.is_trusted(node.reputation, v)

        return {u.id for u in reps if trusted(u.node_id)
                or any(m.status == "redundant" and trusted(m.node_id) for m in groups.get(u.id, ()))}

    def _withdraw(self, touched: list[tuple[str, vf.Reputation]],
                  withdrawn: Sequence[str]) -> list[tuple[str, vf.Reputation]]:
        """A withdrawn flag gives the node back the run of agreements it reset
        (verification.record_withdrawn). The runs are remembered in memory for the round: a hub
        restarted between the flag and the round's close withdraws the flag without the run."""
        after = dict(touched)
        for uid in withdrawn:
            seen = self._run_before_flag.pop(uid, None)
            node = self.scheduler.nodes.get(seen[0]) if seen is not None else None
            if seen is not None and node is not None:
                after[seen[0]] = vf.record_withdrawn(after.get(seen[0], node.reputation), seen[1])
        return list(after.items())

    def _apply_reputations(self, touched: Sequence[tuple[str, vf.Reputation]]) -> None:
        for nid, rep in touched:
            node = self.scheduler.nodes.get(nid)
            if node is not None:
                node.reputation = rep

    def _records(self, job: JobState, shard_of: Mapping[str, ShardState], ups: Sequence[UpdateState],
                 deltas: Sequence[Mapping[str, Tensor]]) -> list[vf.UpdateRecord]:
        """Verification's view of updates. Speed: max(benchmark, delivered EMA) is an upper bound of
        the node's training speed; peak FLOP/s and the model size give the physical minimum time."""
        params = param_count(job.spec.model)
        out = []
        for u, d in zip(ups, deltas, strict=True):
            node = self.scheduler.nodes.get(u.node_id)
            c = u.commitment
            path = (math.fsum(c.norms) if c is not None and job.layout.encoding.identity
                    and referee_grid_ok(c, job.spec.train.steps(shard_of[u.id].samples)) else None)
            out.append(vf.UpdateRecord(
                update_id=u.id, node_id=u.node_id, shard_id=u.shard_id,
                samples_claimed=u.sample_count, shard_samples=shard_of[u.id].samples,
                loss=u.loss, train_s=u.train_s,
                node_samples_per_s=max(node.bench_sps, node.ema_sps) if node else 0.0, delta=d,
                elapsed_s=u.elapsed_s, peak_flops=node.peak_flops if node else 0.0,
                param_count=params,
                local_epochs=job.spec.train.processed(shard_of[u.id].samples) / max(shard_of[u.id].samples, 1),
                path_length=path, lr_scale=job.lr_scale(shard_of[u.id].samples),
            ))
        return out

    # -- closing a round -------------------------------------------------------------------
    async def _close(self, job: JobState) -> None:
        t0 = time.perf_counter()
        job.closing = True
        try:
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
                      for s in shards}
            result = await asyncio.to_thread(self._aggregate, job, reps, shard_of, groups,
                                             self._delta_starter(job))
        except BaseException:
            job.closing = False
            raise
        # live assignments of a finished round are void (replicas of settled shards were already
        # cancelled), except a node-local job's stragglers under late = "next": they count in the next
        # round (once), on a shard of their silo there
        leftovers = [a for s in job.shards.values() for a in s.live.values()]
        now = time.time()
        last = job.round + 1 >= job.rounds
        carry = [a for a in leftovers if job.node_local and job.spec.data.late == "next" and job.secagg is None
                 and a.carried_from is None and not last and a.shard_id in job.shards]
        carried = [(a, ShardState(
            id=f"{job.id}-r{job.round + 1}-s{seq}", job_id=job.id, round=job.round + 1, seq=seq,
            seed=job.shards[a.shard_id].seed, chunk_idxs=job.shards[a.shard_id].chunk_idxs,
            samples=job.shards[a.shard_id].samples, replica_group="", wanted=1, carved_at=now,
            carried_from=job.round)) for seq, a in enumerate(carry)]
        # Apply the round's judgement (hub/policy.judge_round): the store, then memory.
        judgement: policy.RoundJudgement = result["judgement"]
        touched = self._reputations_after([], judgement.flagged_nodes)
        touched = self._withdraw(touched, judgement.withdrawn)
        for s in job.shards.values():  # the round's flags that stand keep the reset
            for u in s.accepted:
                self._run_before_flag.pop(u.id, None)
        # what went down the wire for this round (its models and chunks; updates are in the store)
        metrics = {**result["metrics"], "bytes_down": float(job.bytes_down)}
        outcome = RoundResult(
            model_hash=result["model_hash"], opt_state_sha=result["opt_state_sha"],
            statuses=dict(judgement.statuses), flags=list(judgement.flags), evidence=result["evidence"],
            metrics=metrics, train_loss=result["train_loss"], flagged_nodes=list(judgement.flagged_nodes))
        try:
            await self.store.close_round(job, outcome, flags=list(judgement.flags), withdrawn=list(judgement.withdrawn),
                                         cancelled=[a.id for a in leftovers if a not in carry], reputations=touched,
                                         last=last, now=now, carried=[(a.id, s) for a, s in carried])
        finally:
            job.closing = False
        for a in leftovers:
            self.scheduler.detach(a)
        self._apply_reputations(touched)
        job.error = None  # a failure noted while this round could not close is over
        job.model_hash = result["model_hash"]
        job.opt_state_sha = result["opt_state_sha"]
        job.round += 1
        job.note_model(job.round, job.model_hash)
        self.metrics.rounds_closed += 1
        if last:
            job.end("done")
        else:
            job.open_round()
            for a, shard in carried:
                job.take(shard.chunk_idxs)
                job.shards[shard.id] = shard
                job.next_seq = max(job.next_seq, shard.seq + 1)
                a.carried_from, a.round, a.shard_id = a.round, job.round, shard.id
                self.scheduler.attach(a, shard)
        self.last_close_ms = (time.perf_counter() - t0) * 1000
        self.signal.notify()

    def _delta_starter(self, job: JobState) -> Callable[[str], None] | None:
        """What ``_aggregate`` calls once the round's model blob is durable: a large model that the
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

    def _put_state(self, state: Mapping[str, Tensor]) -> str:
        """Store a state dict as a GFT1 blob, durably; its id."""
        return self.blobs.put(encode_state(state))

    def _put_opt_state(self, opt: ServerOptimizer, residual: Mapping[str, Tensor]) -> str:
        """The server optimizer's state with the download residual, stored as one blob."""
        return self._put_state(opt.state_dict() | {downlink.RESIDUAL_PREFIX + k: v for k, v in residual.items()})

    def _evaluate(self, spec: JobSpec, state: Mapping[str, Tensor], val_sha: str) -> dict[str, float]:
        return evaluate(spec, state, decode_state(self.blobs.read_private(val_sha)))

    def _probe(self, job: JobState, global_state: Mapping[str, Tensor], reps: Sequence[UpdateState],
               deltas: Sequence[Mapping[str, Tensor]]) -> dict[str, Any]:
        """Each update's effect on the loss of the owner's validation set (its first PROBE_SAMPLES
        rows): the loss of the model plus that update minus the model's, as evidence for the
        auditors. Not a rule: measured over 30 rounds of 10 Dirichlet(0.5) digits silos, honest
        updates reached 23 MADs above the round's median change while a sign-flipped one sat under
        1, so a threshold that flags it flags honest silos (docs/silos.md)."""
        val = decode_state(self.blobs.read_private(job.val_sha or ""))
        probe = {k: v[:PROBE_SAMPLES] for k, v in val.items()}
        before = evaluate(job.spec, global_state, probe)["loss"]
        changes: dict[str, float | None] = {}
        for u, d in zip(reps, deltas, strict=True):
            moved = {k: (t + d[k].to(t.dtype) if k in d and t.is_floating_point() else t) for k, t in global_state.items()}
            after = evaluate(job.spec, moved, probe)["loss"]
            changes[u.id] = round(after - before, 6) if math.isfinite(after - before) else None
        return {"samples": int(probe["x"].shape[0]), "loss_before": round(before, 6), "loss_change": changes}

    def _aggregate(self, job: JobState, reps: list[UpdateState], shard_of: dict[str, ShardState],
                   groups: Mapping[str, Sequence[policy.GroupMember]],
                   on_model: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Judge (hub/policy.judge_round), aggregate, step the server optimizer, evaluate, log.
        Worker thread; no DB writes. ``on_model`` is called (on this thread) with the new model's
        blob id as soon as the blob is durable, while the rest of the round's close goes on.

        Work that does not wait on the rest runs beside it, in two more threads (torch's kernels,
        hashing, copies, writes and fsync run outside the GIL): the model's norm while the updates
        are opened, then the two blobs and the evaluation. Each is done, and each blob durable,
        before this returns, and so before the round's close is committed."""
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="gpuflex-close") as pool:
            return self._aggregate_with(pool, job, reps, shard_of, groups, on_model)

    def _aggregate_with(self, pool: ThreadPoolExecutor, job: JobState, reps: list[UpdateState],
                        shard_of: dict[str, ShardState], groups: Mapping[str, Sequence[policy.GroupMember]],
                        on_model: Callable[[str], None] | None) -> dict[str, Any]:
        spec = job.spec
        global_state = decode_state(self.blobs.read_private(job.model_hash))
        if job.secagg is not None:  # the hub holds only the sum of the masked updates (hub/policy/secagg.py)
            judgement, included, flagged, evidence, opt, residual, new_state = self._secagg_step(
                job, job.secagg, reps, global_state)
        else:
            norm = pool.submit(_norm, global_state) if reps else None
            # the outvoted minorities of the round's replica groups: scored when their majority is
            # flagged at review, before their replica_mismatch flags may be withdrawn (policy)
            minority = [m for u in reps for m in shard_of[u.id].accepted if m.status == "quarantined"]
            minority_shard = {m.id: shard_of[u.id] for u in reps for m in shard_of[u.id].accepted}
            with open_deltas(self.blobs, [u.sha for u in (*reps, *minority)], job.layout) as opened:
                deltas, minority_deltas = opened[:len(reps)], opened[len(reps):]
                gnorm = norm.result() if norm is not None else 0.0
                records = self._records(job, shard_of, reps, deltas)
                dissent = {r.update_id: r for r in self._records(job, minority_shard, minority, minority_deltas)}
                # A node-local job's silos can never earn trust (nothing to replicate them with), so
                # the untrusted weight bound would cap every silo at the round's median count for good:
                # its updates are weighted by their sample count, which the owner's max_samples caps
                judgement = policy.judge_round(records, gnorm, spec.verification, groups,
                                               vouched_by_trusted=None if job.node_local
                                               else self._vouched(job, reps, groups),
                                               dissent=dissent)
                del records, dissent
                keep = set(judgement.review.included)
                included = [i for i, u in enumerate(reps) if u.id in keep]
                flagged = {f.update_id: f.reason for f in judgement.review.flags}
                evidence = dict(judgement.review.evidence)
                evidence["bounds"] = dict(judgement.bounds)
                unverified = {reps[i].id: shard_of[reps[i].id].unverified for i in included
                              if shard_of[reps[i].id].unverified}
                if unverified:  # aggregated without a replica's confirmation (verification.unverified = "accept")
                    evidence["unverified"] = unverified
                # the owner's probe set (Templar's Gauntlet); not under central DP, where a per-update
                # loss change would tell the owner what the noise is there to hide
                if job.node_local and job.val_sha and reps and not spec.privacy.central:
                    evidence["probe"] = self._probe(job, global_state, reps, deltas)
                late = {u.id: c for u in reps if (c := shard_of[u.id].carried_from) is not None}
                if late:  # stragglers of the round before (late = "next"): trained on that round's model
                    evidence["late"] = late
                compared = {s.id: s.comparison for s in shard_of.values() if s.comparison}
                if compared:  # replica groups: one compute class (strict tolerance) or several
                    evidence["replica_comparison"] = dict(sorted(compared.items()))
                use = [deltas[i] for i in included]
                dp = spec.privacy
                if dp.central:
                    # Central DP (hub/policy/privacy.py): every included update clipped to the privacy clip and
                    # averaged with equal weights. The norm bound and the untrusted weight share depend
                    # on the other silos' updates and would break the sensitivity bound: not applied
                    # (the round's flags still are: a flagged update is not in `included`).
                    weights = [1.0] * len(use)
                    scales = [privacy.clip_factor(update_norm(d), dp.clip_norm) for d in use]
                    evidence["bounds"]["applied"] = False
                else:
                    weights = [float(shard_of[reps[i].id].samples) * judgement.weight_factors.get(reps[i].id, 1.0)
                               for i in included]
                    scales = [judgement.scales.get(reps[i].id, 1.0) for i in included]
                opt = ServerOptimizer.from_spec(spec.aggregation)
                residual: dict[str, Tensor] = {}
                if job.opt_state_sha:
                    stored, residual = downlink.split_state(decode_state(self.blobs.read_private(job.opt_state_sha)))
                    opt.load_state_dict(stored)
                if use:
                    agg = aggregate(use, weights, spec.aggregation,
                                    scales=scales if any(x < 1.0 for x in scales) else None)
                    if dp.central:  # the noise goes on the mean, before the server optimizer (post-processing)
                        std = privacy.noise_std(dp.noise_multiplier, dp.clip_norm, len(use))
                        privacy.add_noise(agg, std)
                        evidence["privacy"] = {
                            "clip_norm": dp.clip_norm, "noise_multiplier": dp.noise_multiplier, "noise_std": std,
                            # how many were clipped, not which or by how much: a factor is clip / the
                            # update's norm, a per-update figure the guarantee does not cover
                            "updates": len(use), "clipped": sum(1 for f in scales if f < 1.0)}
                    new_state = opt.step(global_state, agg)
                    del agg
                    if spec.communication.download == "topk":
                        new_state, residual = downlink.sparse_step(global_state, new_state,
                                                                   spec.communication.download_fraction, residual)
                else:
                    new_state = {k: v.clone() for k, v in global_state.items()}
                    evidence["empty"] = "no update was included; the model is unchanged"
                del use
        for k, t in new_state.items():
            if t.is_floating_point() and not _all_finite(t):
                raise AggregationError(f"aggregated model tensor {k!r} is not finite")
        compared_shas = {reps[i].sha: c for i in included if (c := shard_of[reps[i].id].comparison)}
        # the server optimizer's blob and the evaluation beside the model's blob
        opt_put = pool.submit(self._put_opt_state, opt, residual) if opt.kind != "none" or residual else None
        scored = pool.submit(self._evaluate, spec, new_state, job.val_sha) if job.val_sha else None
        model_hash = self._put_state({k: v.contiguous() for k, v in new_state.items()})
        if on_model is not None:
            on_model(model_hash)
        opt_sha = opt_put.result() if opt_put is not None else None
        metrics: dict[str, float] = scored.result() if scored is not None else {}
        tot = sum(shard_of[reps[i].id].samples for i in included)
        train_loss = (sum(reps[i].loss * shard_of[reps[i].id].samples for i in included) / tot) if tot else None
        metrics = {k: v for k, v in metrics.items() if math.isfinite(v)}
        if train_loss is not None and math.isfinite(train_loss):
            metrics["train_loss"] = train_loss
        self.audit.append("aggregation", aggregation_body(
            job_id=job.id, round=job.round, model_hash=model_hash, method=spec.aggregation.method,
            included=[reps[i].sha for i in included],
            excluded=[(u.sha, flagged.get(u.id, "excluded")) for i, u in enumerate(reps) if i not in included],
            unverified=[reps[i].sha for i in included if shard_of[reps[i].id].unverified],
            server_optimizer=spec.aggregation.server_optimizer, samples=tot,
            metrics={k: round(v, 6) for k, v in metrics.items()},
            # included updates that stand for a replica group: compared within one class or across
            **({"replica_comparison": compared_shas} if compared_shas else {}),
        ))
        return {
            "model_hash": model_hash, "opt_state_sha": opt_sha, "judgement": judgement,
            "evidence": evidence, "metrics": metrics, "train_loss": _finite_or_none(train_loss),
        }

    def _secagg_step(self, job: JobState, sa: SecAggRound, reps: list[UpdateState],
                     global_state: dict[str, Tensor]) -> tuple[
            policy.RoundJudgement, list[int], dict[str, str], dict[str, Any], ServerOptimizer, dict[str, Tensor],
            dict[str, Tensor]]:
        """A secure-aggregation round: the weighted mean of the updates whose masks came off (the
        protocol's sum, never one update), or, when the protocol aborted, the model unchanged. No
        update can be scored or bounded: the hub never sees one."""
        alive = set(sa.alive) if sa.phase == "done" else set()
        included = [i for i, u in enumerate(reps) if u.node_id in alive]
        statuses = {u.id: "included" if i in included else "excluded" for i, u in enumerate(reps)}
        evidence: dict[str, Any] = {"secure_aggregation": {
            "phase": sa.phase, "roster": len(sa.roster), "threshold": sa.threshold, "survivors": len(sa.survivors),
            "summed": len(alive), "clip": sa.clip, "bits": sa.bits, **({"detail": sa.detail} if sa.detail else {})}}
        opt = ServerOptimizer.from_spec(job.spec.aggregation)
        residual: dict[str, Tensor] = {}
        if job.opt_state_sha:
            stored, residual = downlink.split_state(decode_state(self.blobs.read_private(job.opt_state_sha)))
            opt.load_state_dict(stored)
        if included:
            mean, weight = sa.mean_update()
            evidence["secure_aggregation"]["weight"] = round(weight, 6)
            agg: dict[str, Tensor] = {}
            at = 0
            for t in job.layout.model:
                if not t.dtype.startswith(("float", "bfloat")):
                    continue
                n = math.prod(t.shape)
                ref = global_state[t.name]
                agg[t.name] = torch.from_numpy(mean[at:at + n]).to(ref.dtype).reshape(ref.shape)
                at += n
            new_state = opt.step(global_state, agg)
            if job.spec.communication.download == "topk":
                new_state, residual = downlink.sparse_step(global_state, new_state,
                                                           job.spec.communication.download_fraction, residual)
        else:
            new_state = {k: v.clone() for k, v in global_state.items()}
            evidence["empty"] = f"secure aggregation {sa.phase}: the model is unchanged"
        review = vf.RoundReview([reps[i].id for i in included], [], {})
        judgement = policy.RoundJudgement(review, statuses, (), (), ())
        return judgement, included, {}, evidence, opt, residual, new_state

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
        for rid in [rid for rid, r in self.state_requests.items() if r.job_id == job.id]:
            del self.state_requests[rid]  # nobody is asked for a state of a job that ended
        job.end(state)
        job.error = reason
        self.signal.notify()


def _declined(r: StateRequestState, u: UpdateState) -> SegmentVerdict:
    """The verdict on an update whose node said it no longer holds the states asked for: left
    out unverified, without a flag (policy: "unreachable")."""
    return SegmentVerdict(u.id, u.node_id, "unreachable", {
        "check": "segment_replay", "round": r.round, "node": u.node_id, "update": u.id, "reason": r.reason,
        "request": r.id, "declined_steps": sorted(r.declined),
        "why": "the node said it no longer holds the committed states asked for; its update is left out unverified"})
