"""Control messages: typed frozen dataclasses and their strict msgpack form.

A message travels as a msgpack map ``{"v": PROTOCOL_VERSION, "kind": KIND,
<fields>}``. Decoding is strict (protocol/fields.py holds the rules and the codec): the map
must carry exactly the declared fields, every value has the declared type and lies inside its
bounds, floats are finite, ``bool`` is never accepted as an ``int``, and nothing may follow the
map. Every rule lives next to its field as ``Annotated[type, Rule]`` so the encoder and the
decoder apply the same checks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Final

import msgpack

from .boundary import BOUNDARIES
from .encoding import ENCODINGS, UpdateEncoding
from .errors import DecodeError, EncodeError, VersionError
from .fields import (
    BLOB_ID_RE,
    ID_RE,
    ISA_FLAG_RE,
    MAX_CHECKPOINTS,
    MAX_LIST,
    MAX_MESSAGE_BYTES,
    PRECISIONS,
    Blob,
    BlobIdStr,
    Bool,
    Count,
    Float,
    FloatMap,
    IdStr,
    Int,
    M,
    ModelSpecDict,
    Nested,
    Nonce,
    NonNegFloat,
    OptFloat,
    Seq,
    ShortText,
    Text,
    Timestamp,
    _Fail,
    _from_wire,
    _to_wire,
    nested_from_dict,
    nested_to_dict,
    unpack_strict,
)
from .relaymessages import RELAY_KINDS, RelayHeader, RelayTake
from .secaggmessages import (
    SECAGG_PHASES,
    RosterMember,
    Sealed,
    SecAggKeys,
    SecAggMasked,
    SecAggPoll,
    SecAggShares,
    SecAggState,
    SecAggUnmask,
    UnmaskShare,
)
from .version import PROTOCOL_VERSION

# ---------------------------------------------------------------------------
# Messages.


@dataclass(frozen=True)
class DeviceInfo:
    kind: Annotated[str, Text(choices=("cpu", "cuda", "mps"))]
    name: ShortText
    memory_bytes: Count
    threads: Annotated[int, Int(0, 1 << 20)]


@dataclass(frozen=True)
class ComputeClass:
    """What decides a node's numerics: two nodes whose replicas of one shard should come out
    (almost) bit-identical report equal classes (``protocol.compute.class_key`` says which
    fields count). Strings are "" where a part does not apply (no CUDA on a CPU node).

    ``device_model``: the CUDA device name, the Apple chip, or the CPU model; ``capability``:
    the CUDA compute capability ("8.6"); ``cpu_vendor`` and ``isa``: the CPU's vendor and the
    instruction-set flags that change which kernels run (avx2, avx512f, avx512_bf16, amx_bf16, ...);
    ``onednn``: torch's oneDNN (mkldnn) backend is on; ``threads``: the intra-op thread count;
    ``precisions``: what this node can train in.
    """

    device_kind: Annotated[str, Text(choices=("cpu", "cuda", "mps", "unknown"))]
    device_model: ShortText
    capability: Annotated[str, Text(16)]
    cpu_vendor: Annotated[str, Text(64)]
    isa: Annotated[tuple[str, ...], Seq(Text(32, pattern=ISA_FLAG_RE), 64)]
    torch_version: Annotated[str, Text(64)]
    cuda_version: Annotated[str, Text(64)]
    cudnn_version: Annotated[str, Text(64)]
    onednn: Annotated[bool, Bool()]
    threads: Annotated[int, Int(0, 1 << 20)]
    precisions: Annotated[tuple[str, ...], Seq(Text(choices=PRECISIONS), len(PRECISIONS))]


#: a hello that does not describe its class (test clients): fp32 only, never the same class as a real node
#: the most memory a node may offer a pipeline stage (1 PiB)
MAX_MEMORY_BYTES: Final = 1 << 50

UNKNOWN_CLASS: Final = ComputeClass("unknown", "", "", "", (), "", "", "", False, 0, ("fp32",))


@dataclass(frozen=True)
class Benchmark:
    samples_per_s: NonNegFloat
    matmul_tflops_fp32: NonNegFloat
    matmul_tflops_bf16: OptFloat
    matmul_tflops_fp16: OptFloat
    mem_bandwidth_gbs: NonNegFloat
    h2d_gbs: OptFloat
    d2h_gbs: OptFloat
    reference_model: ShortText
    #: training samples/s of the reference model per precision the device supports (fp32, bf16, ...)
    precision_sps: Annotated[dict[str, float], FloatMap(len(PRECISIONS))] = dataclasses.field(
        default_factory=dict)


@dataclass(frozen=True)
class ChunkRef:
    sha256: BlobIdStr
    size: Count
    samples: Count


@dataclass(frozen=True)
class TrainConfig:
    local_epochs: Annotated[int, Int(1, 100_000)]
    batch_size: Annotated[int, Int(1, 1 << 24)]
    optimizer: Annotated[str, Text(choices=("sgd", "adam", "adamw"))]
    lr: Annotated[float, Float(0.0, 1e6)]
    momentum: Annotated[float, Float(0.0, 1.0)]
    weight_decay: Annotated[float, Float(0.0, 1e6)]
    beta1: Annotated[float, Float(0.0, 1.0)]
    beta2: Annotated[float, Float(0.0, 1.0)]
    loss: Annotated[str, Text(choices=("cross_entropy", "mse"))]
    grad_clip: Annotated[float, Float(0.0, 1e12)]
    #: what the node trains in: the job's precision, "auto" resolved by the hub for this node
    precision: Annotated[str, Text(choices=PRECISIONS)] = "fp32"
    #: steps between committed checkpoints (protocol/checkpoint.py); 0 = about 8 segments
    checkpoint_every: Annotated[int, Int(0, 1 << 30)] = 0
    #: commit to checkpoints at all; False when the job can never ask the referee (no replica,
    #: no spot-check: VerificationSpec.asks_referee), so the node skips the commitment's cost
    commit: Annotated[bool, Bool()] = True
    #: optimizer steps per assignment instead of ``local_epochs`` passes (0: the epochs);
    #: protocol/workload.py
    local_steps: Annotated[int, Int(0, 1 << 30)] = 0
    #: how the update travels (protocol/encoding.py): the job's [communication]
    update: Annotated[str, Text(choices=ENCODINGS)] = "fp32"
    topk_fraction: Annotated[float, Float(1e-9, 1.0)] = 0.01
    error_feedback: Annotated[bool, Bool()] = False
    #: secure aggregation (protocol/secagg.py): the node sends its update masked, never in the
    #: clear: weighted by samples / ``secagg_max_samples``, each coordinate clipped to
    #: +-``secagg_clip`` and quantized to ``secagg_bits`` bits
    secagg: Annotated[bool, Bool()] = False
    secagg_clip: Annotated[float, Float(0.0, 1e6)] = 2.0
    secagg_bits: Annotated[int, Int(1, 31)] = 22
    secagg_max_samples: Annotated[int, Int(1, 1 << 40)] = 1

    @property
    def encoding(self) -> UpdateEncoding:
        return UpdateEncoding(self.update, self.topk_fraction, self.error_feedback)


@dataclass(frozen=True)
class Hello:
    KIND: ClassVar[str] = "hello"
    software_version: Annotated[str, Text(64)]
    protocol_version: Annotated[int, Int(0, 1 << 31)]
    device: Annotated[DeviceInfo, Nested(DeviceInfo)]
    benchmark: Annotated[Benchmark, Nested(Benchmark)]
    timestamp: Timestamp
    nonce: Nonce
    compute: Annotated[ComputeClass, Nested(ComputeClass)] = UNKNOWN_CLASS
    #: the operator's enrollment token ("" = none); the hub may require one
    enroll_token: Annotated[str, Text(128)] = ""
    #: the memory the node offers a pipeline stage, in bytes (``gpuflex-node run --max-memory``,
    #: by default what its device has free); 0 = not said
    max_memory_bytes: Annotated[int, Int(0, MAX_MEMORY_BYTES)] = 0
    #: "host:port" where this node accepts other stages' tensors directly (``gpuflex-node run
    #: --stage-listen``); "" = behind NAT: its stages talk through the hub's relay only
    stage_address: Annotated[str, Text(128)] = ""


@dataclass(frozen=True)
class Welcome:
    KIND: ClassVar[str] = "welcome"
    node_id: IdStr
    hub_fingerprint: IdStr
    server_time: Timestamp
    poll_s: Annotated[float, Float(0.0, 86_400.0)]


@dataclass(frozen=True)
class WorkRequest:
    KIND: ClassVar[str] = "work_request"
    timestamp: Timestamp
    nonce: Nonce
    wait_s: Annotated[float, Float(0.0, 60.0)]
    cached_chunks: Annotated[tuple[str, ...], Seq(Text(64, pattern=BLOB_ID_RE), MAX_LIST)]


@dataclass(frozen=True)
class Assignment:
    KIND: ClassVar[str] = "assignment"
    assignment_id: IdStr
    job_id: IdStr
    round: Annotated[int, Int(0, 1 << 31)]
    node_id: IdStr
    model_hash: BlobIdStr
    model_size: Count
    model_spec: Annotated[dict[str, Any], ModelSpecDict()]
    chunks: Annotated[tuple[ChunkRef, ...], Seq(Nested(ChunkRef), MAX_LIST)]
    seed: Count
    train: Annotated[TrainConfig, Nested(TrainConfig)]
    issued_at: Timestamp
    deadline: Timestamp
    #: always "" from this hub: whether a shard is replicated or spot-checked is never told to the
    #: node that trains it (one that knew could cheat only where nobody looks). Kept on the wire so
    #: that nodes of earlier versions still read the message.
    replica_group: Annotated[str, Text(64, pattern=ID_RE, allow_empty_pattern=True)]


@dataclass(frozen=True)
class NoWork:
    KIND: ClassVar[str] = "no_work"
    retry_after_s: Annotated[float, Float(0.0, 86_400.0)]
    reason: ShortText


@dataclass(frozen=True)
class Heartbeat:
    KIND: ClassVar[str] = "heartbeat"
    assignment_id: IdStr
    progress: Annotated[float, Float(0.0, 1.0)]
    timestamp: Timestamp
    nonce: Nonce
    #: optimizer steps done so far, and the running digest over them (``progress_digest``;
    #: 32 zero bytes = no step yet): the hub extends a deadline only on new progress
    steps: Annotated[int, Int(0, 1 << 40)] = 0
    digest: Annotated[bytes, Blob(32)] = bytes(32)


def progress_digest(previous: bytes, step: int, loss: float) -> bytes:
    """The next link of a heartbeat's progress chain: SHA-256(previous || step || loss), with
    ``step`` as 8 bytes little-endian and ``loss`` as an IEEE-754 double (32 zero bytes start it)."""
    return hashlib.sha256(bytes(previous) + struct.pack("<Qd", int(step), float(loss))).digest()


@dataclass(frozen=True)
class Abandon:
    KIND: ClassVar[str] = "abandon"
    assignment_id: IdStr
    reason: ShortText
    timestamp: Timestamp
    nonce: Nonce


@dataclass(frozen=True)
class BlobRequest:
    KIND: ClassVar[str] = "blob_request"
    sha256: BlobIdStr
    timestamp: Timestamp
    nonce: Nonce


@dataclass(frozen=True)
class Commitment:
    """A node's commitment to its training trajectory (protocol/checkpoint.py): the hash of the
    full training state at steps 0, every, 2*every, ..., steps (the last), each segment's
    update norm (len(hashes) - 1 of them), and the precision it trained in."""

    every: Annotated[int, Int(1, 1 << 40)]
    steps: Annotated[int, Int(0, 1 << 40)]
    precision: Annotated[str, Text(8, choices=("fp32", "tf32", "bf16", "fp16"))]
    hashes: Annotated[tuple[str, ...], Seq(Text(64, pattern=BLOB_ID_RE), MAX_CHECKPOINTS)]
    norms: Annotated[tuple[float, ...], Seq(Float(0.0, 1e300), MAX_CHECKPOINTS)]


@dataclass(frozen=True)
class UpdateHeader:
    KIND: ClassVar[str] = "update"
    assignment_id: IdStr
    update_sha256: BlobIdStr
    update_size: Count
    sample_count: Count
    metrics: Annotated[dict[str, float], FloatMap(32, required=("loss",))]
    timings: Annotated[dict[str, float], FloatMap(32, required=("train_s",))]
    timestamp: Timestamp
    nonce: Nonce
    #: the checkpoint commitment (None: the node committed to nothing; a referee that asks
    #: for a state of it finds none, and flags it unverifiable)
    commitment: Annotated[Commitment | None, Nested(Commitment, optional=True)] = None
    #: the body carries the update's bytes from here to ``update_size``: a resumed upload, whose
    #: first ``offset`` bytes the hub already holds (it says how many: UploadOffset). The hash
    #: and the size are always the whole update's
    offset: Count = 0


@dataclass(frozen=True)
class StateRequest:
    """Hub -> node, as the answer to a work request: hand over the committed training states of
    ``assignment_id`` at ``steps`` (POST /v1/states, one StateUpload each) before ``deadline``,
    or say at once which it no longer holds (StateUnavailable: the update is left out unverified,
    the node not flagged). A node that answers neither way is flagged unverifiable and its update
    left out. ``steps``: up to every
    checkpoint of the commitment (the referee tests every committed segment norm)."""

    KIND: ClassVar[str] = "state_request"
    request_id: IdStr
    job_id: IdStr
    round: Annotated[int, Int(0, 1 << 31)]
    assignment_id: IdStr
    steps: Annotated[tuple[int, ...], Seq(Int(0, 1 << 40), MAX_CHECKPOINTS)]
    deadline: Timestamp


@dataclass(frozen=True)
class StateUpload:
    """Node -> hub header of one checkpoint state (the GFT1 bytes follow as the body)."""

    KIND: ClassVar[str] = "state_upload"
    request_id: IdStr
    step: Annotated[int, Int(0, 1 << 40)]
    state_sha256: BlobIdStr
    state_size: Count
    timestamp: Timestamp
    nonce: Nonce


@dataclass(frozen=True)
class StateUnavailable:
    """Node -> hub, POST /v1/states/unavailable: the node no longer holds the committed states of
    ``request_id`` at ``steps`` (pruned under its byte bound, or its disk was wiped), said at once
    so that the referee decides without waiting for the request's deadline. The update is then
    left out of the round unverified; the node is not flagged."""

    KIND: ClassVar[str] = "state_unavailable"
    request_id: IdStr
    steps: Annotated[tuple[int, ...], Seq(Int(0, 1 << 40), MAX_CHECKPOINTS)]
    reason: ShortText
    timestamp: Timestamp
    nonce: Nonce


@dataclass(frozen=True)
class Ack:
    KIND: ClassVar[str] = "ack"
    ok: Annotated[bool, Bool()]
    detail: ShortText
    deadline: Timestamp


@dataclass(frozen=True)
class UploadOffset:
    """Hub -> node, the answer to POST /v1/updates/offset: how many leading bytes of the update
    (``update_sha256`` of ``assignment_id``) an interrupted upload left with the hub; the node
    sends the rest with ``UpdateHeader.offset`` set to it."""

    KIND: ClassVar[str] = "upload_offset"
    assignment_id: IdStr
    update_sha256: BlobIdStr
    offset: Count


@dataclass(frozen=True)
class SiloQuery:
    """Node -> hub, POST /v1/silos/schema: what a node-local job's silos must hold."""

    KIND: ClassVar[str] = "silo_query"
    job_id: IdStr
    timestamp: Timestamp
    nonce: Nonce


