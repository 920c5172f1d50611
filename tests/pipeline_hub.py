"""What the hub's pipeline tests share: a real hub in a thread (the stages block in theirs), signed
node requests over plain HTTP, and a stage driver that runs one StageAssignment with the node's
own engine (node/pipeline/stage.StageRunner over node/pipeline/relay.RelayTransport): it loads
its units (the job's model, or the unit states it was given), trains its steps on the samples
protocol/pipeline.step_samples names, reports each step and checkpoints its units."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import torch
from gpuflex.hub.server.appkeys import HUB_KEY
from gpuflex.node.errors import PipelineError
from gpuflex.node.pipeline.relay import RelayTransport
from gpuflex.node.pipeline.stage import StageRunner
from gpuflex.node.stagelinks import checked_step
from gpuflex.node.trainer import make_optimizer
from gpuflex.protocol.boundarycodec import BoundaryCode
from gpuflex.protocol.messages import (
    Ack,
    Benchmark,
    BlobRequest,
    DeviceInfo,
    Hello,
    StageAssignment,
    StageReport,
    UnitCheckpoint,
    WorkRequest,
)
from gpuflex.protocol.modelspec import ModelSpec
from gpuflex.protocol.pipeline import (
    cut_state,
    lane_counts,
    lane_place,
    lane_slices,
    load_unit,
    pipeline_units,
    step_samples,
)
from gpuflex.protocol.signing import SigningKey, new_nonce, open_sealed, seal
from gpuflex.protocol.tensors import TensorSpec, decode_state, encode_state
from gpuflex.protocol.version import PROTOCOL_VERSION
from torch import nn

from tests.helpers import start_hub, store_for

#: a pipelined job on the digits: a small MLP cut into ``stages``, ``steps`` steps, a checkpoint
#: every ``every`` (format it; lines added at the end join its [pipeline] section)
DIGITS_SPEC = """
[job]
name = "digits-pipeline"

[model]
kind = "mlp"
input = 64
hidden = [32, 16]
outputs = 10

[train]
batch_size = 32
optimizer = "sgd"
lr = 0.05
momentum = 0.9
seed = 0

[pipeline]
stages = {stages}
micro_batches = 4
schedule = "1f1b"
steps = {steps}
checkpoint_every = {every}
"""
MSGPACK = {"Content-Type": "application/x-msgpack"}


class HubThread:
    """The real hub app on 127.0.0.1, its event loop in a thread."""

    def __init__(self, data_dir: Path, tokens: dict[str, str] | None = None, **config: Any) -> None:
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        config.setdefault("long_poll_max_s", 1.0)
        # the run's PostgreSQL server (if any) starts from this thread: a server started from the
        # hub's thread would stop with it (it dies with the thread that started it)
        config.setdefault("store", store_for(data_dir))

        failed: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.hub = self.loop.run_until_complete(start_hub(data_dir, tokens, **config))
            except BaseException as exc:  # raised in the test's thread below
                failed.append(exc)
                ready.set()
                return
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(60), "the hub did not start within 60 s"
        if failed:
            raise failed[0]
        self.url = self.hub.url
        self.hub_key = self.hub.app[HUB_KEY].public_bytes
        self.tokens = {
            "owner": self.hub.owner_token,
            "auditor": self.hub.auditor_token,
            "admin": self.hub.admin_token,
        }

    def call(self, fn: Any) -> Any:
        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(60)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.hub.stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def request(
    url: str,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii")


def hello(memory: int = 1 << 30, stage_address: str = "", samples_per_s: float = 1000.0) -> Hello:
    return Hello(
        software_version="0.1.0",
        protocol_version=PROTOCOL_VERSION,
        device=DeviceInfo(kind="cpu", name="pipeline-test", memory_bytes=memory, threads=1),
        benchmark=Benchmark(
            samples_per_s=samples_per_s,
            matmul_tflops_fp32=0.1,
            matmul_tflops_bf16=None,
            matmul_tflops_fp16=None,
            mem_bandwidth_gbs=1.0,
            h2d_gbs=None,
            d2h_gbs=None,
            reference_model="mlp-64-128-10",
        ),
        timestamp=time.time(),
        nonce=new_nonce(),
        max_memory_bytes=memory,
        stage_address=stage_address,
    )


def register(url: str, stage_address: str = "", samples_per_s: float = 1000.0) -> SigningKey:
    key = SigningKey.generate()
    msg = hello(stage_address=stage_address, samples_per_s=samples_per_s)
    status, _, body = request(url, "POST", "/v1/nodes/register", seal(key, msg), MSGPACK)
    assert status == 200, body
    return key


def work(hub: HubThread, key: SigningKey, wait_s: float = 1.0) -> bytes:
    """One /v1/work poll's sealed answer."""
    msg = WorkRequest(cached_chunks=(), wait_s=wait_s, timestamp=time.time(), nonce=new_nonce())
    status, _, body = request(hub.url, "POST", "/v1/work", seal(key, msg), MSGPACK)
    assert status == 200, body
    return body


