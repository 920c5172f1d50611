"""The read model: what owners, auditors and the console are shown.

Queries only; nothing here changes state (that is the ledger's, hub/domain/ledger/). Each
function takes the store's connection (through `Store.query`) or the app, applies the
caller's visibility rule, and returns plain JSON-ready documents. The API routes and
the console (hub/server/console) use the same functions, so they cannot disagree.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import re
import sqlite3
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web
from gpuflex.protocol.compute import class_key
from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.jobspec import JobSpec, parse_job_spec
from gpuflex.protocol.messages import ComputeClass, nested_from_dict, nested_to_dict
from gpuflex.protocol.modelfile import model_file_metadata
from gpuflex.protocol.tensors import decode_state, state_to_safetensors

from ..base.errors import BadRequest, Conflict, Forbidden, NotFound
from ..domain.waits import round_waits
from ..policy.privacy import epsilon
from ..storage.tokens import Principal
from .appkeys import BLOBS, CONFIG, HUB_KEY, LEDGER, STORE

FLAG_STATUSES = ("open", "confirmed", "dismissed", "moot")
#: the line the hub writes into a stored spec when it held out the validation set (hub/policy/datadefaults.py)
HELD_BY_HUB = re.compile(r"^validation_fraction = [0-9.]+  # set by the hub: no val file", re.M)


# -- jobs -------------------------------------------------------------------------------------


def require_job_reader(who: Principal) -> None:
    """Jobs and models are read by their owner and by admins; an auditor's token is for the
    evidence (flags, audit log, nodes), not for an owner's jobs or models."""
    if who.role not in ("owner", "admin"):
        raise Forbidden("jobs and models are read with an owner or admin token; an auditor token reads "
                        "flags, the audit log and nodes", code="wrong_role")


def visible(who: Principal) -> tuple[str, tuple[Any, ...]]:
    """The jobs `who` may read (SQL fragment): an admin all, an owner its own, an auditor none
    (403 wrong_role)."""
    require_job_reader(who)
    if who.role == "admin":
        return "1 = 1", ()
    return "owner = ?", (who.name,)


def job_row(conn: sqlite3.Connection, who: Principal, job_id: str) -> sqlite3.Row:
    where, args = visible(who)
    row = conn.execute(f"SELECT * FROM jobs WHERE id = ? AND {where}", (job_id, *args)).fetchone()  # noqa: S608
    if row is None:
        raise NotFound(f"no job {job_id} visible to you", code="unknown_job")
    return row


def jobs_list(conn: sqlite3.Connection, who: Principal) -> list[dict[str, Any]]:
    where, args = visible(who)
    rows = conn.execute(
        f"SELECT id, name, owner, state, round, rounds, model_hash, created_at, updated_at, error"  # noqa: S608
        f" FROM jobs WHERE {where} ORDER BY created_at", args).fetchall()
    return [dict(r) | {"model_hash": r["model_hash"]} for r in rows]


