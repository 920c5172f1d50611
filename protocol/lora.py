"""LoRA modules: frozen (optionally int8) Linear weights beside trained low-rank adapters.

:func:`attach_adapters` turns a model built from its spec into the LoRA model a job with
``ModelSpec.lora`` trains (:mod:`.finetune` says what the settings mean). Hub and node call it
from ``modelspec._construct``, so the manifest, ``build_model`` and ``build_for_state`` all see
the LoRA model. A targeted ``nn.Linear`` at ``name`` becomes a :class:`LoraLinear` whose state is

- ``name.weight`` (fp32, frozen) or, with int8, ``name.weight_q`` (int8, (out, in)) and
  ``name.weight_scale`` (fp32, (out,)): symmetric per-output-channel quantization,
  ``scale = max|w_row| / 127``, ``q = round(w / scale)``;
- ``name.bias`` (frozen) when the layer has one;
- ``name.lora_a`` (rank, in): drawn like a Linear's weight (Kaiming uniform) from the global
  CPU generator, which ``build_model`` seeds with the job's seed: deterministic;
- ``name.lora_b`` (out, rank): zeros, so the untrained LoRA model is the base model.

Forward: ``x W^T + b + (alpha / rank) (x A^T) B^T`` with ``W = q * scale`` dequantized on every
forward: an exact int8 -> fp32 conversion and one fp32 multiply per element, bit-identical on
any IEEE-754 device. The matmuls are the ordinary fp32 (or autocast) kernels, so quantization
adds nothing to what a compute class (:mod:`.compute`) already pins: the referee's CPU replay of
a CPU node reproduces it, and a GPU node sits within the segment tolerances measured for its
precision (docs/lora.md).

Only the adapters train (``requires_grad``); an update carries only them (``update_names``).
:func:`merged_state` folds the adapters into the base for the owner: a plain model's state.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import SpecError
from .finetune import LoraConfig

if TYPE_CHECKING:
    from .modelspec import ModelSpec

__all__ = [
    "ADAPTERS",
    "LoraLinear",
    "attach_adapters",
    "dequantize",
    "freeze_base",
    "lora_state",
    "merged_model",
    "merged_state",
    "quantize_rows",
    "update_names",
]

#: the state-dict suffixes of the trained tensors
ADAPTERS = (".lora_a", ".lora_b")


def quantize_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """(int8 q, fp32 scale) with ``q * scale[:, None]`` ~ ``w`` (out, in): one scale per row."""
    amax = w.detach().abs().amax(dim=1)  # (out,)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w.detach() / scale.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return q, scale.to(torch.float32)


def dequantize(q: Tensor, scale: Tensor) -> Tensor:
    """The fp32 weight (out, in): exact int8 -> fp32, one rounded multiply per element."""
    return q.to(torch.float32) * scale.unsqueeze(1)


class LoraLinear(nn.Module):
    """A frozen Linear (its weight fp32 or int8 + scales) plus trained adapters A and B."""

    def __init__(self, base: nn.Linear, config: LoraConfig) -> None:
        super().__init__()
        out_f, in_f = base.out_features, base.in_features
        device = base.weight.device
        self.int8 = config.frozen == "int8"
        self.scaling = config.scaling
        self.weight: nn.Parameter | None = None
        if self.int8:
            q, scale = quantize_rows(base.weight)
            self.register_buffer("weight_q", q)
            self.register_buffer("weight_scale", scale)
        else:
            self.weight = nn.Parameter(base.weight.detach(), requires_grad=False)
        self.bias = (
            None if base.bias is None else nn.Parameter(base.bias.detach(), requires_grad=False)
        )
        self.lora_a = nn.Parameter(
            torch.empty(config.rank, in_f, device=device, dtype=torch.float32)
        )
        self.lora_b = nn.Parameter(
            torch.zeros(out_f, config.rank, device=device, dtype=torch.float32)
        )
        if device.type != "meta":
            nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    def frozen_weight(self) -> Tensor:
        """The base weight (out, in) in fp32."""
        if self.weight is not None:
            return self.weight
        q, scale = self.get_buffer("weight_q"), self.get_buffer("weight_scale")
        return dequantize(q, scale)

    def forward(self, x: Tensor) -> Tensor:
        # x: (..., in)
        y = F.linear(x, self.frozen_weight(), self.bias)  # (..., out)
        return y + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scaling


def _matches(target: str, name: str) -> bool:
    """ "Linear": every layer; a pattern with * ? [: the whole dotted name; a plain name: a run
    of whole parts of the dotted name ("mlp", "experts.1", "blocks.0.mlp.experts.1.fc")."""
    if target == "Linear":
        return True
    if any(c in target for c in "*?["):
        return fnmatch.fnmatchcase(name, target)
    parts, run = name.split("."), target.split(".")
    return any(parts[i : i + len(run)] == run for i in range(len(parts) - len(run) + 1))


def attach_adapters(module: nn.Module, config: LoraConfig) -> nn.Module:
    """Replace every Linear of ``module`` that ``config.targets`` names by a LoraLinear and
    freeze all but the adapters. SpecError (``lora_targets: ...`` / ``lora_rank: ...``) when a
    target names no Linear layer or the rank is not below a targeted layer's smaller side."""
    linears = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear) and n]
    chosen: dict[str, nn.Linear] = {}
    for target in config.targets:
        hits = [(n, m) for n, m in linears if _matches(target, n)]
        if not hits:
            known = ", ".join(n for n, _ in linears[:8]) or "none"
            raise SpecError(
                f"lora_targets: {target!r:.40} names no Linear layer of this model "
                f"(its Linear layers: {known})"
            )
        chosen.update(hits)
    for name, lin in chosen.items():
        if config.rank >= min(lin.in_features, lin.out_features):
            raise SpecError(
                f"lora_rank: {config.rank} is not below the smaller side of layer {name!r} "
                f"({lin.in_features} -> {lin.out_features}); lower it or leave the layer out"
            )
    for name, lin in chosen.items():
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, LoraLinear(lin, config))
    freeze_base(module)
    return module


