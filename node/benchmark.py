"""An honest benchmark of this machine, as the hub sizes shards by it.

Honest means: every figure is the median of several timed repeats after a warm-up run,
CUDA work is synchronized before a clock is read, and the training throughput is the
node's real training path (``train_assignment``) on two reference MLPs, not a guess
from peak FLOP/s.

Short means: a contributor sees a result in seconds. On a CPU, bf16 and fp16 matmuls
run hundreds of times slower than fp32 (no native kernels), so there they are measured on
a small matrix: the hub takes the fastest matmul figure as the node's peak, which on a CPU
is fp32 anyway. ``on_step(label, done, total)`` reports progress as each figure starts.

A node that trains on several devices (``--devices``, a ``WorkerGroup``) is measured whole:
its training figures are the worker group's, all devices together through the path its
assignments take (one process per device, DDP or FSDP), so the hub sizes its shards by what the
node delivers; the matmul and memory figures stay its first device's. Each group run starts
fresh processes, so there is no warm-up run to drop: the median of the runs is taken, and each
run's clock starts after its workers are set up (``TrainResult.train_s``).

Results are cached in DIR/bench.json keyed by the hardware fingerprint (CPU model, core
count, torch version, device, threads, and the worker group's devices) and measured again when
any part changes.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from gpuflex.protocol.messages import Benchmark, TrainConfig
from gpuflex.protocol.modelspec import ModelSpec, build_model

from .benchcache import cached_entry, to_message
from .device import describe, hardware_fingerprint, supported_precisions
from .identity import write_private_file
from .trainer import train_assignment

if TYPE_CHECKING:
    from .devices import WorkerGroup

REFERENCE_MODEL = "mlp-64-128-10/b32"
BIG_MODEL = "mlp-784-1024-1024-10/b128"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _median_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # warm-up: allocator, kernels, lazy init
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, repeats: int) -> float | None:
    try:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        t = _median_time(lambda: a @ b, device, repeats)
    except (RuntimeError, TypeError):  # dtype not supported on this device
        return None
    return 2 * n**3 / t / 1e12


def mem_bandwidth_gbs(device: torch.device, mbytes: int, repeats: int) -> float:
    x = torch.empty(mbytes << 18, device=device)  # float32: 4 bytes each
    y = torch.empty_like(x)
    t = _median_time(lambda: y.copy_(x), device, repeats)
    return 2 * x.numel() * 4 / t / 1e9  # read + write


def host_device_gbs(device: torch.device, mbytes: int, repeats: int) -> tuple[float, float]:
    host = torch.empty(mbytes << 18).pin_memory()
    dev = torch.empty(mbytes << 18, device=device)
    nbytes = host.numel() * 4
    h2d = _median_time(lambda: dev.copy_(host, non_blocking=True), device, repeats)
    d2h = _median_time(lambda: host.copy_(dev, non_blocking=True), device, repeats)
    return nbytes / h2d / 1e9, nbytes / d2h / 1e9


def training_samples_per_s(
    device: torch.device, spec_dict: dict[str, Any], samples: int, batch: int, repeats: int,
    precision: str = "fp32", group: WorkerGroup | None = None,
) -> float:
    """Training samples/s on ``device`` (after a warm-up run), or through ``group``'s workers."""
    spec = ModelSpec.from_dict(spec_dict)
    state = build_model(spec, seed=0).state_dict()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, *spec.input_shape, generator=gen)
    y = torch.randint(0, spec.outputs, (samples,), generator=gen)
    cfg = TrainConfig(
        local_epochs=1, batch_size=batch, optimizer="sgd", lr=0.01, momentum=0.9,
        weight_decay=0.0, beta1=0.9, beta2=0.999, loss="cross_entropy", grad_clip=0.0, precision=precision,
    )
    chunks = [{"x": x, "y": y}]
    times = []
    if group is not None:  # fresh worker processes every run: no warm-up to drop
        for i in range(repeats):
            times.append(group.train(spec, state, chunks, cfg, seed=i).train_s)
        return samples / statistics.median(times)
    for i in range(repeats + 1):
        result = train_assignment(spec, state, chunks, cfg, seed=i, device=device)
        if i:  # the first run is the warm-up
            times.append(result.train_s)
    return samples / statistics.median(times)


def bench_fingerprint(device: torch.device, group: WorkerGroup | None = None) -> str:
    """What the cache keys a result by: the hardware, and the worker group's devices if any."""
    base = hardware_fingerprint(device)
    if group is None:
        return base
    return f"{base}+{','.join(group.plan.names())}{'+offload' if group.plan.offload else ''}"


Step = Callable[[str, int, int], None]


def _header(device: torch.device, quick: bool, group: WorkerGroup | None) -> dict[str, Any]:
    """What a result says of the machine it measured, before any figure."""
    desc = describe(device)
    return {
        "fingerprint": bench_fingerprint(device, group),
        "quick": quick,
        "workers": None if group is None else list(group.plan.names()),
        "device": {"kind": desc.kind, "name": desc.name, "memory_bytes": desc.memory_bytes,
                   "threads": desc.threads, "torch": torch.__version__},
        "matmul_tflops_bf16": None, "matmul_tflops_fp16": None, "h2d_gbs": None, "d2h_gbs": None,
    }


