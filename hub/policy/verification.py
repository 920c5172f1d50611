"""Verification of contributed updates: replicas, outlier scores, reputation.

Pure functions: records in, verdicts out; no I/O, no clocks, no
global state, inputs never mutated. The hub decides *when* to call them and
persists what they return; an auditor later confirms or dismisses each `Flag`.

How the pieces fit in one round (the round policy that combines them is
hub/policy/round_policy.py; hub/rounds applies its decisions):

1. When a node gets a shard the hub asks ``should_replicate(rep, spec, rng)``
   with the node's `Reputation`. If true the shard gets a ``replica_group`` and
   is handed out again, with the same seed and chunks, to a *distinct* node from
   ``replica_candidates`` (trusted nodes when there are any).
2. When a group has ``quorum`` updates, ``compare_replicas`` runs. Updates that
   agree (relative distance within ``tolerance``) form clusters; a cluster of at
   least ``quorum`` that is a strict majority of the group stands and the rest
   are flagged ``replica_mismatch``. Without such a majority it asks for another
   replica (``needs_more``) until ``max_replicas``; at ``max_replicas`` with no
   majority every update in the group is flagged (an auditor decides). A group
   with no trusted member needs one more agreeing replica and a split among
   untrusted nodes accuses nobody (deterministic attacks agree with themselves).
   One update of an agreeing group (``ReplicaOutcome.canonical``) represents the
   shard in the aggregate, so replication never double-counts a shard.
3. ``review_round`` scores every candidate update of the round (the canonical
   update of each replicated shard plus the unreplicated ones):
   ``free_rider`` (near-zero update), ``implausible`` (claims that do not fit the
   shard: sample count, loss, a training time below the physical minimum for
   the node's benchmarked FLOP/s or above the hub-observed wall time, an
   update longer than the path its committed segment norms add up to),
   ``outlier`` (cosine to the round's coordinate-wise median of per-sample
   updates below the threshold described below, or norm per sample above
   ``norm_ratio_max`` times the round's median). Flagged updates are
   quarantined: kept, shown to auditors, left out of the aggregate.
4. Reputation transitions (``record_agreement``, ``record_flag``,
   ``record_verdict``) are pure: they return a new `Reputation`.

Calibration (measured; the figures are in docs/verification.md): honest replicas
on the same device type and thread count are bit-identical (relative distance
0.0). The digits MLP at the contract's defaults is bit-identical even between
torch threads 1 and 2 (its matmuls are too small to split); a 64-1024-1024-10
MLP at batch 128 differs by at most 1.2e-6. The default ``tolerance = 1e-4``
leaves ~100x margin above that, while every attack in tests/tooling/attacks.py
sits at >= 1e-2. Thresholds: honest per-sample norm ratios stayed <= 2.10 over
60-round digits runs with shards of 1 to 6 chunks, hence ``norm_ratio_max = 4``. That bound
holds for a shard of the round's median size and widens by sqrt of the size ratio, either way,
for others (``size_allowance``): per-sample norms are not size-free.

Cosine threshold: honest updates of small shards late in training are mostly
gradient noise (measured: -0.47 to the median after 47 digits rounds on a
1-chunk shard). So the spec's ``cosine_min`` is the threshold for a shard of the
round's median size in a round whose cosines are tight; it is relaxed to
``median - 4 x robust spread`` of the round's cosines when that is lower, and
both terms widen by sqrt(median samples / own samples) for smaller shards.

Honest false positives: with fewer than ``MIN_OUTLIER_N`` (3) candidate updates
the median is not a robust centre (with 2 it is their mean, so each is "half
the distance" from it), so outlier scoring is skipped and only free_rider and
implausible checks run; the skip is stated in ``RoundReview.evidence``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from statistics import median
from typing import Any, Protocol

import numpy as np
import torch
from gpuflex.protocol.jobspec import VerificationSpec
from torch import Tensor

from ..base.errors import HubError
from .aggregation import DEFAULT_SLICE_ELEMS, PageReleaser, coordinate_median, floating_keys

__all__ = [
    "BAN_AFTER_CONFIRMED",
    "MIN_OUTLIER_N",
    "MIN_REPLICATION",
    "REASONS",
    "Flag",
    "ReplicaOutcome",
    "Reputation",
    "RoundReview",
    "UpdateRecord",
    "VerificationError",
    "compare_replicas",
    "cosine_and_norms",
    "is_trusted",
    "layer_of",
    "record_agreement",
    "record_flag",
    "record_missed",
    "record_verdict",
    "relative_distance",
    "replica_candidates",
    "replication_probability",
    "review_round",
    "should_replicate",
    "trend_alignment",
]

REASONS = ("replica_mismatch", "outlier", "free_rider", "implausible")
MIN_OUTLIER_N = 3  # below this the round's median is no robust centre
MIN_REPLICATION = 0.05  # floor of a trusted node's replication probability
BAN_AFTER_CONFIRMED = 3  # confirmed flags that ban a node
# Margin over the node's benchmarked peak FLOP/s (a benchmark taken on a busy
# machine reads up to ~4x low; one taken at the same time is the real ceiling).
FLOP_SAFETY = 20.0
MIN_TIMING_S = 0.01  # below this the physical minimum is lost in timer noise: not checked
#: relative slack of the path-length check (an update's norm <= the sum of its committed segment
#: norms): float32 rounding of the two sides is about 1e-6; honest paths measured 4-11 % longer
#: than the update (bench/heterogeneity.py's jobs, 7 segments of 5 epochs)
PATH_SLACK = 1e-4
MAX_LAYERS_EVIDENCE = 64
COSINE_SPREAD_K = 4.0  # robust z below which a cosine is an outlier when the spread is wide
EPS = 1e-12
TOP_TENSORS = 5  # per-tensor evidence kept for a replica pair


class VerificationError(HubError):
    """The hub called verification with inputs that cannot be judged (a bug upstream)."""

    status = 500
    code = "verification_error"


class _Rng(Protocol):
    def random(self) -> float: ...


@dataclass(frozen=True)
class UpdateRecord:
    """One accepted update as verification sees it.

    ``samples_claimed`` is the header's sample_count, ``shard_samples`` what the
    hub's shard actually holds; ``loss``/``train_s`` are the node's claims;
    ``node_samples_per_s`` is the node's throughput as the hub knows it (evidence
    only: delivered throughput includes download and polling, so it is no bound).
    ``elapsed_s`` (optional) is the hub-observed wall time from assignment issue
    to upload: a node cannot have trained longer than that.
    ``peak_flops`` (the node's best benchmarked matmul FLOP/s; 0 = unknown),
    ``param_count`` and ``local_epochs`` give the PHYSICAL minimum training time,
    6 * params * samples * epochs / (peak * FLOP_SAFETY); a claim below it is
    implausible (skipped when that minimum is under MIN_TIMING_S).
    ``delta`` may be zero-copy views; it is only read.
    """

    update_id: str
    node_id: str
    shard_id: str
    samples_claimed: int
    shard_samples: int
    loss: float
    train_s: float
    node_samples_per_s: float
    delta: Mapping[str, Tensor]
    elapsed_s: float | None = None
    peak_flops: float = 0.0
    param_count: int = 0
    #: passes over the shard the assignment asked for (local_steps makes it fractional)
    local_epochs: float = 1
    #: the sum of the segment norms the node committed to (an uncoded update with a checkpoint
    #: commitment; None: not checked). By the triangle inequality the update (last checkpoint
    #: minus first) is no longer than that path. The referee tests the norms of the segments whose
    #: states an audit fetched; this bounds the claims of every update, audited or not.
    path_length: float | None = None
    #: the factor on the job's lr this update's shard trained with ([train] lr_scaling)
    lr_scale: float = 1.0

    @property
    def work(self) -> float:
        """What an update's size is compared by: its shard's samples times its lr factor (an
        update moves the model about in proportion to both)."""
        return max(self.shard_samples, 1) * self.lr_scale


@dataclass(frozen=True)
class Flag:
    """A suspicion with its evidence (JSON-serializable: str, int, float, list, dict)."""

    update_id: str
    node_id: str
    reason: str
    evidence: dict[str, Any]


@dataclass(frozen=True)
class ReplicaOutcome:
    """Result of comparing one replica group.

    ``agreed``: a majority cluster of >= quorum stands (``majority`` = its update ids,
    ``canonical`` = the one to aggregate). ``needs_more``: issue another replica.
    Neither: the group is resolved without agreement (everything flagged).
    """

    agreed: bool
    majority: list[str]
    flags: list[Flag]
    needs_more: bool
    evidence: dict[str, Any]
    canonical: str = ""


@dataclass(frozen=True)
class RoundReview:
    """``included``: update ids to aggregate, in input order. ``flags``: the rest."""

    included: list[str]
    flags: list[Flag]
    evidence: dict[str, Any]


@dataclass(frozen=True)
class Reputation:
    """A node's track record. Transitions are the ``record_*`` functions."""

    consecutive_agreements: int = 0
    agreements_total: int = 0
    flags_total: int = 0
    confirmed_flags: int = 0
    dismissed_flags: int = 0
    banned: bool = False
    #: the node is younger than the hub's trust_min_age_s: it cannot be trusted yet, whatever its
    #: run (set and cleared by the hub from the node's age; not stored)
    probation: bool = False

    @property
    def trusted_run(self) -> int:
        return self.consecutive_agreements


# --------------------------------------------------------------------------- distances


def _flat(t: Tensor) -> Tensor:
    return t.reshape(-1)


def _pair_sums(
    a: Tensor, b: Tensor, slice_elems: int, pages: PageReleaser | None = None
) -> tuple[float, float, float, float]:
    """(||a-b||^2, ||a||^2, ||b||^2, a.b) of two same-shape tensors, float64, sliced.
    ``pages`` drops consumed pages of mmap'd blobs (see aggregation.PageReleaser)."""
    fa, fb = _flat(a), _flat(b)
    dd = aa = bb = ab = 0.0
    for s in range(0, fa.numel(), slice_elems):
        xa = fa[s : s + slice_elems].to(torch.float64)
        xb = fb[s : s + slice_elems].to(torch.float64)
        diff = xa - xb
        dd += float(torch.dot(diff, diff))
        aa += float(torch.dot(xa, xa))
        bb += float(torch.dot(xb, xb))
        ab += float(torch.dot(xa, xb))
        if pages is not None:
            pages.release(fa, s, s + xa.numel())
            pages.release(fb, s, s + xb.numel())
    return dd, aa, bb, ab


def _same_layout(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> list[str] | None:
    keys = floating_keys(a)
    if set(keys) != set(floating_keys(b)):
        return None
    for k in keys:
        if tuple(a[k].shape) != tuple(b[k].shape):
            return None
    return keys


def relative_distance(
    a: Mapping[str, Tensor],
    b: Mapping[str, Tensor],
    *,
    slice_elems: int = DEFAULT_SLICE_ELEMS,
    pages: PageReleaser | None = None,
) -> tuple[float, dict[str, float]]:
    """||a-b|| / max(||a||, ||b||, eps) over all floating tensors, and the same
    ratio per tensor. Updates with different layouts are infinitely far apart."""
    keys = _same_layout(a, b)
    if keys is None:
        return math.inf, {}
    dd = aa = bb = 0.0
    per: dict[str, float] = {}
    for k in keys:
        d, x, y, _ = _pair_sums(a[k], b[k], slice_elems, pages)
        dd, aa, bb = dd + d, aa + x, bb + y
        per[k] = math.sqrt(d) / max(math.sqrt(x), math.sqrt(y), EPS)
    return math.sqrt(dd) / max(math.sqrt(aa), math.sqrt(bb), EPS), per


def cosine_and_norms(
    a: Mapping[str, Tensor],
    b: Mapping[str, Tensor],
    *,
    slice_elems: int = DEFAULT_SLICE_ELEMS,
) -> tuple[float, float, float]:
    """(cosine(a, b), ||a||, ||b||) over the floating tensors; cosine 0 if either is 0."""
    cos, na, nb, _ = _cosine_layers(a, b, slice_elems)
    return cos, na, nb


def _cos(ab: float, na: float, nb: float) -> float:
    return ab / (na * nb) if na > EPS and nb > EPS else 0.0


def _cosine_layers(
    a: Mapping[str, Tensor],
    b: Mapping[str, Tensor],
    slice_elems: int,
    pages: PageReleaser | None = None,
) -> tuple[float, float, float, list[tuple[str, float, float, float]]]:
    """Whole-update (cosine, ||a||, ||b||) plus (name, ||a_k||, ||b_k||, cosine_k) per tensor."""
    aa = bb = ab = 0.0
    layers = []
    for k in floating_keys(a):
        _, x, y, z = _pair_sums(a[k], b[k], slice_elems, pages)
        aa, bb, ab = aa + x, bb + y, ab + z
        layers.append((k, math.sqrt(x), math.sqrt(y), _cos(z, math.sqrt(x), math.sqrt(y))))
    na, nb = math.sqrt(aa), math.sqrt(bb)
    return _cos(ab, na, nb), na, nb, layers


def layer_of(key: str) -> str:
    """The module a state-dict key belongs to ("2.weight" -> "2"): a layer's weight and bias
    are judged together."""
    return key.rsplit(".", 1)[0] if "." in key else key


def trend_alignment(
    delta: Mapping[str, Tensor],
    now: Mapping[str, Tensor],
    then: Mapping[str, Tensor],
    *,
    slice_elems: int = DEFAULT_SLICE_ELEMS,
) -> tuple[float, str]:
    """How ``delta`` lines up with the model's trend ``now - then`` (the global model now and
    some rounds earlier): the lowest cosine over its layers, and that layer. Honest updates
    follow the trend in every layer (cosine > 0 in all but about 1 % of them on the digits
    CNN against a 10-round trend); an update crafted to undo or invert one layer points
    against it there. Layers where either side did not move are skipped; (1.0, "") when
    none is left, or the layouts differ (nothing to say)."""
    keys = _same_layout(delta, now)
    if keys is None or _same_layout(now, then) != keys:
        return 1.0, ""
    sums: dict[str, list[float]] = {}
    for k in keys:
        fu, fa, fb = _flat(delta[k]), _flat(now[k]), _flat(then[k])
        acc = sums.setdefault(layer_of(k), [0.0, 0.0, 0.0])  # u.t, u.u, t.t
        for i in range(0, fu.numel(), slice_elems):
            u = fu[i : i + slice_elems].to(torch.float64)
            t = fa[i : i + slice_elems].to(torch.float64) - fb[i : i + slice_elems].to(torch.float64)
            acc[0] += float(torch.dot(u, t))
            acc[1] += float(torch.dot(u, u))
            acc[2] += float(torch.dot(t, t))
    worst, where = 1.0, ""
    for layer, (ut, uu, tt) in sums.items():
        nu, nt = math.sqrt(uu), math.sqrt(tt)
        if nu > EPS and nt > EPS and ut / (nu * nt) < worst:
            worst, where = ut / (nu * nt), layer
    return worst, where


def _norm(delta: Mapping[str, Tensor], slice_elems: int, pages: PageReleaser | None) -> float:
    total = 0.0
    for k in floating_keys(delta):
        _, x, _, _ = _pair_sums(delta[k], delta[k], slice_elems, pages)
        total += x
    return math.sqrt(total)


# --------------------------------------------------------------------------- replicas


def compare_replicas(
    records: Sequence[UpdateRecord],
    spec: VerificationSpec,
    *,
    trusted: Collection[str] | None = None,
    slice_elems: int = DEFAULT_SLICE_ELEMS,
    distances: dict[tuple[str, str], tuple[float, dict[str, float]]] | None = None,
) -> ReplicaOutcome:
    """Decide one replica group (updates of the same shard, seed and chunks).

    ``distances``: a memo of pairwise distances by update-id pair, shared by calls that
    judge one group more than once (hub/policy/round_policy.py asks with the strict tolerance, then
    with the cross-class one): each pair is measured once.

    ``trusted``: ids of the nodes that are trusted now (``is_trusted``); pass it
    (the hub should). When NO member of the group is trusted, agreement proves
    less - a deterministic attack agrees with itself, so two attackers handed the
    same shard agree - hence: the group needs quorum + 1 agreeing replicas (capped
    at max_replicas), and a split vote among untrusted nodes is INCONCLUSIVE
    unless every dissenter differs BLATANTLY from the majority (cosine below
    cosine_min or a norm ratio beyond norm_ratio_max): no
    canonical, no flags (nobody is accused on the word of the untrusted), the
    shard is simply not aggregated (the hub's policy, hub/policy.decide_shard,
    drops it and trains its chunks again; ``review_round``'s ``score_only`` could
    score its members, which the hub does not do). With a trusted
    member, or ``trusted=None``, the plain majority rule below applies.

    ``spec`` is a VerificationSpec (quorum, max_replicas, tolerance). Two updates
    agree when their relative distance is <= tolerance. For each update, its
    cluster is the set of updates that agree with it; the largest cluster wins
    when it has >= quorum members AND is a strict majority of the group. Ties
    and too-small clusters ask for another replica while the group is smaller
    than ``max_replicas``; after that every update is flagged.
    Updates that claim a different shard than the first are rejected as a group
    error (the hub must not mix shards).
    """
    quorum = int(spec.quorum)
    max_replicas = int(spec.max_replicas)
    tolerance = float(spec.tolerance)
    n = len(records)
    ids = [r.update_id for r in records]
    base: dict[str, Any] = {"tolerance": tolerance, "quorum": quorum, "replicas": n}
    if n == 0:
        return ReplicaOutcome(False, [], [], True, {**base, "why": "no replicas yet"})
    shards = {r.shard_id for r in records}
    if len(shards) != 1:
        raise VerificationError(
            f"replica group mixes shards {sorted(shards)}: compare one shard at a time"
        )
    nodes = [r.node_id for r in records]
    if len(set(nodes)) != n:
        # The scheduler hands replicas to distinct nodes; a node's second copy
        # proves nothing, so only its first update counts as a replica.
        raise VerificationError(
            "replica group has two updates from one node: replicas must be distinct nodes"
        )

    dist = [[0.0] * n for _ in range(n)]
    pairs: list[dict[str, Any]] = []
    pages = PageReleaser()
    for i in range(n):
        for j in range(i + 1, n):
            key = (ids[i], ids[j])
            known = distances.get(key) if distances is not None else None
            if known is None:
                known = relative_distance(
                    records[i].delta, records[j].delta, slice_elems=slice_elems, pages=pages
                )
                if distances is not None:
                    distances[key] = known
            d, per = known
            dist[i][j] = dist[j][i] = d
            worst = sorted(per.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP_TENSORS]
            pairs.append(
                {
                    "a": ids[i],
                    "b": ids[j],
                    "relative_distance": _jsonable(d),
                    "agree": d <= tolerance,
                    "tensors": {k: _jsonable(v) for k, v in worst},
                }
            )
    clusters = [[j for j in range(n) if dist[i][j] <= tolerance] for i in range(n)]
    best_size = max(len(c) for c in clusters)
    # Distinct largest clusters (as sets): more than one means a tie, no majority.
    largest = {tuple(c) for c in clusters if len(c) == best_size}
    evidence = {**base, "pairs": pairs}
    untrusted_only = trusted is not None and not any(nd in trusted for nd in nodes)
    if untrusted_only:
        need = min(quorum + 1, max_replicas)
        evidence["untrusted_group"] = True
        if best_size < n:  # a split among untrusted nodes: nobody's word counts
            if n < max_replicas:
                return ReplicaOutcome(
                    False, [], [], True, {**evidence, "why": "split among untrusted nodes"}
                )
            blatant = _blatant_dissent(records, dist, largest, quorum, spec, slice_elems)
            evidence["blatant_dissent"] = blatant
            if not blatant:
                return ReplicaOutcome(
                    False,
                    [],
                    [],
                    False,
                    {**evidence, "why": "inconclusive: split among untrusted nodes"},
                )
            # Blatant dissent (e.g. a sign flip or a x10 update against two identical
            # updates): the plain majority rule decides. Should the majority be the bad
            # side, its canonical meets review_round, and the hub's vouching rule flags
            # the majority and withdraws the dissenter's flag.
        elif n < need:
            return ReplicaOutcome(
                False, [], [], True, {**evidence, "why": f"untrusted group needs {need} agreeing"}
            )
    if best_size >= quorum and 2 * best_size > n and len(largest) == 1:
        members = next(iter(largest))
        majority = [ids[i] for i in members]
        # Canonical: the medoid of the cluster (ties by update id) - any member would do
        # for bit-identical replicas, the medoid is the safest under tiny noise.
        canonical_idx = min(members, key=lambda i: (sum(dist[i][j] for j in members), ids[i]))
        flags = [
            Flag(
                ids[i],
                nodes[i],
                "replica_mismatch",
                {
                    "shard_id": records[i].shard_id,
                    "majority": majority,
                    "relative_distance_to_canonical": _jsonable(dist[i][canonical_idx]),
                    "tolerance": tolerance,
                    "pairs": [p for p in pairs if ids[i] in (p["a"], p["b"])],
                },
            )
            for i in range(n)
            if i not in members
        ]
        return ReplicaOutcome(True, majority, flags, False, evidence, ids[canonical_idx])
    if n < max_replicas:
        why = "fewer than quorum replicas" if n < quorum else "no majority yet"
        return ReplicaOutcome(False, [], [], True, {**evidence, "why": why})
    flags = [
        Flag(
            ids[i],
            nodes[i],
            "replica_mismatch",
            {
                "shard_id": records[i].shard_id,
                "majority": [],
                "why": f"no {quorum} of {n} replicas agree within tolerance",
                "tolerance": tolerance,
                "pairs": [p for p in pairs if ids[i] in (p["a"], p["b"])],
            },
        )
        for i in range(n)
    ]
    return ReplicaOutcome(
        False, [], flags, False, {**evidence, "why": "no majority at max_replicas"}
    )


def _blatant_dissent(
    records: Sequence[UpdateRecord],
    dist: list[list[float]],
    largest: set[tuple[int, ...]],
    quorum: int,
    spec: VerificationSpec,
    slice_elems: int,
) -> bool:
    """Does every update outside the strict-majority cluster differ from it in a way no
    honest hardware noise can (cosine < cosine_min, or norm ratio beyond norm_ratio_max
    either way)? Subtle differences (half a shard, poisoned labels) are not blatant."""
    n = len(records)
    if len(largest) != 1:
        return False
    members = next(iter(largest))
    if len(members) < quorum or 2 * len(members) <= n:
        return False
    cosine_min = float(spec.cosine_min)
    ratio_max = float(spec.norm_ratio_max)
    ref = min(members, key=lambda i: (sum(dist[i][j] for j in members), records[i].update_id))
    for i in range(n):
        if i in members:
            continue
        cos, ni, nr = cosine_and_norms(
            records[i].delta, records[ref].delta, slice_elems=slice_elems
        )
        ratio = ni / max(nr, EPS)
        if not (cos < cosine_min or ratio > ratio_max or ratio < 1.0 / ratio_max):
            return False
    return True


# --------------------------------------------------------------------------- round review


def size_allowance(samples: int | float, median_samples: float) -> float:
    """How much wider a norm-per-sample bound is for a shard of ``samples`` in a round whose
    median shard holds ``median_samples``: sqrt of the size ratio, either way (1 for a shard of
    the median size).

    An update's norm does not grow in proportion to its samples. Small shards are mostly
    gradient noise late in training (norm ~ sqrt(steps)), and early on momentum is still
    building up, so a large shard moves further per sample than a small one. Measured on the
    digits MLP from its initial state (SGD lr 0.05, momentum 0.9, batch 32), norm per sample
    relative to a 128-sample shard: 30 samples 0.67, 64 0.75, 256 1.36, 512 1.87, 1024 2.61
    (sqrt of the size ratio: 2.83); one CI round saw 4.62 for a 1024-sample shard against a
    round of 30- to 192-sample shards, which flagged an honest replica majority."""
    own = max(float(samples), 1.0)
    med = max(float(median_samples), 1.0)
    return math.sqrt(max(own, med) / min(own, med))


def _physical_min_train_s(r: UpdateRecord) -> float:
    """Fewest seconds the claimed training can take on this node (0 = unknown)."""
    if r.peak_flops <= 0 or r.param_count <= 0 or r.shard_samples <= 0:
        return 0.0
    flops = 6.0 * r.param_count * r.shard_samples * (r.local_epochs if r.local_epochs > 0 else 1)
    return flops / (r.peak_flops * FLOP_SAFETY)


def _implausible(r: UpdateRecord, norm: float) -> dict[str, Any] | None:
    problems: list[str] = []
    if r.path_length is not None and norm > r.path_length * (1.0 + PATH_SLACK) + EPS:
        problems.append(f"the update's norm {norm:.6g} exceeds the {r.path_length:.6g} its committed"
                        " segment norms add up to")
    if r.samples_claimed != r.shard_samples:
        problems.append(f"claims {r.samples_claimed} samples, shard holds {r.shard_samples}")
    if not math.isfinite(r.loss) or r.loss < 0:
        problems.append(f"loss {r.loss!r} is not a finite non-negative number")
    if not math.isfinite(r.train_s) or r.train_s <= 0:
        problems.append(f"train_s {r.train_s!r} is not a positive number")
    else:
        min_s = _physical_min_train_s(r)
        if min_s >= MIN_TIMING_S and r.train_s < min_s:
            problems.append(
                f"train_s {r.train_s:.4g} s is below the physical minimum {min_s:.4g} s "
                f"(6 x {r.param_count} params x {r.shard_samples} samples x {r.local_epochs:g} epochs "
                f"at {FLOP_SAFETY:g}x the node's benchmarked {r.peak_flops:.3g} FLOP/s)"
            )
        if r.elapsed_s is not None and r.train_s > r.elapsed_s + 1.0:
            problems.append(
                f"train_s {r.train_s:.4g} s exceeds the {r.elapsed_s:.4g} s between assignment and upload"
            )
    if not problems:
        return None
    return {
        "problems": problems,
        "samples_claimed": r.samples_claimed,
        "shard_samples": r.shard_samples,
        "loss": _jsonable(r.loss),
        "train_s": _jsonable(r.train_s),
        "node_samples_per_s": _jsonable(r.node_samples_per_s),
        "elapsed_s": None if r.elapsed_s is None else _jsonable(r.elapsed_s),
        "physical_min_train_s": _physical_min_train_s(r),
        "path_length": None if r.path_length is None else _jsonable(r.path_length),
    }


def review_round(
    records: Sequence[UpdateRecord],
    global_norm: float,
    spec: VerificationSpec,
    *,
    score_only: Sequence[UpdateRecord] = (),
    slice_elems: int = DEFAULT_SLICE_ELEMS,
) -> RoundReview:
    """Score every candidate update of a round; flag and quarantine the suspicious.

    ``score_only``: updates that are scored with the others (and may be flagged)
    but are never included — the members of replica groups that ended
    inconclusive (a split among untrusted nodes): nobody is accused on the
    word of the untrusted, but a sign-flipped or free-riding update in such a
    group is still caught by its own scores.

    ``global_norm`` is the L2 norm of the global model's floating tensors (the
    free-rider threshold is relative to it). ``spec`` is a VerificationSpec
    (cosine_min, norm_ratio_max, free_rider_norm).

    Order: free_rider and implausible first (they do not need the others); the
    robust centre (coordinate-wise median) and the median update norm are then
    computed over the remaining updates only, so zeros do not drag the centre;
    with fewer than MIN_OUTLIER_N of them outlier scoring is skipped.
    An update gets at most one flag (the first reason found).
    """
    cosine_min = float(spec.cosine_min)
    norm_ratio_max = float(spec.norm_ratio_max)
    free_rider_norm = float(spec.free_rider_norm)
    rider_floor = free_rider_norm * max(float(global_norm), 1.0)

    candidates = list(records)
    records = [*candidates, *score_only]
    flags: list[Flag] = []
    flagged: set[str] = set()
    norms: dict[str, float] = {}
    scores: dict[str, dict[str, Any]] = {}
    # Small rounds (many tiny updates): one (N, P) float64 matrix, a handful of
    # tensor ops instead of Python loops per update and tensor.
    matrix = _as_matrix(records)
    pages = PageReleaser() if matrix is None else None
    fast_norms = matrix.norm(dim=1).tolist() if matrix is not None else None
    for i, r in enumerate(records):
        nrm = fast_norms[i] if fast_norms is not None else _norm(r.delta, slice_elems, pages)
        norms[r.update_id] = nrm
        scores[r.update_id] = {"node_id": r.node_id, "norm": _jsonable(nrm)}
        if not math.isfinite(nrm) or nrm <= rider_floor:
            flags.append(
                Flag(
                    r.update_id,
                    r.node_id,
                    "free_rider",
                    {
                        "update_norm": _jsonable(nrm),
                        "threshold": rider_floor,
                        "global_norm": global_norm,
                    },
                )
            )
            flagged.add(r.update_id)
            continue
        bad = _implausible(r, nrm)
        if bad is not None:
            flags.append(Flag(r.update_id, r.node_id, "implausible", bad))
            flagged.add(r.update_id)

    rest = [r for r in records if r.update_id not in flagged]
    evidence: dict[str, Any] = {
        "n": len(records),
        "score_only": len(score_only),
        "scored": len(rest),
        "cosine_min": cosine_min,
        "norm_ratio_max": norm_ratio_max,
        "free_rider_threshold": rider_floor,
        "scores": scores,
    }
    if len(rest) < MIN_OUTLIER_N:
        evidence["outlier_scoring"] = (
            f"skipped: {len(rest)} updates < {MIN_OUTLIER_N}, median unreliable"
        )
    else:
        # Shards differ in size (the scheduler sizes them to each node's speed) and an
        # update's norm grows with the steps taken: compare norms per sample of the
        # shard (hub-known, not the claim), and take the centre of per-sample updates.
        # Under [train] lr_scaling a shard's lr factor counts too (UpdateRecord.work).
        per_sample = [1.0 / r.work for r in rest]
        fast_cos: list[float] | None = None
        if matrix is not None:
            row = {r.update_id: i for i, r in enumerate(records)}
            x = matrix[[row[r.update_id] for r in rest]]  # (n, P)
            scaled = x * torch.tensor(per_sample, dtype=torch.float64)[:, None]
            # numpy sorts short columns ~3x faster than torch's sort along dim 0
            scaled = torch.from_numpy(np.sort(scaled.numpy(), axis=0))
            m = scaled.shape[0]
            c = scaled[m // 2] if m % 2 else (scaled[m // 2 - 1] + scaled[m // 2]) * 0.5  # (P,)
            centre = _unflatten(c, rest[0].delta)
            cn = float(c.norm())
            fast_cos = [
                _cos(float(d), norms[r.update_id], cn)
                for d, r in zip((x @ c).tolist(), rest, strict=True)
            ]
        else:
            centre = coordinate_median(
                [r.delta for r in rest], factors=per_sample, slice_elems=slice_elems
            )
        unit = {r.update_id: norms[r.update_id] * f for r, f in zip(rest, per_sample, strict=True)}
        med_unit = median(list(unit.values()))
        evidence["outlier_scoring"] = "coordinate-wise median of per-sample updates"
        evidence["median_norm_per_sample"] = med_unit
        cosines: list[float] = []
        for i, r in enumerate(rest):
            if fast_cos is not None:
                cosines.append(fast_cos[i])
            else:
                cosines.append(_cosine_layers(r.delta, centre, slice_elems, pages)[0])
        # Late in training honest updates of small shards are mostly gradient noise and
        # point anywhere (measured down to -0.47 after 50 digits rounds): the spec's
        # cosine_min is relaxed to the round's own robust spread when that is wider.
        # A shard smaller than the round's median is a noisier estimate of the same
        # direction (noise ~ 1/sqrt(samples)): its allowance grows by sqrt(median/own).
        med_cos = median(cosines)
        spread = 1.4826 * median([abs(c - med_cos) for c in cosines])
        med_samples = median([float(max(r.shard_samples, 1)) for r in rest])
        evidence["cosine_median"] = med_cos
        evidence["cosine_spread"] = spread
        for i, r in enumerate(rest):
            cos, nrm = cosines[i], norms[r.update_id]
            widen = max(1.0, math.sqrt(med_samples / max(r.shard_samples, 1)))
            spec_floor = cosine_min * widen if cosine_min < 0 else cosine_min
            cos_floor = max(-1.0, min(spec_floor, med_cos - COSINE_SPREAD_K * spread * widen))
            ratio = unit[r.update_id] / max(med_unit, EPS)
            ratio_limit = norm_ratio_max * size_allowance(r.shard_samples, med_samples)
            scores[r.update_id].update({"cosine": _jsonable(cos), "norm_ratio": _jsonable(ratio)})
            why = []
            if cos < cos_floor:
                why.append(
                    f"cosine {cos:.3f} to the round's median < {cos_floor:.3f} "
                    f"(cosine_min {cosine_min:g}, round median {med_cos:.3f})"
                )
            if ratio > ratio_limit:
                why.append(
                    f"norm per sample {ratio:.2f}x the round's median > {ratio_limit:.3g}"
                    f" (norm_ratio_max {norm_ratio_max:g}, {r.shard_samples} samples"
                    f" vs the round's median {med_samples:g})"
                )
            if why:
                layers = _cosine_layers(r.delta, centre, slice_elems)[3]  # for the auditor
                flags.append(
                    Flag(
                        r.update_id,
                        r.node_id,
                        "outlier",
                        {
                            "problems": why,
                            "cosine": _jsonable(cos),
                            "cosine_threshold": cos_floor,
                            "norm_ratio": _jsonable(ratio),
                            "norm_ratio_limit": ratio_limit,
                            "update_norm": _jsonable(nrm),
                            "shard_samples": r.shard_samples,
                            "median_norm_per_sample": med_unit,
                            "scored_updates": len(rest),
                            # Per tensor, the centre scaled to this shard's samples so the
                            # norms compare like for like.
                            "layers": [
                                {
                                    "name": name,
                                    "norm": _jsonable(ln),
                                    "centre_norm": _jsonable(lc * r.work),
                                    "cosine": _jsonable(lcos),
                                }
                                for name, ln, lc, lcos in layers[:MAX_LAYERS_EVIDENCE]
                            ],
                        },
                    )
                )
                flagged.add(r.update_id)
    included = [r.update_id for r in candidates if r.update_id not in flagged]
    return RoundReview(included, flags, evidence)


# --------------------------------------------------------------------------- reputation


def record_agreement(rep: Reputation) -> Reputation:
    """The node's update was in an agreeing replica majority."""
    return replace(
        rep,
        consecutive_agreements=rep.consecutive_agreements + 1,
        agreements_total=rep.agreements_total + 1,
    )


def record_flag(rep: Reputation) -> Reputation:
    """Any flag (before any verdict) resets the run of agreements: trust is re-earned."""
    return replace(rep, consecutive_agreements=0, flags_total=rep.flags_total + 1)


def record_missed(rep: Reputation) -> Reputation:
    """The node did not come back for a referee's request (offline): its update was left out,
    and it must earn trust again (its run of agreements starts over); no flag, nothing counted
    against it. A cheater that goes quiet whenever it is checked gains nothing by it."""
    return replace(rep, consecutive_agreements=0)


def record_withdrawn(rep: Reputation, run_before: int) -> Reputation:
    """A flag was withdrawn (the node was the outvoted honest minority): the run of agreements
    the flag reset is given back, on top of any agreements earned since."""
    return replace(rep, consecutive_agreements=rep.consecutive_agreements + max(0, run_before))


def record_verdict(
    rep: Reputation, verdict: str, *, ban_after: int = BAN_AFTER_CONFIRMED
) -> Reputation:
    """An auditor's verdict on one of the node's flags.

    ``confirm`` counts against the node and bans it at ``ban_after`` confirmed
    flags; ``dismiss`` is recorded but does not restore the reset run (the run
    measures verified agreement, which a dismissed flag is not).
    """
    if verdict == "confirm":
        confirmed = rep.confirmed_flags + 1
        return replace(rep, confirmed_flags=confirmed, banned=rep.banned or confirmed >= ban_after)
    if verdict == "dismiss":
        return replace(rep, dismissed_flags=rep.dismissed_flags + 1)
    raise VerificationError(f"verdict must be 'confirm' or 'dismiss', got {verdict!r}")


def replication_probability(rep: Reputation, spec: VerificationSpec) -> float:
    """Probability that a shard given to this node is replicated.

    ``replication`` a float in [0, 1]: that fixed fraction. ``"adaptive"`` (BOINC's
    adaptive replication applied to updates): 1.0 until the node has
    ``trust_after`` consecutive agreeing replicas, then max(MIN_REPLICATION, 1/run)
    so trusted nodes still get spot-checked and overhead stays bounded.
    """
    mode = spec.replication
    if rep.banned:
        return 1.0
    if isinstance(mode, str):
        if mode != "adaptive":
            raise VerificationError(
                f"verification.replication must be 'adaptive' or 0..1, got {mode!r}"
            )
        run = rep.consecutive_agreements
        if run < int(spec.trust_after) or rep.probation:
            return 1.0
        return max(MIN_REPLICATION, 1.0 / run)
    p = float(mode)
    if not (0.0 <= p <= 1.0):
        raise VerificationError(
            f"verification.replication must be 'adaptive' or 0..1, got {mode!r}"
        )
    return p


def is_trusted(rep: Reputation, spec: VerificationSpec) -> bool:
    """A run of ``trust_after`` consecutive agreeing replicas, past probation, and not banned."""
    return not rep.banned and not rep.probation and rep.consecutive_agreements >= int(spec.trust_after)


def replica_candidates(
    reps: Mapping[str, Reputation],
    exclude: Collection[str],
    spec: VerificationSpec,
) -> list[str]:
    """Nodes that may take the next replica of a group (``exclude`` = its members),
    sorted by id. Push model: ``rng.choice`` of it; pull model: give the replica to a
    requesting node only if it is in this list (computed over the online nodes).

    Replicas exist to check untrusted work, and two untrusted nodes that agree
    prove little (a deterministic attack agrees with itself, colluders agree on
    purpose). So: trusted nodes only, when any is available; before anyone is
    trusted, the upper half of nodes by their run of agreements (honest nodes
    build runs from the first round; caught nodes sit at 0).
    """
    pool = {n: r for n, r in reps.items() if n not in exclude and not r.banned}
    trusted = sorted(n for n, r in pool.items() if is_trusted(r, spec))
    if trusted:
        return trusted
    if not pool:
        return []
    runs = sorted((r.consecutive_agreements for r in pool.values()), reverse=True)
    cut = runs[(len(runs) - 1) // 2]  # the median run: ties at the cut stay eligible
    return sorted(n for n, r in pool.items() if r.consecutive_agreements >= cut)


class ReplicaPool:
    """``replica_candidates`` over one set of online reputations, asked many times.

    ``eligible(node, exclude)`` equals ``node in replica_candidates(reps, exclude, spec)`` and
    ``anyone(exclude)`` equals ``bool(replica_candidates(reps, exclude, spec))``, each in
    O(|exclude| log n) instead of O(n log n): the scheduler asks once per pending replica per
    work request, which made a round of n nodes cost O(n^2 log n) (bench/simulation.py).
    """

    def __init__(self, reps: Mapping[str, Reputation], spec: VerificationSpec) -> None:
        self.reps = {n: r for n, r in reps.items() if not r.banned}
        self.trusted = frozenset(n for n, r in self.reps.items() if is_trusted(r, spec))
        self.runs = sorted(r.consecutive_agreements for r in self.reps.values())  # ascending

    def _members(self, exclude: Collection[str]) -> list[str]:
        return [e for e in exclude if e in self.reps]

    def anyone(self, exclude: Collection[str]) -> bool:
        return len(self.reps) > len(self._members(exclude))

    def ruled_out(self, node_id: str, most_excluded: int) -> bool:
        """True when ``eligible(node_id, exclude)`` is False for every ``exclude`` of at most
        ``most_excluded`` nodes: a pre-filter that lets a caller skip asking shard by shard.

        Untrusted while more trusted nodes are online than can be excluded: the first rule
        always applies. Otherwise the cut is the median of the runs left after removing at
        most ``most_excluded``; removing g values never lowers the k-th smallest, so the cut
        is at least ``runs[k(g)]``, and k(g) shrinks as g grows: below ``runs[k(most)]``, never.
        """
        rep = self.reps.get(node_id)
        if rep is None:
            return True
        if node_id in self.trusted:
            return False
        if len(self.trusted) > most_excluded:
            return True
        m = len(self.runs) - max(0, most_excluded)
        if m < 1:
            return False
        return rep.consecutive_agreements < self.runs[m - 1 - (m - 1) // 2]

    def eligible(self, node_id: str, exclude: Collection[str]) -> bool:
        rep = self.reps.get(node_id)
        if rep is None or node_id in exclude:
            return False
        gone = self._members(exclude)
        if len(self.trusted) > sum(1 for e in gone if e in self.trusted):
            return node_id in self.trusted
        # the median run of the pool without `gone`: replica_candidates' cut, found in the sorted runs
        m = len(self.runs) - len(gone)
        k = m - 1 - (m - 1) // 2  # its index in ascending order
        taken: list[int] = []
        for v in sorted(self.reps[e].consecutive_agreements for e in gone):
            pos = bisect.bisect_left(self.runs, v)
            while pos in taken:
                pos += 1
            taken.append(pos)
        j = k
        for p in sorted(taken):
            if p <= j:
                j += 1
        while j in taken:
            j += 1
        return rep.consecutive_agreements >= self.runs[j]


def should_replicate(rep: Reputation, spec: VerificationSpec, rng: _Rng) -> bool:
    """Draw once from ``rng`` (e.g. random.Random seeded by the hub) against
    ``replication_probability``. A new node (run 0) is always replicated in
    adaptive mode, without consuming a draw."""
    p = replication_probability(rep, spec)
    if p >= 1.0:
        return True
    if p <= 0.0:
        return False
    return rng.random() < p


# --------------------------------------------------------------------------- helpers


FAST_ELEMS = 1 << 22  # N x P at most this (32 MB of float64): score as one matrix


def _as_matrix(records: Sequence[UpdateRecord]) -> Tensor | None:
    """(N, P) float64 rows of the floating tensors, or None when too big / ragged.

    Filled through numpy: a torch operator a tensor (reshape, to, cat) releases the GIL, and on the
    round engine's thread each one then waits for the busy event loop (1,000 small updates took
    0.17 s this way beside a serving hub); numpy views and copies do not let go of it."""
    if not records:
        return None
    keys = floating_keys(records[0].delta)
    sizes = [math.prod(records[0].delta[k].shape) for k in keys]
    p = sum(sizes)
    if p == 0 or len(records) * p > FAST_ELEMS:
        return None
    out = np.empty((len(records), p), dtype=np.float64)
    for i, r in enumerate(records):
        if _same_layout(records[0].delta, r.delta) is None:
            return None  # the per-update path reports the mismatch
        start = 0
        for k, n in zip(keys, sizes, strict=True):
            t = r.delta[k]
            t = t.detach() if t.requires_grad else t
            out[i, start:start + n] = (t.numpy() if t.dtype != torch.bfloat16 else t.to(torch.float64).numpy()).reshape(-1)
            start += n
    return torch.from_numpy(out)


def _unflatten(flat: Tensor, like: Mapping[str, Tensor]) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    start = 0
    for k in floating_keys(like):
        n = like[k].numel()
        out[k] = flat[start : start + n].reshape(like[k].shape)
        start += n
    return out


def _jsonable(x: float) -> float | str:
    """Evidence goes to JSON: non-finite floats become strings."""
    return x if math.isfinite(x) else repr(x)
