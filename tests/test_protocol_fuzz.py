"""Hostile bytes fed to every decoder: the only exception that may escape is ProtocolError.

About 12,600 generated cases in total; each is cheap, so the file runs in seconds.
"""

from __future__ import annotations

import math
import random
import struct
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from gpuflex.protocol import (
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
    ModelSpec,
    NoWork,
    ProtocolError,
    SigningKey,
    TrainConfig,
    UpdateHeader,
    Welcome,
    WorkRequest,
    decode_message,
    decode_state,
    encode_message,
    open_sealed,
    parse_job_spec,
    read_header,
    seal,
    state_from_safetensors,
    state_to_safetensors,
)
from gpuflex.protocol.messages import (
    MESSAGE_TYPES,
    Commitment,
    ComputeClass,
    RelayHeader,
    RelayTake,
    RosterMember,
    Sealed,
    SecAggKeys,
    SecAggMasked,
    SecAggPoll,
    SecAggShares,
    SecAggState,
    SecAggUnmask,
    SiloQuery,
    SiloRegistration,
    SiloSchema,
    SiloWithdrawal,
    StageAssignment,
    StageReport,
    StateRequest,
    StateUnavailable,
    StateUpload,
    UnitCheckpoint,
    UnitState,
    UnmaskShare,
    UploadOffset,
)
from gpuflex.protocol.modelspec import LAYERS
from gpuflex.protocol.stagesketch import (
    GFS1_ENTRIES,
    MAX_SKETCH_BYTES,
    decode_sketch,
    encode_sketch,
    sketch_size,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch.set_num_threads(1)

FUZZ = settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
SPEC = ModelSpec.from_dict({"kind": "mlp", "input": 8, "hidden": [4], "outputs": 3})
NONCE = b"\x07" * 16
SKETCH = encode_sketch(torch.randn(4, 50, generator=torch.Generator().manual_seed(0)))
#: the sketch layouts a decoder takes: GFS2 (SKETCH), and GFS1 (the 126 largest of 200 entries)
SKETCHES = (
    SKETCH,
    struct.pack("<4sII", b"GFS1", 200, 126)
    + np.arange(0, 252, 2, dtype="<u4").tobytes()
    + np.linspace(-1, 1, 126, dtype="<f4").tobytes(),
)
SAMPLES: list[Any] = [
    Hello(
        "0.1.0",
        1,
        DeviceInfo("cuda", "H100", 80 << 30, 16),
        Benchmark(1e4, 50.0, 400.0, None, 2000.0, 20.0, None, "mlp-64", {"fp32": 1e4, "bf16": 3.5e4}),
        1000.0,
        NONCE,
        ComputeClass("cuda", "NVIDIA H100 80GB HBM3", "9.0", "GenuineIntel", ("avx2", "avx512f"), "2.13.0",
                     "12.8", "91002", True, 16, ("fp32", "tf32", "bf16", "fp16")),
    ),
    Welcome("gf1-aaaa-bbbb-cccc-dddd-eeee", "gf1-ffff-gggg-hhhh-iiii-jjjj", 1000.0, 5.0),
    WorkRequest(1000.0, NONCE, 30.0, ("a" * 64, "b" * 64)),
    Assignment(
        "as-1",
        "job-1",
        2,
        "gf1-aaaa-bbbb-cccc-dddd-eeee",
        "c" * 64,
        999,
        SPEC.to_dict(),
        (ChunkRef("d" * 64, 10, 64), ChunkRef("e" * 64, 11, 64)),
        5,
        TrainConfig(1, 32, "sgd", 0.05, 0.0, 0.0, 0.9, 0.999, "cross_entropy", 0.0, "bf16"),
        1000.0,
        1030.0,
        "rg-1",
    ),
    NoWork(2.5, "no jobs"),
    Heartbeat("as-1", 0.5, 1000.0, NONCE),
    Abandon("as-1", "shutting down", 1000.0, NONCE),
    BlobRequest("f" * 64, 1000.0, NONCE),
    UpdateHeader(
        "as-1", "0" * 64, 100, 64, {"loss": 0.3, "acc": 0.9}, {"train_s": 1.5}, 1000.0, NONCE
    ),
    UpdateHeader(
        "as-2", "1" * 64, 100, 64, {"loss": 0.3}, {"train_s": 1.5}, 1000.0, NONCE,
        Commitment(4, 9, "bf16", ("2" * 64, "3" * 64, "4" * 64, "5" * 64), (0.5, 0.25, 0.125)),
    ),
    Ack(True, "ok", 1030.0),
    StateRequest("sr-1", "job-1", 3, "as-1", (0, 12, 96), 1100.0),
    StateUpload("sr-1", 12, "e" * 64, 4096, 1000.0, NONCE),
    StateUnavailable("sr-1", (0, 12), "pruned", 1000.0, NONCE),
    UploadOffset("as-1", "0" * 64, 700_000),
    SiloQuery("job-1", 1000.0, NONCE),
    SiloSchema("job-1", SPEC.to_dict(), 10, 5000, "label", True, "a" * 64),
    SiloRegistration("job-1", "a" * 64, 4096, 64, 1000.0, NONCE, (30, 34)),
    SiloWithdrawal("job-1", "a" * 64, 1000.0, NONCE),
    SecAggKeys("as-1", b"\x01" * 32, b"\x02" * 32, 1000.0, NONCE),
    SecAggPoll("as-1", 1000.0, NONCE),
    SecAggState("as-1", "masked", (RosterMember("gf1-a", b"\x01" * 32, b"\x02" * 32),), 2, ("gf1-a", "gf1-b"),
                (Sealed("gf1-b", b"\x03" * 160),), (), (), ""),
    SecAggShares("as-1", (Sealed("gf1-b", b"\x04" * 160), Sealed("gf1-c", b"\x05" * 160)), 1000.0, NONCE),
    SecAggMasked("as-1", "a" * 64, 400, 64, 0.5, 1.5, 1000.0, NONCE),
    SecAggUnmask("as-1", (UnmaskShare("gf1-b", "b", b"\x06" * 66), UnmaskShare("gf1-c", "s", b"\x07" * 66)),
                 1000.0, NONCE),
    UpdateHeader(
        "as-3", "6" * 64, 2_000_000, 64, {"loss": 0.3}, {"train_s": 1.5}, 1000.0, NONCE, None, 700_000,
    ),
    RelayHeader("job-1", 7, 2, "activation", 1, 2, "a" * 64, 4096, 1000.0, NONCE, 3, SKETCH),
    RelayTake("job-1", 7, 2, "gradient", 2, 1, 30.0, 1000.0, NONCE, 3),
    StageAssignment(
        "job-1", 3, "gf1-a", 1, 2, 4, ("gf1-a", "gf1-b", "gf1-c"), (b"\x01" * 32, b"\x02" * 32, b"\x03" * 32),
        (0, 2, 4), SPEC.to_dict(), "c" * 64, 9000, (UnitState(2, "d" * 64, 4096), UnitState(3, "e" * 64, 4096)),
        (), TrainConfig(1, 32, "adam", 1e-3, 0.0, 0.0, 0.9, 0.999, "cross_entropy", 1.0), 7, 32, 4, "1f1b",
        20, 100, 10, 1000.0, ("", "", ""), "subspace", 8,
    ),
    UnitCheckpoint("job-1", 3, 1, 2, 30, "d" * 64, 4096, 1000.0, NONCE),
    LinkProbe("e" * 64, 256 << 10, 1000.0, NONCE),
    StageReport("job-1", 3, 2, 31, 0.25, 0.2, 2.5, "", 1000.0, NONCE),
]
WIRE = [encode_message(m) for m in SAMPLES]
KEY = SigningKey.from_seed(b"\x01" * 32)
SEALED = [seal(KEY, m) for m in SAMPLES]
STATE = {
    "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "b": torch.ones(3, dtype=torch.bfloat16),
    "n": torch.tensor(7),
    "m": torch.tensor([True, False]),
    "e": torch.zeros(0, 2, dtype=torch.float16),
}
from gpuflex.protocol import encode_state  # noqa: E402

BLOB = encode_state(STATE)
SAFE = state_to_safetensors(STATE)


def test_samples_cover_every_message_type() -> None:
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES)
    for m, w in zip(SAMPLES, WIRE, strict=True):
        assert decode_message(w, type(m)) == m


