"""Rounds: settle replicated shards, close a covered round, aggregate, evaluate.

One `RoundEngine` per hub. Its `advance(job)` is serialized by a lock (aggregation
never runs twice at once) and does the heavy work (opening update blobs with
mmap, comparing replicas, aggregating, evaluating) in a worker thread. Updates are
visited in a fixed order (update sha, then id), so the same accepted updates give
the same model bytes, across restarts too.

Verification (hub/verification.py: compare_replicas, review_round, reputation
transitions) decides what is aggregated; every aggregation is appended to the
audit log (hub/auditlog.py) before its round is committed, so a crash between the
two repeats the (deterministic, identical) entry rather than losing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import mmap
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from gpuflex.protocol.modelspec import param_count
from gpuflex.protocol.tensors import decode_state, encode_state
from torch import Tensor

from . import verification as vf
from .aggregation import AggregationError, ServerOptimizer, aggregate
from .auditlog import AuditLog, aggregation_body
from .blobs import BlobStore
from .evaluation import evaluate
from .jobs import JobState, ShardState, UpdateState
from .metrics import HubMetrics
from .scheduler import Scheduler, WorkSignal
from .store import RoundResult, Store

log = logging.getLogger("gpuflex.hub.rounds")


@contextlib.contextmanager
def open_deltas(blobs: BlobStore, shas: Sequence[str]) -> Iterator[list[dict[str, Tensor]]]:
    """Zero-copy views of update blobs (the hub's in-memory copy of a small one, else a
    read-only mmap), closed on exit."""
    maps: list[mmap.mmap] = []
    files = []
    states: list[dict[str, Tensor]] = []
    try:
        for sha in shas:
            hot = blobs.hot(sha)
            if hot is not None:
                states.append(decode_state(hot))
                continue
            fh = open(blobs.path(sha), "rb")
            files.append(fh)
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            maps.append(mm)
            states.append(decode_state(mm))
        yield states
    finally:
        del states  # drop tensor views before closing their buffers
        for mm in maps:
            with contextlib.suppress(BufferError):
                mm.close()
        for fh in files:
            fh.close()


@dataclass
class Settlement:
    representative: str | None
    statuses: dict[str, str]
    flags: list[vf.Flag]
    evidence: dict[str, Any]
    needs_more: bool = False
    agreed_nodes: list[str] = field(default_factory=list)
    flagged_nodes: list[str] = field(default_factory=list)


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


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
    ) -> None:
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

    # -- driving ---------------------------------------------------------------------------
    def poke(self, job_id: str) -> None:
        self._pending.add(job_id)
        self._wake.set()

    async def run(self) -> None:
        """Background loop: advance jobs that something happened to.

        One job's failure fails that job, not the loop. If failing it fails too (the store
        is down), the exception leaves the loop: its supervisor (hub/loops.py) logs it, turns
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
            rwait = float(job.spec.verification.replica_wait_s)
            for shard in sorted(job.shards.values(), key=lambda s: s.seq):
                if shard.state != "open" or not shard.accepted:
                    continue
                timed_out = shard.first_update_at is not None and now - shard.first_update_at >= rwait
                stuck = (len(shard.accepted) >= 2 and len(shard.accepted) < shard.wanted and not shard.live
                         and not self.scheduler.replica_takers(job, shard, now))
                if len(shard.accepted) >= shard.wanted or timed_out or stuck:
                    await self._settle(job, shard, timed_out)
            if job.state == "running" and job.round_complete():
                await self._close(job)

    # -- replicas --------------------------------------------------------------------------
    async def _settle(self, job: JobState, shard: ShardState, timed_out: bool) -> None:
        ups = sorted(shard.accepted, key=lambda u: (u.sha, u.id))
        if len(ups) == 1:
            # a lone update (no replica came in time): used unverified, no agreement credit
            result = Settlement(ups[0].id, {}, [], {"replicas": 1, "unverified": shard.wanted > 1})
        else:
            result = await asyncio.to_thread(self._compare, job, shard, ups)
            if result.needs_more:
                pairs = result.evidence.get("pairs") or []
                unanimous = bool(pairs) and all(p.get("agree") for p in pairs)
                # Waiting for a replica nobody online can take only delays the round: when the
                # replicas already agree, settle them now (unverified: no agreement credit).
                nobody = unanimous and not shard.live and not self.scheduler.replica_takers(job, shard, time.time())
                if shard.wanted < int(job.spec.verification.max_replicas) and not timed_out and not nobody:
                    await self.store.want_replicas(shard.id, shard.wanted + 1, result.evidence)
                    shard.wanted += 1
                    self.signal.notify()
                    return
                # No further replica came in time. An agreeing majority stands unverified (no credit, no
                # flags); a split is inconclusive: the shard goes back to the pool, nobody is flagged.
                if unanimous:  # every replica agrees with every other
                    rep = ups[0].id  # ups are sorted by (sha, id)
                    result = Settlement(rep, {u.id: "redundant" for u in ups if u.id != rep}, [],
                                        result.evidence | {"unverified": "replica_wait"})
                else:
                    result = Settlement(None, {u.id: "excluded" for u in ups}, [],
                                        result.evidence | {"inconclusive": "replica_wait"})
        # -- apply: store first, then memory
        cancelled = list(shard.live.values())
        dropped = result.representative is None
        touched = self._reputations(result.agreed_nodes, result.flagged_nodes)
        await self.store.settle_shard(
            shard, state="dropped" if dropped else "settled", evidence=result.evidence,
            statuses=result.statuses, cancelled=[a.id for a in cancelled], flags=result.flags,
            round=job.round, reputations=touched, now=time.time())
        for a in cancelled:
            self.scheduler.detach(a)
        shard.state = "dropped" if dropped else "settled"
        shard.representative = result.representative
        for u in shard.accepted:
            if u.id in result.statuses:
                u.status = result.statuses[u.id]
        self._apply_reputations(touched)
        job.replicated.pop(shard.id, None)
        if dropped:
            job.shards.pop(shard.id, None)
            job.release(shard.chunk_idxs)
        if dropped or cancelled:
            self.signal.notify()

    def _reputations(self, agreed: Sequence[str], flagged: Sequence[str]) -> list[tuple[str, vf.Reputation]]:
        """The nodes' reputations after verification's transitions (memory is not touched)."""
        after: dict[str, vf.Reputation] = {}
        for nid, step in [(n, vf.record_agreement) for n in agreed] + [(n, vf.record_flag) for n in flagged]:
            node = self.scheduler.nodes.get(nid)
            if node is not None:
                after[nid] = step(after.get(nid, node.reputation))
        return list(after.items())

    def _apply_reputations(self, touched: Sequence[tuple[str, vf.Reputation]]) -> None:
        for nid, rep in touched:
            node = self.scheduler.nodes.get(nid)
            if node is not None:
                node.reputation = rep

    def _records(self, job: JobState, shard_of: Mapping[str, ShardState], ups: Sequence[UpdateState],
                 deltas: Sequence[Mapping[str, Tensor]]) -> list[vf.UpdateRecord]:
        """Verification's view of updates. Speed: max(benchmark, delivered EMA) is an upper bound of
        the node's training speed; peak FLOP/s and the model size go along when UpdateRecord takes them."""
        fields = getattr(vf.UpdateRecord, "__dataclass_fields__", {})
        out = []
        for u, d in zip(ups, deltas, strict=True):
            node = self.scheduler.nodes.get(u.node_id)
            extra: dict[str, Any] = {}
            if "peak_flops" in fields:
                extra["peak_flops"] = node.peak_flops if node else 0.0
            if "param_count" in fields:
                extra["param_count"] = param_count(job.spec.model)
            if "local_epochs" in fields:
                extra["local_epochs"] = int(job.spec.train.local_epochs)
            out.append(vf.UpdateRecord(
                update_id=u.id, node_id=u.node_id, shard_id=u.shard_id,
                samples_claimed=u.sample_count, shard_samples=shard_of[u.id].samples,
                loss=u.loss, train_s=u.train_s,
                node_samples_per_s=max(node.bench_sps, node.ema_sps) if node else 0.0, delta=d,
                elapsed_s=u.elapsed_s, **extra,
            ))
        return out

    def _compare(self, job: JobState, shard: ShardState, ups: list[UpdateState]) -> Settlement:
        with open_deltas(self.blobs, [u.sha for u in ups]) as deltas:
            records = self._records(job, {u.id: shard for u in ups}, ups, deltas)
            trusted = {u.node_id for u in ups if (n := self.scheduler.nodes.get(u.node_id)) is not None
                       and vf.is_trusted(n.reputation, job.spec.verification)}
            out = vf.compare_replicas(records, job.spec.verification, trusted=trusted)
            del records
        flags = [vf.Flag(f.update_id, f.node_id, f.reason, dict(f.evidence)) for f in out.flags]
        evidence = dict(out.evidence)
        if out.needs_more:
            return Settlement(None, {}, [], evidence, needs_more=True)
        flagged = {f.update_id for f in flags}
        statuses = {u.id: "quarantined" for u in ups if u.id in flagged}
        if not out.agreed and not flags:  # inconclusive split among untrusted nodes: drop, no flags, no credit
            return Settlement(None, {u.id: "excluded" for u in ups}, [], evidence | {"inconclusive": True})
        rep: str | None = None
        agreed_nodes: list[str] = []
        if out.agreed:
            rep = out.canonical or min(out.majority)
            by_id = {u.id: u for u in ups}
            agreed_nodes = sorted({by_id[m].node_id for m in out.majority if m in by_id})
            for u in ups:
                if u.id != rep and u.id not in flagged:
                    statuses[u.id] = "redundant"
        return Settlement(rep, statuses, flags, evidence, agreed_nodes=agreed_nodes,
                          flagged_nodes=sorted({f.node_id for f in flags}))

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
            result = await asyncio.to_thread(self._aggregate, job, reps, shard_of)
        except BaseException:
            job.closing = False
            raise
        # live assignments of a finished round are void (replicas of settled shards were already cancelled)
        leftovers = [a for s in job.shards.values() for a in s.live.values()]
        now = time.time()
        last = job.round + 1 >= job.rounds
        next_round = job.round + 1
        vouched, withdrawn = self._vouch(shards, result)
        touched = self._reputations([], result["flagged_nodes"] + [f.node_id for f in vouched])
        outcome = RoundResult(
            model_sha=result["model_sha"], opt_state_sha=result["opt_state_sha"], statuses=result["statuses"],
            flags=result["flags"], evidence=result["evidence"], metrics=result["metrics"],
            train_loss=result["train_loss"], flagged_nodes=result["flagged_nodes"])
        try:
            await self.store.close_round(job, outcome, flags=result["flags"] + vouched, withdrawn=withdrawn,
                                         cancelled=[a.id for a in leftovers], reputations=touched, last=last,
                                         now=now)
        finally:
            job.closing = False
        for a in leftovers:
            self.scheduler.detach(a)
        self._apply_reputations(touched)
        job.error = None  # a failure noted while this round could not close is over
        job.model_sha = result["model_sha"]
        job.opt_state_sha = result["opt_state_sha"]
        job.round = next_round
        self.metrics.rounds_closed += 1
        if last:
            job.end("done")
        else:
            job.open_round()
        self.last_close_ms = (time.perf_counter() - t0) * 1000
        self.signal.notify()

    @staticmethod
    def _vouch(shards: Sequence[ShardState], result: dict[str, Any]) -> tuple[list[vf.Flag], list[str]]:
        """When review flags a replica group's canonical update, the majority that agreed with it is
        flagged too (it vouched for it) and the minority's replica_mismatch flags are withdrawn."""
        reasons = {f.update_id: f.reason for f in result["flags"]}
        vouched: list[vf.Flag] = []
        withdrawn: list[str] = []
        for s in shards:
            if s.representative not in reasons or len(s.accepted) < 2:
                continue
            for u in s.accepted:
                if u.status == "redundant":
                    vouched.append(vf.Flag(u.id, u.node_id, reasons[s.representative],
                                           {"vouched_for": s.representative}))
                    result["statuses"][u.id] = "quarantined"
                elif u.status == "quarantined":
                    withdrawn.append(u.id)
        return vouched, withdrawn

    def _aggregate(self, job: JobState, reps: list[UpdateState], shard_of: dict[str, ShardState]) -> dict[str, Any]:
        """Review, aggregate, step the server optimizer, evaluate, log. Worker thread; no DB writes."""
        spec = job.spec
        global_state = decode_state(bytearray(self.blobs.read(job.model_sha)))
        statuses: dict[str, str] = {}
        flags: list[vf.Flag] = []
        evidence: dict[str, Any] = {}
        with open_deltas(self.blobs, [u.sha for u in reps]) as deltas:
            included: list[int] = []
            if reps:
                gnorm = math.sqrt(sum(float((t.double() ** 2).sum()) for t in global_state.values()
                                      if t.is_floating_point()))
                records = self._records(job, shard_of, reps, deltas)
                review = vf.review_round(records, gnorm, spec.verification)
                del records
                keep = set(review.included)
                included = [i for i, u in enumerate(reps) if u.id in keep]
                flags = [vf.Flag(f.update_id, f.node_id, f.reason, dict(f.evidence)) for f in review.flags]
                evidence = dict(review.evidence)
            flagged = {f.update_id: f.reason for f in flags}
            for i, u in enumerate(reps):
                statuses[u.id] = "included" if i in included else ("quarantined" if u.id in flagged else "excluded")
            use = [deltas[i] for i in included]
            weights = [float(shard_of[reps[i].id].samples) for i in included]
            opt = ServerOptimizer.from_spec(spec.aggregation)
            if job.opt_state_sha:
                opt.load_state_dict(decode_state(bytearray(self.blobs.read(job.opt_state_sha))))
            if use:
                agg = aggregate(use, weights, spec.aggregation)
                new_state = opt.step(global_state, agg)
                del agg
            else:
                new_state = {k: v.clone() for k, v in global_state.items()}
                evidence["empty"] = "no update was included; the model is unchanged"
            del use
        for k, t in new_state.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise AggregationError(f"aggregated model tensor {k!r} is not finite")
        model_blob = encode_state({k: v.contiguous() for k, v in new_state.items()})
        model_sha = self.blobs.put(model_blob)
        opt_sha = self.blobs.put(encode_state(opt.state_dict())) if opt.kind != "none" else None
        metrics: dict[str, float] = {}
        if job.val_sha:
            val = decode_state(bytearray(self.blobs.read(job.val_sha)))
            metrics = evaluate(spec, new_state, val)
        tot = sum(shard_of[reps[i].id].samples for i in included)
        train_loss = (sum(reps[i].loss * shard_of[reps[i].id].samples for i in included) / tot) if tot else None
        metrics = {k: v for k, v in metrics.items() if math.isfinite(v)}
        if train_loss is not None and math.isfinite(train_loss):
            metrics["train_loss"] = train_loss
        self.audit.append("aggregation", aggregation_body(
            job_id=job.id, round=job.round, model_hash=model_sha, method=spec.aggregation.method,
            included=[reps[i].sha for i in included],
            excluded=[(u.sha, flagged.get(u.id, "excluded")) for i, u in enumerate(reps) if i not in included],
            server_optimizer=spec.aggregation.server_optimizer, samples=tot,
            metrics={k: round(v, 6) for k, v in metrics.items()},
        ))
        return {
            "model_sha": model_sha, "opt_state_sha": opt_sha, "statuses": statuses, "flags": flags,
            "evidence": evidence, "metrics": metrics, "train_loss": _finite_or_none(train_loss),
            "flagged_nodes": sorted({f.node_id for f in flags}),
        }

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
        job.end(state)
        job.error = reason
        self.signal.notify()
