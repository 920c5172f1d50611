"""Encoded updates end to end (issue 17): a real node agent and a real hub, int8, topk and sign with
error feedback. The residual is committed in the last checkpoint, so the referee's spot check holds the
upload to exactly the encoding of (last state - round model + residual): an attack hidden inside
the quantization noise is caught there. Without feedback, replicas of one class encode to the
same codes and the same attack loses the replica vote."""

from __future__ import annotations

import asyncio
import json
import os
import stat

import pytest
import torch
from gpuflex.hub.policy.replica_comparison import compare_replicas
from gpuflex.hub.policy.update_record import UpdateRecord
from gpuflex.protocol.encoding import UpdateEncoding
from gpuflex.protocol.jobspec import VerificationSpec, parse_job_spec
from gpuflex.protocol.tensors import manifest_of
from test_node_support import EventLog, Hub, agent, dataset, spec_toml

from tests.tooling import attacks as atk


def _spec(update: str, *, rounds: int = 3, spot_check: float = 1.0, feedback: bool = True) -> str:
    return spec_toml(rounds=rounds, chunk_size=64, spot_check=spot_check, hidden=256) + (
        f'[communication]\nupdate = "{update}"\ntopk_fraction = 0.1\nerror_feedback = {str(feedback).lower()}\n')


async def _run(tmp_path, spec: str, cls=None, until=None) -> tuple[Hub, str, EventLog, dict]:
    """Run one node until the job ends (or ``until(hub)`` holds)."""
    hub = await Hub(tmp_path / "hub").start()
    job_id = await hub.submit(spec, dataset(n=256))
    events = EventLog()
    node = agent(tmp_path / "node", hub.url, events, **({"cls": cls} if cls else {}))
    task = asyncio.create_task(node.run())
    try:
        doc = await hub.wait_job(job_id, 90, ended=("done", "failed"), until=until)
    finally:
        node.request_exit("test")
        await asyncio.wait_for(task, 15)
    return hub, job_id, events, doc


@pytest.mark.parametrize("update", ["int8", "topk", "sign"])
async def test_an_encoded_job_with_feedback_runs_and_the_referee_reproduces_it(tmp_path, update) -> None:
    hub, job_id, events, doc = await _run(tmp_path, _spec(update))
    try:
        assert doc["state"] == "done" and all(not h["flags"] for h in doc["history"]), doc["history"]
        rows = hub.db_rows("SELECT status, verdict FROM state_requests ORDER BY requested_at")
        assert [r["status"] for r in rows] == ["reproduced"] * 3, rows
        # the residual each committed is what its last upload left (the first: none yet)
        chains = [json.loads(r["verdict"])["residual_chain"] for r in rows]
        assert chains[0] == "zero" and chains[1:] == ["upload 0"] * 2, chains
        # what travelled: a quarter of fp32 (int8), 10% kept at 8 bytes each (topk), a bit each plus the header (sign)
        model = hub.db_rows("SELECT model_size FROM jobs WHERE id = ?", (job_id,))[0]["model_size"]
        sizes = [e["bytes"] for e in events.of("uploaded")]
        assert len(sizes) == 3 and all(s < {"int8": 0.3, "topk": 0.25, "sign": 0.1}[update] * model for s in sizes), (sizes, model)
        # the residual is on disk, 0600, and moved on with each accepted update
        path = tmp_path / "node" / "feedback" / f"{job_id}.gft"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    finally:
        await hub.stop()


async def test_an_attack_inside_the_quantization_noise_is_caught_by_the_referee(tmp_path) -> None:
    def judged(hub: Hub) -> bool:
        return bool(hub.db_rows("SELECT id FROM state_requests WHERE status != 'open'"))

    hub, job_id, _events, _doc = await _run(tmp_path, _spec("int8", rounds=1), atk.quant_nudge_agent_class(), judged)
    try:
        rows = [r for r in hub.db_rows("SELECT status, verdict FROM state_requests") if r["status"] != "open"]
        assert rows and all(r["status"] == "mismatch" for r in rows), rows
        assert "int8 encoding of the committed last state" in rows[0]["verdict"]
        flagged = await wait_for_flag(hub, job_id)
        assert flagged["reason"].startswith("referee"), flagged
    finally:
        await hub.stop()