def poll(hub: HubThread, key: SigningKey, wait_s: float = 1.0) -> StageAssignment | None:
    """One /v1/work poll: the StageAssignment handed to this node, or None."""
    body = work(hub, key, wait_s)
    try:
        sa, _ = open_sealed(body, StageAssignment, signer=hub.hub_key)
    except Exception:  # NoWork (or a data-parallel assignment)
        return None
    return sa


def poll_until(
    hub: HubThread, keys: list[SigningKey], timeout_s: float = 30.0
) -> list[StageAssignment]:
    """Every node of ``keys`` polls until each holds its stage of one generation."""
    got: dict[int, StageAssignment] = {}
    give_up = time.monotonic() + timeout_s
    while len(got) < len(keys):
        assert time.monotonic() < give_up, f"only {len(got)} of {len(keys)} nodes got a stage"
        for i, key in enumerate(keys):
            if i not in got:
                sa = poll(hub, key, 0.5)
                if sa is not None:
                    got[i] = sa
    return [got[i] for i in range(len(keys))]


def fetch_blob(url: str, key: SigningKey, sha: str) -> bytes:
    auth = BlobRequest(sha256=sha, timestamp=time.time(), nonce=new_nonce())
    status, _, body = request(
        url, "GET", f"/v1/blobs/{sha}", None, {"X-GPUFlex-Auth": b64(seal(key, auth))}
    )
    assert status == 200, (status, body[:200])
    assert hashlib.sha256(body).hexdigest() == sha
    return body


def send_report(
    url: str,
    key: SigningKey,
    sa: StageAssignment,
    steps_done: int,
    *,
    loss: float | None = None,
    failed: str = "",
    generation: int | None = None,
    stage: int | None = None,
    job_id: str | None = None,
    compute_s: float = 0.01,
    update_s: float = 0.0,
    unit_overhead_s: float = 0.0,
) -> tuple[int, bytes]:
    msg = StageReport(
        job_id=job_id or sa.job_id,
        generation=sa.generation if generation is None else generation,
        stage=sa.stage if stage is None else stage,
        steps_done=steps_done,
        step_s=0.05,
        compute_s=compute_s,
        loss=loss,
        failed=failed,
        timestamp=time.time(),
        nonce=new_nonce(),
        update_s=update_s,
        unit_overhead_s=unit_overhead_s,
    )
    status, _, body = request(url, "POST", "/v1/pipeline/report", seal(key, msg), MSGPACK)
    return status, body


def send_checkpoint(
    url: str,
    key: SigningKey,
    sa: StageAssignment,
    unit: int,
    step: int,
    body: bytes,
    *,
    sha: str | None = None,
    size: int | None = None,
    generation: int | None = None,
    stage: int | None = None,
    job_id: str | None = None,
    content_length: int | None = None,
) -> tuple[int, bytes]:
    msg = UnitCheckpoint(
        job_id=job_id or sa.job_id,
        generation=sa.generation if generation is None else generation,
        stage=sa.stage if stage is None else stage,
        unit=unit,
        step=step,
        sha256=sha or hashlib.sha256(body).hexdigest(),
        size=len(body) if size is None else size,
        timestamp=time.time(),
        nonce=new_nonce(),
    )
    headers = {"X-GPUFlex-Auth": b64(seal(key, msg)), "Content-Type": "application/octet-stream"}
    if content_length is not None:
        headers["Content-Length"] = str(content_length)
    status, _, answer = request(url, "POST", "/v1/pipeline/checkpoint", body, headers)
    return status, answer


