"""`gpuflex-hub job status JOB` for a pipelined job: its pipeline (GET /v1/jobs/{id}'s "pipeline")
as text: the committed step against the last, the live generation's stages (units, node,
predicted against measured time), the bubble, every generation with why it was planned, or
the planner's one-line refusal while the job waits for nodes."""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from . import owner_client as oc
from .cli_common import column_lines
from .cli_plan import seconds, size

COLUMNS = (
    "stage",
    "units",
    "node",
    "memory / offered",
    "predicted / micro-batch",
    "step (measured)",
    "steps done",
)


def pipeline_lines(doc: dict[str, Any]) -> list[str]:
    """A pipelined job's status, every value whole."""
    p = doc["pipeline"]
    lines = [
        f"{doc['id']}  {doc['name']}  state={doc['state']}",
        f"step {p['committed_step']}/{p['steps']} committed (checkpoints every {p['checkpoint_every']} steps)",
    ]
    if doc.get("error"):
        lines.append(f"error: {doc['error']}")
    g = p.get("generation")
    if g is not None:
        measured = g.get("measured_step_s")
        lines.append(
            f"generation {g['number']} from step {g['first_step']}: {_shape(g)},"
            f" {g['micro_batches']} micro-batches of {g['micro_batch_size']}, {g['schedule']}, step"
            f" predicted {seconds(g['predicted_step_s'])}, measured"
            f" {'-' if measured is None else seconds(measured)}, bubble {g['bubble_fraction']:.0%}"
            + ("" if g.get("loss") is None else f", loss {g['loss']:.4f}")
        )
        lanes = g.get("lanes") or [None] * len(g["stages"])
        lines += column_lines(
            COLUMNS, [_stage_row(st, lane) for st, lane in zip(g["stages"], lanes, strict=True)]
        )
    elif p.get("waiting"):
        lines.append(f"waiting: {p['waiting']}")
    for past in p["generations"]:
        measured = past.get("measured_step_s")
        lines.append(
            f"generation {past['generation']} (from step {past['first_step']}, {past['stages']} stages,"
            f" step predicted {seconds(past['predicted_step_s'])}, measured"
            f" {'-' if measured is None else seconds(measured)}"
            + ("" if past.get("loss") is None else f", loss {past['loss']:.4f}")
            + f"): {past['reason']}"
        )
    return lines


def _shape(g: dict[str, Any]) -> str:
    """``4 stages``, or ``2 pipelines of 2 stages`` when pipelines share the steps (each runs
    its micro-batches)."""
    lanes = g.get("pipelines", 1)
    if lanes == 1:
        return f"{len(g['stages'])} stages"
    counts = g.get("lane_micro_batches") or []
    share = f" running {'+'.join(map(str, counts))} micro-batches" if len(set(counts)) > 1 else ""
    return f"{lanes} pipelines of {len(g['stages']) // lanes} stages{share}"


def _stage_row(st: dict[str, Any], lane: dict[str, int] | None) -> tuple[str, ...]:
    names = st["unit_names"]
    first, last = st["first_unit"], st["end_unit"] - 1
    units = f"{first} {names[0]}" if first == last else f"{first}-{last}"
    if names and first != last:
        units += f" {names[0]}..{names[-1]}"
    step = st.get("step_s")
    offered = st.get("offered_bytes")
    return (
        str(st["stage"]) if lane is None else f"{lane['pipeline']}.{lane['stage']}",
        units,
        st["node_id"],
        size(st["memory_bytes"]) + ("" if offered is None else f" / {size(offered)}"),
        seconds(st["predicted_micro_batch_s"]),
        "-" if step is None else seconds(step),
        "-" if st.get("steps_done") is None else str(st["steps_done"]),
    )


def print_pipeline_status(
    doc: dict[str, Any], args: argparse.Namespace, hub: str, token: str
) -> int:
    """Print it; --watch prints it again, after a blank line, each time it changes."""
    shown = pipeline_lines(doc)
    print("\n".join(shown), flush=True)
    while args.watch and doc["state"] in ("queued", "running"):
        time.sleep(args.interval)
        doc = asyncio.run(oc.job_status(hub, token, args.id))
        lines = pipeline_lines(doc)
        if lines != shown:
            print("\n" + "\n".join(lines), flush=True)
            shown = lines
    return 0


__all__ = ["pipeline_lines", "print_pipeline_status"]
