"""Loss detection: a stage node's reports are its liveness. A stage silent for longer than its
limit (counted from its last report, or from when it was handed its stage) is lost, and so is a
stage whose node was banned or suspended meanwhile.

The limit is the hub's ``stage_timeout_s``, except for a stage that has reported a step and is
running a step that uploads no checkpoint: it reports after every step, so a silence of
``SILENT_STEPS`` times its last step (at least ``SILENCE_MIN_S``) means it is gone, and a node
killed mid-step is replaced in seconds rather than after the whole timeout. A stage's first
step (it may still be fetching its units) and a checkpoint step (it uploads its units' states
before it reports) keep the full timeout.

When a stage dies its neighbours stop too (they wait for its tensors; with pipelines sharing
the steps, every pipeline waits for its gradients), so several stages fall silent together; the
one that is lost is the one behind: the fewest steps reported, then the node the hub heard from
least recently (a blocked stage's node keeps asking the relay for its tensors, a dead one asks
nothing), then the longest silence."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final

from ...model.pipeline import Generation, StepReport
from .checkpoints import is_checkpoint_step

#: a stage mid-step is lost once silent this many of its steps ...
SILENT_STEPS: Final = 20.0
#: ... and at least this long
SILENCE_MIN_S: Final = 5.0


def silence_limit(
    g: Generation, report: StepReport | None, timeout_s: float, checkpoint_every: int
) -> float:
    """How long stage ``report.stage`` of ``g`` may be silent: see the module's docstring.
    ``checkpoint_every`` 0: the checkpoint steps are unknown (the full timeout throughout)."""
    if report is None or checkpoint_every < 1:
        return timeout_s
    running = report.steps_done + 1  # the step it runs now ends with this many done
    if running > g.end_step or is_checkpoint_step(
        running, first_step=g.first_step, end_step=g.end_step, every=checkpoint_every
    ):
        return timeout_s
    return min(timeout_s, max(SILENCE_MIN_S, SILENT_STEPS * report.step_s))


def lost_stage(
    g: Generation,
    last_report: Mapping[int, float],
    reports: Mapping[int, StepReport],
    now: float,
    timeout_s: float,
    barred: Callable[[str], bool],
    checkpoint_every: int = 0,
    seen: Callable[[str], float] | None = None,
) -> tuple[str, str] | None:
    """(the lost node, why: one line naming its stage) for generation ``g``, or None.
    ``seen(node)``: when the hub last heard from the node, any request (None: not known)."""
    for s, slot in enumerate(g.stages):
        if barred(slot.node_id):
            return slot.node_id, f"stage {s}'s node {slot.node_id} was banned or suspended"
    limits = {
        s: silence_limit(g, reports.get(s), timeout_s, checkpoint_every)
        for s in range(len(g.stages))
    }
    silent = [
        s for s in range(len(g.stages)) if now - last_report.get(s, g.created_at) > limits[s]
    ]
    if not silent:
        return None

    def behind(s: int) -> tuple[int, float, float]:
        done = reports[s].steps_done if s in reports else g.first_step
        heard = 0.0 if seen is None else seen(g.stages[s].node_id)
        return done, heard, last_report.get(s, g.created_at)

    s = min(silent, key=behind)
    node = g.stages[s].node_id
    quiet = now - last_report.get(s, g.created_at)
    limit = (
        f"the hub's stage_timeout_s is {timeout_s:g} s"
        if limits[s] >= timeout_s
        else f"its steps took {reports[s].step_s:.2g} s: the hub waits {limits[s]:.2g} s"
    )
    return node, (
        f"stage {s}'s node {node} sent no report for {quiet:.0f} s after step"
        f" {behind(s)[0]} ({limit})"
    )


__all__ = ["SILENCE_MIN_S", "SILENT_STEPS", "lost_stage", "silence_limit"]
