"""Helpers for the node tests (no tests here): a real in-process hub, a tampering proxy,
an event-collecting output, node processes."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import numpy as np
import torch
from aiohttp import web
from gpuflex.hub.base.config import HubConfig
from gpuflex.hub.server.app import create_app
from gpuflex.hub.server.appkeys import METRICS
from gpuflex.hub.storage.token_admin import create_token
from gpuflex.node.agent import NodeAgent, NodeConfig
from gpuflex.node.benchcache import CACHE_FILE
from gpuflex.node.device import hardware_fingerprint
from gpuflex.node.output import Output
from gpuflex.protocol.messages import Benchmark

from tests.helpers import RELAXED_DEFENCES

FAST_BENCH = Benchmark(
    samples_per_s=20000.0,
    matmul_tflops_fp32=0.05,
    matmul_tflops_bf16=None,
    matmul_tflops_fp16=None,
    mem_bandwidth_gbs=5.0,
    h2d_gbs=None,
    d2h_gbs=None,
    reference_model="test",
)


def spec_toml(
    *,
    rounds: int = 2,
    epochs: int = 1,
    chunk_size: int = 32,
    replication: float = 0.0,
    hidden: int = 16,
    dropout: float = 0.0,
    extra_train: str = "",
    round_target_s: float = 1000.0,
    quorum: int = 2,
    spot_check: float = 0.0,
) -> str:
    return f"""
