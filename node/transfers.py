"""Moving bytes between the hub and the node: downloads checked by sha256, the update upload.

* Downloads: the blobs an assignment names that the cache lacks (never a chunk that is one of
  this node's silos: that one is on its disk, node/silos.py), a few at a time, each
  streamed into ``partial/`` and hashed as it arrives, resumed with Range after a dropped
  connection, and visible in the cache only once its sha256 matched (``BlobWriter``).
* Upload: the update is encoded and hashed once, then offered until the hub answers:
  network errors retry with backoff until the deadline, a hub that forgot the node gets it
  registered again and the same update once more, a fresh header called a replay (the
  hub restarted an instant ago) is signed again once.

Hashing and file I/O run in worker threads (``asyncio.to_thread``): re-hashing a resumed
partial download, hashing each received block, hashing a cached blob from an earlier run,
encoding and hashing the update. The event loop keeps answering heartbeats and the
control endpoint meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Container
from dataclasses import dataclass, field

from gpuflex.protocol.blobdelta import apply_delta
from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.messages import Ack, Assignment, UpdateHeader
from gpuflex.protocol.signing import new_nonce
from gpuflex.protocol.tensors import StateEncoder, sha256_hex

from .cache import BlobCache
from .client import Backoff, HubClient, json_error_detail
from .errors import BlobError, HubError, HubUnavailable, UnknownNode
from .modelpath import ModelPath
from .output import Output
from .pause import PauseState
from .totals import Totals
from .trainer import TrainResult

log = logging.getLogger(__name__)

DOWNLOADS_IN_FLIGHT = 4  # round trips overlap, memory stays bounded
DOWNLOAD_ATTEMPTS = 6
#: a transfer at least this big reports its progress (a `progress` event), at most every
#: PROGRESS_EVERY_S and once more when it is complete
PROGRESS_MIN_BYTES = 1 << 20
PROGRESS_EVERY_S = 1.0


class TransferProgress:
    """Counts one transfer's bytes and says how far it is: ``progress`` events with what moves
    (upload | download), the blob, the bytes so far (a resumed transfer starts at its offset)
    and the total; quiet below PROGRESS_MIN_BYTES."""

    def __init__(self, output: Output, what: str, sha256: str, total: int, start: int = 0) -> None:
        self.output, self.what, self.sha256, self.total = output, what, sha256, total
        self.done = start
        self._last = time.monotonic()
        self._loud = total >= PROGRESS_MIN_BYTES

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self._loud and (self.done >= self.total or now - self._last >= PROGRESS_EVERY_S):
            self._last = now
            self.output.event("progress", what=self.what, sha256=self.sha256, bytes=self.done, total=self.total,
                              percent=round(100.0 * self.done / self.total, 1) if self.total else 100.0)


@dataclass(frozen=True)
class Uploaded:
    """The hub's answer to an update it took, and what was sent."""

    ack: Ack
    sha256: str
    size: int


