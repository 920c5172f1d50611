"""The hub's pipeline relay, through a real hub on 127.0.0.1: stages in threads train over it to the
same parameters as single-process gradient accumulation; every bad input is refused in one line
and changes nothing; a hypothesis fuzz of the endpoint answers only 4xx and keeps nothing."""

from __future__ import annotations

import asyncio
import base64
import copy
import hashlib
import http.client
import itertools
import json
import struct
import threading
import time
from urllib.parse import urlsplit

import pytest
import torch
from gpuflex.hub.model.relay import Crossing, RelayPlan
from gpuflex.hub.server.appkeys import HUB_KEY, RELAY
from gpuflex.node.errors import PipelineError
from gpuflex.node.pipeline.local import run_stages
from gpuflex.node.pipeline.relay import RelayTransport
from gpuflex.node.pipeline.transport import MemoryNetwork, MessageKey
from gpuflex.protocol.messages import Benchmark, DeviceInfo, Hello, RelayHeader, RelayTake
from gpuflex.protocol.signing import SigningKey, new_nonce, open_sealed, seal
from gpuflex.protocol.stagesketch import encode_sketch
from gpuflex.protocol.tensors import TensorSpec, encode_state
from gpuflex.protocol.version import PROTOCOL_VERSION
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from tests.helpers import start_hub
from tests.test_pipeline_engine import (
    ADAM,
    BATCH,
    CUTS,
    SGD,
    accumulate,
    max_rel_diff,
    mlp_units,
    runners_for,
)
from tests.test_pipeline_engine import step_data as engine_steps

torch.set_num_threads(1)


class HubThread:
    """The real hub app on 127.0.0.1, its event loop in a thread (the stages block in theirs)."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.hub = self.loop.run_until_complete(
                start_hub(tmp_path_factory.mktemp("relayhub"), long_poll_max_s=2.0)
            )
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(60)
        self.url = self.hub.url
        self.relay = self.hub.app[RELAY]
        self.hub_key = self.hub.app[HUB_KEY]

    def call(self, fn):
        async def run():
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.hub.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = HubThread(tmp_path_factory)
    yield h
    h.stop()


def _hello() -> Hello:
    return Hello(
        software_version="0.1.0",
        protocol_version=PROTOCOL_VERSION,
        device=DeviceInfo(kind="cpu", name="relay-test", memory_bytes=1, threads=1),
        benchmark=Benchmark(
            samples_per_s=100.0,
            matmul_tflops_fp32=0.1,
            matmul_tflops_bf16=None,
            matmul_tflops_fp16=None,
            mem_bandwidth_gbs=1.0,
            h2d_gbs=None,
            d2h_gbs=None,
            reference_model="x",
        ),
        timestamp=time.time(),
        nonce=new_nonce(),
    )


def _request(
    url: str, method: str, headers: dict[str, str], body: bytes | None = None
) -> tuple[int, dict, bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request(
            method,
            "/v1/relay" if method != "REGISTER" else "/v1/nodes/register",
            body=body,
            headers=headers,
        )
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def register(hub: HubThread) -> SigningKey:
    key = SigningKey.generate()
    parts = urlsplit(hub.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request(
        "POST",
        "/v1/nodes/register",
        body=seal(key, _hello()),
        headers={"Content-Type": "application/x-msgpack"},
    )
    assert conn.getresponse().status == 200
    conn.close()
    return key


def plan_for(keys: list[SigningKey], starts: list[int], micro: int, **kw) -> RelayPlan:
    stages = [nn.Sequential(*u) for u in _stage_units(starts)]
    x = torch.zeros(BATCH, 12)
    crossings = []
    with torch.no_grad():
        for module in stages[:-1]:
            x = module(x)
            crossings.append(Crossing("float32", tuple(x.shape)))
    return RelayPlan(
        stages=tuple(k.fingerprint for k in keys),
        boundaries=tuple(crossings),
        micro_batches=micro,
        **kw,
    )


def _stage_units(starts: list[int]) -> list[list[nn.Module]]:
    units = mlp_units()
    bounds = [*starts, len(units)]
    return [units[a:b] for a, b in itertools.pairwise(bounds)]


RELAYED = [(2, "gpipe"), (2, "1f1b"), (3, "1f1b"), (4, "1f1b"), (4, "gpipe")]


@pytest.mark.parametrize(("stages", "schedule"), RELAYED)
def test_a_pipeline_over_the_relay_equals_gradient_accumulation(
    hub: HubThread, stages: int, schedule: str
) -> None:
    cfg = SGD if stages == 3 else ADAM
    keys = [register(hub) for _ in range(stages)]
    job = f"job-eq-{stages}-{schedule}"
    hub.call(lambda: hub.relay.registry.assign(job, plan_for(keys, CUTS[stages], 4)))
    units = mlp_units()
    reference = nn.Sequential(*copy.deepcopy(units))
    data = engine_steps()
    want = accumulate(reference, data, cfg)
    runners = runners_for(units, CUTS[stages], cfg, schedule, MemoryNetwork())
    transports = [
        RelayTransport(
            hub.url,
            k,
            job,
            hub_public_key=hub.hub_key.public_bytes,
            peers={s: keys[s].public_bytes for s in range(stages)},
            wait_s=1.0,
        )
        for k in keys
    ]
    for runner, transport in zip(runners, transports, strict=True):
        runner.transport = transport
    try:
        got = run_stages(runners, data)
    finally:
        for t in transports:
            t.close()
    assert max_rel_diff([r.module for r in runners], reference) <= 1e-5
    assert got == pytest.approx(want, rel=1e-5)
    assert len(hub.relay) == 0 and hub.relay.held_bytes == 0  # every message was taken


# -- bad input ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two(hub: HubThread):
    """A 2-stage plan for job-bad (steps 0..9) and its two nodes' keys; an activation is (8, 32) float32."""
    keys = [register(hub), register(hub)]
    hub.call(lambda: hub.relay.registry.assign("job-bad", plan_for(keys, [0, 3], 4, end_step=10)))
    return keys


