"""Shared test helpers: digits data, an in-process hub, and a simulated node.

The simulated node signs with gpuflex.protocol and trains with
gpuflex.node.trainer.train_assignment (the node's real trainer), so hub tests
exercise the real wire without importing hub code into the node or vice versa.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import os
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import torch
from aiohttp import web
from gpuflex.protocol.messages import (
    Abandon,
    Ack,
    Assignment,
    Benchmark,
    BlobRequest,
    Commitment,
    DeviceInfo,
    Heartbeat,
    Hello,
    NoWork,
    StateRequest,
    StateUnavailable,
    StateUpload,
    UpdateHeader,
    Welcome,
    WorkRequest,
    progress_digest,
)
from gpuflex.protocol.modelspec import ModelSpec
from gpuflex.protocol.signing import SigningKey, new_nonce, open_sealed, seal
from gpuflex.protocol.tensors import decode_state, encode_state
from gpuflex.protocol.version import PROTOCOL_VERSION, SOFTWARE_VERSION

MSGPACK = {"Content-Type": "application/x-msgpack"}

DIGITS_SPEC = """
[job]
name = "digits-mlp"

[model]
kind = "mlp"
input = 64
hidden = [128]
outputs = 10
activation = "relu"

[train]
rounds = {rounds}
local_epochs = 1
batch_size = 32
optimizer = "sgd"
lr = 0.05
momentum = 0.9
seed = 0
round_target_s = {round_target_s}

[data]
chunk_size = {chunk_size}
split = "stratified"

[verification]
replication = {replication}
replica_wait_s = {replica_wait_s}
spot_check = {spot_check}
spot_check_trusted = {spot_check_trusted}
"""


def digits_spec(
    *,
    rounds: int = 2,
    round_target_s: float = 86400.0,
    chunk_size: int = 64,
    replication: str = "0.0",
    replica_wait_s: float = 30.0,
    spot_check: float = 0.0,
    spot_check_trusted: float = 0.0,
    extra: str = "",
) -> str:
    return (
        DIGITS_SPEC.format(
            rounds=rounds,
            round_target_s=round_target_s,
            chunk_size=chunk_size,
            replication=replication,
            replica_wait_s=replica_wait_s,
            spot_check=spot_check,
            spot_check_trusted=spot_check_trusted,
        )
        + extra
    )


_DIGITS: tuple[np.ndarray, ...] | None = None


def digits_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """sklearn's digits (read from its bundled CSV without importing sklearn: fast),
    stratified 80/20 split with a fixed seed, features / 16. Returns (x_train, y_train, x_val, y_val)."""
    global _DIGITS
    if _DIGITS is None:
        import importlib.util

        spec = importlib.util.find_spec("sklearn")
        assert spec is not None and spec.origin is not None
        raw = np.loadtxt(
            Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz", delimiter=","
        )
        x = (raw[:, :-1] / 16.0).astype(np.float32)
        y = raw[:, -1].astype(np.int64)
        rng = np.random.default_rng(0)
        val_idx = []
        for label in range(10):
            idx = np.flatnonzero(y == label)
            val_idx.extend(rng.choice(idx, size=round(idx.size * 0.2), replace=False).tolist())
        mask = np.zeros(y.size, dtype=bool)
        mask[val_idx] = True
        _DIGITS = (x[~mask], y[~mask], x[mask], y[mask])
    return _DIGITS  # type: ignore[return-value]


def write_digits(directory: Path, **spec_kw: Any) -> tuple[Path, Path, Path]:
    xtr, ytr, xva, yva = digits_arrays()
    directory.mkdir(parents=True, exist_ok=True)
    train, val, spec = directory / "train.npz", directory / "val.npz", directory / "spec.toml"
    np.savez(train, x=xtr, y=ytr)
    np.savez(val, x=xva, y=yva)
    spec.write_text(digits_spec(**spec_kw))
    return train, val, spec


# -- in-process hub -------------------------------------------------------------------------------


#: HubConfig settings that let many SimNodes of one address block and one process work together
RELAXED_DEFENCES: dict[str, Any] = {
    "separate_replicas": False, "registrations_per_block": 100_000, "registrations_global": 100_000,
    "probation_per_block": 100_000, "trust_min_age_s": 0.0, "unproven_max_chunks": 0,
    "bench_seed_max_sps": 1e9, "stall_backoff_s": 0.0,
}


# -- the store the tests' hubs run on --------------------------------------------------------------
#: ``make test`` runs the suite twice (issue 16): on SQLite, the embedded default, and again with
#: GPUFLEX_TEST_STORE=postgresql, where every hub these helpers start (``start_hub``, conftest's
#: ``hub_process``) keeps its state in a PostgreSQL database of its own: one per data folder, so a
#: hub restarted on the same folder finds its state, on one server for the whole run (started on
#: first use, tests/tooling/postgres.py; stopped by conftest's ``_test_store`` at the end).
TEST_STORE = os.environ.get("GPUFLEX_TEST_STORE", "sqlite")
if TEST_STORE not in ("sqlite", "postgresql"):
    raise RuntimeError(f"GPUFLEX_TEST_STORE={TEST_STORE!r}: sqlite or postgresql")
_DATABASES: dict[Path, str] = {}
_SERVER: list[Any] = []  # the run's PostgreSQL server, once started


def store_for(data_dir: Path) -> str | None:
    """The --store of the hub on ``data_dir`` in this run: None (its SQLite file), or its database's URL."""
    if TEST_STORE == "sqlite":
        return None
    key = Path(data_dir).resolve()
    if key not in _DATABASES:
        if not _SERVER:
            from tests.tooling.postgres import MISSING, PostgresServer, find_bin_dir

            bin_dir = find_bin_dir()
            if bin_dir is None:
                raise RuntimeError(f"GPUFLEX_TEST_STORE=postgresql, but {MISSING}")
            server = PostgresServer(bin_dir)
            server.start()
            _SERVER.append(server)
        _DATABASES[key] = str(_SERVER[0].new_database())
    return _DATABASES[key]


