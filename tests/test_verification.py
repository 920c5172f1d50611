"""Verification on REAL digits training deltas: every attack is flagged, honest nodes are not."""

from __future__ import annotations

import copy
import dataclasses
import math
import random
from dataclasses import replace

import pytest
import torch
from gpuflex.hub.policy.aggregation import fedavg
from gpuflex.hub.policy.distances import relative_distance
from gpuflex.hub.policy.replica_comparison import compare_replicas
from gpuflex.hub.policy.reputation import (
    MIN_REPLICATION,
    Reputation,
    record_agreement,
    record_flag,
    record_verdict,
    replica_candidates,
    replication_probability,
    should_replicate,
)
from gpuflex.hub.policy.round_policy import (
    Drop,
    GroupMember,
    ReplicaState,
    Settle,
    WaitForMore,
    decide_shard,
    judge_round,
)
from gpuflex.hub.policy.round_review import review_round
from gpuflex.hub.policy.update_record import UpdateRecord, VerificationError
from gpuflex.protocol.jobspec import VerificationSpec

from tests.tooling import attacks as atk

torch.set_num_threads(1)

SPEC = VerificationSpec()  # the calibrated defaults (docs/verification.md)
SHARD = 3  # chunks per shard (192 samples)


@pytest.fixture(scope="module")
def world():
    """Digits, the MLP, and a global model after 2 clean FedAvg rounds (a realistic state)."""
    spec = atk.digits_spec()
    xtr, ytr, _xva, _yva = atk.digits_data()
    chunks = atk.make_chunks(xtr, ytr, split="stratified")
    state = atk.initial_state(spec)
    cfg = atk.train_config()
    shards = [chunks[i : i + SHARD] for i in range(0, 8 * SHARD, SHARD)][:7]
    for rnd in range(2):
        res = [
            atk.contribute(None, spec, state, sh, cfg, seed=rnd * 100 + j)
            for j, sh in enumerate(shards)
        ]
        state = atk.apply_delta(
            state, fedavg([r.delta for r in res], [r.sample_count for r in res])
        )
    return {
        "spec": spec,
        "chunks": chunks,
        "shards": shards,
        "state": state,
        "cfg": cfg,
        "memo": {},
    }


def run(world, shard_idx, attack=None, *, seed=None, node="n", uid=None):
    """A node's record for a shard. Training is deterministic, so results of stateless
    attacks (and honest work) are computed once per (shard, attack, seed) and shared."""
    sh = world["shards"][shard_idx]
    seed = 1000 + shard_idx if seed is None else seed
    key = (shard_idx, attack, seed)
    if isinstance(attack, atk.Attack):  # stateful (stale replay): never cached
        r = atk.contribute(attack, world["spec"], world["state"], sh, world["cfg"], seed=seed)
    elif key in world["memo"]:
        r = world["memo"][key]
    else:
        a = atk.make_attack(attack) if attack else None
        r = world["memo"][key] = atk.contribute(
            a, world["spec"], world["state"], sh, world["cfg"], seed=seed
        )
    samples = sum(int(c["x"].shape[0]) for c in sh)
    return UpdateRecord(
        update_id=uid or f"u-{node}-{shard_idx}",
        node_id=node,
        shard_id=f"s{shard_idx}",
        samples_claimed=r.sample_count,
        shard_samples=samples,
        loss=r.loss,
        train_s=r.train_s,
        node_samples_per_s=0.0,
        delta=r.delta,
    )


def global_norm(world):
    return math.sqrt(
        sum(
            float(v.double().pow(2).sum()) for v in world["state"].values() if v.is_floating_point()
        )
    )


# ------------------------------------------------------------------ replicas


def test_honest_replicas_are_bit_identical_and_agree(world):
    # Two independent trainings (not the shared memo): same seed and chunks -> same bits.
    fresh = [
        atk.contribute(
            None, world["spec"], world["state"], world["shards"][0], world["cfg"], seed=1000
        )
        for _ in range(2)
    ]
    a, b = (replace(run(world, 0, node=n), delta=r.delta) for n, r in zip("ab", fresh))
    assert a.update_id != b.update_id
    d, per = relative_distance(a.delta, b.delta)
    assert d == 0.0 and set(per) == {k for k, t in a.delta.items() if t.is_floating_point()}
    out = compare_replicas([a, b], SPEC)
    assert out.agreed and not out.needs_more and out.flags == []
    assert sorted(out.majority) == sorted([a.update_id, b.update_id])
    assert out.canonical in out.majority
    assert out.evidence["pairs"][0]["relative_distance"] == 0.0