def _header(key: SigningKey, body: bytes, **over) -> bytes:
    fields = dict(
        job_id="job-bad",
        step=1,
        micro_batch=0,
        carries="activation",
        stage=0,
        to_stage=1,
        sha256=hashlib.sha256(body).hexdigest(),
        size=len(body),
        timestamp=time.time(),
        nonce=new_nonce(),
    )
    fields.update(over)
    return seal(key, RelayHeader(**fields))


def _put(hub: HubThread, sealed: bytes, body: bytes) -> tuple[int, dict, bytes]:
    return _request(
        hub.url,
        "POST",
        {
            "X-GPUFlex-Relay": base64.urlsafe_b64encode(sealed).decode(),
            "Content-Type": "application/octet-stream",
        },
        body,
    )


def _good_body(shape=(BATCH, 32), dtype=torch.float32, fill=0.5) -> bytes:
    return encode_state({"activation": torch.full(shape, fill, dtype=dtype)})


def _refused(hub: HubThread, status: int, code: str, answer: tuple[int, dict, bytes]) -> str:
    got, _, raw = answer
    doc = json.loads(raw)
    assert (got, doc["error"]) == (status, code), doc
    assert "\n" not in doc["detail"] and doc["detail"]
    assert len(hub.relay) == 0 and hub.relay.held_bytes == 0  # nothing kept
    return doc["detail"]


def test_an_unknown_node_is_refused(hub, two) -> None:
    body = _good_body()
    _refused(hub, 401, "unknown_node", _put(hub, _header(SigningKey.generate(), body), body))


def test_a_bad_signature_is_refused(hub, two) -> None:
    body = _good_body()
    sealed = bytearray(_header(two[0], body))
    sealed[-1] ^= 1  # the signature's last byte
    _refused(hub, 401, "bad_signature", _put(hub, bytes(sealed), body))


def test_a_replayed_message_is_refused(hub, two) -> None:
    body = _good_body()
    sealed = _header(two[0], body)
    assert _put(hub, sealed, body)[0] == 200
    taken = RelayTransport(hub.url, two[1], "job-bad", wait_s=0.5).receive(
        MessageKey(1, 0, "activation", 0, 1),
        TensorSpec("activation", "float32", (BATCH, 32)),
        timeout_s=5,
    )
    assert torch.equal(taken, torch.full((BATCH, 32), 0.5))
    _refused(hub, 409, "replay", _put(hub, sealed, body))