def stop_test_store() -> None:
    while _SERVER:
        _SERVER.pop().stop()


def open_store(data_dir: Path, url: str | None = None) -> Any:
    """A connection to the state of the hub on ``data_dir`` (whichever store this run uses, or the
    PostgreSQL ``url`` a test gave it), for a test to read (or, to stage a case, write) rows:
    ``execute(sql, params)`` with ``?`` placeholders, rows as tuples, ``commit()``, ``close()``."""
    url = url or store_for(data_dir)
    if url is None:
        import sqlite3

        return sqlite3.connect(Path(data_dir) / "hub.sqlite3")  # rows are tuples
    from gpuflex.hub.storage.store_postgres import connect

    return _TupleRows(connect(url))


class _TupleRows:
    """The hub's PostgreSQL connection (its `?` statements) with rows as tuples, as sqlite3 gives them."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def execute(self, sql: str, params: Any = ()) -> Any:
        from psycopg.rows import tuple_row

        cur = self.conn.execute(sql, params)
        cur.row_factory = tuple_row
        return cur

    def commit(self) -> None:
        self.conn.commit()

    def close(self) -> None:
        self.conn.close()


def stored_blobs(data_dir: Path) -> dict[str, bytes]:
    """Every blob the hub on ``data_dir`` stores in its folder, by id: the files of their own
    (``blobs/<xx>/<sha>``) and the packed ones (``blobs/pack.sqlite3``, hub/storage/blobpack.py). Read
    without opening a BlobStore, which would empty the live hub's working folders."""
    import sqlite3

    root = Path(data_dir) / "blobs"
    found = {p.name: p.read_bytes() for p in root.glob("[0-9a-f][0-9a-f]/*") if p.is_file()}
    if (root / "pack.sqlite3").exists():
        conn = sqlite3.connect(f"{(root / 'pack.sqlite3').as_uri()}?mode=ro", uri=True)
        try:
            found.update((sha, bytes(data)) for sha, data in conn.execute("SELECT sha, data FROM blobs"))
        finally:
            conn.close()
    return found


