"""Run every stage of a pipeline in this process, one thread each (tests, benches, a machine that
holds several stages): the stages meet only through their transport."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from torch import Tensor

from ..errors import PipelineError
from .stage import StageRunner

#: one step's micro-batches: (inputs, targets)
StepData = tuple[Sequence[Tensor], Sequence[Tensor]]


def run_stages(
    runners: Sequence[StageRunner], steps: Sequence[StepData], *, first_step: int = 0
) -> list[float]:
    """Train ``steps`` on ``runners`` (stage 0 first), each in its own thread; the last stage's
    loss of each step. The first stage's error, if any, is raised once every thread has ended."""
    losses: list[float] = []
    errors: list[BaseException] = []

    def work(runner: StageRunner) -> None:
        try:
            for n, (inputs, targets) in enumerate(steps):
                loss = runner.run_step(
                    first_step + n,
                    len(targets),
                    inputs=inputs if runner.stage == 0 else (),
                    targets=targets if runner.stage == runner.stages - 1 else (),
                )
                if loss is not None:
                    losses.append(loss)
        except BaseException as exc:  # handed to the caller below
            errors.append(exc)

    threads = [
        threading.Thread(target=work, args=(r,), name=f"gpuflex-stage-{r.stage}", daemon=True)
        for r in runners
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    if len(losses) != len(steps):
        raise PipelineError(f"{len(losses)} of {len(steps)} steps reached the last stage")
    return losses


__all__ = ["StepData", "run_stages"]
