"""A ban's cooldown of address blocks and operators, as the hub's operator sees and lifts it.

A banned node's /24 (IPv6 /48) cools down for ``ban_cooldown_s``: no new identity registers from
it (hub/policy/admission.py). A NAT can hide innocent contributors behind that block, so the
operator lists what cools down (``cooldowns``: the block, the time left, the ban that caused it)
and lifts it for one address or the whole block (``lift``). A lift is written to the audit log
first, then to the store (so a restarted hub keeps it), then applied; a later ban in the block
cools it down again."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ...base.config import HubConfig
from ...base.errors import BadRequest, Conflict
from ...policy.admission import Admission, lift_target
from ...storage.auditlog import AuditLog
from ...storage.store import CooldownLift, Store
from ...storage.tokens import Principal


class Cooldowns:
    """The blocks and operators cooling down after a ban, and the operator's lifts of them."""

    def __init__(
        self, *, config: HubConfig, store: Store, audit: AuditLog, admission: Admission
    ) -> None:
        self.config = config
        self.store = store
        self.audit = audit
        self.admission = admission
        self._lifts = asyncio.Lock()

    def restore(self, lifts: list[CooldownLift]) -> None:
        """The lifts the store kept, at start."""
        for lift in lifts:
            self.admission.lift(lift.address, lift.lifted_at)

    def cooldowns(self, who: Principal) -> list[dict[str, Any]]:
        """What cools down now, the one ending last first: kind (block | operator), name, the ban
        that caused it (node, time), when it ends, the seconds left, and the addresses lifted."""
        who.require("admin")
        now = time.time()
        return [
            {
                "kind": c.kind,
                "name": c.name,
                "node_id": c.node_id,
                "banned_at": c.banned_at,
                "until": c.until,
                "remaining_s": round(c.remaining_s(now), 1),
                "lifted": list(c.lifted),
            }
            for c in self.admission.cooldowns(now)
        ]

    async def lift(self, who: Principal, address: str, note: str) -> dict[str, Any]:
        """Lift the cooldown for ``address`` (an IP address, or a block as listed). Refused in
        one line when it is neither, or when no ban's cooldown covers it now."""
        who.require("admin")
        if not isinstance(address, str) or not address or len(address) > 100:
            raise BadRequest(
                "address must be an IP address or an address block", code="bad_address"
            )
        if not isinstance(note, str) or len(note) > 2000:
            raise BadRequest("note must be a string of at most 2000 characters", code="bad_address")
        try:
            target, block = lift_target(
                address,
                ipv4_prefix=self.config.ipv4_block_prefix,
                ipv6_prefix=self.config.ipv6_block_prefix,
            )
        except ValueError as exc:
            raise BadRequest(str(exc), code="bad_address") from None
        async with self._lifts:
            now = time.time()
            cooling = {c.name: c for c in self.admission.cooldowns(now) if c.kind == "block"}
            if block not in cooling:
                raise Conflict(
                    f"no ban's cooldown covers {target} (its block {block} is not cooling down)",
                    code="not_cooling",
                )
            cause = cooling[block]
            await asyncio.to_thread(
                self.audit.append,
                "cooldown_lift",
                {
                    "address": target,
                    "block": block,
                    "banned_node": cause.node_id,
                    "banned_at": cause.banned_at,
                    "until": cause.until,
                    "by": who.name,
                    "note": note,
                },
            )
            await self.store.lift_cooldown(CooldownLift(target, now, who.name, note))
            self.admission.lift(target, now)
        return {
            "address": target,
            "block": block,
            "lifted_at": now,
            "banned_node": cause.node_id,
            "until": cause.until,
        }