def store_args(data_dir: Path) -> list[str]:
    """``--store URL`` for a `gpuflex-hub` command on ``data_dir`` in this run, or nothing."""
    url = store_for(data_dir)
    return ["--store", url] if url else []


#: the same, as `gpuflex-hub serve` options (hubs started as processes by tests)
RELAXED_SERVE_ARGS: tuple[str, ...] = (
    "--allow-shared-blocks", "--registrations-per-block", "100000", "--registrations-global", "100000",
    "--trust-min-age", "0", "--unproven-max-chunks", "0",
)


def production_defences() -> dict[str, Any]:
    """The HubConfig defaults of every setting RELAXED_DEFENCES relaxes (pass to start_hub)."""
    from gpuflex.hub.base.config import HubConfig

    d = HubConfig(data_dir=Path("."))
    return {k: getattr(d, k) for k in RELAXED_DEFENCES}


@dataclass
class RunningHub:
    url: str
    data_dir: Path
    owner_token: str
    auditor_token: str
    admin_token: str
    fingerprint: str
    app: web.Application
    runner: web.AppRunner

    async def stop(self) -> None:
        await self.runner.cleanup()

    @property
    def store(self) -> str | None:
        """The hub's --store: None for its SQLite file, else its PostgreSQL database's URL."""
        from gpuflex.hub.server.appkeys import CONFIG

        return self.app[CONFIG].store

    def token(self, role: str, name: str) -> str:
        """A new token in the hub's own store (as `gpuflex-hub token create` makes one)."""
        from gpuflex.hub.storage.token_admin import create_token

        return create_token(self.data_dir, role, name, store=self.store)

    def auth(self, token: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token or self.owner_token}"}

    def replica_group(self, assignment_id: str) -> str:
        """The hub's own record of a live assignment's replica group ("" = not replicated): the
        signed assignment never says, so tests ask the hub."""
        from gpuflex.hub.server.appkeys import LEDGER

        scheduler = self.app[LEDGER].scheduler
        a = scheduler.assignments.get(assignment_id)
        if a is not None:
            return scheduler.jobs[a.job_id].shards[a.shard_id].replica_group
        conn = open_store(self.data_dir)  # no longer live (uploaded): the store's rows
        try:
            row = conn.execute("SELECT s.replica_group FROM assignments a JOIN shards s ON s.id = a.shard_id"
                               " WHERE a.id = ?", (assignment_id,)).fetchone()
        finally:
            conn.close()
        assert row is not None, f"the hub has no assignment {assignment_id}"
        return str(row[0])


async def start_hub(
    data_dir: Path, tokens: dict[str, str] | None = None, **config_kw: Any
) -> RunningHub:
    """Start the real app on 127.0.0.1:0. `tokens` reuses tokens of an earlier start on the same dir
    (and store: `store=` a PostgreSQL URL runs it on PostgreSQL)."""
    from gpuflex.hub.base.config import HubConfig
    from gpuflex.hub.server.app import create_app
    from gpuflex.hub.server.appkeys import FIRST_ADMIN_TOKEN, HUB_KEY
    from gpuflex.hub.storage.token_admin import create_token

    config_kw.setdefault("long_poll_max_s", 2.0)
    config_kw.setdefault("sweep_interval_s", 0.2)
    config_kw.setdefault("store", store_for(data_dir))
    # Every SimNode of these tests shares one session, so one address block: the Sybil defences
    # (hub/policy/admission.py) are relaxed here, as a single-machine test bed must. tests/test_sybil.py
    # runs the production defaults (`production_defences()`) with nodes in distinct blocks.
    for key, value in RELAXED_DEFENCES.items():
        config_kw.setdefault(key, value)
    app = create_app(HubConfig(data_dir=data_dir, port=0, **config_kw))
    if tokens is None:
        store = config_kw.get("store")  # a PostgreSQL URL, or None: SQLite in data_dir
        tokens = {
            "owner": create_token(data_dir, "owner", "alice", store=store),
            "auditor": create_token(data_dir, "auditor", "audrey", store=store),
            "admin": app[FIRST_ADMIN_TOKEN] or create_token(data_dir, "admin", "root", store=store),
        }
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return RunningHub(
        url=f"http://127.0.0.1:{port}",
        data_dir=data_dir,
        owner_token=tokens["owner"],
        auditor_token=tokens["auditor"],
        admin_token=tokens["admin"],
        fingerprint=app[HUB_KEY].fingerprint,
        app=app,
        runner=runner,
    )


