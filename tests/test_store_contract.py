"""The `Store` contract: one suite, parametrised over every implementation, so that a second
store (PostgreSQL) cannot drift from the first. Each test writes through the store and reads
back what a restarted hub would load."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from gpuflex.hub.domain.jobs import ingest_job
from gpuflex.hub.model.job import AssignmentState, JobState, UpdateState
from gpuflex.hub.policy import rollback
from gpuflex.hub.policy.reputation import Reputation
from gpuflex.hub.policy.update_record import Flag
from gpuflex.hub.storage.blobs import BlobStore
from gpuflex.hub.storage.db import SCHEMA_VERSION, Database
from gpuflex.hub.storage.store import NodeProfile, RoundResult, Store
from gpuflex.hub.storage.store_sqlite import DuplicateUpdate, SqliteStore, _node
from gpuflex.protocol.compute import class_key
from gpuflex.protocol.messages import UNKNOWN_CLASS, ComputeClass, nested_to_dict

from tests.helpers import write_digits

IMPLEMENTATIONS = ["sqlite", "postgres"]
PROFILE = NodeProfile(software_version="0.1.0", device={"kind": "cpu"}, benchmark={"samples_per_s": 10.0})


def _open(kind: str, where: Path) -> Store:
    """`where` is the test's folder; a PostgreSQL store's database URL is in where/store-url."""
    if kind == "sqlite":
        return SqliteStore(Database(where / "hub.sqlite3"))
    if kind == "postgres":
        from gpuflex.hub.storage.store_postgres import PgDatabase, PostgresStore

        return PostgresStore(PgDatabase((where / "store-url").read_text()))
    raise AssertionError(kind)


@pytest_asyncio.fixture(params=IMPLEMENTATIONS)
async def opened(request, tmp_path) -> AsyncIterator[tuple[str, Path, Store]]:
    if request.param == "postgres":  # a fresh database on the session's server (tests/conftest.py)
        (tmp_path / "store-url").write_text(request.getfixturevalue("postgres_url"))
    store = _open(request.param, tmp_path)
    try:
        yield request.param, tmp_path, store
    finally:
        store.close()


async def _reopen(kind: str, where: Path, store: Store) -> Store:
    """What a restarted hub sees: a fresh store on the same data."""
    store.close()
    return _open(kind, where)


async def _job(where: Path, store: Store, replication: str = "0.0") -> JobState:
    train, val, spec = write_digits(where / "digits", rounds=2, replication=replication)
    blobs = BlobStore(where / "blobs")
    return await asyncio.to_thread(ingest_job, store, blobs, owner="alice", spec_text=spec.read_bytes(),
                                   train_path=train, val_path=val)


def _assignment(job: JobState, node_id: str, aid: str = "a-1") -> AssignmentState:
    shard = job.shards[next(iter(job.shards))] if job.shards else None
    assert shard is not None
    now = time.time()
    return AssignmentState(id=aid, shard_id=shard.id, job_id=job.id, round=job.round, node_id=node_id,
                           issued_at=now, expected_s=1.0, deadline=now + 60, sealed=b"sealed",
                           model_hash=job.model_hash, chunk_shas=frozenset())


def _carve(job: JobState, wanted: int = 1):
    from gpuflex.hub.model.job import ShardState

    shard = ShardState(id=f"{job.id}-r0-s0", job_id=job.id, round=0, seq=0, seed=7, chunk_idxs=(0, 1),
                       samples=job.chunks[0].samples + job.chunks[1].samples,
                       replica_group="" if wanted == 1 else f"{job.id}-r0-s0", wanted=wanted)
    job.shards[shard.id] = shard
    job.take(shard.chunk_idxs)
    return shard


async def test_a_node_and_its_reputation_survive_a_restart(opened) -> None:
    kind, where, store = opened
    await store.save_node("gf1-n1", b"k" * 32, PROFILE, bench_sps=12.5, now=100.0)
    rep = Reputation(consecutive_agreements=3, agreements_total=7, flags_total=1, confirmed_flags=1,
                     dismissed_flags=0, banned=False)
    await store.save_reputations([("gf1-n1", rep)])
    await store.save_node("gf1-n1", b"k" * 32, PROFILE, bench_sps=20.0, now=200.0)  # re-registration
    store = await _reopen(kind, where, store)
    try:
        (node,) = (await store.load()).nodes
        assert node.id == "gf1-n1" and node.public_key == b"k" * 32
        assert node.reputation == rep, "re-registering must keep the track record"
        assert node.bench_sps == 20.0 and node.last_seen == 200.0
    finally:
        store.close()


async def test_a_nodes_address_block_operator_and_ban_survive_a_restart(opened) -> None:
    """The Sybil defences' inputs (hub/policy/admission.py): where a node last registered from (a node
    registering again from elsewhere is recorded there), its operator (kept once set) and when
    it was banned."""
    kind, where, store = opened
    await store.save_node("gf1-n1", b"k" * 32, PROFILE, bench_sps=1.0, now=100.0,
                          address_block="203.0.113.0/24", operator="op-7")
    await store.save_node("gf1-n1", b"k" * 32, PROFILE, bench_sps=1.0, now=200.0,
                          address_block="198.51.100.0/24", operator=None)  # re-registers elsewhere
    await store.save_node("gf1-n2", b"j" * 32, PROFILE, bench_sps=1.0, now=300.0, address_block="192.0.2.0/24")
    before = time.time()
    await store.save_reputations([("gf1-n2", Reputation(confirmed_flags=3, banned=True))])
    store = await _reopen(kind, where, store)
    try:
        nodes = {n.id: n for n in (await store.load()).nodes}
        n1, n2 = nodes["gf1-n1"], nodes["gf1-n2"]
        assert (n1.block, n1.last_block, n1.operator, n1.registered_at) == (
            "198.51.100.0/24", "198.51.100.0/24", "op-7", 100.0)
        assert n1.banned_at is None and n2.banned and n2.operator is None
        assert n2.banned_at is not None and before - 5 <= n2.banned_at <= time.time() + 5
    finally:
        store.close()


async def test_a_job_its_live_assignment_and_an_update_survive_a_restart(opened) -> None:
    kind, where, store = opened
    job = await _job(where, store)
    shard = _carve(job)
    a = _assignment(job, "gf1-n1")
    await store.issue_assignment(a, shard, [job.chunks[0], job.chunks[1]])
    loaded = (await store.load()).jobs
    (again,) = loaded
    assert again.id == job.id and again.model_hash == job.model_hash
    assert list(again.shards) == [shard.id] and list(again.shards[shard.id].live) == ["a-1"]
    assert 0 not in again.free and 1 not in again.free
    upd = UpdateState(id="u-1", assignment_id="a-1", shard_id=shard.id, node_id="gf1-n1", sha="ab" * 32,
                      size=10, sample_count=shard.samples, loss=0.5, train_s=0.1, received_at=time.time())
    await store.save_node("gf1-n1", b"k" * 32, PROFILE, bench_sps=1.0, now=1.0)
    from gpuflex.hub.model.node import NodeState

    node = NodeState(id="gf1-n1", public_key=b"k" * 32, bench_sps=1.0, ema_sps=3.0, last_seen=1.0,
                     updates_accepted=1)
    await store.accept_update(upd, job_id=job.id, round=0, metrics={"loss": 0.5}, timings={"train_s": 0.1},
                              node=node, first_update=True, settles=True)
    with pytest.raises(DuplicateUpdate):
        await store.accept_update(upd, job_id=job.id, round=0, metrics={"loss": 0.5},
                                  timings={"train_s": 0.1}, node=node, first_update=False, settles=False)
    fate = await store.assignment_fate("a-1")
    assert fate is not None and fate.state == "done" and fate.update_id == "u-1"
    store = await _reopen(kind, where, store)
    try:
        loaded = await store.load()
        (again,) = loaded.jobs
        s = again.shards[shard.id]
        assert s.state == "settled" and s.representative == "u-1" and not s.live
        assert [n.ema_sps for n in loaded.nodes] == [3.0] and loaded.nodes[0].updates_accepted == 1
    finally:
        store.close()


async def test_ended_assignments_stay_ended(opened) -> None:
    _kind, where, store = opened
    job = await _job(where, store)
    shard = _carve(job)
    await store.issue_assignment(_assignment(job, "gf1-n1"), shard, [job.chunks[0], job.chunks[1]])
    await store.end_assignments(["a-1"], "expired")
    await store.end_assignments(["a-1"], "abandoned")  # only a live one changes
    fate = await store.assignment_fate("a-1")
    assert fate is not None and fate.state == "expired" and fate.update_id is None
    assert await store.assignment_fate("a-unknown") is None
    with pytest.raises(ValueError):
        await store.end_assignments(["a-1"], "done")


async def test_settling_records_flags_and_a_verdict_is_given_once(opened) -> None:
    _kind, where, store = opened
    job = await _job(where, store)
    shard = _carve(job, wanted=2)
    await store.issue_assignment(_assignment(job, "gf1-n1"), shard, [job.chunks[0], job.chunks[1]])
    await store.want_replicas(shard.id, 3, {"why": "split"})
    flags = [Flag("u-1", "gf1-n1", "replica_mismatch", {"distance": 0.3}),
             Flag("u-2", "gf1-n1", "outlier", {"cosine": -0.9})]
    shard.state = "settled"
    await store.settle_shard(shard, state="settled", evidence={"pairs": []}, statuses={}, cancelled=["a-1"],
                             flags=flags, round=0, reputations=[("gf1-n1", Reputation(flags_total=2))], now=5.0)
    fate = await store.assignment_fate("a-1")
    assert fate is not None and fate.state == "cancelled"
    ids = await store.query(lambda c: [r[0] for r in c.execute("SELECT id FROM flags ORDER BY update_id")])
    assert len(ids) == 2
    first = await store.flag(ids[0])
    assert first is not None and first.status == "open" and first.evidence == {"distance": 0.3}
    banned = Reputation(confirmed_flags=3, banned=True)
    decided = await store.decide_flag(ids[0], status="confirmed", note="n", auditor="audrey", now=6.0,
                                      reputation=("gf1-n1", banned), moot_note="moot: banned")
    assert decided is not None and decided.status == "confirmed" and decided.auditor == "audrey"
    other = await store.flag(ids[1])
    assert other is not None and other.status == "moot" and other.verdict_note == "moot: banned"
    again = await store.decide_flag(ids[0], status="dismissed", note="", auditor="x", now=7.0,
                                    reputation=None, moot_note=None)
    assert again is None, "a decided flag cannot be decided again"
    assert await store.flag("f-unknown") is None


async def test_a_proven_mismatch_suspends_its_node_with_the_flag_until_a_verdict(opened) -> None:
    """The flag that suspends (hub/policy/suspension.py) is written by the settling's one write; a
    restarted hub loads the node suspended; a verdict on the flag lifts it."""
    kind, where, store = opened
    await store.save_node("gf1-n1", b"k" * 32, PROFILE, bench_sps=1.0, now=1.0)
    await store.save_node("gf1-n2", b"j" * 32, PROFILE, bench_sps=1.0, now=1.0)
    job = await _job(where, store)
    shard = _carve(job, wanted=2)
    flags = [Flag("u-1", "gf1-n1", "referee_mismatch", {"referee": {}}),
             Flag("u-2", "gf1-n2", "referee_mismatch", {"vouched_for": "u-1"})]  # no proof of its own
    await store.settle_shard(shard, state="dropped", evidence={}, statuses={}, cancelled=[], flags=flags, round=0,
                             reputations=[], now=5.0)
    store = await _reopen(kind, where, store)
    try:
        nodes = {n.id: n for n in (await store.load()).nodes}
        assert nodes["gf1-n1"].suspended is not None and "u-1" in nodes["gf1-n1"].suspended
        assert nodes["gf1-n2"].suspended is None and await store.suspension("gf1-n2") is None
        (fid,) = await store.query(lambda c: [r[0] for r in c.execute("SELECT id FROM flags WHERE update_id = 'u-1'")])
        flag = await store.flag(fid)
        assert flag is not None and flag.suspends
        await store.decide_flag(fid, status="dismissed", note="", auditor="audrey", now=6.0, reputation=None,
                                moot_note=None)
        assert await store.suspension("gf1-n1") is None
    finally:
        store.close()


async def test_closing_the_last_round_finishes_the_job(opened) -> None:
    kind, where, store = opened
    job = await _job(where, store)
    result = RoundResult(model_hash="cd" * 32, opt_state_sha=None, statuses={}, flags=[], evidence={},
                         metrics={"loss": 0.25, "accuracy": 0.9}, train_loss=0.3, flagged_nodes=[])
    await store.close_round(job, result, flags=[], withdrawn=[], cancelled=[], reputations=[], last=False,
                            now=10.0)
    job.round = 1
    await store.close_round(job, result, flags=[], withdrawn=[], cancelled=[], reputations=[], last=True,
                            now=11.0)
    assert await store.job_state(job.id) == "done"
    store = await _reopen(kind, where, store)
    try:
        assert (await store.load()).jobs == [], "a finished job is not resumed"
        rows = await store.query(lambda c: c.execute(
            "SELECT round, accuracy FROM rounds WHERE job_id = ? ORDER BY round", (job.id,)).fetchall())
        assert [tuple(r) for r in rows] == [(0, 0.9), (1, 0.9)]
    finally:
        store.close()


async def test_ending_a_job_cancels_its_live_assignments(opened) -> None:
    _kind, where, store = opened
    job = await _job(where, store)
    shard = _carve(job)
    await store.issue_assignment(_assignment(job, "gf1-n1"), shard, [job.chunks[0], job.chunks[1]])
    await store.fail_job(job.id, "round 0 failed: boom", ["a-1"])
    assert await store.job_state(job.id) == "failed"
    fate = await store.assignment_fate("a-1")
    assert fate is not None and fate.state == "cancelled"


async def test_a_commitment_and_the_referees_requests_survive_a_restart(opened) -> None:
    from gpuflex.hub.model.job import StateRequestState
    from gpuflex.hub.model.node import NodeState
    from gpuflex.protocol.messages import Commitment

    kind, where, store = opened
    job = await _job(where, store, replication="1.0")
    shard = _carve(job)
    shard.wanted = 2
    a = _assignment(job, "gf1-n1")
    await store.issue_assignment(a, shard, [job.chunks[0], job.chunks[1]])
    c = Commitment(every=2, steps=4, precision="bf16", hashes=("a" * 64, "b" * 64, "c" * 64), norms=(0.5, 0.25))
    upd = UpdateState(id="u-1", assignment_id="a-1", shard_id=shard.id, node_id="gf1-n1", sha="ab" * 32,
                      size=10, sample_count=shard.samples, loss=0.5, train_s=0.1, received_at=time.time(),
                      commitment=c)
    await store.save_node("gf1-n1", b"k" * 32, PROFILE, bench_sps=1.0, now=1.0)
    node = NodeState(id="gf1-n1", public_key=b"k" * 32, bench_sps=1.0, ema_sps=3.0, last_seen=1.0)
    await store.accept_update(upd, job_id=job.id, round=0, metrics={"loss": 0.5}, timings={"train_s": 0.1},
                              node=node, first_update=True, settles=False)
    req = StateRequestState(id="sr-1", job_id=job.id, round=0, shard_id=shard.id, update_id="u-1", node_id="gf1-n1",
                            assignment_id="a-1", reason="spot_check", segment=1, steps=(2, 4), requested_at=1.0,
                            deadline=61.0)
    declined = StateRequestState(id="sr-2", job_id=job.id, round=0, shard_id=shard.id, update_id="u-1",
                                 node_id="gf1-n1", assignment_id="a-1", reason="spot_check", segment=0, steps=(0, 2),
                                 requested_at=2.0, deadline=62.0)
    await store.open_state_requests([req, declined])
    await store.record_state("sr-1", 2, "b" * 64)
    await store.close_state_requests([("sr-1", "mismatch", {"distance": 2.5, "threshold": 0.05})])
    await store.decline_states("sr-2", [0])
    store = await _reopen(kind, where, store)
    try:
        (again,) = (await store.load()).jobs
        (u,) = again.shards[shard.id].accepted
        assert u.commitment == c
        (back, status, evidence), (open_one, open_status, _) = await store.referee_requests()  # shard still open
        assert (back.id, back.update_id, back.steps, back.states, back.declined, status) == (
            "sr-1", "u-1", (2, 4), {2: "b" * 64}, set(), "mismatch")
        # a step the node said it no longer holds comes back as declined: the request is decided
        assert (open_one.id, open_one.states, open_one.declined, open_status) == ("sr-2", {}, {0}, "open")
        assert open_one.complete and not back.complete
        assert evidence == {"distance": 2.5, "threshold": 0.05} and back.segment == 1
        row = await store.query(lambda conn: dict(conn.execute(
            "SELECT * FROM state_requests WHERE id = 'sr-1'").fetchone()))
        assert (row["status"], row["states"], row["steps"]) == ("mismatch", '{"2":"' + "b" * 64 + '"}', "[2,4]")
        assert '"distance":2.5' in row["verdict"]
    finally:
        store.close()


def test_a_version_1_database_is_migrated_keeping_its_data(tmp_path: Path) -> None:
    """Data folders written by the previous release keep their nodes' track records and jobs."""
    path = tmp_path / "hub.sqlite3"
    db = Database(path)
    db.close()
    conn = sqlite3.connect(path)  # turn it back into what the previous release wrote
    conn.execute("ALTER TABLE nodes DROP COLUMN compute_class")  # schema v3
    for table, old, new in (("nodes", "agreed", "agreements_total"), ("nodes", "disagreed", "flags_total"),
                            ("nodes", "consecutive_valid", "consecutive_agreements"),
                            ("nodes", "flags_confirmed", "confirmed_flags"),
                            ("nodes", "flags_dismissed", "dismissed_flags"), ("jobs", "model_sha", "model_hash"),
                            ("rounds", "model_sha", "model_hash"), ("rounds", "new_model_sha", "new_model_hash")):
        conn.execute(f"ALTER TABLE {table} RENAME COLUMN {new} TO {old}")
    for column in SYBIL_COLUMNS:  # added by version 4
        conn.execute(f"ALTER TABLE nodes DROP COLUMN {column}")
    _undo_referee_schema(conn)  # added by version 5
    conn.executescript(
        "INSERT INTO nodes (id, public_key, software_version, device, benchmark, bench_sps, ema_sps, registered_at,"
        " last_seen, agreed, disagreed, consecutive_valid, flags_confirmed, flags_dismissed)"
        " VALUES ('gf1-old', x'00', '0.1', '{}', '{}', 1, 1, 0, 0, 9, 2, 4, 1, 1);"
        "INSERT INTO jobs (id, owner, name, spec_toml, state, round, rounds, model_sha, model_size, train_samples,"
        " val_samples, created_at, updated_at) VALUES ('j-old', 'o', 'n', '', 'done', 1, 1, 'ab', 1, 1, 0, 0, 0);"
        "PRAGMA user_version = 1;")
    conn.close()
    db = Database(path)
    try:
        assert db.write_sync(lambda c: c.execute("PRAGMA user_version").fetchone()[0]) == SCHEMA_VERSION
        row = db.write_sync(lambda c: dict(c.execute("SELECT * FROM nodes").fetchone()))
        job = db.write_sync(lambda c: dict(c.execute("SELECT * FROM jobs").fetchone()))
    finally:
        db.close()
    assert (row["agreements_total"], row["flags_total"], row["consecutive_agreements"], row["confirmed_flags"],
            row["dismissed_flags"]) == (9, 2, 4, 1, 1)
    assert job["model_hash"] == "ab"


