"""Choosing and describing the compute device; noticing when a GPU gets busy.

``auto`` picks CUDA, then Apple MPS, then the CPU. The hardware fingerprint (CPU model,
core count, torch version, device name) keys the benchmark cache so a new GPU or a
torch upgrade is measured again.
"""

from __future__ import annotations

import logging
import os
import platform
import re
from dataclasses import dataclass

import torch
from gpuflex.protocol.compute import NUMERIC_ISA
from gpuflex.protocol.messages import MAX_MEMORY_BYTES, ComputeClass

from .errors import ConfigError
from .hostinfo import (
    available_memory_bytes,
    cpu_model,
    default_cpu_threads,
    fingerprint_of,
    host_memory_bytes,
)

log = logging.getLogger(__name__)

_CUDA_RE = re.compile(r"^cuda(?::(\d+))?$")


def prepare_cuda_determinism() -> None:
    """Deterministic cuBLAS needs this before its first handle is created."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def select_device(choice: str = "auto") -> torch.device:
    """Map a ``--device`` value to a torch.device, refusing devices that are not there."""
    choice = choice.strip().lower()
    if choice == "auto":
        if torch.cuda.is_available():
            prepare_cuda_determinism()
            return torch.device("cuda", 0)
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    if choice == "cpu":
        return torch.device("cpu")
    if choice == "mps":
        if not _mps_available():
            raise ConfigError("--device mps: Apple MPS is not available on this machine")
        return torch.device("mps")
    m = _CUDA_RE.match(choice)
    if m:
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {choice}: CUDA is not available (torch {torch.__version__})")
        index = int(m.group(1) or 0)
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"--device {choice}: only {torch.cuda.device_count()} CUDA device(s) present"
            )
        prepare_cuda_determinism()
        return torch.device("cuda", index)
    raise ConfigError(f"--device {choice!r}: allowed values are auto, cpu, cuda, cuda:N, mps")


@dataclass(frozen=True)
class DeviceDescription:
    kind: str  # "cpu" | "cuda" | "mps"
    name: str
    memory_bytes: int
    threads: int


def describe(device: torch.device) -> DeviceDescription:
    threads = torch.get_num_threads()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return DeviceDescription("cuda", str(props.name)[:200], int(props.total_memory), threads)
    if device.type == "mps":
        return DeviceDescription("mps", f"Apple MPS ({platform.machine()})", host_memory_bytes(), threads)
    return DeviceDescription("cpu", cpu_model()[:200], host_memory_bytes(), threads)


def free_memory_bytes(device: torch.device) -> int:
    """What ``device`` has free for training now: the CUDA driver's free memory on a GPU, the
    host's available memory on a CPU or MPS (which share it). The default of --max-memory."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return available_memory_bytes()


def offered_memory(device: torch.device, configured: int | None) -> int:
    """The memory this node offers a pipeline stage: --max-memory when given, else what
    ``device`` has free now (within what the hello carries)."""
    if configured is not None:
        return configured
    return min(MAX_MEMORY_BYTES, max(0, free_memory_bytes(device)))


def cpu_vendor_and_isa() -> tuple[str, tuple[str, ...]]:
    """The CPU vendor and its numerics-relevant ISA flags (protocol.compute.NUMERIC_ISA), from
    /proc/cpuinfo (x86 "vendor_id"/"flags", ARM "CPU implementer"/"Features"); elsewhere the
    machine name and no flags."""
    vendor, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("vendor_id", "CPU implementer") and not vendor:
                    vendor = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return (vendor or platform.machine() or "unknown")[:64], tuple(sorted(flags & NUMERIC_ISA))


def onednn_enabled() -> bool:
    return bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)


def set_onednn(on: bool) -> None:
    """--onednn on|off: torch's oneDNN (mkldnn) CPU kernels; off changes which conv/matmul kernels run."""
    torch.backends.mkldnn.enabled = on


def supported_precisions(device: torch.device) -> tuple[str, ...]:
    """What this device trains in. CUDA: fp32 and fp16 always, tf32 and bf16 from compute capability
    8.0 (Ampere); a CPU: fp32 and bf16 autocast (fp16 has no fast CPU kernels, and no CPU loss
    scaling is worth it); MPS: fp32 and fp16."""
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        return ("fp32", "tf32", "bf16", "fp16") if major >= 8 else ("fp32", "fp16")
    if device.type == "mps":
        return ("fp32", "fp16")
    return ("fp32", "bf16")


