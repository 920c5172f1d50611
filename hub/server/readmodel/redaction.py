"""What a job's [privacy] option keeps from its owner: a redacted copy of the status document and
of the console's extras (owner_view)."""

from __future__ import annotations

import copy
from typing import Any

from gpuflex.protocol.jobspec import JobSpec

from ...storage.tokens import Principal


def owner_view(
    doc: dict[str, Any], spec: JobSpec | None, who: Principal, extras: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What the owner of a job with a [privacy] option may see of its status (``doc``) and of the
    console's extras (shard map, flags); admins and auditors, the hub's own side, see everything.

    - secure aggregation: no update's training loss (a function of one silo's rows); the round's
      train loss, their weighted mean, stays.
    - central differential privacy, which protects whether a given silo took part against
      whoever sees the published models (the owner among them): no node id (each node is a
      positional pseudonym, silo-1, silo-2, ..., never derived from its id), no per-silo or
      per-update sample count, loss, size, blob id, label histogram, training time or share.
      Counts (silos attached, updates per round, shards) and the model's metrics stay.

    Neither doc nor extras is changed: what is redacted is a copy (extras come back under "extras")."""
    mode = (
        None
        if spec is None or who.role != "owner"
        else (
            "dp" if spec.privacy.central else "secagg" if spec.privacy.secure_aggregation else None
        )
    )
    out, ext = doc, extras
    if mode is not None:
        out, ext = copy.deepcopy(doc), copy.deepcopy(extras)
        (_pseudonymize if mode == "dp" else _hide_update_losses)(out, ext)
    return out if ext is None else out | {"extras": ext}


def _hide_update_losses(doc: dict[str, Any], _extras: dict[str, Any] | None) -> None:
    """owner_view under secure aggregation (in place, on copies)."""
    doc["redacted"] = "secure aggregation: no update's own training loss is shown"
    for h in doc["history"]:
        for u in h["updates"]:
            u["loss"] = None


def _pseudonymize(doc: dict[str, Any], extras: dict[str, Any] | None) -> None:
    """owner_view under central DP (in place, on copies): positional pseudonyms for node ids, and
    no per-silo or per-update count, loss, size, blob, histogram, timing or share."""
    names: dict[str, str] = {}

    def alias(node: Any) -> Any:
        return names.setdefault(node, f"silo-{len(names) + 1}") if isinstance(node, str) else node

    doc["redacted"] = (
        "central differential privacy: nodes are pseudonyms, and no silo's or update's "
        "sample count, loss, size or timing is shown"
    )
    for silo in doc.get("silos", []):
        silo.update(
            node_id=alias(silo["node_id"]), samples=None, blob=None, size=None, label_histogram=None
        )
    for w in doc.get("unverified_work", []):
        w["node_id"] = alias(w["node_id"])
    for h in doc["history"]:
        for u in h["updates"]:
            u.update(node_id=alias(u["node_id"]), samples=None, loss=None, chunks=None)
            if u.get("verified_by"):
                u["verified_by"] = {**u["verified_by"], "replicas": [alias(n) for n in u["verified_by"]["replicas"]]}
        for f in h["flags"]:
            f["node_id"] = alias(f["node_id"])
        for sh in h.get("shards", []):
            sh.update(
                nodes=[alias(n) for n in sh["nodes"]],
                samples=None,
                chunks=None,
                train_s=None,
                elapsed_s=None,
            )
        h["node_shares"] = {}
        h.get("parallel", {}).update(balance=None)
    if extras is None:
        return
    for sh in extras.get("shards", []):
        sh.update(samples=None, chunks=[{"idx": "-", "sha": ""} for _ in sh.get("chunks", [])])
        for a in sh.get("assignments", []):
            a["node_id"] = alias(a["node_id"])
    for f in extras.get("flags", []):
        f["node_id"] = alias(f["node_id"])
