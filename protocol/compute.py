"""Compute classes: which nodes' replicas of one shard are expected to be bit-identical.

Two honest replicas agree bit for bit only when the same kernels run in the same order:
the same device model, the same torch / CUDA / cuDNN build, the same precision and, on a
CPU, the same instruction-set flags, oneDNN setting and intra-op thread count (a matmul
large enough to split sums its parts in a thread-count-dependent order). ``class_key``
turns a node's reported ``ComputeClass`` and the precision it trains a job in into one
canonical string; equal keys mean "compare strictly", different keys "cross-class".

``resolve_precision`` maps a job's requested precision to what one node trains in:
``"auto"`` is the device's fastest supported precision (bf16 on CUDA with compute
capability >= 8.0, fp16 on older CUDA, fp32 on a CPU or Apple MPS), anything else must be
in the node's ``precisions`` or the node cannot take the job. Pure functions, no I/O.
"""

from __future__ import annotations

from typing import Final

from .messages import PRECISIONS, ComputeClass

#: what a job spec may ask for: a precision, or "auto" (each node's fastest)
JOB_PRECISIONS: Final = ("auto", *PRECISIONS)

#: ISA flags that change which CPU kernels run (and so the order of a float sum); others are ignored
NUMERIC_ISA: Final = frozenset({
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
    "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16", "asimd", "asimdhp", "sve", "sve2",
    "bf16", "i8mm",
})


def _capability(cc: ComputeClass) -> tuple[int, int]:
    major, _, minor = cc.capability.partition(".")
    try:
        return int(major), int(minor or 0)
    except ValueError:
        return 0, 0


def auto_precision(cc: ComputeClass) -> str | None:
    """The fastest precision this class trains in, among those it offers: bf16 on CUDA with
    compute capability >= 8.0, fp16 on older CUDA, fp32 on a CPU or MPS (bf16 autocast on this
    project's CPU ran the digits MLP at half the fp32 speed, bench/class_distance.py), then the
    next one the node offers. None: it offers nothing."""
    if cc.device_kind == "cuda":
        order = ("bf16", "fp16", "tf32", "fp32") if _capability(cc) >= (8, 0) else ("fp16", "fp32")
    else:
        order = ("fp32", "bf16", "fp16", "tf32")
    return next((p for p in order if p in cc.precisions), None)


def resolve_precision(cc: ComputeClass, requested: str) -> str | None:
    """What a node of class ``cc`` trains a job that asks for ``requested`` in; None: it cannot."""
    if requested == "auto":
        return auto_precision(cc)
    return requested if requested in cc.precisions else None


def class_key(cc: ComputeClass, precision: str) -> str:
    """The canonical class key of ``cc`` training in ``precision`` (a resolved precision or "auto").

    Parts joined by "|": the device kind; for CUDA its compute capability, name and the
    CUDA/cuDNN versions; for a CPU the vendor, the numeric ISA flags (sorted), oneDNN on/off
    and the thread count; for MPS the chip; then the torch version and the precision.
    """
    resolved = resolve_precision(cc, precision) or precision
    kind = cc.device_kind
    if kind == "cuda":
        parts = [kind, f"sm{cc.capability}", cc.device_model, f"cuda{cc.cuda_version}", f"cudnn{cc.cudnn_version}"]
    elif kind == "cpu":
        isa = "+".join(sorted(f for f in set(cc.isa) if f in NUMERIC_ISA)) or "-"
        parts = [kind, cc.cpu_vendor or "-", isa, "onednn" if cc.onednn else "no-onednn", f"t{cc.threads}"]
    else:
        parts = [kind, cc.device_model]
    parts += [f"torch{cc.torch_version}", resolved]
    return "|".join(p.replace("|", "/") for p in parts)


def precision_problem(cc: ComputeClass, requested: str) -> str | None:
    """A one-line reason why a node of class ``cc`` cannot train ``requested`` (None: it can)."""
    if resolve_precision(cc, requested) is not None:
        return None
    return (f"precision {requested} is not supported on this {cc.device_kind} device"
            f" (it trains {', '.join(cc.precisions) or 'nothing'})")


__all__ = ["JOB_PRECISIONS", "NUMERIC_ISA", "auto_precision", "class_key", "precision_problem", "resolve_precision"]
