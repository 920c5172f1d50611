"""Content-addressed blob cache with an LRU size cap.

Layout under the cache root::

    blobs/<sha256>          complete, verified blobs (the only ones anyone reads)
    partial/<sha256>.part   a download in progress, kept so a later attempt resumes with Range

A blob reaches ``blobs/`` only by ``rename`` after its sha256 matched while it streamed
in. It is not fsynced (that cost ~10 ms per blob on the path to training): a blob this
process wrote is trusted for the life of the process, since only a power cut or an OS
crash could tear it and either one ends the process too. A blob left by an earlier run
is re-hashed once before its first use (:meth:`BlobCache.verify`) and dropped if it is
wrong, so a torn file is downloaded again, never trained on.
Recency is the file's mtime (touched on every use); eviction removes the least recently
used blobs that the current assignment does not need until the cache fits its cap.

The folder is listed once, when the cache opens; from then on an in-memory index (id ->
last use, size) follows every commit, touch, discard and eviction, so the list of cached
chunks sent with every work request and the size shown by ``status`` cost no disk scan.
Only one process uses a cache (the data dir is locked), so nothing else changes it
behind the index's back. Writers may commit from worker threads: the index has a lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from gpuflex.protocol.tensors import is_blob_id

from .errors import BlobError

log = logging.getLogger(__name__)

_READ_CHUNK = 1 << 20


class BlobWriter:
    """Streams one blob into ``partial/``; refuses a byte beyond the declared size.

    ``offset`` is where a resumed download continues (the bytes already on disk are
    re-hashed on open, so the final check covers the whole blob).
    """

    def __init__(self, cache: BlobCache, sha256: str, size: int, *, resume: bool) -> None:
        self._cache = cache
        self.sha256 = sha256
        self.size = size
        self.path = cache.partial_dir / f"{sha256}.part"
        self._hash = hashlib.sha256()
        self.offset = 0
        if resume and self.path.exists():
            have = self.path.stat().st_size
            if 0 < have <= size:
                with open(self.path, "rb") as f:
                    while block := f.read(_READ_CHUNK):
                        self._hash.update(block)
                self.offset = have
            else:
                self.path.unlink(missing_ok=True)
        else:
            self.path.unlink(missing_ok=True)
        self._file = open(self.path, "ab")

    def write(self, data: bytes) -> None:
        if self.offset + len(data) > self.size:
            self.abort(keep_partial=False)
            raise BlobError(
                f"blob {self.sha256[:12]}… is larger than the declared {self.size} bytes; refused"
            )
        self._file.write(data)
        self._hash.update(data)
        self.offset += len(data)

    def restart(self) -> None:
        """The server ignored our Range: start from byte 0 again."""
        self._file.close()
        self.path.unlink(missing_ok=True)
        self._hash = hashlib.sha256()
        self.offset = 0
        self._file = open(self.path, "ab")

    def commit(self) -> Path:
        """Verify size and sha256, rename into blobs/; the blob is then visible and trusted."""
        if self.offset != self.size:
            self.abort(keep_partial=True)
            raise BlobError(
                f"blob {self.sha256[:12]}… ended at {self.offset} of {self.size} bytes"
            )
        digest = self._hash.hexdigest()
        if digest != self.sha256:
            self.abort(keep_partial=False)
            raise BlobError(
                f"blob {self.sha256[:12]}… has sha256 {digest[:12]}…: corrupted or tampered; refused"
            )
        self._file.close()
        final = self._cache.blob_path(self.sha256)
        os.replace(self.path, final)
        self._cache.verified.add(self.sha256)
        self._cache.remember(self.sha256, self.size)
        return final

    def abort(self, *, keep_partial: bool) -> None:
        with contextlib.suppress(OSError):
            self._file.close()
        if not keep_partial:
            self.path.unlink(missing_ok=True)


class BlobCache:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.blob_dir = root / "blobs"
        self.partial_dir = root / "partial"
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        self.partial_dir.mkdir(parents=True, exist_ok=True)
        # Blobs whose bytes this process has hashed (written or re-checked) since it started.
        self.verified: set[str] = set()
        self._lock = threading.Lock()
        self._index: dict[str, tuple[float, int]] = {}  # id -> (last use, size)
        # The one listing: anything in blobs/ not named like a blob is a stray and goes.
        for p in self.blob_dir.iterdir():
            if not is_blob_id(p.name):
                with contextlib.suppress(OSError):
                    p.unlink()
                continue
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            self._index[p.name] = (st.st_mtime, st.st_size)

    def remember(self, sha256: str, size: int) -> None:
        """Record a blob that just reached blobs/ (as just used)."""
        with self._lock:
            self._index[sha256] = (time.time(), size)

    def _forget(self, sha256: str) -> None:
        with self._lock:
            self._index.pop(sha256, None)

    def blob_path(self, sha256: str) -> Path:
        if not is_blob_id(sha256):
            raise BlobError(f"not a blob id: {sha256[:80]!r}")
        return self.blob_dir / sha256

    def has(self, sha256: str, size: int | None = None) -> bool:
        try:
            st = self.blob_path(sha256).stat()
        except FileNotFoundError:
            return False
        return size is None or st.st_size == size

    def verify(self, sha256: str) -> bool:
        """True when the cached blob hashes to its name (re-hashed once per process).

        A blob that does not is removed, so the caller downloads it again.
        """
        if sha256 in self.verified:
            return True
        path = self.blob_path(sha256)
        digest = hashlib.sha256()
        try:
            with open(path, "rb") as f:
                while block := f.read(_READ_CHUNK):
                    digest.update(block)
        except FileNotFoundError:
            return False
        if digest.hexdigest() != sha256:
            log.warning("cached blob %s… does not match its sha256 (torn by a crash?): removed", sha256[:12])
            self.discard(sha256)
            return False
        self.verified.add(sha256)
        return True

    def discard(self, sha256: str) -> None:
        """Forget one blob (a superseded model, a corrupt file)."""
        self.verified.discard(sha256)
        self._forget(sha256)
        with contextlib.suppress(FileNotFoundError):
            self.blob_path(sha256).unlink()

    def touch(self, sha256: str) -> Path:
        """Mark a blob as just used (LRU) and return its path."""
        path = self.blob_path(sha256)
        with contextlib.suppress(OSError):
            os.utime(path)
            size = path.stat().st_size
            with self._lock:
                self._index[sha256] = (time.time(), size)
        return path

    def writer(self, sha256: str, size: int, *, resume: bool = True) -> BlobWriter:
        self.blob_path(sha256)  # validates the id
        return BlobWriter(self, sha256, size, resume=resume)

    def _entries(self) -> list[tuple[float, int, str]]:
        with self._lock:
            return [(used, size, sha) for sha, (used, size) in self._index.items()]

    def ids(self, limit: int = 4096) -> list[str]:
        """Cached blob ids, most recently used first."""
        entries = sorted(self._entries(), reverse=True)
        return [name for _, _, name in entries[:limit]]

    def size_bytes(self) -> int:
        """Bytes held: the indexed blobs plus the (few) downloads in progress."""
        partial = 0
        for p in self.partial_dir.iterdir():
            with contextlib.suppress(OSError):
                partial += p.stat().st_size
        return sum(size for _, size, _ in self._entries()) + partial

    def evict(self, keep: Iterable[str] = ()) -> int:
        """Remove least recently used blobs not in ``keep`` until under the cap; bytes freed."""
        keep_set = set(keep)
        entries = sorted(self._entries())  # oldest first
        total = sum(size for _, size, _ in entries)
        freed = 0
        for _, size, name in entries:
            if total <= self.max_bytes:
                break
            if name in keep_set:
                continue
            self.verified.discard(name)
            self._forget(name)
            with contextlib.suppress(FileNotFoundError):
                (self.blob_dir / name).unlink()
                (self.partial_dir / f"{name}.part").unlink(missing_ok=True)
                total -= size
                freed += size
        # Stale partial downloads count against the cap too; drop them first when over.
        if total > self.max_bytes:
            for p in self.partial_dir.iterdir():
                if p.stem not in keep_set:
                    with contextlib.suppress(OSError):
                        p.unlink()
        if total > self.max_bytes:
            log.warning("cache holds %d bytes, over its cap of %d: the current assignment needs them",
                        total, self.max_bytes)
        return freed