def compute_class(device: torch.device, *, precisions: tuple[str, ...] | None = None) -> ComputeClass:
    """This node's compute class for its hello (``precisions``: a subset the volunteer allows)."""
    d = describe(device)
    vendor, isa = cpu_vendor_and_isa()
    capability = cuda_version = cudnn_version = ""
    model = d.name
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        capability = f"{major}.{minor}"
        cuda_version = str(torch.version.cuda or "")
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        cudnn_version = "" if cudnn is None else str(cudnn)
    elif device.type == "cpu":
        model = cpu_model()
    own = supported_precisions(device)
    allowed = own if precisions is None else tuple(p for p in own if p in precisions)
    return ComputeClass(
        device_kind=d.kind, device_model=model[:256], capability=capability, cpu_vendor=vendor,
        isa=isa, torch_version=torch.__version__[:64], cuda_version=cuda_version[:64],
        cudnn_version=cudnn_version[:64], onednn=onednn_enabled(), threads=torch.get_num_threads(),
        precisions=allowed,
    )


def hardware_fingerprint(device: torch.device) -> str:
    """Stable id of what the benchmark measured: re-measure when any part changes."""
    d = describe(device)
    return fingerprint_of(torch.__version__, d.kind, d.name, d.threads, onednn_enabled())


def default_threads(device: torch.device) -> int | None:
    """A background contributor leaves half the cores to their owner on a CPU device.

    On a busy machine torch's default (all cores) leaves OpenMP threads waiting for each other,
    far slower than one thread for a small model (docs/performance.md has the measurement), so
    the default is also the faster choice there. On a GPU torch's default is kept (None).
    """
    if device.type == "cpu":
        return default_cpu_threads()
    return None


def apply_limits(device: torch.device, *, threads: int | None, max_gpu_memory_gb: float | None) -> None:
    """Honour --threads (default: ``default_threads``) and --max-gpu-memory."""
    if threads is None:
        threads = default_threads(device)
    if threads is not None:
        if threads < 1:
            raise ConfigError("--threads must be >= 1")
        torch.set_num_threads(threads)
    if max_gpu_memory_gb is not None:
        if max_gpu_memory_gb <= 0:
            raise ConfigError("--max-gpu-memory must be > 0 (GB)")
        if device.type != "cuda":
            log.info("--max-gpu-memory ignored: device is %s", device.type)
            return
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = min(1.0, max_gpu_memory_gb * 1e9 / total)
        torch.cuda.set_per_process_memory_fraction(fraction, device)


class GpuWatcher:
    """Tells whether another process is using our GPU (NVML), so the node can yield.

    ``available`` is False (with a logged note) where nvidia-ml-py is not installed or
    NVML does not start; the node then simply does not yield.
    """

    def __init__(self, device: torch.device) -> None:
        self.available = False
        self._nvml = None
        self._handle = None
        self._own_pid = os.getpid()
        if device.type != "cuda":
            return
        try:
            import pynvml  # optional extra "gpu"
        except ImportError:
            log.info("GPU yielding off: nvidia-ml-py (pynvml) is not installed (pip install gpuflex[gpu])")
            return
        try:
            pynvml.nvmlInit()
            index = device.index or 0
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible:
                ids = [v.strip() for v in visible.split(",") if v.strip()]
                if index < len(ids) and ids[index].isdigit():
                    index = int(ids[index])
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
            self.available = True
        except Exception as exc:  # NVML missing driver library, permissions...
            log.info("GPU yielding off: NVML unavailable (%s)", exc)

    def others_busy(self) -> bool:
        """True when a process other than this one has a context on our GPU."""
        if not self.available or self._nvml is None:
            return False
        nvml = self._nvml
        pids: set[int] = set()
        for query in (
            nvml.nvmlDeviceGetComputeRunningProcesses,
            nvml.nvmlDeviceGetGraphicsRunningProcesses,
        ):
            try:
                pids.update(int(p.pid) for p in query(self._handle))
            except Exception:  # noqa: S112 - one query unsupported on this GPU: use the other
                continue
        pids.discard(self._own_pid)
        return bool(pids)