def run_benchmark(device: torch.device, *, quick: bool = False, on_step: Step | None = None,
                  group: WorkerGroup | None = None) -> dict[str, Any]:
    """Measure; ``quick`` (~1 s; a few seconds more per worker group run) is what a first ``run``
    uses before a full ``bench``. ``group``: the node's devices, whose training figures these are.

    ``precision_sps``: the reference model's training samples/s in every precision this device
    supports (device.supported_precisions); the hub sizes a job's shards by its precision's figure.
    """
    started = time.perf_counter()
    precisions = supported_precisions(device)
    gpu = device.type in ("cuda", "mps")
    n = (4096 if gpu else 1024) if not quick else (2048 if gpu else 768)
    n_half = n if gpu else 256  # bf16/fp16 on a CPU: slow emulation, a small matrix tells enough
    reps = 5 if not quick else 3
    out = _header(device, quick, group)
    digits = {"kind": "mlp", "input": 64, "hidden": [128], "outputs": 10}
    big = {"kind": "mlp", "input": 784, "hidden": [1024, 1024], "outputs": 10}
    training: dict[str, float] = {}
    runs = (1 if quick else 3) if group is not None else None  # a group run: fresh processes each

    def fp32() -> None:
        out["matmul_tflops_fp32"] = matmul_tflops(device, torch.float32, n, reps) or 0.0

    def bf16() -> None:
        out["matmul_tflops_bf16"] = matmul_tflops(device, torch.bfloat16, n_half, reps)

    def fp16() -> None:
        out["matmul_tflops_fp16"] = matmul_tflops(device, torch.float16, n_half, reps)

    def memory() -> None:
        out["mem_bandwidth_gbs"] = mem_bandwidth_gbs(device, (256 if gpu else 64) // (4 if quick else 1), reps)

    def transfers() -> None:
        out["h2d_gbs"], out["d2h_gbs"] = host_device_gbs(device, 64 if not quick else 16, reps)

    def reference() -> None:
        training[REFERENCE_MODEL] = training_samples_per_s(device, digits, 4096 if gpu else 2048, 32, runs or 3,
                                                           group=group)

    by_precision: dict[str, float] = {}

    def precision_step(precision: str) -> Callable[[], None]:
        def run() -> None:
            # fewer samples on a CPU: the bench stays short (bf16 autocast is ~2x slower there)
            by_precision[precision] = training_samples_per_s(
                device, digits, 4096 if gpu else 1024, 32, runs or (2 if quick else 3), precision=precision,
                group=group)
        return run

    def large() -> None:
        training[BIG_MODEL] = training_samples_per_s(device, big, 16384 if gpu else 256, 128, runs or 2, group=group)

    steps: list[tuple[str, Callable[[], None]]] = [("matmul fp32", fp32)]
    if not quick:
        steps += [("matmul bf16", bf16), ("matmul fp16", fp16)]
    steps.append(("memory bandwidth", memory))
    if device.type == "cuda":
        steps.append(("host <-> device", transfers))
    steps.append((f"training {REFERENCE_MODEL}", reference))
    steps += [(f"training {REFERENCE_MODEL} {p}", precision_step(p)) for p in precisions if p != "fp32"]
    if not quick:
        steps.append((f"training {BIG_MODEL}", large))
    for i, (label, step) in enumerate(steps):
        if on_step is not None:
            on_step(label, i, len(steps))
        step()
    if on_step is not None:
        on_step("done", len(steps), len(steps))
    out["training"] = training
    out["precision_sps"] = {"fp32": training[REFERENCE_MODEL], **by_precision}
    out["samples_per_s"] = training[REFERENCE_MODEL]
    out["reference_model"] = REFERENCE_MODEL
    out["duration_s"] = time.perf_counter() - started
    out["measured_at"] = time.time()
    return out


def load_cached(device: torch.device, path: Path, group: WorkerGroup | None = None) -> dict[str, Any] | None:
    """The cached results for this hardware (and worker group), or None. The file may hold
    several fingerprints."""
    return cached_entry(path, bench_fingerprint(device, group))


def measure_and_cache(
    device: torch.device, path: Path, *, quick: bool = False, on_step: Step | None = None,
    group: WorkerGroup | None = None,
) -> dict[str, Any]:
    results = run_benchmark(device, quick=quick, on_step=on_step, group=group)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        entries = doc.get("by_fingerprint", {}) if isinstance(doc, dict) else {}
        if not isinstance(entries, dict):
            entries = {}
    except (OSError, ValueError):
        entries = {}
    entries[results["fingerprint"]] = results
    write_private_file(path, json.dumps({**results, "by_fingerprint": entries}, indent=1) + "\n")
    return results


def benchmark_for_registration(
    device: torch.device, path: Path, *, on_measure: Callable[[], None] | None = None,
    group: WorkerGroup | None = None,
) -> Benchmark:
    """The cached figures for this hardware (the whole node with ``group``), or a quick
    measurement (cached too).

    ``on_measure`` is called before a measurement starts (to say so on screen).
    """
    cached = load_cached(device, path, group)
    if cached is None or "precision_sps" not in cached:  # measured before per-precision figures
        if on_measure is not None:
            on_measure()
        cached = measure_and_cache(device, path, quick=True, group=group)
    return to_message(cached)
