"""The benchmark cache file (node/benchmark.py measures, this module reads and names the file).

One JSON file holds results per hardware fingerprint (``by_fingerprint``; an older file is a
single result with its ``fingerprint``). No torch here: a CPU's cached result is answered
without it (``cached_on_cpu``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gpuflex.protocol.messages import Benchmark

from .hostinfo import cpu_fingerprint, cpu_only_torch, default_cpu_threads

CACHE_FILE = "bench.json"
ENV_CACHE = "GPUFLEX_BENCH_CACHE"


def cache_path(data_dir: Path, override: str | os.PathLike[str] | None = None) -> Path:
    """--bench-cache PATH, else $GPUFLEX_BENCH_CACHE, else DIR/bench.json.

    A shared file lets every node on one machine reuse one measurement (keyed by the
    hardware fingerprint, so a different device or thread count is measured anew).
    """
    chosen = override or os.environ.get(ENV_CACHE)
    return Path(chosen).expanduser() if chosen else data_dir / CACHE_FILE


def to_message(results: dict[str, Any]) -> Benchmark:
    def opt(key: str) -> float | None:
        v = results.get(key)
        return None if v is None else float(v)

    return Benchmark(
        samples_per_s=float(results["samples_per_s"]),
        matmul_tflops_fp32=float(results["matmul_tflops_fp32"]),
        matmul_tflops_bf16=opt("matmul_tflops_bf16"),
        matmul_tflops_fp16=opt("matmul_tflops_fp16"),
        mem_bandwidth_gbs=float(results["mem_bandwidth_gbs"]),
        h2d_gbs=opt("h2d_gbs"),
        d2h_gbs=opt("d2h_gbs"),
        reference_model=str(results["reference_model"]),
        precision_sps={str(k): float(v) for k, v in (results.get("precision_sps") or {}).items()},
    )


def cached_entry(path: Path, fingerprint: str) -> dict[str, Any] | None:
    """The file's results for ``fingerprint`` (checked to make a Benchmark), or None."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    entry = doc.get("by_fingerprint", {}).get(fingerprint) if isinstance(doc.get("by_fingerprint"), dict) else None
    if entry is None and doc.get("fingerprint") == fingerprint:
        entry = doc  # a single-entry file
    if not isinstance(entry, dict):
        return None
    try:
        to_message(entry)
    except (KeyError, TypeError, ValueError):
        return None
    return entry


def full_result(entry: dict[str, Any] | None) -> dict[str, Any] | None:
    """A cached result `gpuflex-node bench` shows as it is (not the quick one `run` measures,
    nor one from before per-precision figures), marked cached; None otherwise."""
    if entry is None or entry.get("quick") or "precision_sps" not in entry:
        return None
    return {**entry, "cached": True}


def cached_on_cpu(device: str, path: Path, *, threads: int | None, onednn: bool) -> dict[str, Any] | None:
    """The full cached result of ``--device`` ``device`` when it means the CPU (``cpu``, or
    ``auto`` with a CPU-only torch), looked up without torch; None when the device is another
    or nothing is cached for it (the caller then asks torch)."""
    choice = device.strip().lower()
    if choice != "cpu" and not (choice == "auto" and cpu_only_torch()):
        return None
    fingerprint = cpu_fingerprint(threads=threads or default_cpu_threads(), onednn=onednn)
    return None if fingerprint is None else full_result(cached_entry(path, fingerprint))