@pytest.mark.parametrize("update", ["int8", "sign"])
async def test_a_residual_the_earlier_uploads_did_not_leave_is_caught(tmp_path, update) -> None:
    """The node commits and encodes with a residual pushed by 1e-3 everywhere from its second
    assignment on: its uploads are the exact encoding of what it committed, so only the residual's
    chain catches it. Its first, honest update is reproduced; every later one is not."""
    def judged(hub: Hub) -> bool:
        return len(hub.db_rows("SELECT id FROM state_requests WHERE status != 'open'")) >= 2

    hub, job_id, _events, _doc = await _run(tmp_path, _spec(update, rounds=2),
                                            atk.forged_residual_agent_class(after=1), judged)
    try:
        rows = [r for r in hub.db_rows("SELECT status, verdict FROM state_requests ORDER BY requested_at")
                if r["status"] != "open"]
        assert rows[0]["status"] == "reproduced" and json.loads(rows[0]["verdict"])["residual_chain"] == "zero", rows
        assert len(rows) >= 2 and all(r["status"] == "mismatch" for r in rows[1:]), rows
        for r in rows[1:]:
            verdict = json.loads(r["verdict"])
            assert verdict["residual_chain"] == "forged" and "committed residual" in verdict["why"], verdict
        flagged = await wait_for_flag(hub, job_id)
        assert flagged["reason"].startswith("referee"), flagged
    finally:
        await hub.stop()


async def wait_for_flag(hub: Hub, job_id: str) -> dict:
    for _ in range(100):
        rows = hub.db_rows("SELECT reason, status FROM flags WHERE job_id = ?", (job_id,))
        if rows:
            return rows[0]
        await asyncio.sleep(0.1)
    raise AssertionError("no flag")


def test_without_feedback_replicas_encode_alike_and_the_nudge_loses_the_vote() -> None:
    """Two honest same-class replicas of one shard: the same codes, distance 0 under int8. The
    nudged one is within one step of them everywhere, and far outside the allowance."""
    torch.set_num_threads(1)
    spec = atk.digits_spec()
    xtr, ytr, _, _ = atk.digits_data()
    chunks = atk.make_chunks(xtr, ytr, split="stratified")[:3]
    d = atk.contribute(None, spec, atk.initial_state(spec), chunks, atk.train_config(), seed=3).delta
    job = parse_job_spec('[job]\nname = "q"\n[model]\nkind = "mlp"\ninput = 64\nhidden = [32]\noutputs = 10\n'
                         '[communication]\nupdate = "int8"\n')
    enc = UpdateEncoding("int8")
    man = manifest_of(d)

    def record(node: str, wire) -> UpdateRecord:
        return UpdateRecord(update_id=f"u-{node}", node_id=node, shard_id="s", samples_claimed=192,
                            shard_samples=192, loss=1.0, train_s=1.0, node_samples_per_s=0.0,
                            delta=enc.decode(wire, man))

    honest = enc.encode(d).wire
    records = [record("h1", honest), record("h2", enc.encode(d).wire), record("bad", atk.quant_nudge(honest, "int8"))]
    out = compare_replicas(records, job.verification)
    assert out.agreed and [f.update_id for f in out.flags] == ["u-bad"], out.evidence
    pairs = {(p["a"], p["b"]): p["relative_distance"] for p in out.evidence["pairs"]}
    assert pairs[("u-h1", "u-h2")] == 0.0
    assert pairs[("u-h1", "u-bad")] > 3 * job.verification.tolerance
    assert job.verification.tolerance == pytest.approx(VerificationSpec().tolerance + 3e-3)


async def test_a_sparse_download_publishes_models_that_differ_in_few_elements(tmp_path) -> None:
    """[communication] download = "topk": each round's model differs from the last in at most
    download_fraction of its elements (the rest of the change waits in the hub's residual), and the
    node holding the last model fetches the next as a delta a fraction of the model's size."""
    from gpuflex.hub.server.appkeys import BLOBS
    from gpuflex.protocol.blobdelta import make_delta
    from gpuflex.protocol.tensors import decode_state

    spec = spec_toml(rounds=4, chunk_size=64, hidden=256) + (
        '[communication]\nupdate = "int8"\ndownload = "topk"\ndownload_fraction = 0.02\n')
    hub, job_id, _events, doc = await _run(tmp_path, spec)
    try:
        assert doc["state"] == "done", doc
        rows = hub.db_rows("SELECT round, model_hash, new_model_hash FROM rounds WHERE job_id = ? ORDER BY round",
                           (job_id,))
        blobs = hub.app[BLOBS]
        n = None
        for r in rows:
            old, new = (decode_state(bytearray(blobs.read(r[k]))) for k in ("model_hash", "new_model_hash"))
            n = sum(t.numel() for t in old.values() if t.is_floating_point())
            changed = sum(int((old[k] != new[k]).sum()) for k in old if old[k].is_floating_point())
            assert 0 < changed <= -(-n * 2 // 100), (r["round"], changed, n)
            # what a node holding the old model downloads (this small model travels inline with the
            # work answer; a large one is fetched as this delta, hub/storage/deltas.py)
            old_b, new_b = blobs.read(r["model_hash"]), blobs.read(r["new_model_hash"])
            assert len(make_delta(old_b, new_b)) < 0.15 * len(new_b), r["round"]
    finally:
        await hub.stop()
