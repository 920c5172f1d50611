"""Node registration and presence: who a node is, where it connects from, and whether the hub
still admits it (hub/policy/admission.py decides a new identity's admission)."""

from __future__ import annotations

import time

from gpuflex.protocol.messages import Hello, nested_to_dict
from gpuflex.protocol.signing import fingerprint
from gpuflex.protocol.version import PROTOCOL_VERSION

from ...base.config import HubConfig
from ...base.errors import Conflict, Forbidden, Unauthorized
from ...model.node import NodeState, clamp_sps, peak_flops
from ...policy.admission import Admission, address_block, lift_target
from ...storage.store import NodeProfile, Store
from ..scheduler import Scheduler

BANNED = "this node is banned from the hub after confirmed flags"


class Registry:
    """The nodes the hub knows: registration (``register``), and the node behind each signed
    request (``known_node``)."""

    def __init__(self, *, config: HubConfig, store: Store, scheduler: Scheduler, admission: Admission) -> None:
        self.config = config
        self.store = store
        self.scheduler = scheduler
        self.admission = admission

    def block_of(self, address: str | None) -> str:
        """The address block of a peer address (hub/policy/admission.py)."""
        return address_block(address, ipv4_prefix=self.config.ipv4_block_prefix,
                             ipv6_prefix=self.config.ipv6_block_prefix)

    def restore(self, node: NodeState, now: float) -> None:
        """A node loaded from the store at start joins the working state, and counts again in
        admission's limits (and, when banned, in its ban cooldown)."""
        self.scheduler.nodes[node.id] = node
        self.scheduler.presence.refresh_probation(node, now)
        self.admission.admitted(node.block, node.operator, node.registered_at)
        if node.banned:
            self.admission.banned(node.blocks, node.operator, node.banned_at or node.last_seen, node.id)

    async def register(self, signer: bytes, hello: Hello, *, address: str | None = None,
                       operator: str | None = None) -> NodeState:
        """Register a node, or refresh a known node's registration. ``address``: the peer address
        the request came from; ``operator``: 'op-<token id>' of a valid enrollment token it gave.
        A NEW identity must pass hub/policy/admission.py (rate limits, probation cap, ban cooldown)."""
        if hello.protocol_version != PROTOCOL_VERSION:
            raise Conflict(f"node speaks protocol {hello.protocol_version}, this hub speaks {PROTOCOL_VERSION};"
                           " upgrade the older side", code="version_mismatch")
        node_id = fingerprint(signer)
        node = self.scheduler.nodes.get(node_id)
        if node is not None and node.banned:
            raise Forbidden(BANNED, code="banned")
        now = time.time()
        block = self.block_of(address)
        if node is None:
            if self.config.require_enrollment and operator is None:
                raise Forbidden("this hub admits nodes only with an enrollment token: ask the hub's operator"
                                " for one and start the node with --enroll-token", code="enrollment_required")
            self.admission.check(block, operator, now, _ip(address))
            self.admission.admitted(block, operator, now)  # before the write: concurrent hellos count
        bench_sps = clamp_sps(hello.benchmark.samples_per_s)
        profile = _profile(hello)
        await self.store.save_node(node_id, signer, profile, bench_sps=bench_sps, now=now, address_block=block,
                                   operator=operator)
        if node is None:
            # the self-reported benchmark only seeds a bounded guess; deliveries set the throughput
            seed = min(bench_sps, self.config.bench_seed_max_sps)
            node = NodeState(id=node_id, public_key=signer, bench_sps=bench_sps, ema_sps=seed, last_seen=now,
                             registered_at=now, block=block, last_block=block, operator=operator)
            self.scheduler.presence.refresh_probation(node, now)
            self.scheduler.nodes[node_id] = node
        # a node registering again from elsewhere (--source-address, another network) is recorded
        # there: replicas keep apart from where it is, not from where it first came from
        node.block = node.last_block = block
        if node.operator is None:
            node.operator = operator
        node.bench_sps = bench_sps
        node.peak_flops = peak_flops(profile.benchmark)
        node.compute = hello.compute
        node.precision_sps = dict(hello.benchmark.precision_sps)
        node.max_memory_bytes = hello.max_memory_bytes
        node.stage_address = hello.stage_address
        node.last_seen = now
        return node

    async def known_node(self, signer: bytes, address: str | None = None) -> NodeState:
        """The registered, unbanned node that signed a request (``address``: where it came from;
        its address block is noted, in the store when it changed, and replicas keep apart from it
        too, and a ban cools it down, after a restart as well)."""
        node = self.scheduler.nodes.get(fingerprint(signer))
        if node is None:
            raise Unauthorized("this node is not registered with the hub; register again", code="unknown_node")
        if node.public_key != signer:
            raise Unauthorized("node key does not match its registration", code="unknown_node")
        if node.banned:
            raise Forbidden(BANNED, code="banned")
        node.last_seen = time.time()
        if address is not None and (block := self.block_of(address)) != node.last_block:
            await self.store.note_block(node.id, block)
            node.last_block = block
        return node


def _ip(address: str | None) -> str | None:
    """A peer address as the operator names it when lifting a cooldown (None: not an IP address)."""
    try:
        return lift_target(address)[0] if address and "/" not in address else None
    except ValueError:
        return None


def _profile(hello: Hello) -> NodeProfile:
    """What the store keeps of a node's self-description: its software, device, benchmark and
    compute class."""
    b = hello.benchmark
    return NodeProfile(
        software_version=hello.software_version,
        device={"kind": hello.device.kind, "name": hello.device.name,
                "memory_bytes": hello.device.memory_bytes, "threads": hello.device.threads,
                "max_memory_bytes": hello.max_memory_bytes, "stage_address": hello.stage_address},
        benchmark={"samples_per_s": b.samples_per_s, "matmul_tflops_fp32": b.matmul_tflops_fp32,
                   "matmul_tflops_bf16": b.matmul_tflops_bf16, "matmul_tflops_fp16": b.matmul_tflops_fp16,
                   "mem_bandwidth_gbs": b.mem_bandwidth_gbs, "h2d_gbs": b.h2d_gbs, "d2h_gbs": b.d2h_gbs,
                   "reference_model": b.reference_model, "precision_sps": dict(b.precision_sps)},
        compute=nested_to_dict(hello.compute))