REPLICA_ATTACKS = [
    "sign_flip",
    "scale",
    "gaussian_noise",
    "label_flip",
    "free_rider",
    "colluding",
    "half_shard",
]


@pytest.mark.parametrize("name", REPLICA_ATTACKS)
def test_every_attack_loses_the_replica_vote(world, name):
    h1 = run(world, 1, node="h1")
    bad = run(world, 1, name, node="bad")
    d, _ = relative_distance(h1.delta, bad.delta)
    assert d >= 1e-2, d  # far above the 1e-4 tolerance
    first = compare_replicas([h1, bad], SPEC)
    assert not first.agreed and first.needs_more and first.flags == []
    h2 = run(world, 1, node="h2")
    out = compare_replicas([h1, bad, h2], SPEC)
    assert out.agreed and sorted(out.majority) == sorted([h1.update_id, h2.update_id])
    assert [(f.update_id, f.reason) for f in out.flags] == [(bad.update_id, "replica_mismatch")]
    ev = out.flags[0].evidence
    assert ev["relative_distance_to_canonical"] >= 1e-2 and ev["pairs"][0]["tensors"]


def test_stale_replay_loses_the_replica_vote(world):
    stale = atk.make_attack("stale_replay")
    atk.contribute(
        stale, world["spec"], world["state"], world["shards"][2], world["cfg"], seed=5
    )  # round "0"
    bad = run(world, 3, stale, node="bad")  # later assignment: resubmits the old update
    h1, h2 = run(world, 3, node="h1"), run(world, 3, node="h2")
    out = compare_replicas([h1, bad, h2], SPEC)
    assert out.agreed and [f.update_id for f in out.flags] == [bad.update_id]


def test_no_majority_at_max_replicas_flags_everyone(world):
    h = run(world, 0, node="h")
    s = run(world, 0, "sign_flip", node="s")
    x = run(world, 0, "scale", node="x")
    out = compare_replicas([h, s, x], SPEC)
    assert not out.agreed and not out.needs_more
    assert sorted(f.update_id for f in out.flags) == sorted([h.update_id, s.update_id, x.update_id])
    two = compare_replicas([h, s], replace(SPEC, max_replicas=2))
    assert not two.agreed and not two.needs_more and len(two.flags) == 2


def test_colluding_pair_agrees_but_review_flags_their_update(world):
    c1, c2 = run(world, 4, "colluding", node="c1"), run(world, 4, "colluding", node="c2")
    out = compare_replicas([c1, c2], SPEC)
    assert out.agreed  # the same wrong update: replication alone cannot tell
    canonical = c1 if out.canonical == c1.update_id else c2
    others = [run(world, j, node=f"h{j}") for j in (0, 1, 2, 3, 5, 6)]
    rv = review_round([*others, canonical], global_norm(world), SPEC)
    assert [(f.update_id, f.reason) for f in rv.flags] == [(canonical.update_id, "outlier")]
    assert rv.flags[0].evidence["cosine"] < -0.3


def test_replica_group_misuse_is_refused(world):
    a = run(world, 0, node="a")
    with pytest.raises(VerificationError, match="distinct nodes"):
        compare_replicas([a, replace(a, update_id="other")], SPEC)
    with pytest.raises(VerificationError, match="mixes shards"):
        compare_replicas([a, replace(run(world, 1, node="b"))], SPEC)
    assert compare_replicas([], SPEC).needs_more


# ------------------------------------------------------------------ round review


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("sign_flip", "outlier"),
        ("scale", "outlier"),
        ("gaussian_noise", "outlier"),
        ("free_rider", "free_rider"),
    ],
)
def test_review_flags_update_attacks(world, name, reason):
    honest = [run(world, j, node=f"h{j}") for j in range(6)]
    bad = run(world, 6, name, node="bad")
    before = {k: v.clone() for k, v in bad.delta.items()}
    rv = review_round([*honest, bad], global_norm(world), SPEC)
    assert [(f.update_id, f.reason) for f in rv.flags] == [(bad.update_id, reason)]
    assert rv.included == [h.update_id for h in honest]
    assert all(torch.equal(before[k], bad.delta[k]) for k in before)  # inputs untouched
    if reason == "outlier":
        layers = rv.flags[0].evidence["layers"]
        assert [x["name"] for x in layers] == [
            k for k, t in bad.delta.items() if t.is_floating_point()
        ]
        assert all(set(x) == {"name", "norm", "centre_norm", "cosine"} for x in layers)


