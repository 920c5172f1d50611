"""Content-addressed blob store: the local disk (`BlobStore`), or an S3-compatible bucket
(`hub/storage/blobs_s3.py`'s `S3BlobStore`, a subclass: `open_blob_store` in hub/storage/backend.py picks by the hub's config).

A blob's id is the sha256 hex of its bytes. A small one (up to `packed_max`) is packed into
`pack.sqlite3` (hub/storage/blobpack.py), where the blobs that arrive together share one commit. A larger
one goes to a temporary name in `tmp/`, is fsynced, renamed into place and the directory is
fsynced. Either way a blob that exists under its id is complete and survives a crash.

Small blobs that were just written or read (a round's model, which every node fetches
next) are also kept in a bounded in-memory cache, so serving them costs no file open.

The contract both stores keep (tests/test_blobs_s3.py runs it on each): `put`, `put_many` and
`commit_temp` return only once the blob is durable where the store keeps it; `path` gives a local
file holding a stored blob's bytes (a missing blob: a path where no file is; a packed one is
written out to `unpacked/` first); `small`, the bytes of a blob held in memory or packed, with no
file made; `has`, `read`, `read_private`; `discard`, which drops blobs nothing refers to any
more; `temp_path` and `partial_path`, the local working area of uploads.
"""

from __future__ import annotations

import hashlib
import itertools
import mmap
import os
import re
import secrets
import threading
from collections import OrderedDict
from pathlib import Path

from gpuflex.protocol.messages import ID_RE

from ..base.errors import BadRequest, HubError, NotFound
from .blobpack import PACK_FILE, BlobPack

_BLOB_ID = re.compile(r"[0-9a-f]{64}")
HOT_BLOB_MAX = 1 << 20  # blobs up to this size are kept in memory...
HOT_TOTAL_MAX = 64 << 20  # ...up to this many bytes in all (least recently used dropped first)
#: blobs up to this size are packed (hub/storage/blobpack.py says why this size)
PACKED_MAX = 64 << 10


def is_blob_id(value: str) -> bool:
    return bool(_BLOB_ID.fullmatch(value))


def check_blob_id(value: str) -> str:
    """Refuse anything that is not 64 lowercase hex before it can touch a path."""
    if not is_blob_id(value):
        raise BadRequest("blob id must be 64 lowercase hex characters", code="bad_blob_id")
    return value


class BlobStoreUnavailable(HubError):
    """The blob store cannot be used: a bad --blobs URL, an unreachable or refusing bucket, a
    blob whose bytes in the bucket do not hash to its id. One line naming the endpoint and bucket."""

    status = 503
    code = "blob_store_unavailable"


_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_PREFIX = re.compile(r"[A-Za-z0-9!_.*'()/-]{1,512}")


def parse_blobs_url(url: str) -> tuple[str, str]:
    """(bucket, key prefix) of ``s3://BUCKET[/PREFIX]``; the prefix defaults to ``blobs``.
    BlobStoreUnavailable (one line) for anything else."""
    usage = "--blobs takes s3://BUCKET[/PREFIX] (leave it out to keep blobs in the folder blobs/ under --data)"
    if not url.startswith("s3://"):
        raise BlobStoreUnavailable(f"{usage}, not {url[:200]!r}", code="bad_blobs_url")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    prefix = prefix.strip("/") or "blobs"
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise BlobStoreUnavailable(f"{usage}: {bucket[:100]!r} is not a bucket name (3-63 lowercase letters,"
                                   " digits, dots and hyphens)", code="bad_blobs_url")
    if not _PREFIX.fullmatch(prefix) or "//" in prefix or any(p in (".", "..") for p in prefix.split("/")):
        raise BlobStoreUnavailable(f"{usage}: {prefix[:100]!r} is not a key prefix (letters, digits and"
                                   " !_.*'()/- in non-empty parts)", code="bad_blobs_url")
    return bucket, prefix


