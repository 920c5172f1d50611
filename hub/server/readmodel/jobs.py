"""Jobs as they are shown: the API's list and status document (GET /v1/jobs, /v1/jobs/{id}), the
console's list, job page and an auditor's review of a job."""

from __future__ import annotations

import json
import math
import re
import sqlite3
import time
from typing import Any

from aiohttp import web
from gpuflex.protocol.jobspec import JobSpec

from ...domain.waits import round_waits
from ...policy.privacy import epsilon
from ...storage.tokens import Principal
from ..appkeys import LEDGER, STORE
from . import flags, pipelines, rollbacks, rounds
from .access import any_job_row, job_row, spec_of, visible
from .redaction import owner_view

#: the line the hub writes into a stored spec when it held out the validation set (hub/policy/datadefaults.py)
HELD_BY_HUB = re.compile(r"^validation_fraction = [0-9.]+  # set by the hub: no val file", re.M)


def jobs_list(conn: sqlite3.Connection, who: Principal) -> list[dict[str, Any]]:
    where, args = visible(who)
    rows = conn.execute(
        f"SELECT id, name, owner, state, round, rounds, model_hash, created_at, updated_at, error"  # noqa: S608
        f" FROM jobs WHERE {where} ORDER BY created_at",
        args,
    ).fetchall()
    return [dict(r) | {"model_hash": r["model_hash"]} for r in rows]


async def jobs_overview(
    app: web.Application, who: Principal, limit: int = 500
) -> list[dict[str, Any]]:
    """The console's list: the jobs ``who`` may read (access.visible), newest first, each with its
    closed rounds and latest metrics."""
    where, args = visible(who)

    def q(conn: sqlite3.Connection) -> list[dict[str, Any]]:
        rows = conn.execute(
            f"SELECT * FROM jobs WHERE {where} ORDER BY created_at DESC LIMIT ?",  # noqa: S608 - a fixed fragment
            (*args, limit),
        ).fetchall()
        return [
            {
                "id": r["id"],
                "name": r["name"],
                "owner": r["owner"],
                "state": r["state"],
                "round": r["round"],
                "rounds": r["rounds"],
                "closed": rounds.closed_rounds(conn, r["id"]),
                "updated_at": r["updated_at"],
                **_pipeline_progress(conn, r),
            }
            | rounds.latest_metrics(conn, r["id"])
            for r in rows
        ]

    return await app[STORE].query(q)


def _pipeline_progress(conn: sqlite3.Connection, row: sqlite3.Row) -> dict[str, Any]:
    """A pipelined job's committed step against its steps (the list's progress), {} for others."""
    if "[pipeline]" not in row["spec_toml"]:  # most jobs: no spec to parse
        return {}
    spec = spec_of(row)
    if spec is None or spec.pipeline is None:
        return {}
    return {
        "pipeline": {
            "committed_step": pipelines.committed_step(conn, row["id"]),
            "steps": spec.pipeline.steps,
        }
    }


def job_status(conn: sqlite3.Connection, row: sqlite3.Row, spec: JobSpec | None) -> dict[str, Any]:
    """The status document: state, progress and one history entry per closed round. ``spec``: the
    job's spec as stored (``spec_of(row)``; the caller parses it once)."""
    job_id = row["id"]
    chunk_samples, chunk_count, chunk_max = conn.execute(
        "SELECT COALESCE(SUM(samples), 0), COUNT(*), COALESCE(MAX(samples), 0) FROM chunks WHERE job_id = ?",
        (job_id,),
    ).fetchone()
    silos = _silos(conn, job_id)
    history = rounds.history(conn, row, 0 if silos else chunk_samples)
    return {
        "id": job_id,
        "name": row["name"],
        "owner": row["owner"],
        "state": row["state"],
        "round": row["round"],
        "rounds": row["rounds"],
        "model_hash": row["model_hash"],
        "train_samples": row["train_samples"],
        "val_samples": row["val_samples"],
        "error": row["error"],
        "created_at": row["created_at"],
        "updated_at": row["updated_at"],
        "history": history,
        "data_source": "hub" if spec is None else spec.data.source,
        "data": _data_summary(spec, row, int(chunk_count), int(chunk_max)),
        # node-local data: the silos attached (what the hub knows of each: never a row)
        **({"silos": silos} if silos or (spec is not None and spec.data.node_local) else {}),
        "parallel": rounds.job_parallelism(history),
        # suspended or banned nodes whose unverified updates are in the model (a rollback undoes them)
        "unverified_work": rollbacks.unverified_work(conn, job_id, history),
        **(
            {"privacy": dp}
            if spec is not None and (dp := _privacy(spec, len(history))) is not None
            else {}
        ),
        **(
            {"pipeline": pipelines.pipeline_doc(conn, job_id, spec)}
            if spec is not None and spec.pipeline is not None
            else {}
        ),
    }


