"""A job's models: which version a request names, and its .safetensors export."""

from __future__ import annotations

import asyncio
import sqlite3
from dataclasses import replace

from aiohttp import web
from gpuflex.protocol.modelfile import model_file_metadata
from gpuflex.protocol.tensors import decode_state, state_to_safetensors

from ...base.errors import NotFound
from ...storage.tokens import Principal
from ..appkeys import BLOBS, HUB_KEY, STORE
from .access import job_row, spec_of


def model_version(
    conn: sqlite3.Connection, who: Principal, job_id: str, version: int | None
) -> sqlite3.Row:
    """(version, sha) of a job's latest model, or of model `version`."""
    job_row(conn, who, job_id)
    if version is None:
        row = conn.execute(
            "SELECT version, sha FROM models WHERE job_id = ? ORDER BY version DESC LIMIT 1",
            (job_id,),
        ).fetchone()
    else:
        row = conn.execute(
            "SELECT version, sha FROM models WHERE job_id = ? AND version = ?", (job_id, version)
        ).fetchone()
    if row is None:
        raise NotFound(f"job {job_id} has no model for round {version}", code="unknown_round")
    return row  # type: ignore[no-any-return]


async def export_model(
    app: web.Application, who: Principal, job_id: str, version: int | None = None
) -> tuple[int, str, bytes]:
    """(version, model sha, .safetensors bytes) of a job's latest model or of model `version`
    (0 = initial, N = after N rounds), its metadata naming the model spec, the job, the version and
    the hub's key (protocol/modelfile.py model_file_metadata). Same owner scoping as the API."""

    row, spec = await app[STORE].query(
        lambda c: (model_version(c, who, job_id, version), spec_of(job_row(c, who, job_id)))
    )
    blobs = app[BLOBS]
    # a LoRA job's model is downloaded merged: the plain model, each adapted weight W + scale B A
    model = None if spec is None else replace(spec.model, lora=None)
    meta = (
        None
        if model is None
        else model_file_metadata(
            model,
            job_id=job_id,
            round_=int(row["version"]),
            hub_fingerprint=app[HUB_KEY].fingerprint,
        )
    )

    def export() -> bytes:
        from gpuflex.protocol.lora import merged_model  # torch: where a model is exported

        state = decode_state(blobs.read(row["sha"]))
        if spec is not None:
            state = merged_model(spec.model, state)[1]
        return state_to_safetensors(state, meta)

    return int(row["version"]), str(row["sha"]), await asyncio.to_thread(export)


def model_file_name(job_id: str, version: int) -> str:
    """The name a downloaded model is given: ``<job id>-v<version>.safetensors``."""
    return f"{job_id}-v{version}.safetensors"