# Cases are generated from a hypothesis-drawn seed by plain `random` code: far
# cheaper per case than composite strategies, and still replayable from the seed.
SEEDS = st.integers(0, 2**64 - 1)


def _mutate(r: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(r.randint(1, 4)):
        op = r.choice(("flip", "insert", "delete", "truncate", "dup", "byte"))
        pos = r.randint(0, max(len(out) - 1, 0))
        if op == "flip" and out:
            out[pos] ^= r.randint(1, 255)
        elif op == "byte" and out:
            out[pos] = r.choice((0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xCA, 0xCB, 0xCF, 0xD3, 0xDB, 0xDD, 0xDF, 0xFF))
        elif op == "insert":
            out[pos:pos] = r.randbytes(r.randint(1, 8))
        elif op == "delete" and out:
            del out[pos : pos + r.randint(1, 8)]
        elif op == "truncate":
            del out[pos:]
        elif op == "dup":
            out[pos:pos] = out[pos : pos + r.randint(1, 16)]
    return bytes(out)


_LEAVES: tuple[object, ...] = (
    None, True, False, 0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), 0.0, -0.0, 0.5, 1e308,
    math.nan, math.inf, -math.inf, "", "x", "gf1-aaaa", "a" * 64, "a" * 300, "\u00e9\u0000", b"", b"\x00" * 16,
    b"x" * 64, "relu", "Linear", "mlp", "cnn", "sequential", "classification",
)


