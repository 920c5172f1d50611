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
    runners: Sequence[StageRunner],
    steps: Sequence[StepData],
    *,
    first_step: int = 0,
    counts: Sequence[int] = (),
) -> list[float]:
    """Train ``steps`` on ``runners`` (every pipeline's stages; each step's micro-batches shared
    by the pipelines as ``StageRunner.lane`` says: ``counts[p]`` to pipeline ``p``, evenly when
    ``counts`` is empty), each in its own thread; each step's loss (summed over the pipelines'
    last stages). The first error, if any, is raised once every thread has ended."""
    losses: dict[int, float] = {}
    reached: dict[int, int] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work(runner: StageRunner) -> None:
        try:
            for n, (inputs, targets) in enumerate(steps):
                share = counts or (len(targets) // runner.lanes,) * runner.lanes
                m = share[runner.lane]
                first = sum(share[: runner.lane])
                mine = slice(first, first + m)
                loss = runner.run_step(
                    first_step + n,
                    m,
                    inputs=inputs[mine] if runner.stage == 0 else (),
                    targets=targets[mine] if runner.stage == runner.stages - 1 else (),
                )
                if loss is not None:
                    with lock:
                        losses[n] = losses.get(n, 0.0) + loss
                        reached[n] = reached.get(n, 0) + 1
        except BaseException as exc:  # handed to the caller below
            errors.append(exc)

    threads = [
        threading.Thread(
            target=work, args=(r,), name=f"gpuflex-stage-{r.lane}.{r.stage}", daemon=True
        )
        for r in runners
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    lanes = max((r.lanes for r in runners), default=1)
    if any(reached.get(n, 0) != lanes for n in range(len(steps))):
        done = sum(1 for n in range(len(steps)) if reached.get(n, 0) == lanes)
        raise PipelineError(f"{done} of {len(steps)} steps reached the last stage")
    return [losses[n] for n in range(len(steps))]

__all__ = ["StepData", "run_stages"]
