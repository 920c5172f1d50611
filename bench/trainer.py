"""The node's training path against a plain PyTorch loop, and the node's fixed cost per assignment.

1. Throughput: ``train_assignment`` (what a node runs: build from spec, load the global state,
   stack chunks, seeded shuffle, train, compute the delta) against a plain, tight PyTorch loop
   (build, load, randperm + index, zero_grad/forward/backward/step with torch.optim.SGD; also
   with foreach=True, the fastest torch.optim variant) on the same model, data,
   batch size and thread count, in the same process, with interleaved repeats (order alternates)
   and medians. ratio = ours samples/s / plain samples/s (target >= 0.95).

2. Fixed cost for a 25M-parameter model: everything the node does per assignment that is not
   training: verify the sealed assignment, load model + chunks from the cache (mmap), check the
   manifest, encode the delta, sha256 it, seal the header, and stream it over loopback HTTP to a
   sink that hashes and writes it to disk like the hub's upload handler. Reported as a fraction
   of one local epoch over a 10,000-sample shard of that model (the epoch time is measured on
   a sample of batches and scaled to 10,000 samples).

Run: .venv/bin/python bench/trainer.py [--quick]  -> bench/results/trainer.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from gpuflex.node.trainer import train_assignment
from gpuflex.protocol.messages import Assignment, ChunkRef, TrainConfig, UpdateHeader
from gpuflex.protocol.modelspec import ModelSpec, build_model, manifest, param_count
from gpuflex.protocol.signing import SigningKey, new_nonce, open_sealed, seal
from gpuflex.protocol.tensors import check_manifest, encode_state, load_state_file, sha256_hex

RESULTS = Path(__file__).resolve().parent / "results" / "trainer.json"


def _cfg(batch: int, epochs: int = 1) -> TrainConfig:
    return TrainConfig(local_epochs=epochs, batch_size=batch, optimizer="sgd", lr=0.05, momentum=0.9,
                       weight_decay=0.0, beta1=0.9, beta2=0.999, loss="cross_entropy", grad_clip=0.0)


def plain_torch(spec: ModelSpec, state: dict, x: torch.Tensor, y: torch.Tensor, batch: int,
                epochs: int, seed: int, foreach: bool | None = None) -> float:
    """The loop a PyTorch user writes by hand; returns wall seconds."""
    t0 = time.perf_counter()
    model = build_model(spec, seed=0)
    model.load_state_dict(state)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=foreach)
    n = x.shape[0]
    for epoch in range(epochs):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        for i in range(0, n, batch):
            idx = perm[i : i + batch]
            opt.zero_grad()
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
    return time.perf_counter() - t0


def ours(spec: ModelSpec, state: dict, chunks: list, batch: int, epochs: int, seed: int) -> float:
    t0 = time.perf_counter()
    train_assignment(spec, state, chunks, _cfg(batch, epochs), seed, device=torch.device("cpu"))
    return time.perf_counter() - t0


def compare(name: str, spec_dict: dict, n: int, batch: int, epochs: int, chunk: int, repeats: int) -> dict:
    spec = ModelSpec.from_dict(spec_dict)
    state = build_model(spec, seed=1).state_dict()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, *spec.input_shape, generator=g)
    y = torch.randint(0, spec.outputs, (n,), generator=g)
    chunks = [{"x": x[i : i + chunk], "y": y[i : i + chunk]} for i in range(0, n, chunk)]
    # warm-up both paths (lazy init, allocator)
    ours(spec, state, chunks, batch, 1, 0)
    plain_torch(spec, state, x, y, batch, 1, 0)
    plain_torch(spec, state, x, y, batch, 1, 0, foreach=True)
    t_ours, t_plain, t_foreach = [], [], []
    for r in range(repeats):
        runs = [lambda r=r: t_ours.append(ours(spec, state, chunks, batch, epochs, r)),
                lambda r=r: t_plain.append(plain_torch(spec, state, x, y, batch, epochs, r)),
                lambda r=r: t_foreach.append(plain_torch(spec, state, x, y, batch, epochs, r, foreach=True))]
        for i in range(3):  # rotate the order every repeat
            runs[(i + r) % 3]()
    samples = n * epochs
    ours_sps = samples / statistics.median(t_ours)
    plain_sps = samples / statistics.median(t_plain)
    return {"workload": name, "model": spec_dict, "params": param_count(spec), "samples": n,
            "batch_size": batch, "epochs": epochs, "repeats": repeats,
            "ours_samples_per_s": round(ours_sps, 1), "plain_torch_samples_per_s": round(plain_sps, 1),
            "ratio": round(ours_sps / plain_sps, 4),
            "plain_torch_foreach_samples_per_s": round(samples / statistics.median(t_foreach), 1),
            "ratio_vs_plain_foreach": round(ours_sps / (samples / statistics.median(t_foreach)), 4),
            "ours_s": [round(t, 5) for t in t_ours], "plain_s": [round(t, 5) for t in t_plain],
            "plain_foreach_s": [round(t, 5) for t in t_foreach]}


async def _loopback_upload(body: bytes, header_token: str, sink_dir: Path) -> float:
    """POST the update to a local aiohttp sink that streams, hashes and fsyncs it like the hub."""
    import aiohttp
    from aiohttp import web

    async def receive(request: web.Request) -> web.Response:
        digest = hashlib.sha256()
        path = sink_dir / "upload.tmp"
        with open(path, "wb") as fh:
            while piece := await request.content.read(1 << 20):
                digest.update(piece)
                fh.write(piece)
            fh.flush()
            os.fsync(fh.fileno())
        return web.json_response({"sha": digest.hexdigest()})

    app = web.Application(client_max_size=1 << 31)
    app.router.add_post("/v1/updates", receive)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as s:
            t0 = time.perf_counter()
            async with s.post(f"http://127.0.0.1:{port}/v1/updates", data=body,
                              headers={"X-GPUFlex-Update": header_token}) as r:
                doc = await r.json()
            elapsed = time.perf_counter() - t0
        if doc["sha"] != hashlib.sha256(body).hexdigest():
            raise RuntimeError("sink received other bytes")
        return elapsed
    finally:
        await runner.cleanup()


def fixed_cost(quick: bool) -> dict:
    """Per-assignment overhead for a ~25M-parameter MLP vs one local epoch of 10,000 samples."""
    spec_dict = {"kind": "mlp", "input": 1024, "hidden": [4096, 4096, 1024], "outputs": 10}
    spec = ModelSpec.from_dict(spec_dict)
    params = param_count(spec)
    hub, node = SigningKey.generate(), SigningKey.generate()
    state = build_model(spec, seed=0).state_dict()
    shard, chunk_n, batch = 10_000, 500, 64
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        model_blob = encode_state(state)
        model_sha = sha256_hex(model_blob)
        (root / model_sha).write_bytes(model_blob)
        g = torch.Generator().manual_seed(0)
        refs = []
        for _ in range(shard // chunk_n):
            c = encode_state({"x": torch.randn(chunk_n, 1024, generator=g),
                              "y": torch.randint(0, 10, (chunk_n,), generator=g)})
            sha = sha256_hex(c)
            (root / sha).write_bytes(c)
            refs.append(ChunkRef(sha256=sha, size=len(c), samples=chunk_n))
        del model_blob
        now = time.time()
        a = Assignment(assignment_id="a-bench", job_id="j-bench", round=0, node_id=node.fingerprint,
                       model_hash=model_sha, model_size=(root / model_sha).stat().st_size,
                       model_spec=spec.to_dict(), chunks=tuple(refs), seed=1, train=_cfg(batch),
                       issued_at=now, deadline=now + 3600, replica_group="")
        sealed = seal(hub, a)

        timings: dict[str, float] = {}
        t = time.perf_counter()
        got, _ = open_sealed(sealed, Assignment, signer=hub.public_bytes)
        ModelSpec.from_dict(got.model_spec)
        timings["verify_assignment_s"] = time.perf_counter() - t

        t = time.perf_counter()
        global_state = load_state_file(root / model_sha)
        check_manifest(global_state, manifest(spec))
        chunks = [load_state_file(root / r.sha256) for r in got.chunks]
        timings["load_from_cache_s"] = time.perf_counter() - t

        # One local epoch, measured on a slice of the shard and scaled to 10,000 samples.
        sample_n = 256 if quick else 1024
        sub = [{"x": chunks[0]["x"][:sample_n].clone(), "y": chunks[0]["y"][:sample_n].clone()}]
        train_assignment(spec, global_state, [{"x": sub[0]["x"][:batch], "y": sub[0]["y"][:batch]}],
                         _cfg(batch), 0, device=torch.device("cpu"))  # warm-up
        result = train_assignment(spec, global_state, sub, _cfg(batch), 1, device=torch.device("cpu"))
        epoch_s = result.train_s * shard / sample_n

        t = time.perf_counter()
        body = encode_state(result.delta)
        timings["encode_s"] = time.perf_counter() - t
        t = time.perf_counter()
        digest = sha256_hex(body)
        timings["hash_s"] = time.perf_counter() - t
        t = time.perf_counter()
        header = UpdateHeader(assignment_id=a.assignment_id, update_sha256=digest, update_size=len(body),
                              sample_count=shard, metrics={"loss": result.loss}, timings={"train_s": epoch_s},
                              timestamp=time.time(), nonce=new_nonce())
        token = base64.urlsafe_b64encode(seal(node, header)).decode()
        timings["sign_s"] = time.perf_counter() - t
        timings["upload_loopback_s"] = asyncio.run(_loopback_upload(body, token, root))
        total = sum(timings.values())
    return {"model": spec_dict, "params": params, "update_bytes": len(body), "shard_samples": shard,
            "batch_size": batch, "epoch_measured_on_samples": sample_n,
            "local_epoch_s_estimated": round(epoch_s, 3),
            "timings": {k: round(v, 4) for k, v in timings.items()}, "fixed_cost_s": round(total, 4),
            "fixed_cost_fraction_of_epoch": round(total / epoch_s, 5)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats, smaller samples")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    reps = 5 if args.quick else 11
    workloads = [
        compare("digits-mlp 64-128-10 b32 (docs/peers.md job)", {"kind": "mlp", "input": 64, "hidden": [128],
                "outputs": 10}, 1437, 32, 1, 64, reps),
        compare("mlp 784-256-10 b64", {"kind": "mlp", "input": 784, "hidden": [256], "outputs": 10},
                4096, 64, 1, 512, reps),
    ]
    cost = fixed_cost(args.quick)
    ratios = [w["ratio"] for w in workloads]
    out = {
        "bench": "trainer",
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch": torch.__version__, "threads": args.threads, "python": sys.version.split()[0],
                    "loadavg_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None},
        "ratios": {"vs_plain_torch": round(min(ratios), 4),
                   "vs_plain_torch_by_workload": {w["workload"]: w["ratio"] for w in workloads},
                   "vs_plain_torch_foreach_sgd_by_workload": {
                       w["workload"]: w["ratio_vs_plain_foreach"] for w in workloads},
                   "fixed_cost_fraction_of_epoch_25M": cost["fixed_cost_fraction_of_epoch"]},
        "target": {"vs_plain_torch": ">= 0.95"},
        "workloads": workloads,
        "fixed_cost_25M": cost,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    for w in workloads:
        print(f"{w['workload']:<42} ours {w['ours_samples_per_s']:>10,.0f}/s  plain {w['plain_torch_samples_per_s']:>10,.0f}/s"
              f"  ratio {w['ratio']:.3f}  (vs foreach SGD {w['ratio_vs_plain_foreach']:.3f})")
    print(f"25M-param fixed cost {cost['fixed_cost_s']:.3f} s = {cost['fixed_cost_fraction_of_epoch']:.4f} of a "
          f"{cost['local_epoch_s_estimated']:.1f} s local epoch over 10,000 samples  {cost['timings']}")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