def _silos(conn: sqlite3.Connection, job_id: str) -> list[dict[str, Any]]:
    """A node-local job's silos attached, in chunk order ([] for a hub job)."""
    return [
        {
            "node_id": c["owner_node"],
            "samples": c["samples"],
            "blob": c["sha"],
            "size": c["size"],
            "label_histogram": None if c["histogram"] is None else json.loads(c["histogram"]),
            "attached_at": c["registered_at"],
        }
        for c in conn.execute(
            "SELECT owner_node, samples, sha, size, histogram, registered_at FROM chunks"
            " WHERE job_id = ? AND owner_node IS NOT NULL ORDER BY idx",
            (job_id,),
        )
    ]


def _data_summary(
    spec: JobSpec | None, row: sqlite3.Row, chunks: int, chunk_max: int
) -> dict[str, Any]:
    """How the job's data was cut: its chunks (a hub job's) and where its validation set came
    from, in words (with what to do when there is none: no round then reports accuracy)."""
    val_samples = int(row["val_samples"])
    fraction = None if spec is None else spec.data.validation_fraction
    node_local = spec is not None and spec.data.node_local
    if val_samples and fraction and HELD_BY_HUB.search(row["spec_toml"]):
        words = (
            f"{val_samples} samples held out of the training set ({fraction:.0%}, the hub's default without"
            " a validation file); [data] validation_fraction = 0 turns the hold-out off"
        )
    elif (
        val_samples and fraction
    ):  # the spec's own fraction: a validation file, when given, is used instead
        words = (
            f"{val_samples} samples: the validation file given with the job, or else held out of the"
            f" training set (validation_fraction = {fraction:g})"
        )
    elif val_samples:
        words = f"{val_samples} samples from the validation file given with the job"
    else:
        words = (
            "none, so no round reports loss or accuracy on held-out data: give a validation file (--val)"
            + ("" if node_local else " or set [data] validation_fraction")
        )
    return {
        "validation_samples": val_samples,
        "validation": words,
        **({} if node_local else {"chunks": chunks, "chunk_size": chunk_max}),
    }


def idle_note(online: int, pool_chunks: int, chunk_size: int) -> str | None:
    """Why nodes online get no shard of a hub job's round, in words: a shard is at least one
    chunk, so a round of fewer chunks than nodes online leaves the rest without one (None when
    it does not)."""
    if online <= pool_chunks:
        return None
    return (
        f"{online} nodes are online but a round has {pool_chunks} chunks of up to {chunk_size} samples;"
        f" a shard is at least one chunk, so {online - pool_chunks} of them get no shard of this job to train"
        " (at most a replica to check): a smaller [data] chunk_size spreads a round over more nodes"
    )


def _privacy(spec: JobSpec, closed: int) -> dict[str, Any] | None:
    """[privacy] dp = "central": the mechanism and the job's (ε, δ) after its closed rounds and at
    its last (hub/policy/privacy.py's accountant); None when the job has no differential privacy. An ε
    with no finite bound (noise_multiplier 0) is null."""
    dp = spec.privacy
    if not dp.central:
        return None

    def finite(eps: float) -> float | None:
        return eps if math.isfinite(eps) else None

    return {
        "mechanism": "central gaussian, fixed clipping",
        "clip_norm": dp.clip_norm,
        "noise_multiplier": dp.noise_multiplier,
        "delta": dp.delta,
        "rounds": closed,
        "epsilon": finite(epsilon(closed, dp.noise_multiplier, dp.delta)),
        "epsilon_at_end": finite(epsilon(spec.train.rounds, dp.noise_multiplier, dp.delta)),
    }


async def job_document(app: web.Application, who: Principal, job_id: str) -> dict[str, Any]:
    """GET /v1/jobs/{id}: the stored status, with the live round's progress and any error the
    hub could not store yet (a failing store)."""
    doc, spec = await app[STORE].query(lambda c: _status_and_spec(c, job_row(c, who, job_id)))
    doc = owner_view(doc, spec, who)
    live = app[LEDGER].scheduler.jobs.get(job_id)
    if live is not None and live.error and not doc.get("error"):
        doc["error"] = live.error
    if "pipeline" in doc:  # a pipelined job has no rounds: its pipeline is its progress
        pipelines.live(doc["pipeline"], app[LEDGER].pipelines, job_id)
        return doc
    if live is not None:
        if live.active:
            online = 0 if live.node_local else app[LEDGER].scheduler.presence.online_nodes(time.time())
            doc["progress"] = {
                "chunks_total": len(live.chunks),
                "chunks_covered": live.covered_chunks(),
                "chunks_free": len(live.free),
                "assignments_live": live.live_count(),
                "idle": idle_note(online, live.pool_chunks, int(doc["data"].get("chunk_size", 0))),
            }
    waiting = live_waits(app, who, job_id)
    if waiting is not None:
        doc["waiting"] = waiting
    return doc


