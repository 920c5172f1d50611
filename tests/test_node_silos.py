"""Node-local data on the node (node/silos.py): reading and checking a silo with the protocol's
rules, the store on disk, `gpuflex-node data add|list|remove`, and the training path that reads
a silo chunk from the node's own disk and never downloads it.

No real hub: the command line and the agent talk to a small signed stand-in on 127.0.0.1
(`StandInHub`) that answers the node's calls as the hub's routes do. The silos are
scikit-learn's digits.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import hashlib
import io
import json
import os
import pickle
import re
import stat
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from aiohttp import web
from gpuflex.node import cli
from gpuflex.node.agent import NodeAgent, NodeConfig
from gpuflex.node.assignment import check_assignment, load_inputs
from gpuflex.node.cache import BlobCache
from gpuflex.node.errors import AssignmentRejected, TrainError
from gpuflex.node.identity import load_or_create_key
from gpuflex.node.output import Output
from gpuflex.node.pause import PauseState
from gpuflex.node.silos import (
    INDEX_FILE,
    SiloError,
    SiloStore,
    label_histogram,
    load_silo,
)
from gpuflex.node.totals import Totals
from gpuflex.node.trainer import train_assignment
from gpuflex.node.transfers import Transfers
from gpuflex.protocol.dataset import Arrays, decode_arrays, encode_arrays, sniff
from gpuflex.protocol.messages import (
    Abandon,
    Ack,
    Assignment,
    Benchmark,
    ChunkRef,
    Hello,
    NoWork,
    SiloQuery,
    SiloRegistration,
    SiloSchema,
    SiloWithdrawal,
    TrainConfig,
    UpdateHeader,
    Welcome,
    WorkRequest,
)
from gpuflex.protocol.modelspec import ModelSpec, build_model
from gpuflex.protocol.signing import SigningKey, fingerprint, open_sealed, seal
from gpuflex.protocol.tensors import encode_state
from gpuflex.protocol.version import PROTOCOL_VERSION
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sklearn.datasets import load_digits

JOB = "j-silo"
MLP = {"kind": "mlp", "input": 64, "hidden": [32], "outputs": 10}
EMBEDDING = {"kind": "sequential", "input_shape": [6], "outputs": 3, "layers": [
    {"type": "Embedding", "num_embeddings": 20, "embedding_dim": 8}, {"type": "Flatten"},
    {"type": "Linear", "in_features": 48, "out_features": 3}]}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@functools.cache
def digits() -> tuple[np.ndarray, np.ndarray]:
    d = load_digits()
    return (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)


def schema(model: dict[str, Any] | None = None, *, min_samples: int = 20, max_samples: int = 5000,
           histogram: bool = True, label_column: str = "label") -> SiloSchema:
    spec = ModelSpec.from_dict(model or MLP).to_dict()
    return SiloSchema(job_id=JOB, model_spec=spec, min_samples=min_samples, max_samples=max_samples,
                      label_column=label_column, label_histogram=histogram, attached="")


def write_npz(path: Path, x: Any, y: Any) -> Path:
    np.savez(path, x=x, y=y)
    return path


def write_csv(path: Path, x: np.ndarray, y: np.ndarray, label: str = "label") -> Path:
    lines = [",".join([f"f{i}" for i in range(x.shape[1])] + [label])]
    lines += [",".join([repr(float(v)) for v in row] + [str(int(t))]) for row, t in zip(x, y, strict=True)]
    path.write_text("\n".join(lines) + "\n")
    return path


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- reading a silo -------------------------------------------------------------------------------


def test_an_npz_silo_is_read_checked_and_encoded_as_a_chunk(tmp_path):
    x, y = digits()
    arrays = load_silo(write_npz(tmp_path / "d.npz", x.astype(np.float64), y.astype(np.int32)), schema())
    assert isinstance(arrays, Arrays) and len(arrays) == len(y) == 1797
    assert arrays.x.dtype == np.float32 and arrays.x.shape == (1797, 64) and arrays.y.dtype == np.int64
    back = decode_arrays(bytearray(encode_arrays(arrays)), what="blob")
    assert np.array_equal(back.x, x) and np.array_equal(back.y, y)


def test_a_csv_silo_reads_the_jobs_label_column(tmp_path):
    x, y = digits()
    path = write_csv(tmp_path / "d.csv", x[:300], y[:300], label="digit")
    arrays = load_silo(path, schema(label_column="digit"))
    assert np.array_equal(arrays.x, x[:300]) and np.array_equal(arrays.y, y[:300])
    with pytest.raises(SiloError, match="CSV has no label column 'label'"):
        load_silo(path, schema())


def _object_npz(path: Path) -> Path:
    _, y = digits()
    np.savez(path, x=np.array([[1.0, "a"]] * 30, dtype=object), y=y[:30])
    return path


def _pickle_file(path: Path) -> Path:
    x, y = digits()
    path.write_bytes(pickle.dumps({"x": x, "y": y}))
    return path


@pytest.mark.parametrize(("case", "model", "message", "code"), [
    ("object", MLP, "cannot read .npz without pickle", "bad_dataset"),
    ("pickle", MLP, "the file is binary data that is neither .npz nor CSV", "bad_dataset"),
    ("shape", MLP, "each sample of x has shape (32,) but the model takes (64,)", "bad_shape"),
    ("nan", MLP, "x contains NaN or Inf", "non_finite"),
    ("labels", MLP, "labels must be in 0..9 for 10 classes (found 5..14)", "bad_labels"),
    ("tokens", EMBEDDING, "token ids in x must be in 0..19 for Embedding(num_embeddings=20) (found 0..25)",
     "bad_tokens"),
    ("few", MLP, "10 samples; job j-silo takes at least 20 per silo", "too_few_samples"),
    ("many", MLP, "1797 samples; job j-silo takes at most 1000 per silo: pass --subset 1000", "too_many_samples"),
    ("json", MLP, "the file is JSON", "bad_dataset"),
    ("missing", MLP, "no such file", "bad_dataset"),
])
def test_a_silo_that_does_not_fit_the_job_is_refused_in_one_line(tmp_path, case, model, message, code):
    x, y = digits()
    p = tmp_path / "silo.npz"
    made = {
        "object": lambda: _object_npz(p),
        "pickle": lambda: _pickle_file(p),
        "shape": lambda: write_npz(p, x[:, :32], y),
        "nan": lambda: write_npz(p, np.where(np.arange(64) == 3, np.nan, x), y),
        "labels": lambda: write_npz(p, x, y + 5),
        "tokens": lambda: write_npz(p, np.tile(np.arange(0, 26, 5), (40, 1))[:, :6].astype(np.int64),
                                    np.arange(40) % 3),
        "few": lambda: write_npz(p, x[:10], y[:10]),
        "many": lambda: write_npz(p, x, y),
        "json": lambda: (p.write_text('{"x": [[1]], "y": [0]}'), p)[1],
        "missing": lambda: tmp_path / "nowhere.npz",
    }[case]()
    sch = schema(model, min_samples=20, max_samples=1000)
    with pytest.raises(SiloError) as info:
        load_silo(made, sch)
    text = str(info.value)
    assert message in text and "\n" not in text, text
    assert info.value.code == code


def test_subset_keeps_the_same_rows_every_time(tmp_path):
    x, y = digits()
    path = write_npz(tmp_path / "d.npz", x, y)
    sch = schema(max_samples=1000)
    first = load_silo(path, sch, keep=1000)
    again = load_silo(path, sch, keep=1000)
    assert len(first) == 1000 and np.array_equal(first.x, again.x) and np.array_equal(first.y, again.y)
    # rows of the file, in file order
    rows = [int(np.flatnonzero((x == row).all(axis=1))[0]) for row in first.x[:50]]
    assert rows == sorted(rows)
    assert len(load_silo(path, sch, keep=300)) == 300
    for keep, message in ((5000, "asks for more rows than the file holds (1797)"), (0, "must be at least 1"),
                          (10, "takes at least 20")):
        with pytest.raises(SiloError, match=re.escape(message)):
            load_silo(path, sch, keep=keep)


def test_label_histogram_counts_each_label():
    x, y = digits()
    arrays = Arrays(x, y)
    assert label_histogram(arrays, 10) == tuple(int(c) for c in np.bincount(y, minlength=10))
    assert label_histogram(Arrays(x[:3], np.array([0, 0, 2])), 4) == (2, 0, 1, 0)
    with pytest.raises(SiloError, match="needs a classification job"):
        label_histogram(Arrays(x[:3], np.zeros((3, 1), dtype=np.float32)), 1)


# -- hostile bytes --------------------------------------------------------------------------------

_FUZZ_SCHEMA = SiloSchema(job_id=JOB, model_spec=ModelSpec.from_dict({"kind": "mlp", "input": 4, "hidden": [4],
                                                                       "outputs": 3}).to_dict(),
                          min_samples=1, max_samples=1000, label_column="label", label_histogram=False,
                          attached="")


def _npz_bytes() -> bytes:
    buf = io.BytesIO()
    np.savez(buf, x=np.arange(20, dtype=np.float32).reshape(5, 4) / 20, y=np.array([0, 1, 2, 0, 1]))
    return buf.getvalue()


_NPZ = _npz_bytes()


def _mutate(base: bytes, flips: list[tuple[int, int]], cut: int) -> bytes:
    out = bytearray(base)
    for at, value in flips:
        out[at % len(out)] = value
    return bytes(out[:cut])


_cell = st.one_of(st.integers(-1, 3).map(str), st.floats(-10, 10).map(repr), st.floats(allow_nan=True).map(repr),
                 st.sampled_from(["", "x", "nan", "1e400", " 2 ", "2.5"]))
_csv_rows = st.one_of(st.lists(st.lists(_cell, min_size=4, max_size=6), max_size=6),
                      st.lists(st.lists(st.integers(0, 2).map(str), min_size=5, max_size=5), min_size=1, max_size=6))

_dtypes = st.sampled_from([np.float32, np.float64, np.int64, np.int8, np.uint64, np.bool_, np.complex64, np.float16])
_shapes = st.sampled_from([(5, 4), (3, 2, 2), (4,), (0, 4), (5,), (5, 1), (6, 4), ()])


@st.composite
def _npz_of_arrays(draw: st.DrawFn) -> bytes:
    """A well-formed .npz whose arrays are anything numpy holds: the validation's turn."""
    from hypothesis.extra.numpy import arrays

    x = draw(arrays(draw(_dtypes), draw(_shapes)))
    y = draw(arrays(draw(_dtypes), draw(st.sampled_from([(5,), (5, 1), (4,), (5, 3), ()]))))
    names = draw(st.sampled_from([("x", "y"), ("x", "z")]))
    buf = io.BytesIO()
    np.savez(buf, **{names[0]: x, names[1]: y})
    return buf.getvalue()


