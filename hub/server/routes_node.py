"""Node-facing routes: signed msgpack in, hub-signed msgpack out.

Each handler parses and checks the signed message (hub/server/wire.py), calls the ledger
(hub/domain/ledger/) and answers with a hub-signed message. The upload handler also moves
the update's bytes into the blob store, hashing and checking them in worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import mmap
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import BinaryIO, TypeVar

import numpy as np
from aiohttp import web
from gpuflex.protocol.errors import ProtocolError, TensorError
from gpuflex.protocol.messages import (
    Abandon,
    Ack,
    BlobRequest,
    Heartbeat,
    Hello,
    NoWork,
    SecAggKeys,
    SecAggMasked,
    SecAggPoll,
    SecAggShares,
    SecAggUnmask,
    SiloQuery,
    SiloRegistration,
    SiloWithdrawal,
    StateUnavailable,
    StateUpload,
    UpdateHeader,
    UploadOffset,
    Welcome,
    WorkRequest,
)
from gpuflex.protocol.tensors import Manifest, check_blob, decode_state
from gpuflex.protocol.version import PROTOCOL_VERSION

from ..base.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    HubError,
    LengthRequired,
    NotFound,
    PayloadTooLarge,
    Unprocessable,
)
from ..base.numbers import parse_count
from ..domain.pipelines.resharding import count_served
from ..domain.worksignal import Wake, WorkSignal, pass_on
from ..model.job import UpdateLayout
from ..model.node import NodeState
from ..storage.blobs import HOT_BLOB_MAX, BlobStore, check_blob_id
from ..storage.tokens import enrollment_operator
from .appkeys import BLOBS, CONFIG, DB, DELTAS, HUB_KEY, IO_POOL, LEDGER, METRICS
from .linkmeter import BodyClock, tcp_rtt_s
from .manifests import check_streamed_manifest
from .wire import (
    b64_header,
    json_response,
    open_node_message,
    protocol_to_hub,
    read_body,
    sealed_response,
)

routes = web.RouteTableDef()
M = TypeVar("M")
UPLOAD_READ = 1 << 20
SMALL_UPDATE = 1 << 20  # updates up to this size are received in memory


@routes.get("/v1/hub")
async def hub_identity(request: web.Request) -> web.Response:
    key = request.app[HUB_KEY]
    return json_response({"public_key": key.public_bytes.hex(), "fingerprint": key.fingerprint,
                          "protocol_version": PROTOCOL_VERSION, "server_time": time.time()})


@routes.post("/v1/nodes/register")
async def register(request: web.Request) -> web.Response:
    app = request.app
    body = await read_body(request, app[CONFIG].max_message_bytes)
    hello, signer = open_node_message(request, body, Hello)
    operator = None
    if hello.enroll_token:
        operator = await app[DB].read(lambda conn: enrollment_operator(conn, hello.enroll_token))
    node = await app[LEDGER].registry.register(signer, hello, address=request.remote, operator=operator)
    return sealed_response(request, Welcome(node_id=node.id, hub_fingerprint=app[HUB_KEY].fingerprint,
                                            server_time=node.last_seen, poll_s=app[CONFIG].node_poll_s))


@routes.post("/v1/work")
async def work(request: web.Request) -> web.Response:
    app = request.app
    cfg = app[CONFIG]
    ledger = app[LEDGER]
    body = await read_body(request, cfg.max_message_bytes)
    req, signer = open_node_message(request, body, WorkRequest)
    node = await ledger.registry.known_node(signer, request.remote)
    rtt = tcp_rtt_s(request)
    if rtt is not None:
        ledger.scheduler.presence.observe_rtt(node, rtt)
    cached = frozenset(req.cached_chunks)
    wait_s = min(float(req.wait_s), cfg.long_poll_max_s)
    loop = asyncio.get_running_loop()
    give_up = loop.time() + wait_s
    wake = ledger.signal  # the WorkSignal that long-polls wait on (hub/domain/worksignal.py)
    woken = Wake("timeout")
    with ledger.assignments.polling(node):
        while not wake.closing:
            since = wake.generation
            asked = ledger.states.pending_state_request(node)  # the referee's request comes first
            if asked is not None:
                _pass_on(wake, woken, got_work=False)
                request.app[METRICS].bytes_out += len(asked)
                return web.Response(body=asked, content_type="application/x-msgpack")
            staged = ledger.pipelines.stage_for(node)  # a pipelined job's stage (hub/domain/pipelines/)
            if staged is not None:
                _pass_on(wake, woken, got_work=False)
                request.app[METRICS].bytes_out += len(staged)
                return web.Response(body=staged, content_type="application/x-msgpack")
            if node.suspended is not None:
                break
            # a node running a pipeline stage takes no data-parallel work meanwhile
            issued = (None if ledger.pipelines.holds_stage(node)
                      else await ledger.assignments.next_assignment(node, cached))
            _pass_on(wake, woken, got_work=issued is not None)
            if issued is not None:
                return _assignment_response(request, issued.sealed, issued.model_hash, cached, node)
            left = give_up - loop.time()
            if left <= 0:
                break
            woken = await wake.wait(node.id, left, since)
            if woken.kind != "timeout":
                request.app[METRICS].poll_wakeups[woken.kind] += 1
    running = any(j.state == "running" for j in ledger.scheduler.jobs.values())
    refusal = ledger.scheduler.precision_refusal(node)
    if wake.closing:
        reason, retry = "the hub is shutting down", 2.0
    elif node.suspended is not None:
        reason, retry = node.suspended[:256], cfg.node_poll_s
    elif refusal is not None:
        reason, retry = refusal[:256], cfg.node_poll_s
    elif ledger.pipelines.holds_stage(node):
        reason, retry = "this node runs a pipeline stage: it takes other work once the stage ends", 1.0
    elif running:
        reason, retry = "every chunk of the current rounds is taken", 1.0
    else:
        reason, retry = "no job is running", cfg.node_poll_s
    return sealed_response(request, NoWork(retry_after_s=retry, reason=reason))


def _pass_on(wake: WorkSignal, woken: Wake, *, got_work: bool) -> None:
    """An offer this poll was woken by travels on to the next waiting poll (worksignal.pass_on)."""
    misses = pass_on(woken, got_work)
    if misses is not None:
        wake.offer(misses, woken.to)


def _assignment_response(request: web.Request, sealed: bytes, model_hash: str, cached: frozenset[str],
                         node: NodeState) -> web.Response:
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
        inline_max = min(parse_count(request.headers.get("X-GPUFlex-Inline-Max", "0"), "X-GPUFlex-Inline-Max",
                                     maximum=1 << 62), HOT_BLOB_MAX)
    except BadRequest:
        inline_max = 0  # a value this hub cannot read only costs the node the inline model
    if inline_max > 0 and model_hash not in cached:
        blob = request.app[BLOBS].hot(model_hash)  # memory only: never a disk read on the loop
        if blob is not None and len(blob) <= inline_max:
            body = sealed + blob
            headers["X-GPUFlex-Sealed-Length"] = str(len(sealed))
            request.app[LEDGER].assignments.count_served(node, model_hash, len(blob))
    request.app[METRICS].bytes_out += len(body)
    return web.Response(body=body, content_type="application/x-msgpack", headers=headers)


@routes.post("/v1/heartbeat")
async def heartbeat(request: web.Request) -> web.Response:
    app = request.app
    body = await read_body(request, app[CONFIG].max_message_bytes)
    hb, signer = open_node_message(request, body, Heartbeat)
    ledger = app[LEDGER]
    node = await ledger.registry.known_node(signer, request.remote)
    ok, detail, deadline = await ledger.assignments.heartbeat(node, hb.assignment_id, hb.steps, hb.digest)
    return sealed_response(request, Ack(ok=ok, detail=detail, deadline=deadline))


@routes.post("/v1/abandon")
async def abandon(request: web.Request) -> web.Response:
    app = request.app
    body = await read_body(request, app[CONFIG].max_message_bytes)
    msg, signer = open_node_message(request, body, Abandon)
    ledger = app[LEDGER]
    node = await ledger.registry.known_node(signer, request.remote)
    detail = await ledger.assignments.abandon(node, msg.assignment_id)
    return sealed_response(request, Ack(ok=True, detail=detail, deadline=0.0))


async def _signed(request: web.Request, cls: type[M]) -> tuple[M, NodeState]:
    """The body's signed message of type ``cls`` and the registered node that signed it."""
    app = request.app
    msg, signer = open_node_message(request, await read_body(request, app[CONFIG].max_message_bytes), cls)
    return msg, await app[LEDGER].registry.known_node(signer, request.remote)


