"""Aggregation rules: weighted FedAvg and the robust rules (the server optimizers that step the
model by their result are in server_optimizer.py, the strategies that use both in strategy.py).

Pure math: every public function takes updates in and returns a new
result; nothing passed in is ever mutated, reordered or popped.

Memory. The hub hands us zero-copy mmap views of update blobs, so an update is
never "loaded": this module walks each floating tensor in flat slices of
``slice_elems`` elements and touches only one slice of every update at a time.

- ``fedavg`` streams: one float64 accumulator slice plus the output model,
  i.e. O(slice) + O(model) regardless of N.
- ``median``, ``trimmed_mean`` need all N values of a coordinate at once:
  O(N x slice) + O(model).
- ``krum`` accumulates the N x N pairwise squared distances slice by slice
  (O(N x slice) + O(N^2)), then averages the selected updates streaming.
- clipping computes each update's L2 norm in a streaming pass first and scales
  slices on the fly (no clipped copy of an update is ever made).
- pages of the read-only blob mappings are dropped from the resident set once
  consumed (`PageReleaser`, pages.py), so peak RSS does not grow with N
  (bench/aggregate.py measures it).
- models of at most SMALL_MODEL_ELEMS elements take a flat path in fedavg (one
  row per update): same operations, same bits, far fewer Python calls.

Determinism. Updates are always visited in the order given; accumulation is in
float64 per slice and cast to the delta's dtype at the end, so the same inputs in
the same order produce bit-identical outputs whatever ``slice_elems`` is (for
fedavg/median/trimmed mean exactly; Krum's selection compares float64 sums whose
association depends on the slicing, but ties aside the selection is the same).

Limits on the number of Byzantine updates ``f`` each robust rule tolerates, and
enforced here with ``AggregationError``:

- coordinate-wise median: breaks down at f >= n/2 (needs n >= 1; meaningful for
  n >= 3).
- trimmed mean with ``beta``: drops k = floor(beta * n) lowest and highest values
  per coordinate; needs 2k < n (implied by 0 <= beta < 0.5, which is enforced)
  and tolerates f <= k.
- Krum / multi-Krum with ``f``: needs n > 2f + 2 (Blanchard et al. 2017);
  multi-Krum's ``m`` must be in 1..n - f.

Non-floating tensors (e.g. BatchNorm's ``num_batches_tracked``) are not
aggregated and are omitted from the result: the hub keeps the global value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from gpuflex.protocol.jobspec import METHODS as JOBSPEC_METHODS
from gpuflex.protocol.jobspec import AggregationSpec
from torch import Tensor

from ..base.errors import HubError
from .pages import PageReleaser, readonly_mapping

__all__ = [
    "METHODS",
    "Aggregation",
    "AggregationError",
    "PageReleaser",
    "aggregate",
    "aggregate_detailed",
    "bulyan",
    "bulyan_select",
    "clip_factors",
    "coordinate_median",
    "fedavg",
    "floating_keys",
    "krum_select",
    "pairwise_sq_distances",
    "readonly_mapping",
    "trimmed_mean",
    "update_norm",
]

METHODS = JOBSPEC_METHODS  # the job spec's list (protocol/jobspec.py)
DEFAULT_SLICE_ELEMS = 1 << 20
FEDAVG_BLOCK_ELEMS = 1 << 16
SMALL_MODEL_ELEMS = 1 << 16  # fedavg flattens whole updates below this


class AggregationError(HubError):
    """An aggregation rule cannot run on these inputs (one actionable line)."""

    status = 422
    code = "aggregation_error"


@dataclass(frozen=True)
class Aggregation:
    """What ``aggregate_detailed`` produced and why.

    ``selected`` are the indices (into the caller's list) that entered the final
    average: all of them for fedavg/median/trimmed mean, Krum's choice otherwise.
    ``clip_factors`` is the scale applied to each update (1.0 = untouched).
    """

    delta: dict[str, Tensor]
    method: str
    selected: list[int]
    clip_factors: list[float]
    scores: list[float] = field(default_factory=list)  # Krum scores, else empty


# --------------------------------------------------------------------------- helpers


def floating_keys(delta: Mapping[str, Tensor]) -> list[str]:
    """Names of the floating tensors of ``delta`` in its own order."""
    return [k for k, t in delta.items() if t.dtype.is_floating_point]  # the dtype's flag: no torch call


def _check_layout(deltas: Sequence[Mapping[str, Tensor]]) -> list[str]:
    """All updates must carry the same floating tensors with the same shapes/dtypes."""
    if len(deltas) == 0:
        raise AggregationError(
            "no updates to aggregate: a round needs at least one accepted update"
        )
    keys = floating_keys(deltas[0])
    if not keys:
        raise AggregationError("updates carry no floating tensors: nothing to aggregate")
    ref = [(k, deltas[0][k].shape, deltas[0][k].dtype) for k in keys]
    key_set = set(keys)
    for i, d in enumerate(deltas[1:], start=1):
        other = floating_keys(d)
        if other != keys and set(other) != key_set:
            missing = sorted(set(keys) - set(other))
            extra = sorted(set(other) - set(keys))
            raise AggregationError(
                f"update {i} has different tensors than update 0 (missing {missing[:3]}, extra {extra[:3]})"
            )
        for k, shape, dtype in ref:
            t = d[k]
            if t.dtype is not dtype or t.shape != shape:
                raise AggregationError(
                    f"update {i} tensor {k!r} is {t.dtype} {tuple(t.shape)}, "
                    f"update 0 has {dtype} {tuple(shape)}"
                )
    return keys


def _check_slice(slice_elems: int) -> None:
    if not isinstance(slice_elems, int) or slice_elems < 1:
        raise AggregationError(f"slice_elems must be a positive int, got {slice_elems!r}")


def _flat(t: Tensor) -> Tensor:
    # A view for contiguous tensors (the mmap'd blobs are); a copy of one tensor otherwise.
    return t.reshape(-1)


def _slices(numel: int, slice_elems: int) -> Iterator[tuple[int, int]]:
    for start in range(0, numel, slice_elems):
        yield start, min(numel, start + slice_elems)




def _stack(
    flats: Sequence[Tensor],
    start: int,
    end: int,
    factors: Sequence[float] | None,
    pages: PageReleaser | None = None,
) -> Tensor:
    """(N, end-start) float64 copy of one slice of every update, clipped if asked."""
    out = torch.empty((len(flats), end - start), dtype=torch.float64)
    for i, f in enumerate(flats):
        out[i].copy_(f[start:end])
        if pages is not None:
            pages.release(f, start, end)
        if factors is not None and factors[i] != 1.0:
            out[i].mul_(factors[i])
    return out


def update_norm(delta: Mapping[str, Tensor], *, slice_elems: int = DEFAULT_SLICE_ELEMS) -> float:
    """L2 norm over all floating tensors of one update, streaming, float64."""
    _check_slice(slice_elems)
    pages = PageReleaser()
    total = 0.0
    for k in floating_keys(delta):
        flat = _flat(delta[k])
        for s, e in _slices(flat.numel(), slice_elems):
            part = flat[s:e].to(torch.float64)
            total += float(torch.dot(part, part))
            pages.release(flat, s, e)
    return math.sqrt(total)


def clip_factors(
    deltas: Sequence[Mapping[str, Tensor]],
    clip_norm: float,
    *,
    slice_elems: int = DEFAULT_SLICE_ELEMS,
) -> list[float]:
    """Per-update scale so that no update's L2 norm exceeds ``clip_norm`` (0 = off)."""
    if clip_norm < 0 or not math.isfinite(clip_norm):
        raise AggregationError(f"clip_norm must be finite and >= 0, got {clip_norm}")
    if clip_norm == 0:
        return [1.0] * len(deltas)
    out = []
    for d in deltas:
        n = update_norm(d, slice_elems=slice_elems)
        out.append(1.0 if n <= clip_norm else clip_norm / n)
    return out


def _normalized_weights(weights: Sequence[float], n: int) -> list[float]:
    if len(weights) != n:
        raise AggregationError(f"got {n} updates but {len(weights)} weights")
    w = [float(x) for x in weights]
    if any(not math.isfinite(x) or x < 0 for x in w):
        raise AggregationError("weights (sample counts) must be finite and >= 0")
    total = math.fsum(w)
    if total <= 0:
        raise AggregationError("weights (sample counts) sum to zero: nothing to average")
    return [x / total for x in w]


def _finite_or_raise(key: str, values: Tensor) -> None:
    if not bool(torch.isfinite(values).all()):
        raise AggregationError(
            f"aggregate of tensor {key!r} is not finite: an update holds inf/nan"
        )


# --------------------------------------------------------------------------- rules


def fedavg(
    deltas: Sequence[Mapping[str, Tensor]],
    weights: Sequence[float],
    *,
    factors: Sequence[float] | None = None,
    slice_elems: int = DEFAULT_SLICE_ELEMS,
) -> dict[str, Tensor]:
    """Weighted mean sum_i w_i * d_i / sum_i w_i, streaming and deterministic.

    ``weights`` are sample counts (any non-negative scale). ``factors`` are
    optional per-update clip scales. Memory: one float64 slice + the output.
    """
    keys = _check_layout(deltas)
    _check_slice(slice_elems)
    w = _normalized_weights(weights, len(deltas))
    pages = PageReleaser()
    if factors is not None:
        w = [wi * fi for wi, fi in zip(w, factors, strict=True)]
    total = sum(deltas[0][k].numel() for k in keys)
    if total <= SMALL_MODEL_ELEMS:
        return _fedavg_small(deltas, keys, w, total)
    # Accumulate in blocks that keep the float64 accumulator in L2 cache (2x faster
    # than 1M-element blocks); the per-coordinate order, hence every bit, is the same.
    block = min(slice_elems, FEDAVG_BLOCK_ELEMS)
    out: dict[str, Tensor] = {}
    for k in keys:
        ref = deltas[0][k]
        result = torch.empty(ref.shape, dtype=ref.dtype)
        rflat = result.view(-1)
        flats = [_flat(d[k]) for d in deltas]
        pages.release_all(flats)
        tmp = torch.empty(block, dtype=torch.float64)
        for s, e in _slices(rflat.numel(), block):
            acc = torch.zeros(e - s, dtype=torch.float64)
            buf = tmp[: e - s]
            for wi, f in zip(w, flats, strict=True):
                if wi != 0.0:
                    buf.copy_(f[s:e])  # a vectorized cast; same bits as a promoting add
                    acc.add_(buf, alpha=wi)
                pages.release(f, s, e)
            _finite_or_raise(k, acc)
            rflat[s:e].copy_(acc)
        out[k] = result
    return out


def _fedavg_small(
    deltas: Sequence[Mapping[str, Tensor]], keys: list[str], w: Sequence[float], total: int
) -> dict[str, Tensor]:
    """fedavg for small models, many updates: numpy on the same (zero-copy) buffers,
    ~1 us per call instead of torch's per-op overhead. Same operations in the same
    order as the block path (cast to float64, scale by w_i, add): the same bits."""
    acc = np.zeros(total, dtype=np.float64)
    row = np.empty(total, dtype=np.float64)
    bounds = []
    start = 0
    for k in keys:
        bounds.append((k, start, start + deltas[0][k].numel()))
        start += deltas[0][k].numel()
    for wi, d in zip(w, deltas, strict=True):
        if wi == 0.0:
            continue
        for k, lo, hi in bounds:
            row[lo:hi] = d[k].detach().numpy().reshape(-1)
        row *= wi
        acc += row
    if not np.isfinite(acc).all():
        raise AggregationError("aggregate is not finite: an update holds inf/nan")
    out: dict[str, Tensor] = {}
    for k, lo, hi in bounds:
        ref = deltas[0][k]
        out[k] = torch.from_numpy(acc[lo:hi].copy()).to(ref.dtype).reshape(ref.shape)
    return out


def _per_coordinate(
    deltas: Sequence[Mapping[str, Tensor]],
    reduce: Callable[[Tensor], Tensor],
    factors: Sequence[float] | None,
    slice_elems: int,
) -> dict[str, Tensor]:
    """Each floating tensor, slice by slice: ``reduce`` maps the (N, slice) float64 stack of the
    updates' values to that slice of the result (checked finite, cast to the tensor's dtype)."""
    keys = _check_layout(deltas)
    _check_slice(slice_elems)
    pages = PageReleaser()
    out: dict[str, Tensor] = {}
    for k in keys:
        ref = deltas[0][k]
        result = torch.empty(ref.shape, dtype=ref.dtype)
        rflat = result.view(-1)
        flats = [_flat(d[k]) for d in deltas]
        pages.release_all(flats)
        for s, e in _slices(rflat.numel(), slice_elems):
            value = reduce(_stack(flats, s, e, factors, pages))
            _finite_or_raise(k, value)
            rflat[s:e].copy_(value)
        out[k] = result
    return out


def coordinate_median(
    deltas: Sequence[Mapping[str, Tensor]],
    *,
    factors: Sequence[float] | None = None,
    slice_elems: int = DEFAULT_SLICE_ELEMS,
) -> dict[str, Tensor]:
    """Coordinate-wise median (mean of the two middle values when n is even).

    Unweighted by design: weighting would let one node claiming many samples
    move the median. Tolerates f < n/2 arbitrary updates per coordinate.
    """
    n = len(deltas)

    def median(x: Tensor) -> Tensor:
        srt = x.sort(dim=0).values
        return srt[n // 2] if n % 2 == 1 else (srt[n // 2 - 1] + srt[n // 2]) * 0.5

    return _per_coordinate(deltas, median, factors, slice_elems)


def trimmed_mean(
    deltas: Sequence[Mapping[str, Tensor]],
    beta: float,
    *,
    factors: Sequence[float] | None = None,
    slice_elems: int = DEFAULT_SLICE_ELEMS,
) -> dict[str, Tensor]:
    """Coordinate-wise mean after dropping the k = floor(beta*n) lowest and highest.

    Requires 0 <= beta < 0.5 and 2k < n. Tolerates f <= k Byzantine updates.
    Unweighted (as in Yin et al. 2018).
    """
    _check_layout(deltas)
    _check_slice(slice_elems)
    n = len(deltas)
    if not (0.0 <= beta < 0.5):
        raise AggregationError(f"trim_beta must be in [0, 0.5), got {beta}")
    k_trim = math.floor(beta * n)
    if 2 * k_trim >= n:
        raise AggregationError(
            f"trimmed mean with beta={beta} drops {2 * k_trim} of {n} updates: needs 2*floor(beta*n) < n"
        )

    def trimmed(x: Tensor) -> Tensor:
        srt = x.sort(dim=0).values
        # Fixed-order float64 sum, row by row: independent of slice boundaries.
        acc = srt[k_trim].clone()
        for j in range(k_trim + 1, n - k_trim):
            acc.add_(srt[j])
        return acc / (n - 2 * k_trim)

    return _per_coordinate(deltas, trimmed, factors, slice_elems)


def pairwise_sq_distances(
    deltas: Sequence[Mapping[str, Tensor]],
    *,
    factors: Sequence[float] | None = None,
    slice_elems: int = DEFAULT_SLICE_ELEMS,
) -> Tensor:
    """(N, N) float64 matrix of squared L2 distances, accumulated slice by slice."""
    keys = _check_layout(deltas)
    _check_slice(slice_elems)
    pages = PageReleaser()
    n = len(deltas)
    dist = torch.zeros((n, n), dtype=torch.float64)
    for k in keys:
        flats = [_flat(d[k]) for d in deltas]
        pages.release_all(flats)
        for s, e in _slices(flats[0].numel(), slice_elems):
            x = _stack(flats, s, e, factors, pages)  # (N, slice)
            # Exact differences, not the Gram identity: no cancellation for near-equal updates.
            for i in range(n):
                diff = x[i + 1 :] - x[i]
                part = (diff * diff).sum(dim=1)
                dist[i, i + 1 :] += part
                dist[i + 1 :, i] += part
    return dist


def krum_select(
    deltas: Sequence[Mapping[str, Tensor]],
    f: int,
    m: int = 1,
    *,
    factors: Sequence[float] | None = None,
    slice_elems: int = DEFAULT_SLICE_ELEMS,
) -> tuple[list[int], list[float]]:
    """Krum scores and the ``m`` best indices (multi-Krum when m > 1).

    score(i) = sum of squared distances from update i to its n - f - 2 nearest
    other updates. Needs n > 2f + 2 and 1 <= m <= n - f. Ties break by index.
    Returns (selected indices in ascending order, scores of all updates).
    """
    n = len(deltas)
    if not isinstance(f, int) or f < 0:
        raise AggregationError(f"krum_f must be an int >= 0, got {f!r}")
    if n <= 2 * f + 2:
        raise AggregationError(f"Krum with f={f} needs more than {2 * f + 2} updates, got {n}")
    if not isinstance(m, int) or not (1 <= m <= n - f):
        raise AggregationError(f"krum_m must be in 1..{n - f} for {n} updates and f={f}, got {m!r}")
    dist = pairwise_sq_distances(deltas, factors=factors, slice_elems=slice_elems)
    closest = n - f - 2
    scores: list[float] = []
    for i in range(n):
        others = torch.cat([dist[i, :i], dist[i, i + 1 :]])
        scores.append(float(others.sort().values[:closest].sum()))
    order = sorted(range(n), key=lambda i: (scores[i], i))
    return sorted(order[:m]), scores


def bulyan_select(
    deltas: Sequence[Mapping[str, Tensor]],
    f: int,
    *,
    factors: Sequence[float] | None = None,
    slice_elems: int = DEFAULT_SLICE_ELEMS,
) -> tuple[list[int], list[float]]:
    """Bulyan's selection (El Mhamdi et al. 2018): theta = n - 2f updates, each round of it the
    Krum choice among those left (scores over the remaining set, n' - f - 2 nearest). Needs
    n >= 4f + 3. Returns (selected indices ascending, the first round's Krum scores)."""
    n = len(deltas)
    if not isinstance(f, int) or f < 0:
        raise AggregationError(f"krum_f must be an int >= 0, got {f!r}")
    if n < 4 * f + 3:
        raise AggregationError(f"Bulyan with f={f} needs at least {4 * f + 3} updates, got {n}")
    dist = pairwise_sq_distances(deltas, factors=factors, slice_elems=slice_elems)
    left = list(range(n))
    chosen: list[int] = []
    first: list[float] = []
    while len(chosen) < n - 2 * f:
        closest = max(1, len(left) - f - 2)
        scores = {i: float(torch.stack([dist[i, j] for j in left if j != i]).sort().values[:closest].sum())
                  for i in left}
        if not first:
            first = [scores[i] for i in range(n)]
        best = min(left, key=lambda i: (scores[i], i))
        chosen.append(best)
        left.remove(best)
    return sorted(chosen), first


def bulyan(
    deltas: Sequence[Mapping[str, Tensor]],
    f: int,
    *,
    factors: Sequence[float] | None = None,
    slice_elems: int = DEFAULT_SLICE_ELEMS,
) -> tuple[dict[str, Tensor], list[int], list[float]]:
    """Bulyan: Krum selects theta = n - 2f updates (``bulyan_select``), then each coordinate is the
    mean of the beta = theta - 2f selected values closest to their median. Tolerates f Byzantine
    updates out of n >= 4f + 3 (El Mhamdi et al. 2018). Unweighted, like the median rules."""
    selected, scores = bulyan_select(deltas, f, factors=factors, slice_elems=slice_elems)
    sub = [deltas[i] for i in selected]
    sub_f = None if factors is None else [factors[i] for i in selected]
    beta = len(sub) - 2 * f

    def nearest_median(x: Tensor) -> Tensor:  # (theta, slice) float64
        med = x.median(dim=0).values  # torch's median: the lower of the two middle values
        nearest = (x - med).abs().argsort(dim=0, stable=True)[:beta]
        return x.gather(0, nearest).sum(dim=0) / beta

    out = _per_coordinate(sub, nearest_median, sub_f, slice_elems)
    return out, selected, scores


def aggregate_detailed(
    deltas: Sequence[Mapping[str, Tensor]],
    weights: Sequence[float],
    spec: AggregationSpec,
    *,
    slice_elems: int = DEFAULT_SLICE_ELEMS,
    scales: Sequence[float] | None = None,
) -> Aggregation:
    """``aggregate`` plus which updates were used and how they were clipped.

    ``spec``: the job's aggregation section (method, trim_beta, krum_f, krum_m, clip_norm).
    ``scales``: a factor per update (the round's norm bound, hub/policy/round_policy.py), applied with the clip.
    """
    method = str(spec.method)
    if method not in METHODS:
        raise AggregationError(
            f"aggregation.method must be one of {', '.join(METHODS)}, got {method!r}"
        )
    n = len(deltas)
    _check_layout(deltas)
    _check_slice(slice_elems)
    w = _normalized_weights(weights, n)
    factors = clip_factors(deltas, float(spec.clip_norm), slice_elems=slice_elems)
    if scales is not None:
        if len(scales) != n or not all(math.isfinite(x) and 0 < x <= 1 for x in scales):
            raise AggregationError("scales must be one factor in (0, 1] per update")
        factors = [a * float(b) for a, b in zip(factors, scales, strict=True)]
    fac: list[float] | None = None if all(x == 1.0 for x in factors) else factors
    everyone = list(range(n))
    if method == "fedavg":
        out = fedavg(deltas, w, factors=fac, slice_elems=slice_elems)
        return Aggregation(out, method, everyone, factors)
    if method == "median":
        out = coordinate_median(deltas, factors=fac, slice_elems=slice_elems)
        return Aggregation(out, method, everyone, factors)
    if method == "trimmed_mean":
        beta = float(spec.trim_beta)
        out = trimmed_mean(deltas, beta, factors=fac, slice_elems=slice_elems)
        return Aggregation(out, method, everyone, factors)
    f = int(spec.krum_f)
    if method == "bulyan":
        out, selected, scores = bulyan(deltas, f, factors=fac, slice_elems=slice_elems)
        return Aggregation(out, method, selected, factors, scores)
    m = 1 if method == "krum" else int(spec.krum_m)
    selected, scores = krum_select(deltas, f, m, factors=fac, slice_elems=slice_elems)
    sub = [deltas[i] for i in selected]
    sub_w = [w[i] for i in selected]
    sub_f = None if fac is None else [fac[i] for i in selected]
    if math.fsum(sub_w) <= 0:  # Krum picked only zero-weight updates: average them equally
        sub_w = [1.0] * len(sub)
    out = fedavg(sub, sub_w, factors=sub_f, slice_elems=slice_elems)
    return Aggregation(out, method, selected, factors, scores)


def aggregate(
    deltas: Sequence[Mapping[str, Tensor]],
    weights: Sequence[float],
    spec: AggregationSpec,
    *,
    slice_elems: int = DEFAULT_SLICE_ELEMS,
    scales: Sequence[float] | None = None,
) -> dict[str, Tensor]:
    """The aggregated DELTA of a round (floating tensors only).

    ``weights`` are sample counts (FedAvg and the multi-Krum average use them;
    median and trimmed mean are unweighted). ``clip_norm`` > 0 clips every update
    to that L2 norm first. Raises ``AggregationError`` with one line when a rule's
    limit is violated or the inputs do not line up.
    """
    return aggregate_detailed(deltas, weights, spec, slice_elems=slice_elems, scales=scales).delta