def test_implausible_claims_are_flagged(world):
    honest = [run(world, j, node=f"h{j}") for j in range(5)]
    h = run(world, 5, node="x")
    cases = {
        "over": replace(h, update_id="over", samples_claimed=h.shard_samples * 2),
        "nan": replace(h, update_id="nan", loss=float("nan")),
        "neg": replace(h, update_id="neg", loss=-0.1),
        # 6 x 9610 params x 192 samples / (2e7 FLOP/s x 20) = 28 ms minimum
        "fast": replace(h, update_id="fast", peak_flops=2e7, param_count=9610, train_s=0.001),
        "slow": replace(h, update_id="slow", train_s=50.0, elapsed_s=10.0),
    }
    rv = review_round([*honest, *cases.values()], global_norm(world), SPEC)
    got = {f.update_id: f for f in rv.flags}
    assert set(got) == set(cases) and all(f.reason == "implausible" for f in got.values())
    assert "claims 384 samples, shard holds 192" in got["over"].evidence["problems"][0]
    assert rv.included == [r.update_id for r in honest]
    assert "physical minimum" in got["fast"].evidence["problems"][0]
    ok = replace(h, update_id="ok", peak_flops=2e7, param_count=9610, train_s=0.5, elapsed_s=2.0)
    # A fast GPU on a tiny model: the minimum (0.03 ms) is timer noise, never checked.
    gpu = replace(h, update_id="gpu", peak_flops=1e12, param_count=9610, train_s=1e-5)
    assert review_round([*honest, ok, gpu], global_norm(world), SPEC).flags == []


def test_half_shard_claim_is_invisible_to_review_but_not_to_replicas(world):
    honest = [run(world, j, node=f"h{j}") for j in range(6)]
    lazy = run(world, 6, "half_shard", node="lazy")
    assert lazy.samples_claimed == lazy.shard_samples  # the claim itself looks fine
    assert review_round([*honest, lazy], global_norm(world), SPEC).flags == []
    out = compare_replicas([lazy, run(world, 6, node="r1"), run(world, 6, node="r2")], SPEC)
    assert [f.update_id for f in out.flags] == [lazy.update_id]


def test_small_rounds_skip_outlier_scoring_but_not_free_riders(world):
    h = run(world, 0, node="h")
    s = run(world, 1, "sign_flip", node="s")
    rv = review_round([h, s], global_norm(world), SPEC)
    assert rv.flags == [] and rv.included == [h.update_id, s.update_id]
    assert rv.evidence["outlier_scoring"].startswith("skipped")
    z = run(world, 2, "free_rider", node="z")
    rv = review_round([z], global_norm(world), SPEC)
    assert [f.reason for f in rv.flags] == ["free_rider"] and rv.included == []


@pytest.mark.parametrize(("split", "sizes"), [("stratified", (3,)), ("random", (1, 2, 3, 6))])
def test_honest_only_rounds_raise_zero_flags(world, split, sizes):
    """Real FedAvg training, review every round: not one flag (IID-ish and uneven shards)."""
    xtr, ytr, _, _ = atk.digits_data()
    chunks = atk.make_chunks(xtr, ytr, split=split, seed=1)
    spec, cfg = world["spec"], world["cfg"]
    state = atk.initial_state(spec)
    rng = random.Random(0)
    for rnd in range(3):
        order = list(range(len(chunks)))
        rng.shuffle(order)
        shards, i, k = [], 0, 0
        while i < len(order):
            shards.append([chunks[c] for c in order[i : i + sizes[k % len(sizes)]]])
            i += sizes[k % len(sizes)]
            k += 1
        recs = []
        for j, sh in enumerate(shards):
            r = atk.contribute(None, spec, state, sh, cfg, seed=rnd * 100 + j)
            recs.append(
                UpdateRecord(
                    f"u{j}",
                    f"n{j}",
                    f"s{j}",
                    r.sample_count,
                    r.sample_count,
                    r.loss,
                    r.train_s,
                    0.0,
                    r.delta,
                )
            )
        gn = math.sqrt(
            sum(float(v.double().pow(2).sum()) for v in state.values() if v.is_floating_point())
        )
        rv = review_round(recs, gn, SPEC)
        assert rv.flags == [], (rnd, [(f.update_id, f.evidence) for f in rv.flags])
        state = atk.apply_delta(
            state, fedavg([r.delta for r in recs], [r.samples_claimed for r in recs])
        )


# ------------------------------------------------------------------ reputation


def test_reputation_transitions_are_pure():
    r0 = Reputation()
    r1 = record_agreement(r0)
    assert r0 == Reputation() and r1.consecutive_agreements == 1 and r1.agreements_total == 1
    r2 = record_flag(record_agreement(r1))
    assert r2.consecutive_agreements == 0 and r2.agreements_total == 2 and r2.flags_total == 1
    r3 = record_verdict(r2, "dismiss")
    assert r3.dismissed_flags == 1 and r3.consecutive_agreements == 0 and not r3.banned
    banned = r3
    for _ in range(3):
        assert not banned.banned
        banned = record_verdict(banned, "confirm")
    assert banned.banned and banned.confirmed_flags == 3
    with pytest.raises(VerificationError, match="confirm"):
        record_verdict(r0, "maybe")