@dataclass(frozen=True)
class SiloSchema:
    """Hub -> node: a node-local job's schema. The rows must fit ``model_spec``'s input (shape;
    float32, or int64 token ids for an Embedding-first model) and its outputs (labels
    0..outputs-1, or regression targets), and number ``min_samples``..``max_samples``.
    ``label_histogram``: the job asks for the silo's label counts (the operator may decline);
    ``attached``: the blob id of the silo this node has attached to the job ("" = none)."""

    KIND: ClassVar[str] = "silo_schema"
    job_id: IdStr
    model_spec: Annotated[dict[str, Any], ModelSpecDict()]
    min_samples: Count
    max_samples: Count
    label_column: Annotated[str, Text(64)]
    label_histogram: Annotated[bool, Bool()]
    attached: Annotated[str, Text(64, pattern=BLOB_ID_RE, allow_empty_pattern=True)]


@dataclass(frozen=True)
class SiloRegistration:
    """Node -> hub, POST /v1/silos: a silo attached to a node-local job. All that leaves the
    node about its data: the blob id (SHA-256) and size of the encoded silo, its sample count
    and, only when the operator opted in and the job asks, its label histogram (counts per
    label; empty = not shared). Answered with an Ack."""

    KIND: ClassVar[str] = "silo"
    job_id: IdStr
    sha256: BlobIdStr
    size: Count
    samples: Count
    timestamp: Timestamp
    nonce: Nonce
    label_histogram: Annotated[tuple[int, ...], Seq(Int(), MAX_LIST)] = ()