@routes.post("/v1/silos/schema")
async def silo_schema(request: web.Request) -> web.Response:
    """What a silo of a node-local job must hold (signed SiloQuery -> signed SiloSchema)."""
    msg, node = await _signed(request, SiloQuery)
    return sealed_response(request, request.app[LEDGER].silos.silo_schema(node, msg.job_id))


@routes.post("/v1/silos")
async def attach_silo(request: web.Request) -> web.Response:
    """A node attaches its silo to a node-local job (signed SiloRegistration -> signed Ack):
    the blob id, size, sample count and opt-in label histogram; never a row."""
    msg, node = await _signed(request, SiloRegistration)
    detail = await request.app[LEDGER].silos.attach_silo(node, msg)
    return sealed_response(request, Ack(ok=True, detail=detail, deadline=0.0))


@routes.post("/v1/silos/withdraw")
async def withdraw_silo(request: web.Request) -> web.Response:
    """A node's operator removed its silo (signed SiloWithdrawal -> signed Ack): the hub stops
    assigning it and no round waits for it."""
    msg, node = await _signed(request, SiloWithdrawal)
    detail = await request.app[LEDGER].silos.withdraw_silo(node, msg)
    return sealed_response(request, Ack(ok=True, detail=detail, deadline=0.0))


# -- secure aggregation (hub/policy/secagg.py; each answer is the node's SecAggState) -------------
@routes.post("/v1/secagg/keys")
async def secagg_keys(request: web.Request) -> web.Response:
    msg, node = await _signed(request, SecAggKeys)
    return sealed_response(request, await request.app[LEDGER].secagg.keys(node, msg))