def live_waits(app: web.Application, who: Principal, job_id: str) -> list[str] | None:
    """Why the job's open round waits, in words (hub/domain/waits.py); None when no round is open. The
    owner of a job under central differential privacy is told "a node", never which one."""
    scheduler = app[LEDGER].scheduler
    live = scheduler.jobs.get(job_id)
    if live is None or not live.active:
        return None
    names = not (who.role == "owner" and live.spec.privacy.central)
    return round_waits(scheduler, live, time.time(), names=names)


def _status_and_spec(
    conn: sqlite3.Connection, row: sqlite3.Row
) -> tuple[dict[str, Any], JobSpec | None]:
    spec = spec_of(row)
    return job_status(conn, row, spec), spec


def job_extras(
    conn: sqlite3.Connection,
    job_id: str,
    state: str,
    current_round: int,
    shard_round: int | None = None,
) -> dict[str, Any]:
    """What the console shows beside the job status: latest metrics, chunk count, closed rounds,
    the shard map of one round (rounds.shard_map) and the job's flags, newest first.

    The caller has already checked visibility (access.job_row)."""
    out: dict[str, Any] = dict(rounds.latest_metrics(conn, job_id))
    out["chunks"] = conn.execute(
        "SELECT COUNT(*) FROM chunks WHERE job_id = ?", (job_id,)
    ).fetchone()[0]
    out["closed"] = rounds.closed_rounds(conn, job_id)
    out.update(rounds.shard_map(conn, job_id, state, current_round, shard_round))
    out["flags"] = flags.job_flags(conn, job_id)
    return out


async def job_view(
    app: web.Application, who: Principal, job_id: str, shard_round: int | None = None
) -> dict[str, Any]:
    """The console's job page: the API's job status document (same visibility, history,
    redaction, waits) under "doc", plus job_extras."""

    def q(conn: sqlite3.Connection) -> dict[str, Any]:
        row = job_row(conn, who, job_id)
        spec = spec_of(row)
        doc = job_status(conn, row, spec)
        extras = job_extras(conn, job_id, row["state"], int(row["round"]), shard_round)
        # the owner of a job with a [privacy] option sees what that option leaves it (redaction.owner_view)
        seen = owner_view(doc, spec, who, extras)
        return {"doc": {k: v for k, v in seen.items() if k != "extras"}, **seen["extras"]}

    view = await app[STORE].query(q)
    if "pipeline" in view["doc"]:  # the same live part as GET /v1/jobs/{id}'s
        pipelines.live(view["doc"]["pipeline"], app[LEDGER].pipelines, job_id)
    waiting = live_waits(app, who, job_id)
    if waiting is not None:
        view["doc"]["waiting"] = waiting
    return view


# What an auditor sees of a job and of each closed round: how the rounds went and who took part,
# not the owner, the data, the model's metrics or the models themselves.
REVIEW_JOB_FIELDS = (
    "id",
    "name",
    "state",
    "round",
    "rounds",
    "created_at",
    "updated_at",
    "history",
    "unverified_work",
)
REVIEW_ROUND_FIELDS = (
    "round",
    "opened_at",
    "closed_at",
    "rolled_back",
    "restored_from",
    "updates",
    "flags",
    "unverified",
    "replica_comparison",
    "replication_overhead",
    "shards",
    "node_shares",
    "parallel",
)
REVIEW_UPDATE_FIELDS = ("update_id", "node_id", "status", "verified", "verified_by", "replica_group", "chunks")


def review_doc(doc: dict[str, Any]) -> dict[str, Any]:
    """An auditor's part of a job's status document (job_status)."""
    out = {k: doc[k] for k in REVIEW_JOB_FIELDS if k in doc}
    if "pipeline" in doc:  # its stages, nodes and timings; its losses are the owner's (job_review)
        out["pipeline"] = doc["pipeline"]
    out["history"] = [
        {k: h[k] for k in REVIEW_ROUND_FIELDS if k in h}
        | {"updates": [{k: u.get(k) for k in REVIEW_UPDATE_FIELDS} for u in h.get("updates", [])]}
        for h in doc.get("history", [])
    ]
    return out


async def job_review(
    app: web.Application, who: Principal, job_id: str, shard_round: int | None = None
) -> dict[str, Any]:
    """What an auditor reviews of any job (console only; the API's job routes stay the owner's and
    admins'): its state, each closed round's updates, flags and nodes' shares, the shard map and
    the job's flags (review_doc); no metric, data size, owner or model."""
    who.require("auditor")

    def q(conn: sqlite3.Connection) -> dict[str, Any]:
        row = any_job_row(conn, job_id)
        doc = job_status(conn, row, spec_of(row))
        extras = job_extras(conn, job_id, row["state"], int(row["round"]), shard_round)
        for metric in ("loss", "accuracy", "train_loss"):
            extras.pop(metric, None)
        return {"doc": review_doc(doc), **extras}

    view = await app[STORE].query(q)
    if "pipeline" in view["doc"]:
        pipelines.live(view["doc"]["pipeline"], app[LEDGER].pipelines, job_id)
        pipelines.drop_losses(view["doc"]["pipeline"])
    return view