@dataclass(frozen=True)
class SiloWithdrawal:
    """Node -> hub, POST /v1/silos/withdraw: the operator removed this node's silo of a node-local
    job (``gpuflex-node data remove``); the hub stops assigning it and no round waits for it. Names
    the blob id, so a late withdrawal never drops a silo attached since. Answered with an Ack."""

    KIND: ClassVar[str] = "silo_withdrawal"
    job_id: IdStr
    sha256: BlobIdStr
    timestamp: Timestamp
    nonce: Nonce


# -- pipelined jobs (hub/domain/pipelines; node/pipeline/worker) -------------------------------------
PIPELINE_SCHEDULES: Final = ("gpipe", "1f1b")


@dataclass(frozen=True)
class UnitState:
    """One pipeline unit's durable state at a step: a GFT1 blob (content-addressed) holding the
    unit's parameters and buffers under their unit names and its optimizer state under
    ``"optim.<slot>.<name>"`` (the node's stage worker writes it)."""

    unit: Annotated[int, Int(0, 1 << 16)]
    sha256: BlobIdStr
    size: Count


@dataclass(frozen=True)
class StageAssignment:
    """Hub -> node, an answer to POST /v1/work: run stage ``stage`` (units ``unit_start`` up to
    ``unit_end``) of ``job_id``'s pipeline, generation ``generation``, for steps ``first_step``
    up to ``end_step``; sealed by the hub like an Assignment.

    ``stage_nodes``/``stage_keys``/``stage_starts``: each stage's node id, its public key (the
    relay's sender check) and its first unit. ``unit_states``: the state of each of this stage's
    units at ``first_step`` (empty at step 0: the units come from the job's model, ``model_hash``).
    ``chunks``: the job's data, on the first and the last stage (empty in between). The step's
    samples and micro-batches come from protocol/pipeline.py's ``step_samples`` and
    ``micro_batch_slices``. Every ``checkpoint_every`` steps, and at ``end_step``, the stage
    uploads each unit's state (UnitCheckpoint)."""

    KIND: ClassVar[str] = "stage_assignment"
    job_id: IdStr
    generation: Annotated[int, Int(1, 1 << 31)]
    node_id: IdStr
    stage: Annotated[int, Int(0, 1 << 10)]
    unit_start: Annotated[int, Int(0, 1 << 16)]
    unit_end: Annotated[int, Int(1, 1 << 16)]
    stage_nodes: Annotated[tuple[str, ...], Seq(Text(64, pattern=ID_RE), 1024)]
    stage_keys: Annotated[tuple[bytes, ...], Seq(Blob(32), 1024)]
    stage_starts: Annotated[tuple[int, ...], Seq(Int(0, 1 << 16), 1024)]
    model_spec: Annotated[dict[str, Any], ModelSpecDict()]
    model_hash: BlobIdStr
    model_size: Count
    unit_states: Annotated[tuple[UnitState, ...], Seq(Nested(UnitState), MAX_LIST)]
    chunks: Annotated[tuple[ChunkRef, ...], Seq(Nested(ChunkRef), MAX_LIST)]
    train: Annotated[TrainConfig, Nested(TrainConfig)]
    seed: Count
    batch_size: Annotated[int, Int(1, 1 << 24)]
    micro_batches: Annotated[int, Int(1, 1 << 16)]
    schedule: Annotated[str, Text(8, choices=PIPELINE_SCHEDULES)]
    first_step: Annotated[int, Int(0, 1 << 40)]
    end_step: Annotated[int, Int(1, 1 << 40)]
    checkpoint_every: Annotated[int, Int(1, 1 << 30)]
    issued_at: Timestamp
    #: each stage's direct address (its Hello.stage_address; "" = through the relay only)
    stage_addresses: Annotated[tuple[str, ...], Seq(Text(128), 1024)] = ()
    #: how tensors cross each cut (the job's [pipeline] boundary, protocol/boundary.py)
    boundary: Annotated[str, Text(16, choices=BOUNDARIES)] = "fp32"
    boundary_rank: Annotated[int, Int(0, 1 << 16)] = 0
    #: pipelines sharing each step (hybrid parallelism): ``stage_nodes``, ``stage_keys``,
    #: ``stage_starts`` and ``stage_addresses`` list every pipeline's stages, pipeline after
    #: pipeline (each cut the same), ``stage`` indexes that list, and pipeline ``p`` trains its
    #: share of the step's micro-batches, after the pipelines before it (protocol/pipeline.py's
    #: ``lane_slices``)
    lanes: Annotated[int, Int(1, 256)] = 1
    #: each pipeline's micro-batch count when they differ (faster pipelines run more of the
    #: step's micro-batches; ``micro_batches`` is this stage's pipeline's); empty: each runs
    #: ``micro_batches``
    lane_micro_batches: Annotated[tuple[int, ...], Seq(Int(1, 1 << 16), 256)] = ()


