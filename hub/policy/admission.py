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
  ``ban_cooldown_s`` (403 ``cooldown``).

Re-registering a known identity (a node restarting) is never limited. Pure bookkeeping in
memory, rebuilt from the nodes table at start (hub/domain/ledger/registry.py ``restore``); the
clock is passed in.
"""

from __future__ import annotations

import functools
import ipaddress
from collections import deque
from collections.abc import Iterable

from ..base.config import HubConfig
from ..base.errors import Forbidden, TooManyRequests

__all__ = ["Admission", "address_block"]


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
        self._banned: dict[str, float] = {}  # block or operator -> latest ban time

    @staticmethod
    def _keys(block: str, operator: str | None) -> list[str]:
        return [f"block {block}"] + ([f"operator {operator}"] if operator else [])

    def _trim(self, q: deque[float], now: float) -> None:
        while q and now - q[0] > self._keep_s:
            q.popleft()

    def check(self, block: str, operator: str | None, now: float) -> None:
        """May a NEW identity register from ``block`` under ``operator`` now? Raises if not."""
        for key in self._keys(block, operator):
            banned_at = self._banned.get(key)
            if banned_at is not None and now - banned_at < self.cooldown_s:
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

    def banned(self, blocks: Iterable[str], operator: str | None, at: float) -> None:
        """A node was banned at ``at``: its blocks and operator cool down."""
        for block in blocks:
            key = f"block {block}"
            self._banned[key] = max(at, self._banned.get(key, at))
        if operator:
            key = f"operator {operator}"
            self._banned[key] = max(at, self._banned.get(key, at))
