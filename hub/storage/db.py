"""SQLite storage: schema, migrations and the single writer.

One connection, owned by one thread. Every statement runs on that thread, so the
event loop never blocks on SQLite. Writes queued while a transaction runs are
committed together (group commit: one fsync for many requests); a caller's future
resolves only after COMMIT, so a 2xx built on it survives kill -9 (WAL,
synchronous=FULL). Each write runs inside a SAVEPOINT: one failing write rolls
back alone.

Tables: jobs, chunks, models, rounds, shards, shard_chunks, assignments, updates,
nodes, flags, state_requests, cooldown_lifts, tokens, and a pipelined job's pipelines,
pipeline_generations, unit_states, stage_reports (the columns are documented in _SCHEMA below). Only the store
(hub/storage/store_sqlite.py), the read model (hub/server/readmodel/) and the
token table's module (hub/storage/tokens.py) run SQL.

Migrations: `PRAGMA user_version` is the schema version; `_MIGRATIONS[v]` takes a
database from version v to v + 1. A new database is created at the latest version.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

T = TypeVar("T")

SCHEMA_VERSION = 10


#: the pipelined jobs' tables (schema v8), in the schema and in the migration that adds them
_PIPELINE_TABLES = """
-- pipelined jobs (hub/domain/pipelines): each plan of a job's stages (a generation), the unit states
-- its stages checkpoint, its committed step, and each stage's report of each step
CREATE TABLE IF NOT EXISTS pipelines (
    job_id TEXT PRIMARY KEY,
    committed_step INTEGER NOT NULL DEFAULT 0,  -- every unit has a state at this step
    generations INTEGER NOT NULL DEFAULT 0,     -- the highest generation planned
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS pipeline_generations (
    job_id TEXT NOT NULL,
    generation INTEGER NOT NULL,
    first_step INTEGER NOT NULL,
    end_step INTEGER NOT NULL,
    plan TEXT NOT NULL,                 -- JSON: stages (node, units, predicted), micro-batches, schedule
    reason TEXT NOT NULL,               -- why it was planned (the first plan, a lost node, a restart)
    created_at REAL NOT NULL,
    ended_at REAL,
    PRIMARY KEY (job_id, generation)
);
CREATE TABLE IF NOT EXISTS unit_states (
    job_id TEXT NOT NULL,
    unit INTEGER NOT NULL,
    step INTEGER NOT NULL,              -- steps 0 to step - 1 applied
    sha TEXT NOT NULL,                  -- the GFT1 blob (parameters, buffers, optim.*)
    size INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    node_id TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (job_id, unit, step)
);
CREATE TABLE IF NOT EXISTS stage_reports (
    job_id TEXT NOT NULL,
    generation INTEGER NOT NULL,
    stage INTEGER NOT NULL,
    steps_done INTEGER NOT NULL,
    node_id TEXT NOT NULL,
    step_s REAL NOT NULL,               -- measured (wall clock, waits included)
    compute_s REAL NOT NULL,
    predicted_s REAL NOT NULL,          -- the planner's step time
    loss REAL,                          -- the last stage's
    reported_at REAL NOT NULL,
    PRIMARY KEY (job_id, generation, stage, steps_done)
);
"""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tokens (
    id INTEGER PRIMARY KEY,
    hash TEXT NOT NULL UNIQUE,          -- sha256 hex of the token
    role TEXT NOT NULL CHECK (role IN ('owner', 'auditor', 'admin')),
    name TEXT NOT NULL,
    created_at REAL NOT NULL,
    revoked_at REAL
);
CREATE TABLE IF NOT EXISTS enroll_tokens (  -- Sybil defences: the token of an operator admits its nodes
    id INTEGER PRIMARY KEY,             -- the operator is op-ID, shown as eID by token list
    hash TEXT NOT NULL UNIQUE,          -- sha256 hex of the token
    name TEXT NOT NULL,
    created_at REAL NOT NULL,
    revoked_at REAL
);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,                -- token name of the submitter
    name TEXT NOT NULL,
    spec_toml TEXT NOT NULL,
    state TEXT NOT NULL,                -- queued|running|done|cancelled|failed
    round INTEGER NOT NULL DEFAULT 0,   -- current (open) round, 0-based
    rounds INTEGER NOT NULL,
    model_hash TEXT NOT NULL,            -- current global model blob
    model_size INTEGER NOT NULL,
    opt_state_sha TEXT,                 -- server optimizer state blob
    val_sha TEXT,                       -- validation set blob (never served)
    train_samples INTEGER NOT NULL,
    val_samples INTEGER NOT NULL,
    error TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS chunks (
    job_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    sha TEXT NOT NULL,
    samples INTEGER NOT NULL,
    size INTEGER NOT NULL,
    owner_node TEXT,                    -- node-local job: the node whose silo this is (schema v6)
    histogram TEXT,                     -- its label counts as JSON, when its operator shared them
    registered_at REAL,                 -- when the silo was attached (or last replaced)
    PRIMARY KEY (job_id, idx)
);
CREATE TABLE IF NOT EXISTS models (
    job_id TEXT NOT NULL,
    version INTEGER NOT NULL,           -- 0 = initial, N = after round N-1 closed
    sha TEXT NOT NULL,
    created_at REAL NOT NULL,
    opt_state_sha TEXT,                 -- the server optimizer's state that goes with it (schema v10)
    PRIMARY KEY (job_id, version)
);
CREATE TABLE IF NOT EXISTS rounds (
    job_id TEXT NOT NULL,
    round INTEGER NOT NULL,
    model_hash TEXT NOT NULL,            -- model trained in this round
    new_model_hash TEXT,                 -- result of aggregation
    opened_at REAL NOT NULL,
    closed_at REAL,
    train_loss REAL,
    loss REAL,
    accuracy REAL,
    metrics TEXT,                       -- JSON
    evidence TEXT,                      -- JSON from verification
    rolled_back_at REAL,                -- a rollback undid what this round made (hub/policy/rollback.py)
    restored_from INTEGER,              -- this round opened on the model of that earlier round (a rollback)
    PRIMARY KEY (job_id, round)
);
CREATE TABLE IF NOT EXISTS shards (
    id TEXT PRIMARY KEY,
    job_id TEXT NOT NULL,
    round INTEGER NOT NULL,
    seq INTEGER NOT NULL,               -- carve order within the round
    seed INTEGER NOT NULL,
    samples INTEGER NOT NULL,
    replica_group TEXT NOT NULL,        -- '' when not replicated
    wanted INTEGER NOT NULL,            -- replicas wanted
    state TEXT NOT NULL,                -- open|settled|dropped
    first_update_at REAL,
    outcome TEXT                        -- JSON evidence of the replica comparison
);
CREATE INDEX IF NOT EXISTS shards_round ON shards (job_id, round);
CREATE TABLE IF NOT EXISTS shard_chunks (
    shard_id TEXT NOT NULL,
    pos INTEGER NOT NULL,               -- order inside the assignment
    chunk_idx INTEGER NOT NULL,
    chunk_sha TEXT NOT NULL,
    PRIMARY KEY (shard_id, pos)
);
CREATE TABLE IF NOT EXISTS assignments (
    id TEXT PRIMARY KEY,
    shard_id TEXT NOT NULL,
    job_id TEXT NOT NULL,
    round INTEGER NOT NULL,
    node_id TEXT NOT NULL,
    issued_at REAL NOT NULL,
    expected_s REAL NOT NULL,
    deadline REAL NOT NULL,
    state TEXT NOT NULL,                -- live|done|expired|abandoned|cancelled
    sealed BLOB NOT NULL                -- the signed Assignment as sent
);
CREATE INDEX IF NOT EXISTS assignments_live ON assignments (state);
CREATE TABLE IF NOT EXISTS updates (
    id TEXT PRIMARY KEY,
    assignment_id TEXT NOT NULL UNIQUE, -- one update per assignment, ever
    shard_id TEXT NOT NULL,
    job_id TEXT NOT NULL,
    round INTEGER NOT NULL,
    node_id TEXT NOT NULL,
    sha TEXT NOT NULL,
    size INTEGER NOT NULL,
    sample_count INTEGER NOT NULL,
    loss REAL NOT NULL,
    train_s REAL NOT NULL,
    metrics TEXT NOT NULL,
    timings TEXT NOT NULL,
    status TEXT NOT NULL,               -- accepted|included|quarantined|redundant|excluded
    received_at REAL NOT NULL,
    commitment TEXT                     -- JSON: the signed checkpoint Commitment (the referee's), or NULL
);
CREATE INDEX IF NOT EXISTS updates_round ON updates (job_id, round);
CREATE TABLE IF NOT EXISTS nodes (
    id TEXT PRIMARY KEY,                -- fingerprint of the public key
    public_key BLOB NOT NULL,
    software_version TEXT NOT NULL,
    device TEXT NOT NULL,               -- JSON
    benchmark TEXT NOT NULL,            -- JSON
    bench_sps REAL NOT NULL,
    ema_sps REAL NOT NULL,
    registered_at REAL NOT NULL,
    last_seen REAL NOT NULL,
    -- the node's Reputation (hub/policy/verification.py), one column per field
    agreements_total INTEGER NOT NULL DEFAULT 0,
    flags_total INTEGER NOT NULL DEFAULT 0,
    consecutive_agreements INTEGER NOT NULL DEFAULT 0,
    confirmed_flags INTEGER NOT NULL DEFAULT 0,
    dismissed_flags INTEGER NOT NULL DEFAULT 0,
    updates_accepted INTEGER NOT NULL DEFAULT 0,
    banned INTEGER NOT NULL DEFAULT 0,
    compute_class TEXT NOT NULL DEFAULT '{}',  -- JSON: the ComputeClass of its last hello (schema v3)
    address_block TEXT NOT NULL DEFAULT '',  -- Sybil defences (hub/policy/admission.py): where it registered
    -- from and was last seen, its operator (the enrollment token it registered with: op-ID), its ban time
    last_block TEXT NOT NULL DEFAULT '',
    operator TEXT,
    banned_at REAL
);
-- a flag's run_before: the run of agreements of its node that it reset, given back if it is withdrawn
CREATE TABLE IF NOT EXISTS flags (
    id TEXT PRIMARY KEY,
    job_id TEXT NOT NULL,
    round INTEGER NOT NULL,
    update_id TEXT NOT NULL,
    node_id TEXT NOT NULL,
    reason TEXT NOT NULL,
    evidence TEXT NOT NULL,             -- JSON
    status TEXT NOT NULL DEFAULT 'open',  -- open|confirmed|dismissed|moot (node banned meanwhile)
    verdict_note TEXT,
    auditor TEXT,
    created_at REAL NOT NULL,
    decided_at REAL,
    suspends INTEGER NOT NULL DEFAULT 0,  -- 1 while open: it suspends its node (hub/policy/suspension.py)
    run_before INTEGER
);
CREATE INDEX IF NOT EXISTS flags_job ON flags (job_id, status);
-- the referee (hub/policy/referee.py): checkpoint states asked of a node, and the verdict on them
CREATE TABLE IF NOT EXISTS state_requests (
    id TEXT PRIMARY KEY,
    job_id TEXT NOT NULL,
    round INTEGER NOT NULL,
    shard_id TEXT NOT NULL,
    update_id TEXT NOT NULL,
    node_id TEXT NOT NULL,
    assignment_id TEXT NOT NULL,
    reason TEXT NOT NULL,               -- disagreement|spot_check
    segment INTEGER NOT NULL,           -- index of the segment to re-execute
    steps TEXT NOT NULL,                -- JSON [start, end, last]
    states TEXT NOT NULL DEFAULT '{}',  -- JSON {step: sha of the handed-over state blob}
    requested_at REAL NOT NULL,
    deadline REAL NOT NULL,
    status TEXT NOT NULL DEFAULT 'open', -- open|reproduced|mismatch|unverifiable|unreachable
    verdict TEXT                        -- JSON evidence of the verdict
);
CREATE INDEX IF NOT EXISTS state_requests_open ON state_requests (status);
-- a ban's cooldown of a whole address block, lifted for one address or the block by the operator
-- (hub/policy/admission.py): new identities from it are admitted again, until a later ban there
CREATE TABLE IF NOT EXISTS cooldown_lifts (
    address TEXT PRIMARY KEY,           -- an IP address ("203.0.113.7") or a block ("203.0.113.0/24")
    lifted_at REAL NOT NULL,
    lifted_by TEXT NOT NULL,            -- the admin token's name
    note TEXT NOT NULL DEFAULT ''
);
""" + _PIPELINE_TABLES


def durable_connection(path: Path) -> sqlite3.Connection:
    """A connection to the SQLite file ``path`` (created with its folder) whose commits survive a
    crash: WAL, synchronous=FULL; for the single writer's thread (hub/storage/db.py's Database)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10.0)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA busy_timeout=10000")
    return conn


def connect(path: Path) -> sqlite3.Connection:
    """Open (creating and migrating) the hub database with durable settings."""
    conn = durable_connection(path)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA foreign_keys=ON")
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        conn.close()
        raise RuntimeError(f"{path} has schema version {version}; this hub knows up to {SCHEMA_VERSION}:"
                           " upgrade gpuflex")
    if version < SCHEMA_VERSION:
        conn.execute("BEGIN IMMEDIATE")
        if version == 0:
            for stmt in _SCHEMA.split(";"):
                if stmt.strip():
                    conn.execute(stmt)
        else:
            for v in range(version, SCHEMA_VERSION):
                for stmt in _MIGRATIONS[v]:
                    conn.execute(stmt)
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        conn.execute("COMMIT")
    return conn


#: version -> statements that bring a database of that version to the next one
_MIGRATIONS: dict[int, tuple[str, ...]] = {
    # 1 -> 2: one word per concept. The node's reputation columns take the names of Reputation's
    # fields; a model is named by its hash (model_hash), as in the protocol and the API.
    1: tuple(f"ALTER TABLE {table} RENAME COLUMN {old} TO {new}" for table, old, new in (
        ("nodes", "agreed", "agreements_total"), ("nodes", "disagreed", "flags_total"),
        ("nodes", "consecutive_valid", "consecutive_agreements"), ("nodes", "flags_confirmed", "confirmed_flags"),
        ("nodes", "flags_dismissed", "dismissed_flags"), ("jobs", "model_sha", "model_hash"),
        ("rounds", "model_sha", "model_hash"), ("rounds", "new_model_sha", "new_model_hash"))),
    # --- compute classes (issue 14, items 1-3) -------------------------------------------------
    # 2 -> 3: a node's compute class (protocol ComputeClass as JSON) from its hello; '{}' until the
    # node says hello again (it is then the unknown class: fp32 only, placed like any class).
    2: ("ALTER TABLE nodes ADD COLUMN compute_class TEXT NOT NULL DEFAULT '{}'",),
    # --- 3 -> 4: Sybil defences (issue 14, item 7) ----------------------------------------------
    # Each node's address block at registration and when last seen, its operator (enrollment
    # token), and when it was banned (a banned node's block and operator cool down).
    3: ("ALTER TABLE nodes ADD COLUMN address_block TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE nodes ADD COLUMN last_block TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE nodes ADD COLUMN operator TEXT",
        "ALTER TABLE nodes ADD COLUMN banned_at REAL",
        "CREATE TABLE IF NOT EXISTS enroll_tokens (id INTEGER PRIMARY KEY, hash TEXT NOT NULL UNIQUE,"
        " name TEXT NOT NULL, created_at REAL NOT NULL, revoked_at REAL)"),
    # ---- 4 -> 5: the referee (issue 14, items 4-6; hub/policy/referee.py) ---------------------------------
    # An update's checkpoint commitment, and the states the referee asks nodes for, with its verdicts.
    4: (
        "ALTER TABLE updates ADD COLUMN commitment TEXT",
        """CREATE TABLE IF NOT EXISTS state_requests (
            id TEXT PRIMARY KEY, job_id TEXT NOT NULL, round INTEGER NOT NULL, shard_id TEXT NOT NULL,
            update_id TEXT NOT NULL, node_id TEXT NOT NULL, assignment_id TEXT NOT NULL, reason TEXT NOT NULL,
            segment INTEGER NOT NULL, steps TEXT NOT NULL, states TEXT NOT NULL DEFAULT '{}',
            requested_at REAL NOT NULL, deadline REAL NOT NULL, status TEXT NOT NULL DEFAULT 'open', verdict TEXT)""",
        "CREATE INDEX IF NOT EXISTS state_requests_open ON state_requests (status)",
    ),
    # ---- end of 4 -> 5 ----------------------------------------------------------------------------
    # ---- 5 -> 6: node-local data (issue 18). A node-local job's chunks are its silos: one row per
    # node that attached one (its blob id, size and sample count; never a row of data).
    5: ("ALTER TABLE chunks ADD COLUMN owner_node TEXT",
        "ALTER TABLE chunks ADD COLUMN histogram TEXT",
        "ALTER TABLE chunks ADD COLUMN registered_at REAL"),
    # ---- 6 -> 7: a proven mismatch suspends its node while its flag is open (hub/policy/suspension.py)
    6: ("ALTER TABLE flags ADD COLUMN suspends INTEGER NOT NULL DEFAULT 0",),
    # ---- 7 -> 8: pipelined jobs: generations, unit states, the committed step, stage reports
    7: tuple(s.strip() for s in _PIPELINE_TABLES.split(";") if s.strip()),
    # ---- 8 -> 9: the Sybil defences' state kept in the store: a flag's reset run (given back when
    # the flag is withdrawn, across a restart) and the operator's lifts of a ban's block cooldown
    8: ("ALTER TABLE flags ADD COLUMN run_before INTEGER",
        "CREATE TABLE IF NOT EXISTS cooldown_lifts (address TEXT PRIMARY KEY, lifted_at REAL NOT NULL,"
        " lifted_by TEXT NOT NULL, note TEXT NOT NULL DEFAULT '')"),
    # ---- 9 -> 10: rollback (hub/policy/rollback.py). Each kept model with its server optimizer
    # state; a round a rollback undid, and the round that opened on an earlier round's model.
    9: ("ALTER TABLE models ADD COLUMN opt_state_sha TEXT",
        "ALTER TABLE rounds ADD COLUMN rolled_back_at REAL",
        "ALTER TABLE rounds ADD COLUMN restored_from INTEGER"),
}


class _Op:
    """One call into the store's thread. ``loop``: the event loop an ``async`` caller awaits on
    (its future is that loop's); None for ``write_sync`` from a worker thread."""

    __slots__ = ("fn", "future", "loop", "write")

    def __init__(self, fn: Callable[[sqlite3.Connection], Any], write: bool,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.fn = fn
        self.write = write
        self.loop = loop
        self.future: asyncio.Future[Any] | concurrent.futures.Future[Any] = (
            loop.create_future() if loop is not None else concurrent.futures.Future())


class Database:
    """The hub's single SQLite connection behind one thread, with group commit.

    ``opener``: what opens (creating and migrating) the file; the hub's schema by default
    (hub/storage/blobpack.py opens its own)."""

    def __init__(self, path: Path, opener: Callable[[Path], sqlite3.Connection] = connect,
                 thread_name: str = "gpuflex-hub-db") -> None:
        self.path = path
        self._conn = opener(path)
        self._queue: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=thread_name, daemon=True)
        self._thread.start()
        self._closed = False

    # -- callers -------------------------------------------------------------------------
    async def write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn(conn)` in a transaction; resolves after COMMIT."""
        result: T = await self._submit(fn, True, asyncio.get_running_loop())
        return result

    async def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        result: T = await self._submit(fn, False, asyncio.get_running_loop())
        return result

    def write_sync(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """From a worker thread (never from the event loop)."""
        future = cast("concurrent.futures.Future[T]", self._submit(fn, True, None))  # no loop: a thread's
        return future.result()

    def _submit(self, fn: Callable[[sqlite3.Connection], Any], write: bool,
                loop: asyncio.AbstractEventLoop | None) -> asyncio.Future[Any] | concurrent.futures.Future[Any]:
        if self._closed:
            raise RuntimeError("database is closed")
        op = _Op(fn, write, loop)
        self._queue.put(op)
        return op.future

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=30)
        self._conn.close()

    # -- the thread ----------------------------------------------------------------------
    def _serve(self) -> None:
        stop = False
        while not stop:
            first = self._queue.get()
            if first is None:
                break
            batch = [first]
            while len(batch) < 512:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            self._run_batch(batch)

    def _run_batch(self, batch: list[_Op]) -> None:
        conn = self._conn
        results: list[tuple[_Op, bool, Any]] = []
        writes = any(op.write for op in batch)
        try:
            if writes:
                conn.execute("BEGIN IMMEDIATE")
            for op in batch:
                if op.write:
                    # one name for every op's savepoint (each is released before the next begins):
                    # three statements that stay in sqlite3's statement cache, where a name an op
                    # (w0 ... w511) made a batch of more than 128 writes prepare them anew each time
                    conn.execute("SAVEPOINT op")
                    try:
                        value = _kept(op.fn(conn))
                    except BaseException as exc:
                        conn.execute("ROLLBACK TO op")
                        conn.execute("RELEASE op")
                        results.append((op, False, exc))
                    else:
                        conn.execute("RELEASE op")
                        results.append((op, True, value))
                else:
                    try:
                        results.append((op, True, _kept(op.fn(conn))))
                    except BaseException as exc:
                        results.append((op, False, exc))
            if writes:
                conn.execute("COMMIT")
        except BaseException as exc:  # the transaction itself failed: nothing is durable
            if conn.in_transaction:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
            fail_batch(batch, exc)
            return
        settle_batch(results)


def _kept(value: Any) -> Any:
    """What a caller may hold of an op's value: never a cursor. A cursor dropped on another thread
    resets its statement there, and the cached statement may be the one this thread is running
    for the next op of the batch (sqlite3.InterfaceError: bad parameter or other API misuse)."""
    if isinstance(value, sqlite3.Cursor):
        value.close()
        return None
    return value


def fail_batch(batch: list[_Op], exc: BaseException) -> None:
    """The transaction itself failed: every caller of the batch gets ``exc``."""
    settle_batch([(op, False, exc) for op in batch])


def settle_batch(results: list[tuple[_Op, bool, Any]]) -> None:
    """After COMMIT: each caller gets its value, or the error its own savepoint rolled back.

    The callers waiting on one event loop are woken by one call into it for the whole batch
    (one wake-up of the loop, not one a caller: a round's opening commits hundreds at once)."""
    on_loops: dict[asyncio.AbstractEventLoop, list[tuple[_Op, bool, Any]]] = {}
    for item in results:
        op = item[0]
        if op.loop is None:
            _settle(item)
        else:
            on_loops.setdefault(op.loop, []).append(item)
    for loop, items in on_loops.items():
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
            loop.call_soon_threadsafe(_settle_all, items)


def _settle_all(items: list[tuple[_Op, bool, Any]]) -> None:
    for item in items:
        _settle(item)


def _settle(item: tuple[_Op, bool, Any]) -> None:
    op, ok, value = item
    if op.future.done():  # its caller gave up (cancelled at shutdown): the write still committed
        return
    if ok:
        op.future.set_result(value)
    else:
        op.future.set_exception(value)
