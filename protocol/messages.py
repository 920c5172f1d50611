"""Control messages: typed frozen dataclasses and their strict msgpack form.

A message travels as a msgpack map ``{"v": PROTOCOL_VERSION, "kind": KIND,
<fields>}``. Decoding is strict: the map must carry exactly the declared fields,
every value has the declared type and lies inside its bounds, floats are finite,
``bool`` is never accepted as an ``int``, and nothing may follow the map. Every
rule lives next to its field as ``Annotated[type, Rule]`` so the encoder and the
decoder apply the same checks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import struct
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Final, TypeVar

import msgpack

from .encoding import ENCODINGS, UpdateEncoding
from .errors import DecodeError, EncodeError, ProtocolError, VersionError
from .modelspec import ModelSpec
from .version import PROTOCOL_VERSION

MAX_MESSAGE_BYTES: Final = 1 << 20
MAX_TEXT: Final = 256
MAX_LIST: Final = 4096
MAX_MAP: Final = 64
MAX_DEPTH: Final = 8
MAX_INT: Final = (1 << 63) - 1
MAX_CHECKPOINTS: Final = 40  # a Commitment's hashes; keeps the update header under 8 KiB

ID_RE: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")
BLOB_ID_RE: Final = re.compile(r"[0-9a-f]{64}")
METRIC_KEY_RE: Final = re.compile(r"[A-Za-z0-9_.:/-]{1,64}")
ISA_FLAG_RE: Final = re.compile(r"[a-z0-9_]{1,32}")
#: the precisions a job may ask for and a node may train in ("auto" resolves per device: protocol/compute.py)
PRECISIONS: Final = ("fp32", "tf32", "bf16", "fp16")

_UNPACK_LIMITS: Final[dict[str, int]] = {
    "max_str_len": 4 * MAX_TEXT * 4,  # bytes; per-field char limits are checked afterwards
    "max_bin_len": 1024,
    "max_array_len": MAX_LIST,
    "max_map_len": MAX_MAP,
    "max_ext_len": 0,
}


class _Fail(Exception):
    """Internal: a rule failed; carries the text, the caller adds where and direction."""


def _describe(value: object) -> str:
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"


# ---------------------------------------------------------------------------
# Field rules. Each rule turns a wire value into the Python value (decode) and a
# Python value into a wire value (encode), raising _Fail with a short reason.


class Rule:
    def decode(self, value: object) -> object:
        raise NotImplementedError

    def encode(self, value: object) -> object:
        return self.decode(value)


class Text(Rule):
    def __init__(
        self,
        max_len: int = MAX_TEXT,
        *,
        pattern: re.Pattern[str] | None = None,
        choices: tuple[str, ...] = (),
        allow_empty_pattern: bool = False,
    ) -> None:
        self.max_len = max_len
        self.pattern = pattern
        self.choices = choices
        self.allow_empty_pattern = allow_empty_pattern

    def decode(self, value: object) -> str:
        if not isinstance(value, str):
            raise _Fail(f"expected a string, got {_describe(value)}")
        if len(value) > self.max_len:
            raise _Fail(f"string longer than {self.max_len} characters")
        if self.choices and value not in self.choices:
            raise _Fail(f"expected one of {', '.join(self.choices)}, got {value[:40]!r}")
        if self.pattern is not None and not (self.allow_empty_pattern and value == ""):
            if self.pattern.fullmatch(value) is None:
                raise _Fail(f"{value[:40]!r} does not match {self.pattern.pattern}")
        return value


class Int(Rule):
    def __init__(self, lo: int = 0, hi: int = MAX_INT) -> None:
        self.lo = lo
        self.hi = hi

    def decode(self, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Fail(f"expected an integer, got {_describe(value)}")
        if not self.lo <= value <= self.hi:
            raise _Fail(f"integer {value} outside {self.lo}..{self.hi}")
        return value


class Float(Rule):
    def __init__(self, lo: float = 0.0, hi: float = 1e300, *, optional: bool = False) -> None:
        self.lo = lo
        self.hi = hi
        self.optional = optional

    def decode(self, value: object) -> float | None:
        if value is None and self.optional:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            kind = "a float or nil" if self.optional else "a float"
            raise _Fail(f"expected {kind}, got {_describe(value)}")
        result = float(value)
        if not math.isfinite(result):
            raise _Fail(f"expected a finite float, got {result}")
        if not self.lo <= result <= self.hi:
            raise _Fail(f"{result} outside {self.lo}..{self.hi}")
        return result


class Bool(Rule):
    def decode(self, value: object) -> bool:
        if not isinstance(value, bool):
            raise _Fail(f"expected true or false, got {_describe(value)}")
        return value


class Blob(Rule):
    """Bytes of an exact length."""

    def __init__(self, size: int) -> None:
        self.size = size

    def decode(self, value: object) -> bytes:
        if not isinstance(value, bytes):
            raise _Fail(f"expected {self.size} bytes, got {_describe(value)}")
        if len(value) != self.size:
            raise _Fail(f"expected {self.size} bytes, got {len(value)}")
        return value


class Bytes(Rule):
    """Bytes of at most ``max_len`` (at least ``min_len``)."""

    def __init__(self, max_len: int, min_len: int = 0) -> None:
        self.max_len = max_len
        self.min_len = min_len

    def decode(self, value: object) -> bytes:
        if not isinstance(value, bytes):
            raise _Fail(f"expected bytes, got {_describe(value)}")
        if not self.min_len <= len(value) <= self.max_len:
            raise _Fail(f"expected {self.min_len}..{self.max_len} bytes, got {len(value)}")
        return value


class Seq(Rule):
    def __init__(self, item: Rule, max_len: int = MAX_LIST) -> None:
        self.item = item
        self.max_len = max_len

    def _walk(self, value: object, encode: bool) -> tuple[object, ...] | list[object]:
        if not isinstance(value, (list, tuple)):
            raise _Fail(f"expected a list, got {_describe(value)}")
        if len(value) > self.max_len:
            raise _Fail(f"list longer than {self.max_len} items")
        out: list[object] = []
        for index, item in enumerate(value):
            try:
                out.append(self.item.encode(item) if encode else self.item.decode(item))
            except _Fail as exc:
                raise _Fail(f"[{index}]: {exc}") from None
        return out if encode else tuple(out)

    def decode(self, value: object) -> tuple[object, ...] | list[object]:
        return self._walk(value, encode=False)

    def encode(self, value: object) -> tuple[object, ...] | list[object]:
        return self._walk(value, encode=True)


class FloatMap(Rule):
    """``dict[str, float]`` with bounded size, key charset and required keys."""

    def __init__(self, max_keys: int = 32, *, required: tuple[str, ...] = ()) -> None:
        self.max_keys = max_keys
        self.required = required

    def decode(self, value: object) -> dict[str, float]:
        if not isinstance(value, dict):
            raise _Fail(f"expected a map of name to float, got {_describe(value)}")
        if len(value) > self.max_keys:
            raise _Fail(f"more than {self.max_keys} entries")
        out: dict[str, float] = {}
        for key, item in value.items():
            if not isinstance(key, str) or METRIC_KEY_RE.fullmatch(key) is None:
                raise _Fail(f"key {key!r:.40} does not match {METRIC_KEY_RE.pattern}")
            if isinstance(item, bool) or not isinstance(item, (int, float)):
                raise _Fail(f"[{key!r}]: expected a float, got {_describe(item)}")
            number = float(item)
            if not math.isfinite(number):
                raise _Fail(f"[{key!r}]: expected a finite float, got {number}")
            out[key] = number
        for key in self.required:
            if key not in out:
                raise _Fail(f"required key {key!r} is missing")
        return out


def _check_plain(value: object, depth: int) -> None:
    """A free-form msgpack value: str/int/float/bool/nil/list/map only, bounded depth."""
    if depth > MAX_DEPTH:
        raise _Fail(f"nested deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _Fail(f"expected a finite float, got {value}")
        return
    if isinstance(value, (list, tuple)):
        for item in value:
            _check_plain(item, depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise _Fail(f"map key {key!r:.40} is not a string")
            _check_plain(item, depth + 1)
        return
    raise _Fail(f"unsupported value {_describe(value)}")


class ModelSpecDict(Rule):
    """A ``ModelSpec.to_dict()``; validated with ``ModelSpec.from_dict``."""

    def decode(self, value: object) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise _Fail(f"expected a model spec map, got {_describe(value)}")
        _check_plain(value, 1)
        try:
            ModelSpec.from_dict(value)
        except ProtocolError as exc:
            raise _Fail(str(exc)) from None
        return value

    def encode(self, value: object) -> dict[str, Any]:
        if isinstance(value, ModelSpec):
            return value.to_dict()
        if isinstance(value, Mapping):
            return self.decode(dict(value))
        raise _Fail(f"expected a model spec map, got {_describe(value)}")


class Nested(Rule):
    def __init__(self, cls: type[Any], *, optional: bool = False) -> None:
        self.cls = cls
        self.optional = optional

    def decode(self, value: object) -> object:
        if value is None and self.optional:
            return None
        if not isinstance(value, dict):
            name = self.cls.__name__
            raise _Fail(f"expected {'an' if name[:1] in 'AEIOU' else 'a'} {name} map, got {_describe(value)}")
        return _from_wire(self.cls, value)

    def encode(self, value: object) -> dict[str, object] | None:
        if value is None and self.optional:
            return None
        if not isinstance(value, self.cls):
            raise _Fail(f"expected {self.cls.__name__}, got {_describe(value)}")
        return _to_wire(value)


# Shorthands used in the field declarations below.
IdStr = Annotated[str, Text(64, pattern=ID_RE)]
BlobIdStr = Annotated[str, Text(64, pattern=BLOB_ID_RE)]
ShortText = Annotated[str, Text()]
Timestamp = Annotated[float, Float(0.0, 1e11)]
Nonce = Annotated[bytes, Blob(16)]
Count = Annotated[int, Int()]
NonNegFloat = Annotated[float, Float()]
OptFloat = Annotated[float | None, Float(optional=True)]


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


# -- secure aggregation (protocol/secagg.py; hub/policy/secagg.py runs the server's side) ------------
#: the phases of a round's secure aggregation, as the hub reports them to a node
SECAGG_PHASES: Final = ("keys", "shares", "masked", "unmask", "done", "aborted")
CIPHERTEXT_MAX: Final = 1024


@dataclass(frozen=True)
class SecAggKeys:
    """Node -> hub, POST /v1/secagg/keys: the node's two public keys for this round (X25519: one
    to encrypt the shares others send it, one for its pairwise masks), after it trained."""

    KIND: ClassVar[str] = "secagg_keys"
    assignment_id: IdStr
    c_pk: Annotated[bytes, Blob(32)]
    s_pk: Annotated[bytes, Blob(32)]
    timestamp: Timestamp
    nonce: Nonce


@dataclass(frozen=True)
class SecAggPoll:
    """Node -> hub, POST /v1/secagg/poll: where the round's secure aggregation stands (answered
    with a SecAggState), at once or when it moves on (``after``, ``wait_s``)."""

    KIND: ClassVar[str] = "secagg_poll"
    assignment_id: IdStr
    timestamp: Timestamp
    nonce: Nonce
    #: a long-poll: the hub answers once this node's phase is no longer ``after`` (the phase it last
    #: saw), or after ``wait_s`` (at most the hub's long-poll limit); 0 answers at once
    after: Annotated[str, Text(16, choices=("", *SECAGG_PHASES))] = ""
    wait_s: Annotated[float, Float(0.0, 60.0)] = 0.0


@dataclass(frozen=True)
class RosterMember:
    node_id: IdStr
    c_pk: Annotated[bytes, Blob(32)]
    s_pk: Annotated[bytes, Blob(32)]


@dataclass(frozen=True)
class Sealed:
    """A ciphertext from or to one node (``node_id``: the receiver in SecAggShares, the sender in
    a SecAggState's inbox); the hub cannot read it."""

    node_id: IdStr
    ciphertext: Annotated[bytes, Bytes(CIPHERTEXT_MAX, 1)]


@dataclass(frozen=True)
class UnmaskShare:
    """One share a node hands over to unmask the sum: of node ``node_id``'s self-mask seed
    (``kind`` "b", a node whose masked update came) or of its mask key (``kind`` "s", a node that
    dropped out after sharing its keys); never both for one node."""

    node_id: IdStr
    kind: Annotated[str, Text(1, choices=("b", "s"))]
    share: Annotated[bytes, Bytes(CIPHERTEXT_MAX, 1)]


@dataclass(frozen=True)
class SecAggState:
    """Hub -> node: the round's secure aggregation as far as it concerns this node. ``roster`` and
    ``threshold`` from phase "shares" on; ``survivors`` (who shared) and ``inbox`` (the shares sent
    to this node) from "masked" on; ``alive`` (whose masked update came) and ``dropped`` in
    "unmask"; ``detail`` says why a round was "aborted"."""

    KIND: ClassVar[str] = "secagg_state"
    assignment_id: IdStr
    phase: Annotated[str, Text(16, choices=SECAGG_PHASES)]
    roster: Annotated[tuple[RosterMember, ...], Seq(Nested(RosterMember), MAX_LIST)] = ()
    threshold: Annotated[int, Int(0, MAX_LIST)] = 0
    survivors: Annotated[tuple[str, ...], Seq(Text(64, pattern=ID_RE), MAX_LIST)] = ()
    inbox: Annotated[tuple[Sealed, ...], Seq(Nested(Sealed), MAX_LIST)] = ()
    alive: Annotated[tuple[str, ...], Seq(Text(64, pattern=ID_RE), MAX_LIST)] = ()
    dropped: Annotated[tuple[str, ...], Seq(Text(64, pattern=ID_RE), MAX_LIST)] = ()
    detail: ShortText = ""


@dataclass(frozen=True)
class SecAggShares:
    """Node -> hub, POST /v1/secagg/shares: this node's encrypted shares, one per other member."""

    KIND: ClassVar[str] = "secagg_shares"
    assignment_id: IdStr
    shares: Annotated[tuple[Sealed, ...], Seq(Nested(Sealed), MAX_LIST)]
    timestamp: Timestamp
    nonce: Nonce


@dataclass(frozen=True)
class SecAggMasked:
    """Node -> hub, POST /v1/secagg/masked (header X-GPUFlex-Masked; the body is the masked vector,
    uint32 little-endian, ``size`` bytes of SHA-256 ``sha256``): what the node trained, masked.
    ``sample_count``, ``loss`` and ``train_s`` are the plain figures every update reports."""

    KIND: ClassVar[str] = "secagg_masked"
    assignment_id: IdStr
    sha256: BlobIdStr
    size: Count
    sample_count: Count
    loss: Annotated[float, Float(0.0, 1e12)]
    train_s: Annotated[float, Float(0.0, 1e9)]
    timestamp: Timestamp
    nonce: Nonce


@dataclass(frozen=True)
class SecAggUnmask:
    """Node -> hub, POST /v1/secagg/unmask: the shares the hub asked for (SecAggState "unmask")."""

    KIND: ClassVar[str] = "secagg_unmask"
    assignment_id: IdStr
    shares: Annotated[tuple[UnmaskShare, ...], Seq(Nested(UnmaskShare), MAX_LIST)]
    timestamp: Timestamp
    nonce: Nonce


Message = (Hello | Welcome | WorkRequest | Assignment | NoWork | Heartbeat | Abandon | BlobRequest | UpdateHeader | Ack
           | StateRequest | StateUpload | StateUnavailable | UploadOffset | SiloQuery | SiloSchema | SiloRegistration
           | SiloWithdrawal
           | SecAggKeys | SecAggPoll | SecAggState | SecAggShares | SecAggMasked | SecAggUnmask)
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
)
MESSAGE_KINDS: Final[dict[str, type[Any]]] = {cls.KIND: cls for cls in MESSAGE_TYPES}