def error_of(body: bytes) -> tuple[str, str]:
    doc = json.loads(body)
    assert "\n" not in doc["detail"]
    return doc["error"], doc["detail"]


def ack_of(hub: HubThread, body: bytes) -> Ack:
    ack, _ = open_sealed(body, Ack, signer=hub.hub_key)
    return ack


# -- the stage driver ------------------------------------------------------------------------------


def job_data(url: str, key: SigningKey, sa: StageAssignment) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = [], []
    for chunk in sa.chunks:
        state = decode_state(fetch_blob(url, key, chunk.sha256))
        xs.append(state["x"].clone())
        ys.append(state["y"].clone())
    return torch.cat(xs), torch.cat(ys)


#: the node's optimizers' state (node/optim.py): the attribute holding each slot's tensors, in
#: the order of the stage's parameters
SLOTS = {"momentum_buffer": "bufs", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def unit_state_blob(unit_module: nn.Module, optimizer: Any, params: list[torch.Tensor]) -> bytes:
    """A unit's state as the contract says: its own entries, and its optimizer's (SGD's momentum,
    Adam's moments and step count)."""
    state = {k: v.detach().clone() for k, v in unit_module.state_dict().items()}
    index = {id(p): i for i, p in enumerate(params)}
    for slot, attr in SLOTS.items():
        held = getattr(optimizer, attr, None)
        if held is not None:
            for name, p in unit_module.named_parameters():
                if id(p) in index:  # a trainable one (a LoRA job's frozen weights hold no state)
                    state[f"optim.{slot}.{name}"] = held[index[id(p)]].detach().clone()
    if getattr(optimizer, "exp_avg", None) is not None:
        state["optim.step"] = torch.tensor([optimizer.t], dtype=torch.int64)
    return encode_state(state)


@dataclass
class StageRun:
    """What a driven stage did: the losses of its steps (last stage) and how it ended."""

    losses: list[float] = field(default_factory=list)
    error: str | None = None
    acks: list[bool] = field(default_factory=list)


def load_stage(
    url: str, key: SigningKey, sa: StageAssignment
) -> tuple[nn.Sequential, Any, list[torch.Tensor]]:
    spec = ModelSpec.from_dict(sa.model_spec)
    units = pipeline_units(spec)
    model = decode_state(fetch_blob(url, key, sa.model_hash)) if not sa.unit_states else {}
    given = {u.unit: u for u in sa.unit_states}
    modules, optim_state = [], {}
    for index in range(sa.unit_start, sa.unit_end):
        unit = units[index]
        if index in given:
            state = decode_state(fetch_blob(url, key, given[index].sha256))
            own = {k: v.clone() for k, v in state.items() if not k.startswith("optim.")}
            optim_state[index] = {k: v.clone() for k, v in state.items() if k.startswith("optim.")}
        else:
            own = cut_state(unit, model)
        modules.append(load_unit(unit, own))
    stage = nn.Sequential(*modules)
    params = [p for p in stage.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, sa.train)
    if optim_state:  # the optimizer's state, in the order of the parameters
        first = optim_state[sa.unit_start]
        for slot, attr in SLOTS.items():
            if any(k.startswith(f"optim.{slot}.") for k in first):
                setattr(
                    optimizer,
                    attr,
                    [
                        optim_state[sa.unit_start + k][f"optim.{slot}.{name}"]
                        for k, m in enumerate(modules)
                        for name, p in m.named_parameters()
                        if p.requires_grad
                    ],
                )
        if "optim.step" in first:
            optimizer.t = int(first["optim.step"][0])
    return stage, optimizer, params


def drive(
    hub: HubThread,
    key: SigningKey,
    sa: StageAssignment,
    *,
    stop_at: int | None = None,
    report_last: bool = True,
    timeout_s: float = 30.0,
    tamper: Any = None,
    compute_s: float = 0.01,
) -> StageRun:
    """Run ``sa``'s steps (up to ``stop_at`` steps done, then stop silently; the report of that
    last step only when ``report_last``). ``tamper(runner)``: changes the stage's engine before
    its first step (a faulty stage: its checkpoints still hold its own parameters and optimizer).
    ``compute_s``: the compute time each report says (the hub measures the node's speed by it).
    Blocking: run it in a thread per stage."""
    run = StageRun()
    url = hub.url
    stage_module, optimizer, params = load_stage(url, key, sa)
    place = lane_place(sa.stage_starts, sa.lanes, sa.stage)  # pipelines sharing the steps
    stages, local = place.stages, place.stage
    last = local == stages - 1
    x, y = job_data(url, key, sa) if sa.chunks else (None, None)
    counts = lane_counts(sa.micro_batches, sa.lanes, sa.lane_micro_batches)
    mb = sa.batch_size // sum(counts)
    widths = boundary_shapes(sa, mb)
    inbound = TensorSpec("activation", "float32", widths[local - 1]) if local else None
    outbound = None if last else TensorSpec("activation", "float32", widths[local])
    codes = [
        boundary_code(sa, TensorSpec("activation", "float32", w), c)
        for c, w in enumerate(widths[:-1])
    ]
    transport = RelayTransport(
        url,
        key,
        sa.job_id,
        hub_public_key=hub.hub_key,
        wait_s=1.0,
        peers=dict(enumerate(sa.stage_keys)),
        generation=sa.generation,
    )
    runner = StageRunner(
        module=stage_module,
        stage=local,
        stages=stages,
        transport=transport,
        optimizer=optimizer,
        inbound=inbound,
        outbound=outbound,
        loss_fn=nn.CrossEntropyLoss() if last else None,
        schedule=sa.schedule,
        timeout_s=timeout_s,
        seed=sa.seed,
        lane=place.lane,
        lanes=sa.lanes,
        batch_samples=sa.batch_size,
        first_micro_batch=sum(counts[: place.lane]),
        inbound_code=codes[local - 1] if local else None,
        outbound_code=None if last else codes[local],
        sketched=lambda step: checked_step(sa, step),
    )
    if tamper is not None:
        tamper(runner)
    try:
        for step in range(sa.first_step, sa.end_step):
            inputs, targets = _micro_batches(sa, step, x, y, lane=place.lane)
            loss = runner.run_step(
                step,
                sa.micro_batches,
                inputs=inputs if local == 0 else (),
                targets=targets if last else (),
            )
            done = step + 1
            if loss is not None:
                run.losses.append(loss)
            due = done % sa.checkpoint_every == 0 or done == sa.end_step
            if due and place.lane == 0:  # every pipeline holds the same state: the first saves it
                for k, module in enumerate(stage_module):
                    blob = unit_state_blob(module, optimizer, params)
                    status, body = send_checkpoint(url, key, sa, sa.unit_start + k, done, blob)
                    if status == 409 and b"stale_generation" in body:
                        return run  # the generation is over: the stage ends quietly
                    assert status == 200, (status, body[:300])
            if stop_at is not None and done >= stop_at and not report_last:
                return run
            status, body = send_report(url, key, sa, done, loss=loss, compute_s=compute_s)
            assert status == 200, body
            run.acks.append(ack_of(hub, body).ok)
            if not run.acks[-1] or (stop_at is not None and done >= stop_at):
                return run
    except PipelineError as exc:
        run.error = str(exc)
        send_report(url, key, sa, sa.first_step, failed=str(exc)[:200])
    finally:
        transport.close()
    return run


def boundary_code(sa: StageAssignment, raw: TensorSpec, cut: int) -> BoundaryCode | None:
    """How cut ``cut`` travels under the assignment's boundary, as the node builds it
    (node/pipeline/worker.py): None for fp32."""
    if sa.boundary == "fp32":
        return None
    return BoundaryCode(sa.boundary, sa.boundary_rank, raw=raw, seed=sa.seed, cut=cut)


def boundary_shapes(sa: StageAssignment, mb: int) -> list[tuple[int, ...]]:
    """What crosses after each stage for one micro-batch, found on the meta device."""
    import copy

    spec = ModelSpec.from_dict(sa.model_spec)
    units = pipeline_units(spec)
    starts = lane_place(sa.stage_starts, sa.lanes, sa.stage).starts
    h = torch.zeros((mb, *spec.input_shape), device="meta")
    shapes = []
    with torch.no_grad():
        for s in range(len(starts)):
            end = starts[s + 1] if s + 1 < len(starts) else len(units)
            for u in range(starts[s], end):
                h = copy.deepcopy(units[u].module)(h)
            shapes.append(tuple(h.shape))
    return shapes


def _micro_batches(
    sa: StageAssignment,
    step: int,
    x: torch.Tensor | None,
    y: torch.Tensor | None,
    *,
    lane: int | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Pipeline ``lane``'s micro-batches of step ``step`` (None: every pipeline's)."""
    if x is None or y is None:
        return [], []
    idx = torch.tensor(step_samples(sa.seed, step, sa.batch_size, len(x)))
    bx, by = x[idx], y[idx]
    counts = lane_counts(sa.micro_batches, sa.lanes, sa.lane_micro_batches)
    if lane is None:
        slices = lane_slices(sa.batch_size, (sum(counts),), 0)
    else:
        slices = lane_slices(sa.batch_size, counts, lane)
    return [bx[a:b] for a, b in slices], [by[a:b] for a, b in slices]


def drive_all(
    hub: HubThread, keys: list[SigningKey], assignments: list[StageAssignment], **kw: Any
) -> list[StageRun]:
    """Every stage in its own thread; their runs once all have ended. ``kw`` by node index:
    ``{i: {...}}`` drive()'s options for node i."""
    runs: list[StageRun | None] = [None] * len(keys)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            runs[i] = drive(hub, keys[i], assignments[i], **kw.get("options", {}).get(i, {}))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(keys))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return [r for r in runs if r is not None]