@routes.post("/v1/secagg/poll")
async def secagg_poll(request: web.Request) -> web.Response:
    msg, node = await _signed(request, SecAggPoll)
    return sealed_response(request, await request.app[LEDGER].secagg.wait(node, msg.assignment_id, msg.after, msg.wait_s))


@routes.post("/v1/secagg/shares")
async def secagg_shares(request: web.Request) -> web.Response:
    msg, node = await _signed(request, SecAggShares)
    return sealed_response(request, await request.app[LEDGER].secagg.shares(node, msg))


@routes.post("/v1/secagg/masked")
async def secagg_masked(request: web.Request) -> web.Response:
    """The masked update (header X-GPUFlex-Masked: a sealed SecAggMasked; body: uint32 LE). It is
    stored like any update blob (durably, before the 2xx), then handed to the round's protocol."""
    app = request.app
    hdr, signer = open_node_message(request, b64_header(request, "X-GPUFlex-Masked"), SecAggMasked)
    ledger = app[LEDGER]
    node = await ledger.registry.known_node(signer, request.remote)
    ledger.secagg.may_mask(node, hdr)  # the size is the protocol's: checked before the body is read
    body = await read_body(request, hdr.size)
    if len(body) != hdr.size or hashlib.sha256(body).hexdigest() != hdr.sha256:
        raise BadRequest("the masked update's bytes do not match its signed size and SHA-256", code="bad_masked")
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(app[IO_POOL], partial(app[BLOBS].put, body, sha=hdr.sha256))
    vector = np.frombuffer(body, dtype="<u4").astype(np.uint32)
    return sealed_response(request, await ledger.secagg.masked(node, hdr, vector))


