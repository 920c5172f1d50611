"""The hub at 100 to 10,000 nodes, simulated: the real scheduler and the real round policy.

No network and no training: each simulated node has a speed (samples/s, log-normal), goes
offline and comes back (churn), and 20 % of the identities belong to one coordinated
adversary. Everything the hub decides is the hub's own code, called the way the hub calls
it: `Scheduler.plan` (the gathering, the balanced carve, replicas first) on a simulated
clock, `policy.decide_shard` each time a shard's update arrives or its replica wait runs
out, and `policy.judge_round` when the round is covered. Reputations move with
verification's `record_agreement` / `record_flag`, as the engine applies them. Waiting nodes
are woken as the hub's WorkSignal wakes its long-polls (hub/domain/worksignal.py): everyone when a
round opens; for chunks back in the pool, the longest-waiting poll first, the offer passed on
(`pass_on`) while polls get work, until 3 in a row find nothing; for a wanted replica, the
longest-waiting poll of a node that may take it (`Replicas.may_take_replica`).

An update is a small real tensor (256 floats): an honest node returns the shard's true
update (a function of the round's direction and the shard's seed, so honest replicas agree
bit for bit); the adversary returns the sign-flipped update, the same one from each of its
identities (colluders agree with each other on purpose).

Per node count (one row each): shard balance (max/mean of the carve's expected training
time over the nodes that carved in the round's opening gathering), replication overhead
(samples trained beyond the round's distinct samples, after trust has formed), detection
(adversary updates flagged or left out / adversary updates), honest updates flagged, and
the hub's CPU per round (process time of plan + decide_shard + judge_round).

Run: .venv/bin/python bench/simulation.py [--nodes 100,300,1000,3000,10000] [--rounds 14]
-> bench/results/simulation.json and bench/results/simulation.png
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import heapq
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

from gpuflex.hub.base.config import HubConfig  # noqa: E402
from gpuflex.hub.domain.presence import Presence  # noqa: E402
from gpuflex.hub.domain.scheduler import Scheduler  # noqa: E402
from gpuflex.hub.domain.worksignal import Target, Wake, pass_on  # noqa: E402
from gpuflex.hub.model.job import AssignmentState, ChunkInfo, JobState, ShardState, UpdateState  # noqa: E402
from gpuflex.hub.model.node import NodeState  # noqa: E402
from gpuflex.hub.policy import round_policy as policy  # noqa: E402
from gpuflex.hub.policy import verification as vf  # noqa: E402
from gpuflex.protocol.jobspec import parse_job_spec  # noqa: E402

DIM = 256
CHUNK = 64
CHUNKS_PER_NODE = 8  # a round has 8 chunks per node: a shard is a handful of chunks, as on a real job
EPOCHS = 1
SPEC_TOML = """
[job]
name = "simulation"
[model]
kind = "mlp"
input = 16
hidden = [8]
outputs = 2
[train]
rounds = 1000
local_epochs = {epochs}
round_target_s = 3600.0
[data]
chunk_size = {chunk}
[verification]
replication = "adaptive"
trust_after = {trust_after}
replica_wait_s = 30.0
"""


@dataclass
class SimNode:
    state: NodeState
    speed: float  # samples/s it really trains at
    adversary: bool
    online: bool = True


@dataclass
class Stats:
    balance: list[float] = field(default_factory=list)
    trained: int = 0
    distinct: int = 0
    trained_steady: int = 0
    distinct_steady: int = 0
    adv_updates: int = 0
    adv_caught: int = 0
    honest_flagged: int = 0
    cpu_s: list[float] = field(default_factory=list)
    shards: list[int] = field(default_factory=list)


def true_update(direction: torch.Tensor, seed: int, samples: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
    noise = torch.randn(DIM, generator=g) * 0.2
    return (direction + noise) * (samples / 1000.0)


def record(upd: UpdateState, shard: ShardState, delta: torch.Tensor, node: NodeState) -> vf.UpdateRecord:
    return vf.UpdateRecord(update_id=upd.id, node_id=upd.node_id, shard_id=shard.id,
                           samples_claimed=upd.sample_count, shard_samples=shard.samples, loss=1.0,
                           train_s=upd.train_s, node_samples_per_s=node.ema_sps, delta={"w": delta},
                           elapsed_s=upd.elapsed_s, local_epochs=EPOCHS)


def simulate(n: int, rounds: int, *, attackers: float, churn: float, trust_after: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    spec = parse_job_spec(SPEC_TOML.format(epochs=EPOCHS, chunk=CHUNK, trust_after=trust_after))
    vspec = spec.verification
    hub = HubConfig(data_dir=Path("unused"))  # the hub's defaults, Sybil defences included (hub/server/app.py builds it the same way)
    sched = Scheduler(min_deadline_s=30.0, online_window_s=90.0, rng=random.Random(seed + 1),
                      separate_replicas=hub.separate_replicas, trust_min_age_s=hub.trust_min_age_s,
                      unproven_max_chunks=hub.unproven_max_chunks)
    chunks = [ChunkInfo(i, hashlib.sha256(f"{seed}:{i}".encode()).hexdigest(), CHUNK, CHUNK * 64)
              for i in range(CHUNKS_PER_NODE * n)]
    job = JobState(id="j-sim", owner="o", name="sim", spec=spec, state="running", round=0, rounds=rounds,
                   model_hash="0" * 64, model_size=DIM * 4, chunks=chunks, val_sha=None, opt_state_sha=None,
                   created_at=0.0)
    job.open_round()
    sched.add_job(job)
    nodes: dict[str, SimNode] = {}
    adversaries = set(rng.sample(range(n), round(attackers * n)))
    for i in range(n):
        speed = math.exp(rng.gauss(math.log(500.0), 0.6))
        # every identity in its own address block (a botnet's, for the adversary: the worst case for
        # the block rule), registered before the job (past the hub's probation age by the first round)
        block = f"10.{i >> 8 & 255}.{i & 255}.0/24"
        st = NodeState(id=f"n{i:05d}", public_key=b"", bench_sps=speed,
                       ema_sps=min(speed, hub.bench_seed_max_sps), last_seen=0.0,
                       registered_at=-hub.trust_min_age_s, block=block, last_block=block)
        nodes[st.id] = SimNode(st, speed, i in adversaries)
        sched.nodes[st.id] = st
    stats = Stats()
    clock = 1_000.0
    trusted_from: int | None = None
    for r in range(rounds):
        job.round = r
        job.open_round()
        direction = torch.randn(DIM, generator=torch.Generator().manual_seed(seed * 1000 + r))
        for sn in nodes.values():
            if rng.random() < churn:
                sn.online = not sn.online
        online = [sn for sn in nodes.values() if sn.online and not sn.state.banned]
        for sn in online:
            sn.state.last_seen = clock
            sched.presence.poll_started(sn.state.id)
        cpu = 0.0
        heap: list[tuple[float, int, str, AssignmentState]] = []
        idle: collections.deque[SimNode] = collections.deque()  # the waiting polls, longest first
        deltas: dict[str, torch.Tensor] = {}
        shard_flags: set[str] = set()  # update ids flagged when their shard settled
        issued = 0
        carve_times: list[float] = []
        opening = True

        def serve(sn: SimNode, t: float) -> bool:
            nonlocal cpu, issued
            c0 = time.process_time()
            p = sched.plan(sn.state, frozenset(), t)
            cpu += time.process_time() - c0
            sched.presence.poll_ended(sn.state.id, t) if p is None else None
            if p is None:
                return False
            a = AssignmentState(id=f"a-{r}-{issued}", shard_id=p.shard.id, job_id=job.id, round=r,
                                node_id=sn.state.id, issued_at=t, expected_s=p.expected_s, deadline=p.deadline,
                                sealed=b"", model_hash="", chunk_shas=frozenset())
            issued += 1
            sched.attach(a, p.shard)
            sched.presence.poll_ended(sn.state.id, t)
            took = p.shard.samples * EPOCHS / sn.speed
            if p.new_shard and opening:
                carve_times.append(took)
            heapq.heappush(heap, (t + took * rng.uniform(0.97, 1.03), issued, sn.state.id, a))
            return True

        order = list(online)
        rng.shuffle(order)
        for sn in order:
            if not serve(sn, clock):
                idle.append(sn)
        opening = False
        if len(carve_times) > 1:
            stats.balance.append(max(carve_times) / statistics.fmean(carve_times))

        def offer(t: float, to: Target | None = None) -> None:
            """WorkSignal.offer as the hub's long-polls answer it (hub/domain/worksignal.py): the poll that
            has waited longest (of a node ``to`` accepts) plans first and passes the offer on
            (``pass_on``); a poll that found nothing waits again, last."""
            wake = Wake("offer", 0, to)
            while True:
                sn = next((x for x in idle if to is None or to(x.state.id)), None)
                if sn is None:
                    break
                idle.remove(sn)
                got = serve(sn, t)
                if not got:
                    idle.append(sn)
                misses = pass_on(wake, got)
                if misses is None:
                    break
                wake = Wake("offer", misses, to)

        def decide(shard: ShardState, t: float, waited: float | None = None) -> None:
            nonlocal cpu
            ups = sorted(shard.accepted, key=lambda u: (u.sha, u.id))
            waited_s = waited if waited is not None else t - (shard.first_update_at or t)
            n = len(ups)  # the engine's rule (ShardSettling.replica_state)
            taker = bool(shard.live) or (shard.wanted <= n < 2) or sched.replicas.can_take_replica(job, shard, t)
            state = policy.ReplicaState(wanted=shard.wanted, waited_s=waited_s, live=bool(shard.live), taker=taker)
            if not policy.shard_due(len(ups), vspec, state):
                return
            recs = [record(u, shard, deltas[u.id], nodes[u.node_id].state) for u in ups]
            reps = {u.node_id: nodes[u.node_id].state.reputation for u in ups}
            c0 = time.process_time()
            d = policy.decide_shard(recs, vspec, state, reps)
            cpu += time.process_time() - c0
            if isinstance(d, policy.WaitForMore):
                if d.wanted != shard.wanted:
                    shard.wanted = d.wanted
                    sched.replicas.want_replica(job, shard)
                    offer(t, to=lambda nid: sched.replicas.may_take_replica(job, shard, nid, t))
                return
            for a in list(shard.live.values()):
                sched.detach(a)
            shard_flags.update(f.update_id for f in d.flags)
            for u in shard.accepted:
                u.status = d.statuses.get(u.id, u.status)
            touched = [(nid, vf.record_agreement) for nid in getattr(d, "agreed_nodes", ())]
            touched += [(nid, vf.record_flag) for nid in d.flagged_nodes]
            for nid, step in touched:
                nodes[nid].state.reputation = step(nodes[nid].state.reputation)
            job.replicated.pop(shard.id, None)
            if isinstance(d, policy.Settle):
                shard.state, shard.representative = "settled", d.representative
            else:
                shard.state = "dropped"
                job.shards.pop(shard.id, None)
                job.release(shard.chunk_idxs)
                offer(t)

        while True:
            if heap:
                t, _, nid, a = heapq.heappop(heap)
                clock = max(clock, t)
                shard = sched.delivered(a, clock)
                sn = nodes[nid]
                if shard is not None and shard.state == "open":
                    upd = UpdateState(id=f"u-{a.id}", assignment_id=a.id, shard_id=shard.id, node_id=nid,
                                      sha=hashlib.sha256(a.id.encode()).hexdigest(), size=DIM * 4,
                                      sample_count=shard.samples, loss=1.0, train_s=t - a.issued_at,
                                      received_at=t, elapsed_s=t - a.issued_at)
                    honest = true_update(direction, shard.seed, shard.samples)
                    deltas[upd.id] = -honest if sn.adversary else honest
                    shard.accepted.append(upd)
                    Presence.count_delivery(sn.state, shard)  # as the ledger does (an unproven node's cap grows)
                    if shard.first_update_at is None:
                        shard.first_update_at = t
                    stats.trained += shard.samples
                    if trusted_from is not None:
                        stats.trained_steady += shard.samples
                    decide(shard, t)
                sn.state.last_seen = t
                sched.presence.poll_started(nid)
                if not serve(sn, t):
                    idle.append(sn)
                continue
            waiting = [s for s in job.shards.values() if s.state == "open" and s.accepted]
            if not waiting:
                break
            first = min(s.first_update_at or clock for s in waiting)
            clock = max(clock, first + vspec.replica_wait_s)
            for s in waiting:  # their replica wait has run out
                decide(s, clock, waited=vspec.replica_wait_s)
            if any(s.state == "open" and s.accepted for s in job.shards.values()) and not heap:
                break  # held shards (unverified = "hold"): nothing more happens this round
        for sn in idle:
            sched.presence.poll_ended(sn.state.id, clock)
        settled = [s for s in job.shards.values() if s.state == "settled" and s.representative]
        reps, groups = [], {}
        for s in settled:
            rep = next(u for u in s.accepted if u.id == s.representative)
            reps.append(record(rep, s, deltas[rep.id], nodes[rep.node_id].state))
            groups[rep.id] = tuple(policy.GroupMember(u.id, u.node_id, u.status) for u in s.accepted if u.id != rep.id)
        reps.sort(key=lambda rec: rec.update_id)
        dissent = {u.id: record(u, s, deltas[u.id], nodes[u.node_id].state)
                   for s in settled for u in s.accepted if u.status == "quarantined"}
        c0 = time.process_time()
        judgement = policy.judge_round(reps, 10.0, vspec, groups, dissent=dissent)
        cpu += time.process_time() - c0
        for nid in judgement.flagged_nodes:
            nodes[nid].state.reputation = vf.record_flag(nodes[nid].state.reputation)
        included = set(judgement.review.included)
        # flags that stand: raised at settling or at review, less those the vouching rule withdrew
        standing = (shard_flags | {f.update_id for f in judgement.flags}) - set(judgement.withdrawn)
        for s in job.shards.values():
            for u in s.accepted:
                adv = nodes[u.node_id].adversary
                flagged = u.id in standing
                if adv:
                    stats.adv_updates += 1
                    stats.adv_caught += int(flagged or u.id not in included)
                elif flagged:
                    stats.honest_flagged += 1
        distinct = sum(s.samples for s in settled)
        stats.distinct += distinct
        if trusted_from is not None:
            stats.distinct_steady += distinct
        honest = [sn for sn in nodes.values() if not sn.adversary and sn.online]
        if trusted_from is None and honest and sum(vf.is_trusted(sn.state.reputation, vspec) for sn in honest) >= 0.8 * len(honest):
            trusted_from = r + 1
        stats.cpu_s.append(cpu)
        stats.shards.append(len(settled))
        for sn in online:
            sched.presence.polling.pop(sn.state.id, None)
        clock += 1.0
    return {
        "nodes": n, "rounds": rounds, "shards_per_round": statistics.fmean(stats.shards),
        "shard_balance_median": statistics.median(stats.balance) if stats.balance else None,
        "shard_balance_p90": sorted(stats.balance)[int(0.9 * (len(stats.balance) - 1))] if stats.balance else None,
        "replication_overhead": (stats.trained - stats.distinct) / stats.distinct if stats.distinct else None,
        "replication_overhead_steady": ((stats.trained_steady - stats.distinct_steady) / stats.distinct_steady
                                        if stats.distinct_steady else None),
        "trusted_from_round": trusted_from,
        "detection_rate": stats.adv_caught / stats.adv_updates if stats.adv_updates else None,
        "adversary_updates": stats.adv_updates, "honest_flagged": stats.honest_flagged,
        "hub_cpu_s_per_round_median": statistics.median(stats.cpu_s),
        "hub_cpu_ms_per_node_round": 1000 * statistics.median(stats.cpu_s) / n,
    }


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return False
    xs = [r["nodes"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].plot(xs, [r["hub_cpu_s_per_round_median"] for r in rows], "o-")
    axes[0].set(xscale="log", yscale="log", xlabel="nodes", ylabel="hub CPU s / round", title="hub CPU per round")
    axes[1].plot(xs, [r["shard_balance_median"] for r in rows], "o-", label="median")
    axes[1].plot(xs, [r["shard_balance_p90"] for r in rows], "s--", label="p90")
    axes[1].axhline(1.25, color="grey", lw=0.8)
    axes[1].set(xscale="log", xlabel="nodes", ylabel="max / mean shard time", title="shard balance")
    axes[1].legend()
    axes[2].plot(xs, [r["detection_rate"] for r in rows], "o-", label="detection")
    axes[2].plot(xs, [r["replication_overhead_steady"] or 0 for r in rows], "s--", label="replication overhead (steady)")
    axes[2].set(xscale="log", xlabel="nodes", ylim=(0, 1.05), title="verification (20 % adversary)")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="100,300,1000,3000,10000")
    ap.add_argument("--rounds", type=int, default=14)
    ap.add_argument("--attackers", type=float, default=0.2)
    ap.add_argument("--churn", type=float, default=0.05)
    ap.add_argument("--trust-after", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    print(f"{'nodes':>6} {'shards/rnd':>10} {'balance med':>11} {'p90':>5} {'overhead':>8} {'steady':>6} "
          f"{'detect':>6} {'honest fl':>9} {'CPU s/rnd':>9} {'ms/node':>7} {'wall s':>7}")
    for n in (int(x) for x in args.nodes.split(",")):
        t0 = time.perf_counter()
        row = simulate(n, args.rounds, attackers=args.attackers, churn=args.churn, trust_after=args.trust_after,
                       seed=args.seed)
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)

        def f(v: Any, fmt: str) -> str:
            return format(v, fmt) if v is not None else "-"

        print(f"{n:>6} {row['shards_per_round']:>10.0f} {f(row['shard_balance_median'], '.2f'):>11} "
              f"{f(row['shard_balance_p90'], '.2f'):>5} {f(row['replication_overhead'], '.2f'):>8} "
              f"{f(row['replication_overhead_steady'], '.2f'):>6} {f(row['detection_rate'], '.3f'):>6} "
              f"{row['honest_flagged']:>9} {row['hub_cpu_s_per_round_median']:>9.3f} "
              f"{row['hub_cpu_ms_per_node_round']:>7.3f} {row['wall_s']:>7.1f}", flush=True)
    base = rows[0]
    out = {
        "rows": rows,
        "ratios": {f"hub_cpu_per_node_{r['nodes']}_vs_{base['nodes']}":
                   r["hub_cpu_ms_per_node_round"] / base["hub_cpu_ms_per_node_round"] for r in rows},
        "figures": {"max_nodes": rows[-1]["nodes"], "detection_rate_min": min(r["detection_rate"] or 0 for r in rows),
                    "honest_flagged_total": sum(r["honest_flagged"] for r in rows),
                    "shard_balance_median_max": max(r["shard_balance_median"] or 0 for r in rows)},
        "settings": vars(args),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "simulation.json").write_text(json.dumps(out, indent=1, sort_keys=True))
    plotted = plot(rows, RESULTS / "simulation.png")
    print(f"wrote bench/results/simulation.json{' and simulation.png' if plotted else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