M = TypeVar("M")


# ---------------------------------------------------------------------------
# Schema plumbing.

_SCHEMAS: dict[type[Any], tuple[tuple[str, Rule], ...]] = {}
_OPTIONAL: dict[type[Any], dict[str, object]] = {}  # message type -> its fields with a default


def _schema(cls: type[Any]) -> tuple[tuple[str, Rule], ...]:
    cached = _SCHEMAS.get(cls)
    if cached is not None:
        return cached
    hints = typing.get_type_hints(cls, include_extras=True)
    fields: list[tuple[str, Rule]] = []
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        rules = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Rule)]
        if len(rules) != 1:
            raise TypeError(f"{cls.__name__}.{field.name} needs exactly one Rule annotation")
        fields.append((field.name, rules[0]))
    result = tuple(fields)
    _SCHEMAS[cls] = result
    return result


def _from_wire(cls: type[M], data: Mapping[object, object]) -> M:
    schema = _schema(cls)
    names = {name for name, _ in schema}
    for key in data:
        if key not in names and key not in ("v", "kind"):
            raise _Fail(f"unknown field {key!r:.40} in {cls.__name__}")
    values: dict[str, object] = {}
    optional = _optional(cls)
    for name, rule in schema:
        if name not in data:
            if name in optional:  # a later addition with a default: absent means the default
                continue
            raise _Fail(f"missing field {name!r} in {cls.__name__}")
        try:
            values[name] = rule.decode(data[name])
        except _Fail as exc:
            raise _Fail(f"{name}: {exc}") from None
    return cls(**values)


