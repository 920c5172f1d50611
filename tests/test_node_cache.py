"""node/cache.py: content-addressed, size-capped, LRU, never half-written; plus small units."""

from __future__ import annotations

import hashlib
import os
import random
import time

import pytest
from gpuflex.node.cache import BlobCache
from gpuflex.node.client import Backoff
from gpuflex.node.errors import BlobError


def _blob(n: int, seed: int = 0) -> tuple[str, bytes]:
    data = random.Random(seed).randbytes(n)
    return hashlib.sha256(data).hexdigest(), data


def test_commit_makes_blob_visible_only_when_verified(tmp_path):
    cache = BlobCache(tmp_path, 1 << 20)
    sha, data = _blob(1000)
    w = cache.writer(sha, len(data))
    w.write(data[:500])
    assert not cache.has(sha) and cache.ids() == []  # half-written: invisible
    w.write(data[500:])
    w.commit()
    assert cache.has(sha, len(data)) and cache.blob_path(sha).read_bytes() == data
    assert not list(cache.partial_dir.iterdir())


def test_blob_from_an_earlier_run_is_rehashed_before_use(tmp_path):
    """Blobs are not fsynced: one left torn by a crash is found and removed, never trusted."""
    sha, data = _blob(5000, seed=3)
    first = BlobCache(tmp_path, 1 << 20)
    w = first.writer(sha, len(data))
    w.write(data)
    w.commit()
    assert sha in first.verified and first.verify(sha)  # written by this process: trusted
    good_sha, good = _blob(300, seed=4)
    w = first.writer(good_sha, len(good))
    w.write(good)
    w.commit()
    # "power cut": the file kept its size but lost its last page of data
    path = first.blob_path(sha)
    path.write_bytes(data[:4096] + bytes(len(data) - 4096))
    later = BlobCache(tmp_path, 1 << 20)  # the next run
    assert later.verified == set()
    assert later.has(sha, len(data))  # the name and size look fine...
    assert not later.verify(sha) and not later.has(sha)  # ...the hash does not: removed
    assert later.verify(good_sha) and good_sha in later.verified
    assert not later.verify("0" * 64)  # unknown blob


def test_wrong_hash_and_oversize_are_refused(tmp_path):
    cache = BlobCache(tmp_path, 1 << 20)
    sha, data = _blob(100)
    w = cache.writer(sha, len(data))
    w.write(b"x" * 100)
    with pytest.raises(BlobError, match="sha256"):
        w.commit()
    assert not cache.has(sha)
    w = cache.writer(sha, len(data))
    with pytest.raises(BlobError, match="larger than the declared"):
        w.write(data + b"!")
    assert not cache.has(sha) and not list(cache.partial_dir.iterdir())
    with pytest.raises(BlobError):
        cache.writer("../../etc/passwd", 10)


def test_resume_from_partial(tmp_path):
    cache = BlobCache(tmp_path, 1 << 20)
    sha, data = _blob(4096)
    w = cache.writer(sha, len(data))
    w.write(data[:1000])
    w.abort(keep_partial=True)  # connection dropped
    w = cache.writer(sha, len(data), resume=True)
    assert w.offset == 1000
    w.write(data[1000:])
    w.commit()
    assert cache.blob_path(sha).read_bytes() == data


def test_lru_eviction_respects_cap_and_keep(tmp_path):
    cache = BlobCache(tmp_path, 2500)
    shas = []
    for i in range(4):
        sha, data = _blob(1000, seed=i)
        w = cache.writer(sha, len(data))
        w.write(data)
        w.commit()
        t = time.time() - 100 + i
        os.utime(cache.blob_path(sha), (t, t))
        shas.append(sha)
    cache.touch(shas[0])  # most recently used now
    cache.evict(keep={shas[1]})
    left = set(cache.ids())
    assert left == {shas[0], shas[1]}  # oldest not-kept ones went first
    assert cache.size_bytes() <= 2500


