"""A flag's evidence as it is shown: its scores against the thresholds they broke, its headline
(the check it failed, in one line), the referee's re-executed segments, and the flagged update
against its round's centre, layer by layer.

Verification's flag evidence carries whole-update scores (cosine, norm ratio, replica distance).
An auditor also wants to see *where* an update departs: which layers point the other way or are
blown up. When the evidence itself has no per-layer rows, they are computed here from the stored
update blobs: the centre is the coordinate-wise median (hub/policy/aggregation.py
coordinate_median, the same robust centre verification scores against) of the round's candidate
updates (those aggregated plus those quarantined as outliers).

``layer_profile`` is a pure function; ``round_layer_evidence`` is the blocking loader (run it in
a thread); ``layer_evidence`` runs it for a request and keeps a closed round's result. They are
bounded: only small rounds and models are profiled on demand, larger ones show the recorded
evidence only.
"""

from __future__ import annotations

import asyncio
import math
import sqlite3
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from aiohttp import web
from gpuflex.protocol.jobspec import VerificationSpec
from torch import Tensor

from ..appkeys import BLOBS, LAYER_CACHE, STORE
from .figures import short_number as _fmt

MAX_UPDATES = 32
MAX_MODEL_BYTES = 64 << 20
MAX_LAYERS = 64


def layer_profile(
    update: Mapping[str, Tensor], centre: Mapping[str, Tensor], *, max_layers: int = MAX_LAYERS
) -> list[dict[str, Any]]:
    """One row per floating tensor, in the update's order: its L2 norm, the centre's
    norm and their cosine (0 when either is zero). Inputs are only read."""
    rows: list[dict[str, Any]] = []
    for name, t in update.items():
        if not t.is_floating_point() or name not in centre:
            continue
        a = t.detach().reshape(-1).double()
        c = centre[name].detach().reshape(-1).double()
        if a.numel() != c.numel():
            continue
        na, nc = float(a.norm()), float(c.norm())
        cos = float(a @ c) / (na * nc) if na > 0 and nc > 0 else 0.0
        if not all(math.isfinite(v) for v in (na, nc, cos)):
            continue
        rows.append({"name": name, "norm": na, "centre_norm": nc, "cosine": cos})
        if len(rows) >= max_layers:
            break
    return rows


def candidate_shas(conn: sqlite3.Connection, flag: Mapping[str, Any]) -> dict[str, Any] | None:
    """Blob ids needed to profile ``flag``: the flagged update and the round's candidates.

    None when the round or the model is too large to profile on a page view."""
    job = conn.execute("SELECT model_size FROM jobs WHERE id = ?", (flag["job_id"],)).fetchone()
    rnd = conn.execute(
        "SELECT closed_at FROM rounds WHERE job_id = ? AND round = ?",
        (flag["job_id"], flag["round"]),
    ).fetchone()
    mine = conn.execute("SELECT sha FROM updates WHERE id = ?", (flag["update_id"],)).fetchone()
    if job is None or mine is None or int(job["model_size"]) > MAX_MODEL_BYTES:
        return None
    rows = conn.execute(
        "SELECT sha FROM updates WHERE job_id = ? AND round = ? AND (status = 'included' OR id IN"
        " (SELECT update_id FROM flags WHERE job_id = ? AND round = ? AND reason = 'outlier'))"
        " ORDER BY received_at, id LIMIT ?",
        (flag["job_id"], flag["round"], flag["job_id"], flag["round"], MAX_UPDATES + 1),
    ).fetchall()
    shas = [r["sha"] for r in rows]
    if not shas or len(shas) > MAX_UPDATES:
        return None
    closed = rnd is not None and rnd["closed_at"] is not None
    return {"update": mine["sha"], "centre_of": shas, "closed": closed}


def round_layer_evidence(blobs: Any, needed: Mapping[str, Any]) -> dict[str, Any]:
    """Blocking: decode the blobs (zero-copy) and profile the flagged update."""
    from gpuflex.hub.domain.rounds import open_deltas
    from gpuflex.hub.policy.aggregation import coordinate_median

    shas = list(needed["centre_of"])
    with open_deltas(blobs, [needed["update"], *shas]) as states:
        centre = coordinate_median(states[1:])
        layers = layer_profile(states[0], centre)
        del centre, states  # drop the views before open_deltas closes their maps
    return {"layers": layers, "centre_of": len(shas), "closed": bool(needed.get("closed"))}