def job_status(conn: sqlite3.Connection, row: sqlite3.Row, spec: JobSpec | None) -> dict[str, Any]:
    """The status document: state, progress and one history entry per closed round. ``spec``: the
    job's spec as stored (``spec_of(row)``; the caller parses it once)."""
    job_id = row["id"]
    history: list[dict[str, Any]] = []
    rounds = conn.execute("SELECT * FROM rounds WHERE job_id = ? ORDER BY round", (job_id,)).fetchall()
    chunk_samples, chunk_count, chunk_max = conn.execute(
        "SELECT COALESCE(SUM(samples), 0), COUNT(*), COALESCE(MAX(samples), 0) FROM chunks WHERE job_id = ?",
        (job_id,)).fetchone()
    silos = [{"node_id": c["owner_node"], "samples": c["samples"], "blob": c["sha"], "size": c["size"],
              "label_histogram": None if c["histogram"] is None else json.loads(c["histogram"]),
              "attached_at": c["registered_at"]}
             for c in conn.execute("SELECT owner_node, samples, sha, size, histogram, registered_at FROM chunks"
                                   " WHERE job_id = ? AND owner_node IS NOT NULL ORDER BY idx", (job_id,))]
    for r in rounds:
        if r["closed_at"] is None:
            continue
        ups = conn.execute(
            "SELECT u.id, u.node_id, u.status, u.sample_count, u.loss, u.train_s, u.size, s.id AS shard_id, s.samples,"
            " s.replica_group, u.received_at - a.issued_at AS elapsed_s,"
            " (SELECT COUNT(*) FROM shard_chunks sc WHERE sc.shard_id = s.id) AS nchunks"
            " FROM updates u JOIN shards s ON s.id = u.shard_id JOIN assignments a ON a.id = u.assignment_id"
            " WHERE u.job_id = ? AND u.round = ?"
            " ORDER BY u.received_at, u.id", (job_id, r["round"])).fetchall()
        flags = conn.execute("SELECT id, node_id, reason, status FROM flags WHERE job_id = ? AND round = ?",
                             (job_id, r["round"])).fetchall()
        trained = sum(u["samples"] for u in ups)
        metrics = json.loads(r["metrics"] or "{}")
        ev = json.loads(r["evidence"] or "{}")
        history.append({
            "round": r["round"], "loss": r["loss"], "accuracy": r["accuracy"], "train_loss": r["train_loss"],
            "model_hash": r["new_model_hash"], "closed_at": r["closed_at"], "opened_at": r["opened_at"],
            "metrics": {k: v for k, v in metrics.items() if k != "bytes_down"},
            "transfer": _transfer(ups, row["model_size"], metrics.get("bytes_down")),
            # aggregated without a replica's confirmation: update id -> why (verification.unverified)
            "unverified": ev.get("unverified", {}),
            # replica groups: shard id -> same_class | cross_class (which tolerance judged it)
            "replica_comparison": ev.get("replica_comparison", {}),
            # secure_aggregation: the protocol's round (roster, survivors, summed, or why aborted);
            # probe: each update's effect on the owner's validation loss (node-local); late: the
            # round before's stragglers (late = "next"); privacy: the round's clip and noise (dp)
            **{k: ev[k] for k in ("secure_aggregation", "probe", "late", "privacy") if ev.get(k)},
            "updates": [{"update_id": u["id"], "node_id": u["node_id"], "chunks": u["nchunks"],
                         "samples": u["samples"], "loss": u["loss"], "status": u["status"],
                         "replica_group": u["replica_group"]} for u in ups],
            "flags": [{"flag_id": f["id"], "node_id": f["node_id"], "reason": f["reason"],
                       "status": f["status"]} for f in flags],
            # a node-local job is never replicated (each silo is on one node): its rounds train
            # the silos that were online, not every chunk
            "replication_overhead": (trained - chunk_samples) / chunk_samples if chunk_samples and not silos
            else 0.0,
            **_parallelism(ups, r["closed_at"] - r["opened_at"]),
        })
    return {
        "id": job_id, "name": row["name"], "owner": row["owner"], "state": row["state"],
        "round": row["round"], "rounds": row["rounds"], "model_hash": row["model_hash"],
        "train_samples": row["train_samples"], "val_samples": row["val_samples"],
        "error": row["error"], "created_at": row["created_at"], "updated_at": row["updated_at"],
        "history": history,
        "data_source": "hub" if spec is None else spec.data.source,
        "data": _data_summary(spec, row, int(chunk_count), int(chunk_max)),
        # node-local data: the silos attached (what the hub knows of each: never a row)
        **({"silos": silos} if silos or (spec is not None and spec.data.node_local) else {}),
        "parallel": _job_parallelism(history),
        **({"privacy": dp} if spec is not None and (dp := _privacy(spec, len(history))) is not None else {}),
    }