def test_stray_files_are_ignored_and_removed(tmp_path):
    (tmp_path / "blobs").mkdir(parents=True)
    (tmp_path / "blobs" / "garbage.tmp").write_bytes(b"x")
    cache = BlobCache(tmp_path, 1 << 20)
    assert cache.ids() == []
    assert not (tmp_path / "blobs" / "garbage.tmp").exists()


def test_backoff_grows_with_jitter_and_caps():
    b = Backoff(base=0.5, cap=4.0, rng=random.Random(0))
    delays = [b.next_delay() for _ in range(8)]
    assert 0.25 <= delays[0] <= 0.5
    assert all(d <= 4.0 for d in delays) and delays[-1] >= 2.0
    b.reset()
    assert b.next_delay() <= 0.5


def test_device_selection_and_limits():
    import torch
    from gpuflex.node.device import GpuWatcher, default_threads, hardware_fingerprint, select_device
    from gpuflex.node.errors import ConfigError

    assert select_device("cpu").type == "cpu"
    auto = select_device("auto")
    assert auto.type == ("cuda" if torch.cuda.is_available() else auto.type)
    for bad in ("tpu", "cuda:99" if torch.cuda.is_available() else "cuda:0"):
        with pytest.raises(ConfigError):
            select_device(bad)
    assert default_threads(torch.device("cpu")) >= 1
    assert hardware_fingerprint(torch.device("cpu")) == hardware_fingerprint(torch.device("cpu"))
    assert GpuWatcher(torch.device("cpu")).others_busy() is False  # no GPU: never yields


def test_output_json_lines_one_object_per_event():
    import io
    import json

    from gpuflex.node.output import Output

    buf = io.StringIO()
    out = Output(buf, json_lines=True)
    out.event("trained", loss=float("nan"), steps=3)
    out.progress_update(0.5)  # no flood of progress lines
    lines = buf.getvalue().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert rec["event"] == "trained" and rec["loss"] is None and rec["steps"] == 3


def test_cache_index_follows_every_change_and_a_reopened_cache_agrees(tmp_path):
    """The ids sent with every work request come from the in-memory index (no disk scan per
    poll); it follows commit, touch, discard and eviction, and the next run rebuilds it from
    the files (recency = mtime), in the same order."""
    cache = BlobCache(tmp_path, 3500)
    shas = []
    for i in range(3):
        sha, data = _blob(1000, seed=10 + i)
        w = cache.writer(sha, len(data))
        w.write(data)
        w.commit()
        shas.append(sha)
        time.sleep(0.01)
    assert cache.ids() == shas[::-1] and cache.size_bytes() == 3000
    cache.touch(shas[0])
    assert cache.ids()[0] == shas[0]
    cache.discard(shas[1])
    assert cache.ids() == [shas[0], shas[2]] and not cache.has(shas[1])
    sha, data = _blob(2000, seed=20)
    w = cache.writer(sha, len(data))
    w.write(data[:700])
    w.abort(keep_partial=True)
    assert cache.size_bytes() == 2700  # a download in progress counts too
    w = cache.writer(sha, len(data), resume=True)
    w.write(data[700:])
    w.commit()
    assert cache.ids() == [sha, shas[0], shas[2]] and cache.size_bytes() == 4000
    cache.evict(keep={sha})
    assert cache.ids() == [sha, shas[0]] and cache.size_bytes() == 3000  # the oldest went
    assert BlobCache(tmp_path, 3500).ids() == cache.ids()


def test_blob_writes_from_worker_threads_keep_the_index_whole(tmp_path):
    """Downloads commit from worker threads while the loop lists ids: the index has a lock."""
    from concurrent.futures import ThreadPoolExecutor

    cache = BlobCache(tmp_path, 1 << 30)
    blobs = [_blob(64, seed=100 + i) for i in range(200)]

    def put(item):
        sha, data = item
        w = cache.writer(sha, len(data))
        w.write(data)
        w.commit()
        return len(cache.ids())

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, blobs))
    assert sorted(cache.ids()) == sorted(sha for sha, _ in blobs)
    assert cache.size_bytes() == 64 * 200
