"""Data parallelism: a round is cut over every node that wants work, each shard sized to its
node's throughput, so that all finish together (the scheduler's pure carving, no network)."""

from __future__ import annotations

import time

from gpuflex.hub.domain.scheduler import Scheduler
from gpuflex.hub.model.job import AssignmentState, ChunkInfo, JobState
from gpuflex.hub.model.node import NodeState
from gpuflex.hub.policy.reputation import Reputation
from gpuflex.protocol.jobspec import parse_job_spec

from tests.helpers import digits_spec


def make_job(chunks: int = 64, chunk_samples: int = 10, *, replication: str = "0.0",
             target_s: float = 86400.0) -> JobState:
    spec = parse_job_spec(digits_spec(round_target_s=target_s, replication=replication))
    job = JobState(id="j-1", owner="o", name="n", spec=spec, state="running", round=0, rounds=2,
                   model_hash="0" * 64, model_size=1,
                   chunks=[ChunkInfo(i, f"{i:064x}", chunk_samples, 100) for i in range(chunks)],
                   val_sha=None, opt_state_sha=None, created_at=0.0)
    job.open_round()
    return job


def make_node(name: str, sps: float, run: int = 0) -> NodeState:
    return NodeState(id=name, public_key=b"", bench_sps=sps, ema_sps=sps, last_seen=time.time(),
                     reputation=Reputation(consecutive_agreements=run))


def serve(sched: Scheduler, nodes: list[NodeState]) -> dict[str, tuple[int, str]]:
    """Every node is waiting in a long-poll; each asks once, in turn, as the hub serves them.
    Returns node -> (samples, shard id)."""
    for n in nodes:
        sched.nodes[n.id] = n
        sched.presence.poll_started(n.id)
    out = {}
    for i, n in enumerate(nodes):
        p = sched.plan(n, frozenset())
        assert p is not None, f"{n.id} got nothing"
        sched.attach(AssignmentState(id=f"a{i}", shard_id=p.shard.id, job_id=p.job.id, round=0, node_id=n.id,
                                     issued_at=0, expected_s=1, deadline=1e12, sealed=b"", model_hash="",
                                     chunk_shas=frozenset()), p.shard)
        sched.presence.poll_ended(n.id, time.time())
        out[n.id] = (p.shard.samples, p.shard.id)
    return out


def test_equal_nodes_get_equal_shards_covering_the_round():
    sched = Scheduler(min_deadline_s=1.0, online_window_s=90.0)
    job = make_job(chunks=64)
    sched.add_job(job)
    got = serve(sched, [make_node(f"n{i}", 100.0) for i in range(4)])
    assert sorted(s for s, _ in got.values()) == [160, 160, 160, 160]
    assert len({sid for _, sid in got.values()}) == 4 and not job.free


def test_shards_follow_throughput_so_nodes_finish_together():
    sched = Scheduler(min_deadline_s=1.0, online_window_s=90.0)
    job = make_job(chunks=90)
    sched.add_job(job)
    got = serve(sched, [make_node("fast", 200.0), make_node("slow", 100.0)])
    assert got["fast"][0] == 600 and got["slow"][0] == 300
    assert got["fast"][0] / 200.0 == got["slow"][0] / 100.0  # the same training time


def test_round_target_caps_a_shard_and_the_rest_waits():
    sched = Scheduler(min_deadline_s=1.0, online_window_s=90.0)
    job = make_job(chunks=100, target_s=1.0)  # a node trains 100 samples in round_target_s
    sched.add_job(job)
    got = serve(sched, [make_node(f"n{i}", 100.0) for i in range(3)])
    assert [s for s, _ in got.values()] == [100, 100, 100]
    assert len(job.free) == 70  # taken by whoever comes back first


def test_a_lone_node_still_takes_the_whole_round():
    sched = Scheduler(min_deadline_s=1.0, online_window_s=90.0)
    job = make_job(chunks=20)
    sched.add_job(job)
    got = serve(sched, [make_node("only", 5.0)])
    assert got["only"][0] == 200 and not job.free


