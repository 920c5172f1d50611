"""The referee's side of a round: the spot-check and segment draws, asking nodes for their
committed states, and replaying segments when they are in (hub/policy/referee.py decides; this
gathers its inputs, persists the requests and verdicts, store first, then memory)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuflex.protocol.modelspec import param_count
from gpuflex.protocol.tensors import decode_state

from ..model.job import JobState, ShardState, StateRequestState, UpdateState, new_id
from ..policy import round_policy as policy
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
from ..storage.blobs import BlobStore
from ..storage.store import Store
from .metrics import HubMetrics
from .scheduler import Scheduler
from .worksignal import WorkSignal


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


@dataclass(frozen=True)
class RefereeInputs:
    """What the round policy's ``decide_shard`` reads about the referee for one shard: the updates
    that carry a checkpoint commitment, the verdicts given so far, and the shard's spot-check draw."""

    committed: frozenset[str]
    verdicts: Mapping[str, SegmentVerdict]
    spot_draw: float


class RefereeReplays:
    """Opens the referee's state requests, resumes them after a restart and judges them once the
    states are in (or their deadline passed). ``state_requests``: the open ones, by id (the ledger
    answers nodes from it)."""

    def __init__(self, *, store: Store, blobs: BlobStore, scheduler: Scheduler, metrics: HubMetrics,
                 signal: WorkSignal, audit_secret: bytes, poke: Callable[[str], None]) -> None:
        #: keys the referee's spot-check draws (``spot_draw``); derived from the hub's signing key
        self.audit_secret = audit_secret
        self.store = store
        self.blobs = blobs
        self.scheduler = scheduler
        self.metrics = metrics
        self.signal = signal
        self.poke = poke
        self.state_requests: dict[str, StateRequestState] = {}

    def spot_draw(self, job_id: str, shard_id: str) -> float:
        """The shard's spot-check draw (``spot_draw`` under this hub's audit secret)."""
        return spot_draw(self.audit_secret, job_id, shard_id)

    def inputs(self, job: JobState, shard: ShardState, ups: Sequence[UpdateState]) -> RefereeInputs:
        return RefereeInputs(frozenset(u.id for u in ups if u.commitment is not None), dict(shard.verdicts),
                             self.spot_draw(job.id, shard.id))

    def forget_job(self, job_id: str) -> None:
        """Nobody is asked for a state of a job that ended."""
        for rid in [rid for rid, r in self.state_requests.items() if r.job_id == job_id]:
            del self.state_requests[rid]

    async def ask(self, job: JobState, shard: ShardState, decision: policy.Referee) -> bool:
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

    def resume(self, rows: Sequence[tuple[StateRequestState, str, Mapping[str, Any]]]) -> None:
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

    async def judge(self, job: JobState, shard: ShardState) -> None:
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
        cfg = job.train_config(shard.samples)  # what the assignment carried (precision: the commitment's)
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
                              cfg=cfg,
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


def _declined(r: StateRequestState, u: UpdateState) -> SegmentVerdict:
    """The verdict on an update whose node said it no longer holds the states asked for: left
    out unverified, without a flag (policy: "unreachable")."""
    return SegmentVerdict(u.id, u.node_id, "unreachable", {
        "check": "segment_replay", "round": r.round, "node": u.node_id, "update": u.id, "reason": r.reason,
        "request": r.id, "declined_steps": sorted(r.declined),
        "why": "the node said it no longer holds the committed states asked for; its update is left out unverified"})