def test_adaptive_replication_trusts_after_a_run_and_stays_bounded():
    spec = VerificationSpec()
    rng = random.Random(0)
    rep = Reputation()
    for _ in range(spec.trust_after):
        assert replication_probability(rep, spec) == 1.0 and should_replicate(rep, spec, rng)
        rep = record_agreement(rep)
    assert replication_probability(rep, spec) == pytest.approx(1 / spec.trust_after)
    long_run = replace(rep, consecutive_agreements=1000)
    assert replication_probability(long_run, spec) == MIN_REPLICATION
    assert replication_probability(record_flag(long_run), spec) == 1.0  # any flag resets trust
    # Overhead of a trusted node over many shards: about 1/run, floored at 5%.
    draws = [
        should_replicate(replace(rep, consecutive_agreements=40), spec, rng) for _ in range(4000)
    ]
    assert 0.04 < sum(draws) / len(draws) < 0.065
    fixed = replace(spec, replication=0.25)
    assert replication_probability(Reputation(), fixed) == 0.25
    assert not should_replicate(Reputation(), replace(spec, replication=0.0), rng)
    with pytest.raises(VerificationError):
        replication_probability(Reputation(), replace(spec, replication="sometimes"))


def test_records_are_not_mutated_by_comparison(world):
    a, b = run(world, 0, node="a"), run(world, 0, "scale", node="b")
    snap = copy.deepcopy([a.delta, b.delta])
    compare_replicas([a, b], SPEC)
    review_round([a, b], 1.0, SPEC)
    for before, rec in zip(snap, (a, b)):
        assert all(torch.equal(before[k], rec.delta[k]) for k in before)


def test_untrusted_groups_need_more_agreement_and_do_not_accuse(world):
    a1, a2 = run(world, 5, "half_shard", node="a1"), run(world, 5, "half_shard", node="a2")
    h = run(world, 5, node="h")
    # Two identical attackers agree with each other: among untrusted nodes that is not enough.
    two = compare_replicas([a1, a2], SPEC, trusted=set())
    assert not two.agreed and two.needs_more and "needs 3" in two.evidence["why"]
    split = compare_replicas([a1, a2, h], SPEC, trusted=set())
    assert not split.agreed and not split.needs_more and split.flags == []  # inconclusive
    assert "inconclusive" in split.evidence["why"]
    # A trusted member makes the plain majority rule apply.
    t1, t2 = run(world, 5, node="t1"), run(world, 5, node="t2")
    out = compare_replicas([a1, t1, t2], SPEC, trusted={"t1", "t2"})
    assert out.agreed and [f.update_id for f in out.flags] == [a1.update_id]
    honest3 = compare_replicas([h, t1, t2], SPEC, trusted=set())
    assert honest3.agreed and honest3.flags == []


def test_replica_candidates_prefer_trusted_then_proven_nodes():
    spec = VerificationSpec()
    reps = {
        "new": Reputation(),
        "some": Reputation(consecutive_agreements=3),
        "more": Reputation(consecutive_agreements=5),
        "gone": Reputation(consecutive_agreements=50, banned=True),
    }
    assert replica_candidates(reps, set(), spec) == ["more", "some"]
    reps["old"] = Reputation(consecutive_agreements=12)
    assert replica_candidates(reps, set(), spec) == ["old"]
    assert replica_candidates(reps, {"old"}, spec) == ["more", "some"]
    assert replica_candidates({"x": Reputation(banned=True)}, set(), spec) == []


def test_inconclusive_group_members_are_scored_but_never_included(world):
    honest = [run(world, j, node=f"h{j}") for j in range(5)]
    flip = run(world, 5, "sign_flip", node="flip")
    h5 = run(world, 5, node="h5")
    rv = review_round(honest, global_norm(world), SPEC, score_only=[flip, h5])
    assert [(f.update_id, f.reason) for f in rv.flags] == [(flip.update_id, "outlier")]
    assert rv.included == [h.update_id for h in honest]  # h5 scored fine, still not included
    assert rv.evidence["score_only"] == 2