@routes.post("/v1/secagg/unmask")
async def secagg_unmask(request: web.Request) -> web.Response:
    msg, node = await _signed(request, SecAggUnmask)
    return sealed_response(request, request.app[LEDGER].secagg.unmask(node, msg))


async def _blob_reader(request: web.Request, sha: str) -> NodeState:
    """The node whose signed BlobRequest (X-GPUFlex-Auth) names ``sha``, a blob one of its live
    assignments names; 400/401/403 otherwise."""
    data = b64_header(request, "X-GPUFlex-Auth")
    req, signer = open_node_message(request, data, BlobRequest)
    if req.sha256 != sha:
        raise BadRequest("the signed blob request names another blob", code="blob_mismatch")
    ledger = request.app[LEDGER]
    node = await ledger.registry.known_node(signer, request.remote)
    if not (ledger.assignments.may_read_blob(node, sha) or ledger.pipelines.may_read_blob(node, sha)):
        raise Forbidden("blobs are served only for a live assignment (or pipeline stage) that names them",
                        code="not_assigned")
    return node


@routes.get("/v1/blobs/{sha256}")
async def blob(request: web.Request) -> web.StreamResponse:
    app = request.app
    sha = check_blob_id(request.match_info["sha256"])  # before anything touches the disk
    node = await _blob_reader(request, sha)
    ledger = app[LEDGER]
    headers = {"Content-Type": "application/octet-stream", "Cache-Control": "private, max-age=31536000, immutable"}
    loop = asyncio.get_running_loop()
    # a small blob: in memory (this round's model), or else packed (read off the loop)
    small = app[BLOBS].hot(sha) or await loop.run_in_executor(app[IO_POOL], app[BLOBS].small, sha)
    if small is not None:  # no file to open
        resp = _bytes_response(request, small, headers)
        sent = _body_size(resp, small)
        ledger.assignments.count_served(node, sha, sent)
        count_served(ledger.pipelines.jobs, node.id, sha, sent)
        return resp
    # off the loop: a bucket-backed store (hub/storage/blobs_s3.py) fetches a blob missing from its cache
    path = await loop.run_in_executor(app[IO_POOL], app[BLOBS].path, sha)
    if not path.is_file():
        raise NotFound(f"blob {sha} is not stored", code="unknown_blob")
    size = path.stat().st_size
    try:
        start = request.http_range.start or 0
    except ValueError:
        start = 0
    served = max(0, size - start) if start >= 0 else min(size, -start)
    app[METRICS].bytes_out += served
    ledger.assignments.count_served(node, sha, served)
    count_served(ledger.pipelines.jobs, node.id, sha, served)
    return web.FileResponse(path, headers=headers)


@routes.get("/v1/blobs/{sha256}/from/{base}")
async def blob_delta(request: web.Request) -> web.Response:
    """Model ``sha256`` as a delta from ``base``, an earlier model of the same job the node holds
    (protocol/blobdelta.py); the node applies it and checks the result against the signed
    model_hash. 404 no_delta when there is none to give: the node downloads the whole model."""
    app = request.app
    sha = check_blob_id(request.match_info["sha256"])
    base = check_blob_id(request.match_info["base"])
    node = await _blob_reader(request, sha)
    ledger = app[LEDGER]
    if not ledger.assignments.delta_base_ok(node, sha, base):
        raise NotFound("no delta to that model from this base: download the whole model", code="no_delta")
    delta = await app[DELTAS].get(base, sha)
    if delta is None:
        raise NotFound("the two models differ in layout: download the whole model", code="no_delta")
    app[METRICS].bytes_out += len(delta)
    ledger.assignments.count_served(node, sha, len(delta))
    return web.Response(body=delta, headers={"Content-Type": "application/octet-stream", "X-GPUFlex-Delta-From": base})


