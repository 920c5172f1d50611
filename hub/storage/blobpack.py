"""Small blobs packed into one SQLite file, ``blobs/pack.sqlite3``, committed in groups.

A blob in a file of its own costs two fsyncs: the file, then its folder once the file is renamed
into place. On this project's 2-core machines that is 0.4-1.1 ms of CPU a blob, most of it in the
kernel once several threads store at once, and a round of 1,000 nodes brings 1,000 updates of a
small model at once. Packed: 0.09-0.57x the CPU a blob and 2.2-6.7x the blobs a second, from 1 to
16 threads (bench/blob_pack.py). Packed, the blobs that arrive together share one commit: the pack runs
behind hub/storage/db.py's single writer with group commit (WAL, synchronous=FULL, as the hub's own
database), so `put` returns only once its blobs are durable, and a 2xx built on it survives kill -9.

Only small blobs are packed (BlobStore.packed_max). SQLite's own measurements ("Internal Versus
External BLOBs in SQLite", sqlite.org) find blobs under about 100 KB read and written faster
inside a database than as files of their own; larger ones stay files, which the hub maps.

Schema version 1 (``PRAGMA user_version``): one table, ``blobs (sha TEXT PRIMARY KEY, data BLOB)``.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path

from ..base.errors import HubError
from .db import Database, durable_connection

PACK_FILE = "pack.sqlite3"
PACK_SCHEMA_VERSION = 1
_INSERT = "INSERT OR IGNORE INTO blobs (sha, data) VALUES (?, ?)"  # a blob already packed stays as it is


class PackError(HubError):
    """The pack file belongs to a newer hub (its schema version is unknown here): one line."""

    status = 503
    code = "blob_store_unavailable"


def _open(path: Path) -> sqlite3.Connection:
    conn = durable_connection(path)
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > PACK_SCHEMA_VERSION:
        conn.close()
        raise PackError(f"{path} has schema version {version}; this hub knows up to {PACK_SCHEMA_VERSION}:"
                        " upgrade gpuflex")
    if version == 0:
        conn.execute("CREATE TABLE IF NOT EXISTS blobs (sha TEXT PRIMARY KEY, data BLOB NOT NULL)")
        conn.execute(f"PRAGMA user_version={PACK_SCHEMA_VERSION}")
    return conn


class BlobPack:
    """The pack: `put` from worker threads (never from the event loop), `get` and `has` from any."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db = Database(path, opener=_open, thread_name="gpuflex-blob-pack")
        # reads need no turn at the writer's thread: WAL lets a reader see every committed blob
        self._reader = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10.0)
        self._reader.execute("PRAGMA query_only=ON")
        self._read_lock = threading.Lock()

    def put(self, blobs: Sequence[tuple[str, bytes | bytearray | memoryview]]) -> None:
        """Store each (sha, bytes) (its caller hashed them); returns once they are all durable.
        A blob already packed is left as it is."""
        rows = [(sha, bytes(data)) for sha, data in blobs]
        self._db.write_sync(lambda c: c.executemany(_INSERT, rows))

    async def put_async(self, blobs: Sequence[tuple[str, bytes | bytearray | memoryview]]) -> None:
        """`put` from the event loop: awaits the commit without holding a worker thread."""
        rows = [(sha, bytes(data)) for sha, data in blobs]
        await self._db.write(lambda c: c.executemany(_INSERT, rows))

    def delete(self, shas: Sequence[str]) -> None:
        """Drop these blobs from the pack (from a worker thread); returns once that is durable."""
        self._db.write_sync(lambda c: c.executemany("DELETE FROM blobs WHERE sha = ?", [(s,) for s in shas]))

    def get(self, sha: str) -> bytes | None:
        with self._read_lock:
            row = self._reader.execute("SELECT data FROM blobs WHERE sha = ?", (sha,)).fetchone()
        return None if row is None else bytes(row[0])

    def has(self, sha: str) -> bool:
        with self._read_lock:
            return self._reader.execute("SELECT 1 FROM blobs WHERE sha = ?", (sha,)).fetchone() is not None

    def close(self) -> None:
        self._db.close()
        with self._read_lock:
            self._reader.close()