async def submit_job(
    session: aiohttp.ClientSession,
    hub: RunningHub,
    spec: Path | str | bytes,
    train: Path,
    val: Path | None = None,
    token: str | None = None,
) -> aiohttp.ClientResponse:
    form = aiohttp.FormData()
    spec_bytes = (
        spec.read_bytes()
        if isinstance(spec, Path)
        else (spec.encode() if isinstance(spec, str) else spec)
    )
    form.add_field("spec", spec_bytes, filename="spec.toml")
    form.add_field("train", train.read_bytes(), filename=train.name)
    if val is not None:
        form.add_field("val", val.read_bytes(), filename=val.name)
    return await session.post(f"{hub.url}/v1/jobs", data=form, headers=hub.auth(token))


async def when_job_arrives(nodes: list[SimNode], session: aiohttp.ClientSession, hub: RunningHub,
                           spec: Path | str | bytes, train: Path, val: Path | None = None,
                           ) -> tuple[dict[str, Any], list[Any]]:
    """Register the nodes; every one waits in its long-poll when the job is submitted (so the
    round is cut over all of them): the job's JSON and each node's answer (an Assignment, or NoWork)."""
    import asyncio

    for n in nodes:
        await n.register()
    polls = [asyncio.create_task(n.work(wait_s=8.0)) for n in nodes]
    await asyncio.sleep(0.3)  # every node is inside its long-poll
    r = await submit_job(session, hub, spec, train, val)
    assert r.status == 201, await r.text()
    return await r.json(), list(await asyncio.gather(*polls))


async def wait_job(
    session: aiohttp.ClientSession,
    hub: RunningHub,
    job_id: str,
    states: tuple[str, ...] = ("done",),
    timeout: float = 60.0,
) -> dict[str, Any]:
    import asyncio

    give_up = time.monotonic() + timeout
    while True:
        async with session.get(
            f"{hub.url}/v1/jobs/{job_id}", headers=hub.auth(hub.admin_token)
        ) as r:
            doc = await r.json()
        if doc["state"] in states:
            return doc
        if time.monotonic() > give_up:
            raise TimeoutError(f"job {job_id} still {doc['state']} (round {doc['round']})")
        await asyncio.sleep(0.05)


async def finish_job(session: aiohttp.ClientSession, hub: RunningHub, job_id: str, nodes: list[SimNode],
                     timeout: float = 60.0) -> dict[str, Any]:
    """Every node in turn asks for work until the job is done: it hands over the states the
    referee asks of it (``SimNode.work``) and trains and uploads any assignment honestly. The job's
    JSON when done."""
    give_up = time.monotonic() + timeout
    while (doc := await wait_job(session, hub, job_id, states=("running", "done", "failed", "cancelled")))[
            "state"] == "running":
        if time.monotonic() > give_up:
            raise TimeoutError(f"job {job_id} still running (round {doc['round']})")
        for n in nodes:
            got = await n.work(0.2)
            if isinstance(got, Assignment):
                await n.upload(got, *await n.train(got))
    return doc


# -- simulated node -------------------------------------------------------------------------------


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode()