def _data_summary(spec: JobSpec | None, row: sqlite3.Row, chunks: int, chunk_max: int) -> dict[str, Any]:
    """How the job's data was cut: its chunks (a hub job's) and where its validation set came
    from, in words (with what to do when there is none: no round then reports accuracy)."""
    val_samples = int(row["val_samples"])
    fraction = None if spec is None else spec.data.validation_fraction
    node_local = spec is not None and spec.data.node_local
    if val_samples and fraction and HELD_BY_HUB.search(row["spec_toml"]):
        words = (f"{val_samples} samples held out of the training set ({fraction:.0%}, the hub's default without"
                 " a validation file); [data] validation_fraction = 0 turns the hold-out off")
    elif val_samples and fraction:  # the spec's own fraction: a validation file, when given, is used instead
        words = (f"{val_samples} samples: the validation file given with the job, or else held out of the"
                 f" training set (validation_fraction = {fraction:g})")
    elif val_samples:
        words = f"{val_samples} samples from the validation file given with the job"
    else:
        words = ("none, so no round reports loss or accuracy on held-out data: give a validation file (--val)"
                 + ("" if node_local else " or set [data] validation_fraction"))
    return {"validation_samples": val_samples, "validation": words,
            **({} if node_local else {"chunks": chunks, "chunk_size": chunk_max})}


def idle_note(online: int, pool_chunks: int, chunk_size: int) -> str | None:
    """Why nodes online get no shard of a hub job's round, in words: a shard is at least one
    chunk, so a round of fewer chunks than nodes online leaves the rest without one (None when
    it does not)."""
    if online <= pool_chunks:
        return None
    return (f"{online} nodes are online but a round has {pool_chunks} chunks of up to {chunk_size} samples;"
            f" a shard is at least one chunk, so {online - pool_chunks} of them get no shard of this job to train"
            " (at most a replica to check): a smaller [data] chunk_size spreads a round over more nodes")


def owner_view(doc: dict[str, Any], spec: JobSpec | None, who: Principal,
               extras: dict[str, Any] | None = None) -> dict[str, Any]:
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
    mode = None if spec is None or who.role != "owner" else (
        "dp" if spec.privacy.central else "secagg" if spec.privacy.secure_aggregation else None)
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

    doc["redacted"] = ("central differential privacy: nodes are pseudonyms, and no silo's or update's "
                       "sample count, loss, size or timing is shown")
    for silo in doc.get("silos", []):
        silo.update(node_id=alias(silo["node_id"]), samples=None, blob=None, size=None, label_histogram=None)
    for h in doc["history"]:
        for u in h["updates"]:
            u.update(node_id=alias(u["node_id"]), samples=None, loss=None, chunks=None)
        for f in h["flags"]:
            f["node_id"] = alias(f["node_id"])
        for sh in h.get("shards", []):
            sh.update(nodes=[alias(n) for n in sh["nodes"]], samples=None, chunks=None, train_s=None,
                      elapsed_s=None)
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


def spec_of(row: sqlite3.Row) -> JobSpec | None:
    """The job's spec as stored (None for a row without one that parses)."""
    try:
        return parse_job_spec(row["spec_toml"])
    except (ProtocolError, IndexError, KeyError):
        return None


def _privacy(spec: JobSpec, closed: int) -> dict[str, Any] | None:
    """[privacy] dp = "central": the mechanism and the job's (ε, δ) after its closed rounds and at
    its last (hub/policy/privacy.py's accountant); None when the job has no differential privacy. An ε
    with no finite bound (noise_multiplier 0) is null."""
    dp = spec.privacy
    if not dp.central:
        return None

    def finite(eps: float) -> float | None:
        return eps if math.isfinite(eps) else None

    return {"mechanism": "central gaussian, fixed clipping", "clip_norm": dp.clip_norm,
            "noise_multiplier": dp.noise_multiplier, "delta": dp.delta, "rounds": closed,
            "epsilon": finite(epsilon(closed, dp.noise_multiplier, dp.delta)),
            "epsilon_at_end": finite(epsilon(spec.train.rounds, dp.noise_multiplier, dp.delta))}