def test_a_stage_the_sender_does_not_run_is_refused(hub, two) -> None:
    body = _good_body()
    detail = _refused(hub, 403, "not_your_stage", _put(hub, _header(two[1], body), body))
    assert "does not run stage 0" in detail
    grad = encode_state({"gradient": torch.zeros(BATCH, 32)})
    _refused(
        hub,
        403,
        "not_your_stage",
        _put(hub, _header(two[0], grad, carries="gradient", stage=1, to_stage=0), grad),
    )


def test_a_step_outside_the_plan_is_refused(hub, two) -> None:
    body = _good_body()
    detail = _refused(hub, 403, "not_your_step", _put(hub, _header(two[0], body, step=10), body))
    assert "step 10" in detail


def test_a_message_the_plan_has_no_place_for_is_refused(hub, two) -> None:
    body = _good_body()
    _refused(hub, 400, "not_in_plan", _put(hub, _header(two[0], body, micro_batch=4), body))
    _refused(hub, 400, "not_in_plan", _put(hub, _header(two[0], body, carries="gradient"), body))
    _refused(hub, 400, "not_in_plan", _put(hub, _header(two[0], body, to_stage=2), body))
    _refused(hub, 404, "no_pipeline", _put(hub, _header(two[0], body, job_id="job-none"), body))


@pytest.mark.parametrize(
    ("body", "code", "words"),
    [
        (_good_body(shape=(BATCH, 31)), "bad_tensor", "has shape [8, 31], expected [8, 32]"),
        (_good_body(dtype=torch.float16), "bad_tensor", "has dtype float16, expected float32"),
        (_good_body(fill=float("nan")), "nonfinite", "NaN or infinite"),
        (_good_body(fill=float("inf")), "nonfinite", "NaN or infinite"),
    ],
    ids=["shape", "dtype", "nan", "inf"],
)
def test_a_wrong_tensor_is_refused(hub, two, body: bytes, code: str, words: str) -> None:
    assert words in _refused(hub, 422, code, _put(hub, _header(two[0], body), body))


def test_an_oversize_or_mismatched_body_is_refused(hub, two) -> None:
    big = _good_body(shape=(BATCH, 4096))
    assert "at most" in _refused(hub, 413, "too_large", _put(hub, _header(two[0], big), big))
    body = _good_body()
    _refused(hub, 400, "hash_mismatch", _put(hub, _header(two[0], body), body[:-4] + b"\0\0\0\x01"))
    _refused(hub, 400, "size_mismatch", _put(hub, _header(two[0], body, size=len(body) - 64), body))