def test_a_version_2_database_gains_the_compute_class_column(tmp_path: Path) -> None:
    """Schema v3: nodes from before compute classes keep their rows and read as the unknown class."""
    path = tmp_path / "hub.sqlite3"
    Database(path).close()
    conn = sqlite3.connect(path)
    conn.execute("ALTER TABLE nodes DROP COLUMN compute_class")
    for column in SYBIL_COLUMNS:  # added by version 4
        conn.execute(f"ALTER TABLE nodes DROP COLUMN {column}")
    _undo_referee_schema(conn)  # added by version 5
    conn.executescript(
        "INSERT INTO nodes (id, public_key, software_version, device, benchmark, bench_sps, ema_sps, registered_at,"
        " last_seen, agreements_total) VALUES ('gf1-v2', x'00', '0.1', '{}', '{}', 1, 1, 0, 0, 5);"
        "PRAGMA user_version = 2;")
    conn.close()
    db = Database(path)
    try:
        row = db.write_sync(lambda c: dict(c.execute("SELECT * FROM nodes").fetchone()))
        loaded = db.write_sync(lambda c: [_node(r) for r in c.execute("SELECT * FROM nodes")])
    finally:
        db.close()
    assert row["compute_class"] == "{}" and row["agreements_total"] == 5
    assert loaded[0].compute == UNKNOWN_CLASS and loaded[0].class_key("auto") is None