def test_matrix_fast_path_and_sliced_path_agree(world, monkeypatch):
    import gpuflex.hub.policy.round_review as vmod

    recs = [run(world, j, node=f"h{j}") for j in range(5)]
    recs += [run(world, 5, "sign_flip", node="s"), run(world, 6, "free_rider", node="z")]
    fast = review_round(recs, global_norm(world), SPEC)
    monkeypatch.setattr(vmod, "FAST_ELEMS", 0)
    slow = review_round(recs, global_norm(world), SPEC, slice_elems=1000)
    assert fast.included == slow.included
    assert [(f.update_id, f.reason) for f in fast.flags] == [
        (f.update_id, f.reason) for f in slow.flags
    ]
    for uid, sc in fast.evidence["scores"].items():
        for key in ("norm", "cosine", "norm_ratio"):
            if key in sc:
                assert sc[key] == pytest.approx(
                    slow.evidence["scores"][uid][key], rel=1e-6, abs=1e-9
                )


def test_blatant_dissent_in_an_untrusted_group_is_decided_by_majority(world):
    h1, h2 = run(world, 6, node="h1"), run(world, 6, node="h2")
    for attack in ("sign_flip", "scale", "free_rider"):
        bad = run(world, 6, attack, node="bad")
        out = compare_replicas([h1, bad, h2], SPEC, trusted=set())
        assert out.agreed and [f.update_id for f in out.flags] == [bad.update_id], attack
        assert out.evidence["blatant_dissent"] is True
    # Two identical flippers against one honest node: the majority wins the vote here, and
    # its canonical (cos -1 to the round) is what review_round then flags (vouching).
    f1, f2 = run(world, 6, "sign_flip", node="f1"), run(world, 6, "sign_flip", node="f2")
    out = compare_replicas([f1, h1, f2], SPEC, trusted=set())
    assert out.agreed and out.canonical in (f1.update_id, f2.update_id)
    canonical = f1 if out.canonical == f1.update_id else f2
    others = [run(world, j, node=f"o{j}") for j in range(5)]
    rv = review_round([*others, canonical], global_norm(world), SPEC)
    assert [f.update_id for f in rv.flags] == [canonical.update_id]


# ------------------------------------------------------------------ the round policy (hub/policy)

TRUSTED = Reputation(consecutive_agreements=SPEC.trust_after)
NEW = Reputation()


def decide(ups, state, reps=None):
    """decide_shard, checking that it leaves every input as it was."""
    reps = {u.node_id: NEW for u in ups} if reps is None else reps
    ups_before, reps_before = list(ups), dict(reps)
    deltas = copy.deepcopy([u.delta for u in ups])
    out = decide_shard(ups, SPEC, state, reps)
    assert len(ups) == len(ups_before) and all(a is b for a, b in zip(ups, ups_before, strict=True))
    assert dict(reps) == reps_before
    for before, u in zip(deltas, ups, strict=True):
        assert all(torch.equal(before[k], u.delta[k]) for k in before)
    return out


def test_policy_waits_until_a_shard_is_due(world):
    a = run(world, 0, node="a")
    out = decide([a], ReplicaState(wanted=2, waited_s=SPEC.replica_wait_s / 2, live=True))
    assert out == WaitForMore(2, {})
    assert decide([], ReplicaState(wanted=1)) == WaitForMore(1, {})
    # One update, a replica out, or an online node that may take one: it waits for the replica.
    assert isinstance(decide([a], ReplicaState(wanted=2, taker=True)), WaitForMore)
    assert isinstance(decide([a], ReplicaState(wanted=2, live=True, taker=False)), WaitForMore)
    # Nobody may take it (every other online node shares the holder's block, or none is online):
    # waiting replica_wait_s only delays the round, the shard is decided at once.
    now = decide([a], ReplicaState(wanted=2, taker=False))
    assert isinstance(now, Settle) and now.unverified == "no_replica_holder"


def test_policy_lone_update_is_used_unverified_only_when_a_replica_was_wanted(world):
    a = run(world, 0, node="a")
    plain = decide([a], ReplicaState(wanted=1))
    assert isinstance(plain, Settle) and plain.representative == a.update_id
    assert plain.unverified is None and plain.agreed_nodes == () and plain.flags == ()
    late = decide([a], ReplicaState(wanted=2, waited_s=SPEC.replica_wait_s))
    assert isinstance(late, Settle) and late.unverified == "lone_update"
    assert late.evidence == {"replicas": 1, "unverified": "lone_update"} and late.agreed_nodes == ()
    assert plain.evidence == {"replicas": 1}


