"""Server optimizers: how an aggregated delta moves the global model (FedAvgM, FedAdam, Nesterov).

The strategies (hub/policy/strategy.py) step the model with one of these; its state is kept
across rounds by the hub as a GFT1 blob (``state_dict`` / ``load_state_dict``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from gpuflex.protocol.jobspec import SERVER_OPTIMIZERS as JOBSPEC_SERVER_OPTIMIZERS
from gpuflex.protocol.jobspec import AggregationSpec
from torch import Tensor

from .aggregation import AggregationError

__all__ = ["SERVER_OPTIMIZERS", "ServerOptimizer"]

SERVER_OPTIMIZERS = (
    JOBSPEC_SERVER_OPTIMIZERS  # the job spec's list (protocol/jobspec.py): one source
)


_KIND_CODE = {name: i for i, name in enumerate(SERVER_OPTIMIZERS)}
_DEFAULTS = AggregationSpec()  # the job spec's defaults (protocol/jobspec.py) are the only ones


class ServerOptimizer:
    """Applies an aggregated delta to the global model (Reddi et al. 2021, "Adaptive
    Federated Optimization"), treating the delta as a pseudo-gradient step.

    - ``none``:    x <- x + lr * delta            (lr = 1 is plain FedAvg)
    - ``fedavgm``: v <- momentum * v + delta; x <- x + lr * v     (Hsu et al. 2019)
    - ``nesterov``: v <- momentum * v + delta; x <- x + lr * (delta + momentum * v): SGD with
                   Nesterov momentum on the pseudo-gradient -delta, DiLoCo's outer optimizer
                   (Douillard et al. 2023: lr 0.7, momentum 0.9)
    - ``fedadam``: m <- b1*m + (1-b1)*delta; v <- b2*v + (1-b2)*delta^2;
                   x <- x + lr * m / (sqrt(v) + eps)   (no bias correction, as in the paper;
                   eps is the paper's tau. Note lr is then a per-coordinate step size: the
                   paper's good values are 1e-2..1e-1, not FedAvg's 1.0.)

    State is a flat ``dict[str, Tensor]`` (``state_dict``) so the hub can store it
    as a GFT1 blob: ``meta.kind``/``meta.step`` (int64, shape (1,)) plus ``m.<name>``
    / ``v.<name>`` in the parameter's dtype. ``step`` never mutates its inputs and
    only updates this object's own state.
    """

    def __init__(
        self,
        *,
        kind: str = _DEFAULTS.server_optimizer,
        lr: float = _DEFAULTS.server_lr,
        momentum: float = _DEFAULTS.server_momentum,
        beta1: float = _DEFAULTS.server_beta1,
        beta2: float = _DEFAULTS.server_beta2,
        eps: float = _DEFAULTS.server_eps,
    ) -> None:
        if kind not in SERVER_OPTIMIZERS:
            raise AggregationError(
                f"aggregation.server_optimizer must be one of {', '.join(SERVER_OPTIMIZERS)}, got {kind!r}"
            )
        for name, value in (("server_lr", lr), ("server_eps", eps)):
            if not math.isfinite(value) or value <= 0:
                raise AggregationError(f"aggregation.{name} must be finite and > 0, got {value}")
        for name, value in (
            ("server_momentum", momentum),
            ("server_beta1", beta1),
            ("server_beta2", beta2),
        ):
            if not (0.0 <= value < 1.0):
                raise AggregationError(f"aggregation.{name} must be in [0, 1), got {value}")
        self.kind = kind
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.beta1 = float(beta1)
        self.beta2 = float(beta2)
        self.eps = float(eps)
        self.steps = 0
        self._m: dict[str, Tensor] = {}
        self._v: dict[str, Tensor] = {}

    @classmethod
    def from_spec(cls, spec: AggregationSpec) -> ServerOptimizer:
        """Build from an ``AggregationSpec`` (server_optimizer, server_lr, ...)."""
        return cls(
            kind=str(spec.server_optimizer),
            lr=float(spec.server_lr),
            momentum=float(spec.server_momentum),
            beta1=float(spec.server_beta1),
            beta2=float(spec.server_beta2),
            eps=float(spec.server_eps),
        )

    def step(
        self, global_state: Mapping[str, Tensor], agg_delta: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """Return the next global state; neither argument is mutated.

        Tensors of ``global_state`` absent from ``agg_delta`` (non-floating ones)
        are carried over as copies.
        """
        for k, d in agg_delta.items():
            g = global_state.get(k)
            if g is None:
                raise AggregationError(f"aggregated delta has tensor {k!r} that the model lacks")
            if tuple(g.shape) != tuple(d.shape) or not g.is_floating_point():
                raise AggregationError(
                    f"aggregated delta {k!r} {tuple(d.shape)} does not fit model tensor {tuple(g.shape)} {g.dtype}"
                )
        new: dict[str, Tensor] = {}
        for k, g in global_state.items():
            raw = agg_delta.get(k)
            if raw is None:
                new[k] = g.detach().clone()
                continue
            d = raw.detach().to(g.dtype)
            if self.kind == "none":
                upd = d * self.lr
            elif self.kind in ("fedavgm", "nesterov"):
                prev_v = self._m.get(k)
                v = d.clone() if prev_v is None else prev_v * self.momentum + d
                self._m[k] = v
                upd = (v if self.kind == "fedavgm" else d + v * self.momentum) * self.lr
            else:
                prev_m, prev_v = self._m.get(k), self._v.get(k)
                m = (
                    d * (1 - self.beta1)
                    if prev_m is None
                    else prev_m * self.beta1 + d * (1 - self.beta1)
                )
                v = (
                    (d * d) * (1 - self.beta2)
                    if prev_v is None
                    else prev_v * self.beta2 + (d * d) * (1 - self.beta2)
                )
                self._m[k], self._v[k] = m, v
                upd = m / (v.sqrt() + self.eps) * self.lr
            new[k] = g.detach() + upd
        self.steps += 1
        return new

    def state_dict(self) -> dict[str, Tensor]:
        """Tensors only (GFT1-encodable). Returned tensors are copies."""
        out = {
            "meta.kind": torch.tensor([_KIND_CODE[self.kind]], dtype=torch.int64),
            "meta.step": torch.tensor([self.steps], dtype=torch.int64),
        }
        for k, t in self._m.items():
            out["m." + k] = t.clone()
        for k, t in self._v.items():
            out["v." + k] = t.clone()
        return out

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Restore from ``state_dict()`` output; refuses a state of another kind."""
        kind_t = state.get("meta.kind")
        step_t = state.get("meta.step")
        if kind_t is None or step_t is None or kind_t.numel() != 1 or step_t.numel() != 1:
            raise AggregationError(
                "server optimizer state lacks meta.kind/meta.step: not a state_dict() blob"
            )
        code = int(kind_t.reshape(-1)[0])
        if code != _KIND_CODE[self.kind]:
            other = (
                SERVER_OPTIMIZERS[code] if 0 <= code < len(SERVER_OPTIMIZERS) else f"code {code}"
            )
            raise AggregationError(
                f"server optimizer state is for {other!r} but this job uses {self.kind!r}"
            )
        m: dict[str, Tensor] = {}
        v: dict[str, Tensor] = {}
        for k, t in state.items():
            if k.startswith("m."):
                m[k[2:]] = t.detach().clone()
            elif k.startswith("v."):
                v[k[2:]] = t.detach().clone()
            elif not k.startswith("meta."):
                raise AggregationError(f"server optimizer state has unknown entry {k!r}")
        self.steps = int(step_t.reshape(-1)[0])
        self._m, self._v = m, v