async def test_a_nodes_compute_class_survives_a_restart(opened) -> None:
    kind, where, store = opened
    cc = ComputeClass("cuda", "NVIDIA H100 80GB HBM3", "9.0", "GenuineIntel", ("avx2",), "2.13.0", "12.8", "91002",
                      True, 16, ("fp32", "tf32", "bf16", "fp16"))
    profile = NodeProfile(software_version="0.1.0", device={"kind": "cuda"},
                          benchmark={"samples_per_s": 10.0, "precision_sps": {"fp32": 10.0, "bf16": 40.0}},
                          compute=nested_to_dict(cc))
    await store.save_node("gf1-n1", b"k" * 32, profile, bench_sps=10.0, now=100.0)
    store = await _reopen(kind, where, store)
    try:
        (node,) = (await store.load()).nodes
    finally:
        store.close()
    assert node.compute == cc
    assert node.precision_sps == {"fp32": 10.0, "bf16": 40.0} and node.precision_factor("bf16") == 4.0
    key = node.class_key("auto")
    assert key == class_key(cc, "bf16") and key.endswith("|bf16")


async def test_a_nodes_memory_offer_survives_a_restart(opened) -> None:
    kind, where, store = opened
    offered = NodeProfile(software_version="0.1.0", device={"kind": "cpu", "max_memory_bytes": 3 << 30},
                          benchmark={"samples_per_s": 10.0})
    await store.save_node("gf1-n1", b"k" * 32, offered, bench_sps=10.0, now=100.0)
    await store.save_node("gf1-n2", b"j" * 32, PROFILE, bench_sps=10.0, now=100.0)  # said nothing
    store = await _reopen(kind, where, store)
    try:
        nodes = {n.id: n for n in (await store.load()).nodes}
    finally:
        store.close()
    assert nodes["gf1-n1"].max_memory_bytes == 3 << 30 and nodes["gf1-n2"].max_memory_bytes == 0


