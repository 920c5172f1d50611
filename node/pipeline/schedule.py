"""The order of one stage's forward and backward micro-batches in a step: pure, no tensors.

"gpipe": every forward, then every backward (GPipe). "1f1b": a warm-up of forwards as deep as
the stages after this one, then one forward and one backward in turn, then the remaining
backwards (PipeDream-Flush / Megatron's 1F1B): the same result, fewer activations held.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from ..errors import PipelineError

SCHEDULES: Final = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Action:
    """Run micro-batch ``micro_batch``'s forward ("F") or backward ("B") on this stage."""

    op: Literal["F", "B"]
    micro_batch: int


def stage_actions(
    schedule: str, *, stage: int, stages: int, micro_batches: int
) -> tuple[Action, ...]:
    """Stage ``stage`` of ``stages``: its forwards and backwards over ``micro_batches``, in order."""
    if schedule not in SCHEDULES:
        raise PipelineError(
            f"unknown pipeline schedule {schedule!r}; allowed: {', '.join(SCHEDULES)}"
        )
    if stages < 1 or not 0 <= stage < stages:
        raise PipelineError(f"stage {stage} is not one of {stages} stages")
    if micro_batches < 1:
        raise PipelineError("a step needs at least one micro-batch")
    forwards = [Action("F", i) for i in range(micro_batches)]
    backwards = [Action("B", i) for i in range(micro_batches)]
    if schedule == "gpipe":
        return (*forwards, *backwards)
    warm = min(stages - 1 - stage, micro_batches)
    order = forwards[:warm]
    for f, b in zip(forwards[warm:], backwards, strict=False):
        order += [f, b]
    order += backwards[micro_batches - warm :]
    return tuple(order)


__all__ = ["SCHEDULES", "Action", "stage_actions"]
