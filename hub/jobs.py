"""Jobs: submission ingest (validate, chunk, store) and the in-memory picture of a job's round.

The database is the truth; `JobState` is the event loop's working copy, rebuilt
from the database on start (`load_jobs`), mutated only on the loop.
"""

from __future__ import annotations

import hashlib
import secrets
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.jobspec import JobSpec, parse_job_spec
from gpuflex.protocol.modelspec import build_model
from gpuflex.protocol.tensors import encode_state

from .blobs import BlobStore
from .dataset import encode_arrays, make_chunks, read_arrays, split_validation, validate_arrays
from .db import Database
from .errors import Unprocessable

ACTIVE_STATES = ("queued", "running")


@dataclass(frozen=True)
class ChunkInfo:
    idx: int
    sha: str
    samples: int
    size: int


@dataclass
class UpdateState:
    id: str
    assignment_id: str
    shard_id: str
    node_id: str
    sha: str
    size: int
    sample_count: int
    loss: float
    train_s: float
    received_at: float
    status: str = "accepted"  # accepted|redundant|quarantined|included|excluded
    elapsed_s: float | None = None  # hub-observed: upload time - assignment issue time


@dataclass
class AssignmentState:
    id: str
    shard_id: str
    job_id: str
    round: int
    node_id: str
    issued_at: float
    expected_s: float
    deadline: float
    sealed: bytes
    model_sha: str
    chunk_shas: frozenset[str]
    uploading: bool = False


@dataclass
class ShardState:
    id: str
    job_id: str
    round: int
    seq: int
    seed: int
    chunk_idxs: tuple[int, ...]
    samples: int
    replica_group: str
    wanted: int
    state: str = "open"  # open|settled|dropped
    first_update_at: float | None = None
    live: dict[str, AssignmentState] = field(default_factory=dict)
    nodes: set[str] = field(default_factory=set)
    accepted: list[UpdateState] = field(default_factory=list)
    representative: str | None = None

    def replicas_needed(self) -> int:
        return self.wanted - len(self.live) - len(self.accepted)


@dataclass
class JobState:
    id: str
    owner: str
    name: str
    spec: JobSpec
    state: str
    round: int
    rounds: int
    model_sha: str
    model_size: int
    chunks: list[ChunkInfo]
    val_sha: str | None
    opt_state_sha: str | None
    created_at: float
    shards: dict[str, ShardState] = field(default_factory=dict)
    free: set[int] = field(default_factory=set)  # chunk idxs no live/settled shard holds
    next_seq: int = 0
    closing: bool = False
    live_n: int = 0  # live assignments of this job (kept by Scheduler.attach/detach)
    replicated: dict[str, ShardState] = field(default_factory=dict)  # open shards that want > 1 replica
    cursor: int = 0  # every chunk index below it is taken (amortised O(1) carving)
    by_sha: dict[str, int] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    def live_count(self) -> int:
        return self.live_n

    def release(self, idxs: tuple[int, ...] | list[int]) -> None:
        """Chunks go back to the round's pool."""
        self.free.update(idxs)
        if idxs:
            self.cursor = min(self.cursor, min(idxs))

    def covered_chunks(self) -> int:
        return sum(len(s.chunk_idxs) for s in self.shards.values() if s.state == "settled")

    def round_complete(self) -> bool:
        return (
            not self.free
            and all(s.state != "open" for s in self.shards.values())
            and any(s.state == "settled" for s in self.shards.values())
        )

    def open_round(self) -> None:
        self.shards = {}
        self.replicated = {}
        self.free = {c.idx for c in self.chunks}
        self.cursor = 0
        self.next_seq = 0
        if len(self.by_sha) != len(self.chunks):
            self.by_sha = {c.sha: c.idx for c in self.chunks}


