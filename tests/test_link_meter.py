"""The hub times the bodies a node sends (hub/server/linkmeter.py): a relayed activation that
comes in paced, through a real hub on 127.0.0.1, gives the node a measured uplink at about that
pace, which the plan then uses for the node and shows (`nodes[].bandwidth_measured`); a node
whose bodies it never timed keeps the assumed home line; a body too small to time says nothing."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time

import aiohttp
import pytest
import torch
from gpuflex.hub.server.appkeys import LEDGER
from gpuflex.hub.server.linkmeter import MIN_SAMPLE_BYTES, BodyClock
from gpuflex.protocol.messages import LinkProbe, RelayHeader
from gpuflex.protocol.signing import SigningKey, new_nonce, seal
from gpuflex.protocol.tensors import encode_state

from tests.pipeline_hub import (
    DIGITS_SPEC,
    HubThread,
    ack_of,
    b64,
    error_of,
    poll_until,
    register,
    request,
    submit,
)

torch.set_num_threads(1)

#: a digits MLP whose first cut carries (8, 4096) float32: 128 KiB a micro-batch
WIDE = DIGITS_SPEC.format(stages=2, steps=4, every=2).replace(
    "hidden = [32, 16]", "hidden = [4096]"
)
CHUNK, CHUNKS, GAP_S = 8 << 10, 16, 0.01


@pytest.fixture
def hub(tmp_path):
    h = HubThread(tmp_path / "hub")
    yield h
    h.stop()


def test_a_body_too_small_or_all_in_one_piece_says_nothing() -> None:
    clock = BodyClock()
    for size in (4096, MIN_SAMPLE_BYTES - 1, 0):
        clock.piece(size)
    assert clock.rate() is None
    whole = BodyClock()
    whole.piece(1 << 20)
    whole.piece(0)
    assert whole.rate() is None  # everything was buffered before the first read: no time to go by


def test_a_paced_relay_body_measures_the_senders_uplink_and_the_plan_uses_it(hub, tmp_path) -> None:
    keys = [register(hub.url), register(hub.url)]
    code, job = submit(hub, tmp_path, WIDE)
    assert code == 201, job
    got = poll_until(hub, keys)
    first = next(i for i, sa in enumerate(got) if sa.stage == 0)
    sender, receiver = keys[first].fingerprint, keys[1 - first].fingerprint
    body = encode_state({"activation": torch.ones(8, 4096)})
    hdr = RelayHeader(
        job_id=job["id"], step=0, micro_batch=0, carries="activation", stage=0, to_stage=1,
        sha256=hashlib.sha256(body).hexdigest(), size=len(body), timestamp=time.time(),
        nonce=new_nonce(), generation=got[first].generation,
    )  # fmt: skip

    async def paced() -> tuple[int, bytes]:
        async def pieces():
            for k in range(0, len(body), CHUNK):
                yield body[k : k + CHUNK]
                await asyncio.sleep(GAP_S)

        async with aiohttp.ClientSession() as s:
            headers = {"X-GPUFlex-Relay": b64(seal(keys[first], hdr))}
            async with s.post(f"{hub.url}/v1/relay", data=pieces(), headers=headers) as r:
                return r.status, await r.read()

    started = time.perf_counter()
    status, answer = asyncio.run(paced())
    took = time.perf_counter() - started
    assert status == 200 and ack_of(hub, answer).ok, answer
    nodes = hub.call(lambda: hub.hub.app[LEDGER].scheduler.nodes)
    measured = nodes[sender].uplink_bytes_per_s
    paced_at = (len(body) - CHUNK) / ((CHUNKS - 1) * GAP_S)  # no faster than the sleeps allow
    assert len(body) / took * 0.5 <= measured <= paced_at * 1.2, (measured, paced_at, took)
    assert nodes[receiver].uplink_bytes_per_s == 0  # it sent nothing worth timing
    code, _, raw = request(
        hub.url, "GET", f"/v1/jobs/{job['id']}/plan", None,
        {"Authorization": f"Bearer {hub.tokens['owner']}"},
    )  # fmt: skip
    assert code == 200, raw
    offers = json.loads(raw)["offers"]
    shown = {n["node_id"]: n for n in offers["nodes"]}
    assert shown[sender]["bandwidth_measured"] and shown[sender][
        "bandwidth_bytes_per_s"
    ] == pytest.approx(measured)
    assert not shown[receiver]["bandwidth_measured"]
    assert (
        shown[receiver]["bandwidth_bytes_per_s"] == offers["link"]["bandwidth_bytes_per_s"] == 2.5e6
    )
    assert offers["link"]["assumed"] is False  # one node is measured


def _probe(hub, key, body: bytes, **over) -> tuple[int, bytes]:
    fields = dict(
        sha256=hashlib.sha256(body).hexdigest(),
        size=len(body),
        timestamp=time.time(),
        nonce=new_nonce(),
    )
    msg = LinkProbe(**{**fields, **over})
    code, _, answer = request(
        hub.url, "POST", "/v1/nodes/probe", body, {"X-GPUFlex-Auth": b64(seal(key, msg))}
    )
    return code, answer


def test_a_bad_probe_is_refused_in_one_line_and_measures_nothing(hub) -> None:
    key = register(hub.url)
    body = bytes(64 << 10)
    for over, code, error in (
        ({"sha256": "0" * 64}, 422, "hash_mismatch"),
        ({"size": len(body) + 1}, 400, "size_mismatch"),
    ):
        got, answer = _probe(hub, key, body, **over)
        assert got == code and error_of(answer)[0] == error, answer
    stranger = SigningKey.generate()  # never registered
    got, answer = _probe(hub, stranger, body)
    assert got in (401, 403, 404) and "\n" not in json.loads(answer)["detail"], answer
    nodes = hub.call(lambda: hub.hub.app[LEDGER].scheduler.nodes)
    assert nodes[key.fingerprint].uplink_bytes_per_s == 0


async def test_a_node_probes_its_link_when_it_registers(tmp_path) -> None:
    """A real NodeAgent: after its hello it sends the hub a link probe, which the hub times."""
    from tests.helpers import start_hub
    from tests.test_node_support import EventLog, agent, wait_for

    hub = await start_hub(tmp_path / "hub")
    events = EventLog()
    node = agent(tmp_path / "node", hub.url, events)
    try:
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(node.run())
            notes = lambda: [e for e in events.of("note") if "link probe" in e.get("detail", "")]  # noqa: E731
            try:
                await wait_for(lambda: notes() or task.done())
            finally:
                node.request_exit("test")
        (note,) = notes()
        assert note["detail"].startswith("link probe: "), note
        measured = hub.app[LEDGER].scheduler.nodes[node.node_id].uplink_bytes_per_s
        # timed, or in one piece on loopback (then nothing is measured, and the note says so)
        assert (measured > 0) == ("timed at" in note["detail"]), (measured, note)
    finally:
        await hub.stop()
