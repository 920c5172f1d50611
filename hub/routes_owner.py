"""Owner-facing JSON routes (bearer token): submit, list, status, download, cancel.

Who reads what: a job, its status and its models are its owner's and an admin's. An
auditor judges the evidence (flags with their evidence, the audit log, the nodes: see
routes_audit), never an owner's jobs, data or models: `require_job_reader` refuses it.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError
from gpuflex.protocol.tensors import decode_state, state_to_safetensors

from .appkeys import BLOBS, CONFIG, DB, METRICS, ROUNDS, SCHEDULER, SIGNAL
from .errors import BadRequest, Forbidden, NotFound, PayloadTooLarge, Unprocessable
from .httplog import one_line
from .jobs import ingest_job
from .tokens import Principal
from .wire import json_response, principal

routes = web.RouteTableDef()


async def _save_part(part: BodyPartReader, dest: Path, limit: int) -> int:
    size = 0
    with open(dest, "wb") as fh:  # noqa: ASYNC230 - page-cache writes; ingest runs in a thread
        while True:
            chunk = await part.read_chunk(1 << 20)
            if not chunk:
                break
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"part {part.name!r} exceeds the {limit}-byte limit")
            fh.write(chunk)
    return size


@routes.post("/v1/jobs")
async def submit_job(request: web.Request) -> web.Response:
    who = await principal(request)
    who.require("owner")
    app = request.app
    cfg = app[CONFIG]
    total_limit = 2 * cfg.max_dataset_bytes + cfg.max_spec_bytes + (1 << 20)
    if request.content_length is not None and request.content_length > total_limit:
        raise PayloadTooLarge(f"submission of {request.content_length} bytes exceeds {total_limit}")
    if not request.content_type.startswith("multipart/"):
        raise BadRequest("submit a job as multipart/form-data with parts spec, train and optional val",
                         code="bad_form")
    blobs = app[BLOBS]
    paths: dict[str, Path] = {}
    spec_text: bytes | None = None
    try:
        try:
            reader = await request.multipart()
            while True:
                part = await reader.next()
                if part is None:
                    break
                if not isinstance(part, BodyPartReader):
                    raise BadRequest("nested multipart is not accepted", code="bad_form")
                name = part.name
                if name == "spec":
                    if spec_text is not None:
                        raise BadRequest("part 'spec' given twice", code="bad_form")
                    spec_text = await part.read()  # read() enforces no limit: check below
                    if len(spec_text) > cfg.max_spec_bytes:
                        raise PayloadTooLarge(f"spec exceeds {cfg.max_spec_bytes} bytes")
                elif name in ("train", "val"):
                    if name in paths:
                        raise BadRequest(f"part {name!r} given twice", code="bad_form")
                    paths[name] = blobs.temp_path()
                    await _save_part(part, paths[name], cfg.max_dataset_bytes)
                else:
                    raise BadRequest(f"unknown part {name!r}; expected spec, train, val", code="bad_form")
        except (ValueError, HttpProcessingError) as exc:  # aiohttp's multipart parser on malformed bodies
            raise BadRequest(f"malformed multipart body: {one_line(str(exc))}", code="bad_form") from None
        if spec_text is None or "train" not in paths:
            raise BadRequest("a job needs the parts 'spec' (TOML) and 'train' (.npz or .csv)", code="bad_form")
        app[METRICS].bytes_in += len(spec_text) + sum(p.stat().st_size for p in paths.values())
        job = await asyncio.to_thread(
            ingest_job, app[DB], blobs, owner=who.name, spec_text=spec_text, train_path=paths["train"],
            val_path=paths.get("val"),
        )
    except UnicodeDecodeError:
        raise Unprocessable("spec is not UTF-8 text", code="bad_spec") from None
    finally:
        for p in paths.values():
            p.unlink(missing_ok=True)
    app[SCHEDULER].add_job(job)
    app[SIGNAL].notify()
    return json_response({"id": job.id, "name": job.name, "state": job.state, "rounds": job.rounds,
                          "chunks": len(job.chunks), "model_hash": job.model_sha}, status=201)


def require_job_reader(who: Principal) -> None:
    """Jobs and models are read by their owner and by admins; an auditor's token is for the
    evidence (flags, audit log, nodes), not for an owner's jobs or models."""
    if who.role not in ("owner", "admin"):
        raise Forbidden("jobs and models are read with an owner or admin token; an auditor token reads "
                        "flags, the audit log and nodes", code="wrong_role")