def test_untrusted_shards_leave_room_for_their_replicas():
    """Adaptive replication: every new node's shard is trained twice, so 4 new nodes make 2
    distinct shards of half the data each (2 carve, 2 take the replicas), not 4 quarters of
    which 2 are trained twice and the round waits on the rest."""
    sched = Scheduler(min_deadline_s=1.0, online_window_s=90.0)
    job = make_job(chunks=64, replication='"adaptive"')
    sched.add_job(job)
    got = serve(sched, [make_node(f"n{i}", 100.0) for i in range(4)])
    shards = {sid: s for s, sid in got.values()}
    assert sorted(shards.values()) == [320, 320] and not job.free


def test_a_node_arriving_later_gets_what_is_left_not_the_others_share():
    sched = Scheduler(min_deadline_s=1.0, online_window_s=90.0)
    job = make_job(chunks=40)
    sched.add_job(job)
    first = serve(sched, [make_node("a", 100.0), make_node("b", 100.0)])
    assert [s for s, _ in first.values()] == [200, 200] and not job.free
    late = make_node("late", 100.0)
    sched.nodes["late"] = late
    assert sched.plan(late, frozenset()) is None  # nothing free, no replica wanted


# -- over HTTP: the real hub, nodes long-polling when the job arrives -------------------------------


async def test_nodes_waiting_when_a_job_arrives_each_get_a_balanced_shard(tmp_path):

    import aiohttp
    from gpuflex.protocol.messages import Assignment

    from tests.helpers import SimNode, start_hub, wait_job, when_job_arrives, write_digits

    train, val, spec = write_digits(tmp_path / "d", rounds=1)
    hub = await start_hub(tmp_path / "hub", long_poll_max_s=10.0)
    try:
        async with aiohttp.ClientSession() as s:
            nodes = [SimNode(s, hub.url, samples_per_s=500.0) for _ in range(4)]
            job, got = await when_job_arrives(nodes, s, hub, spec, train, val)
            assert all(isinstance(a, Assignment) for a in got)
            sizes = sorted(sum(c.samples for c in a.chunks) for a in got)
            chunk_sets = [frozenset(c.sha256 for c in a.chunks) for a in got]
            assert len(set().union(*chunk_sets)) == job["chunks"], "the round must be covered"
            assert sum(len(c) for c in chunk_sets) == job["chunks"], "no chunk twice (no replication)"
            assert max(sizes) - min(sizes) <= 64 + 64, f"unbalanced shards {sizes}"
            for n, a in zip(nodes, got, strict=True):
                blob, samples, loss = await n.train(a)
                await n.upload(a, blob, samples, loss)
            doc = await wait_job(s, hub, job["id"])
        (h,) = doc["history"]
        assert h["parallel"]["shards"] == 4 and h["parallel"]["nodes"] == 4
        assert sorted(round(v, 2) for v in h["node_shares"].values()) == sorted(
            round(x / sum(sizes), 2) for x in sizes)
        assert all(0.15 < v < 0.35 for v in h["node_shares"].values())
        assert doc["parallel"]["rounds"] == 1 and doc["parallel"]["efficiency"] is not None
    finally:
        await hub.stop()


def test_the_replica_pool_answers_as_replica_candidates_does():
    """The scheduler's fast index gives replica_candidates' answers, for random pools."""
    import random

    from gpuflex.hub.policy.reputation import ReplicaPool, replica_candidates
    from gpuflex.protocol.jobspec import VerificationSpec

    rng = random.Random(7)
    for trial in range(400):
        spec = VerificationSpec(trust_after=rng.choice([0, 2, 5, 10]))
        reps = {f"n{i}": Reputation(consecutive_agreements=rng.randrange(0, 12), banned=rng.random() < 0.1)
                for i in range(rng.randrange(0, 25))}
        names = [*reps, "absent"]
        exclude = set(rng.sample(names, min(len(names), rng.randrange(0, 4))))
        pool = ReplicaPool(reps, spec)
        want = set(replica_candidates(reps, exclude, spec))
        assert pool.anyone(exclude) == bool(want), trial
        for n in names:
            assert pool.eligible(n, exclude) == (n in want), (trial, n)


