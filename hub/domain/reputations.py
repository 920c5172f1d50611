"""The nodes' reputations as the round engine moves them: verification's transitions
(hub/policy/verification.py ``record_*``) worked out on the side, stored with the decision that
caused them, then applied to the nodes in memory."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from ..model.job import JobState, UpdateState
from ..policy import round_policy as policy
from ..policy import verification as vf
from .scheduler import Scheduler


class Reputations:
    """Reads and moves the reputations of the scheduler's nodes. A flag resets a node's run of
    agreements; the store keeps the run with the flag (``runs_before_flags``), so that a flag the
    round withdraws gives it back, across a restart too."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def of(self, ups: Sequence[UpdateState]) -> dict[str, vf.Reputation]:
        """The reputations of the nodes that delivered ``ups``, by node id."""
        now = time.time()
        return {u.node_id: n.reputation_at(now) for u in ups if (n := self.scheduler.nodes.get(u.node_id)) is not None}

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
                 runs: Mapping[str, tuple[str, int]]) -> list[tuple[str, vf.Reputation]]:
        """A withdrawn flag gives the node back the run of agreements it reset
        (verification.record_withdrawn). ``runs``: withdrawn update id -> (node id, the run its
        flag reset), as the store kept them."""
        after = dict(touched)
        for nid, run in runs.values():
            node = self.scheduler.nodes.get(nid)
            if node is not None:
                after[nid] = vf.record_withdrawn(after.get(nid, node.reputation), run)
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
