"""A node as the hub sees it: a plain state type the whole hub shares (the scheduler places work
on it, the ledger changes it, the store saves it), and the benchmark figures it is built from."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from gpuflex.protocol.compute import class_key, resolve_precision
from gpuflex.protocol.messages import UNKNOWN_CLASS, ComputeClass

from ..policy.stage_speed import StageSpeed
from ..policy.verification import Reputation


@dataclass
class RelayLink:
    """A node's relay takes (``GET /v1/relay``) parked at the hub, and how the last of them ended:
    the hub learns that a stage node is gone when its process dies and the kernel closes its
    connections, rather than by waiting out its silence (hub/domain/pipelines/liveness.py).
    Memory only; on the event loop.

    A take parks (``park``) and ends (``unpark``) answered (a tensor, or none in time) or because
    its client hung up. The node is gone from the moment a hang-up ended the last take it had
    parked, as long as it made no request since (``gone_at``). A live node closes no take while it
    runs a stage; when one of its takes is answered it either asks again or holds what it asked
    for (then it is not gone: the last take ended answered). A stage handed to the node starts a
    fresh link (``NodeState.relay``): the takes parked before, which its last stage closed as it
    ended, count on the old one."""

    parked: int = 0
    #: when a hang-up ended the last take it had parked; None while one is parked, or when the
    #: last ended answered
    hung_up_at: float | None = None

    def park(self) -> None:
        self.parked += 1

    def unpark(self, now: float, *, hung_up: bool) -> None:
        self.parked = max(0, self.parked - 1)
        if self.parked == 0:
            self.hung_up_at = now if hung_up else None

    def gone_at(self, last_seen: float) -> float | None:
        """When the node's relay connections went away: a hang-up ended the last take it had
        parked, none is parked now, and it made no request since (``last_seen``: when its last
        request came). None otherwise."""
        if self.parked or self.hung_up_at is None or self.hung_up_at < last_seen:
            return None
        return self.hung_up_at


@dataclass
class NodeState:
    """A registered node as the hub works with it; its track record is a `Reputation`."""

    id: str
    public_key: bytes
    bench_sps: float
    ema_sps: float
    last_seen: float
    reputation: Reputation = field(default_factory=Reputation)
    updates_accepted: int = 0
    #: the most chunks one of its accepted updates covered (memory only: after a restart the
    #: ramp of chunk_cap starts again from the delivery count)
    proven_chunks: int = 0
    peak_flops: float = 0.0  # from the benchmark: the fastest matmul dtype, FLOP/s
    live: set[str] = field(default_factory=set)  # live assignment ids
    #: the compute class from its hello; its class key depends on a job's precision (class_key)
    compute: ComputeClass = UNKNOWN_CLASS
    precision_sps: dict[str, float] = field(default_factory=dict)  # benchmark: samples/s per precision
    # Sybil defences (hub/policy/admission.py): where it registered from and was last seen, its operator
    registered_at: float = 0.0
    block: str = ""
    last_block: str = ""
    operator: str | None = None
    banned_at: float | None = None
    stall_until: float = 0.0  # after an assignment expired undelivered: no new work before this
    stalls: int = 0  # assignments in a row that expired undelivered (the backoff doubles)
    #: the memory it offers a pipeline stage, from its hello (``--max-memory``; 0: not said)
    max_memory_bytes: int = 0
    #: the round trip of its connection to the hub, a moving average of the kernel's measure
    #: (hub/server/linkmeter.py) taken as it asks for work; 0 until measured. Memory only
    rtt_s: float = 0.0
    #: the rate its bodies come in at (bytes/s), a moving average over the relayed tensors,
    #: checkpoints and updates large enough to time (hub/server/linkmeter.py); 0 until measured.
    #: Memory only
    uplink_bytes_per_s: float = 0.0
    #: "host:port" where it accepts other stages' tensors directly (Hello.stage_address; "":
    #: through the hub's relay only); kept in its device facts
    stage_address: str = ""
    #: why it is suspended (a proven mismatch, hub/policy/suspension.py), None when it is not;
    #: the store keeps it as the open flag that suspends it
    suspended: str | None = None
    #: when an agreement last counted for it (memory only: a restarted hub counts from its start);
    #: how long ago that was raises the rate its trusted work is spot-checked at (hub/policy/spot_checks.py)
    checked_at: float = field(default_factory=time.time)
    #: its speed measured on the pipeline stages it ran (hub/policy/stage_speed.py; memory only:
    #: a restarted hub plans with its benchmark until its stage reports again)
    stage_speed: StageSpeed = field(default_factory=StageSpeed)
    #: its relay takes parked at the hub and how they ended (memory only)
    relay: RelayLink = field(default_factory=RelayLink)

    def reputation_at(self, now: float) -> Reputation:
        """Its reputation as the spot-check policy reads it at ``now``: with ``unchecked_s``."""
        return replace(self.reputation, unchecked_s=max(0.0, now - self.checked_at))

    @property
    def blocks(self) -> set[str]:
        return {b for b in (self.block, self.last_block) if b}

    @property
    def throughput(self) -> float:
        return max(1e-3, self.ema_sps)

    def precision_for(self, requested: str) -> str | None:
        """What this node trains a job asking for ``requested`` in (None: it cannot)."""
        return resolve_precision(self.compute, requested)

    def class_key(self, requested: str) -> str | None:
        """Its compute class key for a job's precision; None for a node that did not say
        (it is placed like any class and always compared strictly)."""
        if self.compute.device_kind == "unknown":
            return None
        return class_key(self.compute, requested)

    def precision_factor(self, precision: str) -> float:
        """Its benchmark's training speed in ``precision`` over fp32 (1 when not measured)."""
        base, this = self.precision_sps.get("fp32"), self.precision_sps.get(precision)
        if not base or not this or not math.isfinite(base) or not math.isfinite(this):
            return 1.0
        return min(100.0, max(0.01, this / base))

    @property
    def banned(self) -> bool:
        return self.reputation.banned

    @property
    def barred(self) -> bool:
        """Banned or suspended: it is given no work."""
        return self.reputation.banned or self.suspended is not None


def peak_flops(benchmark: dict[str, object]) -> float:
    """The fastest matmul throughput a node's benchmark reported, in FLOP/s (0 when unknown)."""
    best = 0.0
    for key in ("matmul_tflops_fp32", "matmul_tflops_bf16", "matmul_tflops_fp16"):
        v = benchmark.get(key)
        if isinstance(v, int | float) and math.isfinite(v) and v > best:
            best = float(v)
    return best * 1e12


def clamp_sps(value: float) -> float:
    if not math.isfinite(value) or value <= 0:
        return 1.0
    return min(value, 1e9)