def _value(r: random.Random, depth: int = 0) -> object:
    """An arbitrary msgpack-able value: leaves, lists and maps, a few levels deep."""
    roll = r.random()
    if depth < 3 and roll < 0.15:
        return [_value(r, depth + 1) for _ in range(r.randint(0, 4))]
    if depth < 3 and roll < 0.3:
        return {r.choice(("a", "kind", "type", "v", "x" * 9, "")): _value(r, depth + 1) for _ in range(r.randint(0, 4))}
    if roll < 0.4:
        return r.randint(-(2**64), 2**64 - 1)
    if roll < 0.5:
        return r.uniform(-1e6, 1e6)
    return r.choice(_LEAVES)


def _pack(obj: object) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return b"\xc0"


def _only_protocol_errors(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except ProtocolError as exc:
        text = str(exc)
        assert text and "\n" not in text, repr(text)


@FUZZ
@given(SEEDS)
def test_random_bytes_to_decode_message(seed: int) -> None:
    r = random.Random(seed)
    prefix = r.choice((b"", b"\x80", b"\x8f", b"\x82\xa1v\x01", b"\xde\xff\xff"))
    _only_protocol_errors(decode_message, prefix + r.randbytes(r.randint(0, 200)), r.choice(MESSAGE_TYPES))


@FUZZ
@given(SEEDS)
def test_mutated_messages(seed: int) -> None:
    r = random.Random(seed)
    _only_protocol_errors(decode_message, _mutate(r, r.choice(WIRE)), r.choice(MESSAGE_TYPES))


@FUZZ
@given(SEEDS)
def test_structurally_hostile_fields(seed: int) -> None:
    """A valid map with fields (also nested ones, and the header) replaced by arbitrary values."""
    r = random.Random(seed)
    index = r.randrange(len(WIRE))
    wire = msgpack.unpackb(WIRE[index], raw=False)
    for _ in range(r.randint(1, 2)):
        target = wire
        nested = [k for k, v in wire.items() if isinstance(v, dict)]
        if nested and r.random() < 0.4:
            target = wire[r.choice(nested)]
        key = r.choice([*target.keys(), "extra"])
        if r.random() < 0.1:
            target.pop(key, None)
        else:
            target[key] = _value(r)
    cls = type(SAMPLES[index]) if r.random() < 0.9 else r.choice(MESSAGE_TYPES)
    _only_protocol_errors(decode_message, _pack(wire), cls)


@FUZZ
@given(SEEDS)
def test_mutated_envelopes(seed: int) -> None:
    r = random.Random(seed)
    if r.random() < 0.8:
        data = _mutate(r, r.choice(SEALED))
    else:
        data = _pack({"payload": r.choice(WIRE), "signer": r.randbytes(r.choice((31, 32, 33))),
                      "sig": r.randbytes(r.choice((63, 64)))} if r.random() < 0.5 else _value(r))
    _only_protocol_errors(open_sealed, data, r.choice(MESSAGE_TYPES))


@FUZZ
@given(SEEDS)
def test_mutated_tensor_blobs(seed: int) -> None:
    r = random.Random(seed)
    data = _mutate(r, BLOB) if r.random() < 0.9 else r.randbytes(r.randint(0, 200))
    _only_protocol_errors(decode_state, data)
    _only_protocol_errors(read_header, data)


def _hostile_header(r: random.Random) -> bytes:
    """Syntactically valid GFT1 framing around an adversarial header."""
    from gpuflex.protocol.tensors import ALIGN, PREFIX

    entries: list[object] = []
    for _ in range(r.randint(0, 4)):
        if r.random() < 0.2:
            entries.append(_value(r))
            continue
        entries.append([
            r.choice(("w", "b", "w", "", "bad name", 3, "x" * 300)),
            r.choice(("float32", "bool", "int64", "bfloat16", "uint8", "complex64", 1)),
            [r.choice((0, 1, 2, 3, -1, 2**40, True)) for _ in range(r.randint(0, 3))],
            r.choice((0, 64, 128, 4, -64, 2**40, True)),
            r.choice((0, 1, 4, 8, 12, 64, -8, 2**40)),
        ])
    header = {"tensors": entries, "data_bytes": r.choice((0, 8, 64, 128, 192, -1, 2**40))} if r.random() < 0.9 else _value(r)
    head = _pack(header)
    start = (PREFIX.size + len(head) + ALIGN - 1) // ALIGN * ALIGN
    data = r.randbytes(r.choice((0, 8, 64, 128, 192, r.randint(0, 300))))
    return PREFIX.pack(b"GFT1", 1, 0, len(head), 0) + head + bytes(start - PREFIX.size - len(head)) + data


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(SEEDS)
def test_hostile_tensor_headers(seed: int) -> None:
    _only_protocol_errors(decode_state, _hostile_header(random.Random(seed)))


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(SEEDS)
def test_mutated_safetensors(seed: int) -> None:
    r = random.Random(seed)
    _only_protocol_errors(state_from_safetensors, _mutate(r, SAFE))


_SPEC_KEYS = ("kind", "input", "hidden", "outputs", "activation", "dropout", "task", "image", "channels",
              "kernel", "pool", "input_shape", "layers", "x", "vocab", "context", "width", "heads", "mlp_ratio",
              "tied_embeddings")
_LAYER_KEYS = ("in_features", "out_features", "kernel_size", "in_channels", "out_channels", "args",
               "normalized_shape", "p", "num_features", "stride", "padding", "start_dim", "embedding_dim",
               "num_embeddings")
_GOOD_SPECS = (
    {"kind": "mlp", "input": 8, "hidden": [4], "outputs": 3},
    {"kind": "cnn", "image": [1, 8, 8], "channels": [2], "outputs": 3},
    {"kind": "sequential", "input_shape": [8], "layers": [{"type": "Linear", "in_features": 8, "out_features": 3}],
     "outputs": 3},
    {"kind": "transformer", "vocab": 16, "context": 8, "layers": 1, "width": 8, "heads": 2},
)


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(SEEDS)
def test_hostile_model_specs(seed: int) -> None:
    r = random.Random(seed)
    d: dict[str, Any] = dict(r.choice(_GOOD_SPECS))
    for _ in range(r.randint(1, 3)):
        d[r.choice(_SPEC_KEYS)] = _value(r) if r.random() < 0.5 else r.choice((0, 1, 3, 8, [8], [1, 8, 8], [], [0]))
    _only_protocol_errors(ModelSpec.from_dict, d)


@settings(max_examples=800, deadline=None, suppress_health_check=list(HealthCheck))
@given(SEEDS)
def test_hostile_sequential_layers(seed: int) -> None:
    r = random.Random(seed)
    layers: list[object] = []
    for _ in range(r.randint(0, 4)):
        layer: dict[str, object] = {"type": r.choice((*LAYERS, "Nope", 3))}
        for _ in range(r.randint(0, 3)):
            layer[r.choice(_LAYER_KEYS)] = (
                _value(r) if r.random() < 0.3 else r.choice((0, 1, 2, 3, 8, -1, [2, 2], [1, 2, 3], 0.5, True))
            )
        layers.append(layer if r.random() < 0.95 else _value(r))
    shape = [r.choice((-1, 0, 1, 2, 3, 8)) for _ in range(r.randint(0, 4))]
    _only_protocol_errors(
        ModelSpec.from_dict, {"kind": "sequential", "input_shape": shape, "layers": layers, "outputs": r.choice((1, 2, 8))}
    )


@settings(max_examples=800, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.text(max_size=200) | st.binary(max_size=200))
def test_random_job_specs(text: str | bytes) -> None:
    _only_protocol_errors(parse_job_spec, text)


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(["train", "data", "aggregation", "verification", "job"]),
       st.sampled_from(["rounds", "lr", "split", "method", "replication", "quorum", "name", "zzz"]),
       st.one_of(st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=10), st.booleans(),
                 st.lists(st.integers(), max_size=2)))
