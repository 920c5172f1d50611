"""GFT1 codec vs torch.save/torch.load, safetensors and a plain memcpy.

Encodes then decodes a ~25M-parameter float32 state dict (bytes in memory, no
disk), best of N runs each, all in one process so the ratios are fair. Prints a
table and writes bench/results/codec.json.

    python bench/codec.py [--params 25000000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import math
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from gpuflex.protocol import decode_state, encode_state

GB = 1e9


def make_state(params: int) -> dict[str, torch.Tensor]:
    """A transformer-like mix: one embedding, square and 4x-wide linears, biases, norms."""
    g = torch.Generator().manual_seed(0)
    width = 1024
    state: dict[str, torch.Tensor] = {"embed.weight": torch.randn(4096, width, generator=g)}
    layer = 0
    while sum(t.numel() for t in state.values()) < params:
        p = f"layers.{layer}"
        state[f"{p}.attn.weight"] = torch.randn(width, width, generator=g)
        state[f"{p}.attn.bias"] = torch.randn(width, generator=g)
        state[f"{p}.mlp.weight"] = torch.randn(width * 4, width // 4, generator=g)
        state[f"{p}.mlp.bias"] = torch.randn(width * 4, generator=g)
        state[f"{p}.norm.weight"] = torch.ones(width)
        layer += 1
    return state


def best(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time of ``repeats`` calls (seconds); results dropped outside the timing."""
    times = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
        del result
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=25_000_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "codec.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    state = make_state(args.params)
    n_params = sum(t.numel() for t in state.values())
    payload = sum(t.numel() * t.element_size() for t in state.values())

    # Ours: one copy on encode, none on decode.
    blob = encode_state(state)
    out = decode_state(blob)
    if not all(torch.equal(out[k], state[k]) for k in state):
        raise SystemExit("GFT1 round trip mismatch")
    t_enc = best(lambda: encode_state(state), args.repeats)
    t_dec = best(lambda: decode_state(blob), max(args.repeats, 50))
    t_ours = best(lambda: decode_state(encode_state(state)), args.repeats)

    # torch.save / torch.load(weights_only=True) through BytesIO.
    def torch_save() -> bytes:
        buf = io.BytesIO()
        torch.save(state, buf)
        return buf.getvalue()

    saved = torch_save()

    def torch_load() -> object:
        return torch.load(io.BytesIO(saved), weights_only=True)

    t_tsave = best(torch_save, args.repeats)
    t_tload = best(torch_load, args.repeats)
    t_torch = best(lambda: torch.load(io.BytesIO(torch_save()), weights_only=True), args.repeats)

    # safetensors from/to bytes.
    st_blob = st_save(state)
    t_ssave = best(lambda: st_save(state), args.repeats)
    t_sload = best(lambda: st_load(st_blob), args.repeats)
    t_safe = best(lambda: st_load(st_save(state)), args.repeats)

    # A plain copy of the same number of bytes (the floor for anything that copies once).
    t_memcpy = best(lambda: bytearray(blob), args.repeats)
    flat = torch.cat([t.reshape(-1) for t in state.values()])
    t_clone = best(flat.clone, args.repeats)
    t_copy = min(t_memcpy, t_clone)

    gbs = {
        "ours_roundtrip_gbs": payload / t_ours / GB,
        "ours_encode_gbs": payload / t_enc / GB,
        "torch_roundtrip_gbs": payload / t_torch / GB,
        "torch_save_gbs": payload / t_tsave / GB,
        "torch_load_gbs": payload / t_tload / GB,
        "safetensors_roundtrip_gbs": payload / t_safe / GB,
        "safetensors_save_gbs": payload / t_ssave / GB,
        "safetensors_load_gbs": payload / t_sload / GB,
        "memcpy_gbs": payload / t_copy / GB,
        "bytearray_copy_gbs": payload / t_memcpy / GB,
        "torch_clone_gbs": payload / t_clone / GB,
    }
    figures: dict[str, float] = {
        **{k: round(v, 3) for k, v in gbs.items()},
        "decode_zero_copy_us": round(t_dec * 1e6, 1),
        "decode_per_tensor_us": round(t_dec * 1e6 / len(state), 2),
        "ours_encode_ms": round(t_enc * 1e3, 2),
        "ours_roundtrip_ms": round(t_ours * 1e3, 2),
        "torch_roundtrip_ms": round(t_torch * 1e3, 2),
        "safetensors_roundtrip_ms": round(t_safe * 1e3, 2),
        "memcpy_ms": round(t_copy * 1e3, 2),
        "params": n_params,
        "tensors": len(state),
        "payload_bytes": payload,
        "blob_overhead_bytes": len(blob) - payload,
        "repeats": args.repeats,
        "threads": args.threads,
    }
    ratios = {
        "vs_torch": round(gbs["ours_roundtrip_gbs"] / gbs["torch_roundtrip_gbs"], 2),
        "vs_safetensors": round(gbs["ours_roundtrip_gbs"] / gbs["safetensors_roundtrip_gbs"], 2),
        "vs_memcpy": round(gbs["ours_roundtrip_gbs"] / gbs["memcpy_gbs"], 2),
    }
    result = {
        "name": "codec",
        "figures": figures,
        "ratios": ratios,
        "machine": f"{platform.machine()} {platform.python_implementation()} {platform.python_version()} "
        f"torch {torch.__version__}",
    }

    rows = [
        ("GFT1 encode+decode", t_ours, gbs["ours_roundtrip_gbs"]),
        ("  encode only", t_enc, gbs["ours_encode_gbs"]),
        ("  decode only (zero-copy)", t_dec, payload / t_dec / GB if t_dec else math.inf),
        ("torch.save+load(weights_only)", t_torch, gbs["torch_roundtrip_gbs"]),
        ("  torch.save", t_tsave, gbs["torch_save_gbs"]),
        ("  torch.load", t_tload, gbs["torch_load_gbs"]),
        ("safetensors save+load", t_safe, gbs["safetensors_roundtrip_gbs"]),
        ("  save", t_ssave, gbs["safetensors_save_gbs"]),
        ("  load", t_sload, gbs["safetensors_load_gbs"]),
        ("memcpy (best of bytearray/clone)", t_copy, gbs["memcpy_gbs"]),
    ]
    print(f"state dict: {n_params / 1e6:.1f}M float32 params in {len(state)} tensors, "
          f"{payload / 1e6:.1f} MB; best of {args.repeats}; {args.threads} torch thread(s)")
    print(f"{'operation':36} {'time':>12} {'GB/s':>10}")
    for name, seconds, rate in rows:
        shown = f"{seconds * 1e3:9.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:9.1f} us"
        print(f"{name:36} {shown:>12} {rate:10.2f}")
    print(f"zero-copy decode: {t_dec * 1e6:.0f} us total, {t_dec * 1e6 / len(state):.1f} us per tensor "
          "(header validation + one torch.frombuffer view per tensor)")
    print("ratios: " + ", ".join(f"{k} = {v}" for k, v in ratios.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
