"""Who may become a new identity: address blocks, operators, registration limits, ban cooldowns.

Identities cost nothing (a key pair), so replication alone cannot stop one adversary that
runs many of them. The hub ties every node to two things that do cost something:

- its **address block** (IPv4 /24, IPv6 /48 by default; ``HubConfig.ipv4_block_prefix`` /
  ``ipv6_block_prefix``), recorded at registration and refreshed on every request;
- its **operator**: the enrollment token it registered with (``op-<token id>``), when it
  gave one (required with ``HubConfig.require_enrollment``).

Replicas of one shard never go to two nodes that share either (hub/domain/scheduler.py), and
new identities are admitted here, per block, per operator and in all:

- at most ``registrations_per_block`` new identities per block (and per operator) and
  ``registrations_global`` in all per ``registration_window_s`` (429, ``Retry-After``);
- at most ``probation_per_block`` identities of one block (or operator) younger than
  ``trust_min_age_s`` (429): a flood of keys cannot all be earning trust at once;
- after a ban, no new identity from the banned node's block or operator for
  ``ban_cooldown_s`` (403 ``cooldown``). A NAT can put innocent contributors behind the banned
  node's /24, so the operator sees each cooled-down block (``cooldowns``: what remains, and which
  ban caused it) and may lift it for one address or the whole block (``lift``): new identities
  from there are admitted again, until a later ban in that block.

Re-registering a known identity (a node restarting) is never limited. Pure bookkeeping in
memory, rebuilt at start from the nodes table (hub/domain/ledger/registry.py ``restore``: each
node's registered and last-seen blocks, its ban) and the operator's lifts
(hub/domain/ledger/cooldowns.py); the clock is passed in.
"""

from __future__ import annotations

import functools
import ipaddress
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from ..base.config import HubConfig
from ..base.errors import Forbidden, TooManyRequests

__all__ = ["Admission", "Cooldown", "address_block", "lift_target"]


@functools.lru_cache(maxsize=1 << 16)  # every node request asks (7 µs of ipaddress parsing each)
def address_block(address: str | None, *, ipv4_prefix: int = 24, ipv6_prefix: int = 48) -> str:
    """The network a peer address belongs to, as text ("203.0.113.0/24", "2001:db8::/48").

    An IPv4-mapped IPv6 address counts as IPv4. An address that does not parse (a Unix
    socket, a test transport) is its own block, named as given.
    """
    if not address:
        return "unknown"
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return f"other:{address[:64]}"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    prefix = ipv4_prefix if ip.version == 4 else ipv6_prefix
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))


def lift_target(address: str, *, ipv4_prefix: int = 24, ipv6_prefix: int = 48) -> tuple[str, str]:
    """(the canonical address, its block) of what an operator lifts a cooldown for: an IP address
    ("203.0.113.7": that address alone), or a block as ``address_block`` names it ("203.0.113.0/24":
    the whole block). ValueError (one line) for anything else."""
    text = address.strip()
    if "/" in text:
        try:
            net = ipaddress.ip_network(text, strict=False)
        except ValueError:
            raise ValueError(f"{text[:64]!r} is neither an IP address nor an address block") from None
        block = address_block(str(net.network_address), ipv4_prefix=ipv4_prefix, ipv6_prefix=ipv6_prefix)
        if str(net) != block:
            raise ValueError(f"{text[:64]!r} is not an address block as the hub counts them ({block} is)")
        return block, block
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        raise ValueError(f"{text[:64]!r} is neither an IP address nor an address block") from None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), address_block(str(ip), ipv4_prefix=ipv4_prefix, ipv6_prefix=ipv6_prefix)


@dataclass(frozen=True)
class Cooldown:
    """A block or operator cooling down after a ban: ``kind`` "block" | "operator", its ``name``,
    the latest ban there (``banned_at``, of node ``node_id``), when it ends, and the addresses
    the operator lifted it for since (the block's name itself: all of it)."""

    kind: str
    name: str
    banned_at: float
    until: float
    node_id: str
    lifted: tuple[str, ...]

    def remaining_s(self, now: float) -> float:
        return max(0.0, self.until - now)