def test_policy_hold_keeps_an_unverified_shard_open_until_a_replica_agrees(world):
    """unverified = "hold": what would settle unverified waits instead (wanted unchanged)."""
    hold = dataclasses.replace(SPEC, unverified="hold")
    a = run(world, 0, node="a")
    held = decide_shard([a], hold, ReplicaState(wanted=2, waited_s=hold.replica_wait_s), {})
    assert isinstance(held, WaitForMore) and held.wanted == 2 and held.evidence["held"] == "lone_update"
    plain = decide_shard([a], hold, ReplicaState(wanted=1), {})
    assert isinstance(plain, Settle) and plain.unverified is None  # never replicated: nothing to hold


def test_policy_agreeing_replicas_with_a_trusted_member_settle_with_credit(world):
    a, b = run(world, 1, node="a"), run(world, 1, node="b")
    out = decide([a, b], ReplicaState(wanted=2), {"a": TRUSTED, "b": NEW})
    assert isinstance(out, Settle) and out.unverified is None and out.flags == ()
    assert out.agreed_nodes == ("a", "b") and out.flagged_nodes == ()
    other = b.update_id if out.representative == a.update_id else a.update_id
    assert dict(out.statuses) == {other: "redundant"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.representative = "x"  # type: ignore[misc]


def test_policy_untrusted_pair_needs_one_more_agreeing_replica(world):
    a, b, c = (run(world, 1, node=n) for n in ("a", "b", "c"))
    out = decide([a, b], ReplicaState(wanted=2))
    assert isinstance(out, WaitForMore) and out.wanted == 3
    assert "needs 3" in out.evidence["why"]
    three = decide([a, b, c], ReplicaState(wanted=3))
    assert isinstance(three, Settle) and three.agreed_nodes == ("a", "b", "c")


def test_policy_disagreement_asks_for_another_replica(world):
    h, bad = run(world, 2, node="h"), run(world, 2, "scale", node="bad")
    out = decide([h, bad], ReplicaState(wanted=2), {"h": TRUSTED, "bad": NEW})
    assert (
        isinstance(out, WaitForMore)
        and out.wanted == 3
        and out.evidence["why"] == "no majority yet"
    )


def test_policy_majority_stands_and_the_minority_is_flagged(world):
    h1, h2 = run(world, 2, node="h1"), run(world, 2, node="h2")
    bad = run(world, 2, "half_shard", node="bad")
    out = decide([h1, bad, h2], ReplicaState(wanted=3), {"h1": TRUSTED, "h2": NEW, "bad": NEW})
    assert isinstance(out, Settle) and out.representative in (h1.update_id, h2.update_id)
    assert [(f.update_id, f.reason) for f in out.flags] == [(bad.update_id, "replica_mismatch")]
    assert out.flagged_nodes == ("bad",) and out.agreed_nodes == ("h1", "h2")
    assert out.statuses[bad.update_id] == "quarantined"
    assert sorted(out.statuses.values()) == ["quarantined", "redundant"]


def test_policy_unanimous_replicas_settle_when_nobody_can_take_another(world):
    a, b = run(world, 3, node="a"), run(world, 3, node="b")
    nobody = ReplicaState(wanted=2, live=False, taker=False)
    out = decide([a, b], nobody)
    assert isinstance(out, Settle) and out.unverified == "replica_wait"
    assert out.representative == a.update_id  # the first in the hub's order
    assert dict(out.statuses) == {b.update_id: "redundant"}
    assert out.agreed_nodes == () and out.flags == ()  # unverified: no credit, no flags
    # Someone could take it, or a replica is still out: ask for the third one instead.
    more = decide([a, b], replace(nobody, taker=True))
    assert isinstance(more, WaitForMore) and more.wanted == 3
    assert isinstance(decide([a, b], replace(nobody, live=True)), WaitForMore)
    # Stuck short of `wanted` with no replica out and no taker: due, and settled the same way.
    assert isinstance(decide([a, b], ReplicaState(wanted=3, taker=False)), Settle)


def test_policy_timed_out_split_is_dropped_inconclusive(world):
    h, bad = run(world, 4, node="h"), run(world, 4, "half_shard", node="bad")
    out = decide([h, bad], ReplicaState(wanted=2, waited_s=SPEC.replica_wait_s, live=True))
    assert isinstance(out, Drop) and out.reason == "inconclusive"
    assert out.flags == () and out.flagged_nodes == ()
    assert dict(out.statuses) == {h.update_id: "excluded", bad.update_id: "excluded"}
    assert out.evidence["inconclusive"] == "replica_wait"


def test_policy_untrusted_split_at_max_replicas_accuses_nobody(world):
    a1, a2 = run(world, 5, "half_shard", node="a1"), run(world, 5, "half_shard", node="a2")
    h = run(world, 5, node="h")
    out = decide([a1, a2, h], ReplicaState(wanted=3))
    assert isinstance(out, Drop) and out.reason == "inconclusive" and out.flags == ()
    assert out.evidence["inconclusive"] is True


def test_policy_no_majority_at_max_replicas_flags_everyone(world):
    h = run(world, 6, node="h")
    s, x = run(world, 6, "scale", node="s"), run(world, 6, "half_shard", node="x")
    out = decide([h, s, x], ReplicaState(wanted=3), {"h": TRUSTED, "s": NEW, "x": NEW})
    assert isinstance(out, Drop) and out.reason == "no_majority"
    assert sorted(f.update_id for f in out.flags) == sorted(u.update_id for u in (h, s, x))
    assert out.flagged_nodes == ("h", "s", "x") and set(out.statuses.values()) == {"quarantined"}


def test_judge_round_flags_the_vouching_majority_and_withdraws_the_minority_flag(world):
    others = [run(world, j, node=f"o{j}") for j in range(5)]
    flip = run(world, 6, "sign_flip", node="f1")
    groups = {
        flip.update_id: (
            GroupMember("u-f2", "f2", "redundant"),  # agreed with the flipped update
            GroupMember("u-h", "h", "quarantined"),  # the minority that was right
        ),
        others[0].update_id: (GroupMember("u-r0", "r0", "redundant"),),
    }
    before = copy.deepcopy(groups)
    deltas = copy.deepcopy([u.delta for u in (*others, flip)])
    out = judge_round([*others, flip], global_norm(world), SPEC, groups)
    assert groups == before
    for d, u in zip(deltas, (*others, flip), strict=True):
        assert all(torch.equal(d[k], u.delta[k]) for k in d)
    assert [(f.update_id, f.reason) for f in out.flags] == [
        (flip.update_id, "outlier"),
        ("u-f2", "outlier"),
    ]
    assert out.flags[1].evidence == {"vouched_for": flip.update_id}
    assert out.withdrawn == ("u-h",) and out.flagged_nodes == ("f1", "f2")
    assert out.statuses[flip.update_id] == "quarantined" and out.statuses["u-f2"] == "quarantined"
    assert [out.statuses[o.update_id] for o in others] == ["included"] * 5
    assert out.review.included == [o.update_id for o in others]
    empty = judge_round([], 0.0, SPEC, {})
    assert empty.review.included == [] and empty.flags == () and dict(empty.statuses) == {}


def test_a_minority_flag_is_withdrawn_only_when_the_minority_passes_the_review(world):
    """The vouching rule with the minorities' records (what the hub passes): an honest minority
    outvoted by colluding flippers is cleared; a flipped minority outvoted by a majority that
    review flags too (here a 10x update) keeps its replica_mismatch flag, for the auditor."""
    others = [run(world, j, node=f"o{j}") for j in range(5)]
    flip = run(world, 6, "sign_flip", node="f1")
    honest_minority = run(world, 6, node="h", uid="u-h")
    groups = {flip.update_id: (GroupMember("u-f2", "f2", "redundant"), GroupMember("u-h", "h", "quarantined"))}
    gn = global_norm(world)
    out = judge_round([*others, flip], gn, SPEC, groups, dissent={"u-h": honest_minority})
    assert out.withdrawn == ("u-h",)
    assert "u-h" not in out.review.included and "u-h" not in out.statuses  # scored, never included

    scaled = run(world, 6, "scale", node="s1")
    flipped_minority = run(world, 6, "sign_flip", node="x", uid="u-x")
    groups = {scaled.update_id: (GroupMember("u-s2", "s2", "redundant"), GroupMember("u-x", "x", "quarantined"))}
    out = judge_round([*others, scaled], gn, SPEC, groups, dissent={"u-x": flipped_minority})
    assert [(f.update_id, f.reason) for f in out.flags] == [(scaled.update_id, "outlier"), ("u-s2", "outlier")]
    assert out.withdrawn == ()  # the flipped minority's flag stands
    assert judge_round([*others, scaled], gn, SPEC, groups).withdrawn == ("u-x",)  # without records: as before
    assert judge_round([*others, scaled], gn, SPEC, groups, dissent={}).withdrawn == ()  # no record: kept


def test_a_distance_memo_measures_each_pair_once_and_is_what_the_verdict_uses():
    """policy judges a group twice on the referee path (strict, then the plain rules): the memo
    carries the measured pairs to the second call, and the second call really reads it."""
    from gpuflex.hub.policy.replica_comparison import compare_replicas
    from gpuflex.hub.policy.update_record import UpdateRecord
    from gpuflex.protocol.jobspec import VerificationSpec

    def rec(uid: str, node: str, value: float) -> UpdateRecord:
        return UpdateRecord(update_id=uid, node_id=node, shard_id="s", samples_claimed=8, shard_samples=8,
                            loss=0.1, train_s=1.0, node_samples_per_s=0.0,
                            delta={"w": torch.full((16,), value)})

    spec = VerificationSpec(quorum=2, max_replicas=3)
    # close, within tolerance: no fingerprint settles that pair, it is measured in full
    group = [rec("a", "n1", 1.0), rec("b", "n2", 1.00005)]
    memo: dict[tuple[str, str], tuple[float, dict[str, float]]] = {}
    first = compare_replicas(group, spec, trusted={"n1", "n2"}, distances=memo)
    assert set(memo) == {("a", "b")} and 0.0 < memo[("a", "b")][0] <= spec.tolerance
    assert first.agreed
    memo[("a", "b")] = (0.5, {})  # a memo that says they differ is believed: no second measurement
    second = compare_replicas(group, spec, trusted={"n1", "n2"}, distances=memo)
    assert not second.agreed and second.evidence["pairs"][0]["relative_distance"] == 0.5


def test_norm_bound_widens_for_shards_far_from_the_rounds_median_size(world):
    """From the job's initial state (momentum still building up), a 1,024-sample shard moves
    further per sample than the round's 64-sample shards: honest, so not flagged (a CI round
    once flagged such an honest replica majority, which withdrew the flag on the sign-flipping
    minority). A 10x update on a shard of the median size is still flagged for its norm."""
    init = atk.initial_state(world["spec"])
    chunks = world["chunks"]
    sizes = [16, 1, 1, 1, 1, 1, 1, 1]  # chunks of 64 samples (digits has 22 and a bit); median: 64
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    recs = []
    for j, (s, k) in enumerate(zip(starts, sizes, strict=True)):
        attack = atk.make_attack("scale") if j == 1 else None
        r = atk.contribute(attack, world["spec"], init, chunks[s : s + k], world["cfg"], seed=j)
        recs.append(UpdateRecord(update_id=f"u{j}", node_id=f"n{j}", shard_id=f"s{j}",
                                 samples_claimed=r.sample_count, shard_samples=r.sample_count, loss=r.loss,
                                 train_s=r.train_s, node_samples_per_s=0.0, delta=r.delta))
    norm0 = math.sqrt(sum(float(v.double().pow(2).sum()) for v in init.values() if v.is_floating_point()))
    rv = review_round(recs, norm0, SPEC)
    ratios = {u: s["norm_ratio"] for u, s in rv.evidence["scores"].items()}
    # the large shard really is past norm_ratio_max per sample (4.38 here), and honest
    assert ratios["u0"] > SPEC.norm_ratio_max, ratios
    assert [(f.update_id, f.reason) for f in rv.flags] == [("u1", "outlier")], (ratios, rv.flags)
    flag = rv.flags[0]
    assert any("norm per sample" in p for p in flag.evidence["problems"])
    assert flag.evidence["norm_ratio_limit"] == pytest.approx(SPEC.norm_ratio_max)  # median size
    from gpuflex.hub.policy.round_review import size_allowance

    assert size_allowance(1024, 128) == pytest.approx(math.sqrt(8))
    assert size_allowance(32, 128) == pytest.approx(2.0) and size_allowance(128, 128) == 1.0


def test_under_lr_scaling_updates_are_compared_by_samples_times_their_lr_factor():
    """[train] lr_scaling = "linear": a small shard trains with a larger lr, so its update is as
    long as a large shard's. Compared per sample it would be clipped by the norm bound (and look
    like an outlier); compared by samples x factor (UpdateRecord.work) it is the round's norm."""
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(200, generator=gen)

    def rec(uid: str, samples: int, scale: float) -> UpdateRecord:
        delta = {"w": base + 0.05 * torch.randn(200, generator=gen)}  # every update about as long
        return UpdateRecord(update_id=uid, node_id=f"n-{uid}", shard_id=f"s-{uid}", samples_claimed=samples,
                            shard_samples=samples, loss=0.5, train_s=1.0, node_samples_per_s=0.0, delta=delta,
                            lr_scale=scale)

    scaled = [rec("a", 32, 8.0), rec("b", 32, 8.0), rec("c", 256, 1.0), rec("d", 256, 1.0), rec("e", 256, 1.0)]
    assert scaled[0].work == scaled[2].work == 256.0
    out = judge_round(scaled, 10.0, SPEC, {})
    assert out.flags == () and out.scales == {}
    plain = [dataclasses.replace(r, lr_scale=1.0) for r in scaled]  # the same updates, read per sample
    assert set(judge_round(plain, 10.0, SPEC, {}).scales) == {"a", "b"}
