"""`gpuflex-hub job plan JOB`: the pipeline plan the job would get on the nodes online now (GET
/v1/jobs/{id}/plan), as a table of stages, or the planner's one-line refusal."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from . import owner_client as oc
from .cli_common import _hub_and_token, column_lines

COLUMNS = ("pipeline", "stage", "units", "node", "memory used / offered", "step", "bubble")


def cmd_job_plan(args: argparse.Namespace) -> int:
    hub, token = _hub_and_token(args)
    doc = asyncio.run(oc.job_plan(hub, token, args.id))
    if args.json:
        print(json.dumps(doc))
        return 0
    print("\n".join(plan_lines(doc)))
    return 0


def plan_lines(doc: dict[str, Any]) -> list[str]:
    """The plan as text: a heading, one row per stage (ids whole), and where the offers came from."""
    model = doc["model"]
    head = (
        f"job {doc['id']}: {model['units']} pipeline units, {size(model['state_bytes'])} of state"
        f" (parameters, gradients, optimizer), batch {doc['batch_size']}"
    )
    lines = [head]
    plan = doc.get("plan")
    if plan is None:
        lines.append(f"refused: {doc['refused']}")
    else:
        sps = plan.get("samples_per_s")
        lines.append(
            f"{plan['replicas']} pipeline{'s' if plan['replicas'] != 1 else ''}, predicted step"
            f" {seconds(plan['step_s'])}" + (f", {sps:.4g} samples/s" if sps else "")
        )
        lines += _stage_table(plan["pipelines"])
    lines += _offer_notes(doc["offers"])
    return lines


def _stage_table(pipelines: list[dict[str, Any]]) -> list[str]:
    rows = []
    for k, p in enumerate(pipelines):
        for st in p["stages"]:
            first = st["stage"] == 0
            rows.append(
                (
                    str(k) if first else "",
                    str(st["stage"]),
                    _units(st),
                    st["node_id"],
                    f"{size(st['memory_bytes'])} / {size(st['offered_bytes'])}",
                    seconds(p["step_s"]) if first else "",
                    f"{p['bubble_fraction']:.0%}" if first else "",
                )
            )
    notes = [
        f"pipeline {k}: {p['micro_batches']} micro-batch{'es' if p['micro_batches'] != 1 else ''} of"
        f" {p['micro_batch_size']}, schedule {p['schedule']}"
        for k, p in enumerate(pipelines)
    ]
    return column_lines(COLUMNS, rows) + notes


def _units(st: dict[str, Any]) -> str:
    names = st["unit_names"]
    first, last = st["first_unit"], st["end_unit"] - 1
    if first == last:
        return f"{first} {names[0]}"
    return f"{first}-{last} {names[0]}..{names[-1]}"


def _offer_notes(offers: dict[str, Any]) -> list[str]:
    link = offers["link"]
    lines = [
        f"offers: {len(offers['nodes'])} of {offers['online']} online node(s)",
        f"speed: {offers['speed']['derived']}",
        *(
            f"speed of {n['node_id']}: measured on its stage, median of {n['speed_steps']} step(s)"
            for n in offers["nodes"]
            if n.get("speed_from") == "stage_reports"
        ),
        *(
            [f"benchmarks scaled x{scale:.3g} to the measured nodes' speeds"]
            if (scale := offers["speed"].get("benchmark_scale", 1.0)) != 1.0
            else []
        ),
        *(
            f"link of {n['node_id']}: {size(n['bandwidth_bytes_per_s'])}/s as its bodies came in"
            for n in offers["nodes"]
            if n.get("bandwidth_measured")
        ),
        f"link{' (a node not timed yet)' if not link.get('assumed') else ''}: "
        f"{'assumed ' if link.get('assumed') else ''}{size(link['bandwidth_bytes_per_s'])}/s,"
        f" round trip {link['rtt_s'] * 1e3:.0f} ms",
    ]
    left = offers["left_out"]
    if left["count"]:
        lines.append(f"left out: {left['count']} node(s) {left['why']}")
    return lines


def size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"