@dataclass(frozen=True)
class UnitCheckpoint:
    """Node -> hub, POST /v1/pipeline/checkpoint (header X-GPUFlex-Auth; the body is the unit's
    GFT1 state of ``size`` bytes and SHA-256 ``sha256``): unit ``unit``'s state once ``step``
    steps are applied (steps 0 to ``step`` - 1; a resumed stage starts with step ``step``). The
    hub answers a sealed Ack once the blob and its record are durable."""

    KIND: ClassVar[str] = "unit_checkpoint"
    job_id: IdStr
    generation: Annotated[int, Int(1, 1 << 31)]
    stage: Annotated[int, Int(0, 1 << 10)]
    unit: Annotated[int, Int(0, 1 << 16)]
    step: Annotated[int, Int(1, 1 << 40)]
    sha256: BlobIdStr
    size: Count
    timestamp: Timestamp
    nonce: Nonce


#: the size of the link probe a node sends after registering, and the most a probe may be
LINK_PROBE_BYTES: Final = 256 << 10
MAX_LINK_PROBE_BYTES: Final = 1 << 20


@dataclass(frozen=True)
class LinkProbe:
    """Node -> hub, POST /v1/nodes/probe (header X-GPUFlex-Auth; the body: ``size`` bytes of
    SHA-256 ``sha256``): sent after registering so that the hub times the node's uplink before it
    plans a pipeline stage on it. Answered with a sealed Ack."""

    KIND: ClassVar[str] = "link_probe"
    sha256: BlobIdStr
    size: Annotated[int, Int(1, MAX_LINK_PROBE_BYTES)]
    timestamp: Timestamp
    nonce: Nonce


