"""Model downloads as deltas (issue 17): a node that holds last round's model gets the next one
as a GFD1 delta from it (protocol/blobdelta.py), exact, and checked against the signed
model_hash; a delta is given only from an earlier model of the same job."""

from __future__ import annotations

import asyncio
import base64
import itertools
import os
import time

import torch
from gpuflex.hub.server.appkeys import LEDGER
from gpuflex.protocol.blobdelta import apply_delta, make_delta
from gpuflex.protocol.errors import DecodeError
from gpuflex.protocol.messages import Assignment, BlobRequest
from gpuflex.protocol.signing import new_nonce, seal
from gpuflex.protocol.tensors import encode_state
from hypothesis import given, settings
from hypothesis import strategies as st
from test_node_support import EventLog, Hub, agent, dataset, spec_toml

from tests.helpers import SimNode
from tests.tooling import attacks as atk

WIDE = 60_000  # an 8-60000-3 MLP: a 2.2 MB model, over the 1 MiB that travels inline


def _two_models() -> tuple[bytes, bytes]:
    """Two consecutive digits-MLP models: one round of real training apart."""
    from gpuflex.node.trainer import train_assignment

    torch.set_num_threads(1)
    spec = atk.digits_spec()
    xtr, ytr, _, _ = atk.digits_data()
    g = atk.initial_state(spec)
    res = train_assignment(spec, g, [{"x": xtr[:256], "y": ytr[:256]}], atk.train_config(), 3,
                           device=torch.device("cpu"))
    return bytes(encode_state(g)), bytes(encode_state({k: g[k] + res.delta[k] for k in g}))


def test_a_delta_makes_the_next_model_bit_for_bit_and_smaller() -> None:
    old, new = _two_models()
    delta = make_delta(old, new)
    assert delta is not None and apply_delta(old, delta) == new
    assert len(delta) < len(new) / 1.3  # most high bits stay between rounds
    assert make_delta(old, new[:-4]) is None  # another layout: no delta
    odd = os.urandom(1003)
    assert apply_delta(odd, make_delta(odd, os.urandom(1003)) or b"") != odd


def test_a_bad_delta_is_refused_in_one_line() -> None:
    old, new = _two_models()
    delta = make_delta(old, new)
    assert delta is not None
    for bad, why in ((b"GFD1", "shorter"), (b"XXXX" + delta[4:], "not a GFD1"), (delta[:-10], "stream"),
                     (delta + b"\0" * 9, "stream")):
        try:
            apply_delta(old, bad)
        except DecodeError as exc:
            assert why in str(exc) and "\n" not in str(exc)
        else:
            raise AssertionError(why)
    other = bytearray(old)
    other[100] ^= 1
    try:
        apply_delta(bytes(other), delta)
    except DecodeError as exc:
        assert "another base" in str(exc)
    else:
        raise AssertionError("a delta from another base was applied")


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=300), base=st.binary(min_size=1, max_size=64))
def test_arbitrary_bytes_never_decode_to_anything_but_a_clean_error(data: bytes, base: bytes) -> None:
    try:
        out = apply_delta(base, data)
    except DecodeError as exc:
        assert str(exc).startswith("model delta:") and "\n" not in str(exc)
    else:
        assert len(out) == len(base)  # only a well-formed delta of this very base gets here


async def test_a_node_tries_the_next_model_as_a_delta_from_the_one_it_holds_then_whole(tmp_path) -> None:
    torch.set_num_threads(1)
    hub = await Hub(tmp_path / "hub").start()
    try:
        job_id = await hub.submit(spec_toml(rounds=3, epochs=1, hidden=WIDE, chunk_size=256), dataset(n=256))
        engine = hub.app[LEDGER].rounds
        prepared: list[tuple[str, str]] = []
        made_now = engine.on_new_model
        assert made_now is not None  # the app wires it: a round's delta is made as it publishes the model
        engine.on_new_model = lambda base, new: (prepared.append((base, new)), made_now(base, new))[-1]
        events = EventLog()
        node = agent(tmp_path / "node", hub.url, events)
        task = asyncio.create_task(node.run())
        doc = await hub.wait_job(job_id, 120)
        node.request_exit("test")
        await asyncio.wait_for(task, 15)
        models = [e for e in events.of("download") if e["kind"] == "model"]
        assert len(models) == 3 and "delta_from" not in models[0]  # round 0: nothing to start from
        # round 1: the delta (untimed, it comes first); round 2: the faster of the two as timed
        # (node/modelpath.py, tests/test_model_path.py)
        prev, cur = models[0], models[1]
        assert cur["delta_from"] == prev["sha256"] and cur["bytes"] < cur["model_bytes"] / 1.2, cur
        last = models[2]
        assert last.get("delta_from") == cur["sha256"] or last["bytes"] == models[0]["bytes"], last
        timed = node.transfers.model_path.ways
        assert timed["delta"].s_per_byte is not None and timed["whole"].s_per_byte is not None, timed
        assert [h["round"] for h in doc["history"]] == [0, 1, 2]
        # rounds 0 and 1 published the models rounds 1 and 2 train; the last one trains nothing
        assert prepared == [(prev["sha256"], cur["sha256"]) for prev, cur in itertools.pairwise(models)]
        size = models[0]["bytes"]
        assert doc["history"][1]["transfer"]["bytes_down"] == models[1]["bytes"] < size  # the delta, not the model
    finally:
        await hub.stop()


