"""Which flags suspend a node at once: a proven mismatch only.

A node whose own committed segment the referee re-executed and found not to reproduce within
its class tolerance (``referee_mismatch``; a forged error-feedback residual chain is one too) is
suspended the moment the flag is written, and so is a pipeline stage whose forward or backward on
a micro-batch the referee re-executed from its durable state and found not to reproduce
(``stage_mismatch``, hub/policy/stage_check.py): it gets no further assignment, its pending updates are
held out of aggregation, and its flags come first in the auditor's queue. An auditor lifts the
suspension by dismissing the flag, or confirms it, which bans the node.

Nothing short of proof suspends: a node that did not hand its states over (``unverifiable``),
could not be reached, disagreed with a replica, scored as an outlier, or agreed with a mismatching
replica without being re-executed itself (it vouched: ``vouched_for`` in the evidence) is only
flagged. Honest nodes reproduce their segments, so they are never suspended.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from . import reputation
from .reputation import Reputation
from .update_record import Flag

#: the flag reasons that can suspend: a re-executed segment, a re-executed pipeline stage
PROVEN_MISMATCH = "referee_mismatch"
STAGE_MISMATCH = "stage_mismatch"


def suspends(reason: str, evidence: Mapping[str, Any]) -> bool:
    """Does a flag with this reason and evidence suspend its node?"""
    return reason in (PROVEN_MISMATCH, STAGE_MISMATCH) and "vouched_for" not in evidence


def flag_suspends(flag: Flag) -> bool:
    return suspends(flag.reason, flag.evidence)


def why(reason: str, update_id: str) -> str:
    """What a suspended node and its readers are told."""
    if reason == STAGE_MISMATCH:
        return (
            f"suspended: {reason} on {update_id} (its stage's work did not reproduce); an auditor"
            " lifts or confirms it"
        )
    return (
        f"suspended: {reason} on update {update_id} (its committed segment did not reproduce);"
        " an auditor lifts or confirms it"
    )


def record_verdict(rep: Reputation, verdict: str, suspending: bool) -> Reputation:
    """An auditor's verdict (reputation.record_verdict); confirming a flag that suspends the node
    bans it at once: the proof is the re-execution, the auditor's confirm makes it final."""
    after = reputation.record_verdict(rep, verdict)
    return replace(after, banned=True) if suspending and verdict == "confirm" else after
