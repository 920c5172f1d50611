"""What the hub decides when the owner's spec leaves [data] open, and what job status says of it.

- No val file and no ``validation_fraction``: 10% is held out, so rounds report accuracy; an
  explicit ``validation_fraction = 0`` turns it off, and status says there is none.
- No ``chunk_size``: chunks are sized from the dataset and the nodes online, so a small dataset
  (wine's 124 rows) feeds three nodes; with a fixed chunk size too large for that, job status
  says in words why nodes idle.
- What the hub decided is written into the stored spec, with why.

Real hub on 127.0.0.1, real SQLite/PostgreSQL store, simulated nodes training with the real trainer.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from gpuflex.hub.policy.datadefaults import Decision, record_in_spec
from gpuflex.protocol import parse_job_spec
from gpuflex.protocol.messages import Assignment, NoWork

from tests.helpers import SimNode, open_store, submit_job, wait_job, when_job_arrives

WINE_SPEC = """
[job]
name = "wine"

[model]
kind = "mlp"
input = 13
hidden = [16]
outputs = 3

[train]
rounds = 2
lr = 0.05
round_target_s = 86400.0

[verification]
replication = 0.0
spot_check = 0.0
spot_check_trusted = 0.0
"""


def _wine_csv(path: Path, rows: int = 124) -> Path:
    """The first ``rows`` of a shuffled, standardized wine dataset as CSV with a label column."""
    from sklearn.datasets import load_wine

    x, y = load_wine(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))[:rows]
    x = (x - x.mean(axis=0)) / x.std(axis=0)
    header = ",".join([f"f{i}" for i in range(x.shape[1])] + ["label"])
    lines = [header] + [",".join(f"{v:.6f}" for v in x[i]) + f",{y[i]}" for i in order]
    path.write_text("\n".join(lines) + "\n")
    return path


def _stored_spec(hub, job_id: str) -> str:
    conn = open_store(hub.data_dir)
    try:
        return str(conn.execute("SELECT spec_toml FROM jobs WHERE id = ?", (job_id,)).fetchone()[0])
    finally:
        conn.close()


async def _status(s: aiohttp.ClientSession, hub, job_id: str) -> dict:
    async with s.get(f"{hub.url}/v1/jobs/{job_id}", headers=hub.auth()) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def _train_round(s: aiohttp.ClientSession, hub, job_id: str) -> dict:
    """One node trains round 0 whole; the job's status once the round closed."""
    node = SimNode(s, hub.url)
    await node.register()
    while True:
        a = await node.work(3.0)
        if not isinstance(a, Assignment):
            break
        await node.upload(a, *await node.train(a))
        if a.round > 0:
            break
    doc = await wait_job(s, hub, job_id, states=("running", "done"))
    while not doc["history"]:
        await asyncio.sleep(0.05)
        doc = await _status(s, hub, job_id)
    return doc


async def test_no_val_file_holds_out_ten_percent_and_rounds_report_accuracy(running_hub, tmp_path):
    hub = running_hub
    train = _wine_csv(tmp_path / "wine.csv")
    async with aiohttp.ClientSession() as s:
        r = await submit_job(s, hub, WINE_SPEC, train)
        assert r.status == 201, await r.text()
        job_id = (await r.json())["id"]
        doc = await _status(s, hub, job_id)
        held = doc["val_samples"]  # 10% of each class, rounded
        assert held in (12, 13) and doc["train_samples"] == 124 - held, doc
        assert doc["data"]["validation"] == (f"{held} samples held out of the training set (10%, the hub's default"
                                             " without a validation file); [data] validation_fraction = 0 turns"
                                             " the hold-out off"), doc["data"]
        stored = _stored_spec(hub, job_id)
        assert "validation_fraction = 0.1  # set by the hub: no val file was given" in stored, stored
        assert parse_job_spec(stored).data.validation_fraction == 0.1
        doc = await _train_round(s, hub, job_id)
        assert doc["history"][0]["accuracy"] is not None and doc["history"][0]["loss"] is not None, doc


async def test_validation_fraction_zero_turns_it_off_and_status_says_so(running_hub, tmp_path):
    hub = running_hub
    train = _wine_csv(tmp_path / "wine.csv")
    spec = WINE_SPEC + "\n[data]\nvalidation_fraction = 0\n"
    async with aiohttp.ClientSession() as s:
        r = await submit_job(s, hub, spec, train)
        assert r.status == 201, await r.text()
        job_id = (await r.json())["id"]
        doc = await _status(s, hub, job_id)
        assert doc["val_samples"] == 0 and doc["train_samples"] == 124, doc
        assert doc["data"]["validation"].startswith("none, so no round reports loss or accuracy"), doc["data"]
        assert "validation_fraction = 0\n" in _stored_spec(hub, job_id)
        doc = await _train_round(s, hub, job_id)
        assert doc["history"][0]["accuracy"] is None


