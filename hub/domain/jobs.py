"""Jobs: submission ingest (validate, chunk, store). The in-memory picture of a job's round
(`JobState` and its parts) is plain state, hub/model/job.py."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.jobspec import JobSpec, parse_job_spec
from gpuflex.protocol.modelspec import ModelSpec, build_model
from gpuflex.protocol.pipeline import pipeline_units
from gpuflex.protocol.pipelinespec import PipelineSpec
from gpuflex.protocol.tensors import (
    MAX_HEADER_BYTES,
    encode_state,
)

from ..base.errors import BadRequest, Unprocessable
from ..model.job import (
    ChunkInfo,
    JobState,
    new_id,
)
from ..policy.aggregation import AggregationError
from ..policy.datadefaults import (
    Decision,
    apply_decisions,
    chunk_size_default,
    record_in_spec,
    validation_default,
)
from ..policy.dataset import (
    Arrays,
    encode_arrays,
    make_chunks,
    read_arrays,
    split_validation,
    validate_arrays,
)
from ..policy.strategy import check_registered
from ..storage.blobs import BlobStore
from .pipelines.planning import check_pipeline_spec

if TYPE_CHECKING:
    from torch import Tensor

    from ..storage.store import Store

def silo_size_bounds(spec: ModelSpec, samples: int) -> tuple[int, int]:
    """The bytes a chunk blob of ``samples`` rows of this model's data takes (encode_state of x
    and y: the raw rows plus the GFT1 header), as the node checks a chunk's declared size."""
    row = spec.sample_bytes
    return samples * row, samples * row + MAX_HEADER_BYTES + 64


# -- submission -------------------------------------------------------------------------------


def _initial_state(spec: JobSpec, base_path: Path | None) -> dict[str, Tensor]:
    """The job's round-0 model: built from the spec and its seed, or the owner's ``base`` (a
    .safetensors file of the spec's plain model), which a LoRA job freezes (protocol/lora.py:
    its targeted weights quantized, its adapters drawn from the seed)."""
    from gpuflex.protocol.lora import lora_state
    from gpuflex.protocol.tensors import state_from_safetensors

    if base_path is None:
        try:
            model = build_model(spec.model, seed=spec.train.seed)
        except ProtocolError as exc:
            raise Unprocessable(str(exc), code="bad_spec") from None
        return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    try:
        base = state_from_safetensors(base_path.read_bytes())
        made = lora_state(spec.model, base, seed=spec.train.seed)
    except ProtocolError as exc:
        raise Unprocessable(f"base: not a .safetensors file of the spec's model: {exc}", code="bad_base") from None
    return {k: v.contiguous() for k, v in made.items()}


def _split_and_size(spec: JobSpec, train_path: Path, val_path: Path | None,
                    nodes_online: int) -> tuple[Arrays, Arrays | None, list[Decision]]:
    """(training set, validation set, what the hub decided for the spec's [data]) of a hub job."""
    dspec, mspec = spec.data, spec.model
    x, y = read_arrays(train_path, label_column=dspec.label_column, what="train")
    train = validate_arrays(x, y, mspec, what="train")
    val: Arrays | None = None
    if val_path is not None:
        vx, vy = read_arrays(val_path, label_column=dspec.label_column, what="val")
        val = validate_arrays(vx, vy, mspec, what="val")
    held = validation_default(dspec, len(train), val_path is not None)
    if val_path is None:
        fraction = float(held.value if held is not None else dspec.validation_fraction or 0.0)
        stratified = dspec.split == "stratified" and mspec.task == "classification"
        train, val = split_validation(train, fraction, stratified=stratified, seed=spec.train.seed)
    sized = chunk_size_default(dspec, len(train), nodes_online)
    return train, val, [d for d in (held, sized) if d is not None]


def _check_pipeline(spec: JobSpec) -> None:
    """A ``[pipeline]`` job's model must cut into at least 2 units, into at most its fixed
    ``stages``, and its fixed ``micro_batches`` must divide ``[train] batch_size``."""
    if spec.pipeline is None:
        return
    try:
        units = len(pipeline_units(spec.model))
    except ProtocolError as exc:
        raise Unprocessable(f"pipeline: the model cannot be cut into units: {exc}", code="bad_spec") from None
    why = check_pipeline_spec(spec.pipeline, units, spec.train.batch_size)
    if why is not None:
        raise Unprocessable(f"pipeline: {why}", code="bad_spec")
    if spec.pipeline.boundary != "fp32":
        _check_boundary(spec, spec.pipeline)


