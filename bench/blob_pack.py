"""Storing small blobs: packed (hub/storage/blobpack.py, the default) against a file of their own each.

The hub's own BlobStore both ways, in one process: `put` of N distinct blobs of a small model's
update size from 1, 4 and 16 threads at once (the hub's I/O pool has 16), into a fresh folder on
this machine's disk. The baseline is the same store with packing off (``packed_max = 0``, as the
S3 store runs): temp file, fsync, rename, fsync of the folder, which is what every blob cost
before. Both durable before `put` returns. Reports blobs a second and CPU (user and kernel) per
blob, best of --repeats rounds, round-robin so a burst of load hits both alike, and writes
bench/results/blob_pack.json with the packed figures as ratios against files.

    python bench/blob_pack.py [--blobs 2000] [--size 900] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gpuflex.hub.storage.blobs import BlobStore

THREADS = (1, 4, 16)


def run(packed: bool, threads: int, blobs: list[bytes]) -> tuple[float, float, float]:
    """(blobs/s, user µs a blob, kernel µs a blob) for one fresh store."""
    root = Path(tempfile.mkdtemp(prefix="gpuflex-blob-pack-"))
    store = BlobStore(root)
    if not packed:
        store.packed_max = 0  # each blob a file of its own
    try:
        store.put(os.urandom(64))  # the pack opened, the folder made: not timed
        t0, c0 = time.perf_counter(), os.times()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(store.put, blobs))
        wall, c1 = time.perf_counter() - t0, os.times()
        n = len(blobs)
        return n / wall, 1e6 * (c1.user - c0.user) / n, 1e6 * (c1.system - c0.system) / n
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blobs", type=int, default=2000)
    ap.add_argument("--size", type=int, default=900, help="bytes a blob (hub_load's update: 904)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/blob_pack.json")
    args = ap.parse_args()
    best: dict[tuple[bool, int], tuple[float, float, float]] = {}
    for _ in range(args.repeats):
        for threads in THREADS:
            for packed in (False, True):
                blobs = [os.urandom(args.size) for _ in range(args.blobs)]  # distinct: each one stored
                rate, user, kernel = run(packed, threads, blobs)
                old = best.get((packed, threads))
                if old is None or rate > old[0]:
                    best[(packed, threads)] = (rate, user, kernel)
    print(f"{args.blobs} blobs of {args.size} bytes, best of {args.repeats}")
    print(f"{'threads':>7} {'store':>6} {'blobs/s':>9} {'user µs':>8} {'kernel µs':>9}")
    rows = []
    for threads in THREADS:
        for packed in (False, True):
            rate, user, kernel = best[(packed, threads)]
            print(f"{threads:>7} {'pack' if packed else 'files':>6} {rate:>9.0f} {user:>8.0f} {kernel:>9.0f}")
        files, pack = best[(False, threads)], best[(True, threads)]
        rows.append({"threads": threads, "files_blobs_per_s": round(files[0], 1), "pack_blobs_per_s": round(pack[0], 1),
                     "rate_ratio_vs_files": round(pack[0] / files[0], 3),
                     "cpu_ratio_vs_files": round((pack[1] + pack[2]) / (files[1] + files[2]), 3),
                     "files_cpu_us": round(files[1] + files[2], 1), "pack_cpu_us": round(pack[1] + pack[2], 1)})
    for r in rows:
        print(f"{r['threads']:>2} threads: packed {r['rate_ratio_vs_files']:.2f}x the blobs a second, "
              f"{r['cpu_ratio_vs_files']:.2f}x the CPU a blob")
    out = {"benchmark": "blob_pack", "blobs": args.blobs, "size": args.size, "repeats": args.repeats,
           "baseline": "the same BlobStore with packing off: a file, fsync, rename, fsync of the folder each",
           "figures": rows, "machine": {"python": sys.version.split()[0], "platform": platform.platform(),
                                        "cpus": os.cpu_count()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
