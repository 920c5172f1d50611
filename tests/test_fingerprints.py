"""Fingerprints (hub/policy/fingerprints.py): deterministic, a true lower bound, and a replica
comparison through them decides exactly as the full distance does."""

from __future__ import annotations

import dataclasses
import math

import torch
from gpuflex.hub.policy import round_policy as policy
from gpuflex.hub.policy.distances import relative_distance
from gpuflex.hub.policy.fingerprints import BLOCKS, Fingerprint, distance_bounds, fingerprint_of
from gpuflex.hub.policy.referee import SegmentVerdict
from gpuflex.hub.policy.replica_comparison import compare_replicas
from gpuflex.hub.policy.update_record import UpdateRecord
from gpuflex.protocol.jobspec import VerificationSpec

SPEC = VerificationSpec(quorum=2, max_replicas=3)


def _update(seed: int) -> dict[str, torch.Tensor]:
    """A small model's update: tensors above and under the fingerprint's block count."""
    g = torch.Generator().manual_seed(seed)
    return {
        "0.weight": torch.randn(64, 80, generator=g),
        "0.bias": torch.randn(64, generator=g),
        "1.weight": torch.randn(10, 64, generator=g),
        "1.bias": torch.randn(10, generator=g),
        "steps": torch.tensor(3),
    }


def _rec(
    uid: str, node: str, delta: dict[str, torch.Tensor], sha: str | None = None
) -> UpdateRecord:
    return UpdateRecord(
        sha=sha,
        update_id=uid,
        node_id=node,
        shard_id="s",
        samples_claimed=64,
        shard_samples=64,
        loss=0.1,
        train_s=1.0,
        node_samples_per_s=0.0,
        delta=delta,
    )


def _noisy(d: dict[str, torch.Tensor], scale: float, seed: int) -> dict[str, torch.Tensor]:
    """``d`` plus noise spread over every element (what the sign sketch sees least of)."""
    g = torch.Generator().manual_seed(seed)
    return {
        k: v + scale * float(v.abs().mean()) * torch.randn(v.shape, generator=g)
        if v.is_floating_point()
        else v.clone()
        for k, v in d.items()
    }


def _same_decision(
    records: list[UpdateRecord], spec: VerificationSpec, trusted: set[str] | None
) -> None:
    fast = compare_replicas(records, spec, trusted=trusted, fingerprints={})
    full = compare_replicas(records, spec, trusted=trusted, use_fingerprints=False)
    assert (fast.agreed, fast.majority, fast.needs_more, fast.canonical) == (
        full.agreed,
        full.majority,
        full.needs_more,
        full.canonical,
    )
    assert [p.agree for p in fast.pairs] == [p.agree for p in full.pairs]
    assert fast.flags == full.flags  # the same flags, with the full distances as evidence


def test_a_fingerprint_is_deterministic_and_reads_every_bit() -> None:
    d = _update(1)
    a, b = fingerprint_of(d), fingerprint_of({k: v.clone() for k, v in d.items()}, slice_elems=257)
    assert a.digest == b.digest and a.layout == b.layout and a.norm == b.norm
    assert torch.equal(a.sums, b.sums) and torch.equal(a.squares, b.squares)
    assert len(a.layout) == 4 and a.sums.numel() == BLOCKS  # the int tensor is not in it
    flipped = {k: v.clone() for k, v in d.items()}
    flipped["0.weight"].view(-1)[1234] = torch.nextafter(
        flipped["0.weight"].view(-1)[1234], torch.tensor(9.0)
    )
    assert fingerprint_of(flipped).digest != a.digest
    assert distance_bounds(a, b) == (0.0, True)


def test_the_bound_never_exceeds_the_full_distance() -> None:
    base = _update(2)
    for i, scale in enumerate((1e-7, 1e-4, 1e-2, 0.3, 3.0)):
        other = _noisy(base, scale, i)
        lower, exact = distance_bounds(fingerprint_of(base), fingerprint_of(other))  # type: ignore[misc]
        full = relative_distance(base, other)[0]
        assert not exact and 0.0 <= lower <= full
    # the norm term: tight
    shrunk = {k: v * 0.5 if v.is_floating_point() else v for k, v in base.items()}
    lower, _ = distance_bounds(fingerprint_of(base), fingerprint_of(shrunk))  # type: ignore[misc]
    assert relative_distance(base, shrunk)[0] - 1e-5 < lower <= relative_distance(base, shrunk)[0]
    nan = {**base, "1.bias": torch.full((10,), math.nan)}
    # NaN != NaN: the full distance says disagree, the fingerprints say nothing
    assert distance_bounds(fingerprint_of(nan), fingerprint_of(dict(nan))) is None


