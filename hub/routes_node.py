"""Node-facing routes: signed msgpack in, hub-signed msgpack out (CONTRACT.md "HTTP wire")."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import mmap
import os
import sqlite3
import time
from pathlib import Path

from aiohttp import web
from gpuflex.protocol.errors import ProtocolError, TensorError
from gpuflex.protocol.messages import (
    Abandon,
    Ack,
    Assignment,
    BlobRequest,
    ChunkRef,
    Heartbeat,
    Hello,
    NoWork,
    UpdateHeader,
    Welcome,
    WorkRequest,
)
from gpuflex.protocol.modelspec import manifest
from gpuflex.protocol.signing import fingerprint, seal
from gpuflex.protocol.tensors import check_finite, check_manifest, decode_state
from gpuflex.protocol.version import PROTOCOL_VERSION

from .appkeys import BLOBS, CONFIG, DB, HUB_KEY, IO_POOL, METRICS, ROUNDS, SCHEDULER, SIGNAL
from .blobs import HOT_BLOB_MAX, BlobStore, check_blob_id
from .errors import (
    BadRequest,
    Conflict,
    Forbidden,
    HubError,
    LengthRequired,
    NotFound,
    PayloadTooLarge,
    Unprocessable,
)
from .jobs import AssignmentState, JobState, UpdateState, new_id
from .manifests import check_streamed_manifest
from .scheduler import NodeState, Plan, clamp_sps, peak_flops
from .wire import (
    b64_header,
    json_response,
    known_node,
    open_node_message,
    protocol_to_hub,
    read_body,
    sealed_response,
)

routes = web.RouteTableDef()
UPLOAD_READ = 1 << 20
SMALL_UPDATE = 1 << 20  # updates up to this size are received in memory


@routes.get("/v1/hub")
async def hub_identity(request: web.Request) -> web.Response:
    key = request.app[HUB_KEY]
    return json_response({"public_key": key.public_bytes.hex(), "fingerprint": key.fingerprint,
                          "protocol_version": PROTOCOL_VERSION})


@routes.post("/v1/nodes/register")
async def register(request: web.Request) -> web.Response:
    app = request.app
    body = await read_body(request, app[CONFIG].max_message_bytes)
    hello, signer = open_node_message(request, body, Hello)
    if hello.protocol_version != PROTOCOL_VERSION:
        raise Conflict(f"node speaks protocol {hello.protocol_version}, this hub speaks {PROTOCOL_VERSION};"
                       " upgrade the older side", code="version_mismatch")
    node_id = fingerprint(signer)
    sched = app[SCHEDULER]
    now = time.time()
    bench_sps = clamp_sps(hello.benchmark.samples_per_s)
    node = sched.nodes.get(node_id)
    if node is not None and node.banned:
        raise Forbidden("this node is banned from the hub after confirmed flags", code="banned")
    device = json.dumps({"kind": hello.device.kind, "name": hello.device.name,
                         "memory_bytes": hello.device.memory_bytes, "threads": hello.device.threads})
    bench_doc = {k: getattr(hello.benchmark, k) for k in (
        "samples_per_s", "matmul_tflops_fp32", "matmul_tflops_bf16", "matmul_tflops_fp16",
        "mem_bandwidth_gbs", "h2d_gbs", "d2h_gbs", "reference_model")}
    bench = json.dumps(bench_doc)

    def write(conn: sqlite3.Connection) -> None:
        conn.execute(
            "INSERT INTO nodes (id, public_key, software_version, device, benchmark, bench_sps, ema_sps,"
            " registered_at, last_seen) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (id) DO UPDATE SET software_version = excluded.software_version,"
            " device = excluded.device, benchmark = excluded.benchmark, bench_sps = excluded.bench_sps,"
            " last_seen = excluded.last_seen",
            (node_id, signer, hello.software_version, device, bench, bench_sps, bench_sps, now, now),
        )

    await app[DB].write(write)
    if node is None:
        node = NodeState(id=node_id, public_key=signer, bench_sps=bench_sps, ema_sps=bench_sps, last_seen=now)
        sched.nodes[node_id] = node
    node.bench_sps = bench_sps
    node.peak_flops = peak_flops(bench_doc)
    node.last_seen = now
    return sealed_response(request, Welcome(node_id=node_id, hub_fingerprint=app[HUB_KEY].fingerprint,
                                            server_time=now, poll_s=app[CONFIG].node_poll_s))


async def _issue(request: web.Request, node: NodeState, plan: Plan) -> bytes:
    """Sign and persist an assignment for `plan`; the row is committed before we answer."""
    app = request.app
    job, shard = plan.job, plan.shard
    by_idx = {c.idx: c for c in job.chunks}
    chunks = [by_idx[i] for i in shard.chunk_idxs]
    now = time.time()
    aid = new_id("a")
    msg = Assignment(
        assignment_id=aid, job_id=job.id, round=job.round, node_id=node.id, model_hash=job.model_sha,
        model_size=job.model_size, model_spec=job.spec.model.to_dict(),
        chunks=tuple(ChunkRef(sha256=c.sha, size=c.size, samples=c.samples) for c in chunks),
        seed=shard.seed, train=job.spec.train.train_config(), issued_at=now, deadline=plan.deadline,
        replica_group=shard.replica_group,
    )
    sealed = seal(app[HUB_KEY], msg)
    a = AssignmentState(
        id=aid, shard_id=shard.id, job_id=job.id, round=job.round, node_id=node.id, issued_at=now,
        expected_s=plan.expected_s, deadline=plan.deadline, sealed=sealed, model_sha=job.model_sha,
        chunk_shas=frozenset(c.sha for c in chunks),
    )
    sched = app[SCHEDULER]
    sched.attach(a, shard)
    new_shard = plan.new_shard

    def write(conn: sqlite3.Connection) -> None:
        if new_shard:
            conn.execute(
                "INSERT INTO shards (id, job_id, round, seq, seed, samples, replica_group, wanted, state)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'open')",
                (shard.id, job.id, shard.round, shard.seq, shard.seed, shard.samples, shard.replica_group,
                 shard.wanted),
            )
            conn.executemany(
                "INSERT INTO shard_chunks (shard_id, pos, chunk_idx, chunk_sha) VALUES (?, ?, ?, ?)",
                [(shard.id, pos, c.idx, c.sha) for pos, c in enumerate(chunks)],
            )
        conn.execute(
            "INSERT INTO assignments (id, shard_id, job_id, round, node_id, issued_at, expected_s, deadline,"
            " state, sealed) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'live', ?)",
            (aid, shard.id, job.id, job.round, node.id, now, plan.expected_s, plan.deadline, sealed),
        )

    try:
        await app[DB].write(write)
    except Exception:
        sched.detach(a)
        sched.release_if_empty(shard)
        raise
    app[METRICS].assignments_issued += 1
    return sealed


@routes.post("/v1/work")
async def work(request: web.Request) -> web.Response:
    app = request.app
    cfg = app[CONFIG]
    body = await read_body(request, cfg.max_message_bytes)
    req, signer = open_node_message(request, body, WorkRequest)
    node = known_node(request, signer)
    sched = app[SCHEDULER]
    cached = frozenset(req.cached_chunks)
    wait_s = min(float(req.wait_s), cfg.long_poll_max_s)
    give_up = time.monotonic() + wait_s
    wake = app[SIGNAL]  # the WorkSignal that long-polls wait on
    while not wake.closing:
        node.last_seen = time.time()
        if node.banned:
            raise Forbidden("this node is banned from the hub after confirmed flags", code="banned")
        # A node that comes back while it still holds a live assignment gets that one again.
        held = [a for a in sched.live_for(node.id) if not a.uploading]
        if held:
            first = min(held, key=lambda a: a.issued_at)
            return _assignment_response(request, first.sealed, first.model_sha, cached)
        plan = sched.plan(node, cached)
        if plan is not None:
            model_sha = plan.job.model_sha  # the one _issue signs into the assignment
            sealed = await _issue(request, node, plan)
            return _assignment_response(request, sealed, model_sha, cached)
        left = give_up - time.monotonic()
        if left <= 0:
            break
        await wake.wait(left)
    running = any(j.state == "running" for j in sched.jobs.values())
    if wake.closing:
        reason, retry = "the hub is shutting down", 2.0
    elif running:
        reason, retry = "every chunk of the current rounds is taken", 1.0
    else:
        reason, retry = "no job is running", cfg.node_poll_s
    return sealed_response(request, NoWork(retry_after_s=retry, reason=reason))


def _assignment_response(request: web.Request, sealed: bytes, model_sha: str, cached: frozenset[str]) -> web.Response:
    """The sealed assignment, followed by the model's bytes when the node asked for them inline.

    A node that sends ``X-GPUFlex-Inline-Max: N`` and does not list the model among its
    cached blobs gets a small model (at most N bytes and in the hub's memory) in the same
    answer: ``X-GPUFlex-Sealed-Length`` says where the sealed message ends. That saves the
    node one request per round (one round trip over a real network). The bytes are bound
    to the signed assignment by its model_hash, which the node checks.
    """
    headers: dict[str, str] = {}
    body = sealed
    try:
        inline_max = min(int(request.headers.get("X-GPUFlex-Inline-Max", "0")), HOT_BLOB_MAX)
    except ValueError:
        inline_max = 0
    if inline_max > 0 and model_sha not in cached:
        blob = request.app[BLOBS].hot(model_sha)  # memory only: never a disk read on the loop
        if blob is not None and len(blob) <= inline_max:
            body = sealed + blob
            headers["X-GPUFlex-Sealed-Length"] = str(len(sealed))
    request.app[METRICS].bytes_out += len(body)
    return web.Response(body=body, content_type="application/x-msgpack", headers=headers)


def _owned_live(request: web.Request, node: NodeState, assignment_id: str) -> AssignmentState | None:
    a = request.app[SCHEDULER].assignments.get(assignment_id)
    if a is not None and a.node_id != node.id:
        raise Forbidden("that assignment belongs to another node", code="not_your_assignment")
    return a


async def _closed_state(request: web.Request, node: NodeState, assignment_id: str) -> str:
    """State of an assignment that is not live; 404 if unknown, 403 if someone else's."""
    row = await request.app[DB].read(lambda c: c.execute(
        "SELECT node_id, state FROM assignments WHERE id = ?", (assignment_id,)).fetchone())
    if row is None:
        raise NotFound(f"no assignment {assignment_id}", code="unknown_assignment")
    if row["node_id"] != node.id:
        raise Forbidden("that assignment belongs to another node", code="not_your_assignment")
    return str(row["state"])


@routes.post("/v1/heartbeat")
async def heartbeat(request: web.Request) -> web.Response:
    app = request.app
    cfg = app[CONFIG]
    body = await read_body(request, cfg.max_message_bytes)
    hb, signer = open_node_message(request, body, Heartbeat)
    node = known_node(request, signer)
    node.last_seen = time.time()
    a = _owned_live(request, node, hb.assignment_id)
    if a is None:
        state = await _closed_state(request, node, hb.assignment_id)
        return sealed_response(request, Ack(ok=False, detail=f"assignment is {state}; stop and ask for work",
                                            deadline=0.0))
    job = app[SCHEDULER].jobs[a.job_id]
    now = time.time()
    extension = max(cfg.min_deadline_s, a.expected_s * job.spec.train.deadline_slack)
    new_deadline = min(max(a.deadline, now + extension), a.issued_at + cfg.max_assignment_s)
    if new_deadline > a.deadline:
        a.deadline = new_deadline
        await app[DB].write(lambda c: c.execute("UPDATE assignments SET deadline = ? WHERE id = ?",
                                                (new_deadline, a.id)))
    return sealed_response(request, Ack(ok=True, detail="deadline extended", deadline=a.deadline))


@routes.post("/v1/abandon")
async def abandon(request: web.Request) -> web.Response:
    app = request.app
    body = await read_body(request, app[CONFIG].max_message_bytes)
    msg, signer = open_node_message(request, body, Abandon)
    node = known_node(request, signer)
    a = _owned_live(request, node, msg.assignment_id)
    if a is None:
        state = await _closed_state(request, node, msg.assignment_id)
        return sealed_response(request, Ack(ok=True, detail=f"assignment was already {state}", deadline=0.0))
    if a.uploading:
        raise Conflict("an update for this assignment is being uploaded", code="busy")
    sched = app[SCHEDULER]
    shard = sched.detach(a)
    if shard is not None:
        sched.release_if_empty(shard)
    await app[DB].write(lambda c: c.execute(
        "UPDATE assignments SET state = 'abandoned' WHERE id = ? AND state = 'live'", (a.id,)))
    app[SIGNAL].notify()
    return sealed_response(request, Ack(ok=True, detail="abandoned; the shard goes back to the pool",
                                        deadline=0.0))


@routes.get("/v1/blobs/{sha256}")
async def blob(request: web.Request) -> web.StreamResponse:
    app = request.app
    sha = check_blob_id(request.match_info["sha256"])  # before anything touches the disk
    data = b64_header(request, "X-GPUFlex-Auth")
    req, signer = open_node_message(request, data, BlobRequest)
    if req.sha256 != sha:
        raise BadRequest("the signed blob request names another blob", code="blob_mismatch")
    node = known_node(request, signer)
    node.last_seen = time.time()
    allowed = any(a.model_sha == sha or sha in a.chunk_shas for a in app[SCHEDULER].live_for(node.id))
    if not allowed:
        raise Forbidden("blobs are served only for a live assignment that names them", code="not_assigned")
    headers = {"Content-Type": "application/octet-stream", "Cache-Control": "private, max-age=31536000, immutable"}
    hot = app[BLOBS].hot(sha)
    if hot is not None:  # a small, recent blob (this round's model): no file to open
        return _bytes_response(request, hot, headers)
    path = app[BLOBS].path(sha)
    if not path.is_file():
        raise NotFound(f"blob {sha} is not stored", code="unknown_blob")
    app[METRICS].bytes_out += path.stat().st_size
    return web.FileResponse(path, headers=headers)


def _bytes_response(request: web.Request, data: bytes, headers: dict[str, str]) -> web.Response:
    """Serve in-memory bytes with the same single-range semantics as FileResponse."""
    metrics = request.app[METRICS]
    headers = {**headers, "Accept-Ranges": "bytes"}
    try:
        rng = request.http_range
    except ValueError:
        rng = slice(None, None)  # a malformed Range is ignored: the whole blob
    if rng.start is None and rng.stop is None:
        metrics.bytes_out += len(data)
        return web.Response(body=data, headers=headers)
    start, stop, _ = rng.indices(len(data))
    if start >= len(data) or start >= stop:
        return web.Response(status=416, headers={**headers, "Content-Range": f"bytes */{len(data)}"})
    metrics.bytes_out += stop - start
    return web.Response(status=206, body=data[start:stop],
                        headers={**headers, "Content-Range": f"bytes {start}-{stop - 1}/{len(data)}"})


def _ingest_update_bytes(body: bytes, spec_manifest: object, blobs: BlobStore, sha: str) -> None:
    """An update held in memory: check it, then store it durably (and keep it in memory for the
    round's close). Worker thread."""
    _check_update(body, spec_manifest)
    blobs.put(body, sha=sha)


def _ingest_update_file(path: Path, spec_manifest: object, blobs: BlobStore, sha: str) -> None:
    """Manifest, finiteness (read-only mmap), fsync, rename into the blob store. Worker thread."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            raise Unprocessable("update is empty", code="bad_manifest")
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            _check_update(mm, spec_manifest)
        finally:
            with contextlib.suppress(BufferError):
                mm.close()
        os.fsync(fh.fileno())
    blobs.commit_temp(path, sha)


def _check_update(buf: bytes | mmap.mmap, spec_manifest: object) -> None:
    """The update's tensors match the model's manifest and are all finite."""
    if len(buf) == 0:
        raise Unprocessable("update is empty", code="bad_manifest")
    try:
        check_manifest(buf, spec_manifest)  # type: ignore[arg-type]
        state = decode_state(buf)
    except ProtocolError as exc:
        raise Unprocessable(f"update does not match the model: {exc}", code="bad_manifest") from None
    try:
        check_finite(state)
    except TensorError as exc:
        raise Unprocessable(str(exc), code="non_finite") from None
    finally:
        del state


@routes.post("/v1/updates")
async def update(request: web.Request) -> web.Response:
    app = request.app
    metrics = app[METRICS]
    try:
        return await _update(request)
    except HubError as exc:
        metrics.updates_rejected[exc.code] += 1
        raise


async def _update(request: web.Request) -> web.Response:
    app = request.app
    sched = app[SCHEDULER]
    data = b64_header(request, "X-GPUFlex-Update")
    hdr, signer = open_node_message(request, data, UpdateHeader)
    node = known_node(request, signer)
    node.last_seen = time.time()
    a = _owned_live(request, node, hdr.assignment_id)
    if a is None:
        row = await app[DB].read(lambda c: c.execute(
            "SELECT a.node_id, a.state, u.id AS update_id FROM assignments a"
            " LEFT JOIN updates u ON u.assignment_id = a.id WHERE a.id = ?", (hdr.assignment_id,)).fetchone())
        if row is None:
            raise NotFound(f"no assignment {hdr.assignment_id}", code="unknown_assignment")
        if row["node_id"] != node.id:
            raise Forbidden("that assignment belongs to another node", code="not_your_assignment")
        if row["update_id"] is not None:
            raise Conflict("an update for this assignment was already accepted", code="duplicate_update")
        raise Conflict(f"assignment is {row['state']}; the update came too late", code="late_update")
    if a.uploading:
        raise Conflict("an update for this assignment is already being uploaded", code="duplicate_update")
    job: JobState = sched.jobs[a.job_id]
    if request.content_length is None:
        raise LengthRequired("send the update with a Content-Length header", code="length_required")
    if request.content_length != hdr.update_size:
        raise BadRequest(f"Content-Length {request.content_length} differs from update_size {hdr.update_size}",
                         code="size_mismatch")
    if hdr.update_size > job.model_size:
        await check_streamed_manifest(request, hdr.update_size, manifest(job.spec.model))  # 422 names the tensor
        raise PayloadTooLarge(f"update of {hdr.update_size} bytes is larger than the model ({job.model_size})",
                              code="too_large")
    loss = float(hdr.metrics["loss"])
    train_s = float(hdr.timings["train_s"])
    blobs = app[BLOBS]
    tmp = blobs.temp_path()
    a.uploading = True
    try:
        digest = hashlib.sha256()
        received = 0
        small = hdr.update_size <= SMALL_UPDATE
        pieces: list[bytes] = []
        # A small update is held in memory and written by a worker thread (creating a file
        # costs ~1 ms of event-loop time here); a large one streams into the temp file, whose
        # page-cache writes are fast. Either way the fsync happens in a worker thread.
        fh = None if small else open(tmp, "wb")  # noqa: ASYNC230
        try:
            while True:
                piece = await request.content.read(UPLOAD_READ)
                if not piece:
                    break
                received += len(piece)
                if received > hdr.update_size:
                    raise BadRequest("body is longer than update_size", code="size_mismatch")
                digest.update(piece)
                if fh is None:
                    pieces.append(piece)
                else:
                    fh.write(piece)
        finally:
            if fh is not None:
                fh.close()
        app[METRICS].bytes_in += received
        if received != hdr.update_size:
            raise BadRequest(f"body has {received} bytes, update_size says {hdr.update_size}", code="size_mismatch")
        if digest.hexdigest() != hdr.update_sha256:
            raise Unprocessable("update bytes do not hash to update_sha256", code="hash_mismatch")
        loop = asyncio.get_running_loop()
        if small:
            await loop.run_in_executor(app[IO_POOL], _ingest_update_bytes, b"".join(pieces),
                                       manifest(job.spec.model), blobs, hdr.update_sha256)
        else:
            await loop.run_in_executor(app[IO_POOL], _ingest_update_file, tmp, manifest(job.spec.model), blobs,
                                       hdr.update_sha256)
        if a.id not in sched.assignments or job.round != a.round or job.state != "running":
            raise Conflict("the round closed while the update was uploading", code="late_update")
        now = time.time()
        shard = job.shards.get(a.shard_id)
        if shard is None:
            raise Conflict("the shard of this assignment is no longer open", code="late_update")
        upd = UpdateState(
            id="u-" + a.id.removeprefix("a-"), assignment_id=a.id, shard_id=shard.id, node_id=node.id,
            sha=hdr.update_sha256, size=hdr.update_size, sample_count=hdr.sample_count, loss=loss,
            train_s=train_s, received_at=now, elapsed_s=now - a.issued_at,
        )
        old_ema = node.ema_sps
        sched.observe_throughput(node, shard.samples, job.spec.train.local_epochs, now - a.issued_at,
                                 app[CONFIG].throughput_alpha)
        first = shard.first_update_at is None
        # an unreplicated shard is settled by its one update, in the same transaction
        settles = shard.wanted == 1 and not shard.accepted and shard.state == "open"

        def write(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO updates (id, assignment_id, shard_id, job_id, round, node_id, sha, size,"
                " sample_count, loss, train_s, metrics, timings, status, received_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'accepted', ?)",
                (upd.id, a.id, shard.id, job.id, a.round, node.id, upd.sha, upd.size, upd.sample_count,
                 loss, train_s, json.dumps(hdr.metrics), json.dumps(hdr.timings), now),
            )
            conn.execute("UPDATE assignments SET state = 'done' WHERE id = ?", (a.id,))
            conn.execute("UPDATE nodes SET ema_sps = ?, updates_accepted = updates_accepted + 1,"
                         " last_seen = ? WHERE id = ?", (node.ema_sps, now, node.id))
            if first:
                conn.execute("UPDATE shards SET first_update_at = ? WHERE id = ?", (now, shard.id))
            if settles:
                conn.execute("UPDATE shards SET state = 'settled', outcome = '{\"replicas\":1}' WHERE id = ?",
                             (shard.id,))

        try:
            await app[DB].write(write)
        except sqlite3.IntegrityError:
            node.ema_sps = old_ema
            raise Conflict("an update for this assignment was already accepted", code="duplicate_update") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        a.uploading = False
        raise
    a.uploading = False
    sched.detach(a)
    shard.accepted.append(upd)
    if first:
        shard.first_update_at = now
    if settles:
        shard.state = "settled"
        shard.representative = upd.id
    node.updates_accepted += 1
    app[METRICS].updates_accepted += 1
    app[ROUNDS].poke(job.id)
    return sealed_response(request, Ack(ok=True, detail=f"accepted as {upd.id}", deadline=0.0))


__all__ = ["protocol_to_hub", "routes"]
