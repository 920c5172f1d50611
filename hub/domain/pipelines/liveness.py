"""Loss detection: a stage node's relay connections and its reports are its liveness. A stage
whose node closed its relay connections is lost at once (below), a stage silent for longer than
its limit (counted from its last report, or from when it was handed its stage) is lost, and so is
a stage whose node was banned or suspended meanwhile.

A stage node behind the relay keeps GETs parked at the hub for the tensors it will receive, this
step's and the next's (node/pipeline/prefetch.py); when its process dies the kernel closes their
connections, and the hub sees the last of them end with its client gone (hub/model/node.py,
``RelayLink``). Once that is ``GONE_S`` old, and the node made no request since, its stage is
lost: it is re-planned exactly as a silent one (never flagged). A live node does not close its
takes while it runs a stage: a take answered (a tensor, or a 204 when none came in time) is asked
again or held until the stage uses it, and a node whose last take ended answered is not gone; a
slow step or a checkpoint upload leaves its takes parked. Hang-ups from before the stage was
handed to the node (its last stage's takes, closed as that stage ended) do not count, nor do
those of a stage that reported its last step (its run is over, its takes closed). A node without
parked takes (the direct transport only, ``--stage-listen``, or a prefetch holding every tensor
it may ask for), or one whose connections did not close (the machine lost power or its network),
is found by its silence.

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
#: a stage whose node closed its relay connections is lost once they have been closed this long
#: with no request from the node. The hub sees a closed connection within a tenth of a second; a
#: live node whose connection broke (a home line's hiccup, a NAT rebinding: its take fails)
#: connects again and asks at once, one to three round trips (TCP, then TLS), well under a second
#: even over a slow line. Should one take longer, it costs a re-plan, never a flag, and a dead
#: node is still replaced within about GONE_S instead of SILENCE_MIN_S
GONE_S: Final = 1.5


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


def gone_stage(
    g: Generation,
    last_report: Mapping[int, float],
    reports: Mapping[int, StepReport],
    now: float,
    gone: Callable[[str], float | None],
) -> tuple[str, str] | None:
    """(the node, why) of the stage of ``g`` whose node closed its relay connections longest
    ago, at least ``GONE_S`` ago and after the stage was handed to it or last reported, or None.
    ``gone(node)``: when its relay connections went away with no request since (None: they did
    not). A stage that reported its last step is never gone."""
    found: tuple[float, int] | None = None
    for s, slot in enumerate(g.stages):
        at = gone(slot.node_id)
        report = reports.get(s)
        if (
            at is None
            or now - at < GONE_S
            or at < last_report.get(s, g.created_at)
            or (report is not None and report.steps_done >= g.end_step)
        ):
            continue
        if found is None or at < found[0]:
            found = (at, s)
    if found is None:
        return None
    at, s = found
    node = g.stages[s].node_id
    return node, (
        f"stage {s}'s node {node} closed its relay connections {now - at:.1f} s ago and made no"
        " request since"
    )


def lost_stage(
    g: Generation,
    last_report: Mapping[int, float],
    reports: Mapping[int, StepReport],
    now: float,
    timeout_s: float,
    barred: Callable[[str], bool],
    checkpoint_every: int = 0,
    seen: Callable[[str], float] | None = None,
    gone: Callable[[str], float | None] | None = None,
) -> tuple[str, str] | None:
    """(the lost node, why: one line naming its stage) for generation ``g``, or None.
    ``seen(node)``: when the hub last heard from the node, any request (None: not known);
    ``gone(node)``: when its relay connections went away (``gone_stage``; None: not known)."""
    for s, slot in enumerate(g.stages):
        if barred(slot.node_id):
            return slot.node_id, f"stage {s}'s node {slot.node_id} was banned or suspended"
    if gone is not None and (closed := gone_stage(g, last_report, reports, now, gone)):
        return closed
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


__all__ = ["GONE_S", "SILENCE_MIN_S", "SILENT_STEPS", "gone_stage", "lost_stage", "silence_limit"]
