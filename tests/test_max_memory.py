"""`gpuflex-node run --max-memory`: the size it reads, its default (what the device has free),
and the hello field that carries it to the hub, which keeps it with the node and shows it."""

from __future__ import annotations

import os

import aiohttp
import pytest
import torch
from gpuflex.hub.server.appkeys import LEDGER
from gpuflex.node.cli import main, parse_size
from gpuflex.node.device import free_memory_bytes, offered_memory
from gpuflex.node.errors import NodeError
from gpuflex.node.hostinfo import available_memory_bytes, host_memory_bytes
from gpuflex.protocol.errors import DecodeError
from gpuflex.protocol.messages import (
    MAX_MEMORY_BYTES,
    Hello,
    Welcome,
    decode_message,
    encode_message,
    nested_from_dict,
    nested_to_dict,
)
from gpuflex.protocol.signing import seal

from tests.helpers import SimNode, start_hub


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("2GB", 2 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("2gb", 2 * 10**9),
        (" 3 GB ", 3 * 10**9),
        ("800kB", 800_000),
        ("1TiB", 2**40),
        ("4096B", 4096),
    ],
)
def test_sizes_are_read_in_decimal_and_binary_units(text, size):
    assert parse_size(text, "--max-memory") == size


@pytest.mark.parametrize(
    "text",
    [
        "2",
        "GB",
        "2 GBs",
        "-1GB",
        "0GB",
        "1e3GB",
        "2PB",
        "nanGB",
        "2000TiB",
        "9" * 400 + "GB",
        "",
        "1,5GB",
    ],
)
def test_anything_else_is_one_line_naming_the_flag(text):
    with pytest.raises(NodeError, match=r"^--max-memory ") as info:
        parse_size(text, "--max-memory")
    assert "\n" not in str(info.value) and len(str(info.value)) < 200


def test_a_bad_size_stops_the_node_before_it_starts(capsys):
    code = main(["run", "--hub", "http://127.0.0.1:9", "--max-memory", "2 gigs"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and err.count("\n") == 0
    assert err.startswith("gpuflex-node: error: --max-memory '2 gigs': expected a size like 2GB")


def test_the_default_is_what_the_device_has_free():
    free = free_memory_bytes(torch.device("cpu"))
    assert 0 < free <= host_memory_bytes()
    assert offered_memory(torch.device("cpu"), 2 * 10**9) == 2 * 10**9
    assert 0 < offered_memory(torch.device("cpu"), None) <= host_memory_bytes()
    if os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo", encoding="ascii") as f:
            shown = next(
                int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")
            )
        assert abs(available_memory_bytes() - shown) < host_memory_bytes() // 10


def test_the_hello_field_is_optional_and_bounded():
    node = SimNode(None, "http://unused")
    hello = node.hello(max_memory_bytes=3 << 30)
    assert decode_message(encode_message(hello), Hello).max_memory_bytes == 3 << 30
    wire = nested_to_dict(hello)
    old = {k: v for k, v in wire.items() if k != "max_memory_bytes"}  # a node of an earlier version
    assert nested_from_dict(Hello, old).max_memory_bytes == 0
    for bad in (-1, MAX_MEMORY_BYTES + 1, 1.5, "2GB"):
        with pytest.raises(DecodeError):
            nested_from_dict(Hello, wire | {"max_memory_bytes": bad})


async def _shown(s: aiohttp.ClientSession, hub) -> dict[str, dict]:
    async with s.get(f"{hub.url}/v1/nodes", headers=hub.auth(hub.auditor_token)) as r:
        assert r.status == 200
        return {n["id"]: n for n in (await r.json())["nodes"]}


async def test_the_hub_keeps_and_shows_the_offer_across_a_restart(tmp_path) -> None:
    hub = await start_hub(tmp_path / "hub")
    try:
        async with aiohttp.ClientSession() as s:
            node = SimNode(s, hub.url)
            async with s.get(hub.url + "/v1/hub") as r:
                node.hub_public = bytes.fromhex((await r.json())["public_key"])
            resp = await node.post(
                "/v1/nodes/register", seal(node.key, node.hello(max_memory_bytes=2 * 10**9))
            )
            await node.open_response(resp, Welcome)
            legacy = SimNode(s, hub.url)
            await legacy.register()
            shown = await _shown(s, hub)
            assert shown[node.node_id]["device"]["max_memory_bytes"] == 2 * 10**9
            assert shown[legacy.node_id]["device"]["max_memory_bytes"] == 0
            live = hub.app[LEDGER].scheduler.nodes
            assert (
                live[node.node_id].max_memory_bytes == 2 * 10**9
                and live[legacy.node_id].max_memory_bytes == 0
            )
        tokens = {"owner": hub.owner_token, "auditor": hub.auditor_token, "admin": hub.admin_token}
    finally:
        await hub.stop()
    hub = await start_hub(tmp_path / "hub", tokens=tokens)
    try:
        async with aiohttp.ClientSession() as s:
            assert (await _shown(s, hub))[node.node_id]["device"]["max_memory_bytes"] == 2 * 10**9
            assert hub.app[LEDGER].scheduler.nodes[node.node_id].max_memory_bytes == 2 * 10**9
    finally:
        await hub.stop()


async def _registered(tmp_path, hub, name: str, **kw) -> dict:
    """A real NodeAgent registers with ``hub`` (then stops); the node as GET /v1/nodes shows it."""
    import asyncio

    from tests.test_node_support import EventLog, agent, wait_for

    events = EventLog()
    node = agent(tmp_path / name, hub.url, events, **kw)
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(node.run())
        try:
            await wait_for(lambda: events.of("registered") or task.done())
        finally:
            node.request_exit("test")
    async with aiohttp.ClientSession() as s:
        return (await _shown(s, hub))[events.of("registered")[0]["node_id"]]


async def test_a_real_node_sends_its_flag_or_what_its_device_has_free(tmp_path) -> None:
    hub = await start_hub(tmp_path / "hub")
    try:
        capped = await _registered(tmp_path, hub, "capped", max_memory_bytes=512 * 2**20)
        assert capped["device"]["max_memory_bytes"] == 512 * 2**20
        free = await _registered(tmp_path, hub, "free")
        assert 0 < free["device"]["max_memory_bytes"] <= host_memory_bytes()
    finally:
        await hub.stop()