class Transfers:
    """Downloads and uploads for one node; counts bytes into ``totals``."""

    def __init__(
        self,
        cache: BlobCache,
        totals: Totals,
        output: Output,
        pause: PauseState,
        *,
        backoff_base_s: float,
        backoff_cap_s: float,
    ) -> None:
        self.cache = cache
        self.totals = totals
        self.output = output
        self.pause = pause
        self._backoff_base_s = backoff_base_s
        self._backoff_cap_s = min(backoff_cap_s, 10.0)
        self._encoder = StateEncoder()
        self._last_model: str | None = None
        #: whole model or delta, by what each took last (node/modelpath.py)
        self.model_path = ModelPath()

    # ---------------------------------------------------------------- downloads

    async def accept_inline_model(self, a: Assignment, data: bytes) -> None:
        """Cache a model that came with the assignment, if it is the one the assignment names.

        Anything else is dropped with an event and the model is downloaded as usual.
        """
        if self.cache.has(a.model_hash, a.model_size):
            return
        if len(data) != a.model_size:
            self.output.event("inline_model_refused", assignment_id=a.assignment_id,
                              detail=f"{len(data)} bytes, the assignment says {a.model_size}")
            return

        def store() -> None:
            writer = self.cache.writer(a.model_hash, a.model_size, resume=False)
            writer.write(data)
            writer.commit()  # checks the sha256 against the signed model_hash

        try:
            await asyncio.to_thread(store)
        except BlobError as exc:
            self.output.event("inline_model_refused", assignment_id=a.assignment_id, detail=str(exc))
            return
        self.totals.bytes_downloaded += len(data)

    async def fetch_all(self, client: HubClient, a: Assignment, *, local: Container[str] = frozenset()) -> int:
        """Download the model and the chunks the cache lacks; return the bytes fetched.

        A chunk in ``local`` is one of this node's silos (node/silos.py): read from its disk
        later, never downloaded (the hub does not have it)."""
        wanted = [(a.model_hash, a.model_size, "model")] + [(c.sha256, c.size, "chunk") for c in a.chunks
                                                             if c.sha256 not in local]
        missing = []
        for sha, size, kind in wanted:
            # A blob left by an earlier run is re-hashed once before use (the cache does not fsync).
            if self.cache.has(sha, size) and (
                sha in self.cache.verified or await asyncio.to_thread(self.cache.verify, sha)
            ):
                self.cache.touch(sha)
            else:
                missing.append((sha, size, kind))
        previous = self._last_model
        by_delta = 0
        if (previous is not None and previous != a.model_hash and any(k == "model" for _, _, k in missing)
                and self.model_path.choose() == "delta"):
            # the node holds last round's model: ask for this one as a delta from it
            t0 = time.perf_counter()
            by_delta = await self.model_from_delta(client, a, previous)
            if by_delta:
                self.model_path.record("delta", time.perf_counter() - t0, a.model_size)
                missing = [m for m in missing if m[2] != "model"]
        if previous is not None and previous != a.model_hash:
            self.cache.discard(previous)  # a model blob serves one round: do not let them pile up
        self._last_model = a.model_hash
        silo_chunks = len(a.chunks) + 1 - len(wanted)
        self.output.event("cache", assignment_id=a.assignment_id, hits=len(wanted) - len(missing),
                          misses=len(missing), **({"silo_chunks": silo_chunks} if silo_chunks else {}))
        fetched = by_delta
        gate = asyncio.Semaphore(DOWNLOADS_IN_FLIGHT)

        async def one(sha: str, size: int, kind: str) -> None:
            nonlocal fetched
            async with gate:
                t0 = time.perf_counter()
                got = await self.download(client, sha, size)
            if kind == "model" and got == size:
                self.model_path.record("whole", time.perf_counter() - t0, size)
            fetched += got
            self.output.event("download", assignment_id=a.assignment_id, sha256=sha, kind=kind, bytes=got)

        try:
            async with asyncio.TaskGroup() as tg:
                for sha, size, kind in missing:
                    tg.create_task(one(sha, size, kind))
        except BaseExceptionGroup as group:
            # Surface the first failure as itself so the callers' except clauses apply.
            first = group.exceptions[0]
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from None
        return fetched

    async def model_from_delta(self, client: HubClient, a: Assignment, base: str) -> int:
        """Make the assignment's model from the cached ``base`` and the hub's delta; the delta's
        bytes once the model is in the cache, checked against the signed model_hash (0: not done;
        any failure, no delta, a bad one, the network, leaves the whole download to the caller)."""
        if not self.cache.has(base):
            return 0
        try:
            delta = await client.download_delta(a.model_hash, base, a.model_size + (64 << 10))
        except (HubError, HubUnavailable) as exc:
            if getattr(exc, "code", "") != "no_delta":
                self.output.event("error", assignment_id=a.assignment_id, **json_error_detail(exc),
                                  action="download the whole model")
            return 0

        def build() -> None:
            model = apply_delta(self.cache.touch(base).read_bytes(), delta)
            writer = self.cache.writer(a.model_hash, a.model_size, resume=False)
            writer.write(model)
            writer.commit()  # checks the sha256 against the signed model_hash

        try:
            await asyncio.to_thread(build)
        except (BlobError, ProtocolError, OSError) as exc:
            self.output.event("error", assignment_id=a.assignment_id, **json_error_detail(exc),
                              action="download the whole model")
            return 0
        self.totals.bytes_downloaded += len(delta)
        self.output.event("download", assignment_id=a.assignment_id, sha256=a.model_hash, kind="model",
                          bytes=len(delta), delta_from=base, model_bytes=a.model_size)
        return len(delta)

    async def download(self, client: HubClient, sha: str, size: int) -> int:
        """One blob into the cache, resuming a partial file; bytes received."""
        backoff = Backoff(self._backoff_base_s, self._backoff_cap_s)
        got = 0

        meter: TransferProgress | None = None

        def count(n: int) -> None:
            nonlocal got
            got += n
            self.totals.bytes_downloaded += n
            if meter is not None:
                meter.add(n)

        for attempt in range(DOWNLOAD_ATTEMPTS):
            # Opening a resumable writer re-hashes the partial file: a worker thread's job.
            writer = await asyncio.to_thread(self.cache.writer, sha, size, resume=True)
            meter = TransferProgress(self.output, "download", sha, size, writer.offset)
            try:
                await client.download_blob(sha, writer, on_bytes=count)
                await asyncio.to_thread(writer.commit)
                return got
            except HubUnavailable:
                writer.abort(keep_partial=True)
                if attempt == DOWNLOAD_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(backoff.next_delay())
            except BaseException:
                writer.abort(keep_partial=True)
                raise
        return got

    # ---------------------------------------------------------------- upload

    async def upload(
        self,
        client: HubClient,
        a: Assignment,
        result: TrainResult,
        *,
        download_s: float,
        deadline: Callable[[], float],
        reregister: Callable[[], Awaitable[bool]],
    ) -> Uploaded | None:
        """Offer the update until the hub takes it (Uploaded) or refuses it (None, counted).

        ``deadline()`` is the assignment's current deadline (heartbeats extend it);
        ``reregister()`` registers the node again, False when it cannot.
        """
        t0 = time.perf_counter()

        def encode() -> tuple[memoryview | bytes, str]:
            # One buffer reused every round: a fresh 100 MB one costs more in page faults than the copy.
            body = self._encoder.encode(result.delta)
            return body, sha256_hex(body)

        body, digest = await asyncio.to_thread(encode)
        timings = {"train_s": result.train_s, "download_s": download_s, "encode_s": time.perf_counter() - t0}
        return await _Upload(self, client, a, result, memoryview(body).cast("B"), digest, timings,
                             deadline, reregister).run()

    def _refused(self, a: Assignment, exc: Exception) -> None:
        self.totals.rejected += 1
        self.output.event("rejected", assignment_id=a.assignment_id, **json_error_detail(exc))


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0