_hostile = st.one_of(
    _npz_of_arrays(),
    st.binary(max_size=600),
    st.binary(max_size=300).map(lambda b: b"PK\x03\x04" + b),
    st.binary(max_size=300).map(lambda b: b"\x93NUMPY" + b),
    st.tuples(st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=6),
              st.integers(0, len(_NPZ))).map(lambda t: _mutate(_NPZ, *t)),
    _csv_rows.map(lambda rows: ("a,b,c,d,label\n" + "\n".join(",".join(r) for r in rows)).encode()),
    st.text(max_size=300).map(lambda t: ("a,b,c,d,label\n" + t).encode()),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=_hostile)
def test_load_silo_on_hostile_bytes_returns_arrays_or_one_line(tmp_path, data):
    kind = sniff(data[:512])
    path = tmp_path / f"silo.{'csv' if kind == 'csv' else 'npz'}"
    path.write_bytes(data)
    try:
        arrays = load_silo(path, _FUZZ_SCHEMA)
    except SiloError as exc:
        assert str(exc) and "\n" not in str(exc) and exc.code
        return
    assert arrays.x.dtype == np.float32 and arrays.x.shape[1:] == (4,) and np.isfinite(arrays.x).all()
    assert arrays.y.dtype == np.int64 and arrays.y.shape == (len(arrays),)
    assert 0 <= arrays.y.min() and arrays.y.max() < 3


