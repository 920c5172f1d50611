"""`SqlStore`: the `Store`'s methods as SQL that SQLite and PostgreSQL both run, and `SqliteStore`,
the `Store` on the hub's SQLite database (hub/storage/db.py: WAL, synchronous=FULL, one writer thread,
group commit). Each method below is one transaction. The methods are grouped as the `Store`'s
interfaces are, one class per aggregate (`SqlNodes`, `SqlJobs`, `SqlSilos`, `SqlAssignments`,
`SqlStateRequests`, `SqlFlags`, and a pipelined job's `SqlPipelines` in store_pipelines.py), and
`SqlStore` composes them.

The statements are written once, in the dialect both databases share (`?` placeholders, which the
PostgreSQL connection (hub/storage/store_postgres.py) turns into its own; `INSERT ... ON CONFLICT`); what
differs, the database clock and the integrity error, is a class attribute. One text for both
stores keeps them from drifting apart; tests/test_store_contract.py runs against both."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.jobspec import JobSpec, parse_job_spec
from gpuflex.protocol.messages import UNKNOWN_CLASS, Commitment, ComputeClass, nested_from_dict

from ..base.errors import Conflict
from ..model.job import (
    AssignmentState,
    ChunkInfo,
    JobState,
    ShardState,
    StateRequestState,
    UpdateState,
    new_id,
)
from ..model.node import NodeState, peak_flops
from ..policy.suspension import flag_suspends
from ..policy.suspension import why as suspension_why
from ..policy.verification import Flag, Reputation
from .db import Database
from .store import (
    AssignmentFate,
    AssignmentStore,
    CooldownLift,
    FlagRecord,
    FlagStore,
    JobStore,
    LoadedState,
    NodeProfile,
    NodeStore,
    RoundResult,
    SiloStore,
    StateRequestStore,
    Store,
)
from .store_pipelines import SqlPipelines
from .store_rollback import SqlRollbacks
from .tokens import insert_token

T = TypeVar("T")

def reputation_sql(clock: str) -> str:
    """The statement that writes a node's reputation; `clock` is the database's Unix time in SQL."""
    # `clock` is a store's constant, never input
    return (
        "UPDATE nodes SET agreements_total = ?, flags_total = ?, consecutive_agreements = ?,"  # noqa: S608
        " confirmed_flags = ?, dismissed_flags = ?, banned = ?,"
        # the first time a node is banned, the database's clock stamps it (its block and operator cool down)
        f" banned_at = CASE WHEN banned_at IS NULL AND ? = 1 THEN {clock}"
        " ELSE banned_at END WHERE id = ?"
    )


class DuplicateUpdate(Conflict):
    code = "duplicate_update"


def commitment_to_json(c: Commitment | None) -> str | None:
    return None if c is None else json.dumps(dataclasses.asdict(c), separators=(",", ":"))


def commitment_from_json(text: str | None) -> Commitment | None:
    if not text:
        return None
    d = json.loads(text)
    return Commitment(every=int(d["every"]), steps=int(d["steps"]), precision=str(d["precision"]),
                      hashes=tuple(d["hashes"]), norms=tuple(float(x) for x in d["norms"]))


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _reputation_row(node_id: str, r: Reputation) -> tuple[int, int, int, int, int, int, int, str]:
    return (r.agreements_total, r.flags_total, r.consecutive_agreements, r.confirmed_flags,
            r.dismissed_flags, int(r.banned), int(r.banned), node_id)


def insert_flags(conn: sqlite3.Connection, job_id: str, round_: int, flags: Sequence[Flag], now: float) -> None:
    """The flags, each with its node's stored run of agreements (``run_before``): written before
    the flag's reset reaches the node's row, so it is the run a withdrawal gives back."""
    conn.executemany(
        "INSERT INTO flags (id, job_id, round, update_id, node_id, reason, evidence, status, created_at, suspends,"
        " run_before) VALUES (?, ?, ?, ?, ?, ?, ?, 'open', ?, ?,"
        " (SELECT consecutive_agreements FROM nodes WHERE id = ?))",
        [(new_id("f"), job_id, round_, f.update_id, f.node_id, f.reason, _json(f.evidence), now,
          int(flag_suspends(f)), f.node_id) for f in flags])


def _suspensions(conn: sqlite3.Connection, node_id: str | None = None) -> dict[str, str]:
    """node id -> why it is suspended: its oldest open flag that suspends (hub/policy/suspension.py)."""
    order = " ORDER BY created_at DESC, id DESC"
    sql = "SELECT node_id, reason, update_id FROM flags WHERE status = 'open' AND suspends = 1"
    rows = (conn.execute(sql + order) if node_id is None
            else conn.execute(sql + " AND node_id = ?" + order, (node_id,))).fetchall()
    return {r["node_id"]: suspension_why(r["reason"], r["update_id"]) for r in rows}


def _end_live(conn: sqlite3.Connection, ids: Sequence[str], state: str) -> None:
    conn.executemany("UPDATE assignments SET state = ? WHERE id = ? AND state = 'live'",
                     [(state, i) for i in ids])


def _insert_shard(conn: sqlite3.Connection, s: ShardState, chunks: Sequence[ChunkInfo]) -> None:
    """A new open shard and its chunks, in their order."""
    conn.execute(
        "INSERT INTO shards (id, job_id, round, seq, seed, samples, replica_group, wanted, state)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'open')",
        (s.id, s.job_id, s.round, s.seq, s.seed, s.samples, s.replica_group, s.wanted))
    conn.executemany("INSERT INTO shard_chunks (shard_id, pos, chunk_idx, chunk_sha) VALUES (?, ?, ?, ?)",
                     [(s.id, pos, c.idx, c.sha) for pos, c in enumerate(chunks)])


def flag_record(row: sqlite3.Row) -> FlagRecord:
    return FlagRecord(
        id=row["id"], job_id=row["job_id"], round=row["round"], update_id=row["update_id"],
        node_id=row["node_id"], reason=row["reason"], evidence=json.loads(row["evidence"] or "{}"),
        status=row["status"], verdict_note=row["verdict_note"], auditor=row["auditor"],
        created_at=row["created_at"], decided_at=row["decided_at"], suspends=bool(row["suspends"]))


#: the ``states`` value of a step the node said it no longer holds (no blob is ever named so)
_DECLINED = ""


def _state_request(r: Any) -> StateRequestState:
    answered = {int(k): str(v) for k, v in json.loads(r["states"]).items()}
    return StateRequestState(
        id=r["id"], job_id=r["job_id"], round=r["round"], shard_id=r["shard_id"], update_id=r["update_id"],
        node_id=r["node_id"], assignment_id=r["assignment_id"], reason=r["reason"], segment=r["segment"],
        steps=tuple(int(x) for x in json.loads(r["steps"])), requested_at=r["requested_at"],
        deadline=r["deadline"], states={k: v for k, v in answered.items() if v != _DECLINED},
        declined={k for k, v in answered.items() if v == _DECLINED})


class _SqlRows:
    """What every aggregate's statements run on: a `Database` (one thread, one connection, group
    commit) and the two things the databases differ in (`SqlStore` sets them)."""

    db: Database
    integrity_errors: tuple[type[Exception], ...]
    #: `reputation_sql` with the database's clock
    _reputation_sql: str


class SqlNodes(_SqlRows, NodeStore):
    """The nodes' rows."""

    async def save_node(self, node_id: str, public_key: bytes, profile: NodeProfile, *, bench_sps: float,
                        now: float, address_block: str = "", operator: str | None = None) -> None:
        device, bench = json.dumps(profile.device), json.dumps(profile.benchmark)
        compute = json.dumps(profile.compute)
        await self.db.write(lambda c: c.execute(
            "INSERT INTO nodes (id, public_key, software_version, device, benchmark, bench_sps, ema_sps,"
            " registered_at, last_seen, compute_class, address_block, last_block, operator)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (id) DO UPDATE SET software_version = excluded.software_version,"
            " device = excluded.device, benchmark = excluded.benchmark, bench_sps = excluded.bench_sps,"
            " last_seen = excluded.last_seen, compute_class = excluded.compute_class,"
            " address_block = excluded.address_block, last_block = excluded.last_block, operator = COALESCE(nodes.operator, excluded.operator)",
            (node_id, public_key, profile.software_version, device, bench, bench_sps, bench_sps, now, now,
             compute, address_block, address_block, operator)))

    async def save_reputations(self, reputations: Sequence[tuple[str, Reputation]]) -> None:
        rows = [_reputation_row(n, r) for n, r in reputations]
        await self.db.write(lambda c: c.executemany(self._reputation_sql, rows))

    async def note_block(self, node_id: str, last_block: str) -> None:
        await self.db.write(lambda c: c.execute("UPDATE nodes SET last_block = ? WHERE id = ?", (last_block, node_id)))

    async def lift_cooldown(self, lift: CooldownLift) -> None:
        await self.db.write(lambda c: c.execute(
            "INSERT INTO cooldown_lifts (address, lifted_at, lifted_by, note) VALUES (?, ?, ?, ?)"
            " ON CONFLICT (address) DO UPDATE SET lifted_at = excluded.lifted_at, lifted_by = excluded.lifted_by,"
            " note = excluded.note", (lift.address, lift.lifted_at, lift.lifted_by, lift.note)))


