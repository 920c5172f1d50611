"""Aggregation strategies: the one seam where a round's aggregation rule plugs in.

In the spirit of Flower's ``Strategy`` (configure a round, aggregate it), fitted to this hub: the
round policy (round_policy.py) has already judged the round and says which updates are
included, with the weight factor and the norm-bound scale of each. A strategy then

- ``configure``s the round: which of those updates enter the aggregate, with what weight and
  scale (``RoundPlan``); pure, no tensor is read;
- ``aggregate``s it: the included updates' deltas into one delta, with evidence for the round;
- names the ``server_optimizer`` that steps the model by that delta (its state is kept by the
  hub across rounds).

The round engine (hub/domain) opens the updates, calls these three, steps the model and stores
the result; it knows no rule by name. A strategy is chosen by ``strategy_name(spec)`` from the
job spec's existing fields (``[aggregation] method`` and ``server_optimizer``, ``[privacy] dp``
and ``secure_aggregation``), so every spec keeps its meaning. A contributor adds one by writing
a class with a ``from_context`` constructor and registering it::

    @register("fedavg_halved")
    class HalvedFedAvg:
        opens_updates = True

        def __init__(self, *, spec: AggregationSpec) -> None:
            self.spec = spec

        @classmethod
        def from_context(cls, ctx: StrategyContext) -> HalvedFedAvg:
            return cls(spec=ctx.spec.aggregation)

        def configure(self, contributions: Sequence[Contribution]) -> RoundPlan:
            return RoundPlan(tuple(c.update_id for c in contributions), sample_weighting(contributions))

        def aggregate(self, deltas, plan, *, model):
            delta = fedavg(deltas, plan.weighting.weights)
            return Aggregate({k: v * 0.5 for k, v in delta.items()})

        def server_optimizer(self) -> ServerOptimizer:
            return ServerOptimizer.from_spec(self.spec)

Every class here is pure: tensors in, a new result out, nothing passed in mutated (central DP
adds its noise to the aggregate it made itself).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, Self, TypeVar

import torch
from gpuflex.protocol.jobspec import JobSpec, strategy_of
from torch import Tensor

from . import privacy
from .aggregation import AggregationError, aggregate, update_norm
from .secagg import SecAggRound
from .server_optimizer import ServerOptimizer

__all__ = [
    "Aggregate",
    "CentralDP",
    "Contribution",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "RobustRule",
    "RoundPlan",
    "SecureAggregation",
    "Strategy",
    "StrategyContext",
    "Weighting",
    "aggregation_weights",
    "check_registered",
    "register",
    "registered",
    "sample_weighting",
    "strategy_for",
    "strategy_name",
]

#: why the model stays as it was when a round includes no update
NOTHING_INCLUDED = "no update was included; the model is unchanged"


@dataclass(frozen=True)
class Contribution:
    """One update the round policy included, as a strategy sees it. ``samples``: its shard's (or
    silo's) sample count; ``weight_factor``: the round policy's bound on an untrusted update's
    weight (1 = none); ``scale``: its norm bound on the update's delta (1 = untouched)."""

    update_id: str
    node_id: str
    samples: int
    weight_factor: float = 1.0
    scale: float = 1.0


@dataclass(frozen=True)
class Weighting:
    """How the included updates weigh in the aggregate: ``weights`` (any non-negative scale) and
    ``scales`` (a factor in (0, 1] per update, on its delta). ``bounds_applied``: whether the round
    policy's norm and weight bounds are (not under central DP, whose sensitivity they would break)."""

    weights: tuple[float, ...]
    scales: tuple[float, ...]
    bounds_applied: bool = True


@dataclass(frozen=True)
class RoundPlan:
    """What ``configure`` decided: the update ids that enter the aggregate (in the engine's order),
    their weighting, why the model is unchanged when none enters, and evidence for the round."""

    included: tuple[str, ...]
    weighting: Weighting
    unchanged: str = NOTHING_INCLUDED
    evidence: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Aggregate:
    """The round's aggregated delta (floating tensors only) and what the rule adds to its evidence."""

    delta: dict[str, Tensor]
    evidence: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StrategyContext:
    """What a strategy is built from: the job's spec; under secure aggregation the round's protocol
    state and the model's floating tensors (name, elements) in manifest order, which is the order
    of the masked sum's coordinates."""

    spec: JobSpec
    secagg: SecAggRound | None = None
    float_tensors: tuple[tuple[str, int], ...] = ()


class Strategy(Protocol):
    """The interface every aggregation rule implements (see the module's docstring)."""

    #: whether the hub opens each update (so the round policy can judge, score and bound it);
    #: False where the hub holds only a protocol's sum of them (secure aggregation)
    opens_updates: ClassVar[bool]

    def configure(self, contributions: Sequence[Contribution]) -> RoundPlan: ...

    def aggregate(
        self,
        deltas: Sequence[Mapping[str, Tensor]],
        plan: RoundPlan,
        *,
        model: Mapping[str, Tensor],
    ) -> Aggregate: ...

    def server_optimizer(self) -> ServerOptimizer: ...