# -- the store -------------------------------------------------------------------------------------


def test_the_store_keeps_blobs_and_index_private_and_replaces_a_jobs_silo(tmp_path):
    x, y = digits()
    store = SiloStore(tmp_path / "silos")
    assert store.records() == [] and store.get(JOB) is None and store.blob_ids() == frozenset()
    rec = store.add(JOB, Arrays(x[:500], y[:500]), tmp_path / "a.npz", shared_histogram=True)
    blob = store.blob_path(rec.sha256)
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == rec.sha256 and blob.stat().st_size == rec.size
    assert (rec.samples, rec.histogram_shared, rec.source) == (500, True, str(tmp_path / "a.npz"))
    assert mode(store.root) == 0o700 and mode(blob) == 0o600 and mode(store.root / INDEX_FILE) == 0o600
    assert store.get(JOB) == rec and store.records() == [rec] and store.has_blob(rec.sha256)
    doc = json.loads((store.root / INDEX_FILE).read_text())
    assert doc["silos"][JOB]["sha256"] == rec.sha256 and doc["silos"][JOB]["samples"] == 500

    newer = store.add(JOB, Arrays(x[500:900], y[500:900]), tmp_path / "b.npz", shared_histogram=False)
    assert store.get(JOB) == newer and len(store.records()) == 1
    assert store.has_blob(rec.sha256)  # an assignment signed for the old blob still trains
    assert store.prune() == 1 and not store.has_blob(rec.sha256) and store.has_blob(newer.sha256)
    assert store.retired_job(rec.sha256) == JOB  # named again: refused, never downloaded

    other = store.add("j-other", Arrays(x[:30], y[:30]), tmp_path / "c.npz", shared_histogram=False)
    assert store.remove(JOB) == newer and store.get(JOB) is None
    assert not store.has_blob(newer.sha256) and store.retired_job(newer.sha256) == JOB
    assert store.records() == [other] and store.remove(JOB) is None
    assert not any(p.name.endswith(".tmp") for p in store.root.iterdir())