@dataclass(frozen=True)
class StageReport:
    """Node -> hub, POST /v1/pipeline/report: stage ``stage`` finished ``steps_done`` steps (the
    number applied, counted from step 0), its last step took ``step_s`` (wall clock, waits
    included) and ``compute_s`` of it computing; ``loss`` is that step's mean loss on the last
    stage (None elsewhere). ``failed`` (non-empty): the stage stopped, and why (a peer's tensor
    did not come, a bad tensor); the hub re-plans. ``update_s``: the part of ``compute_s`` the
    step's end took (summing shared gradients, the optimizer step), which does not grow with the
    micro-batches (0: not measured); ``unit_overhead_s``: the fixed time one unit's forward and
    backward take per micro-batch whatever its size, as the stage measured it (0: not measured).
    The answer is a sealed Ack: ok=False means this generation is over: stop and ask for work."""

    KIND: ClassVar[str] = "stage_report"
    job_id: IdStr
    generation: Annotated[int, Int(1, 1 << 31)]
    stage: Annotated[int, Int(0, 1 << 10)]
    steps_done: Annotated[int, Int(0, 1 << 40)]
    step_s: Annotated[float, Float(0.0, 1e6)]
    compute_s: Annotated[float, Float(0.0, 1e6)]
    loss: OptFloat
    failed: ShortText
    timestamp: Timestamp
    nonce: Nonce
    update_s: Annotated[float, Float(0.0, 1e6)] = 0.0
    unit_overhead_s: Annotated[float, Float(0.0, 1e3)] = 0.0