def visible(who: Principal) -> tuple[str, tuple[Any, ...]]:
    if who.role in ("admin", "auditor"):
        return "1 = 1", ()
    return "owner = ?", (who.name,)


def job_row(conn: sqlite3.Connection, who: Principal, job_id: str) -> sqlite3.Row:
    where, args = visible(who)
    row = conn.execute(f"SELECT * FROM jobs WHERE id = ? AND {where}", (job_id, *args)).fetchone()  # noqa: S608
    if row is None:
        raise NotFound(f"no job {job_id} visible to you", code="unknown_job")
    return row


@routes.get("/v1/jobs")
async def list_jobs(request: web.Request) -> web.Response:
    who = await principal(request)
    require_job_reader(who)
    where, args = visible(who)

    def read(conn: sqlite3.Connection) -> list[dict[str, Any]]:
        rows = conn.execute(
            f"SELECT id, name, owner, state, round, rounds, model_sha, created_at, updated_at, error"  # noqa: S608
            f" FROM jobs WHERE {where} ORDER BY created_at", args).fetchall()
        return [dict(r) | {"model_hash": r["model_sha"]} for r in rows]

    return json_response({"jobs": await request.app[DB].read(read)})


def job_status(conn: sqlite3.Connection, row: sqlite3.Row) -> dict[str, Any]:
    """The status document: state, progress and one history entry per closed round."""
    job_id = row["id"]
    history: list[dict[str, Any]] = []
    rounds = conn.execute("SELECT * FROM rounds WHERE job_id = ? ORDER BY round", (job_id,)).fetchall()
    chunk_samples = conn.execute("SELECT COALESCE(SUM(samples), 0) FROM chunks WHERE job_id = ?",
                                 (job_id,)).fetchone()[0]
    for r in rounds:
        if r["closed_at"] is None:
            continue
        ups = conn.execute(
            "SELECT u.id, u.node_id, u.status, u.sample_count, u.loss, s.samples, s.replica_group,"
            " (SELECT COUNT(*) FROM shard_chunks sc WHERE sc.shard_id = s.id) AS nchunks"
            " FROM updates u JOIN shards s ON s.id = u.shard_id WHERE u.job_id = ? AND u.round = ?"
            " ORDER BY u.received_at, u.id", (job_id, r["round"])).fetchall()
        flags = conn.execute("SELECT id, node_id, reason, status FROM flags WHERE job_id = ? AND round = ?",
                             (job_id, r["round"])).fetchall()
        trained = sum(u["samples"] for u in ups)
        history.append({
            "round": r["round"], "loss": r["loss"], "accuracy": r["accuracy"], "train_loss": r["train_loss"],
            "model_hash": r["new_model_sha"], "closed_at": r["closed_at"], "opened_at": r["opened_at"],
            "metrics": json.loads(r["metrics"] or "{}"),
            "updates": [{"update_id": u["id"], "node_id": u["node_id"], "chunks": u["nchunks"],
                         "samples": u["samples"], "loss": u["loss"], "status": u["status"],
                         "replica_group": u["replica_group"]} for u in ups],
            "flags": [{"flag_id": f["id"], "node_id": f["node_id"], "reason": f["reason"],
                       "status": f["status"]} for f in flags],
            "replication_overhead": (trained - chunk_samples) / chunk_samples if chunk_samples else 0.0,
        })
    return {
        "id": job_id, "name": row["name"], "owner": row["owner"], "state": row["state"],
        "round": row["round"], "rounds": row["rounds"], "model_hash": row["model_sha"],
        "train_samples": row["train_samples"], "val_samples": row["val_samples"],
        "error": row["error"], "created_at": row["created_at"], "updated_at": row["updated_at"],
        "history": history,
    }