def _optional(cls: type[Any]) -> dict[str, object]:
    """Fields added after a message type first shipped carry a default: a peer that does not know
    them leaves them out, and a sender leaves them out while they hold the default, so old and
    new peers of one protocol version understand each other."""
    found = _OPTIONAL.get(cls)
    if found is None:
        found = _OPTIONAL[cls] = {f.name: f.default for f in dataclasses.fields(cls)
                                  if f.default is not dataclasses.MISSING}
    return found


def _to_wire(msg: object) -> dict[str, object]:
    out: dict[str, object] = {}
    optional = _optional(type(msg))
    for name, rule in _schema(type(msg)):
        if name in optional and getattr(msg, name) == optional[name]:
            continue
        try:
            out[name] = rule.encode(getattr(msg, name))
        except _Fail as exc:
            raise _Fail(f"{name}: {exc}") from None
    return out


def _unpack(data: object, what: str, limits: Mapping[str, int], max_bytes: int) -> object:
    """msgpack-decode ``data`` with hard limits; any failure becomes DecodeError."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"{what}: expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise DecodeError(f"{what}: {len(data)} bytes exceeds the {max_bytes}-byte limit")
    if len(data) == 0:
        raise DecodeError(f"{what}: empty input")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            timestamp=0,
            **limits,
        )
    except msgpack.ExtraData:
        raise DecodeError(f"{what}: trailing bytes after the msgpack value") from None
    except (ValueError, TypeError, RecursionError, OverflowError, MemoryError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DecodeError(f"{what}: malformed msgpack ({reason[:80]})") from None
    except Exception as exc:  # msgpack's C unpacker may raise other types on garbage
        raise DecodeError(f"{what}: malformed msgpack ({type(exc).__name__})") from None


def unpack_strict(data: object, what: str = "message", *, max_bytes: int = MAX_MESSAGE_BYTES,
                  max_bin_len: int = 1024) -> object:
    """Strictly decode one msgpack value (helper shared with ``signing``)."""
    limits = dict(_UNPACK_LIMITS)
    limits["max_bin_len"] = max_bin_len
    return _unpack(data, what, limits, max_bytes)


# ---------------------------------------------------------------------------
# Public API.


def nested_to_dict(value: object) -> dict[str, object]:
    """A nested message part (e.g. ComputeClass) as its checked plain map (to store it as JSON)."""
    try:
        return _to_wire(value)
    except _Fail as exc:
        raise EncodeError(f"{type(value).__name__}.{exc}") from None


def nested_from_dict(cls: type[M], data: object) -> M:
    """The inverse of ``nested_to_dict``, with the decoder's checks (lists are taken for tuples)."""
    if not isinstance(data, dict):
        raise DecodeError(f"{cls.__name__}: expected a map, got {type(data).__name__}")
    try:
        return _from_wire(cls, data)
    except _Fail as exc:
        raise DecodeError(f"{cls.__name__}.{exc}") from None


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
    "MAX_MESSAGE_BYTES",
    "MESSAGE_KINDS",
    "MESSAGE_TYPES",
    "PRECISIONS",
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
    "Message",
    "NoWork",
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
    "StateRequest",
    "StateUnavailable",
    "StateUpload",
    "TrainConfig",
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