def check_s3_options(blobs: str | None, endpoint: str | None, region: str | None) -> None:
    """Refuse, in one line, a bad --blobs URL, a bad --s3-endpoint, or S3 options without --blobs."""
    if blobs is None:
        if endpoint is not None or region is not None:
            raise BlobStoreUnavailable("--s3-endpoint and --s3-region need --blobs s3://BUCKET[/PREFIX]",
                                       code="bad_blobs_url")
        return
    parse_blobs_url(blobs)
    if endpoint is not None and not re.fullmatch(r"https?://[^/\s?#]+/?", endpoint):
        raise BlobStoreUnavailable(f"--s3-endpoint takes http(s)://HOST[:PORT], not {endpoint[:200]!r}",
                                   code="bad_blobs_url")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BlobStore:
    #: blobs up to this many bytes go into the pack; 0: each blob a file of its own
    packed_max = PACKED_MAX

    def __init__(self, root: Path) -> None:
        self.root = root
        self._pack: BlobPack | None = None  # opened on first use
        self._pack_lock = threading.Lock()
        self._hot: OrderedDict[str, bytes] = OrderedDict()
        self._hot_bytes = 0
        self._hot_lock = threading.Lock()  # put() runs on worker threads, reads on the loop
        self._tmp_prefix = secrets.token_hex(6)
        self._tmp_seq = itertools.count()
        self.tmp = root / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        # Leftovers of a crash mid-upload are never referenced: clear them.
        for leftover in self.tmp.iterdir():
            leftover.unlink(missing_ok=True)
        #: what interrupted uploads left, by assignment and update hash, for the node to resume
        #: (kept across a restart; the hub's sweep drops those whose assignment is over)
        self.partial = root / "partial"
        self.partial.mkdir(exist_ok=True)
        #: packed blobs written out for a caller that needs a file (`path`); a cache, emptied here
        self.unpacked = root / "unpacked"
        self.unpacked.mkdir(exist_ok=True)
        for leftover in self.unpacked.iterdir():
            leftover.unlink(missing_ok=True)

    def pack(self) -> BlobPack:
        with self._pack_lock:
            if self._pack is None:
                self._pack = BlobPack(self.root / PACK_FILE)
            return self._pack

    def close(self) -> None:
        """Close the pack (its writer's thread); the store is not used after this."""
        with self._pack_lock:
            if self._pack is not None:
                self._pack.close()
                self._pack = None

    def partial_path(self, assignment_id: str, sha: str) -> Path:
        """Where the leading bytes of ``sha``, an update for ``assignment_id``, wait for the rest."""
        check_blob_id(sha)
        if not ID_RE.fullmatch(assignment_id):
            raise NotFound(f"no assignment {assignment_id[:64]!r}", code="unknown_assignment")
        return self.partial / f"{assignment_id}.{sha}.part"

    def partial_uploads(self) -> list[tuple[str, Path]]:
        """(assignment id, path) of every interrupted upload held."""
        return [(p.name.split(".", 1)[0], p) for p in self.partial.iterdir() if p.name.endswith(".part")]

    def file(self, sha: str) -> Path:
        """Where the blob lives when it is a file of its own."""
        check_blob_id(sha)
        return self.root / sha[:2] / sha

    def path(self, sha: str) -> Path:
        own = self.file(sha)
        if self.packed_max and not own.is_file():
            data = self.pack().get(sha)
            if data is not None:  # written out for a caller that needs a file (a cache)
                out = self.unpacked / sha
                if not out.is_file():
                    tmp = self.temp_path()
                    tmp.write_bytes(data)
                    os.replace(tmp, out)
                return out
        return own

    def has(self, sha: str) -> bool:
        return self.file(sha).is_file() or bool(self.packed_max and self.pack().has(sha))

    def small(self, sha: str) -> bytes | None:
        """The bytes of a blob held in memory or packed (kept in memory then); None for one
        stored as a file of its own, or not stored. Off the event loop: it may read the pack."""
        hot = self.hot(sha)
        if hot is not None or not self.packed_max:
            return hot
        check_blob_id(sha)
        data = self.pack().get(sha)
        if data is not None:
            self.remember(sha, data)
        return data

    def read(self, sha: str) -> bytes:
        small = self.small(sha)
        if small is not None:
            return small
        p = self.path(sha)
        if not p.is_file():
            raise NotFound(f"blob {sha} is not stored", code="unknown_blob")
        data = p.read_bytes()
        self.remember(sha, data)
        return data

    def read_private(self, sha: str) -> bytearray | mmap.mmap:
        """The blob's bytes as a writable buffer of the caller's own, for ``decode_state`` to view:
        a large blob's file mapped copy-on-write (no copy is made, and a write changes neither the
        file nor anyone else's view), a small one's bytes copied (and kept hot, as ``read`` does)."""
        small = self.small(sha)
        if small is not None:
            return bytearray(small)
        p = self.path(sha)
        if not p.is_file():
            raise NotFound(f"blob {sha} is not stored", code="unknown_blob")
        with open(p, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size <= HOT_BLOB_MAX:
                data = fh.read()
                self.remember(sha, data)
                return bytearray(data)
            return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)  # the map outlives the file object

    def hot(self, sha: str) -> bytes | None:
        """The blob's bytes when they are in the in-memory cache (it is on disk as well)."""
        with self._hot_lock:
            data = self._hot.get(sha)
            if data is not None:
                self._hot.move_to_end(sha)
            return data

    def remember(self, sha: str, data: bytes | bytearray | memoryview) -> None:
        """Keep a small blob's bytes in memory too (call only once the blob is durable on disk)."""
        size = len(memoryview(data).cast("B"))
        if size > HOT_BLOB_MAX:
            return
        value = bytes(data)
        with self._hot_lock:
            if sha in self._hot:
                return
            self._hot[sha] = value
            self._hot_bytes += size
            while self._hot_bytes > HOT_TOTAL_MAX:
                _, old = self._hot.popitem(last=False)
                self._hot_bytes -= len(old)

    def discard(self, shas: list[str]) -> None:
        """Drop blobs nothing refers to any more (the store said so: an old round's model, see
        hub/policy/rollback.py); from a worker thread. A blob not stored is skipped."""
        with self._hot_lock:
            for sha in shas:
                old = self._hot.pop(sha, None)
                self._hot_bytes -= 0 if old is None else len(old)
        if self.packed_max:
            self.pack().delete(shas)
        for sha in shas:
            self.file(sha).unlink(missing_ok=True)
            (self.unpacked / sha).unlink(missing_ok=True)

    def temp_path(self) -> Path:
        # unique for this store's life (tmp/ is emptied at start); no urandom call per upload
        return self.tmp / f"{self._tmp_prefix}-{next(self._tmp_seq)}.part"

    def put(self, data: bytes | bytearray | memoryview, *, sha: str | None = None) -> str:
        """Store bytes durably; returns their id. Idempotent.

        ``sha``: the sha256 of ``data`` when the caller has already computed it from these bytes.
        """
        sha = sha or hashlib.sha256(data).hexdigest()
        if self.packs(memoryview(data).nbytes):
            self.pack().put([(sha, data)])
            self.remember(sha, data)  # only once it is durable
            return sha
        if self.has(sha):
            self.remember(sha, data)
            return sha
        tmp = self.temp_path()
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        self.commit_temp(tmp, sha)
        self.remember(sha, data)  # only once it is durable
        return sha

    def packs(self, size: int) -> bool:
        """Does a blob of ``size`` bytes go into the pack? (Never with packing off: not even an empty one.)"""
        return 0 < self.packed_max and size <= self.packed_max

    async def put_packed(self, data: bytes, sha: str) -> None:
        """`put` from the event loop for a blob the pack takes (`packs`), hashed by the caller:
        it waits for the pack's commit without holding a worker thread."""
        if not self.packs(len(data)):
            raise ValueError(f"a blob of {len(data)} bytes is not packed (packed_max {self.packed_max})")
        await self.pack().put_async([(sha, data)])
        self.remember(sha, data)  # only once it is durable

    def put_many(self, blobs: list[bytes]) -> list[str]:
        """`put` for many blobs at once (a job's chunks): the small ones share one commit."""
        shas = [hashlib.sha256(data).hexdigest() for data in blobs]
        small = [(sha, data) for sha, data in zip(shas, blobs, strict=True) if self.packs(len(data))]
        if small:
            self.pack().put(small)
            for sha, data in small:
                self.remember(sha, data)
        for sha, data in zip(shas, blobs, strict=True):
            if not self.packs(len(data)):
                self.put(data, sha=sha)
        return shas

    def commit_temp(self, tmp: Path, sha: str) -> Path:
        """Move an fsynced temp file into place under `sha` (its caller checked the hash)."""
        final = self.file(sha)
        final.parent.mkdir(exist_ok=True)
        if final.is_file():
            tmp.unlink(missing_ok=True)
            return final
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        return final