def reference(
    spec_dict: dict[str, Any],
    model: dict[str, torch.Tensor],
    sa: StageAssignment,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
) -> nn.Module:
    """One process: the job's model trained ``steps`` steps on the same samples, each step's
    micro-batches' gradients accumulated (each loss weighted by its share of the step)."""
    from gpuflex.protocol.modelspec import build_model

    spec = ModelSpec.from_dict(spec_dict)
    net = build_model(spec, seed=0)
    net.load_state_dict({k: v.clone() for k, v in model.items()})
    params = [p for p in net.parameters() if p.requires_grad]
    opt = make_optimizer(params, sa.train)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(steps):
        xs, ys = _micro_batches(sa, step, x, y)
        opt.zero_grad()
        for bx, by in zip(xs, ys, strict=True):
            (loss_fn(net(bx), by) * (by.shape[0] / sa.batch_size)).backward()
        opt.step()
    return net


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(
        float(
            (a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp_min(1e-12)
        )
        for k in a
    )


def submit(hub: HubThread, tmp_path: Path, spec: str) -> tuple[int, dict[str, Any]]:
    """Submit a pipelined job on the digits data as the hub's owner: (status, JSON answer)."""
    import aiohttp

    train = digits_npz(tmp_path / "data")

    async def post() -> tuple[int, dict[str, Any]]:
        form = aiohttp.FormData()
        form.add_field("spec", spec.encode(), filename="spec.toml")
        form.add_field("train", train.read_bytes(), filename="train.npz")
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                f"{hub.url}/v1/jobs",
                data=form,
                headers={"Authorization": f"Bearer {hub.tokens['owner']}"},
            ) as r,
        ):
            return r.status, await r.json()

    import asyncio

    return asyncio.run(post())


def digits_npz(directory: Path) -> Path:
    from tests.helpers import digits_arrays

    xtr, ytr, _, _ = digits_arrays()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "train.npz"
    np.savez(path, x=xtr, y=ytr)
    return path
