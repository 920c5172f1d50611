"""Small blobs packed into blobs/pack.sqlite3 (hub/storage/blobpack.py), behind the local BlobStore."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from gpuflex.hub.base.errors import NotFound
from gpuflex.hub.storage.blobpack import PACK_FILE, PACK_SCHEMA_VERSION, BlobPack, PackError
from gpuflex.hub.storage.blobs import PACKED_MAX, BlobStore

from tests.helpers import stored_blobs


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_small_blob_is_packed_and_reads_every_way(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    try:
        data = os.urandom(900)
        sha = store.put(data)
        assert sha == _sha(data)
        assert not store.file(sha).exists()  # no file of its own, no fsync of one
        assert stored_blobs(tmp_path)[sha] == data
        assert store.has(sha) and store.read(sha) == data and bytes(store.read_private(sha)) == data
        path = store.path(sha)  # a caller that needs a file gets one, written out
        assert path.parent == store.unpacked and path.read_bytes() == data
        assert store.put(data) == sha  # again: stored once
    finally:
        store.close()


def test_a_blob_over_the_limit_is_a_file_of_its_own(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    try:
        data = os.urandom(PACKED_MAX + 1)
        sha = store.put(data)
        assert store.file(sha).read_bytes() == data and store.path(sha) == store.file(sha)
        assert store.packs(PACKED_MAX) and not store.packs(PACKED_MAX + 1)
        with sqlite3.connect(tmp_path / "blobs" / PACK_FILE) as conn:
            assert conn.execute("SELECT COUNT(*) FROM blobs").fetchone()[0] == 0
    finally:
        store.close()


def test_a_fresh_store_finds_every_packed_blob_and_empties_what_was_written_out(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    blobs = [os.urandom(n) for n in (0, 1, 100, PACKED_MAX, PACKED_MAX + 10)]
    shas = store.put_many(blobs)
    written_out = store.path(shas[2])
    store.close()
    again = BlobStore(tmp_path / "blobs")
    try:
        assert not written_out.exists()  # a cache: emptied at start
        for sha, data in zip(shas, blobs, strict=True):
            assert again.has(sha) and again.read(sha) == data
        missing = _sha(b"never stored")
        assert not again.has(missing) and again.small(missing) is None and not again.path(missing).exists()
        with pytest.raises(NotFound):
            again.read(missing)
    finally:
        again.close()


def test_puts_from_many_threads_share_commits_and_all_land(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    blobs = [os.urandom(700) for _ in range(400)]
    try:
        with ThreadPoolExecutor(16) as pool:
            shas = list(pool.map(store.put, blobs))
        assert shas == [_sha(b) for b in blobs]
    finally:
        store.close()
    assert {sha: stored_blobs(tmp_path)[sha] for sha in shas} == dict(zip(shas, blobs, strict=True))


async def test_put_packed_waits_on_the_loop_for_its_commit(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    try:
        blobs = [os.urandom(500) for _ in range(50)]
        loop_thread = threading.get_ident()
        await asyncio.gather(*(store.put_packed(b, _sha(b)) for b in blobs))
        assert threading.get_ident() == loop_thread
        assert all(store.small(_sha(b)) == b for b in blobs)
        with pytest.raises(ValueError, match="not packed"):
            await store.put_packed(os.urandom(PACKED_MAX + 1), "0" * 64)
    finally:
        store.close()


def test_a_pack_from_a_newer_hub_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "hub" / "blobs" / PACK_FILE
    path.parent.mkdir(parents=True)
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version={PACK_SCHEMA_VERSION + 1}")
    with pytest.raises(PackError, match="upgrade gpuflex"):
        BlobPack(path)
    # and `serve` stops at start-up, in one line
    hub = Path(sys.executable).parent / "gpuflex-hub"
    done = subprocess.run([str(hub), "serve", "--data", str(tmp_path / "hub"), "--port", "0"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0
    assert len(done.stderr.strip().splitlines()) == 1 and "upgrade gpuflex" in done.stderr, done.stderr


PUTTER = """
import os, sys
from pathlib import Path
from gpuflex.hub.storage.blobs import BlobStore
store = BlobStore(Path(sys.argv[1]))
while True:
    data = os.urandom(800)
    sha = store.put(data)
    print(sha, data.hex(), flush=True)  # acknowledged: put returned
"""


def test_every_acknowledged_blob_outlives_kill_9(tmp_path: Path) -> None:
    """A process packs blobs as fast as it can and says each one that `put` returned; kill -9
    lands mid-stream. Every blob it acknowledged is in the pack, byte for byte."""
    proc = subprocess.Popen([sys.executable, "-c", PUTTER, str(tmp_path / "blobs")], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    acked: dict[str, bytes] = {}
    for line in proc.stdout:
        sha, hexdata = line.split()
        acked[sha] = bytes.fromhex(hexdata)
        if len(acked) == 300:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    stored = stored_blobs(tmp_path)
    assert len(acked) == 300 and all(stored.get(sha) == data for sha, data in acked.items())
