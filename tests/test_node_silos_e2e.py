"""Node-local data end to end: real node processes, `gpuflex-node data add`, and every byte they send.

Issue 18: "Nothing else about the data leaves the node, and a test proves it: capture every byte
the node sends and search it for the rows." Two node processes reach a real hub only through a
TCP relay that keeps every byte they send (tests/tooling/relay.py). Their operators attach a
silo each (one .npz, one CSV) with the CLI, the job trains three rounds, and then the capture is
searched for every row: its float32 bytes, and for the CSV silo each line's text.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import subprocess
import sys
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch
from gpuflex.hub.server.appkeys import BLOBS
from gpuflex.protocol.tensors import encode_state
from sklearn.datasets import load_digits

from tests.test_node_support import Hub, ProcessEvents, start_node_process
from tests.tooling.partition import dirichlet_split
from tests.tooling.relay import CuttingRelay

SPEC = """
[job]
name = "private-digits"
[model]
kind = "mlp"
input = 64
hidden = [32]
outputs = 10
[train]
rounds = 3
local_epochs = 2
batch_size = 32
lr = 0.1
seed = 5
[data]
source = "node-local"
min_samples = 50
max_samples = 2000
quorum = 2
round_deadline_s = 120
"""


def _npz(x: np.ndarray, y: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, x=x, y=y)
    return buf.getvalue()


def _csv_lines(x: np.ndarray, y: np.ndarray) -> list[str]:
    return [",".join(repr(float(v)) for v in row) + f",{int(label)}" for row, label in zip(x, y, strict=True)]


def _data_add(data_dir: Path, url: str, job: str, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuflex.node", "data", "add", job, str(path), "--hub", url,
                           "--data-dir", str(data_dir)], capture_output=True, text=True, timeout=120)


def _rows_found(capture: bytes, x: np.ndarray) -> int:
    """How many rows of ``x`` appear, as their float32 bytes, in ``capture``."""
    return sum(1 for row in np.ascontiguousarray(x, dtype=np.float32) if row.tobytes() in capture)


@pytest.mark.asyncio
async def test_a_node_sends_no_row_of_its_silo_only_its_hash_size_and_count(tmp_path):
    torch.set_num_threads(1)
    d = load_digits()
    x, y = (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)
    val = np.arange(0, len(y), 5)
    rest = np.setdiff1d(np.arange(len(y)), val)
    parts = [rest[p] for p in dirichlet_split(y[rest], 2, 0.5, seed=2, min_size=200)]
    (xa, ya), (xb, yb) = ((x[p], y[p]) for p in parts)
    silo_a = tmp_path / "hospital-a.npz"
    silo_a.write_bytes(_npz(xa, ya))
    silo_b = tmp_path / "hospital-b.csv"
    silo_b.write_text(",".join([f"p{i}" for i in range(64)] + ["label"]) + "\n" + "\n".join(_csv_lines(xb, yb)) + "\n")

    hub = await Hub(tmp_path / "hub").start()
    relay = await CuttingRelay(hub.port, cut_after=1 << 40, captured=bytearray()).start()
    procs: list[subprocess.Popen[str]] = []
    try:
        async with aiohttp.ClientSession() as s:
            form = aiohttp.FormData()
            form.add_field("spec", SPEC.encode(), filename="spec.toml")
            form.add_field("val", _npz(x[val], y[val]), filename="val.npz")
            async with s.post(hub.url + "/v1/jobs", data=form,
                              headers={"Authorization": f"Bearer {hub.owner_token}"}) as r:
                assert r.status == 201, await r.text()
                job = (await r.json())["id"]
        events = []
        for name in ("a", "b"):
            procs.append(start_node_process(tmp_path / name, relay.url))
            events.append(ProcessEvents(procs[-1]))
        for ev in events:
            for _ in range(300):
                if "registered" in ev.names():
                    break
                await asyncio.sleep(0.1)
            assert "registered" in ev.names(), ev.raw[-5:]
        added = []
        for name, path in (("a", silo_a), ("b", silo_b)):
            cp = await asyncio.to_thread(_data_add, tmp_path / name, relay.url, job, path)
            assert cp.returncode == 0, cp.stdout + cp.stderr
            added.append(cp.stdout)
        doc = await hub.wait_job(job, 180)
        assert hub.app is not None
        silo_shas = [s["blob"] for s in doc["silos"]]
        hub_has = [hub.app[BLOBS].has(sha) for sha in silo_shas]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        await relay.stop()
        await hub.stop()
    capture = bytes(relay.captured or b"")

    # the job trained both silos every round, where they are, and learned
    assert doc["state"] == "done", doc.get("error")
    assert sorted(s["samples"] for s in doc["silos"]) == sorted([len(ya), len(yb)])
    assert all(s["label_histogram"] is None for s in doc["silos"])  # not asked, not sent
    assert [len(h["updates"]) for h in doc["history"]] == [2, 2, 2]
    assert doc["history"][-1]["accuracy"] > 0.5, [h["accuracy"] for h in doc["history"]]
    assert hub_has == [False, False]  # the hub never holds a silo
    # what the operators were told, and what the hub learned: the blob ids went through the relay
    expected = {hashlib.sha256(encode_state({"x": torch.from_numpy(np.ascontiguousarray(xs)),
                                               "y": torch.from_numpy(np.ascontiguousarray(ys))})).hexdigest()
                for xs, ys in ((xa, ya), (xb, yb))}
    assert set(silo_shas) == expected
    assert all(sha.encode() in capture or bytes.fromhex(sha) in capture for sha in silo_shas)
    assert all("the hub got the blob id, its size and the sample count" in out for out in added), added
    # no row left either node: not as float32 bytes, not as CSV text, not in any request
    assert len(capture) > 10_000  # registrations, work requests, heartbeats, three rounds of updates
    assert _rows_found(capture, xa) == 0 and _rows_found(capture, xb) == 0
    assert not any(line.encode() in capture for line in _csv_lines(xb, yb))
    # the search finds rows where they are: in the encoded silo, and in the capture plus that silo
    blob = encode_state({"x": torch.from_numpy(xa), "y": torch.from_numpy(ya)})
    assert _rows_found(blob, xa) == len(ya) and _rows_found(capture + blob, xa) == len(ya)