SYBIL_COLUMNS = ("address_block", "last_block", "operator", "banned_at")


def test_a_version_3_database_gets_the_sybil_columns_keeping_its_nodes(tmp_path: Path) -> None:
    """3 -> 4 (Sybil defences): nodes gain their address block, operator and ban time; a node of an
    older database has no block (it is in no block's count) and keeps its track record."""
    path = tmp_path / "hub.sqlite3"
    Database(path).close()
    conn = sqlite3.connect(path)
    for column in SYBIL_COLUMNS:
        conn.execute(f"ALTER TABLE nodes DROP COLUMN {column}")
    _undo_referee_schema(conn)  # added by version 5
    conn.executescript(
        "INSERT INTO nodes (id, public_key, software_version, device, benchmark, bench_sps, ema_sps, registered_at,"
        " last_seen, agreements_total, consecutive_agreements, banned)"
        " VALUES ('gf1-old', x'00', '0.1', '{}', '{}', 1, 1, 0, 0, 9, 4, 1);"
        "PRAGMA user_version = 3;")
    conn.close()
    db = Database(path)
    try:
        assert db.write_sync(lambda c: c.execute("PRAGMA user_version").fetchone()[0]) == SCHEMA_VERSION
        row = db.write_sync(lambda c: dict(c.execute("SELECT * FROM nodes").fetchone()))
    finally:
        db.close()
    assert (row["agreements_total"], row["consecutive_agreements"], row["banned"]) == (9, 4, 1)
    assert (row["address_block"], row["last_block"], row["operator"], row["banned_at"]) == ("", "", None, None)


def _undo_rollback_columns(conn: sqlite3.Connection) -> None:
    """Undo schema 10 (kept models' optimizer state, rounds rolled back and restored from)."""
    conn.execute("ALTER TABLE models DROP COLUMN opt_state_sha")
    conn.execute("ALTER TABLE rounds DROP COLUMN rolled_back_at")
    conn.execute("ALTER TABLE rounds DROP COLUMN restored_from")


def _undo_sybil_state(conn: sqlite3.Connection) -> None:
    """Undo schema 9 (a flag's reset run, the operator's cooldown lifts), and 10 after it."""
    _undo_rollback_columns(conn)
    conn.execute("ALTER TABLE flags DROP COLUMN run_before")
    conn.execute("DROP TABLE cooldown_lifts")


def _undo_suspension_column(conn: sqlite3.Connection) -> None:
    """Undo schema 7 (a flag that suspends its node), and 9 and 10 after it."""
    _undo_sybil_state(conn)
    conn.execute("ALTER TABLE flags DROP COLUMN suspends")