def test_a_large_body_is_hashed_and_checked_beside_the_loop(hub) -> None:
    """A body over CHECK_ON_LOOP (hub/server/relay.py) is checked in a thread: the same refusals."""
    from gpuflex.hub.server.relay import CHECK_ON_LOOP

    keys = [register(hub), register(hub)]
    shape = (BATCH, CHECK_ON_LOOP // 4 // BATCH + 16)  # float32: just over the limit
    plan = RelayPlan(
        stages=tuple(k.fingerprint for k in keys),
        boundaries=(Crossing("float32", shape),),
        micro_batches=1,
    )
    hub.call(lambda: hub.relay.registry.assign("job-large", plan))
    body = _good_body(shape=shape)
    assert len(body) > CHECK_ON_LOOP
    bad = body[:-4] + b"\0\0\0\x01"
    _refused(hub, 400, "hash_mismatch", _put(hub, _header(keys[0], body, job_id="job-large"), bad))
    nan = _good_body(shape=shape, fill=float("nan"))
    _refused(hub, 422, "nonfinite", _put(hub, _header(keys[0], nan, job_id="job-large"), nan))
    assert _put(hub, _header(keys[0], body, job_id="job-large"), body)[0] == 200
    taken = RelayTransport(hub.url, keys[1], "job-large", wait_s=0.5).receive(
        MessageKey(1, 0, "activation", 0, 1),
        TensorSpec("activation", "float32", shape),
        timeout_s=5,
    )
    assert torch.equal(taken, torch.full(shape, 0.5))


def test_a_sketch_rides_in_the_header_and_must_match_an_fp32_payload(hub, two) -> None:
    """The sender's sketch of the raw tensor (protocol/stagesketch.py): on an fp32 boundary its
    entries and signed sums are the payload's, or the message is refused (400 bad_sketch) and
    nothing is kept; a malformed one likewise."""
    t = torch.randn(BATCH, 32, generator=torch.Generator().manual_seed(0))
    body = encode_state({"activation": t})
    sketch = encode_sketch(t)
    for bad, words in (
        (encode_sketch(t * (1 + 1e-3)), "does not match its payload"),
        (sketch[:-4] + struct.pack("<f", struct.unpack("<f", sketch[-4:])[0] + 1e-3), "match its"),
        (encode_sketch(t[:, :31]), "covers 248 elements, the tensor has 256"),
        (sketch[:-1], "sketch is refused: a sketch of 62 entries is 1020 bytes, not 1019"),
        (b"GFS2" + struct.pack("<IHH", BATCH * 32, 0, 128), "holds 62 entries, not 0"),
        (b"GFS1" + struct.pack("<II", BATCH * 32, 0), "holds 126 entries, not 0"),
    ):
        detail = _refused(
            hub, 400, "bad_sketch", _put(hub, _header(two[0], body, sketch=bad), body)
        )
        assert words in detail, detail
    assert _put(hub, _header(two[0], body, sketch=sketch), body)[0] == 200
    sealed_b64, got = RelayTransport(hub.url, two[1], "job-bad", wait_s=0.5).fetch(
        MessageKey(1, 0, "activation", 0, 1), timeout_s=5
    )
    hdr, _ = open_sealed(
        base64.urlsafe_b64decode(sealed_b64), RelayHeader, signer=two[0].public_bytes
    )
    assert got == body and hdr.sketch == sketch  # the receiving stage gets it as it was signed


def test_a_sketch_behind_an_encoded_boundary_is_checked_for_its_form_and_whole_rows(hub) -> None:
    keys = [register(hub), register(hub)]
    plan = RelayPlan(
        stages=tuple(k.fingerprint for k in keys),
        boundaries=(Crossing("int8", (BATCH, 36)),),  # int8 rows of 32 values and their scale
        micro_batches=1,
    )
    hub.call(lambda: hub.relay.registry.assign("job-int8", plan))
    body = encode_state({"activation": torch.zeros(BATCH, 36, dtype=torch.int8)})
    odd = encode_sketch(torch.randn(BATCH * 32 + 1))
    detail = _refused(
        hub,
        400,
        "bad_sketch",
        _put(hub, _header(keys[0], body, job_id="job-int8", sketch=odd), body),
    )
    assert "not whole rows of its 8" in detail
    sketch = encode_sketch(torch.randn(BATCH, 32))  # its values are not compared with the wire
    assert _put(hub, _header(keys[0], body, job_id="job-int8", sketch=sketch), body)[0] == 200
    RelayTransport(hub.url, keys[1], "job-int8", wait_s=0.5).fetch(
        MessageKey(1, 0, "activation", 0, 1), timeout_s=5
    )


def test_only_the_receiving_stage_takes(hub, two) -> None:
    take = RelayTake(
        job_id="job-bad",
        step=1,
        micro_batch=0,
        carries="activation",
        stage=0,
        to_stage=1,
        wait_s=0.0,
        timestamp=time.time(),
        nonce=new_nonce(),
    )
    status, _, raw = _request(
        hub.url, "GET", {"X-GPUFlex-Auth": base64.urlsafe_b64encode(seal(two[0], take)).decode()}
    )
    assert (status, json.loads(raw)["error"]) == (403, "not_your_stage")
    status, _, _ = _request(
        hub.url, "GET", {"X-GPUFlex-Auth": base64.urlsafe_b64encode(seal(two[1], take)).decode()}
    )
    assert status == 204


def test_a_refusal_reaches_the_sender_as_one_line(hub, two) -> None:
    transport = RelayTransport(hub.url, two[1], "job-bad")
    with pytest.raises(
        PipelineError,
        match=r"the hub's relay refused the activation of step 1 micro-batch 0 from "
        r"stage 0 to stage 1: 403 not_your_stage: ",
    ) as info:
        transport.send(MessageKey(1, 0, "activation", 0, 1), torch.zeros(BATCH, 32))
    assert "\n" not in str(info.value)


# -- fuzz -----------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_the_relay_endpoint_answers_hostile_input_with_4xx_and_keeps_nothing(
    hub, two, data
) -> None:
    body = _good_body()
    sealed = _header(two[0], body)
    how = data.draw(
        st.sampled_from(
            ["flip_header", "cut_header", "random_header", "flip_body", "random_body", "take"]
        )
    )
    if how == "flip_header":
        raw = bytearray(sealed)
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
        sealed = bytes(raw)
    elif how == "cut_header":
        sealed = sealed[: data.draw(st.integers(0, len(sealed) - 1))]
    elif how == "random_header":
        sealed = data.draw(st.binary(max_size=400))
    elif how == "flip_body":
        raw = bytearray(body)
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
        body = bytes(raw)
    elif how == "random_body":
        body = data.draw(st.binary(max_size=2048))
    if how == "take":
        header = data.draw(st.binary(max_size=300))
        status, _, _ = _request(
            hub.url, "GET", {"X-GPUFlex-Auth": base64.urlsafe_b64encode(header).decode()}
        )
    else:
        status, _, _ = _put(hub, sealed, body)
    assert 400 <= status < 500, (how, status)
    assert len(hub.relay) == 0