async def test_a_val_file_is_the_validation_set_and_nothing_is_held_out(running_hub, tmp_path):
    hub = running_hub
    train = _wine_csv(tmp_path / "wine.csv")
    val = _wine_csv(tmp_path / "val.csv", rows=30)
    async with aiohttp.ClientSession() as s:
        r = await submit_job(s, hub, WINE_SPEC, train, val)
        assert r.status == 201, await r.text()
        doc = await _status(s, hub, (await r.json())["id"])
        assert doc["val_samples"] == 30 and doc["train_samples"] == 124, doc
        assert doc["data"]["validation"] == "30 samples from the validation file given with the job"
        assert "validation_fraction" not in _stored_spec(hub, doc["id"])


async def test_chunks_follow_a_small_dataset_so_three_nodes_all_train(running_hub, tmp_path):
    hub = running_hub
    train = _wine_csv(tmp_path / "wine.csv")
    async with aiohttp.ClientSession() as s:
        nodes = [SimNode(s, hub.url) for _ in range(3)]
        job, answers = await when_job_arrives(nodes, s, hub, WINE_SPEC, train)
        assert all(isinstance(a, Assignment) for a in answers), answers  # nobody idles
        doc = await _status(s, hub, job["id"])
        assert doc["data"]["chunks"] >= 3 and doc["data"]["chunk_size"] == 8, doc["data"]
        assert doc["progress"]["idle"] is None, doc["progress"]
        stored = _stored_spec(hub, job["id"])
        assert (f"chunk_size = 8  # set by the hub: {doc['train_samples']} training rows for at least 16 chunks"
                " (3 nodes online)") in stored, stored


async def test_status_says_why_nodes_idle_when_chunks_are_fewer_than_nodes(running_hub, tmp_path):
    hub = running_hub
    train = _wine_csv(tmp_path / "wine.csv")
    spec = WINE_SPEC + "\n[data]\nchunk_size = 64\n"
    async with aiohttp.ClientSession() as s:
        nodes = [SimNode(s, hub.url) for _ in range(3)]
        job, answers = await when_job_arrives(nodes, s, hub, spec, train)
        assert sum(isinstance(a, NoWork) for a in answers) == 1, answers  # 2 chunks: the third idles
        doc = await _status(s, hub, job["id"])
        idle = doc["progress"]["idle"]
        assert idle.startswith("3 nodes are online but a round has 2 chunks of up to 64 samples;"), idle
        assert "1 of them get no shard of this job to train" in idle and "smaller [data] chunk_size" in idle
        env = dict(os.environ, GPUFLEX_HUB=hub.url, GPUFLEX_TOKEN=hub.owner_token)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gpuflex.hub", "job", "status", job["id"], env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        lines = out.decode().splitlines()
        assert f"idle nodes: {idle}" in lines, lines
        assert f"data: {doc['train_samples']} training samples in 2 chunks of up to 64" in lines, lines
        assert f"validation: {doc['data']['validation']}" in lines, lines
        assert doc["data"]["validation"].startswith(f"{doc['val_samples']} samples held out"), doc["data"]


DECIDED = [Decision("validation_fraction", 0.1, "set by the hub: why"), Decision("chunk_size", 8, "set by the hub")]


@pytest.mark.parametrize(("data", "recorded"), [
    ('[data]\nsplit = "random"\n', True),  # after its header
    ("", True),  # a [data] table of its own at the end
    ('[data]  # the rows\nsplit = "random"\n[aggregation]\nmethod = "median"\n', True),
    ('data = { split = "random" }\n', False),  # an inline table: left as written
])
def test_record_in_spec_writes_the_decisions_into_data_or_leaves_the_text(data, recorded):
    text = data + WINE_SPEC if data.startswith("data =") else WINE_SPEC + data  # a root key comes first
    spec = parse_job_spec(text)
    out = record_in_spec(text, spec, DECIDED)
    if not recorded:
        assert out == text
        return
    got = parse_job_spec(out)
    assert got.data.validation_fraction == 0.1 and got.data.chunk_size == 8 and got.data.split == spec.data.split
    assert got.train == spec.train and got.model == spec.model
    assert "validation_fraction = 0.1  # set by the hub: why\n" in out
