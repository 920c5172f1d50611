"""The round review: free-rider, plausibility and outlier scores of a round's candidate updates.

``review_round`` scores every candidate update of a round against the others (a robust
centre: the coordinate-wise median of per-sample updates) and flags the suspicious; flagged
updates are quarantined, the rest are aggregated. The calibration of its thresholds is in
hub/policy/verification.py's docstring and docs/verification.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any

import numpy as np
import torch
from gpuflex.protocol.jobspec import VerificationSpec
from torch import Tensor

from .aggregation import DEFAULT_SLICE_ELEMS, PageReleaser, coordinate_median, floating_keys
from .distances import cosine, cosine_layers, same_layout, update_norm
from .update_record import EPS, Flag, UpdateRecord, jsonable

__all__ = ["MIN_OUTLIER_N", "RoundReview", "review_round", "size_allowance"]

MIN_OUTLIER_N = 3  # below this the round's median is no robust centre
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


@dataclass(frozen=True)
class RoundReview:
    """``included``: update ids to aggregate, in input order. ``flags``: the rest.
    ``norms``: every scored update's L2 norm, by update id (in ``evidence["scores"]`` as JSON)."""

    included: list[str]
    flags: list[Flag]
    evidence: dict[str, Any]
    norms: Mapping[str, float] = field(default_factory=dict)


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
        problems.append(
            f"the update's norm {norm:.6g} exceeds the {r.path_length:.6g} its committed"
            " segment norms add up to"
        )
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
        "loss": jsonable(r.loss),
        "train_s": jsonable(r.train_s),
        "node_samples_per_s": jsonable(r.node_samples_per_s),
        "elapsed_s": None if r.elapsed_s is None else jsonable(r.elapsed_s),
        "physical_min_train_s": _physical_min_train_s(r),
        "path_length": None if r.path_length is None else jsonable(r.path_length),
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
    free_rider_norm = float(spec.free_rider_norm)
    rider_floor = free_rider_norm * max(float(global_norm), 1.0)

    candidates = list(records)
    records = [*candidates, *score_only]
    # Small rounds (many tiny updates): one (N, P) float64 matrix, a handful of
    # tensor ops instead of Python loops per update and tensor.
    matrix = _as_matrix(records)
    pages = PageReleaser() if matrix is None else None
    fast_norms = matrix.norm(dim=1).tolist() if matrix is not None else None
    norms: dict[str, float] = {}
    scores: dict[str, dict[str, Any]] = {}
    flags: list[Flag] = []
    for i, r in enumerate(records):
        nrm = fast_norms[i] if fast_norms is not None else update_norm(r.delta, slice_elems, pages)
        norms[r.update_id] = nrm
        scores[r.update_id] = {"node_id": r.node_id, "norm": jsonable(nrm)}
        flag = _screen(r, nrm, rider_floor, global_norm)
        if flag is not None:
            flags.append(flag)
    flagged = {f.update_id for f in flags}
    rest = [r for r in records if r.update_id not in flagged]
    evidence: dict[str, Any] = {
        "n": len(records),
        "score_only": len(score_only),
        "scored": len(rest),
        "cosine_min": float(spec.cosine_min),
        "norm_ratio_max": float(spec.norm_ratio_max),
        "free_rider_threshold": rider_floor,
        "scores": scores,
    }
    if len(rest) < MIN_OUTLIER_N:
        evidence["outlier_scoring"] = (
            f"skipped: {len(rest)} updates < {MIN_OUTLIER_N}, median unreliable"
        )
    else:
        centre, cosines = _centre(records, rest, matrix, norms, slice_elems, pages)
        outliers = _score_outliers(rest, centre, cosines, norms, spec, slice_elems)
        evidence.update(outliers.evidence)
        for uid, more in outliers.scores.items():
            scores[uid].update(more)
        flags.extend(outliers.flags)
        flagged.update(f.update_id for f in outliers.flags)
    included = [r.update_id for r in candidates if r.update_id not in flagged]
    return RoundReview(included, flags, evidence, norms)