Message = (Hello | Welcome | WorkRequest | Assignment | NoWork | Heartbeat | Abandon | BlobRequest | UpdateHeader | Ack
           | StateRequest | StateUpload | StateUnavailable | UploadOffset | SiloQuery | SiloSchema | SiloRegistration
           | SiloWithdrawal
           | SecAggKeys | SecAggPoll | SecAggState | SecAggShares | SecAggMasked | SecAggUnmask
           | RelayHeader | RelayTake | StageAssignment | UnitCheckpoint | StageReport | LinkProbe)
MESSAGE_TYPES: Final[tuple[type[Any], ...]] = (
    Hello,
    Welcome,
    WorkRequest,
    Assignment,
    NoWork,
    Heartbeat,
    Abandon,
    BlobRequest,
    UpdateHeader,
    Ack,
    StateRequest,
    StateUpload,
    StateUnavailable,
    UploadOffset,
    SiloQuery,
    SiloSchema,
    SiloRegistration,
    SiloWithdrawal,
    SecAggKeys,
    SecAggPoll,
    SecAggState,
    SecAggShares,
    SecAggMasked,
    SecAggUnmask,
    RelayHeader,
    RelayTake,
    StageAssignment,
    UnitCheckpoint,
    StageReport,
    LinkProbe,
)
MESSAGE_KINDS: Final[dict[str, type[Any]]] = {cls.KIND: cls for cls in MESSAGE_TYPES}

