"""A job whose first layer is an Embedding trains end to end: token ids travel as int64.

The hub stores chunks and the validation set of such a model with x as int64 (whole numbers
in [0, num_embeddings)), a real node trains on them and the hub aggregates and evaluates.
"""

from __future__ import annotations

import asyncio
import io

import aiohttp
import numpy as np
import pytest
import torch
from gpuflex.protocol.tensors import decode_state
from test_node_support import EventLog, agent

from tests.helpers import open_store, start_hub, submit_job

VOCAB, SEQ, CLASSES = 40, 6, 3

EMBEDDING_SPEC = f"""
[job]
name = "tokens"

[model]
kind = "sequential"
input_shape = [{SEQ}]
outputs = {CLASSES}
layers = [
  {{ type = "Embedding", num_embeddings = {VOCAB}, embedding_dim = 8 }},
  {{ type = "LayerNorm", normalized_shape = [8] }},
  {{ type = "Flatten" }},
  {{ type = "Linear", in_features = {SEQ * 8}, out_features = {CLASSES} }},
]

[train]
rounds = 2
batch_size = 16
lr = 0.1
seed = 3
round_target_s = 1000.0

[data]
chunk_size = 32
split = "random"

[verification]
replication = 0.0
spot_check = 0.0
"""


def tokens(n: int, seed: int, dtype=np.int64) -> tuple[np.ndarray, np.ndarray]:
    """Token sequences whose class is told by their first token (a learnable rule)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, size=(n, SEQ))
    y = x[:, 0] % CLASSES
    return x.astype(dtype), y.astype(np.int64)


def npz(path, x, y):
    buf = io.BytesIO()
    np.savez(buf, x=x, y=y)
    path.write_bytes(buf.getvalue())
    return path


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


async def test_embedding_job_trains_aggregates_and_evaluates(tmp_path):
    hub = await start_hub(tmp_path / "hub", long_poll_max_s=1.0)
    try:
        train = npz(tmp_path / "train.npz", *tokens(192, 0))
        val = npz(tmp_path / "val.npz", *tokens(64, 1, dtype=np.float32))  # whole floats are token ids too
        async with aiohttp.ClientSession() as s:
            r = await submit_job(s, hub, EMBEDDING_SPEC, train, val)
            doc = await r.json()
            assert r.status == 201, doc
            job_id = doc["id"]
        conn = open_store(hub.data_dir)
        sha = conn.execute("SELECT sha FROM chunks WHERE job_id = ? LIMIT 1", (job_id,)).fetchone()[0]
        val_sha = conn.execute("SELECT val_sha FROM jobs WHERE id = ?", (job_id,)).fetchone()[0]
        conn.close()
        from gpuflex.hub.server.appkeys import BLOBS

        for blob in (sha, val_sha):
            chunk = decode_state(bytearray(hub.app[BLOBS].read(blob)))
            assert chunk["x"].dtype == torch.int64 and chunk["y"].dtype == torch.int64
        events = EventLog()
        node = agent(tmp_path / "node", hub.url, events, max_assignments=2)
        code = await asyncio.wait_for(node.run(), 120)
        assert code == 0, events.names()
        assert len(events.of("uploaded")) == 2, events.events[-5:]
        async with aiohttp.ClientSession() as s:
            for _ in range(200):
                async with s.get(f"{hub.url}/v1/jobs/{job_id}", headers=hub.auth()) as r:
                    doc = await r.json()
                if doc["state"] == "done":
                    break
                await asyncio.sleep(0.1)
            assert doc["state"] == "done", doc
            assert [h["round"] for h in doc["history"]] == [0, 1]
            for h in doc["history"]:
                assert h["loss"] is not None and np.isfinite(h["loss"])
                assert h["accuracy"] is not None
                assert [u["status"] for u in h["updates"]] == ["included"]
            assert doc["history"][1]["loss"] < doc["history"][0]["loss"] or doc["history"][1]["accuracy"] >= 0.5
            async with s.get(f"{hub.url}/v1/jobs/{job_id}/model", headers=hub.auth()) as r:
                assert r.status == 200 and r.headers["X-GPUFlex-Model-Version"] == "2"
    finally:
        await hub.stop()


@pytest.mark.parametrize(
    ("x", "words"),
    [
        (tokens(64, 0)[0] + VOCAB, "0..39"),
        (tokens(64, 0)[0] - 41, "0..39"),
        (tokens(64, 0)[0] + 0.5, "whole numbers"),
        (np.full((64, SEQ), np.nan), "NaN"),
        (tokens(64, 0)[0].astype(np.float64) * 1e30, "0..39"),
    ],
    ids=["too-large", "negative", "fraction", "nan", "huge"],
)
async def test_token_ids_out_of_range_or_not_whole_are_refused(running_hub, tmp_path, x, words):
    path = npz(tmp_path / "bad.npz", x, tokens(64, 0)[1])
    async with aiohttp.ClientSession() as s:
        r = await submit_job(s, running_hub, EMBEDDING_SPEC, path)
        doc = await r.json()
    assert r.status == 422 and doc["error"] in ("bad_tokens", "non_finite"), doc
    assert words in doc["detail"], doc


MODELS = {
    "mlp": ('kind = "mlp"\ninput = 6\nhidden = [4]\noutputs = 3', (6,), "int"),
    "mlp-regression": ('kind = "mlp"\ninput = 6\nhidden = [4]\noutputs = 2\ntask = "regression"', (6,), "float"),
    "cnn": ('kind = "cnn"\nimage = [1, 4, 4]\nchannels = [2]\nhidden = [4]\noutputs = 3', (1, 4, 4), "int"),
    "embedding": (EMBEDDING_SPEC.split("[model]")[1].split("[train]")[0], (SEQ,), "int"),
}


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_what_the_hub_stores_is_what_the_node_trainer_takes(kind):
    """The class behind the Embedding bug: for every model kind, the chunks and validation set
    the hub writes pass the node trainer's own checks (stack_chunks) and one training step."""
    from gpuflex.hub.policy.dataset import encode_arrays, make_chunks, validate_arrays
    from gpuflex.node.trainer import stack_chunks
    from gpuflex.protocol.jobspec import parse_job_spec

    body, shape, labels = MODELS[kind]
    spec = parse_job_spec(f'[job]\nname = "k"\n[model]\n{body}\n[train]\nrounds = 1\n')
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(40, *shape)).astype(np.float64)
    y = rng.integers(0, 3, size=40) if labels == "int" else rng.normal(size=(40, 2))
    data = validate_arrays(x, y, spec.model, what="train")
    blobs = [blob for blob, _ in make_chunks(data, 16, stratified=False, seed=0)]
    blobs.append(encode_arrays(data))  # the validation set's encoding
    chunks = [decode_state(bytearray(b)) for b in blobs]
    xs, ys = stack_chunks(spec.model, chunks)
    assert xs.shape[0] == ys.shape[0] == 40 + 40
    from gpuflex.protocol.modelspec import build_model

    model = build_model(spec.model, seed=0)
    out = model(xs[:4])
    assert out.shape[0] == 4 and torch.isfinite(out).all()
