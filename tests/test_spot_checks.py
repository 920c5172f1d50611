"""Spot checks of trusted work with trust that decays (hub/policy/spot_checks.py): the rate rises
for a short record and for work unchecked for a while, within a bound, and an agreement that
counts restarts a node's clock."""

from __future__ import annotations

import dataclasses

import pytest
from gpuflex.hub.domain.reputations import Reputations
from gpuflex.hub.model.node import NodeState
from gpuflex.hub.policy import round_policy as policy
from gpuflex.hub.policy.reputation import Reputation, record_agreement
from gpuflex.hub.policy.settlement import settle_at_upload
from gpuflex.hub.policy.spot_checks import MAX_FACTOR, trusted_rate
from gpuflex.protocol.jobspec import VerificationSpec

SPEC = VerificationSpec(trust_after=10, spot_check_trusted=0.1, spot_check_stale_s=3600.0)


def _rep(run: int, unchecked_s: float = 0.0) -> Reputation:
    return Reputation(consecutive_agreements=run, agreements_total=run, unchecked_s=unchecked_s)


@pytest.mark.parametrize(("run", "unchecked_s", "rate"), [
    (20, 0.0, 0.1),      # a long record, just checked: the base rate
    (40, 0.0, 0.1),
    (10, 0.0, 0.2),      # just trusted: twice the base rate
    (15, 0.0, 0.15),
    (20, 3600.0, 0.2),   # unchecked for spot_check_stale_s: twice
    (20, 7200.0, 0.3),
    (10, 3600.0, 0.1 * MAX_FACTOR),   # both: 2 x 2, at the bound
    (20, 1e9, 0.1 * MAX_FACTOR),      # never past the bound
])
def test_the_trusted_rate_rises_for_a_short_or_stale_record_within_a_bound(run: int, unchecked_s: float,
                                                                            rate: float) -> None:
    assert trusted_rate(_rep(run, unchecked_s), SPEC) == pytest.approx(rate)


def test_no_base_rate_checks_nothing_and_no_stale_span_means_no_ageing() -> None:
    assert trusted_rate(_rep(10, 1e6), dataclasses.replace(SPEC, spot_check_trusted=0.0)) == 0.0
    assert trusted_rate(_rep(20, 1e6), dataclasses.replace(SPEC, spot_check_stale_s=0.0)) == pytest.approx(0.1)
    assert policy.spot_rate(False, SPEC, _rep(20, 1e6)) == SPEC.spot_check  # untrusted: its own rate


def test_a_stale_trusted_nodes_lone_update_is_spot_checked_where_a_fresh_one_settles() -> None:
    def lone(rep: Reputation) -> bool:
        return settle_at_upload(wanted=1, accepted=0, shard_state="open", trend_measured=False, reputation=rep,
                                spec=SPEC, spot_draw=0.15).settles

    assert lone(_rep(20)) and not lone(_rep(20, 3600.0)) and not lone(_rep(10))


def test_an_agreement_restarts_the_nodes_clock_and_the_policy_reads_its_age() -> None:
    class _Scheduler:
        nodes: dict[str, NodeState] = {}

    node = NodeState(id="n", public_key=b"k" * 32, bench_sps=1.0, ema_sps=1.0, last_seen=0.0,
                     reputation=_rep(20), checked_at=100.0)
    _Scheduler.nodes = {"n": node}
    reps = Reputations(_Scheduler())  # type: ignore[arg-type]
    assert node.reputation_at(3700.0).unchecked_s == 3600.0
    reps.apply([("n", dataclasses.replace(node.reputation, probation=True))])  # no agreement: the clock runs on
    assert node.checked_at == 100.0
    reps.apply([("n", record_agreement(node.reputation))])
    assert node.checked_at > 100.0 and node.reputation.agreements_total == 21
