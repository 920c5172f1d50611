"""Content-addressed blob store on the local disk.

A blob's id is the sha256 hex of its bytes. Writes go to a temporary name in
`tmp/`, are fsynced, renamed into place and the directory is fsynced, so a blob
that exists under its id is complete and survives a crash.

Small blobs that were just written or read (a round's model, which every node fetches
next) are also kept in a bounded in-memory cache, so serving them costs no file open.
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

from .errors import BadRequest, NotFound

_BLOB_ID = re.compile(r"[0-9a-f]{64}")
HOT_BLOB_MAX = 1 << 20  # blobs up to this size are kept in memory...
HOT_TOTAL_MAX = 64 << 20  # ...up to this many bytes in all (least recently used dropped first)


def is_blob_id(value: str) -> bool:
    return bool(_BLOB_ID.fullmatch(value))


def check_blob_id(value: str) -> str:
    """Refuse anything that is not 64 lowercase hex before it can touch a path."""
    if not is_blob_id(value):
        raise BadRequest("blob id must be 64 lowercase hex characters", code="bad_blob_id")
    return value


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = root
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

    def partial_path(self, assignment_id: str, sha: str) -> Path:
        """Where the leading bytes of ``sha``, an update for ``assignment_id``, wait for the rest."""
        check_blob_id(sha)
        if not ID_RE.fullmatch(assignment_id):
            raise NotFound(f"no assignment {assignment_id[:64]!r}", code="unknown_assignment")
        return self.partial / f"{assignment_id}.{sha}.part"

    def partial_uploads(self) -> list[tuple[str, Path]]:
        """(assignment id, path) of every interrupted upload held."""
        return [(p.name.split(".", 1)[0], p) for p in self.partial.iterdir() if p.name.endswith(".part")]

    def path(self, sha: str) -> Path:
        check_blob_id(sha)
        return self.root / sha[:2] / sha

    def has(self, sha: str) -> bool:
        return self.path(sha).is_file()

    def read(self, sha: str) -> bytes:
        hot = self.hot(sha)
        if hot is not None:
            return hot
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
        hot = self.hot(sha)
        if hot is not None:
            return bytearray(hot)
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

    def temp_path(self) -> Path:
        # unique for this store's life (tmp/ is emptied at start); no urandom call per upload
        return self.tmp / f"{self._tmp_prefix}-{next(self._tmp_seq)}.part"

    def put(self, data: bytes | bytearray | memoryview, *, sha: str | None = None) -> str:
        """Store bytes durably; returns their id. Idempotent.

        ``sha``: the sha256 of ``data`` when the caller has already computed it from these bytes.
        """
        sha = sha or hashlib.sha256(data).hexdigest()
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

    def commit_temp(self, tmp: Path, sha: str) -> Path:
        """Move an fsynced temp file into place under `sha` (its caller checked the hash)."""
        final = self.path(sha)
        final.parent.mkdir(exist_ok=True)
        if final.is_file():
            tmp.unlink(missing_ok=True)
            return final
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        return final
