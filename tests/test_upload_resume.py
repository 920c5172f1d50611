"""Resumable update uploads (issue 17): a home line that drops mid-upload costs only the bytes
that did not arrive. The hub keeps what came, per assignment and update hash (a hub restart
included); the node asks how much (POST /v1/updates/offset) and sends the rest.

The end-to-end test runs the real node process through a TCP relay that cuts the link once,
in the middle of the update's body, and counts every byte the node sent."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time

import aiohttp
import torch
from gpuflex.hub.server.app import drop_stale_partials
from gpuflex.protocol.messages import Ack, Assignment, UploadOffset
from gpuflex.protocol.signing import new_nonce
from gpuflex.protocol.tensors import decode_state, encode_state
from test_node_support import Hub, ProcessEvents, dataset, spec_toml, start_node_process, wait_for

from tests.helpers import MSGPACK, SimNode
from tests.tooling.relay import CuttingRelay

#: an MLP 8-60000-3: a 2.2 MB update, over the hub's 1 MiB in-memory limit (resumable)
WIDE = 60_000


def _large_spec(rounds: int = 1) -> str:
    """A job that never asks the referee (no spot check of trusted work either): the hand-made
    updates here carry no checkpoint commitment, which a job that may ask refuses."""
    return spec_toml(rounds=rounds, epochs=1, hidden=WIDE, chunk_size=256) + "spot_check_trusted = 0.0\n"


async def test_a_node_resumes_an_update_upload_the_line_cut_in_the_middle(tmp_path) -> None:
    torch.set_num_threads(1)
    hub = await Hub(tmp_path / "hub").start()
    relay = await CuttingRelay(hub.port, cut_after=1 << 40).start()
    proc = None
    try:
        job_id = await hub.submit(_large_spec(), dataset(n=256))
        size = len(encode_state({k: torch.zeros(v) for k, v in
                                 {"0.weight": (WIDE, 8), "0.bias": (WIDE,), "2.weight": (3, WIDE),
                                  "2.bias": (3,)}.items()}))
        relay.cut_after = int(0.4 * size)  # the line drops with 40 % of the update's body sent
        proc = start_node_process(tmp_path / "node", relay.url)
        out = ProcessEvents(proc)
        await wait_for(lambda: out.of("uploaded"), timeout=90, step=0.1)
        assert relay.cut, "the relay never cut the upload"
        resumed = out.of("resume")
        assert len(resumed) == 1, out.raw
        assert 0 < resumed[0]["offset"] < size and resumed[0]["size"] == size
        # the long transfer said how far it was: the resumed upload counts from its offset, to the end
        ups = [e for e in out.of("progress") if e["what"] == "upload"]
        assert ups and ups[-1]["bytes"] == ups[-1]["total"] == size and ups[-1]["percent"] == 100.0
        # The node sent the update once, not once and 40 %: what came before the cut stayed.
        assert size < relay.sent_watched < size + (64 << 10), (relay.sent_watched, size)
        await hub.wait_job(job_id, 30)
        async with aiohttp.ClientSession() as s, s.get(hub.url + "/metrics") as r:
            text = await r.text()
        assert "gpuflex_uploads_resumed_total 1" in text
        (row,) = hub.db_rows("SELECT sha, size FROM updates")
        assert row["size"] == size
        blob = (hub.data_dir / "blobs" / row["sha"][:2] / row["sha"]).read_bytes()
        assert hashlib.sha256(blob).hexdigest() == row["sha"]
        assert not list((hub.data_dir / "blobs" / "partial").iterdir())  # moved into place
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        await relay.stop()
        await hub.stop()


async def _post_update(n: SimNode, a: Assignment, blob: bytes, body: bytes, **over) -> aiohttp.ClientResponse:
    hdr = n.update_header(a, blob, 256, 1.0, **over)
    from gpuflex.protocol.signing import seal

    token = base64.urlsafe_b64encode(seal(n.key, hdr)).decode()
    return await n.session.post(n.url + "/v1/updates", data=body, headers={"X-GPUFlex-Update": token})


async def _offset(n: SimNode, a: Assignment, blob: bytes) -> tuple[int, object]:
    from gpuflex.protocol.signing import seal

    hdr = n.update_header(a, blob, 256, 1.0)
    token = base64.urlsafe_b64encode(seal(n.key, hdr)).decode()
    r = await n.session.post(n.url + "/v1/updates/offset", data=b"", headers={"X-GPUFlex-Update": token})
    if r.status != 200:
        return r.status, await r.read()
    return r.status, await n.open_response(r, UploadOffset)


async def _cut_upload(url: str, token: str, blob: bytes, keep: int) -> None:
    """Send the headers and the first ``keep`` bytes of the body, then drop the connection."""
    host, port = url.removeprefix("http://").split(":")
    _reader, writer = await asyncio.open_connection(host, int(port))
    head = (f"POST /v1/updates HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(blob)}\r\n"
            f"Content-Type: application/octet-stream\r\nX-GPUFlex-Update: {token}\r\n\r\n").encode()
    writer.write(head + blob[:keep])
    await writer.drain()
    await asyncio.sleep(0.3)
    writer.transport.abort()


async def test_the_hub_keeps_what_arrived_across_a_restart_and_refuses_a_wrong_offset(tmp_path) -> None:
    """An interrupted upload's bytes survive a hub restart; a resume at any other offset is refused
    in one line (409 offset_mismatch) and changes nothing; an offset past the end is a 400; the
    sweep drops what an assignment that is over left behind."""
    from gpuflex.protocol.signing import seal

    torch.set_num_threads(1)
    hub = await Hub(tmp_path / "hub").start()
    try:
        job_id = await hub.submit(_large_spec(rounds=2), dataset(n=256))
        async with aiohttp.ClientSession() as s:
            n = SimNode(s, hub.url)
            await n.register()
            a = await n.work(2.0)
            assert isinstance(a, Assignment)
            g = decode_state(bytearray(await n.blob(a.model_hash)))
            blob = encode_state({k: torch.full_like(v, 1e-3) for k, v in g.items()})
            assert len(blob) > 1 << 20
            token = base64.urlsafe_b64encode(seal(n.key, n.update_header(a, blob, 256, 1.0))).decode()
            await _cut_upload(hub.url, token, blob, keep=700_000)
            held = await wait_for_offset(n, a, blob, 700_000)
            assert held == 700_000
        await hub.stop()
        hub = await Hub(tmp_path / "hub", port=hub.port, owner_token=hub.owner_token).start()
        async with aiohttp.ClientSession() as s:
            n.session, n.url = s, hub.url
            assert await wait_for_offset(n, a, blob, 700_000) == 700_000
            r = await _post_update(n, a, blob, blob[500_000:], offset=500_000)
            assert (r.status, (await r.json())["error"]) == (409, "offset_mismatch")
            r = await _post_update(n, a, blob, b"", offset=len(blob) + 1)
            assert (r.status, (await r.json())["error"]) == (400, "size_mismatch")
            assert await wait_for_offset(n, a, blob, 700_000) == 700_000  # unchanged by the refusals
            r = await _post_update(n, a, blob, blob[700_000:], offset=700_000)
            assert r.status == 200, await r.text()
            ack = await n.open_response(r, Ack)
            assert ack.ok
            (row,) = hub.db_rows("SELECT sha FROM updates")
            assert row["sha"] == hashlib.sha256(blob).hexdigest()
            # round 1: an upload cut, then the job is cancelled: the sweep drops its bytes
            a2 = await n.work(5.0)
            assert isinstance(a2, Assignment) and a2.round == 1
            token = base64.urlsafe_b64encode(seal(n.key, n.update_header(a2, blob, 256, 1.0))).decode()
            await _cut_upload(hub.url, token, blob, keep=300_000)
            assert await wait_for_offset(n, a2, blob, 300_000) == 300_000
            async with s.post(f"{hub.url}/v1/jobs/{job_id}/cancel",
                              headers={"Authorization": f"Bearer {hub.owner_token}"}) as r:
                assert r.status == 200, await r.text()
            assert await drop_stale_partials(hub.app) == 1
            assert not list((hub.data_dir / "blobs" / "partial").iterdir())
    finally:
        await hub.stop()


async def wait_for_offset(n: SimNode, a: Assignment, blob: bytes, want: int) -> int:
    """The hub's offset once it has closed the interrupted upload (409 busy until then)."""
    deadline = time.monotonic() + 10
    while True:
        status, got = await _offset(n, a, blob)
        if status == 200 and isinstance(got, UploadOffset) and got.offset >= want:
            return got.offset
        assert time.monotonic() < deadline, (status, got)
        await asyncio.sleep(0.05)


__all__ = ["MSGPACK", "new_nonce"]