def _undo_silo_columns(conn: sqlite3.Connection) -> None:
    """Undo schema 6 (a node-local job's silo columns on chunks), and 7 after it."""
    _undo_suspension_column(conn)
    for column in ("owner_node", "histogram", "registered_at"):
        conn.execute(f"ALTER TABLE chunks DROP COLUMN {column}")


def _undo_referee_schema(conn: sqlite3.Connection) -> None:
    """Undo schema 5 (the referee's commitment column and state_requests table), and 6 after it."""
    _undo_silo_columns(conn)
    conn.execute("DROP INDEX state_requests_open")
    conn.execute("DROP TABLE state_requests")
    conn.execute("ALTER TABLE updates DROP COLUMN commitment")


def test_a_version_4_database_gains_the_referees_tables_keeping_its_data(tmp_path: Path) -> None:
    path = tmp_path / "hub.sqlite3"
    Database(path).close()
    conn = sqlite3.connect(path)
    _undo_referee_schema(conn)
    conn.executescript(
        "INSERT INTO updates (id, assignment_id, shard_id, job_id, round, node_id, sha, size, sample_count, loss,"
        " train_s, metrics, timings, status, received_at) VALUES ('u-old', 'a-old', 's', 'j', 0, 'n', 'ab', 1, 1,"
        " 0.5, 1.0, '{}', '{}', 'included', 0);"
        "PRAGMA user_version = 4;")
    conn.close()
    db = Database(path)
    try:
        assert db.write_sync(lambda c: c.execute("PRAGMA user_version").fetchone()[0]) == SCHEMA_VERSION
        row = db.write_sync(lambda c: dict(c.execute("SELECT * FROM updates").fetchone()))
        n = db.write_sync(lambda c: c.execute("SELECT count(*) FROM state_requests").fetchone()[0])
    finally:
        db.close()
    assert row["id"] == "u-old" and row["commitment"] is None and n == 0


def test_a_version_5_database_gains_the_silo_columns_keeping_its_chunks(tmp_path: Path) -> None:
    path = tmp_path / "hub.sqlite3"
    Database(path).close()
    conn = sqlite3.connect(path)
    _undo_silo_columns(conn)
    conn.executescript("INSERT INTO chunks (job_id, idx, sha, samples, size) VALUES ('j', 0, 'ab', 64, 100);"
                       "PRAGMA user_version = 5;")
    conn.close()
    db = Database(path)
    try:
        assert db.write_sync(lambda c: c.execute("PRAGMA user_version").fetchone()[0]) == SCHEMA_VERSION
        row = db.write_sync(lambda c: dict(c.execute("SELECT * FROM chunks").fetchone()))
    finally:
        db.close()
    assert (row["sha"], row["samples"], row["owner_node"], row["histogram"]) == ("ab", 64, None, None)


def test_a_version_6_database_gains_the_suspension_column_its_flags_suspending_nothing(tmp_path: Path) -> None:
    path = tmp_path / "hub.sqlite3"
    Database(path).close()
    conn = sqlite3.connect(path)
    _undo_suspension_column(conn)
    conn.executescript("INSERT INTO flags (id, job_id, round, update_id, node_id, reason, evidence, created_at)"
                       " VALUES ('f-old', 'j', 0, 'u', 'n', 'referee_mismatch', '{}', 0);"
                       "PRAGMA user_version = 6;")
    conn.close()
    db = Database(path)
    try:
        assert db.write_sync(lambda c: c.execute("PRAGMA user_version").fetchone()[0]) == SCHEMA_VERSION
        row = db.write_sync(lambda c: dict(c.execute("SELECT * FROM flags").fetchone()))
    finally:
        db.close()
    assert (row["id"], row["status"], row["suspends"]) == ("f-old", "open", 0)


def test_a_version_7_database_gains_the_flags_reset_run_and_the_cooldown_lifts(tmp_path: Path) -> None:
    path = tmp_path / "hub.sqlite3"
    Database(path).close()
    conn = sqlite3.connect(path)
    _undo_sybil_state(conn)
    conn.executescript("INSERT INTO flags (id, job_id, round, update_id, node_id, reason, evidence, created_at)"
                       " VALUES ('f-old', 'j', 0, 'u', 'n', 'replica_mismatch', '{}', 0);"
                       "PRAGMA user_version = 7;")
    conn.close()
    db = Database(path)
    try:
        assert db.write_sync(lambda c: c.execute("PRAGMA user_version").fetchone()[0]) == SCHEMA_VERSION
        row = db.write_sync(lambda c: dict(c.execute("SELECT * FROM flags").fetchone()))
        lifts = db.write_sync(lambda c: c.execute("SELECT COUNT(*) FROM cooldown_lifts").fetchone()[0])
    finally:
        db.close()
    assert (row["id"], row["run_before"], lifts) == ("f-old", None, 0)  # a run it never kept gives back nothing


async def test_a_nodes_last_seen_block_survives_a_restart(opened) -> None:
    """Where a known node was last seen (it moved after registering): replicas keep apart from it
    and a ban cools it down, after a restart too (hub/policy/admission.py)."""
    kind, where, store = opened
    await store.save_node("gf1-n1", b"k" * 32, PROFILE, bench_sps=1.0, now=100.0, address_block="203.0.113.0/24")
    await store.note_block("gf1-n1", "198.51.100.0/24")
    store = await _reopen(kind, where, store)
    try:
        (node,) = (await store.load()).nodes
        assert (node.block, node.last_block) == ("203.0.113.0/24", "198.51.100.0/24")
        assert node.blocks == {"203.0.113.0/24", "198.51.100.0/24"}
    finally:
        store.close()


async def test_a_flag_keeps_the_run_it_reset_for_a_withdrawal_after_a_restart(opened) -> None:
    """The settling's one write stores each flag with its node's run of agreements before the
    flag reset it; a round that withdraws the flag gives that run back, whatever restarted between."""
    kind, where, store = opened
    await store.save_node("gf1-n1", b"k" * 32, PROFILE, bench_sps=1.0, now=1.0)
    await store.save_reputations([("gf1-n1", Reputation(consecutive_agreements=4, agreements_total=4))])
    job = await _job(where, store)
    shard = _carve(job, wanted=2)
    reset = Reputation(consecutive_agreements=0, agreements_total=4, flags_total=1)
    await store.settle_shard(shard, state="settled", evidence={}, statuses={}, cancelled=[],
                             flags=[Flag("u-1", "gf1-n1", "replica_mismatch", {}),
                                    Flag("u-2", "gf1-n1", "outlier", {})],
                             round=0, reputations=[("gf1-n1", reset)], now=5.0)
    store = await _reopen(kind, where, store)
    try:
        (node,) = (await store.load()).nodes
        assert node.reputation.consecutive_agreements == 0
        runs = await store.runs_before_flags(["u-1", "u-2", "u-unknown"])
        assert runs == {"u-1": ("gf1-n1", 4)}
        # the round engine's side (hub/domain/reputations.py): the restarted hub gives the run back
        from gpuflex.hub.domain.reputations import Reputations
        from gpuflex.hub.domain.scheduler import Scheduler

        scheduler = Scheduler(min_deadline_s=30.0, online_window_s=60.0)
        scheduler.nodes[node.id] = node
        touched = Reputations(scheduler).withdraw([], runs)
        assert [(n, r.consecutive_agreements, r.flags_total) for n, r in touched] == [("gf1-n1", 4, 1)]
    finally:
        store.close()