def _body_size(resp: web.Response, data: bytes) -> int:
    """The bytes ``resp`` sends of ``data`` (a slice of it for a Range; a packed blob's memoryview
    becomes a payload whose size is its length)."""
    body = resp.body
    if isinstance(body, (bytes, bytearray)):
        return len(body)
    size = getattr(body, "size", None)
    return int(size) if size is not None else len(data)


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


def _ingest_update_bytes(body: bytes, sha: str, layout: UpdateLayout, blobs: BlobStore) -> None:
    """An update held in memory: hash and check it, then store it durably (and keep it in memory
    for the round's close). Worker thread."""
    _check_update_bytes(body, sha, layout)
    blobs.put(body, sha=sha)


def _check_update_bytes(body: bytes, sha: str, layout: UpdateLayout) -> None:
    if hashlib.sha256(body).hexdigest() != sha:
        raise Unprocessable("update bytes do not hash to update_sha256", code="hash_mismatch")
    _check_update(body, layout)


def _ingest_update_file(path: Path, layout: UpdateLayout, blobs: BlobStore, sha: str) -> None:
    """Manifest, finiteness (read-only mmap), fsync, rename into the blob store. Worker thread."""
    _ingest_file(path, blobs, sha, partial(_check_update, layout=layout))


def _ingest_file(path: Path, blobs: BlobStore, sha: str, check: Callable[[bytes | mmap.mmap], None]) -> None:
    """A received file whose hash its caller checked: ``check`` its bytes (a read-only mmap, so
    nothing of it is copied into memory), fsync it, rename it into the blob store. Worker thread."""
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            check(b"")  # an empty body: the check says what is wrong with it (nothing maps it)
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            check(mm)
        finally:
            with contextlib.suppress(BufferError):
                mm.close()
        os.fsync(fh.fileno())
    blobs.commit_temp(path, sha)


def _check_update(buf: bytes | mmap.mmap, layout: UpdateLayout) -> None:
    """The update's tensors are the job's encoding of the model's (names, dtypes, shapes), hold
    only values its encoder makes, and are all finite."""
    if len(buf) == 0:
        raise Unprocessable("update is empty", code="bad_manifest")
    try:
        nonfinite = check_blob(buf, layout.wire)  # no tensor made: an fp32 update needs no more
    except ProtocolError as exc:
        raise Unprocessable(f"update does not match the model: {exc}", code="bad_manifest") from None
    if nonfinite is not None:
        raise Unprocessable(f"tensor {nonfinite!r} contains NaN or infinite values", code="non_finite")
    if layout.encoding.identity:
        return
    state = decode_state(buf)
    try:
        layout.encoding.check(state, layout.model)
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
    ledger = app[LEDGER]
    data = b64_header(request, "X-GPUFlex-Update")
    hdr, signer = open_node_message(request, data, UpdateHeader)
    node = await ledger.registry.known_node(signer, request.remote)
    a, job = await ledger.uploads.begin_upload(node, hdr, request.content_length)
    blobs = app[BLOBS]
    # A large update streams into a file kept per (assignment, hash): when the link drops mid-way,
    # what arrived stays, and the node sends only the rest (POST /v1/updates/offset says how much).
    resumable = hdr.update_size > SMALL_UPDATE and hdr.update_size <= job.model_size
    tmp = blobs.partial_path(a.id, hdr.update_sha256) if resumable else blobs.temp_path()
    keep = False
    try:
        largest = max(job.model_size, job.layout.max_update_bytes)
        if hdr.update_size > largest:  # refused before a byte of the body is read
            raise PayloadTooLarge(f"update of {hdr.update_size} bytes is larger than any update of this job's model"
                                  f" and encoding can be (at most {largest}; its tensors: "
                                  f"{_tensor_list(job.layout.wire)})", code="too_large")
        if hdr.update_size > job.model_size:
            await check_streamed_manifest(request, hdr.update_size, job.layout.wire)  # 422 names the tensor
            raise PayloadTooLarge(f"update of {hdr.update_size} bytes is larger than the model ({job.model_size})",
                                  code="too_large")
        held = await asyncio.get_running_loop().run_in_executor(app[IO_POOL], _held_bytes, tmp) if resumable else 0
        if hdr.offset != 0 and hdr.offset != held:
            raise Conflict(f"the hub holds {held} bytes of this update; send it from offset {held}",
                           code="offset_mismatch")
        keep = resumable
        clock = BodyClock()
        await _receive_update(request, hdr, job.layout, tmp, clock)
        ledger.scheduler.presence.observe_uplink(node, clock.rate())
        upd = await ledger.uploads.accept_update(node, a, job, hdr)
    except BaseException as exc:
        # a temp file goes; what an interrupted upload left stays, unless its bytes were refused
        if not resumable or (keep and not _interrupted(exc)):
            tmp.unlink(missing_ok=True)
        ledger.uploads.end_upload(a)
        raise
    if hdr.offset:
        app[METRICS].uploads_resumed += 1
    return sealed_response(request, Ack(ok=True, detail=f"accepted as {upd.id}", deadline=0.0))