def encode_message(msg: object) -> bytes:
    """Validate ``msg`` against its schema and return its msgpack bytes."""
    cls = type(msg)
    kind = getattr(cls, "KIND", None)
    if not isinstance(kind, str) or MESSAGE_KINDS.get(kind) is not cls:
        raise EncodeError(f"{cls.__name__} is not a protocol message type")
    try:
        body = _to_wire(msg)
    except _Fail as exc:
        raise EncodeError(f"{kind}.{exc}") from None
    wire: dict[str, object] = {"v": PROTOCOL_VERSION, "kind": kind}
    wire.update(body)
    try:
        packed: bytes = msgpack.packb(wire, use_bin_type=True)
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. a lone surrogate in a str
        raise EncodeError(f"{kind}: cannot encode ({type(exc).__name__}: {str(exc)[:80]})") from None
    return packed


def peek_kind(data: bytes | bytearray | memoryview) -> str:
    """Return the ``kind`` of an encoded message after the version check (no field checks)."""
    obj = unpack_strict(data)
    return _header(obj)[1]


def _header(obj: object) -> tuple[dict[object, object], str]:
    if not isinstance(obj, dict):
        raise DecodeError(f"message: expected a msgpack map, got {type(obj).__name__}")
    version = obj.get("v")
    if isinstance(version, bool) or not isinstance(version, int):
        raise DecodeError("message: missing or non-integer protocol version field 'v'")
    if version != PROTOCOL_VERSION:
        raise VersionError(
            f"peer speaks protocol version {version}, this software speaks {PROTOCOL_VERSION}; "
            "upgrade the older side"
        )
    kind = obj.get("kind")
    if not isinstance(kind, str):
        raise DecodeError("message: missing or non-string field 'kind'")
    if kind not in MESSAGE_KINDS:
        raise DecodeError(f"message: unknown kind {kind[:40]!r}")
    return obj, kind


