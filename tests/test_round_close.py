"""Closing a round (hub/domain/aggregating.py RoundAggregation.aggregate): the model blob, the server optimizer's
blob and the evaluation run side by side, and all three are done (the blobs durable) before the
close returns to be committed; the delta of a large model starts as soon as its blob is durable;
the blobs a close reads are mapped copy-on-write (hub/blobs.read_private)."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from gpuflex.hub.base.errors import NotFound
from gpuflex.hub.domain import aggregating, rounds
from gpuflex.hub.domain.aggregating import ClosedRound, _all_finite
from gpuflex.hub.domain.rounds import RoundEngine
from gpuflex.hub.model.job import JobState, ShardState, UpdateState
from gpuflex.hub.policy.evaluation import evaluate
from gpuflex.hub.storage.blobs import HOT_BLOB_MAX, BlobStore
from gpuflex.protocol.jobspec import parse_job_spec
from gpuflex.protocol.modelspec import build_model
from gpuflex.protocol.tensors import decode_state, encode_state
from hypothesis import given, settings
from hypothesis import strategies as st

SPEC = """
[job]
name = "close"
[model]
kind = "mlp"
input = 64
hidden = [2048, 128]
outputs = 10
[train]
rounds = {rounds}
local_steps = 5
batch_size = 16
lr = 0.05
seed = 0
[aggregation]
server_optimizer = "nesterov"
server_lr = 0.7
server_momentum = 0.9
[data]
chunk_size = 64
[verification]
replication = 0.0
spot_check = 0.0
spot_check_trusted = 0.0
[communication]
update = "topk"
topk_fraction = 0.05
error_feedback = true
download = "topk"
download_fraction = 0.02
"""


class Audit:
    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, Any]]] = []

    def append(self, kind: str, body: dict[str, Any]) -> None:
        self.records.append((kind, body))


def _setup(tmp_path: Path, rounds_: int = 3) -> tuple[RoundEngine, JobState, BlobStore, Audit]:
    spec = parse_job_spec(SPEC.format(rounds=rounds_))
    blobs = BlobStore(tmp_path / "blobs")
    state = {k: v.detach().clone() for k, v in build_model(spec.model, 0).state_dict().items()}
    model = encode_state(state)
    assert len(model) > HOT_BLOB_MAX  # read through a copy-on-write map, and its delta made early
    g = torch.Generator().manual_seed(1)
    val = {"x": torch.randn(200, 64, generator=g), "y": torch.randint(0, 10, (200,), generator=g)}
    audit = Audit()
    engine = RoundEngine(store=None, blobs=blobs, scheduler=SimpleNamespace(nodes={}),  # type: ignore[arg-type]
                         metrics=None, signal=None, audit=audit, audit_secret=b"k")  # type: ignore[arg-type]
    job = JobState(id="job1", owner="o", name="close", spec=spec, state="running", round=0, rounds=rounds_,
                   model_hash=blobs.put(model), model_size=len(model), chunks=[], val_sha=blobs.put(encode_state(val)),
                   opt_state_sha=None, created_at=time.time())
    return engine, job, blobs, audit


def _round(engine: RoundEngine, job: JobState, blobs: BlobStore, seed: int,
           on_model: Any = None) -> ClosedRound:
    reps, shard_of = [], {}
    for i in range(2):
        g = torch.Generator().manual_seed(seed * 10 + i)
        delta = {k: torch.randn(s.shape, generator=g) * 1e-3 for k, s in
                 decode_state(blobs.read(job.model_hash)).items()}
        sha = blobs.put(encode_state(job.layout.encoding.encode(delta).wire))
        u = UpdateState(id=f"u{seed}-{i}", assignment_id=f"a{i}", shard_id=f"s{seed}-{i}", node_id=f"n{i}", sha=sha,
                        size=0, sample_count=64, loss=1.0 + i, train_s=1.0, received_at=0.0, elapsed_s=1.5)
        reps.append(u)
        shard_of[u.id] = ShardState(id=u.shard_id, job_id=job.id, round=job.round, seq=i, seed=0, chunk_idxs=(i,),
                                    samples=64, replica_group="g", wanted=1)
    reps.sort(key=lambda u: (u.sha, u.id))
    result = engine.closing.aggregation.aggregate(job, reps, shard_of, {}, on_model)
    return result


def test_both_blobs_are_durable_and_the_round_evaluated_when_the_close_returns(tmp_path: Path) -> None:
    engine, job, blobs, audit = _setup(tmp_path)
    seen: list[tuple[str, bool]] = []
    for r in range(3):
        before = job.model_hash
        result = _round(engine, job, blobs, r, on_model=lambda sha: seen.append((sha, blobs.has(sha))))
        model, opt = result.model_hash, result.opt_state_sha
        assert model != before and blobs.has(model) and opt is not None and blobs.has(opt)
        assert seen[-1] == (model, True)  # called once the model's blob was in place, never before
        # the figures are the evaluation of the published model, recorded in the audit log as well
        published = decode_state(blobs.read(model))
        val = decode_state(blobs.read(job.val_sha or ""))
        want = evaluate(job.spec, published, val)
        assert result.metrics == {**want, "train_loss": 1.5}
        kind, body = audit.records[-1]
        assert kind == "aggregation" and body["model_hash"] == model and body["round"] == r
        assert body["metrics"] == {k: round(v, 6) for k, v in result.metrics.items()}
        # the stored optimizer state carries the download residual
        stored = decode_state(blobs.read(opt))
        assert any(k.startswith("download.") for k in stored) and any(k.startswith("m.") for k in stored)
        job.model_hash, job.opt_state_sha, job.round = model, opt, r + 1
    assert len(seen) == 3


def test_the_same_inputs_close_to_the_same_bytes(tmp_path: Path) -> None:
    out = []
    for run in ("a", "b"):
        engine, job, blobs, _ = _setup(tmp_path / run)
        for r in range(2):
            result = _round(engine, job, blobs, r)
            job.model_hash, job.opt_state_sha, job.round = result.model_hash, result.opt_state_sha, r + 1
            out.append((run, r, result.model_hash, result.opt_state_sha, result.metrics))
    assert [o[2:] for o in out[:2]] == [o[2:] for o in out[2:]]


def test_a_failed_evaluation_fails_the_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, job, blobs, audit = _setup(tmp_path)

    def broken(*_: Any) -> dict[str, float]:
        raise RuntimeError("evaluation broke")

    monkeypatch.setattr(aggregating, "evaluate", broken)
    with pytest.raises(RuntimeError, match="evaluation broke"):
        _round(engine, job, blobs, 0)
    assert audit.records == []  # nothing logged for a round that did not close


async def test_the_delta_starts_on_the_loop_once_the_model_is_durable(tmp_path: Path) -> None:
    engine, job, blobs, _ = _setup(tmp_path, rounds_=2)
    assert engine.closing.delta_starter(job) is None  # nobody wired on_new_model
    prepared: list[tuple[str, str, bool]] = []
    engine.on_new_model = lambda base, new: prepared.append((base, new, blobs.has(new)))
    start = engine.closing.delta_starter(job)
    assert start is not None
    before = job.model_hash
    result = await asyncio.to_thread(_round, engine, job, blobs, 0, start)
    await asyncio.sleep(0)  # the loop runs what the worker thread handed it
    assert prepared == [(before, result.model_hash, True)]
    start(before)  # an unchanged model has no delta
    await asyncio.sleep(0)
    assert len(prepared) == 1
    job.round = 1  # the last round: its model trains nothing, no delta
    assert engine.closing.delta_starter(job) is None
    job.round, job.model_size = 0, HOT_BLOB_MAX  # a small model travels inline with the work answer
    assert engine.closing.delta_starter(job) is None


def test_a_blob_read_private_is_the_callers_own(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    big = bytes(range(256)) * ((HOT_BLOB_MAX // 256) + 10)
    small = b"small blob"
    for data in (big, small):
        sha = blobs.put(data)
        mine = blobs.read_private(sha)
        assert bytes(mine) == data
        mine[0] ^= 0xFF  # writable, and private
        assert blobs.read(sha) == data and blobs.path(sha).read_bytes() == data
        assert bytes(blobs.read_private(sha)) == data
    with pytest.raises(NotFound):
        blobs.read_private("0" * 64)


@settings(max_examples=300, deadline=None)
@given(values=st.lists(st.floats(width=32), max_size=40),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
       shape=st.sampled_from(["flat", "column", "scalar"]))
def test_all_finite_is_isfinite_all(values: list[float], dtype: torch.dtype, shape: str) -> None:
    t = torch.tensor(values, dtype=torch.float32).to(dtype)
    if shape == "column":
        t = t.reshape(-1, 1)
    elif shape == "scalar":
        t = t[:1].reshape(()) if t.numel() else torch.tensor(math.inf, dtype=dtype)
    assert _all_finite(t) == bool(torch.isfinite(t).all())


@pytest.mark.parametrize("update", ["int8", "topk", "sign"])
def test_encoded_updates_of_a_large_model_stream_from_mapped_files(tmp_path: Path, update: str) -> None:
    """open_deltas decodes each encoded update of a model over HOT_BLOB_MAX to an unnamed
    temporary file and maps it read-only, as fp32 updates are mapped: the PageReleasers can drop
    its pages, and a round of many updates does not hold them all decoded in memory."""
    from gpuflex.hub.model.job import UpdateLayout
    from gpuflex.hub.policy.pages import _MAPPED, _MAPPED_LOCK

    spec = parse_job_spec(SPEC.format(rounds=2).replace('update = "topk"', f'update = "{update}"'))
    layout = UpdateLayout.of(spec)
    assert layout.dense_bytes > HOT_BLOB_MAX
    blobs = BlobStore(tmp_path / "blobs")
    model = build_model(spec.model, 0).state_dict()
    g = torch.Generator().manual_seed(1)
    deltas = [{k: torch.randn(v.shape, generator=g) * 0.01 for k, v in model.items()} for _ in range(3)]
    wires = [layout.encoding.encode(d).wire for d in deltas]
    shas = [blobs.put(encode_state(w)) for w in wires]
    with rounds.open_deltas(blobs, shas, layout) as states:
        with _MAPPED_LOCK:
            ranges = list(_MAPPED.values())
        for state, wire in zip(states, wires, strict=True):
            expected = layout.dense(wire)
            assert set(state) == set(expected)
            for k, t in state.items():
                assert torch.equal(t, expected[k])
                ptr = t.data_ptr()
                assert any(lo <= ptr < hi for lo, hi in ranges), k  # a view of a registered mapping
        assert not any(blobs.tmp.iterdir())  # unnamed: nothing to leave behind
        del state, t
    with _MAPPED_LOCK:
        assert not any(r in _MAPPED.values() for r in ranges)