def _screen(r: UpdateRecord, nrm: float, rider_floor: float, global_norm: float) -> Flag | None:
    """The checks an update fails on its own: free_rider (a near-zero or non-finite update),
    then implausible (claims that do not fit its shard)."""
    if not math.isfinite(nrm) or nrm <= rider_floor:
        return Flag(
            r.update_id,
            r.node_id,
            "free_rider",
            {
                "update_norm": jsonable(nrm),
                "threshold": rider_floor,
                "global_norm": global_norm,
            },
        )
    bad = _implausible(r, nrm)
    return None if bad is None else Flag(r.update_id, r.node_id, "implausible", bad)


def _centre(
    records: Sequence[UpdateRecord],
    rest: Sequence[UpdateRecord],
    matrix: Tensor | None,
    norms: Mapping[str, float],
    slice_elems: int,
    pages: PageReleaser | None,
) -> tuple[dict[str, Tensor], list[float]]:
    """The robust centre of the scored updates (``rest``): the coordinate-wise median of
    their per-sample updates, and each one's cosine to it.

    Shards differ in size (the scheduler sizes them to each node's speed) and an
    update's norm grows with the steps taken: compare norms per sample of the
    shard (hub-known, not the claim), and take the centre of per-sample updates.
    Under [train] lr_scaling a shard's lr factor counts too (UpdateRecord.work).
    ``matrix``: every record's row (``_as_matrix``), or None for the sliced path."""
    per_sample = [1.0 / r.work for r in rest]
    if matrix is None:
        centre = coordinate_median(
            [r.delta for r in rest], factors=per_sample, slice_elems=slice_elems
        )
        return centre, [cosine_layers(r.delta, centre, slice_elems, pages)[0] for r in rest]
    row = {r.update_id: i for i, r in enumerate(records)}
    x = matrix[[row[r.update_id] for r in rest]]  # (n, P)
    scaled = x * torch.tensor(per_sample, dtype=torch.float64)[:, None]
    # numpy sorts short columns ~3x faster than torch's sort along dim 0
    scaled = torch.from_numpy(np.sort(scaled.numpy(), axis=0))
    m = scaled.shape[0]
    c = scaled[m // 2] if m % 2 else (scaled[m // 2 - 1] + scaled[m // 2]) * 0.5  # (P,)
    cn = float(c.norm())
    cosines = [
        cosine(float(d), norms[r.update_id], cn)
        for d, r in zip((x @ c).tolist(), rest, strict=True)
    ]
    return _unflatten(c, rest[0].delta), cosines


@dataclass(frozen=True)
class _Outliers:
    """What outlier scoring adds: its flags, the round's evidence entries and, by update id,
    the entries of that update's scores."""

    flags: tuple[Flag, ...]
    evidence: dict[str, Any]
    scores: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class _Limits:
    """The round's figures an update's cosine and norm per sample are held against."""

    cosine_min: float
    norm_ratio_max: float
    median_cosine: float
    spread: float
    median_samples: float
    median_unit: float

    def cosine_floor(self, r: UpdateRecord) -> float:
        # A shard smaller than the round's median is a noisier estimate of the same
        # direction (noise ~ 1/sqrt(samples)): its allowance grows by sqrt(median/own).
        widen = max(1.0, math.sqrt(self.median_samples / max(r.shard_samples, 1)))
        spec_floor = self.cosine_min * widen if self.cosine_min < 0 else self.cosine_min
        return max(
            -1.0, min(spec_floor, self.median_cosine - COSINE_SPREAD_K * self.spread * widen)
        )

    def ratio_limit(self, r: UpdateRecord) -> float:
        return self.norm_ratio_max * size_allowance(r.shard_samples, self.median_samples)


def _score_outliers(
    rest: Sequence[UpdateRecord],
    centre: Mapping[str, Tensor],
    cosines: Sequence[float],
    norms: Mapping[str, float],
    spec: VerificationSpec,
    slice_elems: int,
) -> _Outliers:
    """Flag the scored updates (``rest``) whose cosine to the round's centre or norm per sample
    falls outside the round's limits (``_Limits``)."""
    unit = {r.update_id: norms[r.update_id] * (1.0 / r.work) for r in rest}  # per sample
    # Late in training honest updates of small shards are mostly gradient noise and
    # point anywhere (measured down to -0.47 after 50 digits rounds): the spec's
    # cosine_min is relaxed to the round's own robust spread when that is wider.
    med_cos = median(cosines)
    limits = _Limits(
        cosine_min=float(spec.cosine_min),
        norm_ratio_max=float(spec.norm_ratio_max),
        median_cosine=med_cos,
        spread=1.4826 * median([abs(c - med_cos) for c in cosines]),
        median_samples=median([float(max(r.shard_samples, 1)) for r in rest]),
        median_unit=median(list(unit.values())),
    )
    evidence = {
        "outlier_scoring": "coordinate-wise median of per-sample updates",
        "median_norm_per_sample": limits.median_unit,
        "cosine_median": med_cos,
        "cosine_spread": limits.spread,
    }
    scores: dict[str, dict[str, Any]] = {}
    flags: list[Flag] = []
    for r, cos in zip(rest, cosines, strict=True):
        ratio = unit[r.update_id] / max(limits.median_unit, EPS)
        scores[r.update_id] = {"cosine": jsonable(cos), "norm_ratio": jsonable(ratio)}
        flag = _outlier_flag(
            r, cos, ratio, norms[r.update_id], limits, centre, len(rest), slice_elems
        )
        if flag is not None:
            flags.append(flag)
    return _Outliers(tuple(flags), evidence, scores)


def _outlier_flag(
    r: UpdateRecord,
    cos: float,
    ratio: float,
    nrm: float,
    limits: _Limits,
    centre: Mapping[str, Tensor],
    scored: int,
    slice_elems: int,
) -> Flag | None:
    """The outlier flag of one scored update (None: within the limits), with per-tensor
    evidence for the auditor."""
    cos_floor, ratio_limit = limits.cosine_floor(r), limits.ratio_limit(r)
    why = []
    if cos < cos_floor:
        why.append(
            f"cosine {cos:.3f} to the round's median < {cos_floor:.3f} "
            f"(cosine_min {limits.cosine_min:g}, round median {limits.median_cosine:.3f})"
        )
    if ratio > ratio_limit:
        why.append(
            f"norm per sample {ratio:.2f}x the round's median > {ratio_limit:.3g}"
            f" (norm_ratio_max {limits.norm_ratio_max:g}, {r.shard_samples} samples"
            f" vs the round's median {limits.median_samples:g})"
        )
    if not why:
        return None
    layers = cosine_layers(r.delta, centre, slice_elems)[3]
    return Flag(
        r.update_id,
        r.node_id,
        "outlier",
        {
            "problems": why,
            "cosine": jsonable(cos),
            "cosine_threshold": cos_floor,
            "norm_ratio": jsonable(ratio),
            "norm_ratio_limit": ratio_limit,
            "update_norm": jsonable(nrm),
            "shard_samples": r.shard_samples,
            "median_norm_per_sample": limits.median_unit,
            "scored_updates": scored,
            # Per tensor, the centre scaled to this shard's samples so the
            # norms compare like for like.
            "layers": [
                {
                    "name": name,
                    "norm": jsonable(ln),
                    "centre_norm": jsonable(lc * r.work),
                    "cosine": jsonable(lcos),
                }
                for name, ln, lc, lcos in layers[:MAX_LAYERS_EVIDENCE]
            ],
        },
    )


# --------------------------------------------------------------------------- the (N, P) matrix


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
        if same_layout(records[0].delta, r.delta) is None:
            return None  # the per-update path reports the mismatch
        start = 0
        for k, n in zip(keys, sizes, strict=True):
            t = r.delta[k]
            t = t.detach() if t.requires_grad else t
            out[i, start : start + n] = (
                t.numpy() if t.dtype != torch.bfloat16 else t.to(torch.float64).numpy()
            ).reshape(-1)
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
