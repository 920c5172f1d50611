"""Pure pieces of the hub: shard carving, dataset chunking, the OpenAPI document, metrics, the DB writer."""

from __future__ import annotations

import asyncio
import concurrent.futures
import sqlite3
import threading
import time

import numpy as np
import pytest
from aiohttp import web
from gpuflex.hub.base.config import HubConfig
from gpuflex.hub.base.errors import Unprocessable
from gpuflex.hub.domain.scheduler import Scheduler
from gpuflex.hub.model.job import ChunkInfo, JobState, shard_seed
from gpuflex.hub.model.node import NodeState
from gpuflex.hub.policy.dataset import Arrays, make_chunks, split_validation, validate_arrays
from gpuflex.hub.server.app import create_app
from gpuflex.hub.server.openapi import openapi_document
from gpuflex.hub.storage.db import Database
from gpuflex.protocol.jobspec import parse_job_spec
from gpuflex.protocol.tensors import decode_state

from tests.helpers import digits_spec


def make_job(chunks: int = 20, chunk_samples: int = 10, target_s: float = 10.0) -> JobState:
    spec = parse_job_spec(digits_spec(round_target_s=target_s, replication="0.0"))
    job = JobState(id="j-1", owner="o", name="n", spec=spec, state="running", round=0, rounds=2,
                   model_hash="0" * 64, model_size=1, chunks=[ChunkInfo(i, f"{i:064x}", chunk_samples, 100)
                                                            for i in range(chunks)],
                   val_sha=None, opt_state_sha=None, created_at=0.0)
    job.open_round()
    return job


def node(name: str, sps: float) -> NodeState:
    return NodeState(id=name, public_key=b"", bench_sps=sps, ema_sps=sps, last_seen=time.time())


def test_shards_are_sized_to_throughput_and_prefer_cached_chunks():
    sched = Scheduler(min_deadline_s=30.0, online_window_s=90.0)
    job = make_job()
    sched.add_job(job)
    slow, fast = node("slow", 2.0), node("fast", 10.0)  # 20 and 100 samples in 10 s
    sched.nodes = {"slow": slow, "fast": fast}
    p_fast = sched.plan(fast, frozenset())
    assert p_fast is not None and p_fast.shard.samples == 100 and p_fast.shard.chunk_idxs == tuple(range(10))
    cached = frozenset({f"{17:064x}", f"{19:064x}"})
    p_slow = sched.plan(slow, cached)
    assert p_slow.shard.chunk_idxs == (17, 19)  # what it holds, before anything else
    assert p_slow.deadline - time.time() == pytest.approx(30.0, abs=1.0)  # min deadline wins
    assert job.free == {10, 11, 12, 13, 14, 15, 16, 18}
    assert p_fast.shard.seed == shard_seed(0, 0, 0) and p_slow.shard.seed == shard_seed(0, 0, 1)


def test_one_node_with_a_huge_round_target_takes_the_whole_round():
    sched = Scheduler(min_deadline_s=1.0, online_window_s=90.0)
    job = make_job(target_s=86400.0)
    sched.add_job(job)
    n = node("n", 1.0)
    sched.nodes = {"n": n}
    p = sched.plan(n, frozenset())
    assert p.shard.chunk_idxs == tuple(range(20)) and not job.free
    assert sched.plan(node("m", 1.0), frozenset()) is None  # nothing left; no replica wanted


def test_fair_share_between_jobs():
    sched = Scheduler(min_deadline_s=1.0, online_window_s=90.0)
    a, b = make_job(), make_job()
    b.id, b.created_at = "j-2", 1.0
    sched.add_job(a)
    sched.add_job(b)
    picks = []
    for i in range(4):
        p = sched.plan(node(f"n{i}", 1.0), frozenset())
        from gpuflex.hub.model.job import AssignmentState

        sched.attach(AssignmentState(id=f"a{i}", shard_id=p.shard.id, job_id=p.job.id, round=0, node_id=f"n{i}",
                                     issued_at=0, expected_s=1, deadline=1e12, sealed=b"", model_hash="",
                                     chunk_shas=frozenset()), p.shard)
        picks.append(p.job.id)
    assert picks == ["j-1", "j-2", "j-1", "j-2"]


def test_stratified_chunks_spread_every_class():
    y = np.repeat(np.arange(10), 50)
    x = np.random.default_rng(0).random((500, 64), dtype=np.float32)
    spec = parse_job_spec(digits_spec()).model
    data = validate_arrays(x, y, spec, what="train")
    chunks = make_chunks(data, 50, stratified=True, seed=0)
    assert len(chunks) == 10
    for blob, n in chunks:
        labels = decode_state(bytearray(blob))["y"].numpy()
        assert n == 50 and sorted(np.bincount(labels, minlength=10)) == [5] * 10
    again = make_chunks(data, 50, stratified=True, seed=0)
    assert [c[0] for c in again] == [c[0] for c in chunks]  # deterministic
    train, val = split_validation(data, 0.2, stratified=True, seed=0)
    assert len(val) == 100 and len(train) == 400 and sorted(np.bincount(val.y)) == [10] * 10
    with pytest.raises(Unprocessable):
        validate_arrays(x.astype(object), y, spec, what="train")
    assert isinstance(data, Arrays)


def test_openapi_lists_every_route(tmp_path):
    app = create_app(HubConfig(data_dir=tmp_path / "h"))
    doc = openapi_document()
    served = set()
    for route in app.router.routes():
        path = route.resource.canonical if route.resource else ""
        if route.method == "HEAD" or not (path.startswith("/v1") or path in ("/healthz", "/metrics")):
            continue
        served.add((path, route.method.lower()))
    documented = {(p, m) for p, ops in doc["paths"].items() for m in ops}
    assert served == documented
    assert doc["openapi"].startswith("3.")
    asyncio.run(_close(app))


