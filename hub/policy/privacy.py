"""Differential privacy for node-local jobs: central DP with fixed clipping, and its accountant.

``[privacy] dp = "central"`` (protocol/jobspec.py PrivacySpec), modelled on Flower's
``DifferentialPrivacyServerSideFixedClipping`` (McMahan et al. 2018, "Learning differentially
private recurrent language models", DP-FedAvg with a fixed clip). Each round the hub (hub/domain/rounds.py):

1. clips every included silo update to L2 norm ``clip_norm`` over all its floating tensors
   together (``clip_factor``);
2. averages the clipped updates with EQUAL weights: the sensitivity bound needs each silo to move
   the sum by at most ``clip_norm``; a weight by sample count would let a large silo move it more;
3. adds Gaussian noise of standard deviation ``noise_multiplier * clip_norm / n`` to every
   coordinate of that mean (n = the number of included updates): the sum of the clipped updates
   plus N(0, (z C)^2) per coordinate, divided by n (``add_noise``);
4. only then steps the server optimizer, downlink sparsification and so on: post-processing of
   the noised mean, which costs no privacy.

What it protects. The unit is one silo: its whole update in a round, so whatever the silo's rows
are, the models the hub publishes (every round's, to every node and to the owner) reveal at most
(ε, δ) about whether that silo took part. Adjacent rounds differ in one silo's update replaced by
zero ("zero-out" adjacency, Kairouz et al. 2021; equivalently add/remove with ``n`` public), the
usual convention of DP-FedAvg, Flower, Opacus and TF Privacy. Under replace-one adjacency (a silo's
update swapped for any other) the sensitivity doubles: the same ε holds for noise_multiplier / 2.

What it does not protect. The hub itself sees every update in the clear before the noise (central
DP trusts the hub: secure aggregation or local DP is the answer to an untrusted hub, not built);
a silo's sample count, hash and (opt-in) label histogram are sent as before and are not covered;
nothing holds if an operator attaches the same data twice under two nodes (two units). The noise
is drawn with torch's generator seeded from ``secrets`` (unpredictable, never derivable from the
job), not from a floating-point-hardened sampler (Mironov 2012): fine against the threat of a
published model, not a certified implementation.

Which checks it changes (hub/policy/strategy.py ``CentralDP``, run by hub/domain/aggregating.py). The round's scores still run and a
flagged update is still excluded (before the noise; the noise is scaled to the updates included).
The norm bound (verification.norm_bound) and the untrusted weight share no longer reshape the
mean: both depend on the other silos' updates (the round's median), so one silo's presence
would change how another's update counts and break the sensitivity bound; the privacy clip
bounds every update instead, and the weights are uniform. [aggregation] must be fedavg without
its own clip_norm (the spec refuses others). A node-local job already has replication, spot
checks, the referee and the trend audit off. Rounds are no longer bit-reproducible: the same
updates give a different noised model each time.

The accountant. Every online silo takes part in every round (no Poisson sampling is claimed, so
no amplification by subsampling). One round is the Gaussian mechanism with sensitivity ``C`` and
noise ``z C`` on the sum, whose Rényi DP (Mironov 2017) is RDP(alpha) = alpha / (2 z²); T rounds
compose to T alpha / (2 z²) (adaptive composition, whatever the number of silos each round). It is
turned into (ε, δ) with the conversion of Canonne, Kamath & Steinke 2020 (Prop. 12; Balle et al.
2020, Thm. 21), the one Opacus and TF Privacy use:

    ε = min over alpha of  T alpha / (2 z²) + log((alpha - 1) / alpha)
                           - (log δ + log alpha) / (alpha - 1)

which is below the classic ε = RDP(alpha) + log(1/δ) / (alpha - 1) (Mironov 2017, Prop. 3; also
here, ``conversion="standard"``) at every alpha. alpha ranges over a fine grid in (1, 10 000], the
closed-form optimum of the classic conversion, alpha* = 1 + z √(2 log(1/δ) / T), clipped to the
grid, and a golden-section refinement around the best point: every alpha gives a valid bound, so a
finer search only tightens it. z = 0 gives ε = inf (no noise: no guarantee), 0 rounds give ε = 0.
Since each round is itself Gaussian, the exact ε of T rounds is that of one Gaussian of noise
z / √T (Balle & Wang 2018; tests/test_privacy.py checks the bound against it: at z = 1, T = 30,
δ = 1e-5 the bound is 39.8, the classic conversion's 41.3, the exact value 37.6).
"""

from __future__ import annotations

import functools
import math
import secrets
from collections.abc import MutableMapping

import torch
from torch import Tensor

__all__ = [
    "ALPHA_MAX",
    "CONVERSIONS",
    "add_noise",
    "clip_factor",
    "epsilon",
    "noise_std",
    "rdp_epsilon",
    "secure_generator",
]

#: the largest Rényi order searched
ALPHA_MAX = 10_000.0
#: "ckks": Canonne-Kamath-Steinke 2020 / Balle et al. 2020 (the default); "standard": Mironov 2017
CONVERSIONS = ("ckks", "standard")
_GRID_POINTS = 2000
_NOISE_SLICE = 1 << 20


# -- the mechanism --------------------------------------------------------------------------------


def clip_factor(norm: float, clip_norm: float) -> float:
    """The scale that brings an update of L2 norm ``norm`` to at most ``clip_norm``: 1 when it is
    within already, else ``clip_norm / norm`` (in (0, 1))."""
    if not math.isfinite(clip_norm) or clip_norm <= 0:
        raise ValueError(f"clip_norm must be finite and > 0, got {clip_norm}")
    if not math.isfinite(norm) or norm < 0:
        raise ValueError(f"an update's norm must be finite and >= 0, got {norm}")
    return 1.0 if norm <= clip_norm else clip_norm / norm


