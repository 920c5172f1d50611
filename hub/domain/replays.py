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

from gpuflex.protocol.messages import TrainConfig
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


@dataclass(frozen=True)
class ReplayItem:
    """One update's segment replay: its request, the states handed over (a copy: a late upload
    changes nothing), and what the replay reads besides the job's model and chunks."""

    request: StateRequestState
    update: UpdateState
    states: Mapping[int, str]
    asked: bool
    onednn: bool
    previous: tuple[str, ...] | None  # the node's earlier uploads, for error feedback's residual chain


@dataclass(frozen=True)
class Replay:
    """What judging one shard's state requests reads, taken under the round engine's lock
    (``RefereeReplays.prepare``) so that the re-execution runs without it. ``declined``: the
    verdicts given without a replay; ``items``: the segments to re-execute (none: apply at once)."""

    job: JobState
    shard: ShardState
    requests: tuple[StateRequestState, ...]
    declined: Mapping[str, SegmentVerdict]
    items: tuple[ReplayItem, ...]
    model_hash: str
    chunk_shas: tuple[str, ...]
    cfg: TrainConfig
    seed: int


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
        #: (job id, shard id) of the shards whose segments are being re-executed now
        self.replaying: set[tuple[str, str]] = set()
        #: called in the worker thread before each re-execution starts (tests hold a replay with it)
        self.before_replay: Callable[[], None] | None = None

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

    async def ask(self, job: JobState, shard: ShardState, decision: policy.Referee, *,
                  same_class: bool = False) -> bool:
        """Open a state request for each update the policy wants re-executed (persisted first);
        an update with no usable commitment gets its unverifiable verdict at once (True).
        ``same_class``: the shard's replicas are of one compute class (ReplicaState.comparison),
        so a disagreement's segment is found from the checkpoint hashes (referee.pick_segment)."""
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
            # beside a disagreeing replica: one whose trajectory differs from this one, when any does
            others = [o.commitment for o in shard.accepted if o.id != uid and o.commitment is not None]
            other = next((o for o in others if o.hashes != c.hashes), others[0]) if others else None
            seg = pick_segment(c, other if decision.reason == "disagreement" else None,
                               draw=segment_draw(self.audit_secret, job.id, uid), same_class=same_class)
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

    async def prepare(self, job: JobState, shard: ShardState) -> Replay:
        """Every requested state is in (or its time ran out): what judging the shard reads, taken
        under the engine's lock (the store's earlier uploads, the blob ids, the settings). A request
        the node declined is decided here, without a replay: no model, chunks or states read."""
        reqs = tuple(shard.requests.values())
        by_id = {u.id: u for u in shard.accepted}
        declined = {r.update_id: _declined(r, by_id[r.update_id]) for r in reqs if r.declined}
        replay = [r for r in reqs if not r.declined]
        earlier = await self._earlier_uploads(job, [by_id[r.update_id] for r in replay]) if replay else {}
        items = []
        for r in replay:
            u = by_id[r.update_id]
            node = self.scheduler.nodes.get(u.node_id)
            items.append(ReplayItem(request=r, update=u, states=dict(r.states), asked=r.asked,
                                    onednn=replay_onednn(None if node is None else node.compute),
                                    previous=tuple(earlier[u.id]) if u.id in earlier else None))
        return Replay(job=job, shard=shard, requests=reqs, declined=declined, items=tuple(items),
                      model_hash=job.model_hash, chunk_shas=tuple(c.sha for c in job.chunks_at(shard.chunk_idxs)),
                      cfg=job.train_config(shard.samples), seed=shard.seed)

    def current(self, replay: Replay) -> bool:
        """Is the shard still where the replay found it: its job running, the shard open and waiting
        on the very requests the replay judged (a rollback or the job's end forgets them)?"""
        job, shard = replay.job, replay.shard
        return (job.state == "running" and job.shards.get(shard.id) is shard and shard.state == "open"
                and all(self.state_requests.get(r.id) is r and shard.requests.get(r.update_id) is r
                        for r in replay.requests))

    async def apply(self, replay: Replay, verdicts: Mapping[str, SegmentVerdict]) -> bool:
        """Record the verdicts (store, then memory), under the engine's lock. A replay whose shard
        moved on meanwhile (``current`` is False: the job ended or was rolled back, which forgot the
        requests) is dropped: nothing is written, the requests stay as the store has them. False then."""
        if not self.current(replay):
            return False
        verdicts = dict(verdicts) | replay.declined
        shard = replay.shard
        await self.store.close_state_requests([(r.id, verdicts[r.update_id].outcome,
                                                dict(verdicts[r.update_id].evidence)) for r in replay.requests])
        for r in replay.requests:
            shard.requests.pop(r.update_id, None)
            self.state_requests.pop(r.id, None)
            shard.verdicts[r.update_id] = verdicts[r.update_id]
        self.metrics.referee_verdicts.update(verdicts[r.update_id].outcome for r in replay.requests)
        return True

    async def _earlier_uploads(self, job: JobState, ups: Sequence[UpdateState]) -> dict[str, list[str]]:
        """For a job with error feedback: each update's node's latest earlier uploads in the job
        (blob ids, newest first, up to RESIDUAL_LOOKBACK), for the referee's residual chain."""
        enc = job.layout.encoding
        if enc.identity or not enc.error_feedback:
            return {}
        return {u.id: await self.store.uploads_before(job.id, u.node_id, u.received_at, but=u.id,
                                                      limit=RESIDUAL_LOOKBACK) for u in ups}

    def replay(self, replay: Replay) -> dict[str, SegmentVerdict]:
        """Re-execute the segments (worker thread, no lock held): reads only ``replay`` and blobs."""
        if self.before_replay is not None and replay.items:
            self.before_replay()
        spec = replay.job.spec
        vspec = spec.verification
        encoding = replay.job.layout.encoding
        global_state = decode_state(self.blobs.read_private(replay.model_hash))
        x, y = stack_data([decode_state(self.blobs.read_private(sha)) for sha in replay.chunk_shas])
        out: dict[str, SegmentVerdict] = {}
        for item in replay.items:
            r, u = item.request, item.update
            c = u.commitment
            if c is None:  # not reached: requests are opened only for committed updates
                continue
            states = {step: decode_state(self.blobs.read_private(sha)) for step, sha in item.states.items()}
            tol = float(vspec.segment_tolerance if c.precision == "fp32" else vspec.segment_tolerance_low)
            delta = decode_state(self.blobs.read_private(u.sha))
            previous = None if item.previous is None else [
                decode_state(self.blobs.read_private(sha)) for sha in item.previous]
            v = judge_segment(update_id=u.id, node_id=u.node_id, round=r.round, spec=spec.model, cfg=replay.cfg,
                              seed=replay.seed, commitment=c, segment=r.segment, states=states,
                              global_state=global_state, delta=delta, x=x, y=y, tolerance=tol,
                              onednn=item.onednn, encoding=encoding, previous=previous)
            outcome, evidence = v.outcome, dict(v.evidence) | {"reason": r.reason, "request": r.id}
            if outcome == "unverifiable" and not item.asked:
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