def _check_boundary(spec: JobSpec, pipeline: PipelineSpec) -> None:
    """Every cut's tensor can travel in the job's ``[pipeline] boundary`` (a subspace rank below
    its width, a floating tensor): the units run on the meta device, nothing is computed."""
    import torch
    from gpuflex.protocol.boundary import encoded_crossing
    from gpuflex.protocol.tensors import DTYPE_NAMES

    units = pipeline_units(spec.model).units
    x = torch.zeros((1, *spec.model.input_shape), dtype=spec.model.input_dtype, device="meta")
    with torch.no_grad():
        for i, unit in enumerate(units[:-1]):
            x = unit.module(x)
            try:
                encoded_crossing(tuple(x.shape), DTYPE_NAMES.get(x.dtype, str(x.dtype)),
                                 pipeline.boundary, pipeline.boundary_rank)
            except ProtocolError as exc:
                raise Unprocessable(f"pipeline: the cut after unit {i} ({unit.name}): {exc}",
                                    code="bad_spec") from None


def ingest_job(
    store: Store,
    blobs: BlobStore,
    *,
    owner: str,
    spec_text: bytes,
    train_path: Path | None,
    val_path: Path | None,
    nodes_online: int = 0,
    base_path: Path | None = None,
) -> JobState:
    """Validate a submission and store it (blobs, then rows). Runs in a worker thread. A
    node-local job ([data] source = "node-local") comes with no training set: its chunks are the
    silos nodes attach later; an optional validation set is the owner's own. What the spec leaves
    to the hub (the hold-out, the chunk size: hub/policy/datadefaults.py) is decided here, from the
    training set and ``nodes_online``, and written into the stored spec."""
    try:
        spec = parse_job_spec(spec_text)
        check_registered(spec)  # a strategy the spec names is one this hub's code has
    except (ProtocolError, AggregationError) as exc:
        raise Unprocessable(str(exc), code="bad_spec") from None
    _check_pipeline(spec)
    mspec = spec.model
    dspec = spec.data
    stratified = dspec.split == "stratified" and mspec.task == "classification"
    val: Arrays | None = None
    chunks: list[ChunkInfo] = []
    train_samples = 0
    if dspec.node_local:
        if train_path is not None:
            raise Unprocessable("a node-local job takes no training set: its data stays on the nodes "
                                "(gpuflex-node data add); give only the spec and an optional val", code="bad_form")
        if val_path is not None:
            vx, vy = read_arrays(val_path, label_column=dspec.label_column, what="val")
            val = validate_arrays(vx, vy, mspec, what="val")
    else:
        if train_path is None:  # a missing form part: 400, as the route answers for a missing spec
            raise BadRequest("a job needs a training set (part 'train': .npz or .csv), or "
                             "[data] source = \"node-local\"", code="bad_form")
        train, val, decided = _split_and_size(spec, train_path, val_path, nodes_online)
        spec_text = record_in_spec(spec_text.decode("utf-8"), spec, decided).encode("utf-8")
        spec = apply_decisions(spec, decided)
        pieces = make_chunks(train, int(spec.data.chunk_size or 0), stratified=stratified, seed=spec.train.seed)
        shas = blobs.put_many([data for data, _ in pieces])  # the small ones: one commit for them all
        for idx, ((data, samples), sha) in enumerate(zip(pieces, shas, strict=True)):
            chunks.append(ChunkInfo(idx, sha, samples, len(data)))
        train_samples = len(train)
    val_sha = blobs.put(encode_arrays(val)) if val is not None else None
    state = _initial_state(spec, base_path)
    model_blob = encode_state(state)
    model_hash = blobs.put(model_blob)
    now = time.time()
    job = JobState(
        id=new_id("j"),
        owner=owner,
        name=spec.name,
        spec=spec,
        state="running",
        round=0,
        rounds=spec.train.rounds,
        model_hash=model_hash,
        model_size=len(model_blob),
        chunks=chunks,
        val_sha=val_sha,
        opt_state_sha=None,
        created_at=now,
    )
    job.note_model(0, model_hash)
    job.open_round()
    store.insert_job_sync(job, spec_text.decode("utf-8"), train_samples, len(val) if val is not None else 0)
    return job