async def layer_evidence(app: web.Application, flag: dict[str, Any]) -> dict[str, Any] | None:
    """Per-layer rows of the flagged update against its round's centre (round_layer_evidence);
    None when the round or model is too large to profile on a page view."""
    cache = app[LAYER_CACHE]
    if flag["id"] in cache:
        return cache[flag["id"]]  # type: ignore[no-any-return]
    needed = await app[STORE].query(lambda c: candidate_shas(c, flag))
    result = None
    if needed is not None:
        result = await asyncio.to_thread(round_layer_evidence, app[BLOBS], needed)
    if result is not None and result["closed"]:  # a closed round's updates never change
        if len(cache) >= 256:
            cache.clear()
        cache[flag["id"]] = result
    return result


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def referee_rows(flag: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The referee's re-executed segments behind a flag (hub/policy/referee.py): this update's first,
    then the other replicas' of its group. Each row: node, update, round, steps (start, end),
    precision, reason (disagreement | spot_check), outcome, distance, threshold, why."""
    ev: Mapping[str, Any] = flag.get("evidence") or {}
    if not isinstance(ev, Mapping):
        return []
    mine = ev.get("referee")
    group = ev.get("group")
    items = [mine] if isinstance(mine, Mapping) else list(mine) if isinstance(mine, list) else []
    if isinstance(group, list):
        items += [
            g
            for g in group
            if isinstance(g, Mapping)
            and all(g.get("update") != i.get("update") for i in items if isinstance(i, Mapping))
        ]
    rows = []
    for v in items:
        if not isinstance(v, Mapping):
            continue
        steps = v.get("steps") if isinstance(v.get("steps"), list) else []
        rows.append(
            {
                "node": str(v.get("node", "")),
                "update": str(v.get("update", "")),
                "round": v.get("round"),
                "steps": [int(x) for x in steps if isinstance(x, int)],
                "precision": str(v.get("precision", "")),
                "reason": str(v.get("reason", "")),
                "outcome": str(v.get("outcome", "mismatch" if "why" in v else "")),
                "distance": _num(v.get("distance")),
                "threshold": _num(v.get("threshold")),
                "why": str(v.get("why", "")),
                "this": v.get("update") == flag.get("update_id"),
            }
        )
    return rows


#: one score to show: (name, value, threshold, bad_when "above" | "below", the rule with {th})
_Candidate = tuple[str, Any, Any, str, str]


def threshold_scores(flag: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A flag's scores against the thresholds they broke: rows of name, value, threshold,
    the rule in words, ``ok`` (None when there is no threshold) and ``bad_when``.

    ``flag`` carries ``evidence`` and, from flags.flag_context, ``round_evidence`` (the
    round's thresholds). The console's gauges and ``GET /v1/flags/{id}`` both show these rows."""
    ev: Mapping[str, Any] = flag.get("evidence") or {}
    if not isinstance(ev, Mapping):
        ev = {}
    rev: Mapping[str, Any] = flag.get("round_evidence") or {}
    # the job's own thresholds (its spec), else the round's recorded ones, else the spec's defaults
    limits: Mapping[str, Any] = {
        **asdict(VerificationSpec()),
        **rev,
        **(flag.get("thresholds") or {}),
    }
    scores = []
    for name, value, threshold, bad_when, rule in [
        *_update_scores(flag, ev, limits),
        *_referee_scores(flag, ev, limits),
    ]:
        v, th = _num(value), _num(threshold)
        if v is None:
            continue
        ok = None if th is None else (v <= th if bad_when == "above" else v >= th)
        scores.append(
            {
                "name": name,
                "value": v,
                "threshold": th,
                "bad_when": bad_when,
                "ok": ok,
                "rule": rule.format(th=_fmt(th) if th is not None else "n/a"),
            }
        )
    return scores


def _update_scores(
    flag: Mapping[str, Any], ev: Mapping[str, Any], limits: Mapping[str, Any]
) -> list[_Candidate]:
    """The scores verification records of the update itself: direction, size, replica distance,
    claimed samples and training time."""
    out: list[_Candidate] = [
        (
            "cosine to round centre",
            ev.get("cosine"),
            limits.get("cosine_min"),
            "below",
            "must be ≥ {th}",
        ),
        (
            "norm per sample / round median",
            ev.get("norm_ratio"),
            limits.get("norm_ratio_max"),
            "above",
            "must be ≤ {th}",
        ),
    ]
    if flag.get("reason") == "free_rider":
        out.append(
            (
                "update norm",
                ev.get("update_norm"),
                ev.get("threshold"),
                "below",
                "must be > {th} (free-rider floor)",
            )
        )
    elif _num(ev.get("norm_ratio")) is None:
        out.append(("update norm", ev.get("update_norm"), None, "above", ""))
    if "relative_distance_to_canonical" in ev:
        out.append(
            (
                "replica distance",
                ev.get("relative_distance_to_canonical"),
                ev.get("tolerance"),
                "above",
                "must be ≤ {th} (tolerance)",
            )
        )
    if "samples_claimed" in ev:
        out.append(
            (
                "samples claimed",
                ev.get("samples_claimed"),
                ev.get("shard_samples"),
                "above",
                "shard holds {th}",
            )
        )
    if "train_s" in ev:
        out.append(("train time (s)", ev.get("train_s"), None, "above", "node claims"))
    return out


def _referee_scores(
    flag: Mapping[str, Any], ev: Mapping[str, Any], limits: Mapping[str, Any]
) -> list[_Candidate]:
    """The referee's: each re-executed segment's distance, this update's binding to its committed
    state, and a replica's distance to the update it vouched for."""
    out: list[_Candidate] = []
    for row in referee_rows(flag):
        who = "this update's" if row["this"] else f"replica {row['update'][:14]}'s"
        steps = f" (steps {row['steps'][0]}-{row['steps'][1]})" if len(row["steps"]) == 2 else ""
        out.append(
            (
                f"{who} re-executed segment{steps}",
                row["distance"],
                row["threshold"],
                "above",
                "must be ≤ {th} (segment tolerance, " + (row["precision"] or "fp32") + ")",
            )
        )
    own = _own_referee(flag)
    if own is not None and _num(own.get("binding_distance")) is not None:
        out.append(
            (
                "this update vs. its committed last state minus the round's model",
                own["binding_distance"],
                0.0,
                "above",
                "must be {th}: the commitment binds the update",
            )
        )
    if "relative_distance" in ev and "vouched_for" in ev:
        out.append(
            (
                "distance to the update it vouched for",
                ev.get("relative_distance"),
                limits.get("tolerance"),
                "below",
                "agreed within {th}",
            )
        )
    return out


def _own_referee(flag: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The referee's verdict on the flagged update itself (hub/policy/referee.py's evidence), if any."""
    ev = flag.get("evidence")
    mine = ev.get("referee") if isinstance(ev, Mapping) else None
    if isinstance(mine, Mapping) and mine.get("update") == flag.get("update_id"):
        return mine
    return None


def _referee_check(v: Mapping[str, Any]) -> str:
    """One failed referee check in words, with its numbers."""
    why = str(v.get("why") or "")
    binding, dist, th = (
        _num(v.get("binding_distance")),
        _num(v.get("distance")),
        _num(v.get("threshold")),
    )
    if binding is not None:
        return f"{why}: relative distance {_fmt(binding)} (must be 0)"
    steps = v.get("steps")
    if dist is not None and th is not None and isinstance(steps, list) and len(steps) == 2:
        return (
            f"re-executed segment (steps {steps[0]}-{steps[1]}) ended {_fmt(dist)} from the committed"
            f" state (must be ≤ {_fmt(th)})"
        )
    return why or f"referee outcome: {v.get('outcome', '?')}"


def headline(flag: Mapping[str, Any]) -> str:
    """The check a flag failed, with its numbers, in one line: what the demo's round lines,
    ``gpuflex-hub audit show`` and the console's flag page lead with (GET /v1/flags/{id} carries
    it as ``headline``). The referee's verdict on this update comes first; then, for a replica
    that vouched for an update the referee failed, that update's check; then every score beyond
    its threshold; then the evidence's own words. A score that passed is never the headline."""
    ev = flag.get("evidence")
    ev = ev if isinstance(ev, Mapping) else {}
    own = _own_referee(flag)
    if own is not None:
        return "referee: " + _referee_check(own)
    theirs = ev.get("referee")
    if "vouched_for" in ev and isinstance(theirs, Mapping):
        return (
            f"agreed with {ev['vouched_for']} (relative distance {_fmt(_num(ev.get('relative_distance')) or 0.0)}),"
            f" which failed the referee: {_referee_check(theirs)}"
        )
    beyond = [s for s in threshold_scores(flag) if s["ok"] is False]
    if beyond:
        return "; ".join(f"{s['name']} {_fmt(s['value'])} ({s['rule']})" for s in beyond)
    words = [str(p) for p in ev.get("problems") or [] if isinstance(p, (str, int, float))]
    return words[0] if words else str(ev.get("why") or flag.get("reason") or "")
