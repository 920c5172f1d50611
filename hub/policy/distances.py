"""Distances between updates: relative L2 distance, cosines and norms, the model's trend.

Pure functions over state dicts (tensor name -> tensor), float64 sums over slices of
``slice_elems`` so a large update never has a float64 copy in memory; inputs are only read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from .aggregation import DEFAULT_SLICE_ELEMS, PageReleaser, floating_keys
from .update_record import EPS

__all__ = [
    "cosine",
    "cosine_and_norms",
    "cosine_layers",
    "layer_of",
    "relative_distance",
    "same_layout",
    "trend_alignment",
    "update_norm",
]


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


def same_layout(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> list[str] | None:
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
    keys = same_layout(a, b)
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
    cos, na, nb, _ = cosine_layers(a, b, slice_elems)
    return cos, na, nb


def cosine(ab: float, na: float, nb: float) -> float:
    """The cosine of two vectors from their dot product and norms; 0 if either norm is 0."""
    return ab / (na * nb) if na > EPS and nb > EPS else 0.0


def cosine_layers(
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
        layers.append((k, math.sqrt(x), math.sqrt(y), cosine(z, math.sqrt(x), math.sqrt(y))))
    na, nb = math.sqrt(aa), math.sqrt(bb)
    return cosine(ab, na, nb), na, nb, layers


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
    none is left, or the layouts differ (nothing to say). An update that carries part of the
    model (a LoRA job's adapters) is judged against the trend of that part."""
    now = {k: now[k] for k in delta if k in now}
    then = {k: then[k] for k in delta if k in then}
    keys = same_layout(delta, now)
    if keys is None or same_layout(now, then) != keys:
        return 1.0, ""
    sums: dict[str, list[float]] = {}
    for k in keys:
        fu, fa, fb = _flat(delta[k]), _flat(now[k]), _flat(then[k])
        acc = sums.setdefault(layer_of(k), [0.0, 0.0, 0.0])  # u.t, u.u, t.t
        for i in range(0, fu.numel(), slice_elems):
            u = fu[i : i + slice_elems].to(torch.float64)
            t = fa[i : i + slice_elems].to(torch.float64) - fb[i : i + slice_elems].to(
                torch.float64
            )
            acc[0] += float(torch.dot(u, t))
            acc[1] += float(torch.dot(u, u))
            acc[2] += float(torch.dot(t, t))
    worst, where = 1.0, ""
    for layer, (ut, uu, tt) in sums.items():
        nu, nt = math.sqrt(uu), math.sqrt(tt)
        if nu > EPS and nt > EPS and ut / (nu * nt) < worst:
            worst, where = ut / (nu * nt), layer
    return worst, where


def update_norm(delta: Mapping[str, Tensor], slice_elems: int, pages: PageReleaser | None) -> float:
    """The L2 norm of an update's floating tensors, float64, sliced."""
    total = 0.0
    for k in floating_keys(delta):
        _, x, _, _ = _pair_sums(delta[k], delta[k], slice_elems, pages)
        total += x
    return math.sqrt(total)