class Admission:
    """The admission rules of the module docstring over the identities registered so far."""

    def __init__(self, config: HubConfig) -> None:
        self.per_key = max(1, int(config.registrations_per_block))
        self.global_max = max(1, int(config.registrations_global))
        self.window_s = float(config.registration_window_s)
        self.probation_s = float(config.trust_min_age_s)
        self.probation_max = max(1, int(config.probation_per_block))
        self.cooldown_s = float(config.ban_cooldown_s)
        self._keep_s = max(self.window_s, self.probation_s)
        self._recent: dict[str, deque[float]] = {}  # block or operator -> registration times, oldest first
        self._all: deque[float] = deque()
        self._banned: dict[str, tuple[float, str]] = {}  # block or operator -> latest ban (time, node id)
        self._lifted: dict[str, float] = {}  # address or block -> when the operator lifted its cooldown

    @staticmethod
    def _keys(block: str, operator: str | None) -> list[str]:
        return [f"block {block}"] + ([f"operator {operator}"] if operator else [])

    def _trim(self, q: deque[float], now: float) -> None:
        while q and now - q[0] > self._keep_s:
            q.popleft()

    def _cooling(self, key: str, now: float, address: str | None = None) -> float | None:
        """When ``key``'s cooldown began, while it runs and is not lifted (for ``address``)."""
        ban = self._banned.get(key)
        if ban is None or now - ban[0] >= self.cooldown_s:
            return None
        kind, _, name = key.partition(" ")
        lifted = [self._lifted.get(name, -1.0)] if kind == "block" else []
        if kind == "block" and address:
            lifted.append(self._lifted.get(address, -1.0))
        return None if any(t >= ban[0] for t in lifted) else ban[0]

    def check(self, block: str, operator: str | None, now: float, address: str | None = None) -> None:
        """May a NEW identity register from ``block`` (from ``address`` in it) under ``operator``
        now? Raises if not."""
        for key in self._keys(block, operator):
            banned_at = self._cooling(key, now, address)
            if banned_at is not None:
                days = (self.cooldown_s - (now - banned_at)) / 86400
                raise Forbidden(f"a node of this {key.split()[0]} was banned; new identities from it are refused"
                                f" for {days:.1f} more days", code="cooldown")
        self._trim(self._all, now)
        in_window = [t for t in self._all if now - t <= self.window_s]
        if len(in_window) >= self.global_max:
            raise TooManyRequests(f"too many new nodes registered in the last {self.window_s:g} s;"
                                  " try again later", retry_after_s=in_window[0] + self.window_s - now)
        for key in self._keys(block, operator):
            q = self._recent.get(key)
            if not q:
                continue
            self._trim(q, now)
            recent = [t for t in q if now - t <= self.window_s]
            if len(recent) >= self.per_key:
                raise TooManyRequests(f"too many new nodes from this {key.split()[0]} in the last"
                                      f" {self.window_s:g} s; try again later",
                                      retry_after_s=recent[0] + self.window_s - now)
            young = [t for t in q if now - t < self.probation_s]
            if len(young) >= self.probation_max:
                raise TooManyRequests(f"this {key.split()[0]} already has {len(young)} nodes still earning trust;"
                                      " try again later", retry_after_s=young[0] + self.probation_s - now,
                                      code="probation_full")

    def admitted(self, block: str, operator: str | None, at: float) -> None:
        """A new identity registered from ``block`` under ``operator`` at ``at``."""
        for key in self._keys(block, operator):
            q = self._recent.setdefault(key, deque())
            q.append(at)
            if len(q) > 1 and q[-2] > at:  # loading out of order
                self._recent[key] = deque(sorted(q))
        self._all.append(at)
        if len(self._all) > 1 and self._all[-2] > at:
            self._all = deque(sorted(self._all))

    def banned(self, blocks: Iterable[str], operator: str | None, at: float, node_id: str = "") -> None:
        """Node ``node_id`` was banned at ``at``: its blocks and operator cool down (the latest
        ban of a block or operator is the one its cooldown runs from)."""
        keys = [f"block {b}" for b in blocks] + ([f"operator {operator}"] if operator else [])
        for key in keys:
            if key not in self._banned or self._banned[key][0] < at:
                self._banned[key] = (at, node_id)

    def lift(self, address: str, at: float) -> None:
        """The operator lifted the cooldown for ``address`` (an IP address, or a whole block as
        ``address_block`` names it) at ``at``: a ban there after ``at`` cools it down again."""
        self._lifted[address] = max(at, self._lifted.get(address, at))

    def cooldowns(self, now: float) -> list[Cooldown]:
        """Every block and operator cooling down now, the one ending last first (lifted or not)."""
        out = []
        for key, (at, node_id) in self._banned.items():
            if now - at >= self.cooldown_s:
                continue
            kind, _, name = key.partition(" ")
            lifted = tuple(sorted(a for a, t in self._lifted.items() if t >= at and kind == "block"
                                  and (a == name or _in_block(a, name))))
            out.append(Cooldown(kind, name, at, at + self.cooldown_s, node_id, lifted))
        return sorted(out, key=lambda c: (-c.until, c.kind, c.name))


def _in_block(address: str, block: str) -> bool:
    """Is ``address`` (an IP address) inside ``block`` (a network as text)?"""
    try:
        return "/" not in address and ipaddress.ip_address(address) in ipaddress.ip_network(block)
    except ValueError:
        return False
