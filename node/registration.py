"""Joining a hub: check its key against the pin, then a signed hello with the benchmark and
the compute class, then a link probe for the hub to time this node's uplink.

The hub's key is checked (and pinned on first use) before anything is sent; from then on
every answer must verify with that key. The welcome must name this node under the pinned
hub fingerprint, or the answer is treated as not coming from the hub.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import torch
from gpuflex.protocol.messages import (
    LINK_PROBE_BYTES,
    Ack,
    Benchmark,
    ComputeClass,
    DeviceInfo,
    Hello,
    LinkProbe,
)
from gpuflex.protocol.signing import new_nonce, seal
from gpuflex.protocol.version import PROTOCOL_VERSION, SOFTWARE_VERSION

from .client import HubClient
from .device import compute_class, describe
from .errors import HubError
from .identity import HubPin, check_hub_key


async def register(
    client: HubClient,
    *,
    data_dir: Path,
    hub_url: str,
    expected_hub_key: str | None,
    node_id: str,
    device: torch.device,
    benchmark: Benchmark,
    compute: ComputeClass | None = None,
    enroll_token: str = "",
    max_memory_bytes: int = 0,
    stage_address: str = "",
) -> HubPin:
    """Register with the hub at ``client``; the pinned hub key (the client now trusts it).
    ``max_memory_bytes``: the memory this node offers a pipeline stage (--max-memory; 0: not said);
    ``stage_address``: where it takes other stages' tensors directly (--stage-listen; "": none)."""
    public_key, claimed, proto = await client.hub_info()
    pin = check_hub_key(data_dir, hub_url, public_key, claimed, expected_hub_key)
    if proto != PROTOCOL_VERSION:
        raise HubError(
            f"hub speaks protocol {proto}, this node {PROTOCOL_VERSION}; upgrade the older side",
            code="version_mismatch",
        )
    client.hub_public_key = pin.public_key
    d = describe(device)
    hello = Hello(
        software_version=SOFTWARE_VERSION[:64], protocol_version=PROTOCOL_VERSION,
        device=DeviceInfo(kind=d.kind, name=d.name[:256], memory_bytes=d.memory_bytes, threads=d.threads),
        benchmark=benchmark, timestamp=time.time(), nonce=new_nonce(),
        compute=compute if compute is not None else compute_class(device), enroll_token=enroll_token,
        max_memory_bytes=max_memory_bytes, stage_address=stage_address,
    )
    welcome = await client.register(hello)
    if welcome.node_id != node_id or welcome.hub_fingerprint != pin.fingerprint:
        raise HubError(
            f"hub welcomed {welcome.node_id} under {welcome.hub_fingerprint}; expected "
            f"{node_id} under {pin.fingerprint}", code="bad_answer",
        )
    return pin


__all__ = ["probe_link", "register"]


async def probe_link(client: HubClient, size: int = LINK_PROBE_BYTES) -> Ack:
    """POST /v1/nodes/probe: ``size`` random bytes for the hub to time this node's uplink, what a
    pipeline plan takes as its link (the Ack's detail says the rate the hub measured)."""
    body = os.urandom(size)
    msg = LinkProbe(
        sha256=hashlib.sha256(body).hexdigest(), size=size, timestamp=client.now(), nonce=new_nonce()
    )
    return await client._post_sealed(
        "/v1/nodes/probe", "X-GPUFlex-Auth", seal(client.key, msg), body, "link probe"
    )