def _tensor_list(wire: Manifest, shown: int = 6) -> str:
    """The job's update tensors, for a refusal a client with the wrong model can act on."""
    names = [f"{t.name} {list(t.shape)} {t.dtype}" for t in wire[:shown]]
    return ", ".join(names) + (f", and {len(wire) - shown} more" if len(wire) > shown else "")


@routes.post("/v1/updates/offset")
async def update_offset(request: web.Request) -> web.Response:
    """How much of an interrupted upload the hub holds: the node's signed update header in
    X-GPUFlex-Update (as for the upload itself), no body; a signed UploadOffset back."""
    app = request.app
    ledger = app[LEDGER]
    data = b64_header(request, "X-GPUFlex-Update")
    hdr, signer = open_node_message(request, data, UpdateHeader)
    node = await ledger.registry.known_node(signer, request.remote)
    a = ledger.uploads.upload_target(node, hdr)
    held = 0
    if hdr.update_size > SMALL_UPDATE:
        path = app[BLOBS].partial_path(a.id, hdr.update_sha256)
        held = await asyncio.get_running_loop().run_in_executor(app[IO_POOL], _held_bytes, path)
    return sealed_response(request, UploadOffset(assignment_id=a.id, update_sha256=hdr.update_sha256,
                                                 offset=min(held, hdr.update_size)))