async def test_a_cooldown_lift_survives_a_restart_and_a_second_lift_replaces_it(opened) -> None:
    from gpuflex.hub.storage.store import CooldownLift

    kind, where, store = opened
    await store.lift_cooldown(CooldownLift("203.0.113.7", 10.0, "root", "a university NAT"))
    await store.lift_cooldown(CooldownLift("198.51.100.0/24", 11.0, "root"))
    await store.lift_cooldown(CooldownLift("203.0.113.7", 12.0, "ops", "again"))
    store = await _reopen(kind, where, store)
    try:
        assert (await store.load()).lifts == [CooldownLift("198.51.100.0/24", 11.0, "root", ""),
                                             CooldownLift("203.0.113.7", 12.0, "ops", "again")]
    finally:
        store.close()


async def test_a_silo_survives_a_restart_and_replacing_it_keeps_its_index(opened) -> None:
    from gpuflex.hub.model.job import ChunkInfo

    kind, where, store = opened
    spec = (where / "silo.toml")
    spec.write_text('[job]\nname = "s"\n[model]\nkind = "mlp"\ninput = 4\nhidden = [4]\noutputs = 2\n'
                    '[data]\nsource = "node-local"\nlabel_histogram = true\n')
    job = await asyncio.to_thread(ingest_job, store, BlobStore(where / "blobs"), owner="alice",
                                  spec_text=spec.read_bytes(), train_path=None, val_path=None)
    assert job.chunks == []
    await store.save_silo(job.id, ChunkInfo(0, "aa" * 32, 10, 400, "gf1-a"), histogram=(4, 6), now=1.0)
    await store.save_silo(job.id, ChunkInfo(1, "bb" * 32, 20, 700, "gf1-b"), histogram=None, now=2.0)
    await store.save_silo(job.id, ChunkInfo(0, "cc" * 32, 12, 480, "gf1-a"), histogram=None, now=3.0)
    store = await _reopen(kind, where, store)
    try:
        (again,) = (await store.load()).jobs
    finally:
        store.close()
    assert again.chunks == [ChunkInfo(0, "cc" * 32, 12, 480, "gf1-a"), ChunkInfo(1, "bb" * 32, 20, 700, "gf1-b")]
    assert again.silo_of == {"gf1-a": 0, "gf1-b": 1} and again.free == {0, 1} and again.free_total == 32
    # withdrawn (gpuflex-node data remove): the row stays, without an owner, in no round's pool
    store = _open(kind, where)
    try:
        await store.withdraw_silo(job.id, 1, [])
    finally:
        store.close()
    store = _open(kind, where)
    try:
        (again,) = (await store.load()).jobs
    finally:
        store.close()
    assert again.chunks[1] == ChunkInfo(1, "bb" * 32, 20, 700, None)
    assert again.silo_of == {"gf1-a": 0} and again.free == {0} and again.free_total == 12


def _generation(job_id: str, number: int, first_step: int, reason: str):
    from gpuflex.hub.model.pipeline import Generation, StageSlot

    return Generation(job_id=job_id, number=number, first_step=first_step, end_step=20,
                      stages=(StageSlot("gf1-a", 0, 1, 0.25, 100), StageSlot("gf1-b", 1, 2, 0.5, 200)),
                      micro_batches=4, micro_batch_size=8, schedule="1f1b", step_s=1.5,
                      bubble_fraction=0.2, reason=reason, created_at=10.0 + number)


async def test_a_pipelines_generations_unit_states_and_committed_step_survive_a_restart(opened) -> None:
    """A pipelined job's durable state: the last generation planned, each unit's state at or after
    the committed step (a state at an earlier step is history), the committed step itself."""
    from gpuflex.hub.model.pipeline import StepReport, UnitRecord

    kind, where, store = opened
    job = await _job(where, store)
    await store.save_generation(_generation(job.id, 1, 0, "the first plan"), now=11.0)
    for unit, step in ((0, 5), (1, 5), (0, 10)):
        await store.save_unit_state(job.id, UnitRecord(unit, step, f"{unit}{step}" * 16, 100 + unit),
                                    generation=1, node_id="gf1-a", now=12.0,
                                    committed=5 if (unit, step) == (1, 5) else None)
    await store.save_stage_report(job.id, StepReport(1, 1, "gf1-b", 6, 1.7, 1.2, 1.5, 2.25, 13.0))
    await store.save_stage_report(job.id, StepReport(1, 1, "gf1-b", 6, 1.8, 1.3, 1.5, 2.5, 14.0))
    await store.save_generation(_generation(job.id, 2, 5, "node gf1-a was lost"), now=15.0)
    store = await _reopen(kind, where, store)
    try:
        (loaded,) = await store.load_pipelines()
        rows = await store.query(lambda c: [tuple(r) for r in c.execute(
            "SELECT generation, ended_at FROM pipeline_generations ORDER BY generation").fetchall()])
        reports = await store.query(lambda c: [tuple(r) for r in c.execute(
            "SELECT steps_done, step_s, loss FROM stage_reports").fetchall()])
        await store.finish_pipeline(job.id, "ff" * 32, 1234, now=16.0)
        assert await store.load_pipelines() == [], "a done job has no pipeline to resume"
        assert await store.job_state(job.id) == "done"
        model = await store.query(lambda c: tuple(c.execute(
            "SELECT version, sha FROM models WHERE job_id = ? ORDER BY version DESC", (job.id,)).fetchone()))
    finally:
        store.close()
    assert (loaded.committed_step, loaded.generations) == (5, 2)
    assert loaded.last == _generation(job.id, 2, 5, "node gf1-a was lost")
    assert loaded.states == [UnitRecord(0, 5, "05" * 16, 100), UnitRecord(1, 5, "15" * 16, 101),
                             UnitRecord(0, 10, "010" * 16, 100)]
    assert rows == [(1, 15.0), (2, None)]
    assert reports == [(6, 1.8, 2.5)], "a step reported again replaces its row"
    assert model == (1, "ff" * 32)


