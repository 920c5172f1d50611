"""Owner-facing JSON routes (bearer token): submit, list, status, pipeline plan, download, cancel,
roll back.

Who reads what: a job, its status and its models are its owner's and an admin's. An
auditor judges the evidence (flags with their evidence, the audit log, the nodes: see
routes_audit), never an owner's jobs, data or models: `readmodel.access.require_job_reader` refuses it.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from ..base.errors import BadRequest, PayloadTooLarge, Unprocessable
from ..base.numbers import parse_count
from .appkeys import BLOBS, CONFIG, LEDGER, METRICS, STORE
from .httplog import one_line
from .readmodel import jobs, plans
from .readmodel.access import job_row
from .readmodel.models import export_model, model_file_name
from .wire import json_response, principal, read_body

routes = web.RouteTableDef()


async def _save_part(part: BodyPartReader, dest: Path, limit: int) -> int:
    """Stream one uploaded file to `dest`; the file writes run in a worker thread."""
    loop = asyncio.get_running_loop()
    size = 0
    fh = await loop.run_in_executor(None, open, dest, "wb")
    try:
        while True:
            chunk = await part.read_chunk(1 << 20)
            if not chunk:
                break
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"part {part.name!r} exceeds the {limit}-byte limit")
            await loop.run_in_executor(None, fh.write, chunk)
    finally:
        await loop.run_in_executor(None, fh.close)
    return size


@routes.post("/v1/jobs")
async def submit_job(request: web.Request) -> web.Response:
    who = await principal(request)
    who.require("owner")
    app = request.app
    cfg = app[CONFIG]
    total_limit = 3 * cfg.max_dataset_bytes + cfg.max_spec_bytes + (1 << 20)
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
                elif name in ("train", "val", "base"):
                    if name in paths:
                        raise BadRequest(f"part {name!r} given twice", code="bad_form")
                    paths[name] = blobs.temp_path()
                    await _save_part(part, paths[name], cfg.max_dataset_bytes)
                else:
                    raise BadRequest(f"unknown part {name!r}; expected spec, train, val, base", code="bad_form")
        except (ValueError, HttpProcessingError) as exc:  # aiohttp's multipart parser on malformed bodies
            raise BadRequest(f"malformed multipart body: {one_line(str(exc))}", code="bad_form") from None
        if spec_text is None:  # 'train' too, unless the spec is node-local: jobs.ingest_job says which
            raise BadRequest("a job needs the part 'spec' (TOML), and 'train' (.npz or .csv) unless its "
                             "[data] source is \"node-local\"", code="bad_form")
        app[METRICS].bytes_in += len(spec_text) + sum(p.stat().st_size for p in paths.values())
        job = await app[LEDGER].jobs.submit_job(who.name, spec_text, paths.get("train"), paths.get("val"),
                                                base_path=paths.get("base"))
    except UnicodeDecodeError:
        raise Unprocessable("spec is not UTF-8 text", code="bad_spec") from None
    finally:
        for p in paths.values():
            p.unlink(missing_ok=True)
    return json_response({"id": job.id, "name": job.name, "state": job.state, "rounds": job.rounds,
                          "chunks": len(job.chunks), "model_hash": job.model_hash}, status=201)


@routes.get("/v1/jobs")
async def list_jobs(request: web.Request) -> web.Response:
    who = await principal(request)
    return json_response({"jobs": await request.app[STORE].query(lambda c: jobs.jobs_list(c, who))})


@routes.get("/v1/jobs/{job_id}")
async def get_job(request: web.Request) -> web.Response:
    who = await principal(request)
    return json_response(await jobs.job_document(request.app, who, request.match_info["job_id"]))


@routes.get("/v1/jobs/{job_id}/plan")
async def get_job_plan(request: web.Request) -> web.Response:
    """The pipeline plan the job would get on the nodes online now (readmodel/plans.py)."""
    who = await principal(request)
    return json_response(await plans.job_plan(request.app, who, request.match_info["job_id"]))


@routes.get("/v1/jobs/{job_id}/model")
async def get_model(request: web.Request) -> web.StreamResponse:
    who = await principal(request)
    job_id = request.match_info["job_id"]
    version_q = request.query.get("round")
    version = None if version_q is None else parse_count(version_q, "round", code="bad_round")
    got, sha, data = await export_model(request.app, who, job_id, version)
    request.app[METRICS].bytes_out += len(data)
    return web.Response(body=data, content_type="application/octet-stream", headers={
        "Content-Disposition": f'attachment; filename="{model_file_name(job_id, got)}"',
        "X-GPUFlex-Model-Version": str(got), "X-GPUFlex-Model-Hash": sha})


@routes.post("/v1/jobs/{job_id}/cancel")
async def cancel_job(request: web.Request) -> web.Response:
    who = await principal(request)
    who.require("owner")
    job_id = request.match_info["job_id"]
    await request.app[STORE].query(lambda c: job_row(c, who, job_id))  # visible to `who`, or 404
    before = await request.app[STORE].job_state(job_id)
    if before not in ("queued", "running"):
        return json_response({"id": job_id, "state": before, "detail": "job had already ended"})
    state = await request.app[LEDGER].jobs.cancel_job(job_id, who.name)
    return json_response({"id": job_id, "state": state})


@routes.post("/v1/jobs/{job_id}/rollback")
async def rollback_job(request: web.Request) -> web.Response:
    """Restore a kept model and continue the job from it (hub/policy/rollback.py): JSON
    {"before_node": NODE} (the round before the node's first unverified update; with
    "oldest_kept": true, the oldest kept model when that one is gone) or {"to_round": R}."""
    who = await principal(request)
    who.require("owner")
    job_id = request.match_info["job_id"]
    await request.app[STORE].query(lambda c: job_row(c, who, job_id))  # visible to `who`, or 404
    before_node, to_round, oldest_kept = rollback_target(await read_body(request, 4096))
    return json_response(await request.app[LEDGER].rollbacks.roll_back(who, job_id, before_node=before_node,
                                                                       to_round=to_round, oldest_kept=oldest_kept))


def rollback_target(body: bytes) -> tuple[str | None, int | None, bool]:
    """(before_node, to_round, oldest_kept) of a rollback's JSON body (an empty body names neither)."""
    usage = 'body must be JSON {"before_node": "NODE"} (optionally "oldest_kept": true) or {"to_round": R}'
    try:
        doc = json.loads(body) if body.strip() else {}
    except (ValueError, UnicodeDecodeError):
        raise BadRequest(usage, code="bad_json") from None
    if not isinstance(doc, dict) or set(doc) - {"before_node", "to_round", "oldest_kept"}:
        raise BadRequest(usage, code="bad_json")
    node, rnd, oldest = doc.get("before_node"), doc.get("to_round"), doc.get("oldest_kept", False)
    if node is not None and not (isinstance(node, str) and 0 < len(node) <= 128):
        raise BadRequest("before_node must be a node id", code="bad_rollback")
    if rnd is not None and (isinstance(rnd, bool) or not isinstance(rnd, int) or not 0 <= rnd <= 999_999_999):
        raise BadRequest("to_round must be a round number (0 or more)", code="bad_round")
    if not isinstance(oldest, bool):
        raise BadRequest("oldest_kept must be true or false", code="bad_rollback")
    return node, rnd, oldest