async def _close(app: web.Application) -> None:
    runner = web.AppRunner(app)
    await runner.setup()
    await runner.cleanup()


async def test_db_group_commit_isolates_a_failing_write(tmp_path):
    db = Database(tmp_path / "db.sqlite3")
    try:
        def good(i):
            return lambda c: c.execute("INSERT INTO tokens (hash, role, name, created_at) VALUES (?, 'owner', 'x', 0)",
                                       (f"h{i}",))

        def bad(c):
            c.execute("INSERT INTO tokens (hash, role, name, created_at) VALUES ('h0', 'owner', 'x', 0)")

        results = await asyncio.gather(*(db.write(good(i)) for i in range(20)), db.write(bad),
                                       return_exceptions=True)
        assert sum(isinstance(r, sqlite3.IntegrityError) for r in results) == 1
        assert await db.read(lambda c: c.execute("SELECT COUNT(*) FROM tokens").fetchone()[0]) == 20
        mode = await db.read(lambda c: c.execute("PRAGMA journal_mode").fetchone()[0])
        assert mode == "wal"
    finally:
        db.close()


async def test_db_batch_settles_every_waiter_and_a_cancelled_ones_write_still_commits(tmp_path):
    """A batch's results reach the event loop in one call (hub/storage/db.py settle_batch): every waiter
    gets its own value, a waiter that gave up does not stop the others, and its write committed."""
    db = Database(tmp_path / "db.sqlite3")
    gate = threading.Event()
    try:
        def insert(i):
            def fn(c):
                if i == 0:
                    gate.wait(10)  # holds the store's thread until the rest are queued
                c.execute("INSERT INTO tokens (hash, role, name, created_at) VALUES (?, 'owner', 'x', 0)", (f"h{i}",))
                return i
            return fn

        first = asyncio.ensure_future(db.write(insert(0)))
        await asyncio.sleep(0.05)
        waiters = [asyncio.ensure_future(db.write(insert(i))) for i in range(1, 40)]
        await asyncio.sleep(0.05)
        waiters[5].cancel()  # its caller went away while the write was queued
        from_thread = await asyncio.to_thread(lambda: (gate.set(), db.write_sync(insert(99)))[1])
        results = await asyncio.gather(first, *waiters, return_exceptions=True)
        assert from_thread == 99
        assert isinstance(results[6], asyncio.CancelledError)
        assert [r for i, r in enumerate(results) if i != 6] == [i for i in range(40) if i != 6]
        count = await db.read(lambda c: c.execute("SELECT COUNT(*) FROM tokens").fetchone()[0])
        assert count == 41  # the cancelled caller's write committed with its batch
    finally:
        gate.set()
        db.close()


async def test_db_failed_transaction_fails_every_waiter_of_its_batch(tmp_path):
    db = Database(tmp_path / "db.sqlite3")
    try:
        def breaks_the_transaction(c):
            c.execute("COMMIT")  # ends the batch's transaction under it: the batch's COMMIT fails

        results = await asyncio.gather(db.write(breaks_the_transaction),
                                       db.write(lambda c: c.execute("SELECT 1").fetchone()[0]),
                                       return_exceptions=True)
        assert all(isinstance(r, BaseException) for r in results), results
        assert await db.read(lambda c: c.execute("SELECT 2").fetchone()[0]) == 2  # and the store goes on
    finally:
        db.close()


def test_db_hands_no_cursor_to_its_callers(tmp_path):
    """A write that returns its cursor (`lambda c: c.execute(...)`, as many of the store's do) hands
    its caller None: the cursor, dropped on the caller's thread, reset its statement there while the
    store's thread ran the same cached statement for the next write of its batch (SQLite's "bad
    parameter or other API misuse", seen once blobs were packed from 16 threads at once)."""
    db = Database(tmp_path / "db.sqlite3")
    try:
        def insert(i):
            rows = [(f"h{i}-{j}",) for j in range(3)]
            return lambda c: c.executemany(
                "INSERT INTO tokens (hash, role, name, created_at) VALUES (?, 'owner', 'x', 0)", rows)

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda i: db.write_sync(insert(i)), range(400)))
        assert results == [None] * 400
        assert db.write_sync(lambda c: c.execute("SELECT COUNT(*) FROM tokens").fetchone()[0]) == 1200
    finally:
        db.close()


def test_settle_heap_freezes_start_up_and_collects_young_objects_less_often():
    import gc

    from gpuflex.hub.server.heap import GEN0, GEN1, GEN2, settle_heap

    before = gc.get_threshold()
    try:
        settle_heap()
        assert gc.get_freeze_count() > 1000  # this process's imports: torch, aiohttp, numpy
        assert gc.get_threshold() == (GEN0, GEN1, GEN2)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_an_unproven_nodes_cap_doubles_per_delivery_and_is_twice_its_largest_delivered_shard():
    from gpuflex.hub.domain.sizing import MAX_CHUNKS_PER_ASSIGNMENT

    sched = Scheduler(min_deadline_s=1.0, online_window_s=90.0, unproven_max_chunks=4)
    n = node("n-1", 100.0)
    assert sched.sizing.chunk_cap(n) == 4  # nothing delivered: the ramp's first step
    n.updates_accepted, n.proven_chunks = 1, 4
    assert sched.sizing.chunk_cap(n) == 8  # a lone node that took 4 chunks: doubled, as before
    n.proven_chunks = 12  # it took its equal part (12 chunks) of a round among several
    assert sched.sizing.chunk_cap(n) == 24
    n.updates_accepted = 16
    assert sched.sizing.chunk_cap(n) == MAX_CHUNKS_PER_ASSIGNMENT  # proven