class SqlJobs(_SqlRows, JobStore):
    """The jobs' rows and their rounds, chunks and models."""

    def insert_job_sync(self, job: JobState, spec_text: str, train_samples: int, val_samples: int) -> None:
        def write(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO jobs (id, owner, name, spec_toml, state, round, rounds, model_hash, model_size,"
                " val_sha, train_samples, val_samples, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, ?, 0, ?, ?, ?, ?, ?, ?, ?, ?)",
                (job.id, job.owner, job.name, spec_text, job.state, job.rounds, job.model_hash,
                 job.model_size, job.val_sha, train_samples, val_samples, job.created_at, job.created_at))
            conn.executemany(
                "INSERT INTO chunks (job_id, idx, sha, samples, size) VALUES (?, ?, ?, ?, ?)",
                [(job.id, c.idx, c.sha, c.samples, c.size) for c in job.chunks])
            conn.execute("INSERT INTO models (job_id, version, sha, created_at) VALUES (?, 0, ?, ?)",
                         (job.id, job.model_hash, job.created_at))
            conn.execute("INSERT INTO rounds (job_id, round, model_hash, opened_at) VALUES (?, 0, ?, ?)",
                         (job.id, job.model_hash, job.created_at))

        self.db.write_sync(write)

    async def job_state(self, job_id: str) -> str | None:
        row = await self.db.read(lambda c: c.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone())
        return None if row is None else str(row["state"])

    async def load_job(self, job_id: str) -> JobState | None:
        def read(conn: sqlite3.Connection) -> JobState | None:
            row = conn.execute("SELECT * FROM jobs WHERE id = ? AND state IN ('queued', 'running')",
                               (job_id,)).fetchone()
            return None if row is None else _load_job(conn, row, parse_job_spec(row["spec_toml"]))

        return await self.db.read(read)

    async def end_job(self, job_id: str, state: str, error: str | None, cancelled: Sequence[str]) -> None:
        now = time.time()

        def write(conn: sqlite3.Connection) -> None:
            conn.execute("UPDATE jobs SET state = ?, error = ?, updated_at = ? WHERE id = ?",
                         (state, error, now, job_id))
            _end_live(conn, cancelled, "cancelled")

        await self.db.write(write)

    async def fail_job(self, job_id: str, error: str, cancelled: Sequence[str] = ()) -> None:
        await self.end_job(job_id, "failed", error, cancelled)

    async def close_round(self, job: JobState, result: RoundResult, *, flags: Sequence[Flag],
                          withdrawn: Sequence[str], cancelled: Sequence[str],
                          reputations: Sequence[tuple[str, Reputation]], last: bool, now: float,
                          carried: Sequence[tuple[str, ShardState]] = ()) -> None:
        rows = [_reputation_row(n, r) for n, r in reputations]
        next_round = job.round + 1

        def write(conn: sqlite3.Connection) -> None:
            insert_flags(conn, job.id, job.round, flags, now)  # with the runs they reset, before the reset
            conn.executemany(self._reputation_sql, rows)
            conn.executemany("UPDATE updates SET status = ? WHERE id = ?",
                             [(s, u) for u, s in result.statuses.items()])
            conn.executemany(
                "UPDATE flags SET status = 'dismissed', auditor = 'hub', decided_at = ?, verdict_note ="
                " 'withdrawn: the majority this update disagreed with was flagged at review'"
                " WHERE update_id = ? AND reason = 'replica_mismatch' AND status = 'open'",
                [(now, uid) for uid in withdrawn])
            _end_live(conn, cancelled, "cancelled")
            conn.execute(
                "UPDATE rounds SET new_model_hash = ?, closed_at = ?, train_loss = ?, loss = ?, accuracy = ?,"
                " metrics = ?, evidence = ? WHERE job_id = ? AND round = ?",
                (result.model_hash, now, result.train_loss, result.metrics.get("loss"),
                 result.metrics.get("accuracy"), _json(result.metrics), _json(result.evidence),
                 job.id, job.round))
            conn.execute("INSERT INTO models (job_id, version, sha, created_at, opt_state_sha) VALUES (?, ?, ?, ?, ?)"
                         " ON CONFLICT (job_id, version) DO UPDATE SET sha = excluded.sha,"
                         " created_at = excluded.created_at, opt_state_sha = excluded.opt_state_sha",
                         (job.id, next_round, result.model_hash, now, result.opt_state_sha))
            conn.execute(
                "UPDATE jobs SET round = ?, model_hash = ?, opt_state_sha = ?, state = ?, updated_at = ?"
                " WHERE id = ?",
                (next_round, result.model_hash, result.opt_state_sha, "done" if last else "running", now, job.id))
            if not last:
                # a fresh round row, as the round opens (what a row left from before held is cleared)
                conn.execute("INSERT INTO rounds (job_id, round, model_hash, opened_at) VALUES (?, ?, ?, ?)"
                             " ON CONFLICT (job_id, round) DO UPDATE SET model_hash = excluded.model_hash,"
                             " opened_at = excluded.opened_at, new_model_hash = NULL, closed_at = NULL,"
                             " train_loss = NULL, loss = NULL, accuracy = NULL, metrics = NULL, evidence = NULL,"
                             " rolled_back_at = NULL, restored_from = NULL",
                             (job.id, next_round, result.model_hash, now))
                for aid, s in carried:  # a straggler's assignment, and its shard, move to the next round
                    _insert_shard(conn, s, job.chunks_at(s.chunk_idxs))
                    conn.execute("UPDATE assignments SET shard_id = ?, round = ? WHERE id = ? AND state = 'live'",
                                 (s.id, next_round, aid))

        await self.db.write(write)


class SqlSilos(_SqlRows, SiloStore):
    """A node-local job's silos: its chunk rows' owners."""

    async def save_silo(self, job_id: str, chunk: ChunkInfo, *, histogram: Sequence[int] | None, now: float) -> None:
        hist = None if histogram is None else json.dumps(list(histogram))

        def write(conn: sqlite3.Connection) -> None:
            conn.execute("DELETE FROM chunks WHERE job_id = ? AND idx = ?", (job_id, chunk.idx))
            conn.execute(
                "INSERT INTO chunks (job_id, idx, sha, samples, size, owner_node, histogram, registered_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (job_id, chunk.idx, chunk.sha, chunk.samples, chunk.size, chunk.owner, hist, now))

        await self.db.write(write)

    async def withdraw_silo(self, job_id: str, idx: int, abandoned: Sequence[str]) -> None:
        def write(conn: sqlite3.Connection) -> None:
            conn.execute("UPDATE chunks SET owner_node = NULL WHERE job_id = ? AND idx = ?", (job_id, idx))
            _end_live(conn, abandoned, "abandoned")

        await self.db.write(write)


class SqlAssignments(_SqlRows, AssignmentStore):
    """Assignments, the updates they bring, and their shards' verdicts."""

    async def issue_assignment(self, a: AssignmentState, new_shard: ShardState | None,
                               chunks: Sequence[ChunkInfo]) -> None:
        def write(conn: sqlite3.Connection) -> None:
            if new_shard is not None:
                _insert_shard(conn, new_shard, chunks)
            conn.execute(
                "INSERT INTO assignments (id, shard_id, job_id, round, node_id, issued_at, expected_s, deadline,"
                " state, sealed) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'live', ?)",
                (a.id, a.shard_id, a.job_id, a.round, a.node_id, a.issued_at, a.expected_s, a.deadline,
                 a.sealed))

        await self.db.write(write)

    async def extend_deadline(self, assignment_id: str, deadline: float) -> None:
        await self.db.write(lambda c: c.execute("UPDATE assignments SET deadline = ? WHERE id = ?",
                                                (deadline, assignment_id)))

    async def end_assignments(self, ids: Sequence[str], state: str) -> None:
        if state not in ("expired", "abandoned", "cancelled"):
            raise ValueError(f"an assignment cannot end as {state!r}")
        await self.db.write(lambda c: _end_live(c, ids, state))

    async def assignment_fate(self, assignment_id: str) -> AssignmentFate | None:
        row = await self.db.read(lambda c: c.execute(
            "SELECT a.node_id, a.state, u.id AS update_id FROM assignments a"
            " LEFT JOIN updates u ON u.assignment_id = a.id WHERE a.id = ?", (assignment_id,)).fetchone())
        if row is None:
            return None
        return AssignmentFate(row["node_id"], row["state"], row["update_id"])

    async def accept_update(self, upd: UpdateState, *, job_id: str, round: int, metrics: dict[str, float],
                            timings: dict[str, float], node: NodeState, first_update: bool,
                            settles: bool) -> None:
        def write(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO updates (id, assignment_id, shard_id, job_id, round, node_id, sha, size,"
                " sample_count, loss, train_s, metrics, timings, status, received_at, commitment)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'accepted', ?, ?)",
                (upd.id, upd.assignment_id, upd.shard_id, job_id, round, upd.node_id, upd.sha, upd.size,
                 upd.sample_count, upd.loss, upd.train_s, json.dumps(metrics), json.dumps(timings),
                 upd.received_at, commitment_to_json(upd.commitment)))
            conn.execute("UPDATE assignments SET state = 'done' WHERE id = ?", (upd.assignment_id,))
            conn.execute("UPDATE nodes SET ema_sps = ?, updates_accepted = ?, last_seen = ? WHERE id = ?",
                         (node.ema_sps, node.updates_accepted, upd.received_at, node.id))
            if first_update:
                conn.execute("UPDATE shards SET first_update_at = ? WHERE id = ?", (upd.received_at, upd.shard_id))
            if settles:
                conn.execute("UPDATE shards SET state = 'settled', outcome = '{\"replicas\":1}' WHERE id = ?",
                             (upd.shard_id,))

        try:
            await self.db.write(write)
        except self.integrity_errors:
            raise DuplicateUpdate("an update for this assignment was already accepted") from None

    async def want_replicas(self, shard_id: str, wanted: int, evidence: dict[str, Any]) -> None:
        await self.db.write(lambda c: c.execute("UPDATE shards SET wanted = ?, outcome = ? WHERE id = ?",
                                                (wanted, _json(evidence), shard_id)))

    async def settle_shard(self, shard: ShardState, *, state: str, evidence: dict[str, Any], statuses: dict[str, str],
                           cancelled: Sequence[str], flags: Sequence[Flag], round: int,
                           reputations: Sequence[tuple[str, Reputation]], now: float) -> None:
        rows = [_reputation_row(n, r) for n, r in reputations]

        def write(conn: sqlite3.Connection) -> None:
            conn.execute("UPDATE shards SET state = ?, outcome = ? WHERE id = ?", (state, _json(evidence), shard.id))
            conn.executemany("UPDATE updates SET status = ? WHERE id = ?", [(s, u) for u, s in statuses.items()])
            _end_live(conn, cancelled, "cancelled")
            insert_flags(conn, shard.job_id, round, flags, now)
            conn.executemany(self._reputation_sql, rows)

        await self.db.write(write)

    async def update_sha(self, update_id: str) -> str | None:
        row = await self.db.read(lambda c: c.execute("SELECT sha FROM updates WHERE id = ?",
                                                      (update_id,)).fetchone())
        return None if row is None else str(row["sha"])

    async def uploads_before(self, job_id: str, node_id: str, before: float, *, but: str,
                             limit: int) -> list[str]:
        rows = await self.db.read(lambda c: c.execute(
            "SELECT sha FROM updates WHERE job_id = ? AND node_id = ? AND received_at < ? AND id != ?"
            " ORDER BY received_at DESC LIMIT ?", (job_id, node_id, before, but, limit)).fetchall())
        return [str(r["sha"]) for r in rows]


class SqlStateRequests(_SqlRows, StateRequestStore):
    """The referee's state requests."""

    async def open_state_requests(self, requests: Sequence[StateRequestState]) -> None:
        rows = [(r.id, r.job_id, r.round, r.shard_id, r.update_id, r.node_id, r.assignment_id, r.reason, r.segment,
                 _json(list(r.steps)), r.requested_at, r.deadline) for r in requests]
        await self.db.write(lambda c: c.executemany(
            "INSERT INTO state_requests (id, job_id, round, shard_id, update_id, node_id, assignment_id, reason,"
            " segment, steps, requested_at, deadline) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows))

    async def record_state(self, request_id: str, step: int, sha: str) -> None:
        await self._answer_steps(request_id, {step: sha})

    async def decline_states(self, request_id: str, steps: Sequence[int]) -> None:
        await self._answer_steps(request_id, dict.fromkeys(steps, _DECLINED))

    async def _answer_steps(self, request_id: str, answers: dict[int, str]) -> None:
        """The ``states`` column maps each answered step to its blob, or to ``_DECLINED``."""
        def write(conn: sqlite3.Connection) -> None:
            row = conn.execute("SELECT states FROM state_requests WHERE id = ?", (request_id,)).fetchone()
            if row is None:
                raise Conflict(f"no state request {request_id}", code="unknown_request")
            states = json.loads(row["states"])
            states.update({str(step): sha for step, sha in answers.items()})
            conn.execute("UPDATE state_requests SET states = ? WHERE id = ?", (_json(states), request_id))

        await self.db.write(write)

    async def close_state_requests(self, outcomes: Sequence[tuple[str, str, dict[str, Any]]]) -> None:
        rows = [(status, _json(evidence), rid) for rid, status, evidence in outcomes]
        await self.db.write(lambda c: c.executemany(
            "UPDATE state_requests SET status = ?, verdict = ? WHERE id = ?", rows))

    async def referee_requests(self) -> list[tuple[StateRequestState, str, dict[str, Any]]]:
        def read(conn: sqlite3.Connection) -> list[tuple[StateRequestState, str, dict[str, Any]]]:
            rows = conn.execute(
                "SELECT r.* FROM state_requests r JOIN shards s ON s.id = r.shard_id WHERE s.state = 'open'"
                " ORDER BY r.requested_at, r.id").fetchall()
            return [(_state_request(r), str(r["status"]), json.loads(r["verdict"]) if r["verdict"] else {})
                    for r in rows]

        return await self.db.read(read)


class SqlFlags(_SqlRows, FlagStore):
    """The flags and the auditors' verdicts on them."""

    async def flag(self, flag_id: str) -> FlagRecord | None:
        row = await self.db.read(lambda c: c.execute("SELECT * FROM flags WHERE id = ?", (flag_id,)).fetchone())
        return None if row is None else flag_record(row)

    async def decide_flag(self, flag_id: str, *, status: str, note: str, auditor: str, now: float,
                          reputation: tuple[str, Reputation] | None,
                          moot_note: str | None) -> FlagRecord | None:
        rep_row = _reputation_row(*reputation) if reputation is not None else None

        def write(conn: sqlite3.Connection) -> FlagRecord | None:
            cur = conn.execute(
                "UPDATE flags SET status = ?, verdict_note = ?, auditor = ?, decided_at = ?"
                " WHERE id = ? AND status = 'open'", (status, note, auditor, now, flag_id))
            if cur.rowcount == 0:
                return None
            if rep_row is not None:
                conn.execute(self._reputation_sql, rep_row)
                if moot_note is not None:
                    conn.execute(
                        "UPDATE flags SET status = 'moot', verdict_note = ?, auditor = 'hub', decided_at = ?"
                        " WHERE node_id = ? AND status = 'open'", (moot_note, now, rep_row[-1]))
            return flag_record(conn.execute("SELECT * FROM flags WHERE id = ?", (flag_id,)).fetchone())

        return await self.db.write(write)

    async def suspension(self, node_id: str) -> str | None:
        return await self.db.read(lambda c: _suspensions(c, node_id).get(node_id))

    async def runs_before_flags(self, update_ids: Sequence[str]) -> dict[str, tuple[str, int]]:
        def read(conn: sqlite3.Connection) -> dict[str, tuple[str, int]]:
            out: dict[str, tuple[str, int]] = {}
            for uid in update_ids:
                row = conn.execute("SELECT node_id, run_before FROM flags WHERE update_id = ?"
                                   " AND reason = 'replica_mismatch' AND run_before IS NOT NULL"
                                   " ORDER BY created_at DESC, id DESC", (uid,)).fetchone()
                if row is not None:
                    out[uid] = (str(row["node_id"]), int(row["run_before"]))
            return out

        return await self.db.read(read)


class SqlStore(SqlNodes, SqlJobs, SqlSilos, SqlAssignments, SqlStateRequests, SqlFlags, SqlRollbacks,
               SqlPipelines, Store):
    """Every `Store` method as SQL, over a `Database` (one thread, one connection, group commit):
    one class per aggregate above, and what starts, reads and stops the store."""

    #: the database's clock as Unix seconds, in its SQL
    clock_sql = "(julianday('now') - 2440587.5) * 86400.0"
    #: what the connection raises on a broken UNIQUE constraint
    integrity_errors: tuple[type[Exception], ...] = (sqlite3.IntegrityError,)

    def __init__(self, db: Database) -> None:
        self.db = db
        self._reputation_sql = reputation_sql(self.clock_sql)

    # -- start -------------------------------------------------------------------------------
    async def load(self) -> LoadedState:
        def read(conn: sqlite3.Connection) -> LoadedState:
            nodes = [_node(r) for r in conn.execute("SELECT * FROM nodes").fetchall()]
            suspended = _suspensions(conn)
            for n in nodes:
                n.suspended = suspended.get(n.id)
            jobs, broken = _load_jobs(conn)
            lifts = [CooldownLift(r["address"], r["lifted_at"], r["lifted_by"], r["note"])
                     for r in conn.execute("SELECT * FROM cooldown_lifts ORDER BY lifted_at").fetchall()]
            return LoadedState(nodes, jobs, broken, lifts)

        return await self.db.read(read)

    def first_admin_token_sync(self) -> str:
        def first_admin(conn: sqlite3.Connection) -> str:
            if conn.execute("SELECT COUNT(*) FROM tokens WHERE role = 'admin'").fetchone()[0]:
                return ""
            return insert_token(conn, "admin", "admin")

        return self.db.write_sync(first_admin)

    # -- the read side -----------------------------------------------------------------------
    async def query(self, fn: Callable[[Any], T]) -> T:
        return await self.db.read(fn)

    async def ping(self) -> None:
        await self.db.read(lambda c: c.execute("SELECT 1").fetchone())

    def close(self) -> None:
        self.db.close()


class SqliteStore(SqlStore):
    """The `Store` on the hub's SQLite file (hub/storage/db.py)."""


# -- loading ----------------------------------------------------------------------------------


def _compute(text: str) -> ComputeClass:
    """A stored compute class; a row from before schema v3 (or unreadable) is the unknown class."""
    try:
        return nested_from_dict(ComputeClass, json.loads(text))
    except (ValueError, ProtocolError):
        return UNKNOWN_CLASS


def _max_memory(device: str) -> int:
    """The memory a node offers a pipeline stage, kept in its device JSON (0: it did not say)."""
    facts = json.loads(device)
    value = facts.get("max_memory_bytes", 0) if isinstance(facts, dict) else 0
    return value if isinstance(value, int) and value >= 0 else 0


def _stage_address(device: str) -> str:
    """Where a node accepts other stages' tensors, kept in its device JSON ("": relay only)."""
    facts = json.loads(device)
    value = facts.get("stage_address", "") if isinstance(facts, dict) else ""
    return value if isinstance(value, str) else ""


def _node(r: sqlite3.Row) -> NodeState:
    bench = json.loads(r["benchmark"])
    sps = bench.get("precision_sps") if isinstance(bench, dict) else None
    return NodeState(
        compute=_compute(r["compute_class"]),
        precision_sps={k: float(v) for k, v in sps.items() if isinstance(v, int | float)}
        if isinstance(sps, dict) else {},
        id=r["id"], public_key=bytes(r["public_key"]), bench_sps=r["bench_sps"], ema_sps=r["ema_sps"],
        last_seen=r["last_seen"], updates_accepted=r["updates_accepted"],
        peak_flops=peak_flops(json.loads(r["benchmark"])),
        registered_at=r["registered_at"], block=r["address_block"], last_block=r["last_block"] or r["address_block"],
        operator=r["operator"], banned_at=r["banned_at"], max_memory_bytes=_max_memory(r["device"]),
        stage_address=_stage_address(r["device"]),
        reputation=Reputation(
            consecutive_agreements=r["consecutive_agreements"], agreements_total=r["agreements_total"],
            flags_total=r["flags_total"], confirmed_flags=r["confirmed_flags"],
            dismissed_flags=r["dismissed_flags"], banned=bool(r["banned"])),
    )


def _load_jobs(conn: sqlite3.Connection) -> tuple[list[JobState], list[tuple[str, str]]]:
    """Rebuild every active job's round. Returns the jobs and (job_id, reason) for rows that
    could not be loaded."""
    jobs: list[JobState] = []
    broken: list[tuple[str, str]] = []
    for row in conn.execute(
        "SELECT * FROM jobs WHERE state IN ('queued', 'running') ORDER BY created_at"
    ).fetchall():
        try:
            spec = parse_job_spec(row["spec_toml"])
        except ProtocolError as exc:
            broken.append((row["id"], str(exc)))
            continue
        jobs.append(_load_job(conn, row, spec))
    return jobs, broken


def _load_job(conn: sqlite3.Connection, row: sqlite3.Row, spec: JobSpec) -> JobState:
    """A job's row, its chunks, its recent models and its open round's shards."""
    chunks = [
        ChunkInfo(r["idx"], r["sha"], r["samples"], r["size"], r["owner_node"])
        for r in conn.execute(
            "SELECT idx, sha, samples, size, owner_node FROM chunks WHERE job_id = ? ORDER BY idx", (row["id"],)
        )
    ]
    job = JobState(
        id=row["id"], owner=row["owner"], name=row["name"], spec=spec, state=row["state"],
        round=row["round"], rounds=row["rounds"], model_hash=row["model_hash"],
        model_size=row["model_size"], chunks=chunks, val_sha=row["val_sha"],
        opt_state_sha=row["opt_state_sha"], created_at=row["created_at"],
    )
    for m in conn.execute("SELECT version, sha FROM models WHERE job_id = ? AND version >= ? ORDER BY version",
                          (job.id, job.round - spec.verification.trend_rounds)):
        job.note_model(m["version"], m["sha"])
    job.note_model(job.round, job.model_hash)
    job.open_round()
    by_idx = {c.idx: c for c in chunks}
    for s in conn.execute(
        "SELECT * FROM shards WHERE job_id = ? AND round = ? ORDER BY seq", (job.id, job.round)
    ):
        job.next_seq = max(job.next_seq, s["seq"] + 1)
        if s["state"] == "dropped":
            continue
        shard = _load_shard(conn, job, s, by_idx)
        if shard.state == "settled" and shard.representative is None:
            shard.state = "dropped"  # nothing usable; its chunks go back to the pool
            continue
        job.shards[shard.id] = shard
        if shard.wanted > 1 and shard.state == "open":
            job.replicated[shard.id] = shard
        job.take(shard.chunk_idxs)
    return job


def _load_shard(conn: sqlite3.Connection, job: JobState, s: sqlite3.Row, by_idx: dict[int, ChunkInfo]) -> ShardState:
    """A shard of the job's open round, with its holders, live assignments and usable updates."""
    idxs = tuple(
        r["chunk_idx"]
        for r in conn.execute(
            "SELECT chunk_idx FROM shard_chunks WHERE shard_id = ? ORDER BY pos", (s["id"],)
        )
    )
    shard = ShardState(
        id=s["id"], job_id=job.id, round=job.round, seq=s["seq"], seed=s["seed"],
        chunk_idxs=idxs, samples=s["samples"], replica_group=s["replica_group"],
        wanted=s["wanted"], state=s["state"], first_update_at=s["first_update_at"],
    )
    if s["state"] == "settled":
        unverified = json.loads(s["outcome"] or "{}").get("unverified")
        shard.unverified = str(unverified) if unverified else None
    for a in conn.execute("SELECT * FROM assignments WHERE shard_id = ?", (shard.id,)):
        shard.nodes.add(a["node_id"])
        if a["state"] == "live":
            shard.live[a["id"]] = AssignmentState(
                id=a["id"], shard_id=shard.id, job_id=job.id, round=job.round,
                node_id=a["node_id"], issued_at=a["issued_at"], expected_s=a["expected_s"],
                deadline=a["deadline"], sealed=bytes(a["sealed"]), model_hash=job.model_hash,
                chunk_shas=frozenset(by_idx[i].sha for i in idxs),
            )
    for u in conn.execute(
        "SELECT u.*, a.issued_at FROM updates u JOIN assignments a ON a.id = u.assignment_id"
        " WHERE u.shard_id = ? AND u.status IN ('accepted', 'redundant') ORDER BY u.received_at, u.id",
        (shard.id,),
    ):
        upd = UpdateState(
            id=u["id"], assignment_id=u["assignment_id"], shard_id=shard.id,
            node_id=u["node_id"], sha=u["sha"], size=u["size"],
            sample_count=u["sample_count"], loss=u["loss"], train_s=u["train_s"],
            received_at=u["received_at"], status=u["status"],
            elapsed_s=u["received_at"] - u["issued_at"],
            commitment=commitment_from_json(u["commitment"]),
        )
        shard.accepted.append(upd)
        if upd.status == "accepted" and shard.state == "settled":
            shard.representative = upd.id
    return shard