def test_a_version_7_database_gains_the_pipeline_tables(tmp_path: Path) -> None:
    path = tmp_path / "hub.sqlite3"
    Database(path).close()
    conn = sqlite3.connect(path)
    _undo_sybil_state(conn)  # schemas 9 and 10 came after 8
    conn.executescript("DROP TABLE pipelines; DROP TABLE pipeline_generations; DROP TABLE unit_states;"
                       " DROP TABLE stage_reports; PRAGMA user_version = 7;")
    conn.close()
    db = Database(path)
    try:
        assert db.write_sync(lambda c: c.execute("PRAGMA user_version").fetchone()[0]) == SCHEMA_VERSION
        assert db.write_sync(lambda c: c.execute("SELECT COUNT(*) FROM unit_states").fetchone()[0]) == 0
    finally:
        db.close()


def test_a_database_from_a_newer_hub_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "hub.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(RuntimeError, match="upgrade gpuflex"):
        Database(path)


# -- PostgreSQL: its schema, its versions, its URL -------------------------------------------------


def _sqlite_columns(path: Path) -> dict[str, list[str]]:
    conn = sqlite3.connect(path)
    try:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {t: sorted(r[1] for r in conn.execute(f"PRAGMA table_info({t})")) for t in tables}
    finally:
        conn.close()


def test_postgres_has_sqlites_tables_and_columns_at_the_same_version(tmp_path: Path, postgres_url: str) -> None:
    """One schema in two dialects: a store written for one reads the same columns in the other."""
    import psycopg
    from gpuflex.hub.storage import store_postgres

    Database(tmp_path / "hub.sqlite3").close()
    store_postgres.connect(postgres_url).close()
    with psycopg.connect(postgres_url) as conn:
        rows = conn.execute("SELECT table_name, column_name FROM information_schema.columns"
                            " WHERE table_schema = 'public' AND table_name != 'gpuflex_schema'").fetchall()
        version = conn.execute("SELECT version FROM gpuflex_schema").fetchall()
    pg: dict[str, list[str]] = {}
    for table, column in rows:
        pg.setdefault(table, []).append(column)
    assert {t: sorted(c) for t, c in pg.items()} == _sqlite_columns(tmp_path / "hub.sqlite3")
    assert version == [(SCHEMA_VERSION,)] and store_postgres.SCHEMA_VERSION == SCHEMA_VERSION


def test_a_postgres_database_from_a_newer_hub_is_refused_in_one_line(postgres_url: str) -> None:
    import psycopg
    from gpuflex.hub.storage.store_postgres import PgDatabase, StoreUnavailable

    PgDatabase(postgres_url).close()
    with psycopg.connect(postgres_url) as conn:
        conn.execute("UPDATE gpuflex_schema SET version = version + 1")
    with pytest.raises(StoreUnavailable, match="upgrade gpuflex") as caught:
        PgDatabase(postgres_url)
    assert "\n" not in caught.value.detail and f"schema version {SCHEMA_VERSION + 1}" in caught.value.detail


def test_a_postgres_store_reopened_twice_at_once_migrates_once(postgres_url: str) -> None:
    """Two hubs starting together on one new database: the advisory lock lets one create the schema."""
    from concurrent.futures import ThreadPoolExecutor

    from gpuflex.hub.storage.store_postgres import connect

    with ThreadPoolExecutor(4) as pool:
        conns = list(pool.map(lambda _: connect(postgres_url), range(4)))
    for conn in conns:
        assert conn.execute("SELECT version FROM gpuflex_schema").fetchone()[0] == SCHEMA_VERSION
        conn.close()


@pytest.mark.parametrize(("url", "says"), [
    ("mysql://root@localhost/hub", "--store takes a postgresql://"),
    ("/var/lib/hub.sqlite3", "--store takes a postgresql://"),
    ("postgresql://u@h:5432/db?sslmode=sometimes&nonsense=1", "not a valid PostgreSQL URL"),
])
def test_a_bad_store_url_is_refused_in_one_line(url: str, says: str) -> None:
    from gpuflex.hub.storage.store_postgres import StoreUnavailable, check_url

    with pytest.raises(StoreUnavailable, match=says) as caught:
        check_url(url)
    assert "\n" not in caught.value.detail


def test_an_unreachable_postgres_server_is_one_line_without_the_password() -> None:
    import socket

    from gpuflex.hub.storage.store_postgres import PgDatabase, StoreUnavailable

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(StoreUnavailable, match=f"cannot connect to PostgreSQL at postgresql://hub:\\*\\*\\*@127.0.0.1:{port}/"
                       ) as caught:
        PgDatabase(f"postgresql://hub:s3cret@127.0.0.1:{port}/gpuflex")
    assert "s3cret" not in caught.value.detail and "\n" not in caught.value.detail


def test_postgres_rows_read_like_sqlite_rows(postgres_url: str) -> None:
    """What the read model (hub/server/readmodel/, hub/server/console) does with a row: by name, by position,
    dict(row), tuple(row); `?` placeholders; a `%` in a literal; SUM of a BIGINT is an int."""
    from gpuflex.hub.storage.store_postgres import connect

    conn = connect(postgres_url)
    try:
        conn.executemany("INSERT INTO chunks (job_id, idx, sha, samples, size) VALUES (?, ?, ?, ?, ?)",
                         [("j", i, f"s{i}", 10, 5) for i in range(3)])
        row = conn.execute("SELECT COUNT(*) AS n, SUM(samples) AS total, '100%' AS pct FROM chunks"
                           " WHERE job_id = ? AND sha LIKE ?", ("j", "s%")).fetchone()
        assert (row[0], row["total"], row["pct"], tuple(row), dict(row)) == (
            3, 30, "100%", (3, 30, "100%"), {"n": 3, "total": 30, "pct": "100%"})
        assert type(row["total"]) is int
        assert conn.execute("SELECT 'a?b' || ? AS s", ("c",)).fetchone()["s"] == "a?bc"
        conn.rollback()
    finally:
        conn.close()


