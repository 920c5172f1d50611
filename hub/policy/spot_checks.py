"""How often a trusted node's work is re-executed: trust that decays.

Trust saves a node the replica, never every check (``[verification] spot_check_trusted``, the base
rate). A node that earned trust and then forges is caught over its life at that rate, so the rate
rises where a forger would hide:

- for a node whose work has gone unchecked for a while (``unchecked_s``, the time since an
  agreement last counted for it): its agreements age out, and after ``spot_check_stale_s`` the
  rate has doubled (1 + unchecked_s / spot_check_stale_s);
- for a short record: a node that has only just reached ``trust_after`` agreements in a row is
  checked at twice the base rate, falling to the base rate at twice ``trust_after``
  (1 + (2 * trust_after - run) / trust_after, clipped to [1, 2]).

The two factors multiply and are capped at ``MAX_FACTOR`` times the base rate, so the
verification budget a job sets with ``spot_check_trusted`` holds within that bound: a node that
keeps being checked (every check that agrees resets its clock) costs about the base rate.

Pure: the hub passes in how long each node has gone unchecked (``Reputation.unchecked_s``).
"""

from __future__ import annotations

from gpuflex.protocol.jobspec import VerificationSpec

from .reputation import Reputation

#: the most a trusted node's rate rises over ``spot_check_trusted``
MAX_FACTOR = 4.0


def trusted_rate(reputation: Reputation, spec: VerificationSpec) -> float:
    """The spot-check rate of work a trusted node with this record did (the module docstring)."""
    base = float(spec.spot_check_trusted)
    if base <= 0.0:
        return 0.0
    stale_s = float(spec.spot_check_stale_s)
    stale = 1.0 + (reputation.unchecked_s / stale_s if stale_s > 0 else 0.0)
    trust_after = max(1, int(spec.trust_after))
    short = 1.0 + min(1.0, max(0.0, (2 * trust_after - reputation.consecutive_agreements) / trust_after))
    return min(1.0, base * min(MAX_FACTOR, stale * short))
