"""SGD, Adam and AdamW as a few fused tensor-list updates.

Why not ``torch.optim``: constructing any ``torch.optim.Optimizer`` imports ``torch._dynamo``
(its ``_disable_dynamo`` decorator), which costs seconds of CPU in every fresh node process
and delays the first assignment and a prompt exit on SIGTERM. These classes follow
torch.optim's update rules exactly (same formulas, foreach kernels; tests compare them), with
the hyper-parameters of ``TrainConfig`` and nothing else: no closures, no param groups.

A pipeline stage keeps its optimizer's state across a re-plan: ``state_slots`` and ``steps`` give
it (torch.optim's slot names: ``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``), and
``load_state_slots`` takes it up in a fresh optimizer, which then steps as the first would have.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor


class LocalOptimizer:
    """A fresh optimizer per assignment (contract), or one that took up a pipeline stage's state;
    ``zero_grad`` + ``step`` like torch.optim."""

    def __init__(self, params: Sequence[Tensor]) -> None:
        self.params = list(params)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _with_grads(self) -> tuple[list[Tensor], list[Tensor]]:
        ps = [p for p in self.params if p.grad is not None]
        return ps, [p.grad for p in ps]  # type: ignore[misc]

    @torch.no_grad()
    def step(self) -> None:
        raise NotImplementedError

    @property
    def steps(self) -> int:
        """The steps the state counts (Adam's bias correction); 0 where no rule needs it."""
        return 0

    def state_slots(self) -> dict[str, list[Tensor]]:
        """The state each rule keeps per parameter, by slot name, aligned with ``params`` ({} until
        it exists). The optimizer's own tensors: copy before changing them."""
        return {}

    def load_state_slots(self, slots: Mapping[str, Sequence[Tensor]], steps: int) -> None:
        """Take up state that ``state_slots`` and ``steps`` gave (of this rule, over the same
        parameters): the next ``step`` is the one the exporting optimizer would have taken.
        ValueError when a slot is missing or unknown or a tensor does not fit its parameter."""
        if slots:
            raise ValueError(f"{type(self).__name__} keeps no state, got slots {sorted(slots)}")

    def _aligned(self, slots: Mapping[str, list[Tensor] | None]) -> dict[str, list[Tensor]]:
        out = {name: values for name, values in slots.items() if values is not None}
        for name, values in out.items():
            if len(values) != len(self.params):
                raise ValueError(f"{name} covers {len(values)} of {len(self.params)} parameters "
                                 "(some had no gradient at the first step)")
        return out

    def _copies(self, slots: Mapping[str, Sequence[Tensor]], names: Sequence[str]) -> list[list[Tensor]]:
        """``slots``' tensors for ``names``, each checked against its parameter and copied onto it."""
        if set(slots) != set(names):
            raise ValueError(f"{type(self).__name__} keeps slots {sorted(names)}, got {sorted(slots)}")
        out = []
        for name in names:
            values = list(slots[name])
            if len(values) != len(self.params):
                raise ValueError(f"{name} has {len(values)} tensors for {len(self.params)} parameters")
            for i, (v, p) in enumerate(zip(values, self.params, strict=True)):
                if v.shape != p.shape or not v.is_floating_point():
                    raise ValueError(f"{name} of parameter {i} is {v.dtype} {list(v.shape)}, the parameter "
                                     f"is {p.dtype} {list(p.shape)}")
            out.append([v.detach().to(p.device, p.dtype, copy=True) for v, p in zip(values, self.params,
                                                                                    strict=True)])
        return out


class SGD(LocalOptimizer):
    """torch.optim.SGD (dampening 0, no Nesterov)."""

    def __init__(self, params: Sequence[Tensor], *, lr: float, momentum: float, weight_decay: float) -> None:
        super().__init__(params)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.bufs: list[Tensor] | None = None

    @torch.no_grad()
    def step(self) -> None:
        ps, grads = self._with_grads()
        if not ps:
            return
        if self.weight_decay != 0:
            grads = list(torch._foreach_add(grads, ps, alpha=self.weight_decay))
        if self.momentum != 0:
            if self.bufs is None:
                self.bufs = [g.detach().clone() for g in grads]
            else:
                torch._foreach_mul_(self.bufs, self.momentum)
                torch._foreach_add_(self.bufs, grads)
            grads = self.bufs
        torch._foreach_add_(ps, grads, alpha=-self.lr)

    def state_slots(self) -> dict[str, list[Tensor]]:
        return self._aligned({"momentum_buffer": self.bufs})

    def load_state_slots(self, slots: Mapping[str, Sequence[Tensor]], steps: int) -> None:
        if not slots:  # plain SGD, or momentum before its first step
            self.bufs = None
            return
        if self.momentum == 0:
            super().load_state_slots(slots, steps)
        (self.bufs,) = self._copies(slots, ("momentum_buffer",))


class Adam(LocalOptimizer):
    """torch.optim.Adam / AdamW (``decoupled=True``), eps 1e-8, no amsgrad."""

    def __init__(self, params: Sequence[Tensor], *, lr: float, betas: tuple[float, float],
                 weight_decay: float, decoupled: bool, eps: float = 1e-8) -> None:
        super().__init__(params)
        self.lr, self.weight_decay, self.decoupled, self.eps = lr, weight_decay, decoupled, eps
        self.beta1, self.beta2 = betas
        self.t = 0
        self.exp_avg: list[Tensor] | None = None
        self.exp_avg_sq: list[Tensor] | None = None

    @torch.no_grad()
    def step(self) -> None:
        ps, grads = self._with_grads()
        if not ps:
            return
        if self.exp_avg is None or self.exp_avg_sq is None:
            self.exp_avg = [torch.zeros_like(p) for p in ps]
            self.exp_avg_sq = [torch.zeros_like(p) for p in ps]
        self.t += 1
        if self.weight_decay != 0:
            if self.decoupled:
                torch._foreach_mul_(ps, 1 - self.lr * self.weight_decay)
            else:
                grads = list(torch._foreach_add(grads, ps, alpha=self.weight_decay))
        torch._foreach_lerp_(self.exp_avg, grads, 1 - self.beta1)
        torch._foreach_mul_(self.exp_avg_sq, self.beta2)
        torch._foreach_addcmul_(self.exp_avg_sq, grads, grads, 1 - self.beta2)
        bias1 = 1 - self.beta1**self.t
        bias2_sqrt = (1 - self.beta2**self.t) ** 0.5  # as torch.optim computes it
        denom = torch._foreach_sqrt(self.exp_avg_sq)
        torch._foreach_div_(denom, bias2_sqrt)
        torch._foreach_add_(denom, self.eps)
        torch._foreach_addcdiv_(ps, self.exp_avg, denom, (self.lr / bias1) * -1)

    @property
    def steps(self) -> int:
        return self.t

    def state_slots(self) -> dict[str, list[Tensor]]:
        return self._aligned({"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq})

    def load_state_slots(self, slots: Mapping[str, Sequence[Tensor]], steps: int) -> None:
        if steps < 0 or (steps > 0) != bool(slots):
            raise ValueError(f"Adam's state at step {steps} needs exp_avg and exp_avg_sq exactly when steps > 0")
        self.t = steps
        if not slots:
            self.exp_avg = self.exp_avg_sq = None
            return
        self.exp_avg, self.exp_avg_sq = self._copies(slots, ("exp_avg", "exp_avg_sq"))


def clip_grad_norm(params: Sequence[Tensor], max_norm: float) -> None:
    """torch.nn.utils.clip_grad_norm_ (L2, foreach) without its imports."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    norms = torch._foreach_norm(grads, 2.0)
    total = torch.linalg.vector_norm(torch.stack([n.to(grads[0].device) for n in norms]), 2.0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef.to(grads[0].device))
