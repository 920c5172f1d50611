"""A unit's checkpoint: which steps are checkpoint steps, what a unit's state blob must hold, and
when a step becomes the job's committed step.

A unit state blob (GFT1) holds exactly the unit's own state-dict entries (their names, shapes and
dtypes) and, besides them, only optimizer entries: ``optim.<slot>.<name>`` for a trainable
parameter ``name`` of the unit (slot ``momentum_buffer`` for SGD with momentum,
``exp_avg``/``exp_avg_sq`` for Adam and AdamW; the parameter's shape, float32) and
``optim.step`` (int64, shape [1]) for Adam and AdamW. Every float is finite.
"""

from __future__ import annotations

from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.jobspec import TrainSpec
from gpuflex.protocol.tensors import TensorSpec, check_blob, decode_state, max_encoded_size

from ...base.errors import Unprocessable
from ...model.pipeline import PipelineState

#: name -> (shape, dtype, trainable parameter): one unit's state entries (offers.ModelCut.entries)
Entries = dict[str, tuple[tuple[int, ...], str, bool]]


def is_checkpoint_step(step: int, *, first_step: int, end_step: int, every: int) -> bool:
    """A stage uploads its units' states after step ``step`` when it is a multiple of ``every``
    or the last, and only for steps its generation ran (after ``first_step``)."""
    return first_step < step <= end_step and (step % every == 0 or step == end_step)


def optimizer_slots(train: TrainSpec) -> tuple[str, ...]:
    if train.optimizer in ("adam", "adamw"):
        return ("exp_avg", "exp_avg_sq")
    return ("momentum_buffer",) if train.momentum > 0 else ()


def unit_manifest(entries: Entries, train: TrainSpec) -> list[TensorSpec]:
    """Every tensor a unit's state blob may hold (its entries, then the optimizer's)."""
    specs = [TensorSpec(name, dtype, shape) for name, (shape, dtype, _) in entries.items()]
    for slot in optimizer_slots(train):
        specs += [
            TensorSpec(f"optim.{slot}.{name}", "float32", shape)
            for name, (shape, _, trainable) in entries.items()
            if trainable
        ]
    if train.optimizer in ("adam", "adamw"):
        specs.append(TensorSpec("optim.step", "int64", (1,)))
    return specs


def max_state_bytes(entries: Entries, train: TrainSpec) -> int:
    """The most bytes a unit's state blob can take: what a checkpoint beyond is refused for."""
    return max_encoded_size(unit_manifest(entries, train))


def check_unit_state(body: bytes, unit_name: str, entries: Entries, train: TrainSpec) -> None:
    """Unprocessable (one line, code ``bad_state``) unless ``body`` is a unit state blob of this
    unit (see the module docstring). Blocking (decodes the header): a worker thread's."""
    allowed = {s.name: s for s in unit_manifest(entries, train)}
    try:
        state = decode_state(body)
    except ProtocolError as exc:
        raise Unprocessable(
            f"unit {unit_name}'s state is not a GFT1 state: {exc}", code="bad_state"
        ) from None
    names = set(state)
    missing = sorted(set(entries) - names)
    unknown = sorted(names - set(allowed))
    if missing or unknown:
        raise Unprocessable(
            f"unit {unit_name}'s state must hold exactly its entries and optimizer state"
            f" (missing {missing[:3]}, unexpected {unknown[:3]})",
            code="bad_state",
        )
    manifest = [allowed[name] for name in state]
    del state
    try:
        nonfinite = check_blob(body, manifest)
    except ProtocolError as exc:
        raise Unprocessable(
            f"unit {unit_name}'s state does not fit the unit: {exc}", code="bad_state"
        ) from None
    if nonfinite is not None:
        raise Unprocessable(
            f"unit {unit_name}'s state holds NaN or infinite values in {nonfinite!r}",
            code="nonfinite",
        )


def committed_after(state: PipelineState, step: int) -> int | None:
    """The job's new committed step once a unit's state at ``step`` is recorded: ``step`` when
    every unit now has a state there and it is past the committed step; None otherwise."""
    if step > state.committed_step and state.complete_step(step):
        return step
    return None


__all__ = [
    "Entries",
    "check_unit_state",
    "committed_after",
    "is_checkpoint_step",
    "max_state_bytes",
    "optimizer_slots",
    "unit_manifest",
]