def freeze_base(module: nn.Module) -> None:
    """Only the adapters train."""
    for name, p in module.named_parameters():
        p.requires_grad_(name.endswith(ADAPTERS))


def update_names(names: list[str]) -> list[str]:
    """The tensors of a LoRA model's state that an update carries: its adapters, in order."""
    return [n for n in names if n.endswith(ADAPTERS)]


def lora_state(spec: ModelSpec, base: Mapping[str, Tensor], *, seed: int = 0) -> dict[str, Tensor]:
    """The model's state over a plain model's state ``base`` (the spec without ``lora``: names,
    dtypes and shapes must match, TensorError otherwise). For a LoRA spec each targeted weight is
    held as the job says (int8 and scales, or fp32) and the adapters are drawn as
    ``build_model(spec, seed)`` draws them; every other tensor is ``base``'s."""
    from .modelspec import build_model, manifest
    from .tensors import check_manifest

    check_manifest(base, manifest(replace(spec, lora=None)))
    if spec.lora is None:
        return {k: v.detach().clone() for k, v in base.items()}
    fresh = build_model(spec, seed=seed).state_dict()
    out: dict[str, Tensor] = {}
    for name, t in fresh.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight_q":
            out[name], out[f"{prefix}.weight_scale"] = quantize_rows(base[f"{prefix}.weight"])
        elif leaf != "weight_scale":
            out[name] = base[name].detach().clone() if name in base else t
    return {k: out[k] for k in fresh}


def merged_model(
    spec: ModelSpec, state: Mapping[str, Tensor]
) -> tuple[ModelSpec, dict[str, Tensor]]:
    """A LoRA job's model as the plain model the owner runs: (``spec`` without ``lora``, its
    state in that model's order) with every adapted layer's weight ``W + (alpha / rank) B A``."""
    from .modelspec import manifest

    if spec.lora is None:
        return spec, dict(state)
    plain = replace(spec, lora=None)
    merged = merged_state(state, spec.lora)
    return plain, {t.name: merged[t.name] for t in manifest(plain)}


def merged_state(state: Mapping[str, Tensor], config: LoraConfig) -> dict[str, Tensor]:
    """A LoRA model's state with every adapted layer's weight ``W + (alpha / rank) B A`` in
    fp32, its adapters and scales gone (in the LoRA state's order: ``merged_model`` orders it)."""
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        prefix, _, leaf = name.rpartition(".")
        adapted = f"{prefix}.lora_a" in state
        if not adapted:
            out[name] = t.clone()
        elif leaf in ("weight", "weight_q"):
            w = t.float() if leaf == "weight" else dequantize(t, state[f"{prefix}.weight_scale"])
            ab = (
                state[f"{prefix}.lora_b"].double() @ state[f"{prefix}.lora_a"].double()
            )  # (out, in)
            out[f"{prefix}.weight"] = (w.double() + config.scaling * ab).to(torch.float32)
        elif leaf == "bias":
            out[name] = t.clone()
    return out
