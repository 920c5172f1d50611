"""The final model of a pipelined job: the job's model with each unit's entries written back from
its state at the last step (``protocol/pipeline.put_state``), optimizer state left out."""

from __future__ import annotations

from gpuflex.protocol.pipeline import pipeline_units, put_state
from gpuflex.protocol.tensors import decode_state, encode_state

from ...model.job import JobState
from ...model.pipeline import UnitRecord
from ...storage.blobs import BlobStore


def assemble_model(
    blobs: BlobStore, job: JobState, states: dict[int, UnitRecord]
) -> tuple[str, int]:
    """(blob id, size) of the assembled model, stored durably. Blocking: a worker thread's."""
    units = pipeline_units(job.spec.model)
    model = {k: v.clone() for k, v in decode_state(blobs.read(job.model_hash)).items()}
    for index, unit in enumerate(units.units):
        unit_state = decode_state(blobs.read(states[index].sha))
        own = {k: v.clone() for k, v in unit_state.items() if not k.startswith("optim.")}
        put_state(unit, own, model)
    data = encode_state(model)
    return blobs.put(data), len(data)


__all__ = ["assemble_model"]