# -- the weighting rule --------------------------------------------------------------------------


def aggregation_weights(contributions: Sequence[Contribution], *, central_dp: bool) -> Weighting:
    """The weight and scale of each included update. Under central DP every update weighs the same
    and is clipped by the mechanism itself (privacy.py): the round policy's norm bound and the
    untrusted weight share depend on the other silos' updates and would break the sensitivity
    bound, so they are not applied (its flags still are: a flagged update is not included).
    Otherwise an update weighs its sample count times the policy's weight factor, scaled by the
    policy's norm bound."""
    if central_dp:
        n = len(contributions)
        return Weighting((1.0,) * n, (1.0,) * n, bounds_applied=False)
    return Weighting(
        tuple(float(c.samples) * c.weight_factor for c in contributions),
        tuple(c.scale for c in contributions),
    )


def sample_weighting(contributions: Sequence[Contribution]) -> Weighting:
    """``aggregation_weights`` without central DP: samples x the round policy's factor."""
    return aggregation_weights(contributions, central_dp=False)


def _scales(weighting: Weighting) -> list[float] | None:
    return list(weighting.scales) if any(x < 1.0 for x in weighting.scales) else None


# -- the registry --------------------------------------------------------------------------------

_REGISTRY: dict[str, Callable[[StrategyContext], Strategy]] = {}


class _Buildable(Protocol):
    def from_context(self, ctx: StrategyContext, /) -> Strategy: ...


B = TypeVar("B", bound=_Buildable)


def register(name: str) -> Callable[[B], B]:
    """Class decorator: the strategy ``name`` is built by the class's ``from_context``."""

    def add(cls: B) -> B:
        if name in _REGISTRY:
            raise ValueError(f"aggregation strategy {name!r} is registered already")
        _REGISTRY[name] = cls.from_context
        return cls

    return add


def registered() -> tuple[str, ...]:
    """The names of the registered strategies, sorted."""
    return tuple(sorted(_REGISTRY))


def strategy_name(spec: JobSpec) -> str:
    """The strategy a job uses: the one its ``[aggregation] strategy`` names, else the one its other
    fields mean (protocol/jobspec.py ``derived_strategy``: secure aggregation or central DP when
    [privacy] asks for it, FedAvgM or FedAdam for FedAvg with that server optimizer, else the
    method)."""
    return strategy_of(spec)


def check_registered(spec: JobSpec) -> None:
    """Refuse a spec whose strategy this hub does not have (at submission, before anything is
    stored): one line naming the ones it has."""
    name = strategy_name(spec)
    if name not in _REGISTRY:
        raise AggregationError(
            f"aggregation.strategy: this hub has no strategy {name!r}; it has {', '.join(registered())}"
        )


def strategy_for(ctx: StrategyContext) -> Strategy:
    """The registered strategy a job's spec names, built for this round."""
    name = strategy_name(ctx.spec)
    build = _REGISTRY.get(name)
    if build is None:
        raise AggregationError(
            f"no aggregation strategy {name!r}; registered: {', '.join(registered())}"
        )
    return build(ctx)


# -- the strategies ------------------------------------------------------------------------------


class _FromSpec:
    """A strategy that needs only the job's spec, and opens the updates."""

    opens_updates: ClassVar[bool] = True

    def __init__(self, *, spec: JobSpec) -> None:
        self.spec = spec

    @classmethod
    def from_context(cls, ctx: StrategyContext) -> Self:
        return cls(spec=ctx.spec)


class _SpecRule(_FromSpec):
    """A rule of ``aggregation.aggregate`` (the spec's method, clip_norm...) weighted by samples,
    stepping the model with the spec's server optimizer."""

    def configure(self, contributions: Sequence[Contribution]) -> RoundPlan:
        return RoundPlan(tuple(c.update_id for c in contributions), sample_weighting(contributions))

    def aggregate(
        self,
        deltas: Sequence[Mapping[str, Tensor]],
        plan: RoundPlan,
        *,
        model: Mapping[str, Tensor],
    ) -> Aggregate:
        w = plan.weighting
        return Aggregate(
            aggregate(deltas, list(w.weights), self.spec.aggregation, scales=_scales(w))
        )

    def server_optimizer(self) -> ServerOptimizer:
        return ServerOptimizer.from_spec(self.spec.aggregation)


@register("fedavg")
class FedAvg(_SpecRule):
    """Weighted FedAvg (McMahan et al. 2017): the mean of the updates weighted by samples."""


