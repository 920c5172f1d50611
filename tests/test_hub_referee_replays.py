"""The referee's heavy work on a real hub over loopback: a segment replay runs without the round
engine's lock (the hub answers, and other jobs' rounds close, while it re-trains), and a large
state streams to disk as it arrives instead of being held in memory."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import json
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from gpuflex.hub.server.appkeys import BLOBS, LEDGER
from gpuflex.protocol.messages import (
    Ack,
    Assignment,
    NoWork,
    StateRequest,
    StateUpload,
    WorkRequest,
)
from gpuflex.protocol.signing import new_nonce, seal
from gpuflex.protocol.tensors import decode_state, encode_state

from tests.helpers import (
    SimNode,
    digits_spec,
    open_store,
    start_hub,
    submit_job,
    wait_job,
    write_digits,
)

#: a trusted node's lone update is re-executed before it counts (hub/policy/referee.py)
AUDITED = {"rounds": 1, "replication": "0.0", "spot_check": 0.0, "spot_check_trusted": 1.0,
           "extra": "trust_after = 0\n"}


async def _state_request(n: SimNode, timeout: float = 30.0) -> StateRequest:
    """Poll for work until the hub asks ``n`` for its committed states (not handed over)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        req = WorkRequest(timestamp=time.time(), nonce=new_nonce(), wait_s=0.5, cached_chunks=())
        got = await n.open_response(await n.post("/v1/work", seal(n.key, req)), StateRequest, Assignment, NoWork)
        if isinstance(got, StateRequest):
            return got
    raise AssertionError("the hub never asked for the committed states")


async def _paced(body: bytes) -> AsyncIterator[bytes]:
    """The body in 256 KiB pieces, a link's pace: the hub reads each as it comes (sent at once
    over loopback, the whole body would sit in aiohttp's buffers before the route reads it)."""
    for i in range(0, len(body), 1 << 18):
        yield body[i:i + (1 << 18)]
        await asyncio.sleep(0.002)


async def _post_state(n: SimNode, asked: StateRequest, step: int, body: bytes, sha: str) -> aiohttp.ClientResponse:
    hdr = StateUpload(request_id=asked.request_id, step=step, state_sha256=sha, state_size=len(body),
                      timestamp=time.time(), nonce=new_nonce())
    return await n.session.post(n.url + "/v1/states", data=_paced(body), headers={
        "X-GPUFlex-State": base64.urlsafe_b64encode(seal(n.key, hdr)).decode(),
        "Content-Type": "application/octet-stream", "Content-Length": str(len(body))})


async def test_a_replay_runs_outside_the_engines_lock_and_its_verdict_still_lands(tmp_path: Path) -> None:
    """While the referee re-executes a segment (held here in its worker thread), another node's
    heartbeat and upload are answered at once, the engine's lock is free and another job's round
    closes; once the replay ends, its verdict is recorded and the audited job completes."""
    train, val, audited = write_digits(tmp_path / "a", **AUDITED)
    _, _, plain = write_digits(tmp_path / "b", rounds=1)
    hub = await start_hub(tmp_path / "hub")
    rounds = hub.app[LEDGER].rounds
    started, gate = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        gate.wait(60)

    rounds.referee.before_replay = hold
    try:
        async with aiohttp.ClientSession() as s:
            job_a = (await (await submit_job(s, hub, audited, train, val)).json())["id"]
            n1 = SimNode(s, hub.url)
            await n1.register()
            a1 = await n1.work(2.0)
            assert isinstance(a1, Assignment)
            assert (await n1.upload(a1, *await n1.train(a1))).ok
            assert isinstance(await n1.work(0.5), NoWork)  # the state request is answered (SimNode.hand_over)
            assert await asyncio.to_thread(started.wait, 30), "the replay never started"
            held_at = time.monotonic()

            job_b = (await (await submit_job(s, hub, plain, train, val)).json())["id"]
            n2 = SimNode(s, hub.url)
            await n2.register()
            answered: list[float] = []  # seconds each heartbeat and upload of n2 took
            while isinstance(a2 := await n2.work(1.0), Assignment):
                assert a2.job_id == job_b
                t0 = time.monotonic()
                assert (await n2.heartbeat(a2.assignment_id)).status == 200
                answered.append(time.monotonic() - t0)
                blob, samples, loss = await n2.train(a2)
                t0 = time.monotonic()
                assert (await n2.upload(a2, blob, samples, loss)).ok
                answered.append(time.monotonic() - t0)
            assert answered
            async with asyncio.timeout(5):  # no settling nor closing waits on the replay
                async with rounds.held():
                    pass
            assert (await wait_job(s, hub, job_b, timeout=30))["state"] == "done"
            assert not gate.is_set() and rounds.state_requests  # the replay is still held
            assert (await wait_job(s, hub, job_a, states=("running",)))["history"] == []
            held_s = time.monotonic() - held_at
            assert max(answered) < min(2.0, held_s / 4), (answered, held_s)
            gate.set()

            doc = await wait_job(s, hub, job_a, timeout=60)
            assert doc["history"][0]["flags"] == []
            async with s.get(hub.url + "/metrics") as r:
                assert 'gpuflex_referee_verdicts_total{outcome="reproduced"} 1' in await r.text()
        conn = open_store(hub.data_dir)
        try:
            assert conn.execute("SELECT status FROM state_requests").fetchall() == [("reproduced",)]
        finally:
            conn.close()
        assert not rounds.referee.replaying
    finally:
        gate.set()
        await hub.stop()