def test_ruled_out_never_hides_a_node_that_some_shard_would_take():
    """ReplicaPool.ruled_out is a pre-filter: a node it rules out is eligible for no shard of
    at most `most` holders, and it does rule nodes out (the scan it saves is real)."""
    import itertools
    import random

    from gpuflex.hub.policy.reputation import ReplicaPool
    from gpuflex.protocol.jobspec import VerificationSpec

    rng = random.Random(11)
    ruled = 0
    for trial in range(300):
        spec = VerificationSpec(trust_after=rng.choice([0, 2, 5, 10]))
        reps = {f"n{i}": Reputation(consecutive_agreements=rng.randrange(0, 12), banned=rng.random() < 0.1)
                for i in range(rng.randrange(1, 9))}
        pool = ReplicaPool(reps, spec)
        names = [*reps, "absent"]
        most = rng.randrange(0, 4)
        for n in names:
            if not pool.ruled_out(n, most):
                continue
            ruled += 1
            others = [x for x in names if x != n]
            for size in range(most + 1):
                for exclude in itertools.combinations(others, size):
                    assert not pool.eligible(n, set(exclude)), (trial, n, exclude)
    assert ruled > 100


async def test_the_node_whose_upload_closes_a_round_keeps_its_share_of_the_next(tmp_path):
    """On a real line a node asks for work again a round trip after its upload is acknowledged.
    When that upload closes the round, the node already waiting in a long-poll is woken at once:
    it must carve only its share of the new round, leaving the other half for the node on its
    way back (Scheduler.delivered). Measured before the fix over a 30 ms home line
    (bench/bandwidth.py): one shard of the whole dataset a round, the two nodes taking turns."""
    import asyncio

    import aiohttp
    from gpuflex.protocol.messages import Assignment

    from tests.helpers import SimNode, start_hub, submit_job, wait_job, write_digits

    train, val, spec = write_digits(tmp_path / "d", rounds=2)
    hub = await start_hub(tmp_path / "hub", long_poll_max_s=10.0)
    try:
        async with aiohttp.ClientSession() as s:
            a_node, b_node = SimNode(s, hub.url, samples_per_s=500.0), SimNode(s, hub.url, samples_per_s=500.0)
            for n in (a_node, b_node):
                await n.register()
            polls = [asyncio.create_task(n.work(wait_s=8.0)) for n in (a_node, b_node)]
            await asyncio.sleep(0.3)
            r = await submit_job(s, hub, spec, train, val)
            assert r.status == 201, await r.text()
            job = await r.json()
            first_a, first_b = await asyncio.gather(*polls)
            assert isinstance(first_a, Assignment) and isinstance(first_b, Assignment)
            trained_a, trained_b = await a_node.train(first_a), await b_node.train(first_b)
            await asyncio.sleep(0.5)  # both train about as long (the hub measures their speed so)
            await a_node.upload(first_a, *trained_a)
            waiting = asyncio.create_task(a_node.work(wait_s=8.0))  # a waits for round 1
            await asyncio.sleep(0.05)
            await b_node.upload(first_b, *trained_b)  # closes round 0; a is woken at once
            second_a = await waiting
            await asyncio.sleep(0.2)  # b's next request, a round trip later
            second_b = await b_node.work(wait_s=8.0)
            assert isinstance(second_a, Assignment) and second_a.round == 1
            assert isinstance(second_b, Assignment) and second_b.round == 1, second_b
            sizes = [sum(c.samples for c in x.chunks) for x in (second_a, second_b)]
            assert sum(len(x.chunks) for x in (second_a, second_b)) == job["chunks"]
            assert min(sizes) >= 0.35 * sum(sizes), f"unbalanced: {sizes}"
            for n, x in ((a_node, second_a), (b_node, second_b)):
                blob, samples, loss = await n.train(x)
                await n.upload(x, blob, samples, loss)
            doc = await wait_job(s, hub, job["id"])
        assert [h["parallel"]["shards"] for h in sorted(doc["history"], key=lambda h: h["round"])] == [2, 2]
    finally:
        await hub.stop()