def _job_parallelism(history: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's summary of how it was spread: mean shards, nodes, speedup and efficiency per round."""
    ps = [h["parallel"] for h in history if h["parallel"]["nodes"]]
    if not ps:
        return {"rounds": 0, "shards": None, "nodes": None, "speedup": None, "efficiency": None}
    return {"rounds": len(ps), "shards": sum(p["shards"] for p in ps) / len(ps),
            "nodes": sum(p["nodes"] for p in ps) / len(ps),
            "speedup": sum(p["speedup"] for p in ps) / len(ps),
            "efficiency": sum(p["efficiency"] for p in ps) / len(ps)}


def _transfer(ups: Sequence[sqlite3.Row], model_size: int, bytes_down: float | None) -> dict[str, Any]:
    """A round's traffic: the updates' bytes up (every update received, whatever became of it),
    the models' and chunks' bytes down (None when the hub did not count them: rounds closed before
    it did), and the compression ratio: what the updates would weigh as full fp32 models over what
    they weighed (1.0 for fp32 updates, about 4 for int8: the job's [communication] update)."""
    up = sum(int(u["size"]) for u in ups)
    return {"updates": len(ups), "bytes_up": up, "bytes_down": None if bytes_down is None else int(bytes_down),
            "compression_ratio": (len(ups) * model_size / up) if up else None}


def _parallelism(ups: list[sqlite3.Row], wall_s: float) -> dict[str, Any]:
    """How a round was spread: its shards (size, nodes, training time), each node's share of the
    samples trained, and the parallel efficiency, the round's training time summed over nodes
    against its wall time (1.0 = every node trained the whole round)."""
    shards: dict[str, dict[str, Any]] = {}
    per_node: dict[str, int] = {}
    for u in ups:
        sh = shards.setdefault(u["shard_id"], {"shard_id": u["shard_id"], "samples": u["samples"],
                                                "chunks": u["nchunks"], "replicated": False,
                                                "nodes": [], "train_s": 0.0, "elapsed_s": 0.0})
        sh["nodes"].append(u["node_id"])
        sh["replicated"] = len(sh["nodes"]) >= 2  # trained twice or more, not only planned so
        sh["train_s"] = max(sh["train_s"], float(u["train_s"]))  # what the node reports
        sh["elapsed_s"] = max(sh["elapsed_s"], float(u["elapsed_s"]))  # issue to upload, as the hub saw it
        per_node[u["node_id"]] = per_node.get(u["node_id"], 0) + int(u["samples"])
    trained = sum(per_node.values())
    work_s = sum(float(u["train_s"]) for u in ups)
    nodes = len(per_node)
    wall = max(float(wall_s), 1e-9)
    times = [sh["train_s"] for sh in shards.values() if sh["train_s"] > 0]
    return {
        "shards": sorted(shards.values(), key=lambda sh: (-sh["samples"], sh["shard_id"])),
        "node_shares": {n: k / trained for n, k in sorted(per_node.items())} if trained else {},
        "parallel": {"nodes": nodes, "shards": len(shards), "wall_s": float(wall_s), "train_s_sum": work_s,
                     "speedup": work_s / wall, "efficiency": work_s / wall / nodes if nodes else 0.0,
                     "balance": max(times) / (sum(times) / len(times)) if times else None},
    }


async def job_document(app: web.Application, who: Principal, job_id: str) -> dict[str, Any]:
    """GET /v1/jobs/{id}: the stored status, with the live round's progress and any error the
    hub could not store yet (a failing store)."""
    doc, spec = await app[STORE].query(lambda c: _status_and_spec(c, job_row(c, who, job_id)))
    doc = owner_view(doc, spec, who)
    live = app[LEDGER].scheduler.jobs.get(job_id)
    if live is not None:
        if live.error and not doc.get("error"):
            doc["error"] = live.error
        if live.active:
            online = 0 if live.node_local else app[LEDGER].scheduler.presence.online_nodes(time.time())
            doc["progress"] = {
                "chunks_total": len(live.chunks), "chunks_covered": live.covered_chunks(),
                "chunks_free": len(live.free), "assignments_live": live.live_count(),
                "idle": idle_note(online, live.pool_chunks, int(doc["data"].get("chunk_size", 0))),
            }
    waiting = live_waits(app, who, job_id)
    if waiting is not None:
        doc["waiting"] = waiting
    return doc


def live_waits(app: web.Application, who: Principal, job_id: str) -> list[str] | None:
    """Why the job's open round waits, in words (hub/domain/waits.py); None when no round is open. The
    owner of a job under central differential privacy is told "a node", never which one."""
    scheduler = app[LEDGER].scheduler
    live = scheduler.jobs.get(job_id)
    if live is None or not live.active:
        return None
    names = not (who.role == "owner" and live.spec.privacy.central)
    return round_waits(scheduler, live, time.time(), names=names)


def _status_and_spec(conn: sqlite3.Connection, row: sqlite3.Row) -> tuple[dict[str, Any], JobSpec | None]:
    spec = spec_of(row)
    return job_status(conn, row, spec), spec


def model_version(conn: sqlite3.Connection, who: Principal, job_id: str, version: int | None) -> sqlite3.Row:
    """(version, sha) of a job's latest model, or of model `version`."""
    job_row(conn, who, job_id)
    if version is None:
        row = conn.execute("SELECT version, sha FROM models WHERE job_id = ? ORDER BY version DESC LIMIT 1",
                           (job_id,)).fetchone()
    else:
        row = conn.execute("SELECT version, sha FROM models WHERE job_id = ? AND version = ?",
                           (job_id, version)).fetchone()
    if row is None:
        raise NotFound(f"job {job_id} has no model for round {version}", code="unknown_round")
    return row  # type: ignore[no-any-return]


async def export_model(app: web.Application, who: Principal, job_id: str,
                       version: int | None = None) -> tuple[int, str, bytes]:
    """(version, model sha, .safetensors bytes) of a job's latest model or of model `version`
    (0 = initial, N = after N rounds), its metadata naming the model spec, the job, the version and
    the hub's key (protocol/modelfile.py model_file_metadata). Same owner scoping as the API."""

    row, spec = await app[STORE].query(lambda c: (model_version(c, who, job_id, version),
                                                   spec_of(job_row(c, who, job_id))))
    blobs = app[BLOBS]
    meta = None if spec is None else model_file_metadata(
        spec.model, job_id=job_id, round_=int(row["version"]), hub_fingerprint=app[HUB_KEY].fingerprint)

    def export() -> bytes:
        return state_to_safetensors(decode_state(blobs.read(row["sha"])), meta)

    return int(row["version"]), str(row["sha"]), await asyncio.to_thread(export)


# -- flags and nodes --------------------------------------------------------------------------


def _flag_dict(r: sqlite3.Row) -> dict[str, Any]:
    d = dict(r)
    d["evidence"] = json.loads(d["evidence"] or "{}")
    return d


def _flag_scope(who: Principal) -> tuple[str, tuple[Any, ...]]:
    if who.role in ("admin", "auditor"):
        return "1 = 1", ()
    return "f.job_id IN (SELECT id FROM jobs WHERE owner = ?)", (who.name,)


async def list_flags_for(app: web.Application, who: Principal, status: str | None = None,
                         job: str | None = None) -> list[dict[str, Any]]:
    """Flags visible to `who` (auditors/admins: all; owners: their jobs'), oldest first."""
    if status is not None and status not in FLAG_STATUSES:
        raise BadRequest(f"status must be one of {', '.join(FLAG_STATUSES)}", code="bad_status")
    if job is not None and len(job) > 64:
        raise BadRequest("job id is too long", code="bad_job")
    where, args = _flag_scope(who)
    sql = f"SELECT f.* FROM flags f WHERE {where}"  # noqa: S608 - fixed fragments only
    params: list[Any] = list(args)
    if status:
        sql += " AND f.status = ?"
        params.append(status)
    if job:
        sql += " AND f.job_id = ?"
        params.append(job)
    sql += " ORDER BY f.created_at, f.id LIMIT 10000"
    rows = await app[STORE].query(lambda c: c.execute(sql, params).fetchall())
    return [_flag_dict(r) for r in rows]


MAX_CANDIDATES = 10


def resolve_flag_id(conn: sqlite3.Connection, who: Principal, ref: str) -> str:
    """The flag id that `ref` names among the flags `who` may see: the id itself or, as git
    does with commits, any unique prefix of it (with or without the leading "f-").

    NotFound when nothing matches; Conflict ("ambiguous_flag") listing the candidates when
    more than one does. Ids are never cut short in what the hub or the CLI prints, so a
    prefix is always the user's choice."""
    where, args = _flag_scope(who)
    if not ref or len(ref) > 64 or not ref.isprintable():
        raise NotFound(f"no flag {ref[:64]!r} visible to you", code="unknown_flag")
    exact = conn.execute(f"SELECT f.id FROM flags f WHERE f.id = ? AND {where}",  # noqa: S608
                         (ref, *args)).fetchone()
    if exact is not None:
        return str(exact["id"])
    escaped = ref.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    rows = conn.execute(
        f"SELECT f.id FROM flags f WHERE (f.id LIKE ? ESCAPE '\\' OR f.id LIKE ? ESCAPE '\\') AND {where}"  # noqa: S608
        " ORDER BY f.id LIMIT ?", (escaped + "%", "f-" + escaped + "%", *args, MAX_CANDIDATES + 1)).fetchall()
    ids = [str(r["id"]) for r in rows]
    if not ids:
        raise NotFound(f"no flag {ref} visible to you", code="unknown_flag")
    if len(ids) > 1:
        more = " ..." if len(ids) > MAX_CANDIDATES else ""
        raise Conflict(f"flag prefix {ref} is ambiguous: it matches {', '.join(ids[:MAX_CANDIDATES])}{more};"
                       " give more characters", code="ambiguous_flag")
    return ids[0]


async def flag_for(app: web.Application, who: Principal, flag_id: str) -> dict[str, Any]:
    """One flag visible to `who`, by id or unique prefix (resolve_flag_id)."""

    def read(c: sqlite3.Connection) -> sqlite3.Row:
        row: sqlite3.Row = c.execute("SELECT * FROM flags WHERE id = ?",
                                     (resolve_flag_id(c, who, flag_id),)).fetchone()
        return row

    return _flag_dict(await app[STORE].query(read))



REPUTATION_FIELDS = ("consecutive_agreements", "agreements_total", "flags_total", "confirmed_flags",
                     "dismissed_flags")


def _compute_view(text: str) -> tuple[dict[str, Any], dict[str, str]]:
    """A stored compute class as shown (its fields) and its class key per precision it trains."""
    try:
        cc = nested_from_dict(ComputeClass, json.loads(text))
    except (ValueError, ProtocolError):
        return {}, {}
    return nested_to_dict(cc), {p: class_key(cc, p) for p in cc.precisions}


async def nodes_overview(app: web.Application, who: Principal) -> list[dict[str, Any]]:
    """Every registered node: device, benchmark, throughput EMA, reputation, activity (auditor/admin).
    A node's track record is its `reputation` (the Reputation's fields, the columns' names)."""
    who.require("auditor")
    rows = await app[STORE].query(lambda c: c.execute(
        "SELECT n.*,"
        " (SELECT COUNT(*) FROM assignments a WHERE a.node_id = n.id AND a.state IN ('expired', 'abandoned'))"
        " AS assignments_failed"
        " FROM nodes n ORDER BY n.registered_at").fetchall())
    sched = app[LEDGER].scheduler
    now = time.time()
    out = []
    for r in rows:
        d = {k: r[k] for k in ("id", "software_version", "bench_sps", "ema_sps", "registered_at", "last_seen",
                               "updates_accepted", "assignments_failed")}
        d["device"] = json.loads(r["device"])
        d["benchmark"] = json.loads(r["benchmark"])
        d["compute_class"], d["class_keys"] = _compute_view(r["compute_class"])
        rep = {k: r[k] for k in REPUTATION_FIELDS} | {"banned": bool(r["banned"])}
        live = sched.nodes.get(r["id"])
        if live is not None:  # memory is at least as new as the row
            d.update(ema_sps=live.ema_sps, last_seen=max(d["last_seen"], live.last_seen),
                     updates_accepted=live.updates_accepted, assignments_live=len(live.live))
            rep = {k: getattr(live.reputation, k) for k in (*REPUTATION_FIELDS, "banned")}
        d["reputation"] = rep
        d["banned"] = rep["banned"]
        # Sybil defences: where it last registered from and was last seen, its operator, its probation
        d["address_block"], d["last_block"] = r["address_block"], r["last_block"]
        d["operator"], d["banned_at"] = r["operator"], r["banned_at"]
        if live is not None:
            d["last_block"] = live.last_block or d["last_block"]
            d["probation"] = live.reputation.probation
        d["online"] = now - d["last_seen"] <= app[CONFIG].online_window_s
        out.append(d)
    return out
