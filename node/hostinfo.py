"""What this machine is, read without torch: the CPU, its cores and memory, the installed torch's
version, and the hardware fingerprint that keys the benchmark cache (node/benchmark.py).

``device.hardware_fingerprint`` asks torch for the device's name and thread count, and
``cpu_fingerprint`` computes the same key for a CPU from what the command line says (its
thread count, its oneDNN setting) and the torch wheel's version. With it `gpuflex-node bench`
answers a cached CPU result without importing torch (1 to 3 s); when it cannot tell, or the
key differs, it takes the way through torch, which finds the cache again if there is one.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def host_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def available_memory_bytes() -> int:
    """The memory the host can give a new process now: MemAvailable from /proc/meminfo on Linux;
    elsewhere the free pages sysconf reports, or the total when it reports none."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_AVPHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return host_memory_bytes()


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def fingerprint_of(torch_version: str, kind: str, name: str, threads: int, onednn: bool) -> str:
    """The benchmark cache's key: the CPU, its cores, torch's version, the device and the threads."""
    parts = [cpu_model(), str(cpu_count()), torch_version, kind, name, str(threads)]
    if not onednn:
        parts.append("no-onednn")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def installed_torch() -> str | None:
    """The installed torch's version as ``torch.__version__`` gives it (``2.13.0+cpu``), or None."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_only_torch() -> bool:
    """Is the installed torch a CPU-only build (so ``--device auto`` means the CPU)?"""
    version = installed_torch()
    return version is not None and version.endswith("+cpu")


def cpu_fingerprint(*, threads: int, onednn: bool) -> str | None:
    """``hardware_fingerprint`` of the CPU device with ``threads`` threads and oneDNN as asked,
    without torch; None when torch's version cannot be read."""
    version = installed_torch()
    if version is None:
        return None
    return fingerprint_of(version, "cpu", cpu_model()[:200], threads, onednn)


def default_cpu_threads() -> int:
    """A background contributor leaves half the cores to their owner on a CPU device."""
    return max(1, cpu_count() // 2)
