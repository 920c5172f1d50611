"""GPUFlex protocol package: the wire contract shared by hub and node.

Sans-I/O: message types with strict encode/decode, Ed25519 signing over exact
bytes, the GFT1 tensor codec, declarative model specs and job specs. The only
disk I/O is key files and reading tensor/spec files on request.
"""

from typing import TYPE_CHECKING

from .errors import (
    DecodeError,
    EncodeError,
    KeyFileError,
    ProtocolError,
    ReplayError,
    SignatureError,
    SpecError,
    TensorError,
    VersionError,
)
from .jobspec import (
    AggregationSpec,
    DataSpec,
    JobSpec,
    TrainSpec,
    VerificationSpec,
    load_job_spec,
    parse_job_spec,
)
from .messages import (
    Abandon,
    Ack,
    Assignment,
    Benchmark,
    BlobRequest,
    ChunkRef,
    DeviceInfo,
    Heartbeat,
    Hello,
    LinkProbe,
    Message,
    NoWork,
    TrainConfig,
    UpdateHeader,
    Welcome,
    WorkRequest,
    decode_message,
    encode_message,
)
from .modelfile import load_safetensors_model
from .modelspec import (
    ModelSpec,
    build_for_state,
    build_model,
    manifest,
    param_count,
)
from .signing import (
    ReplayGuard,
    SigningKey,
    domain,
    fingerprint,
    new_nonce,
    open_sealed,
    seal,
)
from .version import PROTOCOL_VERSION, SOFTWARE_VERSION, check_protocol_version

if TYPE_CHECKING:
    from .tensors import (
        Manifest,
        StateEncoder,
        TensorInfo,
        TensorSpec,
        check_blob,
        check_finite,
        check_manifest,
        decode_state,
        encode_state,
        is_blob_id,
        load_state_file,
        manifest_of,
        read_header,
        sha256_hex,
        state_from_safetensors,
        state_to_safetensors,
    )

# The tensor codec needs torch (1-2 s to import); it loads on first use, so a command
# that only parses specs or signs messages (the CLI, `--version`) starts without it.
_TENSOR_NAMES = frozenset({
    "Manifest",
    "StateEncoder",
    "TensorInfo",
    "TensorSpec",
    "check_blob",
    "check_finite",
    "check_manifest",
    "decode_state",
    "encode_state",
    "is_blob_id",
    "load_state_file",
    "manifest_of",
    "read_header",
    "sha256_hex",
    "state_from_safetensors",
    "state_to_safetensors",
})


def __getattr__(name: str) -> object:
    if name in _TENSOR_NAMES:
        from . import tensors

        return getattr(tensors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "PROTOCOL_VERSION",
    "SOFTWARE_VERSION",
    "Abandon",
    "Ack",
    "AggregationSpec",
    "Assignment",
    "Benchmark",
    "BlobRequest",
    "ChunkRef",
    "DataSpec",
    "DecodeError",
    "DeviceInfo",
    "EncodeError",
    "Heartbeat",
    "Hello",
    "JobSpec",
    "KeyFileError",
    "LinkProbe",
    "Manifest",
    "Message",
    "ModelSpec",
    "NoWork",
    "ProtocolError",
    "ReplayError",
    "ReplayGuard",
    "SignatureError",
    "SigningKey",
    "SpecError",
    "StateEncoder",
    "TensorError",
    "TensorInfo",
    "TensorSpec",
    "TrainConfig",
    "TrainSpec",
    "UpdateHeader",
    "VerificationSpec",
    "VersionError",
    "Welcome",
    "WorkRequest",
    "build_for_state",
    "build_model",
    "check_blob",
    "check_finite",
    "check_manifest",
    "check_protocol_version",
    "decode_message",
    "decode_state",
    "domain",
    "encode_message",
    "encode_state",
    "fingerprint",
    "is_blob_id",
    "load_job_spec",
    "load_safetensors_model",
    "load_state_file",
    "manifest",
    "manifest_of",
    "new_nonce",
    "open_sealed",
    "param_count",
    "parse_job_spec",
    "read_header",
    "seal",
    "sha256_hex",
    "state_from_safetensors",
    "state_to_safetensors",
]