# -- the mailboxes ----------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _key(step: int, job: str = "j") -> tuple[str, int, int, str, int, int]:
    return (job, step, 0, "activation", 0, 1)


async def test_a_mailbox_holds_one_message_taken_once() -> None:
    from gpuflex.hub.base.errors import Conflict
    from gpuflex.hub.server.relaybox import Relay

    relay = Relay(clock=Clock())
    relay.put(_key(1), b"h", b"body")
    with pytest.raises(Conflict, match="already holds this message"):
        relay.put(_key(1), b"h", b"other")
    taken = await relay.take(_key(1), 0.0)
    assert taken is not None and taken.body == b"body"
    assert await relay.take(_key(1), 0.0) is None
    assert len(relay) == 0 and relay.held_bytes == 0


async def test_a_waiting_take_wakes_when_the_message_comes() -> None:
    from gpuflex.hub.server.relaybox import Relay

    relay = Relay(clock=Clock())
    waiting = asyncio.ensure_future(relay.take(_key(2), 5.0))
    await asyncio.sleep(0.01)
    relay.put(_key(2), b"h", b"late")
    taken = await asyncio.wait_for(waiting, 1.0)
    assert taken is not None and taken.body == b"late"
    assert await relay.take(_key(3), 0.05) is None  # nothing came: None after the wait


async def test_the_relay_is_bounded_and_forgets_what_nobody_takes() -> None:
    from gpuflex.hub.base.errors import TooManyRequests
    from gpuflex.hub.server.relaybox import Relay

    clock = Clock()
    relay = Relay(max_bytes=100, max_per_job=2, ttl_s=10.0, clock=clock)
    relay.put(_key(1), b"h", b"x" * 40)
    relay.put(_key(2), b"h", b"x" * 40)
    with pytest.raises(TooManyRequests, match="the relay is full"):
        relay.put(_key(3), b"h", b"x")  # the job's 2 messages
    with pytest.raises(TooManyRequests, match="the relay is full"):
        relay.put(_key(1, job="k"), b"h", b"x" * 30)  # 100 bytes in all
    assert len(relay) == 2 and relay.held_bytes == 82
    clock.now += 11
    relay.put(_key(4), b"h", b"y")  # the two expired first
    assert len(relay) == 1 and relay.held_bytes == 2
    assert await relay.take(_key(1), 0.0) is None


async def test_shutdown_answers_a_waiting_take_at_once() -> None:
    from gpuflex.hub.server.relaybox import Relay

    relay = Relay(clock=Clock())
    waiting = asyncio.ensure_future(relay.take(_key(5), 30.0))
    await asyncio.sleep(0.01)
    relay.wake_all()
    assert await asyncio.wait_for(waiting, 1.0) is None
