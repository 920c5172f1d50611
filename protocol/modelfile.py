"""The model file an owner downloads (`gpuflex-hub job download`): a .safetensors file whose
metadata names the model spec, the job, the round and the hub's key, so that the torch module
can be rebuilt from the file alone (whitelisted layers, no code from the file, no pickle)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Final

from .errors import SpecError
from .modelspec import ModelSpec, build_for_state

if TYPE_CHECKING:  # torch and the tensor codec load where a file is read, not on import (CLI start-up)
    from torch import nn

#: what a model file's metadata says it is
MODEL_FILE_FORMAT: Final = "gpuflex-model/1"


def model_file_metadata(spec: ModelSpec, *, job_id: str, round_: int, hub_fingerprint: str) -> dict[str, str]:
    """The .safetensors metadata of a job's model (text to text): the model spec as JSON
    (``to_dict``), the job, the rounds the model has been trained for and the hub's key."""
    return {"format": MODEL_FILE_FORMAT, "model_spec": json.dumps(spec.to_dict(), separators=(",", ":")),
            "job_id": job_id, "round": str(round_), "hub_fingerprint": hub_fingerprint}


def load_safetensors_model(path: str | os.PathLike[str]) -> nn.Module:
    """The torch module of a model file from ``gpuflex-hub job download``, from the file alone:
    built from the spec in its metadata (whitelisted layers, no code from the file), holding its
    tensors (names and shapes must match the spec exactly), in eval mode on the CPU.

    SpecError when the file has no GPUFlex model spec in its metadata; DecodeError or
    TensorError when it is not a readable .safetensors file."""
    from .tensors import safetensors_metadata, state_from_safetensors

    data = Path(path).read_bytes()
    meta = safetensors_metadata(data)
    if meta.get("format") != MODEL_FILE_FORMAT or "model_spec" not in meta:
        raise SpecError(f"{path}: no GPUFlex model spec in the file's metadata (format {MODEL_FILE_FORMAT!r})")
    try:
        raw = json.loads(meta["model_spec"])
    except ValueError:
        raise SpecError(f"{path}: the model_spec metadata is not JSON") from None
    spec = ModelSpec.from_dict(raw, where="model_spec")
    try:
        module = build_for_state(spec, state_from_safetensors(data))
    except (ValueError, RuntimeError) as exc:
        raise SpecError(f"{path}: the tensors do not fit the spec ({str(exc).splitlines()[0][:160]})") from None
    return module.eval()


__all__ = ["MODEL_FILE_FORMAT", "load_safetensors_model", "model_file_metadata"]