def shard_seed(job_seed: int, round_: int, seq: int) -> int:
    """Pure function of (job seed, round, shard index): a restarted hub reproduces it."""
    digest = hashlib.sha256(f"gpuflex-shard:{job_seed}:{round_}:{seq}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(8)}"


# -- submission -------------------------------------------------------------------------------


def ingest_job(
    db: Database,
    blobs: BlobStore,
    *,
    owner: str,
    spec_text: bytes,
    train_path: Path,
    val_path: Path | None,
) -> JobState:
    """Validate a submission and store it (blobs, then rows). Runs in a worker thread."""
    try:
        spec = parse_job_spec(spec_text)
    except ProtocolError as exc:
        raise Unprocessable(str(exc), code="bad_spec") from None
    mspec = spec.model
    dspec = spec.data
    stratified = dspec.split == "stratified" and mspec.task == "classification"
    x, y = read_arrays(train_path, label_column=dspec.label_column, what="train")
    train = validate_arrays(x, y, mspec, what="train")
    if val_path is not None:
        vx, vy = read_arrays(val_path, label_column=dspec.label_column, what="val")
        val = validate_arrays(vx, vy, mspec, what="val")
    else:
        train, val = split_validation(
            train, dspec.validation_fraction, stratified=stratified, seed=spec.train.seed
        )
    pieces = make_chunks(train, dspec.chunk_size, stratified=stratified, seed=spec.train.seed)
    chunks: list[ChunkInfo] = []
    for idx, (data, samples) in enumerate(pieces):
        sha = blobs.put(data)
        chunks.append(ChunkInfo(idx, sha, samples, len(data)))
    val_sha = blobs.put(encode_arrays(val)) if val is not None else None
    try:
        model = build_model(mspec, seed=spec.train.seed)
    except ProtocolError as exc:
        raise Unprocessable(str(exc), code="bad_spec") from None
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    model_blob = encode_state(state)
    model_sha = blobs.put(model_blob)
    now = time.time()
    job = JobState(
        id=new_id("j"),
        owner=owner,
        name=spec.name,
        spec=spec,
        state="running",
        round=0,
        rounds=spec.train.rounds,
        model_sha=model_sha,
        model_size=len(model_blob),
        chunks=chunks,
        val_sha=val_sha,
        opt_state_sha=None,
        created_at=now,
    )
    job.open_round()
    text = spec_text.decode("utf-8")

    def write(conn: sqlite3.Connection) -> None:
        conn.execute(
            "INSERT INTO jobs (id, owner, name, spec_toml, state, round, rounds, model_sha, model_size,"
            " val_sha, train_samples, val_samples, created_at, updated_at)"
            " VALUES (?, ?, ?, ?, ?, 0, ?, ?, ?, ?, ?, ?, ?, ?)",
            (job.id, owner, job.name, text, job.state, job.rounds, model_sha, job.model_size,
             val_sha, len(train), len(val) if val is not None else 0, now, now),
        )
        conn.executemany(
            "INSERT INTO chunks (job_id, idx, sha, samples, size) VALUES (?, ?, ?, ?, ?)",
            [(job.id, c.idx, c.sha, c.samples, c.size) for c in chunks],
        )
        conn.execute("INSERT INTO models (job_id, version, sha, created_at) VALUES (?, 0, ?, ?)",
                     (job.id, model_sha, now))
        conn.execute("INSERT INTO rounds (job_id, round, model_sha, opened_at) VALUES (?, 0, ?, ?)",
                     (job.id, model_sha, now))

    db.write_sync(write)
    return job


# -- restart --------------------------------------------------------------------------------


def load_jobs(conn: sqlite3.Connection) -> tuple[list[JobState], list[tuple[str, str]]]:
    """Rebuild every active job's round from the database.

    Returns the jobs and (job_id, reason) for rows that could not be loaded.
    """
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
        chunks = [
            ChunkInfo(r["idx"], r["sha"], r["samples"], r["size"])
            for r in conn.execute(
                "SELECT idx, sha, samples, size FROM chunks WHERE job_id = ? ORDER BY idx", (row["id"],)
            )
        ]
        job = JobState(
            id=row["id"], owner=row["owner"], name=row["name"], spec=spec, state=row["state"],
            round=row["round"], rounds=row["rounds"], model_sha=row["model_sha"],
            model_size=row["model_size"], chunks=chunks, val_sha=row["val_sha"],
            opt_state_sha=row["opt_state_sha"], created_at=row["created_at"],
        )
        job.open_round()
        by_idx = {c.idx: c for c in chunks}
        for s in conn.execute(
            "SELECT * FROM shards WHERE job_id = ? AND round = ? ORDER BY seq", (job.id, job.round)
        ):
            job.next_seq = max(job.next_seq, s["seq"] + 1)
            if s["state"] == "dropped":
                continue
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
            for a in conn.execute("SELECT * FROM assignments WHERE shard_id = ?", (shard.id,)):
                shard.nodes.add(a["node_id"])
                if a["state"] == "live":
                    shard.live[a["id"]] = AssignmentState(
                        id=a["id"], shard_id=shard.id, job_id=job.id, round=job.round,
                        node_id=a["node_id"], issued_at=a["issued_at"], expected_s=a["expected_s"],
                        deadline=a["deadline"], sealed=bytes(a["sealed"]), model_sha=job.model_sha,
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
                )
                shard.accepted.append(upd)
                if upd.status == "accepted" and shard.state == "settled":
                    shard.representative = upd.id
            if shard.state == "settled" and shard.representative is None:
                shard.state = "dropped"  # nothing usable; its chunks go back to the pool
                continue
            job.shards[shard.id] = shard
            if shard.wanted > 1 and shard.state == "open":
                job.replicated[shard.id] = shard
            job.free.difference_update(idxs)
        jobs.append(job)
    return jobs, broken
