"""``[train] finetune = "lora"``: freeze the base weights and train low-rank adapters.

A LoRA job's model is its ``[model]`` with a :class:`LoraConfig` attached (``ModelSpec.lora``):
hub and node build it alike from plain data (:mod:`.lora`), so the config travels inside the
assignment's model spec (``to_dict()["lora"]``). Every ``nn.Linear`` that ``targets`` names is
replaced by a :class:`.lora.LoraLinear`: its weight and bias frozen (the weight held as int8 with
one fp32 scale per output channel when ``frozen = "int8"``), beside two trained fp32 adapters
``lora_a`` (rank, in) and ``lora_b`` (out, rank). Everything else in the model is frozen too.

Keys (``[train]``): ``finetune`` ("full" or "lora"), ``lora_rank``, ``lora_alpha`` (the adapters'
product is scaled by alpha / rank), ``lora_targets`` (layer kinds or name patterns: "Linear" is
every Linear layer, a name such as "attn", "mlp" or "experts.1" every Linear layer whose dotted
name has those parts in a row (a mixture's expert 1 in every block: ``blocks.0.mlp.experts.1.fc``),
a pattern with * or ? matched against the whole name), ``frozen_precision``
("int8" or "fp32"). The LoRA keys are refused without ``finetune = "lora"``.

Refused with LoRA: secure aggregation (its masked sum runs over the node's whole model manifest,
which a LoRA update is not; not in this release). A LoRA job may be pipelined: each stage holds
its units' frozen weights (int8 when asked) and trains their adapters, and so does an expert
host for its experts (node/pipeline/experts.py). Pure data: torch is imported only where the
targets are checked against the model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final

from .errors import SpecError

if TYPE_CHECKING:
    from .modelspec import ModelSpec

FINETUNES: Final = ("full", "lora")
FROZEN_PRECISIONS: Final = ("int8", "fp32")
LORA_KEYS: Final = ("lora_rank", "lora_alpha", "lora_targets", "frozen_precision")
MAX_RANK: Final = 4096
MAX_TARGETS: Final = 32


@dataclass(frozen=True)
class LoraConfig:
    """What a LoRA job trains and how its frozen weights are held."""

    rank: int = 8
    alpha: float = 16.0
    #: layer kinds or name patterns (see the module's docstring)
    targets: tuple[str, ...] = ("Linear",)
    #: "int8": each targeted layer's frozen weight as int8 with per-output-channel fp32 scales
    frozen: str = "int8"

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "alpha": self.alpha,
            "targets": list(self.targets),
            "frozen": self.frozen,
        }

    @classmethod
    def from_dict(cls, d: object, where: str = "model.lora") -> LoraConfig:
        """Validate the plain-data form (``to_dict``); SpecError names ``where.key``."""
        if not isinstance(d, Mapping) or set(d) != {"rank", "alpha", "targets", "frozen"}:
            raise SpecError(f"{where}: expected a table of exactly rank, alpha, targets, frozen")
        return _config(
            d["rank"],
            d["alpha"],
            d["targets"],
            d["frozen"],
            where,
            ("rank", "alpha", "targets", "frozen"),
        )


def _config(
    rank: object,
    alpha: object,
    targets: object,
    frozen: object,
    where: str,
    keys: tuple[str, str, str, str],
) -> LoraConfig:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
        raise SpecError(f"{where}.{keys[0]}: expected an integer 1..{MAX_RANK}, got {rank!r:.40}")
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, (int, float))
        or not (math.isfinite(alpha) and alpha > 0)
    ):
        raise SpecError(f"{where}.{keys[1]}: expected a number > 0, got {alpha!r:.40}")
    if (
        not isinstance(targets, (list, tuple))
        or not 1 <= len(targets) <= MAX_TARGETS
        or not all(isinstance(t, str) and 1 <= len(t) <= 128 and t.isprintable() for t in targets)
    ):
        raise SpecError(
            f"{where}.{keys[2]}: expected a list of 1..{MAX_TARGETS} layer kinds or name patterns, "
            f"got {targets!r:.40}"
        )
    if frozen not in FROZEN_PRECISIONS:
        raise SpecError(
            f"{where}.{keys[3]}: expected one of {', '.join(FROZEN_PRECISIONS)}, got {frozen!r:.40}"
        )
    return LoraConfig(rank=rank, alpha=float(alpha), targets=tuple(targets), frozen=str(frozen))


def without_lora(model_table: Mapping[str, Any]) -> Mapping[str, Any]:
    """A job spec's ``[model]`` table, refused when it carries ``lora`` (set in ``[train]``)."""
    if "lora" in model_table:
        raise SpecError('model.lora: LoRA is set in [train] (finetune = "lora", lora_rank, ...)')
    return model_table


def apply_finetune(train: Mapping[str, Any], used: set[str], model: ModelSpec) -> ModelSpec:
    """The job's model with ``[train]``'s LoRA settings attached (``model`` itself for a full
    fine-tune). Marks the keys it read in ``used``; SpecError names ``train.key``."""
    used.update(("finetune", *LORA_KEYS))
    finetune = train.get("finetune", "full")
    if finetune not in FINETUNES:
        raise SpecError(
            f"train.finetune: expected one of {', '.join(FINETUNES)}, got {finetune!r:.40}"
        )
    if finetune == "full":
        for key in LORA_KEYS:
            if key in train:
                raise SpecError(f'train.{key}: only with finetune = "lora"')
        return model
    d = LoraConfig()
    config = _config(
        train.get("lora_rank", d.rank),
        train.get("lora_alpha", d.alpha),
        train.get("lora_targets", list(d.targets)),
        train.get("frozen_precision", d.frozen),
        "train",
        LORA_KEYS,
    )
    return with_lora(model, config, where="train")


def with_lora(model: ModelSpec, config: LoraConfig, *, where: str) -> ModelSpec:
    """``model`` with ``config`` attached, once its targets and rank fit the model's layers."""
    from .modelspec import manifest

    spec = replace(model, lora=config)
    try:
        manifest(spec)  # builds it on the meta device: the targets and the rank are checked there
    except SpecError as exc:
        raise SpecError(f"{where}.{exc}") from None
    return spec


def check_finetune(model: ModelSpec, *, secure_aggregation: bool) -> None:
    """What a LoRA job cannot be combined with, in one line."""
    if model.lora is None:
        return
    if secure_aggregation:
        raise SpecError(
            'train.finetune: "lora" with [privacy] secure_aggregation is not supported in this '
            "release (the masked sum covers the whole model, a LoRA update only its adapters)"
        )


__all__ = [
    "FINETUNES",
    "FROZEN_PRECISIONS",
    "LORA_KEYS",
    "LoraConfig",
    "apply_finetune",
    "check_finetune",
    "with_lora",
    "without_lora",
]
