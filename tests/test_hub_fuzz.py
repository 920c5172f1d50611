"""Hypothesis fuzz of the node-facing endpoints with mutated signed messages (bounded: 200 examples).

The hub runs in a background thread with its own event loop; the test talks to it
with a plain blocking HTTP client so hypothesis drives plain functions.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import threading
import time
from urllib.parse import urlsplit

import pytest
from gpuflex.protocol.messages import (
    Abandon,
    Benchmark,
    BlobRequest,
    Commitment,
    DeviceInfo,
    Heartbeat,
    Hello,
    LinkProbe,
    SiloQuery,
    SiloRegistration,
    SiloWithdrawal,
    StageReport,
    StateUnavailable,
    StateUpload,
    UnitCheckpoint,
    UpdateHeader,
    WorkRequest,
)
from gpuflex.protocol.signing import SigningKey, new_nonce, seal
from gpuflex.protocol.version import PROTOCOL_VERSION
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from tests.helpers import start_hub


@pytest.fixture(scope="module")
def hub_thread(tmp_path_factory):
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box = {}

    def run():
        asyncio.set_event_loop(loop)
        box["hub"] = loop.run_until_complete(start_hub(tmp_path_factory.mktemp("fuzzhub"), long_poll_max_s=0.0))
        started.set()
        loop.run_forever()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(60)
    hub = box["hub"]
    key = SigningKey.generate()
    conn = _conn(hub.url)
    status, _ = _post(conn, "/v1/nodes/register", seal(key, _hello()))
    assert status == 200
    yield hub, key
    asyncio.run_coroutine_threadsafe(hub.stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    t.join(10)


def _conn(url):
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)


def _post(conn, path, body, headers=None):
    conn.request("POST", path, body=body, headers={"Content-Type": "application/x-msgpack", **(headers or {})})
    r = conn.getresponse()
    return r.status, r.read()


def _hello():
    return Hello(software_version="0.1.0", protocol_version=PROTOCOL_VERSION,
                 device=DeviceInfo(kind="cpu", name="fuzz", memory_bytes=1, threads=1),
                 benchmark=Benchmark(samples_per_s=100.0, matmul_tflops_fp32=0.1, matmul_tflops_bf16=None,
                                     matmul_tflops_fp16=None, mem_bandwidth_gbs=1.0, h2d_gbs=None, d2h_gbs=None,
                                     reference_model="x"),
                 timestamp=time.time(), nonce=new_nonce())


def _message(kind: str):
    now = time.time()
    if kind == "register":
        return "/v1/nodes/register", _hello()
    if kind == "work":
        return "/v1/work", WorkRequest(timestamp=now, nonce=new_nonce(), wait_s=0.0, cached_chunks=("a" * 64,))
    if kind == "heartbeat":
        return "/v1/heartbeat", Heartbeat(assignment_id="a-1", progress=0.5, timestamp=now, nonce=new_nonce())
    if kind == "abandon":
        return "/v1/abandon", Abandon(assignment_id="a-1", reason="x", timestamp=now, nonce=new_nonce())
    if kind == "blob":
        return "/v1/blobs/" + "a" * 64, BlobRequest(sha256="a" * 64, timestamp=now, nonce=new_nonce())
    if kind == "silo_schema":
        return "/v1/silos/schema", SiloQuery(job_id="j-1", timestamp=now, nonce=new_nonce())
    if kind == "silo":
        return "/v1/silos", SiloRegistration(job_id="j-1", sha256="e" * 64, size=4096, samples=10, timestamp=now,
                                             nonce=new_nonce(), label_histogram=(5, 5))
    if kind == "silo_withdrawal":
        return "/v1/silos/withdraw", SiloWithdrawal(job_id="j-1", sha256="e" * 64, timestamp=now, nonce=new_nonce())
    if kind == "state_unavailable":
        return "/v1/states/unavailable", StateUnavailable(request_id="sr-1", steps=(0, 3), reason="pruned",
                                                          timestamp=now, nonce=new_nonce())
    if kind == "stage_report":
        return "/v1/pipeline/report", StageReport(job_id="j-1", generation=1, stage=0, steps_done=1, step_s=0.1,
                                                  compute_s=0.1, loss=2.0, failed="", timestamp=now,
                                                  nonce=new_nonce())
    if kind == "unit_checkpoint":
        return "/v1/pipeline/checkpoint", UnitCheckpoint(job_id="j-1", generation=1, stage=0, unit=0, step=2,
                                                         sha256="c" * 64, size=4, timestamp=now, nonce=new_nonce())
    if kind == "link_probe":
        return "/v1/nodes/probe", LinkProbe(sha256="c" * 64, size=4, timestamp=now, nonce=new_nonce())
    if kind == "state":
        return "/v1/states", StateUpload(request_id="sr-1", step=3, state_sha256="c" * 64, state_size=4,
                                         timestamp=now, nonce=new_nonce())
    commitment = None if kind == "update" else Commitment(every=2, steps=4, precision="fp32",
                                                             hashes=("d" * 64,) * 3, norms=(0.1, 0.2))
    return "/v1/updates", UpdateHeader(assignment_id="a-1", update_sha256="b" * 64, update_size=4, sample_count=1,
                                       metrics={"loss": 1.0}, timings={"train_s": 1.0}, timestamp=now,
                                       nonce=new_nonce(), commitment=commitment)


mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10_000), st.just(0)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=64), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 10_000), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("random"), st.binary(max_size=512), st.just(0)),
)


def _mutate(data: bytes, m) -> bytes:
    op, a, b = m
    if op == "flip":
        i = a % len(data)
        return data[:i] + bytes([data[i] ^ b]) + data[i + 1:]
    if op == "truncate":
        return data[: a % len(data)]
    if op == "append":
        return data + a
    if op == "insert":
        i = a % len(data)
        return data[:i] + b + data[i:]
    return a


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["register", "work", "heartbeat", "abandon", "blob", "update", "update_committed",
                             "update_offset", "state", "state_unavailable", "silo_schema", "silo", "silo_withdrawal",
                             "stage_report", "unit_checkpoint", "link_probe"]),
       m=mutation)
def test_mutated_signed_messages_get_clean_4xx(hub_thread, kind, m):
    hub, key = hub_thread
    path, msg = _message(kind)
    data = _mutate(seal(key, msg), m)
    conn = _conn(hub.url)
    try:
        if kind == "blob":
            conn.request("GET", path, headers={"X-GPUFlex-Auth": base64.urlsafe_b64encode(data).decode()})
            r = conn.getresponse()
            status, body = r.status, r.read()
        elif kind in ("update", "update_committed"):
            status, body = _post(conn, path, b"\x00" * 4,
                                 {"X-GPUFlex-Update": base64.urlsafe_b64encode(data).decode()})
        elif kind == "update_offset":
            status, body = _post(conn, "/v1/updates/offset", b"",
                                 {"X-GPUFlex-Update": base64.urlsafe_b64encode(data).decode()})
        elif kind == "state":
            status, body = _post(conn, path, b"\x00" * 4,
                                 {"X-GPUFlex-State": base64.urlsafe_b64encode(data).decode()})
        elif kind in ("unit_checkpoint", "link_probe"):
            status, body = _post(conn, path, b"\x00" * 4,
                                 {"X-GPUFlex-Auth": base64.urlsafe_b64encode(data).decode()})
        else:
            status, body = _post(conn, path, data)
    finally:
        conn.close()
    # a mutation can never produce a valid new message: always a clean client error
    assert 400 <= status < 500, (status, body[:200])
    doc = json.loads(body)
    assert set(doc) == {"error", "detail"} and doc["detail"] and "\n" not in doc["detail"]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request_id=st.text("abcdefghij0123456789-_", min_size=1, max_size=64), step=st.integers(0, 1 << 40),
       sha=st.text("0123456789abcdef", min_size=64, max_size=64), size=st.integers(0, 1 << 40),
       body=st.binary(max_size=256))
def test_validly_signed_hostile_state_uploads_get_clean_4xx(hub_thread, request_id, step, sha, size, body):
    """POST /v1/states with a correctly signed header naming anything: never a 5xx, never stored."""
    hub, key = hub_thread
    hdr = StateUpload(request_id=request_id, step=step, state_sha256=sha, state_size=size, timestamp=time.time(),
                      nonce=new_nonce())
    conn = _conn(hub.url)
    try:
        status, raw = _post(conn, "/v1/states", body,
                            {"X-GPUFlex-State": base64.urlsafe_b64encode(seal(key, hdr)).decode()})
    finally:
        conn.close()
    assert 400 <= status < 500, (status, raw[:200])
    doc = json.loads(raw)
    assert set(doc) == {"error", "detail"} and "\n" not in doc["detail"]
    assert doc["error"] == "unknown_request"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.binary(min_size=1, max_size=80), value=st.binary(max_size=200))
def test_arbitrary_multipart_part_headers_get_clean_4xx(hub_thread, header, value):
    """Any bytes in a job submission's part header (control characters, NUL, no colon, a
    bare CR) are refused with a 4xx JSON line or by the HTTP parser, never a 500."""
    hub, _ = hub_thread
    body = b"--B\r\n" + header + b": " + value + b"\r\n\r\nx\r\n--B--\r\n"
    conn = _conn(hub.url)
    try:
        conn.request("POST", "/v1/jobs", body=body, headers={
            "Content-Type": "multipart/form-data; boundary=B", "Authorization": f"Bearer {hub.owner_token}"})
        r = conn.getresponse()
        status, raw = r.status, r.read()
    finally:
        conn.close()
    assert 400 <= status < 500, (status, raw[:200])
    if r.getheader("Content-Type", "").startswith("application/json"):
        doc = json.loads(raw)
        assert set(doc) == {"error", "detail"} and "\n" not in doc["detail"]


SILO_SPEC = b"""[job]
name = "fuzz-silos"
[model]
kind = "mlp"
input = 4
hidden = [4]
outputs = 3
[data]
source = "node-local"
min_samples = 5
max_samples = 100
label_histogram = true
"""


@pytest.fixture(scope="module")
def silo_job(hub_thread):
    hub, _ = hub_thread
    boundary = "fuzzsilo"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"spec\"; filename=\"s.toml\"\r\n"
            "Content-Type: application/toml\r\n\r\n").encode() + SILO_SPEC + f"\r\n--{boundary}--\r\n".encode()
    conn = _conn(hub.url)
    conn.request("POST", "/v1/jobs", body=body, headers={
        "Content-Type": f"multipart/form-data; boundary={boundary}", "Authorization": f"Bearer {hub.owner_token}"})
    r = conn.getresponse()
    doc = json.loads(r.read())
    assert r.status == 201, doc
    return doc["id"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(samples=st.one_of(st.integers(0, 120), st.integers(0, 1 << 40)), data=st.data(),
       sha=st.text("0123456789abcdef", min_size=64, max_size=64))
def test_signed_silo_registrations_with_any_fields_are_refused_cleanly_or_attached(hub_thread, silo_job, samples,
                                                                                   data, sha):
    """A correctly signed SiloRegistration for a node-local job, with any values: a clean 4xx that
    attaches nothing, or a 200 for a silo the schema allows (5..100 samples of 4 floats and a label,
    3 label counts that sum to them when sent)."""
    from gpuflex.hub.domain.jobs import silo_size_bounds
    from gpuflex.hub.server.appkeys import LEDGER

    hub, _ = hub_thread
    row = 4 * 4 + 8  # 4 float32 features and an int64 label
    size = data.draw(st.one_of(st.integers(0, 1 << 40), st.integers(samples * row - 2, samples * row + 300)))
    a, b = sorted(data.draw(st.lists(st.integers(0, samples), min_size=2, max_size=2)))
    counts = [a, b - a, samples - b]  # three label counts that sum to the sample count
    histogram = data.draw(st.one_of(st.just([]), st.lists(st.integers(0, 1 << 40), max_size=6), st.just(counts)))
    key = SigningKey.generate()  # a fresh node each time: no earlier silo to replace
    conn = _conn(hub.url)
    try:
        assert _post(conn, "/v1/nodes/register", seal(key, _hello()))[0] == 200
        msg = SiloRegistration(job_id=silo_job, sha256=sha, size=size, samples=samples, timestamp=time.time(),
                               nonce=new_nonce(), label_histogram=tuple(histogram))
        status, body = _post(conn, "/v1/silos", seal(key, msg))
    finally:
        conn.close()
    job = hub.app[LEDGER].scheduler.jobs[silo_job]
    lo, hi = silo_size_bounds(job.spec.model, samples)
    allowed = (5 <= samples <= 100 and lo <= size <= hi
               and (not histogram or (len(histogram) == 3 and sum(histogram) == samples)))
    event(f"status {status}")
    if status == 200:
        assert allowed and job.silo_of.get(key.fingerprint) is not None
        return
    assert 400 <= status < 500, (status, body[:200])
    doc = json.loads(body)
    assert set(doc) == {"error", "detail"} and "\n" not in doc["detail"]
    assert key.fingerprint not in job.silo_of
    assert not allowed or doc["error"] == "silo_taken"  # the same blob id drawn twice


def _query_operations() -> list[tuple[str, str, str]]:
    """(METHOD, path template, query parameter) for every query parameter the OpenAPI document lists."""
    from gpuflex.hub.server.openapi import openapi_document

    return [(method.upper(), path, p["name"])
            for path, ops in openapi_document()["paths"].items() for method, op in ops.items()
            for p in op.get("parameters", ()) if p.get("in") == "query"]


QUERY_OPERATIONS = _query_operations()
#: characters that ``str.isdigit`` (or ``int``) takes for digits although they are not 0-9
NOT_ASCII_DIGITS = "²³¹⁰₀₉①٠١٢٣۴߀०১๑༡၁០᠑１𝟎𝟗"
query_values = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=30),  # any unicode (no lone surrogates)
    st.text(NOT_ASCII_DIGITS + "0123456789", min_size=1, max_size=12),
    st.integers(-(1 << 70), 1 << 70).map(str),
    st.sampled_from(["", " 1", "1 ", "+1", "1_000", "0x10", "1e3", "\uff11", "1.0", "-0", "9" * 40]),
)


def test_every_documented_query_parameter_is_fuzzed():
    assert {(p, n) for _m, p, n in QUERY_OPERATIONS} >= {("/v1/jobs/{job_id}/model", "round"),
                                                         ("/v1/flags", "status"), ("/v1/flags", "job")}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(op=st.sampled_from(QUERY_OPERATIONS), value=query_values)
@example(op=("GET", "/v1/jobs/{job_id}/model", "round"), value="\u00b2")  # "²".isdigit(), int("²") raises
def test_any_query_parameter_value_gets_an_answer_or_a_one_line_4xx(hub_thread, silo_job, op, value):
    """Every query parameter of every documented operation, with any unicode value, asked with an
    admin token (so the parameter is read): a 2xx, or a 4xx with a one-line JSON error; never a 5xx."""
    from urllib.parse import quote

    hub, _ = hub_thread
    method, template, name = op
    path = template.replace("{job_id}", silo_job).replace("{flag_id}", "f-nope")
    conn = _conn(hub.url)
    try:
        conn.request(method, f"{path}?{quote(name)}={quote(value, safe='')}",
                     headers={"Authorization": f"Bearer {hub.admin_token}"})
        r = conn.getresponse()
        status, raw = r.status, r.read()
    finally:
        conn.close()
    event(f"{template} {status}")
    assert status < 500, (status, value, raw[:300])
    if status >= 400:
        doc = json.loads(raw)
        assert set(doc) == {"error", "detail"} and doc["detail"] and "\n" not in doc["detail"], doc
    if template.endswith("/model") and value.isascii() and value.isdigit() and int(value) == 0:
        assert status == 200, raw[:300]


# -- a pipelined job's stage endpoints, against a live generation ------------------------------------


@pytest.fixture(scope="module")
def pipeline_world(tmp_path_factory):
    """A 2-stage generation of a pipelined job: the fuzzing node runs stage 0."""
    from tests.pipeline_hub import HubThread, poll_until, register, submit
    from tests.test_hub_pipeline import SPEC

    where = tmp_path_factory.mktemp("fuzzpipeline")
    hub = HubThread(where / "hub", stage_timeout_s=3600.0)
    keys = [register(hub.url) for _ in range(2)]
    code, job = submit(hub, where, SPEC.format(stages=2, steps=8, every=2))
    assert code == 201, job
    got = poll_until(hub, keys)
    first = next(i for i, sa in enumerate(got) if sa.stage == 0)
    yield hub, keys[first], got[first]
    hub.stop()


def _pipeline_rows(hub) -> tuple[int, int]:
    from tests.helpers import open_store

    conn = open_store(hub.hub.data_dir)
    try:
        return (conn.execute("SELECT COUNT(*) FROM unit_states").fetchone()[0],
                conn.execute("SELECT committed_step FROM pipelines").fetchone()[0])
    finally:
        conn.close()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(generation=st.sampled_from([1, 2, 1 << 31]), stage=st.integers(0, 3), unit=st.integers(0, 4),
       step=st.integers(1, 12), sha=st.none() | st.text("0123456789abcdef", min_size=64, max_size=64),
       size_delta=st.integers(-3, 3), body=st.binary(max_size=300))
def test_validly_signed_hostile_checkpoints_get_clean_4xx_and_keep_nothing(pipeline_world, generation, stage, unit,
                                                                            step, sha, size_delta, body):
    """POST /v1/pipeline/checkpoint, signed by the stage's own node, naming anything with any body."""
    from tests.pipeline_hub import send_checkpoint

    hub, key, sa = pipeline_world
    size = max(0, len(body) + size_delta)
    status, raw = send_checkpoint(hub.url, key, sa, unit, step, body, sha=sha, size=size, generation=generation,
                                  stage=stage)
    assert 400 <= status < 500, (status, raw[:200])
    doc = json.loads(raw)
    assert set(doc) == {"error", "detail"} and doc["detail"] and "\n" not in doc["detail"]
    event(doc["error"])
    assert _pipeline_rows(hub) == (0, 0)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(job=st.sampled_from(["own", "j-1"]), generation=st.sampled_from([1, 2, 1 << 31]), stage=st.integers(0, 3),
       steps_done=st.integers(0, 1 << 40), step_s=st.floats(0.0, 1e6), loss=st.none() | st.floats(0.0, 1e30))
def test_validly_signed_hostile_reports_are_refused_in_one_line_or_acknowledged(pipeline_world, job, generation,
                                                                                stage, steps_done, step_s, loss):
    """POST /v1/pipeline/report, signed by the stage's own node, naming anything: a 4xx in one line, or
    a sealed Ack for a report of its own stage (recorded only then); the generation stays."""
    from gpuflex.hub.server.appkeys import LEDGER

    from tests.pipeline_hub import ack_of, send_report

    hub, key, sa = pipeline_world
    status, raw = send_report(hub.url, key, sa, steps_done, loss=loss, generation=generation, stage=stage,
                              job_id=sa.job_id if job == "own" else job)
    if status == 200:
        ack = ack_of(hub, raw)
        assert ack.ok == (generation == sa.generation and job == "own"), ack
        event(f"ack ok={ack.ok}")
    else:
        assert 400 <= status < 500, (status, raw[:200])
        doc = json.loads(raw)
        assert set(doc) == {"error", "detail"} and "\n" not in doc["detail"]
        event(doc["error"])
    live = hub.call(lambda: hub.hub.app[LEDGER].pipelines.jobs[sa.job_id].generation)
    assert live is not None and live.number == sa.generation