@register("fedavgm")
class FedAvgM(_SpecRule):
    """FedAvg with server momentum (Hsu et al. 2019): ``server_optimizer = "fedavgm"``."""


@register("fedadam")
class FedAdam(_SpecRule):
    """FedAvg with an Adam server step (Reddi et al. 2021): ``server_optimizer = "fedadam"``."""


class RobustRule(_SpecRule):
    """The robust rules of aggregation.py (median, trimmed mean, Krum, multi-Krum, Bulyan), one
    registered name each; the spec's method picks the rule."""


for _method in ("median", "trimmed_mean", "krum", "multi_krum", "bulyan"):
    register(_method)(RobustRule)


@register("central_dp")
class CentralDP(_FromSpec):
    """Central differential privacy (privacy.py): every included update clipped to the privacy
    clip, averaged with equal weights, Gaussian noise on the mean before the server optimizer
    steps (post-processing)."""

    def configure(self, contributions: Sequence[Contribution]) -> RoundPlan:
        return RoundPlan(
            tuple(c.update_id for c in contributions),
            aggregation_weights(contributions, central_dp=True),
        )

    def aggregate(
        self,
        deltas: Sequence[Mapping[str, Tensor]],
        plan: RoundPlan,
        *,
        model: Mapping[str, Tensor],
    ) -> Aggregate:
        dp = self.spec.privacy
        scales = [privacy.clip_factor(update_norm(d), dp.clip_norm) for d in deltas]
        agg = aggregate(
            deltas,
            list(plan.weighting.weights),
            self.spec.aggregation,
            scales=scales if any(x < 1.0 for x in scales) else None,
        )
        std = privacy.noise_std(dp.noise_multiplier, dp.clip_norm, len(deltas))
        privacy.add_noise(agg, std)
        evidence = {
            "clip_norm": dp.clip_norm,
            "noise_multiplier": dp.noise_multiplier,
            "noise_std": std,
            # how many were clipped, not which or by how much: a factor is clip / the update's
            # norm, a per-update figure the guarantee does not cover
            "updates": len(deltas),
            "clipped": sum(1 for f in scales if f < 1.0),
        }
        return Aggregate(agg, {"privacy": evidence})

    def server_optimizer(self) -> ServerOptimizer:
        return ServerOptimizer.from_spec(self.spec.aggregation)


@register("secure_aggregation")
class SecureAggregation:
    """Secure aggregation (secagg.py): the weighted mean of the updates whose masks came off (the
    protocol's sum, never one update), or, when the protocol aborted, none. No update can be scored
    or bounded: the hub never sees one."""

    opens_updates: ClassVar[bool] = False

    def __init__(
        self, *, spec: JobSpec, secagg: SecAggRound, float_tensors: Sequence[tuple[str, int]]
    ) -> None:
        self.spec = spec
        self.secagg = secagg
        self.float_tensors = tuple(float_tensors)

    @classmethod
    def from_context(cls, ctx: StrategyContext) -> SecureAggregation:
        if ctx.secagg is None:
            raise AggregationError("secure aggregation: the round has no protocol state")
        return cls(spec=ctx.spec, secagg=ctx.secagg, float_tensors=ctx.float_tensors)

    def configure(self, contributions: Sequence[Contribution]) -> RoundPlan:
        sa = self.secagg
        alive = set(sa.alive) if sa.phase == "done" else set()
        included = [c for c in contributions if c.node_id in alive]
        evidence = {
            "phase": sa.phase,
            "roster": len(sa.roster),
            "threshold": sa.threshold,
            "survivors": len(sa.survivors),
            "summed": len(alive),
            "clip": sa.clip,
            "bits": sa.bits,
            **({"detail": sa.detail} if sa.detail else {}),
        }
        return RoundPlan(
            tuple(c.update_id for c in included),
            Weighting((1.0,) * len(included), (1.0,) * len(included), bounds_applied=False),
            unchanged=f"secure aggregation {sa.phase}: the model is unchanged",
            evidence={"secure_aggregation": evidence},
        )

    def aggregate(
        self,
        deltas: Sequence[Mapping[str, Tensor]],
        plan: RoundPlan,
        *,
        model: Mapping[str, Tensor],
    ) -> Aggregate:
        mean, weight = self.secagg.mean_update()
        agg: dict[str, Tensor] = {}
        at = 0
        for name, n in self.float_tensors:
            ref = model[name]
            agg[name] = torch.from_numpy(mean[at : at + n]).to(ref.dtype).reshape(ref.shape)
            at += n
        evidence = dict(plan.evidence["secure_aggregation"]) | {"weight": round(weight, 6)}
        return Aggregate(agg, {"secure_aggregation": evidence})

    def server_optimizer(self) -> ServerOptimizer:
        return ServerOptimizer.from_spec(self.spec.aggregation)