async def test_a_postgres_store_reconnects_after_its_connection_drops(postgres_url: str) -> None:
    """A server restart or a dropped connection fails the call in flight, not the hub: the next
    call opens a new connection."""
    import psycopg
    from gpuflex.hub.storage.store_postgres import PgDatabase, PostgresStore

    store = PostgresStore(PgDatabase(postgres_url))
    try:
        await store.ping()
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                          " WHERE application_name = 'gpuflex-hub' AND datname = current_database()")
        with pytest.raises(psycopg.OperationalError):
            await store.ping()
        await store.save_node("gf1-n1", b"k" * 32, PROFILE, bench_sps=1.0, now=1.0)
        assert [n.id for n in (await store.load()).nodes] == ["gf1-n1"]
    finally:
        store.close()


def test_a_postgres_user_without_the_right_to_create_tables_is_told_in_one_line(postgres_url: str) -> None:
    """PostgreSQL 15 lets only a database's owner create tables in its public schema."""
    import psycopg
    from gpuflex.hub.storage.store_postgres import PgDatabase, StoreUnavailable, redact

    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute("DO $$ BEGIN CREATE ROLE weak LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    weak = postgres_url.replace("://gpuflex@", "://weak:pw@")
    with pytest.raises(StoreUnavailable, match="refused the hub's schema: permission denied") as caught:
        PgDatabase(weak)
    assert "\n" not in caught.value.detail and ":pw@" not in caught.value.detail
    assert redact("postgresql://u@h/db?password=x&sslmode=require") == (
        "postgresql://u@h/db?password=***&sslmode=require")


async def test_a_failing_write_in_a_group_commit_fails_alone(opened) -> None:
    """Writes queued together commit in one transaction (group commit); one that fails (a duplicate
    key here) is rolled back alone, by its savepoint, and its caller gets the error; every other
    write commits."""
    kind, _where, store = opened
    db = store.db  # type: ignore[attr-defined]
    await db.write(lambda c: c.execute("CREATE TABLE contract_keys (k INTEGER PRIMARY KEY)"))

    def hold(c):  # type: ignore[no-untyped-def]  # keeps the writer busy while the others queue up
        time.sleep(0.3)
        c.execute("INSERT INTO contract_keys (k) VALUES (?)", (100,))

    def insert(k: int):  # type: ignore[no-untyped-def]
        return lambda c: c.execute("INSERT INTO contract_keys (k) VALUES (?)", (k,)) and k

    first = asyncio.ensure_future(db.write(hold))
    await asyncio.sleep(0.05)
    got = await asyncio.gather(*(db.write(insert(k)) for k in [*range(10), 5, *range(10, 20)]),
                               return_exceptions=True)
    await first
    failed = [g for g in got if isinstance(g, BaseException)]
    assert len(failed) == 1 and isinstance(failed[0], store.integrity_errors), got  # type: ignore[attr-defined]
    keys = await db.read(lambda c: [r[0] for r in c.execute("SELECT k FROM contract_keys ORDER BY k")])
    assert keys == [*range(20), 100], (kind, keys)


def test_a_version_9_database_gains_the_rollback_columns_keeping_its_models(tmp_path: Path) -> None:
    path = tmp_path / "hub.sqlite3"
    Database(path).close()
    conn = sqlite3.connect(path)
    _undo_rollback_columns(conn)
    conn.executescript("INSERT INTO models (job_id, version, sha, created_at) VALUES ('j', 1, 'ab', 0);"
                       "PRAGMA user_version = 9;")
    conn.close()
    db = Database(path)
    try:
        assert db.write_sync(lambda c: c.execute("PRAGMA user_version").fetchone()[0]) == SCHEMA_VERSION
        row = db.write_sync(lambda c: dict(c.execute("SELECT * FROM models").fetchone()))
    finally:
        db.close()
    assert (row["sha"], row["opt_state_sha"]) == ("ab", None)


def _closed(model: str, opt: str | None) -> RoundResult:
    return RoundResult(model_hash=model, opt_state_sha=opt, statuses={}, flags=[], evidence={}, metrics={},
                       train_loss=None, flagged_nodes=[])


async def test_a_rollback_survives_a_restart_and_old_models_are_let_go(opened) -> None:
    """Each round's model is kept with its optimizer state; a rollback restores one and opens the
    next round on it (the rounds undone marked); pruning names only blobs nothing refers to."""
    kind, where, store = opened
    job = await _job(where, store)
    for rnd, (model, opt) in enumerate((("aa" * 32, "0a" * 32), ("bb" * 32, "0b" * 32))):
        job.round = rnd
        await store.close_round(job, _closed(model, opt), flags=[], withdrawn=[], cancelled=[], reputations=[],
                                last=False, now=10.0 + rnd)
    job.round = 2
    history = await store.rollback_history(job.id)
    assert history is not None and (history.state, history.round, history.kept) == ("running", 2, {0, 1, 2})
    assert await store.rollback_history("j-nope") is None
    plan = rollback.decide(history, to_round=1)
    assert isinstance(plan, rollback.Rollback) and (plan.new_round, plan.rounds, plan.undone) == (3, 4, (1, 2))
    assert await store.kept_model(job.id, 1) == ("aa" * 32, "0a" * 32)
    assert await store.kept_model(job.id, 7) is None
    await store.roll_back(job.id, plan, model_hash="aa" * 32, opt_state_sha="0a" * 32, cancelled=[], now=20.0)
    store = await _reopen(kind, where, store)
    try:
        (loaded,) = (await store.load()).jobs
        assert (loaded.round, loaded.rounds, loaded.model_hash, loaded.opt_state_sha) == (3, 4, "aa" * 32, "0a" * 32)
        again = await store.rollback_history(job.id)
        assert again is not None and again.rolled_back == {1, 2} and again.kept == {0, 1, 2, 3}
        rows = await store.query(lambda c: c.execute(
            "SELECT round, restored_from, rolled_back_at FROM rounds WHERE job_id = ? ORDER BY round",
            (job.id,)).fetchall())
        assert [tuple(r) for r in rows] == [(0, None, None), (1, None, 20.0), (2, None, 20.0), (3, 1, None)]
        # versions 1 and 2 go: version 3 and the job still name version 1's blobs, not version 2's
        assert await store.prune_models(job.id, 3) == sorted(["bb" * 32, "0b" * 32])
        assert (await store.rollback_history(job.id)).kept == {0, 3}  # type: ignore[union-attr]
        assert await store.prune_models(job.id, 3) == []
        assert (await store.load_job(job.id)).round == 3  # type: ignore[union-attr]
        assert await store.load_job("j-nope") is None
    finally:
        store.close()