def _held_bytes(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


#: refusals about the update's content: what arrived of it is worth nothing to a resumed upload
_CONTENT_CODES = frozenset({"hash_mismatch", "bad_manifest", "non_finite", "too_large", "body_too_long"})


def _interrupted(exc: BaseException) -> bool:
    """Did the upload stop for a reason a resume can get past (the link, the round's state), as
    opposed to a refusal of the bytes themselves?"""
    return not (isinstance(exc, HubError) and exc.code in _CONTENT_CODES)


async def _receive_update(request: web.Request, hdr: UpdateHeader, layout: UpdateLayout, tmp: Path,
                          clock: BodyClock) -> None:
    """Read the body, hash it and check it against the model's manifest, then store it durably.

    Hashing, file writes, the manifest and finiteness checks and the fsync run in the I/O
    pool, never on the event loop, except for an update small enough to be packed
    (hub/storage/blobpack.py), checked on the loop. A small update is held in memory (creating a file
    costs ~1 ms); a large one streams into a file, hashed piece by piece as it arrives. A resumed one
    (``hdr.offset`` > 0) appends to the bytes an interrupted upload left there, hashed first.
    If the body stops short, what arrived is written before the error goes up (a resume starts
    after it).
    """
    app = request.app
    pool = app[IO_POOL]
    loop = asyncio.get_running_loop()
    blobs = app[BLOBS]
    size, sha = hdr.update_size, hdr.update_sha256
    small = size <= SMALL_UPDATE
    digest = hashlib.sha256()
    fh = None if small else await loop.run_in_executor(pool, _open_for_append, tmp, hdr.offset, digest)
    want = size - hdr.offset
    pieces, received = await _read_body(request, want, digest, fh, field="update_size", long_code="body_too_long",
                                        clock=clock)
    if received != want:
        raise BadRequest(f"body has {received} bytes, update_size - offset says {want}", code="size_mismatch")
    if small:
        body = b"".join(pieces)
        if blobs.packs(len(body)):
            # a packed update: checked here (a tenth of a millisecond, less than a hand-off to a
            # worker thread and back) and committed with the others arriving now, no thread held
            _check_update_bytes(body, sha, layout)
            await blobs.put_packed(body, sha)
        else:
            await loop.run_in_executor(pool, _ingest_update_bytes, body, sha, layout, blobs)
    else:
        if digest.hexdigest() != sha:
            raise Unprocessable("update bytes do not hash to update_sha256", code="hash_mismatch")
        await loop.run_in_executor(pool, _ingest_update_file, tmp, layout, blobs, sha)


async def _read_body(request: web.Request, want: int, digest: hashlib._Hash, fh: BinaryIO | None, *,
                     field: str, long_code: str, clock: BodyClock | None = None) -> tuple[list[bytes], int]:
    """Read a body of at most ``want`` bytes: into ``fh`` (then closed), hashed into ``digest``
    and written about a MiB at a time in the I/O pool, so that only that much is held in memory;
    with no file, into memory (the pieces returned, for the caller to hash). Returns the pieces
    held and the bytes received. A body that stops short has what came written before the error
    goes up (a resumed upload starts after it). ``clock``: told of each piece (linkmeter.py)."""
    app = request.app
    pool = app[IO_POOL]
    loop = asyncio.get_running_loop()
    pieces: list[bytes] = []
    received = buffered = 0
    try:
        while True:
            piece = await request.content.read(UPLOAD_READ)
            if clock is not None:
                clock.piece(len(piece))
            received += len(piece)
            if received > want:
                raise BadRequest(f"body is longer than {field}", code=long_code)
            if piece:
                pieces.append(piece)
                buffered += len(piece)
            if fh is not None and pieces and (buffered >= UPLOAD_READ or not piece):
                await loop.run_in_executor(pool, _hash_and_write, digest, fh, pieces)
                pieces, buffered = [], 0
            if not piece:
                break
    finally:
        if fh is not None:
            if pieces and received <= want:  # a body that stopped short: keep what came
                await loop.run_in_executor(pool, _hash_and_write, digest, fh, pieces)
            await loop.run_in_executor(pool, fh.close)
        app[METRICS].bytes_in += received
    return pieces, received


def _open_for_append(path: Path, offset: int, digest: hashlib._Hash) -> BinaryIO:
    """The update's file, positioned at ``offset`` with ``digest`` fed the bytes before it (a
    fresh upload, offset 0, starts it empty)."""
    if offset == 0:
        return open(path, "wb")
    fh = open(path, "r+b")
    while fh.tell() < offset:
        block = fh.read(min(UPLOAD_READ, offset - fh.tell()))
        if not block:
            break
        digest.update(block)
    fh.seek(offset)
    fh.truncate()
    return fh


def _hash_and_write(digest: hashlib._Hash, fh: BinaryIO, pieces: list[bytes]) -> None:
    for piece in pieces:
        digest.update(piece)
        fh.write(piece)


@routes.post("/v1/states")
async def state_upload(request: web.Request) -> web.Response:
    """A checkpoint state the referee asked for: signed StateUpload header, GFT1 bytes as the body.
    The bytes must hash to the state the node committed to in its update header."""
    app = request.app
    ledger = app[LEDGER]
    data = b64_header(request, "X-GPUFlex-State")
    hdr, signer = open_node_message(request, data, StateUpload)
    node = await ledger.registry.known_node(signer)
    r, expected, limit = ledger.states.begin_state(node, hdr)
    if request.content_length is None:
        raise LengthRequired("send the state with a Content-Length header", code="length_required")
    if request.content_length != hdr.state_size:
        raise BadRequest(f"Content-Length {request.content_length} differs from state_size {hdr.state_size}",
                         code="size_mismatch")
    if hdr.state_size > limit:
        raise PayloadTooLarge(f"a state of {hdr.state_size} bytes is larger than this model's can be ({limit})",
                              code="too_large")
    await _receive_state(request, hdr, expected)
    await ledger.states.accept_state(r, hdr.step, expected)
    return sealed_response(request, Ack(ok=True, detail=f"state of step {hdr.step} accepted", deadline=r.deadline))


async def _receive_state(request: web.Request, hdr: StateUpload, sha: str) -> None:
    """Read a state's body, check it and store it durably. A state up to SMALL_UPDATE bytes is
    held in memory; a larger one (a model's weights and optimizer state) streams into a temp file
    in the blob store's folder as updates do, hashed piece by piece, then is checked on a
    read-only map and moved into place: about a MiB of it is in memory at any time. A refused
    state leaves nothing behind."""
    app = request.app
    pool = app[IO_POOL]
    loop = asyncio.get_running_loop()
    blobs = app[BLOBS]
    size = hdr.state_size
    digest = hashlib.sha256()
    tmp = None if size <= SMALL_UPDATE else blobs.temp_path()
    try:
        fh = None if tmp is None else await loop.run_in_executor(pool, open, tmp, "wb")
        pieces, received = await _read_body(request, size, digest, fh, field="state_size", long_code="size_mismatch")
        if received != size:
            raise BadRequest(f"body has {received} bytes, state_size says {size}", code="size_mismatch")
        if tmp is None:
            await loop.run_in_executor(pool, _ingest_state, b"".join(pieces), sha, blobs)
            return
        if digest.hexdigest() != sha:
            raise Unprocessable("state bytes do not hash to state_sha256", code="hash_mismatch")
        await loop.run_in_executor(pool, _ingest_file, tmp, blobs, sha, _check_state)
    except BaseException:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise


@routes.post("/v1/states/unavailable")
async def state_unavailable(request: web.Request) -> web.Response:
    """The node no longer holds states the referee asked for: the referee decides at once."""
    msg, node = await _signed(request, StateUnavailable)
    detail = await request.app[LEDGER].states.decline_states(node, msg)
    return sealed_response(request, Ack(ok=True, detail=detail, deadline=0.0))


def _ingest_state(body: bytes, sha: str, blobs: BlobStore) -> None:
    """Hash, decode-check and store one state held in memory (worker thread)."""
    if hashlib.sha256(body).hexdigest() != sha:
        raise Unprocessable("state bytes do not hash to state_sha256", code="hash_mismatch")
    _check_state(body)
    blobs.put(body, sha=sha)


#: elements of a tensor checked for NaN and infinity at a time: the check's own memory is bounded
FINITE_BLOCK = 1 << 20


def _check_state(buf: bytes | mmap.mmap) -> None:
    """A state is GFT1 tensors, all finite (the caller closes a map once this returns: no view
    of it outlives this call, not even in a traceback)."""
    try:
        nonfinite = _nonfinite(buf)
    except ProtocolError as exc:
        raise Unprocessable(f"state is not a valid tensor state: {exc}", code="bad_state") from None
    if nonfinite is not None:
        raise Unprocessable(f"state is not a valid tensor state: tensor {nonfinite!r} contains NaN or infinite "
                            "values", code="bad_state")


def _nonfinite(buf: bytes | mmap.mmap) -> str | None:
    """The first floating tensor of a GFT1 state (viewed in place, no copy) holding NaN or
    infinity, tested FINITE_BLOCK elements at a time; None when all are finite."""
    for name, t in decode_state(buf).items():
        if t.is_floating_point():
            flat = t.reshape(-1)
            for i in range(0, flat.numel(), FINITE_BLOCK):
                if not bool(flat[i:i + FINITE_BLOCK].isfinite().all()):
                    return name
    return None


__all__ = ["protocol_to_hub", "routes"]