[job]
name = "node-test"
[model]
kind = "mlp"
input = 8
hidden = [{hidden}]
outputs = 3
dropout = {dropout}
[train]
rounds = {rounds}
local_epochs = {epochs}
batch_size = 16
lr = 0.05
momentum = 0.9
seed = 7
round_target_s = {round_target_s}
{extra_train}
[data]
chunk_size = {chunk_size}
split = "random"
[verification]
replication = {replication}
quorum = {quorum}
replica_wait_s = 30.0
spot_check = {spot_check}
"""


def dataset(n: int = 256, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 1).astype(np.int64)
    buf = io.BytesIO()
    np.savez(buf, x=x, y=y)
    return buf.getvalue()


class EventLog(Output):
    """Collects events in memory (and keeps the JSON-lines contract)."""

    def __init__(self) -> None:
        super().__init__(io.StringIO(), json_lines=True)
        self.events: list[dict[str, Any]] = []

    def event(self, event: str, **fields: Any) -> None:
        super().event(event, **fields)
        self.events.append({"event": event, **fields})

    def names(self) -> list[str]:
        return [e["event"] for e in self.events]

    def of(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == name]


@dataclass
class Hub:
    data_dir: Path
    port: int = 0
    long_poll_max_s: float = 1.0
    min_deadline_s: float = 20.0
    runner: web.AppRunner | None = None
    app: web.Application | None = None
    url: str = ""
    owner_token: str = ""

    async def start(self) -> Hub:
        cfg = HubConfig(
            data_dir=self.data_dir,
            port=self.port,
            long_poll_max_s=self.long_poll_max_s,
            min_deadline_s=self.min_deadline_s,
            sweep_interval_s=0.2,
            **RELAXED_DEFENCES,  # every agent of these tests connects from 127.0.0.1
        )
        self.app = create_app(cfg)
        self.runner = web.AppRunner(self.app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        if not self.owner_token:
            self.owner_token = create_token(self.data_dir, "owner", "tester")
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    def blob_requests(self) -> int:
        assert self.app is not None
        return sum(v for k, v in self.app[METRICS].requests.items() if "blobs" in k)

    async def submit(self, spec: str, train: bytes) -> str:
        async with aiohttp.ClientSession() as s:
            form = aiohttp.FormData()
            form.add_field("spec", spec.encode(), filename="spec.toml")
            form.add_field("train", train, filename="train.npz")
            async with s.post(
                self.url + "/v1/jobs",
                data=form,
                headers={"Authorization": f"Bearer {self.owner_token}"},
            ) as r:
                doc = json.loads(await r.text())
                assert r.status in (200, 201), doc
                return str(doc["id"])

    async def job(self, job_id: str) -> dict[str, Any]:
        async with (
            aiohttp.ClientSession() as s,
            s.get(
                self.url + f"/v1/jobs/{job_id}",
                headers={"Authorization": f"Bearer {self.owner_token}"},
            ) as r,
        ):
            return json.loads(await r.text())

    async def wait_job(self, job_id: str, timeout: float, *, ended: tuple[str, ...] = ("done",),
                       until: Callable[[Hub], Any] | None = None) -> dict[str, Any]:
        """The job's status once its state is one of ``ended`` (or ``until(self)`` holds)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while (doc := await self.job(job_id))["state"] not in ended and not (until and until(self)):
            assert asyncio.get_running_loop().time() < deadline, doc
            await asyncio.sleep(0.2)
        return doc

    def db_rows(self, sql: str, args: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        import sqlite3

        conn = sqlite3.connect(self.data_dir / "hub.sqlite3")
        conn.row_factory = sqlite3.Row
        try:
            return [dict(r) for r in conn.execute(sql, args).fetchall()]
        finally:
            conn.close()


def agent(
    data_dir: Path,
    url: str,
    events: EventLog | None = None,
    cls: type[NodeAgent] = NodeAgent,
    **kw: Any,
) -> NodeAgent:
    cfg = dict(
        hub_url=url,
        data_dir=data_dir,
        device="cpu",
        poll_wait_s=1.0,
        heartbeat_s=0.5,
        backoff_base_s=0.1,
        backoff_cap_s=0.5,
        benchmark=FAST_BENCH,
        control=False,
    )
    cfg.update(kw)
    return cls(NodeConfig(**cfg), output=events or EventLog())


async def wait_for(pred: Callable[[], Any], timeout: float = 20.0, step: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        await asyncio.sleep(step)
    raise AssertionError("condition not met in time")


@dataclass
class TamperProxy:
    """A man in the middle between node and hub; ``mutate(path, body) -> body`` edits answers."""

    target: str
    mutate: Callable[[str, bytes], bytes] = lambda path, body: body
    inline: bool = False  # pass the node's X-GPUFlex-Inline-Max through (models inside work answers)
    intercept: Callable[[str], web.Response | None] | None = None  # answer instead of the hub
    seen: list[str] = field(default_factory=list)
    runner: web.AppRunner | None = None
    url: str = ""

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(f"{request.method} {request.path}")
        body = await request.read()
        if self.intercept is not None and (answer := self.intercept(request.path)) is not None:
            return answer
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() in ("x-gpuflex-auth", "x-gpuflex-update", "content-type", "range")
            or (self.inline and k.lower() == "x-gpuflex-inline-max")
        }
        async with (
            aiohttp.ClientSession() as s,
            s.request(
                request.method, self.target + request.path_qs, data=body or None, headers=headers
            ) as r,
        ):
            data = await r.read()
            status = r.status
            ctype = r.headers.get("Content-Type", "application/octet-stream").split(";")[0]
            passed = {k: v for k, v in r.headers.items() if k.lower() == "x-gpuflex-sealed-length"}
        if status in (200, 206):
            data = self.mutate(request.path, data)
        return web.Response(body=data, status=status, content_type=ctype, headers=passed)

    async def start(self) -> TamperProxy:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def flip_signature(envelope: bytes) -> bytes:
    env = msgpack.unpackb(envelope, raw=False)
    sig = bytearray(env["sig"])
    sig[0] ^= 1
    env["sig"] = bytes(sig)
    return msgpack.packb(env, use_bin_type=True)


# -- node processes -----------------------------------------------------------------------


def seed_bench_cache(data_dir: Path, threads: int = 1) -> None:
    """Pre-write bench.json for this hardware so a node process skips its start-up benchmark."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fp = hardware_fingerprint(torch.device("cpu"))
    finally:
        torch.set_num_threads(before)
    data_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "fingerprint": fp,
        "quick": True,
        "samples_per_s": 20000.0,
        "matmul_tflops_fp32": 0.05,
        "matmul_tflops_bf16": None,
        "matmul_tflops_fp16": None,
        "mem_bandwidth_gbs": 5.0,
        "h2d_gbs": None,
        "d2h_gbs": None,
        "reference_model": "test",
    }
    (data_dir / CACHE_FILE).write_text(json.dumps(results))


def start_node_process(data_dir: Path, url: str, *extra: str) -> subprocess.Popen[str]:
    seed_bench_cache(data_dir)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpuflex.node",
            "run",
            "--hub",
            url,
            "--data-dir",
            str(data_dir),
            "--device",
            "cpu",
            "--threads",
            "1",
            "--poll-wait",
            "1",
            "--heartbeat",
            "0.5",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


class ProcessEvents:
    """Reads a node process's JSON lines on a thread so the test can wait on events."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        import threading

        self.proc = proc
        self.events: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.raw.append(line)
            try:
                self.events.append(json.loads(line))
            except ValueError:
                pass

    def names(self) -> list[str]:
        return [e.get("event", "") for e in self.events]

    def of(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == name]