class SimNode:
    """A minimal node: signs requests, fetches blobs, trains with the real trainer, uploads.

    As the real node does (node/agent.py), it commits to its checkpoints when the assignment asks
    (``train.commit``: the job may ask the referee) with the node's own recorder
    (node/checkpoints.py), keeps the states in a folder of its own, sends the commitment in its
    update header, and hands the states over when ``work`` is answered with a state request."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        hub_public: bytes | None = None,
        key: SigningKey | None = None,
        samples_per_s: float = 1e6,
        compute: Any = None,
    ) -> None:
        self.session = session
        self.url = url
        self.key = key or SigningKey.generate()
        self.hub_public = hub_public
        self.samples_per_s = samples_per_s
        self.compute = compute  # a ComputeClass for its hello (None: the unknown class)
        self.cache: dict[str, bytes] = {}
        self.steps = 0  # the heartbeat progress chain (protocol.messages.progress_digest)
        self.digest = bytes(32)
        #: assignment id -> the commitment its training recorded (sent in its update header)
        self.commitments: dict[str, Commitment] = {}
        self._states: tempfile.TemporaryDirectory[str] | None = None  # made at the first commitment

    @property
    def node_id(self) -> str:
        return self.key.fingerprint

    def hello(self, **over: Any) -> Hello:
        h = Hello(
            software_version=SOFTWARE_VERSION,
            protocol_version=PROTOCOL_VERSION,
            device=DeviceInfo(kind="cpu", name="test-cpu", memory_bytes=1 << 30, threads=1),
            benchmark=Benchmark(
                samples_per_s=self.samples_per_s,
                matmul_tflops_fp32=0.1,
                matmul_tflops_bf16=None,
                matmul_tflops_fp16=None,
                mem_bandwidth_gbs=10.0,
                h2d_gbs=None,
                d2h_gbs=None,
                reference_model="mlp-64-128-10",
            ),
            timestamp=time.time(),
            nonce=new_nonce(),
        )
        if self.compute is not None:
            h = dataclasses.replace(h, compute=self.compute)
        return dataclasses.replace(h, **over)

    async def post(self, path: str, body: bytes) -> aiohttp.ClientResponse:
        return await self.session.post(self.url + path, data=body, headers=MSGPACK)

    async def open_response(self, resp: aiohttp.ClientResponse, *kinds: type) -> Any:
        body = await resp.read()
        if resp.status != 200:
            raise AssertionError(f"{resp.status}: {body[:300]!r}")
        from gpuflex.protocol.messages import peek_kind

        payload_kind = None
        from gpuflex.protocol.signing import open_envelope

        payload, _, _ = open_envelope(body)
        payload_kind = peek_kind(payload)
        for cls in kinds:
            if cls.KIND == payload_kind:
                msg, _ = open_sealed(body, cls, signer=self.hub_public)
                return msg
        raise AssertionError(f"unexpected kind {payload_kind}")

    async def register(self) -> Welcome:
        if self.hub_public is None:
            async with self.session.get(self.url + "/v1/hub") as r:
                self.hub_public = bytes.fromhex((await r.json())["public_key"])
        resp = await self.post("/v1/nodes/register", seal(self.key, self.hello()))
        return await self.open_response(resp, Welcome)

    async def work(self, wait_s: float = 1.0, cached: tuple[str, ...] = ()) -> Assignment | NoWork:
        """Ask for work; a state request in the answer is handed over (``hand_over``), as the
        real node does, and the node asks again for the rest of ``wait_s``."""
        give_up = time.monotonic() + wait_s
        for _ in range(8):
            req = WorkRequest(timestamp=time.time(), nonce=new_nonce(),
                              wait_s=max(0.0, give_up - time.monotonic()), cached_chunks=cached)
            resp = await self.post("/v1/work", seal(self.key, req))
            got = await self.open_response(resp, Assignment, NoWork, StateRequest)
            if not isinstance(got, StateRequest):
                return got
            await self.hand_over(got)
        raise AssertionError("the hub asked for states again and again")

    @property
    def checkpoints(self) -> Any:
        """The node's checkpoint store (node/checkpoints.py), in a temporary folder of its own."""
        from gpuflex.node.checkpoints import CheckpointStore

        if self._states is None:
            self._states = tempfile.TemporaryDirectory(prefix="gpuflex-simnode-")
        return CheckpointStore(Path(self._states.name))

    async def hand_over(self, asked: StateRequest) -> None:
        """The committed states the referee asked for (as node/handover.py), or which are not held."""
        store = self.checkpoints
        missing = [s for s in asked.steps if store.read(asked.assignment_id, s) is None]
        if missing:
            msg = StateUnavailable(request_id=asked.request_id, steps=tuple(missing), reason="not kept",
                                   timestamp=time.time(), nonce=new_nonce())
            resp = await self.post("/v1/states/unavailable", seal(self.key, msg))
            assert resp.status == 200, await resp.text()
            return
        for step in asked.steps:
            data = store.read(asked.assignment_id, step)
            hdr = StateUpload(request_id=asked.request_id, step=step, state_sha256=hashlib.sha256(data).hexdigest(),
                              state_size=len(data), timestamp=time.time(), nonce=new_nonce())
            async with self.session.post(self.url + "/v1/states", data=data, headers={
                    "X-GPUFlex-State": b64(seal(self.key, hdr)), "Content-Type": "application/octet-stream"}) as r:
                assert r.status == 200, await r.text()

    async def silo_schema(self, job_id: str) -> Any:
        """POST /v1/silos/schema: the job's silo schema (a SiloSchema)."""
        from gpuflex.protocol.messages import SiloQuery, SiloSchema

        resp = await self.post("/v1/silos/schema", seal(self.key, SiloQuery(job_id=job_id, timestamp=time.time(),
                                                                          nonce=new_nonce())))
        return await self.open_response(resp, SiloSchema)

    async def attach_silo(self, job_id: str, blob: bytes, samples: int, histogram: tuple[int, ...] = (),
                          **over: Any) -> aiohttp.ClientResponse:
        """POST /v1/silos for an encoded silo ``blob`` (kept here, as a node keeps it on its disk:
        ``blob`` then never downloads it); the raw response (``over`` changes the message's fields)."""
        from gpuflex.protocol.messages import SiloRegistration

        sha = hashlib.sha256(blob).hexdigest()
        self.cache[sha] = blob
        msg = SiloRegistration(job_id=job_id, sha256=sha, size=len(blob), samples=samples, timestamp=time.time(),
                               nonce=new_nonce(), label_histogram=histogram)
        return await self.post("/v1/silos", seal(self.key, dataclasses.replace(msg, **over)))

    def blob_auth(self, sha: str) -> dict[str, str]:
        return {
            "X-GPUFlex-Auth": b64(
                seal(self.key, BlobRequest(sha256=sha, timestamp=time.time(), nonce=new_nonce()))
            )
        }

    async def blob(self, sha: str) -> bytes:
        if sha in self.cache:
            return self.cache[sha]
        async with self.session.get(f"{self.url}/v1/blobs/{sha}", headers=self.blob_auth(sha)) as r:
            data = await r.read()
            if r.status != 200:
                raise AssertionError(f"blob {r.status}: {data[:200]!r}")
        if hashlib.sha256(data).hexdigest() != sha:
            raise AssertionError("blob hash mismatch")
        self.cache[sha] = data
        return data

    def recorder(self, a: Assignment, chunks: list[dict[str, torch.Tensor]]) -> Any:
        """The trainer's checkpoint hook for ``a`` when it asks for a commitment (the job may ask
        the referee: node/agent.py commits then), else None."""
        if not a.train.commit:
            return None
        return self.checkpoints.recorder(a, sum(int(c["x"].shape[0]) for c in chunks))

    def keep_commitment(self, a: Assignment, recorder: Any) -> None:
        """The commitment ``recorder`` made, for ``a``'s update header."""
        if recorder is not None:
            self.commitments[a.assignment_id] = recorder.commitment()

    async def train(self, a: Assignment) -> tuple[bytes, int, float]:
        """Returns (update blob, sample_count, loss)."""
        from gpuflex.node.trainer import train_assignment

        torch.set_num_threads(1)
        global_state = decode_state(bytearray(await self.blob(a.model_hash)))
        chunks = [decode_state(bytearray(await self.blob(c.sha256))) for c in a.chunks]
        recorder = self.recorder(a, chunks)
        try:
            res = train_assignment(
                ModelSpec.from_dict(a.model_spec),
                global_state,
                chunks,
                a.train,
                a.seed,
                device=torch.device("cpu"),
                on_step=recorder,
            )
        except BaseException:
            if recorder is not None:
                recorder.abandon()
            raise
        self.keep_commitment(a, recorder)
        return encode_state(res.delta), res.sample_count, res.loss

    def update_header(
        self, a: Assignment, blob: bytes, samples: int, loss: float, **over: Any
    ) -> UpdateHeader:
        h = UpdateHeader(
            assignment_id=a.assignment_id,
            update_sha256=hashlib.sha256(blob).hexdigest(),
            update_size=len(blob),
            sample_count=samples,
            metrics={"loss": loss},
            timings={"train_s": 0.01},
            timestamp=time.time(),
            nonce=new_nonce(),
            commitment=self.commitments.get(a.assignment_id),
        )
        return dataclasses.replace(h, **over)

    async def upload_raw(self, header: UpdateHeader | bytes, blob: bytes) -> aiohttp.ClientResponse:
        sealed = header if isinstance(header, bytes) else seal(self.key, header)
        return await self.session.post(
            self.url + "/v1/updates",
            data=blob,
            headers={"X-GPUFlex-Update": b64(sealed), "Content-Type": "application/octet-stream"},
        )

    async def upload(self, a: Assignment, blob: bytes, samples: int, loss: float) -> Ack:
        resp = await self.upload_raw(self.update_header(a, blob, samples, loss), blob)
        return await self.open_response(resp, Ack)

    async def heartbeat(
        self, assignment_id: str, progress: float = 0.5, steps: int | None = None
    ) -> aiohttp.ClientResponse:
        """A heartbeat; by default it proves one more step (an honest trainer's chain), `steps`
        sends that count with the chain as it stands (steps=0: no progress at all)."""
        if steps is None:
            self.steps += 1
            self.digest = progress_digest(self.digest, self.steps, 1.0 / self.steps)
            steps = self.steps
        hb = Heartbeat(
            assignment_id=assignment_id, progress=progress, timestamp=time.time(), nonce=new_nonce(),
            steps=steps, digest=self.digest if steps else bytes(32),
        )
        return await self.post("/v1/heartbeat", seal(self.key, hb))

    async def abandon(self, assignment_id: str) -> aiohttp.ClientResponse:
        ab = Abandon(
            assignment_id=assignment_id, reason="test", timestamp=time.time(), nonce=new_nonce()
        )
        return await self.post("/v1/abandon", seal(self.key, ab))

    async def step(self, wait_s: float = 2.0) -> Assignment | None:
        """Ask for work once; train and upload it. Returns the assignment done (None if no work)."""
        a = await self.work(wait_s)
        if isinstance(a, NoWork):
            return None
        blob, samples, loss = await self.train(a)
        await self.upload(a, blob, samples, loss)
        return a