def test_the_index_is_replaced_atomically(tmp_path, monkeypatch):
    """A crash while the index is written leaves the previous index whole, and no temp file."""
    x, y = digits()
    store = SiloStore(tmp_path / "silos")
    rec = store.add(JOB, Arrays(x[:100], y[:100]), "a.npz", shared_histogram=False)
    before = (store.root / INDEX_FILE).read_bytes()
    blob = store.write_blob(Arrays(x[100:200], y[100:200]))

    def crash(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("gpuflex.node.files.os.replace", crash)
    with pytest.raises(OSError):
        store.commit("j-two", blob, "b.npz", shared_histogram=False)
    monkeypatch.undo()
    assert (store.root / INDEX_FILE).read_bytes() == before and store.records() == [rec]
    assert not [p for p in store.root.iterdir() if p.name.endswith(".tmp")]
    assert store.drop_blob(blob.sha256) and not store.has_blob(blob.sha256)
    assert not store.drop_blob(rec.sha256) and store.has_blob(rec.sha256)  # a record names it: kept
    (store.root / INDEX_FILE).write_text("{not json")
    with pytest.raises(SiloError, match=r"silo index .* is unreadable"):
        store.records()


def test_a_tampered_or_truncated_blob_is_refused_at_load(tmp_path):
    x, y = digits()
    store = SiloStore(tmp_path / "silos")
    rec = store.add(JOB, Arrays(x[:200], y[:200]), "a.npz", shared_histogram=False)
    good = store.read_blob(rec.sha256, rec.size)
    assert hashlib.sha256(good).hexdigest() == rec.sha256
    path = store.blob_path(rec.sha256)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # one flipped bit in the last sample
    path.write_bytes(bytes(data))
    with pytest.raises(SiloError, match="does not match its SHA-256: tampered or damaged") as info:
        store.read_blob(rec.sha256, rec.size)
    assert "\n" not in str(info.value)
    path.write_bytes(bytes(data[:-100]))
    with pytest.raises(SiloError, match=f"holds {rec.size - 100} bytes, {rec.size} expected"):
        store.read_blob(rec.sha256, rec.size)
    path.unlink()
    with pytest.raises(SiloError, match="is not on this node"):
        store.read_blob(rec.sha256)


# -- the training path ----------------------------------------------------------------------------


HUB_KEY = SigningKey.from_seed(b"h" * 32)


def signed_assignment(node_id: str, spec: ModelSpec, model: bytes, chunks: tuple[ChunkRef, ...],
                      hub: SigningKey = HUB_KEY) -> Assignment:
    """An assignment as a node receives it: sealed by the hub key, opened against it."""
    now = time.time()
    a = Assignment(assignment_id="as-silo-1", job_id=JOB, round=0, node_id=node_id,
                   model_hash=hashlib.sha256(model).hexdigest(), model_size=len(model), model_spec=spec.to_dict(),
                   chunks=chunks, seed=7, train=TrainConfig(1, 32, "sgd", 0.05, 0.0, 0.0, 0.9, 0.999,
                                                            "cross_entropy", 0.0),
                   issued_at=now, deadline=now + 120, replica_group="")
    opened, signer = open_sealed(seal(hub, a), Assignment, signer=hub.public_bytes)
    assert signer == hub.public_bytes
    return opened


def model_blob(spec: ModelSpec) -> bytes:
    return encode_state({k: v.detach().clone() for k, v in build_model(spec, 0).state_dict().items()})


def cache_with(root: Path, blob: bytes) -> BlobCache:
    cache = BlobCache(root, 1 << 30)
    w = cache.writer(hashlib.sha256(blob).hexdigest(), len(blob))
    w.write(blob)
    w.commit()
    return cache


def test_an_assignment_naming_a_silo_reads_it_from_the_store_and_trains(tmp_path):
    x, y = digits()
    spec = ModelSpec.from_dict(MLP)
    model = model_blob(spec)
    cache = cache_with(tmp_path / "cache", model)
    store = SiloStore(tmp_path / "silos")
    rec = store.add(JOB, Arrays(x[:300], y[:300]), "a.npz", shared_histogram=False)
    a = signed_assignment("gf1-me", spec, model, (ChunkRef(rec.sha256, rec.size, rec.samples),))
    local = frozenset({rec.sha256})
    cap = len(model) + 1000  # room for the model only: the silo is not the cache's to hold
    with pytest.raises(AssignmentRejected, match="GB of cache"):
        check_assignment(a, node_id="gf1-me", now=time.time(), seen=(), cache_cap_bytes=cap)
    assert check_assignment(a, node_id="gf1-me", now=time.time(), seen=(), cache_cap_bytes=cap, local=local) == spec
    assert not cache.has(rec.sha256)
    global_state, chunks = load_inputs(cache, a, spec, silos=store, local=local)
    assert np.array_equal(chunks[0]["x"].numpy(), x[:300]) and np.array_equal(chunks[0]["y"].numpy(), y[:300])
    result = train_assignment(spec, global_state, chunks, a.train, a.seed, device=torch.device("cpu"))
    assert result.sample_count == 300 and np.isfinite(result.loss)

    # the per-chunk checks of a downloaded chunk: a sample count or size the blob does not have
    way_off = signed_assignment("gf1-me", spec, model, (ChunkRef(rec.sha256, rec.size, 3000),))
    with pytest.raises(AssignmentRejected, match=f"declares {rec.size} bytes for 3000 samples"):
        check_assignment(way_off, node_id="gf1-me", now=time.time(), seen=(), cache_cap_bytes=1 << 30, local=local)
    wrong = signed_assignment("gf1-me", spec, model, (ChunkRef(rec.sha256, rec.size, 299),))
    with pytest.raises(TrainError, match="does not hold 299 samples"):
        load_inputs(cache, wrong, spec, silos=store, local=local)
    bigger = signed_assignment("gf1-me", spec, model, (ChunkRef(rec.sha256, rec.size + 8, 300),))
    with pytest.raises(TrainError, match="expected: truncated or replaced"):
        load_inputs(cache, bigger, spec, silos=store, local=local)
    path = store.blob_path(rec.sha256)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(TrainError, match="does not match its SHA-256"):
        load_inputs(cache, a, spec, silos=store, local=local)


class RecordingClient:
    """What Transfers asks of a HubClient when every blob is cached but the silo: a download
    is recorded and refused, as the hub would (it has no such blob)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def download_blob(self, sha256: str, writer: Any, *, on_bytes: Any = None) -> None:
        from gpuflex.node.errors import HubError

        self.asked.append(sha256)
        writer.abort(keep_partial=False)
        raise HubError(f"GET blob {sha256[:12]}: hub answered 404 unknown_blob", code="unknown_blob", status=404)


async def test_transfers_never_download_a_silo_chunk(tmp_path):
    from gpuflex.node.errors import HubError

    x, y = digits()
    spec = ModelSpec.from_dict(MLP)
    model = model_blob(spec)
    cache = cache_with(tmp_path / "cache", model)
    store = SiloStore(tmp_path / "silos")
    rec = store.add(JOB, Arrays(x[:64], y[:64]), "a.npz", shared_histogram=False)
    a = signed_assignment("gf1-me", spec, model, (ChunkRef(rec.sha256, rec.size, rec.samples),))
    sink = io.StringIO()
    output = Output(sink, json_lines=True)
    transfers = Transfers(cache, Totals(), output, PauseState(output), backoff_base_s=0.01, backoff_cap_s=0.01)
    client = RecordingClient()
    assert await transfers.fetch_all(client, a, local=frozenset({rec.sha256})) == 0  # type: ignore[arg-type]
    assert client.asked == [] and not cache.has(rec.sha256)
    events = [json.loads(line) for line in sink.getvalue().splitlines()]
    assert next(e for e in events if e["event"] == "cache")["silo_chunks"] == 1
    with pytest.raises(HubError):  # without the store's word it is a chunk like any other
        await transfers.fetch_all(client, a)  # type: ignore[arg-type]
    assert client.asked == [rec.sha256]


# -- a stand-in hub: the routes the node calls ---------------------------------------------------


@dataclass
class StandInHub:
    schema: SiloSchema
    key: SigningKey = HUB_KEY
    url: str = ""
    refuse: tuple[int, str, str] | None = None
    registrations: list[SiloRegistration] = field(default_factory=list)
    blob_gets: list[str] = field(default_factory=list)
    blobs: dict[str, bytes] = field(default_factory=dict)
    work: list[Assignment] = field(default_factory=list)
    updates: list[UpdateHeader] = field(default_factory=list)
    abandons: list[Abandon] = field(default_factory=list)
    withdrawals: list[SiloWithdrawal] = field(default_factory=list)

    def sealed(self, msg: object) -> web.Response:
        return web.Response(body=seal(self.key, msg), content_type="application/x-msgpack")

    def app(self) -> web.Application:
        async def info(_: web.Request) -> web.Response:
            return web.json_response({"public_key": self.key.public_bytes.hex(), "fingerprint": self.key.fingerprint,
                                      "protocol_version": PROTOCOL_VERSION})

        async def silo_schema(request: web.Request) -> web.Response:
            q, _ = open_sealed(await request.read(), SiloQuery)
            if q.job_id != self.schema.job_id:
                return web.json_response({"error": "unknown_job", "detail": f"no running job {q.job_id}"}, status=404)
            return self.sealed(self.schema)

        async def silos(request: web.Request) -> web.Response:
            msg, _ = open_sealed(await request.read(), SiloRegistration)
            self.registrations.append(msg)
            if self.refuse is not None:
                status, code, detail = self.refuse
                return web.json_response({"error": code, "detail": detail}, status=status)
            return self.sealed(Ack(ok=True, detail="attached", deadline=0.0))

        async def register(request: web.Request) -> web.Response:
            _, signer = open_sealed(await request.read(), Hello)
            return self.sealed(Welcome(node_id=fingerprint(signer), hub_fingerprint=self.key.fingerprint,
                                       server_time=time.time(), poll_s=1.0))

        async def work(request: web.Request) -> web.Response:
            open_sealed(await request.read(), WorkRequest)
            if self.work:
                return self.sealed(self.work.pop(0))
            await asyncio.sleep(0.2)
            return self.sealed(NoWork(retry_after_s=0.2, reason="no work"))

        async def blob(request: web.Request) -> web.Response:
            sha = request.match_info["sha"]
            self.blob_gets.append(sha)
            if sha not in self.blobs:
                return web.json_response({"error": "unknown_blob", "detail": "no such blob"}, status=404)
            return web.Response(body=self.blobs[sha], content_type="application/octet-stream")

        async def delta(_: web.Request) -> web.Response:
            return web.json_response({"error": "no_delta", "detail": "none"}, status=404)

        async def heartbeat(_: web.Request) -> web.Response:
            return self.sealed(Ack(ok=True, detail="", deadline=0.0))

        async def update(request: web.Request) -> web.Response:
            hdr, _ = open_sealed(base64.urlsafe_b64decode(request.headers["X-GPUFlex-Update"]), UpdateHeader)
            body = await request.read()
            assert hashlib.sha256(body).hexdigest() == hdr.update_sha256
            self.updates.append(hdr)
            return self.sealed(Ack(ok=True, detail="accepted", deadline=0.0))

        async def abandon(request: web.Request) -> web.Response:
            self.abandons.append(open_sealed(await request.read(), Abandon)[0])
            return self.sealed(Ack(ok=True, detail="", deadline=0.0))

        async def withdraw(request: web.Request) -> web.Response:
            self.withdrawals.append(open_sealed(await request.read(), SiloWithdrawal)[0])
            return self.sealed(Ack(ok=True, detail="withdrawn", deadline=0.0))

        app = web.Application()
        app.router.add_get("/v1/hub", info)
        app.router.add_post("/v1/silos/withdraw", withdraw)
        app.router.add_post("/v1/silos/schema", silo_schema)
        app.router.add_post("/v1/silos", silos)
        app.router.add_post("/v1/nodes/register", register)
        app.router.add_post("/v1/work", work)
        app.router.add_get("/v1/blobs/{sha}", blob)
        app.router.add_get("/v1/blobs/{sha}/from/{base}", delta)
        app.router.add_post("/v1/heartbeat", heartbeat)
        app.router.add_post("/v1/updates", update)
        app.router.add_post("/v1/abandon", abandon)
        return app


@pytest.fixture
async def hub() -> AsyncIterator[StandInHub]:
    stand_in = StandInHub(schema=schema(max_samples=1000))
    runner = web.AppRunner(stand_in.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    stand_in.url = f"http://{host}:{port}"
    try:
        yield stand_in
    finally:
        await runner.cleanup()


@pytest.fixture
def node_dir(tmp_path: Path) -> Path:
    d = tmp_path / "node"
    d.mkdir(mode=0o700)
    load_or_create_key(d)
    return d


async def data(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = await asyncio.to_thread(cli.main, ["data", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def silo_files(node_dir: Path) -> list[str]:
    root = node_dir / "silos"
    return sorted(p.name for p in root.iterdir() if p.name.endswith(".gft")) if root.exists() else []


# -- `gpuflex-node data add | list | remove` ------------------------------------------------------


async def test_data_add_sends_the_blob_id_size_and_count_and_nothing_else(hub, node_dir, tmp_path, capsys):
    x, y = digits()
    path = write_npz(tmp_path / "mine.npz", x[:800], y[:800])
    code, out, err = await data(capsys, "add", JOB, str(path), "--hub", hub.url, "--data-dir", str(node_dir),
                                "--share-histogram")
    assert code == 0, err
    (reg,) = hub.registrations
    blob = node_dir / "silos" / f"{reg.sha256}.gft"
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == reg.sha256 and reg.size == blob.stat().st_size
    assert reg.samples == 800 and reg.label_histogram == tuple(int(c) for c in np.bincount(y[:800], minlength=10))
    assert mode(blob) == 0o600
    lines = out.splitlines()
    assert lines[0] == f"job        {JOB}" and lines[1] == "samples    800"
    assert lines[2].startswith(f"blob id    {reg.sha256} ({reg.size:,} bytes")
    assert lines[3] == "histogram  shared: 10 counts, one per label"
    assert lines[-1].startswith("Nothing else about the rows left this node") and "label histogram" in lines[-1]
    (rec,) = SiloStore(node_dir / "silos").records()
    assert (rec.job_id, rec.sha256, rec.samples, rec.histogram_shared, rec.source) == (
        JOB, reg.sha256, 800, True, str(path.resolve()))

    code, out, _ = await data(capsys, "list", "--data-dir", str(node_dir))
    assert code == 0 and JOB in out and "800" in out and reg.sha256[:16] in out and str(path.resolve()) in out
    code, out, _ = await data(capsys, "list", "--data-dir", str(node_dir), "--json")
    assert json.loads(out)["silos"][0]["sha256"] == reg.sha256

    # again without opting in: the histogram stays here; the hub URL comes from the pin
    code, out, err = await data(capsys, "add", JOB, str(path), "--data-dir", str(node_dir), "--subset", "500")
    assert code == 0, err
    assert hub.registrations[-1].label_histogram == () and hub.registrations[-1].samples == 500
    assert "not shared (the job asks for it; pass --share-histogram to send it)" in out
    assert f"replaces   the silo {reg.sha256[:12]}" in out and "label histogram" not in out.splitlines()[-1]

    current = SiloStore(node_dir / "silos").get(JOB)
    code, out, err = await data(capsys, "remove", JOB, "--data-dir", str(node_dir))
    assert code == 0 and "no longer trains it" in out and "the hub withdrew it: withdrawn" in out, (out, err)
    assert [(w.job_id, w.sha256) for w in hub.withdrawals] == [(JOB, current.sha256)]  # signed, by the pinned hub
    assert SiloStore(node_dir / "silos").records() == [] and silo_files(node_dir) == []  # the replaced one too
    code, _, err = await data(capsys, "remove", JOB, "--data-dir", str(node_dir))
    assert code == 1 and err.strip() == f"gpuflex-node: error: no silo for job {JOB} on this node (see gpuflex-node data list)"
    code, out, _ = await data(capsys, "list", "--data-dir", str(node_dir))
    assert out.startswith("no silos on this node")


@pytest.mark.parametrize("case", ["refused", "unknown_job", "too_many", "bad_file", "no_hub", "wrong_key"])
async def test_a_failed_data_add_is_one_line_and_changes_nothing(hub, node_dir, tmp_path, capsys, case):
    x, y = digits()
    path = write_npz(tmp_path / "mine.npz", x[:800] if case != "too_many" else x, y[:800] if case != "too_many" else y)
    argv = ["add", JOB, str(path), "--hub", hub.url, "--data-dir", str(node_dir)]
    expected, exit_code = {
        "refused": ("hub answered 409 silo_taken another node attached this silo", 1),
        "unknown_job": ("hub answered 404 unknown_job no running job j-other", 1),
        "too_many": ("1797 samples; job j-silo takes at most 1000 per silo: pass --subset 1000", 1),
        "bad_file": ("the file is JSON", 1),
        "no_hub": ("no hub URL: pass --hub URL", 1),
        "wrong_key": ("REFUSING TO WORK", 3),
    }[case]
    if case == "refused":
        hub.refuse = (409, "silo_taken", "another node attached this silo")
    elif case == "unknown_job":
        argv[1] = "j-other"
    elif case == "bad_file":
        path.write_text('{"x": 1}')
    elif case == "no_hub":
        argv = argv[:3] + argv[5:]
    elif case == "wrong_key":
        argv += ["--hub-key", SigningKey.from_seed(b"o" * 32).fingerprint]
    code, out, err = await data(capsys, *argv)
    assert code == exit_code and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and expected in err, err
    assert SiloStore(node_dir / "silos").records() == [] and silo_files(node_dir) == []
    assert len(hub.registrations) == (1 if case == "refused" else 0)


async def test_data_add_before_the_node_ever_ran_says_what_to_do(hub, tmp_path, capsys):
    x, y = digits()
    path = write_npz(tmp_path / "mine.npz", x[:100], y[:100])
    code, _, err = await data(capsys, "add", JOB, str(path), "--hub", hub.url, "--data-dir", str(tmp_path / "fresh"))
    assert code == 1 and "no identity yet" in err and "gpuflex-node run --hub URL" in err
    assert not (tmp_path / "fresh").exists()


# -- the agent ------------------------------------------------------------------------------------


def _benchmark() -> Benchmark:
    return Benchmark(samples_per_s=1000.0, matmul_tflops_fp32=0.1, matmul_tflops_bf16=None, matmul_tflops_fp16=None,
                     mem_bandwidth_gbs=1.0, h2d_gbs=None, d2h_gbs=None, reference_model="mlp")


async def test_the_agent_trains_a_silo_from_its_disk_and_never_asks_the_hub_for_it(hub, node_dir, capsys):
    """`data add` while the node runs: the next assignment finds the silo (the store is read
    again), trains it from disk and uploads; the hub is asked for the model only."""
    x, y = digits()
    sink = io.StringIO()
    agent = NodeAgent(NodeConfig(hub_url=hub.url, data_dir=node_dir, hub_key=hub.key.fingerprint, device="cpu",
                                 once=True, poll_wait_s=1.0, heartbeat_s=0.5, yield_gpu=False, control=False,
                                 benchmark=_benchmark()), output=Output(sink, json_lines=True))
    store = SiloStore(node_dir / "silos")
    rec = store.add(JOB, Arrays(x[:256], y[:256]), "mine.npz", shared_histogram=False)  # after the agent started
    spec = ModelSpec.from_dict(MLP)
    model = model_blob(spec)
    hub.blobs[hashlib.sha256(model).hexdigest()] = model
    hub.work.append(signed_assignment(agent.node_id, spec, model, (ChunkRef(rec.sha256, rec.size, rec.samples),)))
    assert agent.silo_chunks(hub.work[0]) == frozenset({rec.sha256})
    code = await asyncio.wait_for(agent.run(), 60)
    events = [json.loads(line) for line in sink.getvalue().splitlines()]
    assert code == 0, events[-5:]
    assert hub.blob_gets == [hashlib.sha256(model).hexdigest()]  # the model; never the silo
    (upd,) = hub.updates
    assert upd.sample_count == 256 and hub.abandons == []
    assert any(e["event"] == "assignment" and e.get("silo_chunks") == 1 for e in events)

    # removed by the operator: an assignment naming it is refused, not fetched from the hub
    store.remove(JOB)
    again = signed_assignment(agent.node_id, spec, model, (ChunkRef(rec.sha256, rec.size, rec.samples),))
    with pytest.raises(AssignmentRejected, match=f"is the silo of job {JOB} that was removed from this node"):
        agent.silo_chunks(again)
    assert not os.path.exists(store.blob_path(rec.sha256))
    # ... and a running node asks the hub, which was not told (`data remove` ran offline), to withdraw it
    sink = io.StringIO()
    agent = NodeAgent(dataclasses.replace(agent.config, once=False), output=Output(sink, json_lines=True))
    hub.work.append(again)
    running = asyncio.create_task(agent.run())
    try:
        async with asyncio.timeout(30):
            while not hub.abandons:
                await asyncio.sleep(0.05)
    finally:
        agent.request_exit("test")
        await asyncio.wait_for(running, 30)
    assert [(w.job_id, w.sha256) for w in hub.withdrawals] == [(JOB, rec.sha256)]
    assert [a.assignment_id for a in hub.abandons] == [again.assignment_id]  # a no-op at a real hub
    events = [json.loads(line) for line in sink.getvalue().splitlines()]
    assert any(e["event"] == "silo_withdrawn" and e["detail"] == "withdrawn" for e in events)
    assert any(e["event"] == "rejected" for e in events) and hub.updates == [upd]
