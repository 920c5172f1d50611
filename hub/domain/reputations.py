"""The nodes' reputations as the round engine moves them: verification's transitions
(hub/policy/verification.py ``record_*``) worked out on the side, stored with the decision that
caused them, then applied to the nodes in memory."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

from ..model.job import JobState, UpdateState
from ..policy import round_policy as policy
from ..policy import verification as vf
from .scheduler import Scheduler


class Reputations:
    """Reads and moves the reputations of the scheduler's nodes. A flag resets a node's run of
    agreements; the run is remembered here for the round, so that a flag the round withdraws gives
    it back (a hub restarted between the flag and the round's close withdraws it without the run)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        #: update id -> (node id, its run of agreements before the update was flagged at settling)
        self._run_before_flag: dict[str, tuple[str, int]] = {}

    def of(self, ups: Sequence[UpdateState]) -> dict[str, vf.Reputation]:
        """The reputations of the nodes that delivered ``ups``, by node id."""
        now = time.time()
        return {u.node_id: n.reputation_at(now) for u in ups if (n := self.scheduler.nodes.get(u.node_id)) is not None}

    def note_flags(self, flags: Iterable[vf.Flag]) -> None:
        """Remember the run each flag resets, to restore it if the round withdraws the flag."""
        for f in flags:
            if (n := self.scheduler.nodes.get(f.node_id)) is not None:
                self._run_before_flag[f.update_id] = (f.node_id, n.reputation.consecutive_agreements)

    def forget(self, update_ids: Iterable[str]) -> None:
        """The round's flags that stand keep the reset."""
        for uid in update_ids:
            self._run_before_flag.pop(uid, None)

    def after(self, agreed: Sequence[str], flagged: Sequence[str],
              missed: Sequence[str] = ()) -> list[tuple[str, vf.Reputation]]:
        """The nodes' reputations after verification's transitions (memory is not touched)."""
        after: dict[str, vf.Reputation] = {}
        steps = ([(n, vf.record_agreement) for n in agreed] + [(n, vf.record_flag) for n in flagged]
                 + [(n, vf.record_missed) for n in missed])
        for nid, step in steps:
            node = self.scheduler.nodes.get(nid)
            if node is not None:
                after[nid] = step(after.get(nid, node.reputation))
        return list(after.items())

    def withdraw(self, touched: list[tuple[str, vf.Reputation]],
                 withdrawn: Sequence[str]) -> list[tuple[str, vf.Reputation]]:
        """A withdrawn flag gives the node back the run of agreements it reset
        (verification.record_withdrawn)."""
        after = dict(touched)
        for uid in withdrawn:
            seen = self._run_before_flag.pop(uid, None)
            node = self.scheduler.nodes.get(seen[0]) if seen is not None else None
            if seen is not None and node is not None:
                after[seen[0]] = vf.record_withdrawn(after.get(seen[0], node.reputation), seen[1])
        return list(after.items())

    def apply(self, touched: Sequence[tuple[str, vf.Reputation]]) -> None:
        """Memory follows the store: set the reputations already stored."""
        now = time.time()
        for nid, rep in touched:
            node = self.scheduler.nodes.get(nid)
            if node is not None:
                if rep.agreements_total > node.reputation.agreements_total:
                    node.checked_at = now  # its work was checked and agreed: the spot-check clock restarts
                node.reputation = rep

    def vouched(self, job: JobState, reps: Sequence[UpdateState],
                groups: Mapping[str, Sequence[policy.GroupMember]]) -> set[str]:
        """The representatives a trusted node delivered, or agreed with (a redundant member)."""
        v = job.spec.verification

        def trusted(node_id: str) -> bool:
            node = self.scheduler.nodes.get(node_id)
            return node is not None and vf.is_trusted(node.reputation, v)

        return {u.id for u in reps if trusted(u.node_id)
                or any(m.status == "redundant" and trusted(m.node_id) for m in groups.get(u.id, ()))}
