"""Loss detection: a stage node's reports are its liveness. A stage silent for longer than the
hub's ``stage_timeout_s`` (counted from its last report, or from when it was handed its stage)
is lost, and so is a stage whose node was banned or suspended meanwhile.

When a stage dies its neighbours stop too (they wait for its tensors), so several stages fall
silent together; the one that is lost is the one behind: the fewest steps reported, then the
longest silence."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ...model.pipeline import Generation, StepReport


def lost_stage(
    g: Generation,
    last_report: Mapping[int, float],
    reports: Mapping[int, StepReport],
    now: float,
    timeout_s: float,
    barred: Callable[[str], bool],
) -> tuple[str, str] | None:
    """(the lost node, why: one line naming its stage) for generation ``g``, or None."""
    for s, slot in enumerate(g.stages):
        if barred(slot.node_id):
            return slot.node_id, f"stage {s}'s node {slot.node_id} was banned or suspended"
    silent = [s for s in range(len(g.stages)) if now - last_report.get(s, g.created_at) > timeout_s]
    if not silent:
        return None

    def behind(s: int) -> tuple[int, float]:
        done = reports[s].steps_done if s in reports else g.first_step
        return done, last_report.get(s, g.created_at)

    s = min(silent, key=behind)
    node = g.stages[s].node_id
    quiet = now - last_report.get(s, g.created_at)
    return node, (
        f"stage {s}'s node {node} sent no report for {quiet:.0f} s after step"
        f" {behind(s)[0]} (the hub's stage_timeout_s is {timeout_s:g} s)"
    )


__all__ = ["lost_stage"]