def test_fingerprints_and_full_distances_decide_the_same() -> None:
    honest = _update(3)
    same = {k: v.clone() for k, v in honest.items()}  # far agree: the same bytes
    # far disagree
    flipped = {k: -v if k.startswith("1.") else v.clone() for k, v in honest.items()}
    d = relative_distance(honest, _noisy(honest, 1e-3, 7))[0]
    # a tolerance just under, at and over the pair's distance
    near = [d * f for f in (0.98, 1.0, 1.02)]
    for tol in (1e-4, 0.2, *near):
        spec = VerificationSpec(quorum=2, max_replicas=3, tolerance=tol)
        for others in (
            [same],
            [flipped],
            [_noisy(honest, 1e-3, 7)],
            [same, flipped],
            [flipped, flipped],
            [_noisy(honest, 1e-3, 7), flipped],
        ):
            group = [
                _rec("u0", "n0", honest),
                *(_rec(f"u{i}", f"n{i}", o) for i, o in enumerate(others, 1)),
            ]
            for trusted in (None, {"n0"}, set()):
                _same_decision(group, spec, trusted)
            # as the hub's records come: the sha of each blob (equal bytes, equal shas)
            shas = [dataclasses.replace(r, sha=fingerprint_of(r.delta).digest) for r in group]
            _same_decision(shas, spec, {"n0"})


def test_a_pair_near_the_threshold_is_measured_in_full_and_a_flag_holds_full_distances() -> None:
    honest = _update(4)
    near = _noisy(honest, 1e-3, 8)
    d = relative_distance(honest, near)[0]
    # apart, but the sketch cannot tell
    spec = VerificationSpec(quorum=2, max_replicas=3, tolerance=d / 1.5)
    memo: dict[tuple[str, str], tuple[float, dict[str, float]]] = {}
    prints: dict[str, Fingerprint] = {}
    out = compare_replicas(
        [_rec("a", "n1", honest), _rec("b", "n2", near)], spec, distances=memo, fingerprints=prints
    )
    assert out.needs_more and out.pairs[0].measured == "full" and memo[("a", "b")][0] == d
    assert out.evidence["pairs"][0]["tensors"] and "measured" not in out.evidence["pairs"][0]
    flipped = {k: -v if k.startswith("1.") else v.clone() for k, v in honest.items()}
    far = compare_replicas(
        [_rec("a", "n1", honest), _rec("c", "n3", flipped)],
        spec,
        distances=memo,
        fingerprints=prints,
    )
    assert far.needs_more and far.pairs[0].measured == "fingerprint" and ("a", "c") not in memo
    assert far.evidence["pairs"][0]["measured"] == "fingerprint_lower_bound"
    three = [_rec("a", "n1", honest), _rec("b", "n2", dict(honest)), _rec("c", "n3", flipped)]
    assert set(prints) == {"a", "b", "c"}
    flagged = compare_replicas(three, spec, fingerprints=prints)
    assert flagged.agreed and [f.update_id for f in flagged.flags] == ["c"]
    ev = flagged.flags[0].evidence
    assert all("measured" not in p and p["tensors"] for p in ev["pairs"])
    assert ev["relative_distance_to_canonical"] == relative_distance(honest, flipped)[0]


def test_a_referee_flag_holds_the_full_distance_of_its_pairs() -> None:
    honest = _update(5)
    flipped = {k: -v if k.startswith("1.") else v.clone() for k, v in honest.items()}
    ups = [_rec("u-a", "n-a", honest), _rec("u-b", "n-b", flipped)]
    verdicts = {
        "u-a": SegmentVerdict("u-a", "n-a", "reproduced", {"distance": 0.0}),
        "u-b": SegmentVerdict("u-b", "n-b", "mismatch", {"distance": 2.5}),
    }
    done = policy.decide_shard(
        ups,
        SPEC,
        policy.ReplicaState(wanted=2),
        {},
        committed=frozenset({"u-a", "u-b"}),
        verdicts=verdicts,
    )
    assert isinstance(done, policy.Settle) and [f.update_id for f in done.flags] == ["u-b"]
    (pair,) = done.flags[0].evidence["pairs"]
    assert (
        "measured" not in pair
        and pair["relative_distance"] == relative_distance(honest, flipped)[0]
    )


def test_a_replayed_segment_equal_to_the_committed_end_is_at_distance_zero() -> None:
    from gpuflex.hub.policy.referee import segment_distance
    from gpuflex.protocol.checkpoint import segment_norm

    start = _update(6)
    end = _noisy(start, 0.1, 9)
    assert segment_distance(start, end, {k: v.clone() for k, v in end.items()}) == 0.0
    other = _noisy(end, 1e-4, 10)
    names = sorted(k for k, v in other.items() if v.is_floating_point())
    want = segment_norm(other, end, names) / segment_norm(start, other, names)
    assert segment_distance(start, end, other) == want > 0.0
    nan = {**end, "1.bias": torch.full((10,), math.nan)}
    assert math.isnan(segment_distance(start, nan, dict(nan)))  # NaN != NaN: the norms decide


def test_replicas_uploaded_as_the_same_bytes_agree_without_a_fingerprint() -> None:
    honest = _update(7)
    group = [_rec("a", "n1", honest, sha="ab" * 32), _rec("b", "n2", dict(honest), sha="ab" * 32)]
    prints: dict[str, Fingerprint] = {}
    out = compare_replicas(group, SPEC, trusted={"n1"}, fingerprints=prints)
    assert out.agreed and out.pairs[0].measured == "bytes" and not prints  # no tensor was read
    assert (
        out.pairs[0].evidence()
        == compare_replicas(group, SPEC, use_fingerprints=False).pairs[0].evidence()
    )
