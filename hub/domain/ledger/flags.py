"""An auditor's verdict on a flag: the one path for the API and the console. The node's
reputation moves by hub/policy/verification.py ``record_verdict``; the audit log gets its entry
before the verdict is committed."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from ...base.errors import BadRequest, Conflict, NotFound
from ...policy.admission import Admission
from ...policy.suspension import record_verdict
from ...storage.auditlog import AuditLog, verdict_body
from ...storage.store import FlagRecord, Store
from ...storage.tokens import Principal
from ..scheduler import Scheduler
from ..worksignal import WorkSignal

MOOT = "moot: the node was banned after confirmed flags; no verdict is needed"


@dataclass(frozen=True)
class Verdict:
    flag: FlagRecord
    node_banned: bool  # the node is banned now
    banned_by_this_verdict: bool  # ... and this verdict is what banned it


class Flags:
    """Verdicts on open flags, one at a time in this process (a lock), and never twice (the
    store's check, across processes)."""

    def __init__(self, *, store: Store, scheduler: Scheduler, signal: WorkSignal, audit: AuditLog,
                 admission: Admission) -> None:
        self.store = store
        self.scheduler = scheduler
        self.signal = signal
        self.audit = audit
        self.admission = admission
        self._verdicts = asyncio.Lock()

    async def verdict(self, who: Principal, flag_id: str, verdict: str, note: str) -> Verdict:
        """Confirm or dismiss an open flag: the one path for the API and the console.

        Moves the node's reputation (verification.record_verdict; 3 confirmed flags ban it),
        and appends a `verdict` entry to the audit log before the verdict is committed (a crash
        in between leaves an entry for a verdict that can be given again, never a verdict
        without its entry). A verdict that bans the node makes its other open flags moot.
        """
        who.require("auditor")
        if verdict not in ("confirm", "dismiss"):
            raise BadRequest('verdict must be "confirm" or "dismiss"', code="bad_verdict")
        if not isinstance(note, str) or len(note) > 2000:
            raise BadRequest("note must be a string of at most 2000 characters", code="bad_verdict")
        status = "confirmed" if verdict == "confirm" else "dismissed"
        async with self._verdicts:
            flag = await self.store.flag(flag_id)
            if flag is None:
                raise NotFound(f"no flag {flag_id}", code="unknown_flag")
            if flag.status != "open":
                raise Conflict(f"flag {flag_id} already has a verdict ({flag.status})", code="already_decided")
            node = self.scheduler.nodes.get(flag.node_id)
            before = node.reputation if node is not None else None
            after = record_verdict(before, verdict, flag.suspends) if before is not None else None
            newly_banned = bool(after and after.banned and before and not before.banned)
            banned = bool(after and after.banned)
            sha = await self.store.update_sha(flag.update_id)
            await asyncio.to_thread(self.audit.append, "verdict", verdict_body(
                flag_id=flag_id, node_id=flag.node_id, update=sha or flag.update_id, reason=flag.reason,
                verdict=verdict, auditor=who.name, note=note, job_id=flag.job_id, banned=banned,
                **_suspension_note(flag, verdict)))
            decided = await self.store.decide_flag(
                flag_id, status=status, note=note, auditor=who.name, now=time.time(),
                reputation=(flag.node_id, after) if after is not None else None,
                moot_note=MOOT if newly_banned else None)
            if decided is None:  # not under this lock's watch: another process decided it first
                raise Conflict(f"flag {flag_id} already has a verdict", code="already_decided")
            if node is not None and after is not None:
                node.reputation = after
                if newly_banned:  # its block and operator cool down (hub/policy/admission.py)
                    node.banned_at = time.time()
                    self.admission.banned(node.blocks, node.operator, node.banned_at, node.id)
            if node is not None and flag.suspends:  # lifted unless another open flag suspends it
                node.suspended = await self.store.suspension(flag.node_id)
        if newly_banned:
            self.signal.for_node(flag.node_id)  # its long-polls answer "banned" now
        elif flag.suspends:
            self.signal.offer()  # work for it again, when nothing else suspends it
        return Verdict(decided, banned, newly_banned)


def _suspension_note(flag: FlagRecord, verdict: str) -> dict[str, str]:
    """For the audit log: what a verdict does to the suspension its flag holds
    (hub/policy/suspension.py); nothing for a flag that suspends nothing."""
    if not flag.suspends:
        return {}
    return {"suspension": "confirmed: the node is banned" if verdict == "confirm" else "lifted: the flag is dismissed"}