def noise_std(noise_multiplier: float, clip_norm: float, n: int) -> float:
    """The noise's standard deviation per coordinate of the mean of ``n`` clipped updates."""
    if n < 1:
        raise ValueError(f"the noise is for a mean of at least one update, got n = {n}")
    return noise_multiplier * clip_norm / n


def secure_generator() -> torch.Generator:
    """A CPU generator seeded from the operating system's CSPRNG (``secrets``): its noise cannot be
    reproduced from anything public (the job, its seed, the round), unlike torch's global one."""
    g = torch.Generator()
    g.manual_seed(secrets.randbits(63))
    return g


def add_noise(delta: MutableMapping[str, Tensor], std: float,
              generator: torch.Generator | None = None) -> None:
    """Add N(0, std²) to every coordinate of the floating tensors of ``delta``, in place (other
    tensors are left alone). ``generator``: a CPU torch.Generator, by default a fresh
    ``secure_generator()``. Noise is drawn in slices of 1M coordinates (float64 for a float64
    tensor, float32 otherwise), so it never needs a second copy of a large model."""
    if not math.isfinite(std) or std < 0:
        raise ValueError(f"the noise's standard deviation must be finite and >= 0, got {std}")
    if std == 0.0:
        return
    g = secure_generator() if generator is None else generator
    for key, t in delta.items():
        if not t.is_floating_point():
            continue
        dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
        if not t.is_contiguous() or t.device.type != "cpu":
            noise = torch.randn(t.shape, generator=g, dtype=dtype).mul_(std)
            delta[key] = t.add_(noise.to(device=t.device, dtype=t.dtype))
            continue
        flat = t.view(-1)
        for start in range(0, flat.numel(), _NOISE_SLICE):
            seg = flat[start:start + _NOISE_SLICE]
            seg.add_(torch.randn(seg.numel(), generator=g, dtype=dtype).mul_(std).to(t.dtype))


# -- the accountant -------------------------------------------------------------------------------


def _grid() -> list[float]:
    """Rényi orders in (1, ALPHA_MAX]: alpha - 1 log-spaced from 1e-3 to ALPHA_MAX - 1, and 2..64."""
    lo, hi = math.log(1e-3), math.log(ALPHA_MAX - 1.0)
    steps = _GRID_POINTS - 1
    orders = {1.0 + math.exp(lo + (hi - lo) * i / steps) for i in range(_GRID_POINTS)}
    orders.update(float(a) for a in range(2, 65))
    return sorted(a for a in orders if 1.0 < a <= ALPHA_MAX)


_ALPHAS = _grid()


def _eps_at(alpha: float, rdp_per_alpha: float, log_delta: float, conversion: str) -> float:
    """(ε at δ) from RDP(alpha) = rdp_per_alpha · alpha."""
    rdp = rdp_per_alpha * alpha
    if conversion == "standard":
        return rdp - log_delta / (alpha - 1.0)
    return rdp + math.log1p(-1.0 / alpha) - (log_delta + math.log(alpha)) / (alpha - 1.0)


def rdp_epsilon(rounds: int, noise_multiplier: float, delta: float, conversion: str = "ckks") -> tuple[float, float]:
    """(ε, the Rényi order alpha that gives it) for ``rounds`` Gaussian rounds of noise multiplier
    ``noise_multiplier`` at ``delta``. See the module's docstring for the formula."""
    if rounds < 0:
        raise ValueError(f"rounds must be >= 0, got {rounds}")
    if not math.isfinite(noise_multiplier) or noise_multiplier < 0:
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if conversion not in CONVERSIONS:
        raise ValueError(f"conversion must be one of {', '.join(CONVERSIONS)}, got {conversion!r}")
    if rounds == 0:
        return 0.0, math.inf
    if noise_multiplier == 0.0:
        return math.inf, math.inf
    slope = rounds / (2.0 * noise_multiplier * noise_multiplier)  # RDP(alpha) = slope · alpha
    log_delta = math.log(delta)
    closed = 1.0 + noise_multiplier * math.sqrt(-2.0 * log_delta / rounds)  # the classic conversion's optimum
    alphas = sorted({*_ALPHAS, min(max(closed, _ALPHAS[0]), ALPHA_MAX)})

    def at(a: float) -> float:
        return _eps_at(a, slope, log_delta, conversion)

    i = min(range(len(alphas)), key=lambda j: at(alphas[j]))
    best = alphas[i]
    # golden-section search between the best order's neighbours (any alpha is a valid bound)
    lo, hi = alphas[max(i - 1, 0)], alphas[min(i + 1, len(alphas) - 1)]
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    for _ in range(40):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        if at(a) <= at(b):
            hi = b
        else:
            lo = a
    mid = 0.5 * (lo + hi)
    if at(mid) < at(best):
        best = mid
    return max(0.0, at(best)), best


@functools.lru_cache(maxsize=4096)
def epsilon(rounds: int, noise_multiplier: float, delta: float) -> float:
    """The job's ε at ``delta`` after ``rounds`` rounds of central DP with ``noise_multiplier``
    (RDP of the Gaussian mechanism, no subsampling, the Canonne-Kamath-Steinke conversion): inf
    when noise_multiplier is 0 and a round has closed, 0 before any."""
    return rdp_epsilon(rounds, noise_multiplier, delta)[0]