def test_hostile_job_values(section: str, key: str, value: object) -> None:
    if isinstance(value, float) and math.isnan(value):
        literal = "nan"
    elif isinstance(value, float) and math.isinf(value):
        literal = "inf" if value > 0 else "-inf"
    elif isinstance(value, bool):
        literal = str(value).lower()
    elif isinstance(value, str):
        literal = '"' + value.encode("unicode_escape").decode().replace('"', '\\"') + '"'
    else:
        literal = repr(value)
    base = '[model]\nkind = "mlp"\ninput = 4\noutputs = 2\n'
    if section == "job":
        text = f'[job]\n{key} = {literal}\n' + base
    else:
        text = f'[job]\nname = "x"\n{base}[{section}]\n{key} = {literal}\n'
    _only_protocol_errors(parse_job_spec, text)


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(SEEDS)
def test_mutated_stage_sketches(seed: int) -> None:
    """A sketch (protocol/stagesketch.py, either layout) mutated or random: a DecodeError line,
    or one that is well formed (its size, indices strictly increasing within its elements, finite
    values and projections)."""
    r = random.Random(seed)
    data = _mutate(r, r.choice(SKETCHES)) if r.random() < 0.9 else r.randbytes(r.randint(0, 1100))
    try:
        got = decode_sketch(data)
    except ProtocolError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    if got.projections is None:  # GFS1: its entries alone
        assert len(data) == 12 + 8 * min(GFS1_ENTRIES, got.numel)
    else:
        assert len(data) == sketch_size(got.numel) and bool(torch.isfinite(got.projections).all())
    assert len(data) <= MAX_SKETCH_BYTES and bool(torch.isfinite(got.values).all())
    assert bool((got.indices.diff() > 0).all())
    assert got.indices.numel() == 0 or int(got.indices.max()) < got.numel


def test_total_generated_cases_at_least_10000() -> None:
    counts = [1500] * 5 + [1500, 500, 1000, 800, 800, 500, 500]
    assert sum(counts) >= 10_000


@pytest.mark.parametrize("depth", [50, 5000])
def test_deep_nesting(depth: int) -> None:
    data = b"\x91" * depth + b"\xc0"
    for cls in MESSAGE_TYPES:
        _only_protocol_errors(decode_message, data, cls)
    data = b"\x81\xa1a" * depth + b"\xc0"
    _only_protocol_errors(decode_message, data, Hello)