async def job_with_a_round(hub: Any, tmp_path: Path) -> tuple[str, Path, str]:
    """A 2-round digits job on ``hub`` whose round 0 one SimNode trained and closed: (job id, its
    spec file, the node's id)."""
    train, val, spec = write_digits(tmp_path / "d", rounds=2)
    async with aiohttp.ClientSession() as s:
        r = await submit_job(s, hub, spec, train, val)
        assert r.status == 201, await r.text()
        job_id = (await r.json())["id"]
        node = SimNode(s, hub.url)
        await node.register()
        a = await node.work(5.0)
        assert isinstance(a, Assignment), a
        await node.upload(a, *await node.train(a))
        while not (await wait_job(s, hub, job_id, states=("running", "done")))["history"]:
            await asyncio.sleep(0.05)
    return job_id, spec, node.node_id


@contextlib.asynccontextmanager
async def sessions_from(*addresses: str) -> AsyncIterator[list[aiohttp.ClientSession]]:
    """One client session per local address (127.0.N.x): each connects from that address."""
    async with contextlib.AsyncExitStack() as stack:
        out = []
        for addr in addresses:
            connector = aiohttp.TCPConnector(local_addr=(addr, 0))
            out.append(await stack.enter_async_context(aiohttp.ClientSession(connector=connector)))
        yield out