async def test_a_large_state_streams_to_disk_and_a_forged_one_leaves_nothing(tmp_path: Path) -> None:
    """A state of several MiB (a wide MLP's weights and momentum) is received a MiB at a time:
    the process's Python allocations while the hub takes one, sent at a link's pace, stay well
    under the state's size (held in memory, it was the state's size twice over). Bytes that
    do not hash to the committed state are refused in one line, and nothing of them stays."""
    train, val, _ = write_digits(tmp_path / "d")
    spec = tmp_path / "wide.toml"
    spec.write_text(digits_spec(**AUDITED).replace("hidden = [128]", "hidden = [16384]"))
    hub = await start_hub(tmp_path / "hub")
    blobs = hub.app[BLOBS]
    try:
        async with aiohttp.ClientSession() as s:
            job_id = (await (await submit_job(s, hub, spec, train, val)).json())["id"]
            n = SimNode(s, hub.url)
            await n.register()
            a = await n.work(2.0)
            assert isinstance(a, Assignment)
            assert (await n.upload(a, *await n.train(a))).ok
            asked = await _state_request(n)
            states = {step: n.checkpoints.read(asked.assignment_id, step) for step in asked.steps}
            assert all(data is not None and len(data) > 4 << 20 for data in states.values())

            first = asked.steps[0]
            sha = hashlib.sha256(states[first]).hexdigest()
            forged = bytes(len(states[first]))
            async with await _post_state(n, asked, first, forged, sha) as r:
                body = await r.json()
                assert (r.status, body["error"]) == (422, "hash_mismatch")
                assert "\n" not in body["detail"]
            assert list(blobs.tmp.iterdir()) == [] and not blobs.has(sha)

            for step, data in states.items():
                assert data is not None
                step_sha = hashlib.sha256(data).hexdigest()
                tracemalloc.start()
                try:
                    async with await _post_state(n, asked, step, data, step_sha) as r:
                        assert r.status == 200, await r.text()
                    _, peak = tracemalloc.get_traced_memory()
                finally:
                    tracemalloc.stop()
                assert peak < len(data) // 2, (peak, len(data))
                assert blobs.has(step_sha)
            assert list(blobs.tmp.iterdir()) == []
            doc = await wait_job(s, hub, job_id, timeout=60)
            assert doc["history"][0]["flags"] == []
        conn = open_store(hub.data_dir)
        try:
            (status, verdict), = conn.execute("SELECT status, verdict FROM state_requests").fetchall()
        finally:
            conn.close()
        assert status == "reproduced", json.loads(verdict)
    finally:
        await hub.stop()


async def test_a_large_state_holding_nan_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    """A streamed state that hashes to what the node committed but holds a NaN is refused
    (422 bad_state, one line), and neither its temp file nor a blob stays."""
    train, val, _ = write_digits(tmp_path / "d")
    spec = tmp_path / "wide.toml"
    spec.write_text(digits_spec(**AUDITED).replace("hidden = [128]", "hidden = [20000]"))
    hub = await start_hub(tmp_path / "hub")
    blobs = hub.app[BLOBS]
    try:
        async with aiohttp.ClientSession() as s:
            assert (await submit_job(s, hub, spec, train, val)).status == 201
            n = SimNode(s, hub.url)
            await n.register()
            a = await n.work(2.0)
            assert isinstance(a, Assignment)
            blob, samples, loss = await n.train(a)
            first = n.checkpoints.read(a.assignment_id, 0)
            assert first is not None and len(first) > 4 << 20
            state = {k: v.clone() for k, v in decode_state(bytearray(first)).items()}
            name = next(k for k, v in state.items() if v.is_floating_point() and v.numel() > 1 << 20)
            state[name].view(-1)[(1 << 20) + 5] = float("nan")  # in the second block _check_state looks at
            poisoned = encode_state(state)
            sha = hashlib.sha256(poisoned).hexdigest()
            c = n.commitments[a.assignment_id]
            committed = dataclasses.replace(c, hashes=(sha, *c.hashes[1:]))
            assert (await n.open_response(await n.upload_raw(
                n.update_header(a, blob, samples, loss, commitment=committed), blob), Ack)).ok
            asked = await _state_request(n)
            assert asked.steps[0] == 0
            async with await _post_state(n, asked, 0, poisoned, sha) as r:
                body = await r.json()
                assert (r.status, body["error"]) == (422, "bad_state"), body
                assert name in body["detail"] and "\n" not in body["detail"]
            assert list(blobs.tmp.iterdir()) == [] and not blobs.has(sha)
    finally:
        await hub.stop()