@routes.get("/v1/jobs/{job_id}")
async def get_job(request: web.Request) -> web.Response:
    who = await principal(request)
    require_job_reader(who)
    job_id = request.match_info["job_id"]

    def read(conn: sqlite3.Connection) -> dict[str, Any]:
        return job_status(conn, job_row(conn, who, job_id))

    doc = await request.app[DB].read(read)
    live = request.app[SCHEDULER].jobs.get(job_id)
    if live is not None and live.active:
        doc["progress"] = {
            "chunks_total": len(live.chunks), "chunks_covered": live.covered_chunks(),
            "chunks_free": len(live.free), "assignments_live": live.live_count(),
        }
    return json_response(doc)


async def export_model(app: web.Application, who: Principal, job_id: str,
                       version: int | None = None) -> tuple[int, str, bytes]:
    """(version, model sha, .safetensors bytes) of a job's latest model or of model `version`
    (0 = initial, N = after N rounds). Same owner scoping as the API; never to an auditor."""
    require_job_reader(who)

    def read(conn: sqlite3.Connection) -> sqlite3.Row:
        job_row(conn, who, job_id)
        if version is None:
            row = conn.execute("SELECT version, sha FROM models WHERE job_id = ? ORDER BY version DESC LIMIT 1",
                               (job_id,)).fetchone()
        else:
            row = conn.execute("SELECT version, sha FROM models WHERE job_id = ? AND version = ?",
                               (job_id, version)).fetchone()
        if row is None:
            raise NotFound(f"job {job_id} has no model for round {version}", code="unknown_round")
        return row

    row = await app[DB].read(read)
    blobs = app[BLOBS]

    def export() -> bytes:
        return state_to_safetensors(decode_state(blobs.read(row["sha"])))

    return int(row["version"]), str(row["sha"]), await asyncio.to_thread(export)


@routes.get("/v1/jobs/{job_id}/model")
async def get_model(request: web.Request) -> web.StreamResponse:
    who = await principal(request)
    job_id = request.match_info["job_id"]
    version_q = request.query.get("round")
    version: int | None = None
    if version_q is not None:
        if not version_q.isdigit() or len(version_q) > 9:
            raise BadRequest("round must be a non-negative integer", code="bad_round")
        version = int(version_q)
    got, sha, data = await export_model(request.app, who, job_id, version)
    request.app[METRICS].bytes_out += len(data)
    return web.Response(body=data, content_type="application/octet-stream", headers={
        "Content-Disposition": f'attachment; filename="{job_id}-v{got}.safetensors"',
        "X-GPUFlex-Model-Version": str(got), "X-GPUFlex-Model-Hash": sha})


@routes.post("/v1/jobs/{job_id}/cancel")
async def cancel_job(request: web.Request) -> web.Response:
    who = await principal(request)
    who.require("owner")
    job_id = request.match_info["job_id"]
    row = await request.app[DB].read(lambda c: job_row(c, who, job_id))
    job = request.app[SCHEDULER].jobs.get(job_id)
    if row["state"] not in ("queued", "running"):
        return json_response({"id": job_id, "state": row["state"], "detail": "job had already ended"})
    if job is not None:
        await request.app[ROUNDS].end_job(job, "cancelled", f"cancelled by {who.name}")
    else:
        await request.app[DB].write(lambda c: c.execute(
            "UPDATE jobs SET state = 'cancelled' WHERE id = ?", (job_id,)))
    return json_response({"id": job_id, "state": "cancelled"})