@dataclass
class _Upload:
    """One update offered until the hub takes or refuses it: a dropped line resumes from what
    the hub holds (POST /v1/updates/offset), a forgotten node registers again once, a header
    called a replay is signed again once, and a resumed upload whose hash fails is sent whole
    once more."""

    transfers: Transfers
    client: HubClient
    a: Assignment
    result: TrainResult
    view: memoryview
    digest: str
    timings: dict[str, float]
    deadline: Callable[[], float]
    reregister: Callable[[], Awaitable[bool]]
    offset: int = 0  # what the hub holds of this update
    reregistered: bool = False
    resigned: bool = False
    restarted: bool = False  # a resumed upload that failed its hash was sent again from byte 0
    mismatches: int = 0
    backoff: Backoff = field(init=False)

    def __post_init__(self) -> None:
        self.backoff = Backoff(self.transfers._backoff_base_s, self.transfers._backoff_cap_s)

    def header_at(self, at: int) -> UpdateHeader:
        r = self.result
        return UpdateHeader(
            assignment_id=self.a.assignment_id, update_sha256=self.digest, update_size=len(self.view),
            sample_count=r.sample_count, metrics={"loss": _finite(r.loss)}, timings=self.timings,
            timestamp=self.client.now(), nonce=new_nonce(), commitment=r.commitment, offset=at,
        )

    async def _pause_for(self, delay: float) -> None:
        await self.transfers.pause.interruptible(asyncio.sleep(delay))

    async def _wait_or_give_up(self, exc: HubUnavailable) -> None:
        if self.client.now() > self.deadline() or self.transfers.pause.exiting:
            raise exc
        delay = self.backoff.next_delay()
        self.transfers.output.event("error", **json_error_detail(exc), retry_in_s=round(delay, 2))
        await self._pause_for(delay)

    async def _resume_point(self) -> bool:
        """After a dropped line the hub kept what arrived: ask how much (False: ask again)."""
        try:
            held = (await self.client.upload_offset(self.header_at(0))).offset
        except HubUnavailable as exc:
            await self._wait_or_give_up(exc)
            return False
        except HubError as exc:
            if exc.code == "busy" and self.client.now() <= self.deadline() and not self.transfers.pause.exiting:
                # the hub is still closing the interrupted upload: ask again shortly
                await self._pause_for(self.backoff.next_delay())
                return False
            held = 0  # the upload itself says what is wrong
        self.offset = held if 0 <= held <= len(self.view) else 0
        if self.offset:
            self.transfers.output.event("resume", assignment_id=self.a.assignment_id, offset=self.offset,
                                        size=len(self.view))
        return True

    async def run(self) -> Uploaded | None:
        ask_offset = False
        while True:
            if ask_offset and not await self._resume_point():
                continue
            ask_offset = False
            meter = TransferProgress(self.transfers.output, "upload", self.digest, len(self.view), self.offset)
            try:
                ack = await self.client.upload_update(self.header_at(self.offset), self.view[self.offset:],
                                                      on_bytes=meter.add)
            except HubUnavailable as exc:
                await self._wait_or_give_up(exc)
                ask_offset = True
                continue
            except UnknownNode as exc:
                if not await self._registered_again(exc):
                    return None
                ask_offset = True
                continue
            except HubError as exc:
                retry = await self._retry_after(exc)
                if retry is None:
                    self.transfers._refused(self.a, exc)
                    return None
                ask_offset = retry
                continue
            self.transfers.totals.bytes_uploaded += len(self.view) - self.offset
            return Uploaded(ack=ack, sha256=self.digest, size=len(self.view))

    async def _registered_again(self, exc: UnknownNode) -> bool:
        """The hub forgot us (restarted with a fresh node table): register again and offer the
        same update once more; the hub decides whether it is still wanted."""
        if self.reregistered:
            self.transfers._refused(self.a, exc)
            return False
        self.reregistered = True
        self.transfers.output.event("error", **json_error_detail(exc), action="re-register")
        if not await self.transfers.pause.interruptible(self.reregister()):
            self.transfers._refused(self.a, exc)
            return False
        return True

    async def _retry_after(self, exc: HubError) -> bool | None:
        """Whether a refusal is worth another try: None to give up, else whether to ask the hub
        how much it holds first."""
        out = self.transfers.output
        if exc.code == "replay" and not self.resigned:
            # Our own fresh header called a replay: the hub restarted an instant ago (it refuses
            # anything signed before its start) or the clocks disagree. Signing again is always
            # safe: the hub accepts one update per assignment.
            self.resigned = True
            out.event("error", **json_error_detail(exc), action="sign again")
            await self._pause_for(0.5)
            return True
        if exc.code in ("offset_mismatch", "busy") and self.mismatches < 3:
            self.mismatches += 1  # the hub holds another count than we thought: ask again
            await self._pause_for(self.backoff.next_delay())
            return True
        if exc.code == "hash_mismatch" and self.offset > 0 and not self.restarted:
            # what the hub kept did not add up (it dropped it): the whole update once more
            self.restarted = True
            self.offset = 0
            out.event("error", **json_error_detail(exc), action="send the whole update again")
            return False
        return None


__all__ = ["Transfers", "Uploaded"]