def decode_message(data: bytes | bytearray | memoryview, expected: type[M]) -> M:
    """Strictly decode ``data`` as a message of type ``expected``.

    Raises VersionError for another protocol version and DecodeError for
    everything else that is wrong, naming the field.
    """
    expected_kind = getattr(expected, "KIND", None)
    if not isinstance(expected_kind, str) or MESSAGE_KINDS.get(expected_kind) is not expected:
        raise DecodeError(f"{getattr(expected, '__name__', expected)!r} is not a message type")
    obj, kind = _header(unpack_strict(data))
    if kind != expected_kind:
        raise DecodeError(f"message: expected kind {expected_kind!r}, got {kind!r}")
    try:
        return _from_wire(expected, obj)
    except _Fail as exc:
        raise DecodeError(f"{kind}.{exc}") from None


__all__ = [
    "BLOB_ID_RE",
    "ID_RE",
    "LINK_PROBE_BYTES",
    "MAX_CHECKPOINTS",
    "MAX_LINK_PROBE_BYTES",
    "MAX_LIST",
    "MAX_MESSAGE_BYTES",
    "MESSAGE_KINDS",
    "MESSAGE_TYPES",
    "PIPELINE_SCHEDULES",
    "PRECISIONS",
    "RELAY_KINDS",
    "SECAGG_PHASES",
    "UNKNOWN_CLASS",
    "Abandon",
    "Ack",
    "Assignment",
    "Benchmark",
    "BlobRequest",
    "ChunkRef",
    "Commitment",
    "ComputeClass",
    "DeviceInfo",
    "Heartbeat",
    "Hello",
    "LinkProbe",
    "Message",
    "NoWork",
    "RelayHeader",
    "RelayTake",
    "RosterMember",
    "Sealed",
    "SecAggKeys",
    "SecAggMasked",
    "SecAggPoll",
    "SecAggShares",
    "SecAggState",
    "SecAggUnmask",
    "SiloQuery",
    "SiloRegistration",
    "SiloSchema",
    "SiloWithdrawal",
    "StageAssignment",
    "StageReport",
    "StateRequest",
    "StateUnavailable",
    "StateUpload",
    "TrainConfig",
    "UnitCheckpoint",
    "UnitState",
    "UnmaskShare",
    "UpdateHeader",
    "UploadOffset",
    "Welcome",
    "WorkRequest",
    "decode_message",
    "encode_message",
    "nested_from_dict",
    "nested_to_dict",
    "peek_kind",
    "progress_digest",
    "unpack_strict",
]
