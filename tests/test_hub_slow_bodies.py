"""Bodies that never come: an update that declares more bytes than the job's model and encoding
can make is refused before its body is read, and a client that sends headers and then nothing
is cut off after the hub's body idle timeout, so it holds nothing (an assignment's upload
included). Real hub, real sockets, raw HTTP written by hand."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import torch
from gpuflex.protocol.messages import Assignment
from gpuflex.protocol.signing import seal
from gpuflex.protocol.tensors import decode_state, encode_state

from tests.helpers import SimNode, b64, start_hub, submit_job

TERABYTE = 1 << 40


async def _assigned(hub, digits_npz, session):
    train, val, spec = digits_npz
    await submit_job(session, hub, spec, train, val)
    node = SimNode(session, hub.url)
    await node.register()
    a = await node.work(0.5)
    assert isinstance(a, Assignment)
    model = decode_state(bytearray(await node.blob(a.model_hash)))
    return node, a, encode_state({k: torch.zeros_like(v) for k, v in model.items()})


async def _open(hub, path: str, headers: dict[str, str], body: bytes = b""):
    """A connection that has sent a request's head (and ``body``, which may be short of its
    Content-Length), then sends nothing more."""
    port = int(hub.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(head.encode() + b"\r\n" + body)
    await writer.drain()
    return reader, writer


async def _response(reader: asyncio.StreamReader) -> tuple[int, dict[str, object]]:
    """The status and JSON body of the answer on ``reader``."""
    status_line = await reader.readline()
    assert status_line.startswith(b"HTTP/1.1 "), status_line
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    return int(status_line.split()[1]), json.loads(await reader.readexactly(length))


def _update_headers(node: SimNode, a: Assignment, blob: bytes, **over: object) -> dict[str, str]:
    hdr = node.update_header(a, blob, 10, 1.0, **over)
    length = over.get("update_size", len(blob))
    return {"X-GPUFlex-Update": b64(seal(node.key, hdr)), "Content-Type": "application/octet-stream",
            "Content-Length": str(length)}


async def test_an_update_declaring_a_terabyte_gets_413_before_any_body(tmp_path, digits_npz):
    hub = await start_hub(tmp_path / "hub")
    try:
        async with aiohttp.ClientSession() as session:
            node, a, good = await _assigned(hub, digits_npz, session)
            reader, writer = await _open(hub, "/v1/updates", _update_headers(node, a, good, update_size=TERABYTE))
            started = time.monotonic()
            try:
                status, doc = await asyncio.wait_for(_response(reader), 1.0)
            finally:
                writer.close()
            took = time.monotonic() - started
            assert status == 413 and doc["error"] == "too_large", doc
            assert str(TERABYTE) in str(doc["detail"]) and "\n" not in str(doc["detail"])
            assert took < 1.0
            # the refusal held nothing: the right update is accepted at once
            await node.upload(a, good, 10, 1.0)
    finally:
        await hub.stop()


async def test_clients_that_send_nothing_are_cut_off_and_hold_no_upload(tmp_path, digits_npz):
    """Eight connections send a request head (one an update's head and half its body) and then
    nothing. While the stalled update holds its assignment a retry is told it is busy; after the
    idle timeout (1 s here) the hub answers 408 and closes every one of them, and the node's
    honest upload of the same update is accepted."""
    hub = await start_hub(tmp_path / "hub", body_idle_timeout_s=1.0)
    try:
        async with aiohttp.ClientSession() as session:
            node, a, good = await _assigned(hub, digits_npz, session)
            stalled = await _open(hub, "/v1/updates", _update_headers(node, a, good), good[: len(good) // 2])
            routes = [("/v1/nodes/register", "application/x-msgpack"), ("/v1/work", "application/x-msgpack"),
                      ("/v1/heartbeat", "application/x-msgpack"), ("/v1/jobs", "multipart/form-data; boundary=B")]
            idle = [await _open(hub, path, {"Content-Length": "4096", "Content-Type": kind,
                                            "Authorization": f"Bearer {hub.owner_token}"})
                    for path, kind in (routes * 2)[:7]]
            await asyncio.sleep(0.2)
            r = await node.upload_raw(node.update_header(a, good, 10, 1.0), good)
            body = await r.json()
            assert r.status == 409 and body["error"] == "duplicate_update", body  # the stalled one holds it
            started = time.monotonic()
            status, doc = await asyncio.wait_for(_response(stalled[0]), 5.0)
            assert status == 408 and doc["error"] == "body_idle", doc
            assert "\n" not in str(doc["detail"])
            for reader, _writer in [stalled, *idle]:
                # answered (408) and closed by the hub: the stream ends
                await asyncio.wait_for(reader.read(), 5.0 - (time.monotonic() - started))
                assert reader.at_eof()
            for _reader, writer in [stalled, *idle]:
                writer.close()
            ack = await node.upload(a, good, 10, 1.0)
            assert ack.ok
    finally:
        await hub.stop()
