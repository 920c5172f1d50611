"""Bad input of every kind gets a 4xx JSON {"error", "detail"} and changes nothing."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import time

import aiohttp
import msgpack
import numpy as np
import pytest
import torch
from gpuflex.protocol.messages import Assignment, Hello, WorkRequest
from gpuflex.protocol.signing import SigningKey, new_nonce, seal
from gpuflex.protocol.tensors import decode_state, encode_state

from tests.helpers import MSGPACK, SimNode, b64, digits_spec, open_store, stored_blobs, submit_job


def count(hub, table):
    conn = open_store(hub.data_dir)
    try:
        return conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
    finally:
        conn.close()


async def expect(resp, status, error=None):
    body = await resp.json(content_type=None)
    assert resp.status == status, body
    assert set(body) == {"error", "detail"} and "\n" not in body["detail"]
    if error is not None:
        assert body["error"] == error, body
    return body


async def test_bad_signed_messages(running_hub):
    url = running_hub.url
    async with aiohttp.ClientSession() as s:
        node = SimNode(s, url)
        post = node.post
        await expect(await post("/v1/nodes/register", b"\x00garbage"), 400, "bad_message")
        await expect(
            await post("/v1/nodes/register", msgpack.packb({"payload": b"x"})), 400, "bad_message"
        )
        sealed = seal(node.key, node.hello())
        forged = bytearray(sealed)
        forged[20] ^= 0x01  # inside the payload
        await expect(await post("/v1/nodes/register", bytes(forged)), 401, "bad_signature")
        other = SigningKey.generate()
        env = msgpack.unpackb(sealed)
        env["signer"] = other.public_bytes  # claims another key
        await expect(
            await post("/v1/nodes/register", msgpack.packb(env, use_bin_type=True)),
            401,
            "bad_signature",
        )
        # a validly signed Hello sent where a WorkRequest is expected: the domain differs
        await expect(await post("/v1/work", seal(node.key, node.hello())), 401, "bad_signature")
        old = seal(node.key, node.hello(protocol_version=99))
        await expect(await post("/v1/nodes/register", old), 409, "version_mismatch")
        stale = seal(node.key, node.hello(timestamp=time.time() - 3600))
        await expect(await post("/v1/nodes/register", stale), 409, "replay")
        req = WorkRequest(timestamp=time.time(), nonce=new_nonce(), wait_s=0.0, cached_chunks=())
        await expect(await post("/v1/work", seal(node.key, req)), 401, "unknown_node")
        good = seal(node.key, node.hello())
        assert (await post("/v1/nodes/register", good)).status == 200
        await expect(await post("/v1/nodes/register", good), 409, "replay")
        big = b"\x00" * (2 << 20)
        await expect(await post("/v1/work", big), 413)
        hb = await node.heartbeat("a-doesnotexist")
        await expect(hb, 404, "unknown_assignment")
    assert count(running_hub, "nodes") == 1


async def test_bad_blob_requests(running_hub):
    async with aiohttp.ClientSession() as s:
        node = SimNode(s, running_hub.url)
        await node.register()
        for bad in ("zz", "A" * 64, "0" * 63, "..%2f..%2fhub.key"):
            async with s.get(
                f"{running_hub.url}/v1/blobs/{bad}", headers=node.blob_auth("0" * 64)
            ) as r:
                await expect(r, 400 if "%" not in bad else r.status)
        sha = "a" * 64
        async with s.get(f"{running_hub.url}/v1/blobs/{sha}") as r:
            await expect(r, 401, "missing_auth")
        async with s.get(
            f"{running_hub.url}/v1/blobs/{sha}", headers={"X-GPUFlex-Auth": "!!!"}
        ) as r:
            await expect(r, 400, "bad_message")
        async with s.get(
            f"{running_hub.url}/v1/blobs/{sha}", headers=node.blob_auth("b" * 64)
        ) as r:
            await expect(r, 400, "blob_mismatch")
        async with s.get(f"{running_hub.url}/v1/blobs/{sha}", headers=node.blob_auth(sha)) as r:
            await expect(r, 403, "not_assigned")


@pytest.fixture
async def assigned(running_hub, digits_npz):
    """A hub with a job, a registered node and its live assignment."""
    train, val, spec = digits_npz
    s = aiohttp.ClientSession()
    await submit_job(s, running_hub, spec, train, val)
    node = SimNode(s, running_hub.url)
    await node.register()
    a = await node.work(0.5)
    assert isinstance(a, Assignment)
    model = decode_state(bytearray(await node.blob(a.model_hash)))
    try:
        yield node, a, model
    finally:
        await s.close()


def zero_delta(model):
    return {k: torch.zeros_like(v) for k, v in model.items()}


async def test_bad_updates_are_refused_and_nothing_is_stored(running_hub, assigned):
    node, a, model = assigned
    blobs_before = set(stored_blobs(running_hub.data_dir))

    async def up(blob, status, error, **over):
        hdr = node.update_header(a, blob, 10, 1.0, **over)
        await expect(await node.upload_raw(hdr, blob), status, error)

    good = encode_state(zero_delta(model))
    wrong = zero_delta(model)
    wrong["2.bias"] = wrong["2.bias"].to(torch.int32)  # same size, wrong dtype
    await up(encode_state(wrong), 422, "bad_manifest")
    wrong = zero_delta(model)
    wrong["0.weight"] = torch.zeros(2, 2)
    await up(encode_state(wrong), 422, "bad_manifest")
    nan = zero_delta(model)
    nan["0.bias"][0] = float("nan")
    await up(encode_state(nan), 422, "non_finite")
    await up(good, 422, "hash_mismatch", update_sha256="0" * 64)
    await up(good, 400, "size_mismatch", update_size=len(good) - 1)
    await up(b"\x00" * (len(good) + 64), 422, "bad_manifest")  # no GFT1 header at all
    await up(padded_blob(good, 64), 413, "too_large")  # the model's tensors, and more bytes
    await up(b"GFT1" + b"\x00" * (len(good) - 4), 422, "bad_manifest")
    # headers
    r = await node.session.post(node.url + "/v1/updates", data=good)
    await expect(r, 401, "missing_auth")
    r = await node.session.post(
        node.url + "/v1/updates", data=good, headers={"X-GPUFlex-Update": "%%%"}
    )
    await expect(r, 400, "bad_message")
    stranger = SimNode(node.session, node.url)
    await stranger.register()
    hdr = stranger.update_header(a, good, 10, 1.0)
    await expect(await stranger.upload_raw(hdr, good), 403, "not_your_assignment")
    hdr = node.update_header(a, good, 10, 1.0, assignment_id="a-unknown")
    await expect(await node.upload_raw(hdr, good), 404, "unknown_assignment")
    sealed = seal(node.key, node.update_header(a, good, 10, 1.0))
    await node.upload_raw(sealed, good)  # accepted
    await expect(await node.upload_raw(sealed, good), 409, "replay")
    assert count(running_hub, "updates") == 1
    assert set(stored_blobs(running_hub.data_dir)) - blobs_before == {hashlib.sha256(good).hexdigest()}
    async with node.session.get(f"{running_hub.url}/metrics") as r:
        text = await r.text()
    assert 'gpuflex_updates_rejected_total{reason="bad_manifest"} 4' in text
    assert "gpuflex_updates_accepted_total 1" in text


def padded_blob(blob: bytes, extra: int) -> bytes:
    """The same GFT1 tensors with `extra` unused bytes after the data (a valid blob whose
    manifest is the model's but which is larger than the model)."""
    import struct

    magic, version, flags, hlen, reserved = struct.unpack_from("<4sHHII", blob)
    header = msgpack.unpackb(blob[16 : 16 + hlen])
    data = blob[-header["data_bytes"] :] if header["data_bytes"] else b""
    header["data_bytes"] += extra
    packed = msgpack.packb(header, use_bin_type=True)
    head = struct.pack("<4sHHII", magic, version, flags, len(packed), reserved) + packed
    head += b"\x00" * (-len(head) % 64)
    return head + data + b"\x00" * extra


async def test_extra_or_renamed_tensor_is_a_bad_manifest_naming_it(running_hub, assigned):
    """An update of another model: one larger than any of this job's can be is refused 413 before
    its body is read, with the job's tensors listed; one that could be this job's by its size (a
    renamed tensor, a small extra one) is read and refused 422 bad_manifest naming the tensor."""
    node, a, model = assigned

    async def up(blob, status=422, code="bad_manifest"):
        hdr = node.update_header(a, blob, 10, 1.0)
        return await expect(await node.upload_raw(hdr, blob), status, code)

    extra = zero_delta(model) | {"extra.weight": torch.zeros(4, 4)}  # within the header's slack: read
    body = await up(encode_state(extra))
    assert "'extra.weight'" in body["detail"] and "not part of the model" in body["detail"]
    wide = zero_delta(model) | {"extra.weight": torch.zeros(64, 64)}
    body = await up(encode_state(wide), 413, "too_large")
    assert "0.weight [" in body["detail"] and "larger than any update" in body["detail"]
    renamed = zero_delta(model)
    renamed["0.weight_renamed"] = renamed.pop("0.weight")
    body = await up(encode_state(renamed))
    assert "'0.weight_renamed'" in body["detail"] and "'0.weight'" in body["detail"]
    bigger = zero_delta(model)
    bigger["2.bias"] = torch.zeros(bigger["2.bias"].numel() + 100)
    body = await up(encode_state(bigger), 413, "too_large")
    assert "2.bias [10] float32" in body["detail"]
    assert count(running_hub, "updates") == 0
    # the assignment is still live: the right update is accepted after all that
    good = encode_state(zero_delta(model))
    await node.upload(a, good, 10, 1.0)
    assert count(running_hub, "updates") == 1


def npz_bytes(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


async def test_bad_job_submissions(running_hub, tmp_path):
    x = np.random.default_rng(0).random((100, 64), dtype=np.float32)
    y = np.arange(100) % 10
    spec = digits_spec(rounds=1)
    cases = [
        ("[job\nname=", npz_bytes(x=x, y=y), 422, "bad_spec"),
        (spec.replace('kind = "mlp"', 'kind = "rnn"'), npz_bytes(x=x, y=y), 422, "bad_spec"),
        (spec + "\n[bogus]\nkey = 1\n", npz_bytes(x=x, y=y), 422, "bad_spec"),
        # a strategy this hub's code does not have (hub/policy/strategy.py's registry)
        (spec + '\n[aggregation]\nstrategy = "not_on_this_hub"\n', npz_bytes(x=x, y=y), 422, "bad_spec"),
        (spec, npz_bytes(x=np.array([object()] * 100, dtype=object), y=y), 422, "bad_dataset"),
        (spec, npz_bytes(x=x[:, :10], y=y), 422, "bad_shape"),
        (spec, npz_bytes(x=x, y=y[:50]), 422, "bad_dataset"),
        (spec, npz_bytes(x=np.where(np.eye(100, 64) > 0, np.nan, x), y=y), 422, "non_finite"),
        (spec, npz_bytes(x=x, y=y + 5), 422, "bad_labels"),
        (spec, npz_bytes(x=x, y=y + 0.5), 422, "bad_dataset"),
        (spec, npz_bytes(a=x), 422, "bad_dataset"),
        (spec, b"PK\x03\x04 not really a zip", 422, "bad_dataset"),
        (spec, b"label\nnot-a-number\n", 422, "bad_dataset"),
        (spec, b"\xff\xfe\x00binary", 422, "bad_dataset"),
    ]
    async with aiohttp.ClientSession() as s:
        for i, (spec_text, train_bytes, status, error) in enumerate(cases):
            path = tmp_path / f"t{i}.bin"
            path.write_bytes(train_bytes)
            r = await submit_job(s, running_hub, spec_text, path)
            body = await expect(r, status, error)
            if "not_on_this_hub" in spec_text:
                assert "this hub has no strategy 'not_on_this_hub'" in body["detail"]
        headers = running_hub.auth()
        async with s.post(f"{running_hub.url}/v1/jobs", data=b"{}", headers=headers) as r:
            await expect(r, 400, "bad_form")
        form = aiohttp.FormData()
        form.add_field("spec", spec.encode(), filename="spec.toml")
        async with s.post(f"{running_hub.url}/v1/jobs", data=form, headers=headers) as r:
            await expect(r, 400, "bad_form")
        form = aiohttp.FormData()
        form.add_field("spec", spec.encode(), filename="spec.toml")
        form.add_field("weights", b"x", filename="w.bin")
        async with s.post(f"{running_hub.url}/v1/jobs", data=form, headers=headers) as r:
            await expect(r, 400, "bad_form")
        for path in ("/v1/jobs/j-nope", "/v1/jobs/j-nope/model", "/v1/flags/f-nope"):
            async with s.get(running_hub.url + path, headers=headers) as r:
                await expect(r, 404)
        async with s.get(f"{running_hub.url}/v1/jobs/j-nope/model?round=-1", headers=headers) as r:
            await expect(r, 400, "bad_round")
        async with s.get(f"{running_hub.url}/v1/nowhere") as r:
            await expect(r, 404, "not_found")
        async with s.delete(f"{running_hub.url}/v1/jobs") as r:
            await expect(r, 405)
    assert count(running_hub, "jobs") == 0
    assert count(running_hub, "chunks") == 0
    assert list((running_hub.data_dir / "blobs" / "tmp").iterdir()) == []


async def test_hello_field_changes_are_refused_after_signing(running_hub):
    """Changing any field of a signed message invalidates it (the hub verifies the exact bytes)."""
    async with aiohttp.ClientSession() as s:
        node = SimNode(s, running_hub.url)
        hello = node.hello()
        sealed = msgpack.unpackb(seal(node.key, hello))
        payload = msgpack.unpackb(sealed["payload"])
        payload["software_version"] = "9.9.9"
        sealed["payload"] = msgpack.packb(payload, use_bin_type=True)
        r = await node.post("/v1/nodes/register", msgpack.packb(sealed, use_bin_type=True))
        await expect(r, 401, "bad_signature")
    _ = dataclasses, Hello, b64, MSGPACK


CONTROL_HEADERS = [
    b'Content-Disposition: form-data; name="spec\x00"',
    b'Content-Disposition: form-data; name="spec"\x01x',
    b'Content-Disposition: form-data; name="sp\x07ec"',
    b"X-Part\x00: 1",
    b"Content-Disposition: form-data; name=spec\x0b",
    b"Content-Type: text/\x7fplain",
    b"Content-Disposition: form-data; name=\"spec\"\r\n\x00",
]


@pytest.mark.parametrize("part_header", CONTROL_HEADERS, ids=range(len(CONTROL_HEADERS)))
async def test_control_characters_in_a_part_header_are_a_4xx_with_one_line(
    running_hub, part_header, caplog
):
    body = b"--BOUND\r\n" + part_header + b"\r\n\r\n[job]\r\n--BOUND--\r\n"
    headers = {**running_hub.auth(), "Content-Type": "multipart/form-data; boundary=BOUND"}
    with caplog.at_level("WARNING"):
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{running_hub.url}/v1/jobs", data=body, headers=headers) as r:
                doc = await expect(r, 400, "bad_form")
    assert doc["detail"].isprintable()
    assert not [rec for rec in caplog.records if rec.exc_info or rec.levelname == "ERROR"]
    assert count(running_hub, "jobs") == 0


async def test_a_broken_chunked_body_is_a_4xx_not_a_500(running_hub, caplog):
    """A handler reading a body that aiohttp's parser refuses half-way (bad chunk size)."""
    import asyncio

    port = int(running_hub.url.rsplit(":", 1)[1])
    with caplog.at_level("WARNING"):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/flags/f-x/verdict HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: Bearer {running_hub.auditor_token}\r\n".encode()
            + b"Transfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n"
            + b"5\r\n{\"ver\r\nzz\r\nxx\r\n0\r\n\r\n"
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.read(4096), 10)
        writer.close()
    status = int(head.split(b" ", 2)[1])
    assert 400 <= status < 500, head[:300]
    assert not [rec for rec in caplog.records if rec.exc_info or rec.levelname == "ERROR"]


async def test_an_undocumented_query_parameter_is_refused(running_hub):
    """?rounds=0 (a typo for ?round=0) must not silently mean "the latest model"."""
    auth = running_hub.auth(running_hub.auditor_token)
    async with aiohttp.ClientSession() as s:
        for path, headers in (
            ("/v1/jobs/j-x/model?rounds=0", running_hub.auth()),
            ("/v1/flags?state=open", auth),
            ("/v1/nodes?all=1", auth),
            ("/v1/hub?x=1", {}),
        ):
            async with s.get(running_hub.url + path, headers=headers) as r:
                body = await expect(r, 400, "bad_query")
            assert repr(path.split("?")[1].split("=")[0]) in body["detail"]
        async with s.get(f"{running_hub.url}/v1/flags?status=open&job=j-x", headers=auth) as r:
            assert r.status == 200


async def test_a_body_that_arrives_in_pieces_is_read_whole(running_hub):
    """On a real line a request body spans TCP segments that arrive apart (a lost segment is
    sent again a round trip later). The hub must read the whole body, not what has arrived so
    far: found by the bandwidth bench over a 30 ms, 0.1%-loss home line, where every node's
    `POST /v1/work` came back "malformed msgpack (incomplete input)"."""
    import asyncio
    import socket
    from urllib.parse import urlsplit

    async with aiohttp.ClientSession() as s:
        node = SimNode(s, running_hub.url)
        body = seal(node.key, node.hello())
    host, port = urlsplit(running_hub.url).hostname, urlsplit(running_hub.url).port
    reader, writer = await asyncio.open_connection(host, port)
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = (f"POST /v1/nodes/register HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/x-msgpack\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    writer.write(head + body[:40])
    await writer.drain()
    await asyncio.sleep(0.3)  # the rest a while later, as a retransmitted segment would come
    writer.write(body[40:])
    await writer.drain()
    response = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert response.startswith(b"HTTP/1.1 200"), response[:300]