async def test_a_delta_is_given_only_from_an_earlier_model_of_the_same_job(tmp_path) -> None:
    """From a chunk, an unknown blob or the model itself: 404 no_delta (a delta from a blob the node
    was never sent would hand it that blob); for another node's model: 403 not_assigned."""
    hub = await Hub(tmp_path / "hub").start()
    try:
        await hub.submit(spec_toml(rounds=2, epochs=1, hidden=WIDE, chunk_size=256), dataset(n=256))
        import aiohttp

        async with aiohttp.ClientSession() as s:
            n = SimNode(s, hub.url)
            await n.register()
            a = await n.work(2.0)
            assert isinstance(a, Assignment)

            async def ask(sha: str, base: str, who: SimNode = n) -> tuple[int, str]:
                auth = base64.urlsafe_b64encode(seal(who.key, BlobRequest(sha256=sha, timestamp=time.time(),
                                                                          nonce=new_nonce()))).decode()
                async with s.get(f"{hub.url}/v1/blobs/{sha}/from/{base}", headers={"X-GPUFlex-Auth": auth}) as r:
                    return r.status, (await r.json())["error"] if r.status != 200 else "ok"

            for base in (a.chunks[0].sha256, "0" * 64, a.model_hash):
                assert await ask(a.model_hash, base) == (404, "no_delta")
            assert await ask(a.chunks[0].sha256, a.model_hash) == (404, "no_delta")  # a chunk is no model
            other = SimNode(s, hub.url)
            await other.register()
            assert await ask(a.model_hash, "0" * 64, other) == (403, "not_assigned")
    finally:
        await hub.stop()


async def test_the_hub_makes_each_delta_once_and_keeps_a_bounded_few(tmp_path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from gpuflex.hub.storage.blobs import BlobStore
    from gpuflex.hub.storage.deltas import ModelDeltas

    blobs = BlobStore(tmp_path / "blobs")
    models = [blobs.put(os.urandom(4096)) for _ in range(4)]
    with ThreadPoolExecutor(2) as pool:
        deltas = ModelDeltas(blobs, pool, keep=8, max_bytes=6000)
        made = []
        original = deltas._make
        deltas._make = lambda b, n: made.append((b, n)) or original(b, n)  # type: ignore[method-assign]
        first, again = await asyncio.gather(deltas.get(models[0], models[1]), deltas.get(models[0], models[1]))
        assert first == again and made == [(models[0], models[1])]  # two asks, one delta made
        assert apply_delta(blobs.read(models[0]), first) == blobs.read(models[1])
        await deltas.get(models[1], models[2])
        await deltas.get(models[2], models[3])
        assert list(deltas._made) == [(models[2], models[3])]  # random bytes: ~4 KB each, 6,000 bytes kept at most


async def test_a_delta_is_made_ahead_only_after_the_model_before_went_out_as_a_delta(tmp_path) -> None:
    """hub/storage/deltas.py's ``published``: nodes on fast links take the model whole, and a delta made for
    nobody costs CPU as the round's nodes start training."""
    from concurrent.futures import ThreadPoolExecutor

    from gpuflex.hub.storage.blobs import BlobStore
    from gpuflex.hub.storage.deltas import ModelDeltas

    blobs = BlobStore(tmp_path / "blobs")
    models = [blobs.put(os.urandom(4096)) for _ in range(4)]
    with ThreadPoolExecutor(2) as pool:
        deltas = ModelDeltas(blobs, pool)
        made: list[tuple[str, str]] = []
        original = deltas._make
        deltas._make = lambda b, n: made.append((b, n)) or original(b, n)  # type: ignore[method-assign]
        deltas.published(models[0], models[1])  # round 0's model went out whole: nothing made ahead
        await asyncio.sleep(0.05)
        assert made == []
        await deltas.get(models[0], models[1])  # a node asks anyway: made on demand
        assert made == [(models[0], models[1])]
        deltas.published(models[1], models[2])  # models[1] went out as a delta: the next is made ahead
        for _ in range(100):
            if len(made) == 2:
                break
            await asyncio.sleep(0.01)
        assert made[1] == (models[1], models[2])
        deltas.published(models[2], models[3])  # nobody fetched models[2] as a delta
        await asyncio.sleep(0.05)
        assert len(made) == 2
