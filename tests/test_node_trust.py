"""The node refuses forged work: tampered assignment signatures, a hub with the wrong key,
tampered or oversized blobs. It reports and does not train. Real hub over loopback,
a man-in-the-middle proxy for the tampering."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from gpuflex.node.agent import NodeAgent
from gpuflex.node.errors import HubKeyMismatch
from gpuflex.node.identity import check_hub_key
from test_node_support import (
    EventLog,
    Hub,
    TamperProxy,
    agent,
    dataset,
    flip_signature,
    spec_toml,
    wait_for,
)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


async def _run_until(node: NodeAgent, events: EventLog, pred, timeout: float = 20.0):
    import asyncio

    task = asyncio.create_task(node.run())
    try:
        await wait_for(lambda: pred() or task.done(), timeout=timeout)
    finally:
        node.request_exit("test")
        code = await asyncio.wait_for(task, 15)
    return code


def _forge(body: bytes, forger) -> bytes:
    """The hub's own work answer, signed again by ``forger`` but still naming the hub's key."""
    import msgpack
    from gpuflex.protocol.messages import Assignment
    from gpuflex.protocol.signing import open_envelope

    payload, hub_key, _ = open_envelope(body)
    sig = forger.sign(Assignment.KIND, payload)
    return msgpack.packb({"payload": payload, "signer": hub_key, "sig": sig}, use_bin_type=True)


@pytest.mark.parametrize("how", ["flipped_bit", "other_key"])
async def test_forged_assignment_stops_the_node_loudly(tmp_path, how):
    """Work from the hub's address that the pinned key did not sign: someone forges the hub.
    The node stops at once (exit 3, as for a changed hub key), never retries, never downloads."""
    import asyncio

    from gpuflex.protocol.signing import SigningKey

    hub = await Hub(tmp_path / "hub").start()
    await hub.submit(spec_toml(rounds=1), dataset())
    forger = SigningKey.generate()

    def mutate(path: str, body: bytes) -> bytes:
        if path != "/v1/work":
            return body
        return flip_signature(body) if how == "flipped_bit" else _forge(body, forger)

    proxy = await TamperProxy(hub.url, mutate).start()
    try:
        events = EventLog()
        node = agent(tmp_path / "node", proxy.url, events)
        code = await asyncio.wait_for(node.run(), 30)  # no request_exit: it stops by itself
        assert code == 3, events.names()
        fatal = [e for e in events.of("error") if e.get("fatal")]
        assert len(fatal) == 1 and fatal[0]["error"] == "HubForged"
        detail = fatal[0]["detail"]
        assert detail.startswith("REFUSING TO WORK: someone is forging the hub.")
        fpr = events.of("registered")[0]["hub_fingerprint"]
        assert fpr in str(node.fatal) and "hub.pin" in str(node.fatal)
        assert str(node.fatal).startswith(detail)  # the CLI prints it whole on stderr
        assert proxy.seen.count("POST /v1/work") == 1  # not retried
        assert "assignment" not in events.names() and "trained" not in events.names()
        assert not any("/v1/blobs/" in p for p in proxy.seen) and hub.blob_requests() == 0
    finally:
        await proxy.stop()
        await hub.stop()


async def test_tampered_inline_model_is_refused_and_downloaded_instead(tmp_path):
    """A model inside the work answer must hash to the signed model_hash; else it is fetched."""
    import msgpack

    hub = await Hub(tmp_path / "hub").start()
    await hub.submit(spec_toml(rounds=1), dataset())
    tampered: list[int] = []

    def mutate(path: str, body: bytes) -> bytes:
        if path != "/v1/work":
            return body
        unpacker = msgpack.Unpacker()
        unpacker.feed(body)
        unpacker.unpack()
        if unpacker.tell() == len(body):
            return body  # no model inline (NoWork)
        tampered.append(len(body) - unpacker.tell())
        return body[:-1] + bytes([body[-1] ^ 1])

    proxy = await TamperProxy(hub.url, mutate, inline=True).start()
    try:
        events = EventLog()
        node = agent(tmp_path / "node", proxy.url, events, once=True)
        code = await _run_until(node, events, lambda: events.of("uploaded"))
        assert code == 0 and tampered  # the hub did send the model inline
        refused = events.of("inline_model_refused")
        assert refused and "sha256" in refused[0]["detail"]
        assert [e["kind"] for e in events.of("download")].count("model") == 1  # fetched instead
        assert events.of("uploaded")[0]["ok"] is True
    finally:
        await proxy.stop()
        await hub.stop()


async def test_update_called_a_replay_is_signed_again_not_dropped(tmp_path):
    """A hub that restarted an instant ago refuses what was signed before its start: re-sign."""
    from aiohttp import web

    hub = await Hub(tmp_path / "hub").start()
    await hub.submit(spec_toml(rounds=1), dataset())
    refused: list[str] = []

    def intercept(path: str) -> web.Response | None:
        if path == "/v1/updates" and not refused:
            refused.append(path)
            return web.json_response({"error": "replay", "detail": "request was signed before this hub started"},
                                     status=409)
        return None

    proxy = await TamperProxy(hub.url, intercept=intercept).start()
    try:
        events = EventLog()
        node = agent(tmp_path / "node", proxy.url, events, once=True)
        code = await _run_until(node, events, lambda: events.of("uploaded") or events.of("rejected"))
        assert code == 0 and refused
        assert [e.get("action") for e in events.of("error")] == ["sign again"]
        assert events.of("uploaded") and events.of("uploaded")[0]["ok"] is True
        assert not events.of("rejected")
        assert proxy.seen.count("POST /v1/updates") == 2
    finally:
        await proxy.stop()
        await hub.stop()


async def test_wrong_hub_key_refuses_loudly(tmp_path):
    hub = await Hub(tmp_path / "hub").start()
    try:
        events = EventLog()
        node = agent(tmp_path / "node", hub.url, events, hub_key="gf1-aaaa-bbbb-cccc-dddd-eeee")
        code = await node.run()
        assert code == 3
        err = events.of("error")[0]
        assert err["fatal"] and "REFUSING TO WORK" in err["detail"] and "gf1-aaaa" in err["detail"]
        assert "registered" not in events.names()
        assert not (tmp_path / "node" / "hub.pin").exists()
    finally:
        await hub.stop()


async def test_pinned_key_mismatch_after_hub_key_change(tmp_path):
    """Trust on first use: the pin is written once; a hub that later shows another key is refused."""
    hub = await Hub(tmp_path / "hub").start()
    try:
        events = EventLog()
        node = agent(tmp_path / "node", hub.url, events, once=True)
        await _run_until(node, events, lambda: events.of("registered"))
        pin = json.loads((tmp_path / "node" / "hub.pin").read_text())
        assert (tmp_path / "node" / "hub.pin").stat().st_mode & 0o077 == 0
        assert pin["fingerprint"] == events.of("registered")[0]["hub_fingerprint"]
    finally:
        await hub.stop()
    # A different hub (fresh key) on another data dir: the pinned node refuses it.
    other = await Hub(tmp_path / "hub2").start()
    try:
        events = EventLog()
        code = await agent(tmp_path / "node", other.url, events).run()
        assert code == 3
        assert "hub.pin" in events.of("error")[0]["detail"]
    finally:
        await other.stop()


def test_check_hub_key_rejects_a_lying_fingerprint(tmp_path):
    from gpuflex.protocol.signing import SigningKey

    key = SigningKey.generate()
    with pytest.raises(HubKeyMismatch, match="claims fingerprint"):
        check_hub_key(tmp_path, "http://x", key.public_bytes, "gf1-aaaa-aaaa-aaaa-aaaa-aaaa", None)
    pin = check_hub_key(tmp_path, "http://x", key.public_bytes, key.fingerprint, key.fingerprint)
    assert pin.fingerprint == key.fingerprint


@pytest.mark.parametrize("attack", ["flip", "grow"])
async def test_tampered_or_oversized_chunk_is_refused(tmp_path, attack):
    hub = await Hub(tmp_path / "hub").start()
    await hub.submit(spec_toml(rounds=1), dataset())
    blob_gets: list[str] = []

    def mutate(path: str, body: bytes) -> bytes:
        if not path.startswith("/v1/blobs/"):
            return body
        blob_gets.append(path)
        if len(blob_gets) != 2:  # the first blob is the model; tamper with the first chunk
            return body
        tampered_paths.append(path)
        if attack == "flip":
            b = bytearray(body)
            b[-1] ^= 0x55
            return bytes(b)
        return body + b"\0" * 4096

    tampered_paths: list[str] = []  # downloads run concurrently: remember which one was changed
    proxy = await TamperProxy(hub.url, mutate).start()
    try:
        events = EventLog()
        # a generous abandon timeout: the hub must hear of the refusal however busy the loop is
        node = agent(tmp_path / "node", proxy.url, events, abandon_timeout_s=30.0)
        await _run_until(node, events, lambda: events.of("rejected"))
        rejected = events.of("rejected")
        assert rejected, events.names()
        assert (
            ("sha256" in rejected[0]["detail"])
            if attack == "flip"
            else ("larger" in rejected[0]["detail"])
        )
        # The assignment whose chunk was tampered with is never trained on (a later, genuine
        # download of the same shard under a new assignment may be, on a fast machine).
        refused_id = rejected[0]["assignment_id"]
        assert all(e["assignment_id"] != refused_id for e in events.of("trained")), events.names()
        assert all(e["assignment_id"] != refused_id for e in events.of("uploaded")), events.names()
        # Nothing unverified is visible in the cache.
        blobs = list((tmp_path / "node" / "cache" / "blobs").iterdir())
        # A retried, genuine download of the same blob may be cached: what matters is that every
        # cached file is exactly the bytes its name (sha256) promises.
        assert tampered_paths, "the proxy never tampered with a chunk"
        for p in blobs:
            assert hashlib.sha256(p.read_bytes()).hexdigest() == p.name, p
        # The hub was told, so the shard is free again.
        rows = hub.db_rows("SELECT state FROM assignments WHERE id = ?", (refused_id,))
        assert rows and rows[0]["state"] == "abandoned"
    finally:
        await proxy.stop()
        await hub.stop()


async def test_interrupted_download_resumes_with_range(tmp_path):
    """The connection drops half-way through a chunk: the node resumes with Range, verifies the
    whole blob, and trains; the half-received bytes never appear as a cached blob."""
    import aiohttp
    from aiohttp import web

    hub = await Hub(tmp_path / "hub").start()
    await hub.submit(spec_toml(rounds=1, chunk_size=128), dataset())
    ranges: list[str] = []
    cut: set[str] = set()

    async def handler(request: web.Request) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("x-gpuflex-auth", "x-gpuflex-update", "content-type", "range")}
        if "Range" in request.headers:
            ranges.append(request.headers["Range"])
        body = await request.read()
        async with aiohttp.ClientSession() as s, s.request(
            request.method, hub.url + request.path_qs, data=body or None, headers=headers
        ) as r:
            data = await r.read()
            status, ctype = r.status, r.headers.get("Content-Type", "application/octet-stream")
            extra = {"Content-Range": r.headers["Content-Range"]} if "Content-Range" in r.headers else {}
        is_chunk = request.path.startswith("/v1/blobs/") and len(data) > 2000
        if is_chunk and status == 200 and request.path not in cut:
            cut.add(request.path)
            resp = web.StreamResponse(status=200, headers={"Content-Type": ctype})
            resp.content_length = len(data)
            await resp.prepare(request)
            await resp.write(data[: len(data) // 2])
            request.transport.close()  # the line drops mid-body
            return resp
        return web.Response(body=data, status=status, headers={"Content-Type": ctype, **extra})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        events = EventLog()
        code = await agent(tmp_path / "node", url, events, once=True).run()
        assert code == 0 and events.of("uploaded"), [(e["event"], e.get("detail")) for e in events.events]
        assert cut and ranges and all(r.startswith("bytes=") and not r.startswith("bytes=0-") for r in ranges)
        assert len(ranges) == len(cut)  # every cut blob was resumed, not re-fetched from 0
    finally:
        await runner.cleanup()
        await hub.stop()
