"""HubClient: the node's thin HTTP adapter around the sans-I/O protocol.

Every request body is sealed with the node key; every 200 response must be sealed by
the pinned hub key (``open_sealed(..., signer=hub key)``), so a man in the middle can
neither forge work nor answers. HTTP failures map onto the node's error tree:

* connection errors, timeouts, 5xx, 429  -> HubUnavailable (retry with backoff)
* 401 unknown_node                        -> UnknownNode (re-register)
* 403 banned                              -> Banned (stop)
* any other 4xx                           -> HubError(code, status)
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, TypeVar

import aiohttp
from gpuflex.protocol.errors import ProtocolError, SignatureError
from gpuflex.protocol.messages import (
    Abandon,
    Ack,
    Assignment,
    BlobRequest,
    Heartbeat,
    Hello,
    NoWork,
    SiloQuery,
    SiloRegistration,
    SiloSchema,
    SiloWithdrawal,
    StageAssignment,
    StageReport,
    StateRequest,
    StateUnavailable,
    StateUpload,
    UnitCheckpoint,
    UpdateHeader,
    UploadOffset,
    Welcome,
    WorkRequest,
)
from gpuflex.protocol.signing import SigningKey, new_nonce, open_sealed, seal

from .cache import BlobWriter
from .errors import (
    AssignmentRejected,
    BadSignature,
    Banned,
    BlobError,
    HubError,
    HubUnavailable,
    UnknownNode,
)

M = TypeVar("M")
UPLOAD_PIECE = 1 << 20  # an upload that reports progress goes out this many bytes at a time

MAX_RESPONSE_BYTES = 2 << 20  # sealed control messages are <= 1 MiB
INLINE_MODEL_MAX = 1 << 20  # a model this small may come inside the work answer (no extra request)
_NET_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, OSError)


class Backoff:
    """Exponential backoff with jitter: base * 2**n capped, half fixed, half random."""

    def __init__(self, base: float = 0.5, cap: float = 30.0, rng: random.Random | None = None) -> None:
        self.base = base
        self.cap = cap
        self.attempt = 0
        self._rng = rng or random.Random()

    def next_delay(self) -> float:
        ceiling = min(self.cap, self.base * float(2 ** min(self.attempt, 30)))
        self.attempt += 1
        return ceiling / 2 + self._rng.uniform(0, ceiling / 2)

    def reset(self) -> None:
        self.attempt = 0


async def _read_limited(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    if resp.content_length is not None and resp.content_length > limit:
        raise HubError(f"hub answer of {resp.content_length} bytes exceeds {limit}", code="too_large")
    buf = bytearray()
    async for block in resp.content.iter_chunked(1 << 16):
        buf += block
        if len(buf) > limit:
            raise HubError(f"hub answer exceeds {limit} bytes", code="too_large")
    return bytes(buf)


def _error_from(status: int, body: bytes, what: str) -> Exception:
    code, detail = "", ""
    try:
        obj = json.loads(body.decode("utf-8", "replace"))
        if isinstance(obj, dict):
            code = str(obj.get("error", ""))[:64]
            detail = str(obj.get("detail", ""))[:300]
    except ValueError:
        detail = body[:200].decode("utf-8", "replace")
    message = f"{what}: hub answered {status} {code or ''} {detail}".strip()
    if status >= 500 or status in (408, 429):
        return HubUnavailable(message)
    if status == 401 and code in ("unknown_node", ""):
        return UnknownNode(message, code=code or "unknown_node", status=status)
    if status == 403 and code == "banned":
        return Banned(message, code=code, status=status)
    return HubError(message, code=code, status=status)


class HubClient:
    def __init__(
        self,
        base_url: str,
        key: SigningKey,
        session: aiohttp.ClientSession,
        *,
        hub_public_key: bytes | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.key = key
        self.session = session
        self.hub_public_key = hub_public_key
        self.clock_offset = 0.0  # hub time - our time, learned at registration
        self.requests = 0

    # -- helpers --------------------------------------------------------------------------

    def now(self) -> float:
        return time.time() + self.clock_offset

    def _url(self, path: str) -> str:
        return f"{self.base_url}{path}"

    def _open(self, data: bytes, expected: type[M]) -> M:
        if self.hub_public_key is None:
            raise HubError("hub key not pinned yet")
        msg: M = open_sealed(data, expected, signer=self.hub_public_key)[0]
        return msg

    async def _post(self, path: str, msg: object, *, limit_s: float = 30.0) -> bytes:
        data, _ = await self._post_full(path, msg, limit_s=limit_s)
        return data

    async def _post_full(
        self, path: str, msg: object, *, limit_s: float = 30.0, headers: Mapping[str, str] | None = None,
        max_bytes: int = MAX_RESPONSE_BYTES,
    ) -> tuple[bytes, Mapping[str, str]]:
        body = seal(self.key, msg)
        self.requests += 1
        try:
            async with self.session.post(
                self._url(path),
                data=body,
                headers={"Content-Type": "application/x-msgpack", **(headers or {})},
                timeout=aiohttp.ClientTimeout(total=limit_s),
            ) as resp:
                data = await _read_limited(resp, max_bytes)
                if resp.status != 200:
                    raise _error_from(resp.status, data, f"POST {path}")
                return data, resp.headers
        except _NET_ERRORS as exc:
            raise HubUnavailable(f"POST {path}: {type(exc).__name__}: {exc}"[:300]) from exc

    def _signed_answer(self, data: bytes, expected: type[M], what: str) -> M:
        try:
            return self._open(data, expected)
        except ProtocolError as exc:
            raise HubError(f"{what}: answer not valid from the pinned hub: {exc}", code="bad_answer") from exc

    # -- calls ------------------------------------------------------------------------------

    async def hub_info(self) -> tuple[bytes, str, int]:
        """GET /v1/hub -> (public key, claimed fingerprint, protocol version)."""
        self.requests += 1
        sent = time.time()
        try:
            async with self.session.get(
                self._url("/v1/hub"), timeout=aiohttp.ClientTimeout(total=15)
            ) as resp:
                data = await _read_limited(resp, 64 << 10)
                if resp.status != 200:
                    raise _error_from(resp.status, data, "GET /v1/hub")
        except _NET_ERRORS as exc:
            raise HubUnavailable(f"GET /v1/hub: {type(exc).__name__}: {exc}"[:300]) from exc
        try:
            obj = json.loads(data)
            pk = bytes.fromhex(str(obj["public_key"]))
            info = pk, str(obj["fingerprint"]), int(obj["protocol_version"])
        except (ValueError, KeyError, TypeError) as exc:
            raise HubError(f"GET /v1/hub: malformed answer ({exc})", code="bad_answer") from exc
        # the hub's clock, for what this client signs before it registers (`gpuflex-node data add`
        # and `data remove` on a machine whose clock is off); registration's signed time replaces it
        server_time = obj.get("server_time")
        if isinstance(server_time, int | float) and math.isfinite(server_time):
            self.clock_offset = float(server_time) - (sent + (time.time() - sent) / 2)
        return info

    async def register(self, hello: Hello) -> Welcome:
        sent = time.time()
        data = await self._post("/v1/nodes/register", hello)
        welcome = self._signed_answer(data, Welcome, "register")
        rtt = time.time() - sent
        self.clock_offset = welcome.server_time - (sent + rtt / 2)
        return welcome

    async def request_work(
        self, wait_s: float, cached: list[str]
    ) -> tuple[Assignment | StageAssignment | NoWork | StateRequest, bytes | None]:
        """The hub's answer, and the model's bytes when the hub sent them inline (unchecked here:
        the caller matches them against the assignment's model_hash)."""
        req = WorkRequest(
            timestamp=self.now(), nonce=new_nonce(), wait_s=wait_s, cached_chunks=tuple(cached[:4096])
        )
        data, headers = await self._post_full(
            "/v1/work", req, limit_s=wait_s + 30.0, headers={"X-GPUFlex-Inline-Max": str(INLINE_MODEL_MAX)},
            max_bytes=MAX_RESPONSE_BYTES + INLINE_MODEL_MAX,
        )
        inline: bytes | None = None
        split = headers.get("X-GPUFlex-Sealed-Length")
        if split is not None:
            if not split.isdigit() or not 0 < int(split) < len(data):
                raise HubError(f"work answer has a bad X-GPUFlex-Sealed-Length {split[:20]!r}", code="bad_answer")
            data, inline = data[: int(split)], data[int(split) :]
        if len(data) > MAX_RESPONSE_BYTES:
            raise HubError("work answer is larger than a sealed message may be", code="bad_answer")
        return self._open_work_answer(data), inline

    def _open_work_answer(self, data: bytes) -> Assignment | StageAssignment | NoWork | StateRequest:
        if self.hub_public_key is None:
            raise HubError("hub key not pinned yet")
        # The signature's domain names the kind, so try each kind against the pinned key.
        try:
            msg, _ = open_sealed(data, Assignment, signer=self.hub_public_key)
            return msg
        except SignatureError:
            pass
        except ProtocolError as exc:
            raise AssignmentRejected(f"assignment refused: {exc}") from exc
        try:
            stage, _ = open_sealed(data, StageAssignment, signer=self.hub_public_key)
            return stage
        except SignatureError:
            pass
        except ProtocolError as exc:
            raise AssignmentRejected(f"stage assignment refused: {exc}") from exc
        try:
            asked, _ = open_sealed(data, StateRequest, signer=self.hub_public_key)
            return asked
        except SignatureError:
            pass
        except ProtocolError as exc:
            raise HubError(f"state request refused: {exc}", code="bad_answer") from exc
        try:
            nowork, _ = open_sealed(data, NoWork, signer=self.hub_public_key)
            return nowork
        except ProtocolError as exc:
            raise BadSignature(
                f"work answer refused: its signature does not verify with the pinned hub key ({exc})"
            ) from exc

    async def heartbeat(self, assignment_id: str, progress: float, steps: int = 0,
                        digest: bytes = bytes(32)) -> Ack:
        msg = Heartbeat(
            assignment_id=assignment_id, progress=max(0.0, min(1.0, progress)),
            timestamp=self.now(), nonce=new_nonce(), steps=steps, digest=digest,
        )
        return self._signed_answer(await self._post("/v1/heartbeat", msg, limit_s=15), Ack, "heartbeat")

    async def abandon(self, assignment_id: str, reason: str, *, limit_s: float = 10.0) -> Ack:
        msg = Abandon(assignment_id=assignment_id, reason=reason[:256], timestamp=self.now(), nonce=new_nonce())
        return self._signed_answer(await self._post("/v1/abandon", msg, limit_s=limit_s), Ack, "abandon")

    async def stage_message(self, msg: StageReport | UnitCheckpoint, body: bytes = b"") -> Ack:
        """A pipeline stage's report (POST /v1/pipeline/report: the Ack's ok=False ends the stage's
        generation), or one unit's checkpoint (POST /v1/pipeline/checkpoint: the signed header in
        X-GPUFlex-Auth, the GFT1 state as ``body``; answered once the hub holds it durably)."""
        if isinstance(msg, UnitCheckpoint):
            return await self._post_sealed("/v1/pipeline/checkpoint", "X-GPUFlex-Auth", seal(self.key, msg), body,
                                           "unit checkpoint")
        data = await self._post("/v1/pipeline/report", msg, limit_s=15.0)
        return self._signed_answer(data, Ack, "stage report")

    async def silo_schema(self, job_id: str) -> SiloSchema:
        """POST /v1/silos/schema: what a node-local job's silo must hold (its model's input and
        outputs, the sample bounds, whether it asks for a label histogram, the blob this node
        attached)."""
        msg = SiloQuery(job_id=job_id, timestamp=self.now(), nonce=new_nonce())
        schema = self._signed_answer(await self._post("/v1/silos/schema", msg), SiloSchema, "silo schema")
        if schema.job_id != job_id:
            raise HubError(f"silo schema: asked for job {job_id}, the hub answered for {schema.job_id}",
                           code="bad_answer")
        return schema

    async def register_silo(self, job_id: str, sha256: str, size: int, samples: int,
                            histogram: tuple[int, ...] = ()) -> Ack:
        """POST /v1/silos: attach this node's silo to a node-local job. All that leaves the node
        about its rows: the blob id, its size, the sample count and ``histogram`` (empty: not
        shared)."""
        msg = SiloRegistration(job_id=job_id, sha256=sha256, size=size, samples=samples, timestamp=self.now(),
                               nonce=new_nonce(), label_histogram=tuple(histogram))
        return self._signed_answer(await self._post("/v1/silos", msg), Ack, "silo registration")

    async def withdraw_silo(self, job_id: str, sha256: str, *, limit_s: float = 10.0) -> Ack:
        """POST /v1/silos/withdraw: the operator removed this node's silo ``sha256`` of a node-local
        job; the hub stops assigning it (idempotent: the Ack's detail says what it did)."""
        msg = SiloWithdrawal(job_id=job_id, sha256=sha256, timestamp=self.now(), nonce=new_nonce())
        return self._signed_answer(await self._post("/v1/silos/withdraw", msg, limit_s=limit_s), Ack,
                                   "silo withdrawal")

    async def download_blob(
        self,
        sha256: str,
        writer: BlobWriter,
        *,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        """Stream one blob into ``writer`` (resuming at writer.offset with Range).

        Never holds more than one network block in memory; the writer refuses any byte
        beyond the declared size. Raises HubUnavailable on network errors (the partial
        file stays for a resume), BlobError on size/hash failure.
        """
        headers = self._blob_auth(sha256)
        if writer.offset:
            headers["Range"] = f"bytes={writer.offset}-"
        self.requests += 1
        try:
            async with self.session.get(
                self._url(f"/v1/blobs/{sha256}"),
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=15, sock_read=60),
            ) as resp:
                if resp.status == 200 and writer.offset:
                    writer.restart()  # the hub ignored Range: take the whole blob
                elif resp.status == 206:
                    start = _range_start(resp.headers.get("Content-Range", ""))
                    if start != writer.offset:
                        writer.restart()
                        raise HubUnavailable(f"blob {sha256[:12]}…: unexpected Content-Range; restarting")
                elif resp.status == 416:
                    writer.restart()
                    raise HubUnavailable(f"blob {sha256[:12]}…: range not satisfiable; restarting")
                elif resp.status != 200:
                    raise _error_from(resp.status, await _read_limited(resp, 64 << 10), f"GET blob {sha256[:12]}")
                remaining = writer.size - writer.offset
                if resp.content_length is not None and resp.content_length > remaining:
                    writer.abort(keep_partial=False)
                    raise BlobError(
                        f"blob {sha256[:12]}… is larger than declared: the hub sends "
                        f"{resp.content_length} bytes, {remaining} expected; refused"
                    )
                async for block in resp.content.iter_chunked(1 << 20):
                    # hashing and writing a block is the writer's work: off the event loop
                    await asyncio.to_thread(writer.write, block)
                    if on_bytes is not None:
                        on_bytes(len(block))
        except _NET_ERRORS as exc:
            raise HubUnavailable(f"GET blob {sha256[:12]}: {type(exc).__name__}: {exc}"[:300]) from exc

    async def upload_update(self, header: UpdateHeader, body: bytes | memoryview,
                            on_bytes: Callable[[int], None] | None = None) -> Ack:
        """POST the update's bytes from ``header.offset`` on (``body`` is just those);
        ``on_bytes(n)`` as each MiB goes out."""
        return await self._post_sealed("/v1/updates", "X-GPUFlex-Update", seal(self.key, header), body, "upload",
                                       on_bytes=on_bytes)

    def _blob_auth(self, sha256: str) -> dict[str, str]:
        """The X-GPUFlex-Auth header of a blob read: a fresh signed BlobRequest for ``sha256``."""
        req = BlobRequest(sha256=sha256, timestamp=self.now(), nonce=new_nonce())
        return {"X-GPUFlex-Auth": base64.urlsafe_b64encode(seal(self.key, req)).decode("ascii")}

    async def download_delta(self, sha256: str, base: str, limit: int) -> bytes:
        """Model ``sha256`` as a delta from ``base`` (protocol/blobdelta.py), at most ``limit``
        bytes; HubError ``no_delta`` when the hub has none to give."""
        self.requests += 1
        try:
            async with self.session.get(
                self._url(f"/v1/blobs/{sha256}/from/{base}"), headers=self._blob_auth(sha256),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=15, sock_read=60),
            ) as resp:
                data = await _read_limited(resp, limit)
                if resp.status != 200:
                    raise _error_from(resp.status, data, f"GET delta {sha256[:12]}")
                return data
        except _NET_ERRORS as exc:
            raise HubUnavailable(f"GET delta {sha256[:12]}: {type(exc).__name__}: {exc}"[:300]) from exc

    async def upload_offset(self, header: UpdateHeader) -> UploadOffset:
        """How many leading bytes of this update an interrupted upload left with the hub."""
        return await self._post_sealed("/v1/updates/offset", "X-GPUFlex-Update", seal(self.key, header), b"",
                                       "upload offset", UploadOffset)

    async def upload_state(self, header: StateUpload, body: bytes) -> Ack:
        """Hand over one committed checkpoint state the hub's referee asked for."""
        return await self._post_sealed("/v1/states", "X-GPUFlex-State", seal(self.key, header), body,
                                       "state upload")

    async def states_unavailable(self, msg: StateUnavailable) -> Ack:
        """Say that states the referee asked for are no longer kept (it decides without them)."""
        return self._signed_answer(await self._post("/v1/states/unavailable", msg), Ack, "state unavailable")

    async def _post_sealed(self, path: str, header_name: str, sealed: bytes, body: bytes | memoryview,
                           what: str, answer: type[M] = Ack,  # type: ignore[assignment]
                           on_bytes: Callable[[int], None] | None = None) -> M:
        """POST raw bytes with their signed header (base64 in ``header_name``); the hub's signed
        answer (an Ack unless ``answer`` says otherwise). With ``on_bytes`` the body goes out a
        MiB at a time (with its Content-Length, never chunked), reporting each."""
        token = base64.urlsafe_b64encode(sealed).decode("ascii")
        self.requests += 1
        headers = {header_name: token, "Content-Type": "application/octet-stream"}
        data: Any = body
        if on_bytes is not None:
            view = memoryview(body).cast("B")
            headers["Content-Length"] = str(len(view))

            async def pieces() -> AsyncIterator[memoryview]:
                for at in range(0, len(view), UPLOAD_PIECE):
                    piece = view[at : at + UPLOAD_PIECE]
                    yield piece
                    on_bytes(len(piece))

            data = pieces()
        try:
            async with self.session.post(
                self._url(path),
                data=data,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=15, sock_read=120),
            ) as resp:
                data = await _read_limited(resp, MAX_RESPONSE_BYTES)
                if resp.status != 200:
                    raise _error_from(resp.status, data, f"POST {path}")
        except _NET_ERRORS as exc:
            raise HubUnavailable(f"POST {path}: {type(exc).__name__}: {exc}"[:300]) from exc
        return self._signed_answer(data, answer, what)


def _range_start(content_range: str) -> int:
    # "bytes START-END/TOTAL"
    try:
        unit, rest = content_range.split(" ", 1)
        if unit != "bytes":
            return -1
        return int(rest.split("-", 1)[0])
    except ValueError:
        return -1


def json_error_detail(exc: BaseException) -> dict[str, Any]:
    """Fields describing an exception for an event line."""
    out: dict[str, Any] = {"error": type(exc).__name__, "detail": str(exc)[:300]}
    code = getattr(exc, "code", "")
    if code:
        out["code"] = code
    return out
