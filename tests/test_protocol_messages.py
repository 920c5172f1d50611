"""Control messages: round-trips for every kind and strict decoding."""

from __future__ import annotations

import dataclasses
import math
import string

import msgpack
import pytest
from gpuflex.protocol import (
    PROTOCOL_VERSION,
    Abandon,
    Ack,
    Assignment,
    Benchmark,
    BlobRequest,
    ChunkRef,
    DecodeError,
    DeviceInfo,
    EncodeError,
    Heartbeat,
    Hello,
    ModelSpec,
    NoWork,
    ProtocolError,
    TrainConfig,
    UpdateHeader,
    VersionError,
    Welcome,
    WorkRequest,
    decode_message,
    encode_message,
)
from gpuflex.protocol.boundary import BOUNDARIES
from gpuflex.protocol.messages import (
    MAX_LINK_PROBE_BYTES,
    MESSAGE_TYPES,
    PIPELINE_SCHEDULES,
    PRECISIONS,
    RELAY_KINDS,
    SECAGG_PHASES,
    UNKNOWN_CLASS,
    Commitment,
    ComputeClass,
    LinkProbe,
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
    peek_kind,
)
from hypothesis import given, settings
from hypothesis import strategies as st

# ---------------------------------------------------------------------------
# Strategies producing valid messages.

ids = st.text(string.ascii_letters + string.digits + "_-", min_size=1, max_size=64)
blob_ids = st.text("0123456789abcdef", min_size=64, max_size=64)
texts = st.text(max_size=256)
nonces = st.binary(min_size=16, max_size=16)
timestamps = st.floats(0.0, 1e11, allow_nan=False)
counts = st.integers(0, 2**63 - 1)
pos_floats = st.floats(0.0, 1e300, allow_nan=False, allow_infinity=False)
opt_floats = st.none() | pos_floats
metric_keys = st.text(string.ascii_letters + string.digits + "_.:/-", min_size=1, max_size=64)
finite = st.floats(allow_nan=False, allow_infinity=False)

device_infos = st.builds(
    DeviceInfo,
    kind=st.sampled_from(["cpu", "cuda", "mps"]),
    name=texts,
    memory_bytes=counts,
    threads=st.integers(0, 1 << 20),
)
benchmarks = st.builds(
    Benchmark,
    samples_per_s=pos_floats,
    matmul_tflops_fp32=pos_floats,
    matmul_tflops_bf16=opt_floats,
    matmul_tflops_fp16=opt_floats,
    mem_bandwidth_gbs=pos_floats,
    h2d_gbs=opt_floats,
    d2h_gbs=opt_floats,
    reference_model=texts,
    precision_sps=st.dictionaries(st.sampled_from(list(PRECISIONS)), pos_floats, max_size=4),
)
compute_classes = st.builds(
    ComputeClass,
    device_kind=st.sampled_from(["cpu", "cuda", "mps", "unknown"]),
    device_model=texts,
    capability=st.text(max_size=16),
    cpu_vendor=st.text(max_size=64),
    isa=st.lists(st.text(string.ascii_lowercase + string.digits + "_", min_size=1, max_size=32), max_size=8).map(tuple),
    torch_version=st.text(max_size=64),
    cuda_version=st.text(max_size=64),
    cudnn_version=st.text(max_size=64),
    onednn=st.booleans(),
    threads=st.integers(0, 1 << 20),
    precisions=st.lists(st.sampled_from(list(PRECISIONS)), max_size=4).map(tuple),
)
train_configs = st.builds(
    TrainConfig,
    local_epochs=st.integers(1, 100),
    batch_size=st.integers(1, 4096),
    optimizer=st.sampled_from(["sgd", "adam", "adamw"]),
    lr=st.floats(0.0, 1.0),
    momentum=st.floats(0.0, 1.0),
    weight_decay=st.floats(0.0, 1.0),
    beta1=st.floats(0.0, 1.0),
    beta2=st.floats(0.0, 1.0),
    loss=st.sampled_from(["cross_entropy", "mse"]),
    grad_clip=st.floats(0.0, 100.0),
    precision=st.sampled_from(list(PRECISIONS)),
)
model_specs = st.builds(
    lambda i, h, o, a, d: ModelSpec.from_dict(
        {"kind": "mlp", "input": i, "hidden": h, "outputs": o, "activation": a, "dropout": d}
    ).to_dict(),
    st.integers(1, 256),
    st.lists(st.integers(1, 64), max_size=3),
    st.integers(1, 20),
    st.sampled_from(["relu", "gelu", "tanh", "sigmoid"]),
    st.sampled_from([0.0, 0.1, 0.5]),
)

keys32 = st.binary(min_size=32, max_size=32)
sealeds = st.lists(st.builds(Sealed, node_id=ids, ciphertext=st.binary(min_size=1, max_size=1024)),
                   max_size=5).map(tuple)

MESSAGES = {
    Hello: st.builds(
        Hello,
        software_version=st.text(max_size=64),
        protocol_version=st.integers(0, 2**31),
        device=device_infos,
        benchmark=benchmarks,
        timestamp=timestamps,
        nonce=nonces,
        compute=compute_classes,
    ),
    Welcome: st.builds(
        Welcome,
        node_id=ids,
        hub_fingerprint=ids,
        server_time=timestamps,
        poll_s=st.floats(0.0, 86400.0),
    ),
    WorkRequest: st.builds(
        WorkRequest,
        timestamp=timestamps,
        nonce=nonces,
        wait_s=st.floats(0.0, 60.0),
        cached_chunks=st.lists(blob_ids, max_size=8).map(tuple),
    ),
    Assignment: st.builds(
        Assignment,
        assignment_id=ids,
        job_id=ids,
        round=st.integers(0, 2**31),
        node_id=ids,
        model_hash=blob_ids,
        model_size=counts,
        model_spec=model_specs,
        chunks=st.lists(
            st.builds(ChunkRef, sha256=blob_ids, size=counts, samples=counts), max_size=5
        ).map(tuple),
        seed=counts,
        train=train_configs,
        issued_at=timestamps,
        deadline=timestamps,
        replica_group=st.just("") | ids,
    ),
    NoWork: st.builds(NoWork, retry_after_s=st.floats(0.0, 86400.0), reason=texts),
    Heartbeat: st.builds(
        Heartbeat,
        assignment_id=ids,
        progress=st.floats(0.0, 1.0),
        timestamp=timestamps,
        nonce=nonces,
    ),
    Abandon: st.builds(
        Abandon, assignment_id=ids, reason=texts, timestamp=timestamps, nonce=nonces
    ),
    BlobRequest: st.builds(BlobRequest, sha256=blob_ids, timestamp=timestamps, nonce=nonces),
    UpdateHeader: st.builds(
        UpdateHeader,
        assignment_id=ids,
        update_sha256=blob_ids,
        update_size=counts,
        sample_count=counts,
        metrics=st.dictionaries(metric_keys, finite, max_size=8).map(lambda d: {**d, "loss": 0.5}),
        timings=st.dictionaries(metric_keys, finite, max_size=8).map(
            lambda d: {**d, "train_s": 1.0}
        ),
        timestamp=timestamps,
        nonce=nonces,
        commitment=st.none() | st.builds(
            Commitment, every=st.integers(1, 1 << 20), steps=st.integers(0, 1 << 20),
            precision=st.sampled_from(["fp32", "tf32", "bf16", "fp16"]),
            hashes=st.lists(blob_ids, max_size=40).map(tuple), norms=st.lists(pos_floats, max_size=40).map(tuple)),
        offset=counts,
    ),
    Ack: st.builds(Ack, ok=st.booleans(), detail=texts, deadline=timestamps),
    StateRequest: st.builds(
        StateRequest, request_id=ids, job_id=ids, round=st.integers(0, 2**31), assignment_id=ids,
        steps=st.lists(st.integers(0, 1 << 40), max_size=8).map(tuple), deadline=timestamps),
    StateUpload: st.builds(
        StateUpload, request_id=ids, step=st.integers(0, 1 << 40), state_sha256=blob_ids, state_size=counts,
        timestamp=timestamps, nonce=nonces),
    StateUnavailable: st.builds(
        StateUnavailable, request_id=ids, steps=st.lists(st.integers(0, 1 << 40), max_size=8).map(tuple),
        reason=texts, timestamp=timestamps, nonce=nonces),
    UploadOffset: st.builds(UploadOffset, assignment_id=ids, update_sha256=blob_ids, offset=counts),
    SiloQuery: st.builds(SiloQuery, job_id=ids, timestamp=timestamps, nonce=nonces),
    SiloSchema: st.builds(SiloSchema, job_id=ids, model_spec=model_specs,
                          min_samples=counts, max_samples=counts, label_column=st.text(max_size=64),
                          label_histogram=st.booleans(), attached=st.just("") | blob_ids),
    SiloRegistration: st.builds(SiloRegistration, job_id=ids, sha256=blob_ids, size=counts, samples=counts,
                                timestamp=timestamps, nonce=nonces,
                                label_histogram=st.lists(counts, max_size=20).map(tuple)),
    SiloWithdrawal: st.builds(SiloWithdrawal, job_id=ids, sha256=blob_ids, timestamp=timestamps, nonce=nonces),
    SecAggKeys: st.builds(SecAggKeys, assignment_id=ids, c_pk=keys32, s_pk=keys32, timestamp=timestamps,
                          nonce=nonces),
    SecAggPoll: st.builds(SecAggPoll, assignment_id=ids, timestamp=timestamps, nonce=nonces,
                          after=st.sampled_from(("", *SECAGG_PHASES)), wait_s=st.floats(0.0, 60.0)),
    SecAggState: st.builds(
        SecAggState, assignment_id=ids, phase=st.sampled_from(SECAGG_PHASES),
        roster=st.lists(st.builds(RosterMember, node_id=ids, c_pk=keys32, s_pk=keys32), max_size=5).map(tuple),
        threshold=st.integers(0, 4096), survivors=st.lists(ids, max_size=5).map(tuple), inbox=sealeds,
        alive=st.lists(ids, max_size=5).map(tuple), dropped=st.lists(ids, max_size=5).map(tuple), detail=texts),
    SecAggShares: st.builds(SecAggShares, assignment_id=ids, shares=sealeds, timestamp=timestamps, nonce=nonces),
    SecAggMasked: st.builds(SecAggMasked, assignment_id=ids, sha256=blob_ids, size=counts, sample_count=counts,
                            loss=st.floats(0.0, 1e12), train_s=st.floats(0.0, 1e9), timestamp=timestamps,
                            nonce=nonces),
    SecAggUnmask: st.builds(SecAggUnmask, assignment_id=ids, shares=st.lists(st.builds(
        UnmaskShare, node_id=ids, kind=st.sampled_from(["b", "s"]), share=st.binary(min_size=1, max_size=1024)),
        max_size=5).map(tuple), timestamp=timestamps, nonce=nonces),
    RelayHeader: st.builds(RelayHeader, job_id=ids, step=st.integers(0, 1 << 40), micro_batch=st.integers(0, 1 << 16),
                           carries=st.sampled_from(RELAY_KINDS), stage=st.integers(0, 1 << 10),
                           to_stage=st.integers(0, 1 << 10), sha256=blob_ids, size=counts, timestamp=timestamps,
                           nonce=nonces),
    RelayTake: st.builds(RelayTake, job_id=ids, step=st.integers(0, 1 << 40), micro_batch=st.integers(0, 1 << 16),
                         carries=st.sampled_from(RELAY_KINDS), stage=st.integers(0, 1 << 10),
                         to_stage=st.integers(0, 1 << 10), wait_s=st.floats(0.0, 60.0), timestamp=timestamps,
                         nonce=nonces, generation=st.integers(0, 1 << 31)),
    StageAssignment: st.builds(
        StageAssignment, job_id=ids, generation=st.integers(1, 1 << 31), node_id=ids, stage=st.integers(0, 1 << 10),
        unit_start=st.integers(0, 1 << 16), unit_end=st.integers(1, 1 << 16),
        stage_nodes=st.lists(ids, max_size=4).map(tuple), stage_keys=st.lists(keys32, max_size=4).map(tuple),
        stage_starts=st.lists(st.integers(0, 1 << 16), max_size=4).map(tuple), model_spec=model_specs,
        model_hash=blob_ids, model_size=counts,
        unit_states=st.lists(st.builds(UnitState, unit=st.integers(0, 1 << 16), sha256=blob_ids, size=counts),
                             max_size=4).map(tuple),
        chunks=st.lists(st.builds(ChunkRef, sha256=blob_ids, size=counts, samples=counts), max_size=3).map(tuple),
        train=train_configs, seed=counts, batch_size=st.integers(1, 1 << 24), micro_batches=st.integers(1, 1 << 16),
        schedule=st.sampled_from(PIPELINE_SCHEDULES), first_step=st.integers(0, 1 << 40),
        end_step=st.integers(1, 1 << 40), checkpoint_every=st.integers(1, 1 << 30), issued_at=timestamps,
        boundary=st.sampled_from(BOUNDARIES), boundary_rank=st.integers(0, 1 << 16)),
    UnitCheckpoint: st.builds(
        UnitCheckpoint, job_id=ids, generation=st.integers(1, 1 << 31), stage=st.integers(0, 1 << 10),
        unit=st.integers(0, 1 << 16), step=st.integers(1, 1 << 40), sha256=blob_ids, size=counts,
        timestamp=timestamps, nonce=nonces),
    LinkProbe: st.builds(
        LinkProbe, sha256=blob_ids, size=st.integers(1, MAX_LINK_PROBE_BYTES), timestamp=timestamps, nonce=nonces),
    StageReport: st.builds(
        StageReport, job_id=ids, generation=st.integers(1, 1 << 31), stage=st.integers(0, 1 << 10),
        steps_done=st.integers(0, 1 << 40), step_s=st.floats(0.0, 1e6), compute_s=st.floats(0.0, 1e6),
        loss=st.none() | st.floats(0.0, 1e6), failed=texts, timestamp=timestamps, nonce=nonces),
}


def test_every_message_type_has_a_strategy() -> None:
    assert set(MESSAGES) == set(MESSAGE_TYPES)


@pytest.mark.parametrize("cls", list(MESSAGES), ids=lambda c: c.KIND)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_round_trip(cls: type, data: st.DataObject) -> None:
    msg = data.draw(MESSAGES[cls])
    wire = encode_message(msg)
    assert decode_message(wire, cls) == msg
    assert peek_kind(wire) == cls.KIND
    # encoding is deterministic
    assert encode_message(decode_message(wire, cls)) == wire


# ---------------------------------------------------------------------------
# Fixed examples and hand-made hostile maps.


def _hb() -> Heartbeat:
    return Heartbeat(assignment_id="a-1", progress=0.5, timestamp=1000.0, nonce=b"n" * 16)


def _raw(**over: object) -> bytes:
    wire = msgpack.unpackb(encode_message(_hb()), raw=False)
    for key, value in over.items():
        if value is _DELETE:
            del wire[key]
        else:
            wire[key] = value
    return msgpack.packb(wire, use_bin_type=True)


_DELETE = object()


def _fails(data: bytes, cls: type = Heartbeat, exc: type[Exception] = DecodeError) -> str:
    with pytest.raises(exc) as info:
        decode_message(data, cls)
    text = str(info.value)
    assert "\n" not in text
    return text


def test_unknown_field_named() -> None:
    assert "surprise" in _fails(_raw(surprise=1))


def test_missing_field_named() -> None:
    assert "progress" in _fails(_raw(progress=_DELETE))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("progress", "half"),
        ("progress", True),
        ("progress", 1.5),
        ("progress", -0.1),
        ("timestamp", None),
        ("nonce", "x" * 16),
        ("nonce", b"short"),
        ("assignment_id", "has space"),
        ("assignment_id", "x" * 65),
        ("assignment_id", ""),
        ("assignment_id", 7),
    ],
)
def test_wrong_type_or_range_named(field: str, value: object) -> None:
    assert field in _fails(_raw(**{field: value}))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_float_refused(bad: float) -> None:
    assert "finite" in _fails(_raw(progress=bad))


def test_bool_is_not_an_int() -> None:
    good = Welcome(node_id="n", hub_fingerprint="h", server_time=1.0, poll_s=1.0)
    raw = msgpack.unpackb(encode_message(good), raw=False)
    raw["poll_s"] = True
    assert "poll_s" in _fails(msgpack.packb(raw), Welcome)
    a = msgpack.unpackb(encode_message(_assignment()), raw=False)
    a["seed"] = True
    assert "seed" in _fails(msgpack.packb(a), Assignment)


def test_int_bounds() -> None:
    a = msgpack.unpackb(encode_message(_assignment()), raw=False)
    a["seed"] = -1
    assert "seed" in _fails(msgpack.packb(a), Assignment)
    a["seed"] = 2**64 - 1
    assert "seed" in _fails(msgpack.packb(a), Assignment)


def test_trailing_bytes_refused() -> None:
    assert "trailing" in _fails(encode_message(_hb()) + b"\x00")


def test_wrong_kind_refused() -> None:
    text = _fails(encode_message(_hb()), Abandon)
    assert "abandon" in text and "heartbeat" in text


def test_unknown_kind_refused() -> None:
    assert "unknown kind" in _fails(_raw(kind="nope"))


def test_version_mismatch_names_both() -> None:
    text = _fails(_raw(v=PROTOCOL_VERSION + 1), exc=VersionError)
    assert str(PROTOCOL_VERSION) in text and str(PROTOCOL_VERSION + 1) in text


def test_missing_version_refused() -> None:
    _fails(_raw(v=_DELETE))
    _fails(_raw(v="1"))


def test_not_a_map_refused() -> None:
    _fails(msgpack.packb([1, 2, 3]))
    _fails(b"")
    _fails(b"\xc1")


def test_over_long_string_refused() -> None:
    raw = msgpack.unpackb(encode_message(Abandon("a", "r", 1.0, b"n" * 16)), raw=False)
    raw["reason"] = "x" * 257
    assert "reason" in _fails(msgpack.packb(raw), Abandon)
    raw["reason"] = "x" * 100_000  # over the unpacker's byte limit
    _fails(msgpack.packb(raw), Abandon)


def test_over_long_list_refused() -> None:
    msg = WorkRequest(1.0, b"n" * 16, 1.0, ())
    raw = msgpack.unpackb(encode_message(msg), raw=False)
    raw["cached_chunks"] = ["0" * 64] * 4097
    _fails(msgpack.packb(raw), WorkRequest)


def test_too_many_metrics_refused() -> None:
    msg = _update()
    raw = msgpack.unpackb(encode_message(msg), raw=False)
    raw["metrics"] = {f"m{i}": 1.0 for i in range(33)} | {"loss": 1.0}
    assert "metrics" in _fails(msgpack.packb(raw), UpdateHeader)
    raw["metrics"] = {"acc": 1.0}
    assert "loss" in _fails(msgpack.packb(raw), UpdateHeader)


def test_nested_too_deep_refused() -> None:
    raw = msgpack.unpackb(encode_message(_assignment()), raw=False)
    deep: object = 1
    for _ in range(20):
        deep = [deep]
    raw["model_spec"]["extra"] = deep
    assert "model_spec" in _fails(msgpack.packb(raw), Assignment)


def test_model_spec_validated_on_decode() -> None:
    raw = msgpack.unpackb(encode_message(_assignment()), raw=False)
    raw["model_spec"]["activation"] = "exec"
    text = _fails(msgpack.packb(raw), Assignment)
    assert "model_spec" in text and "activation" in text


def test_ext_types_and_bytes_keys_refused() -> None:
    raw = msgpack.unpackb(encode_message(_hb()), raw=False)
    raw["progress"] = msgpack.ExtType(5, b"x")
    _fails(msgpack.packb(raw))
    raw = msgpack.unpackb(encode_message(_hb()), raw=False)
    raw[b"kind"] = 1
    _fails(msgpack.packb(raw, use_bin_type=True))


def test_nested_unknown_field_named() -> None:
    raw = msgpack.unpackb(encode_message(_assignment()), raw=False)
    raw["train"]["schedule"] = "cosine"
    assert "schedule" in _fails(msgpack.packb(raw), Assignment)


def test_encode_refuses_bad_values() -> None:
    with pytest.raises(EncodeError, match="progress"):
        encode_message(dataclasses.replace(_hb(), progress=2.0))
    with pytest.raises(EncodeError, match="nonce"):
        encode_message(dataclasses.replace(_hb(), nonce=b"x"))
    with pytest.raises(EncodeError):
        encode_message(DeviceInfo("cpu", "x", 1, 1))  # nested type, not a message


def test_encode_accepts_lists_and_ints() -> None:
    msg = WorkRequest(timestamp=5, nonce=b"n" * 16, wait_s=1, cached_chunks=["a" * 64])  # type: ignore[arg-type]
    back = decode_message(encode_message(msg), WorkRequest)
    assert back.cached_chunks == ("a" * 64,) and isinstance(back.timestamp, float)


def test_decode_accepts_memoryview_and_bytearray() -> None:
    wire = encode_message(_hb())
    assert decode_message(memoryview(wire), Heartbeat) == _hb()
    assert decode_message(bytearray(wire), Heartbeat) == _hb()


def test_decode_refuses_non_bytes() -> None:
    with pytest.raises(ProtocolError):
        decode_message("text", Heartbeat)  # type: ignore[arg-type]


def _assignment() -> Assignment:
    spec = ModelSpec.from_dict({"kind": "mlp", "input": 64, "hidden": [128], "outputs": 10})
    return Assignment(
        assignment_id="as-1",
        job_id="job-1",
        round=3,
        node_id="gf1-aaaa-bbbb-cccc-dddd-eeee",
        model_hash="0" * 64,
        model_size=1234,
        model_spec=spec.to_dict(),
        chunks=(ChunkRef("1" * 64, 100, 64),),
        seed=7,
        train=TrainConfig(1, 32, "sgd", 0.05, 0.0, 0.0, 0.9, 0.999, "cross_entropy", 0.0),
        issued_at=1000.0,
        deadline=1030.0,
        replica_group="",
    )


def _update() -> UpdateHeader:
    return UpdateHeader(
        "as-1", "f" * 64, 10, 64, {"loss": 0.5}, {"train_s": 1.0}, 1000.0, b"n" * 16
    )


def test_check_protocol_version() -> None:
    from gpuflex.protocol import check_protocol_version

    check_protocol_version(PROTOCOL_VERSION)
    with pytest.raises(VersionError) as info:
        check_protocol_version(PROTOCOL_VERSION + 1, peer="node")
    assert f"node speaks protocol version {PROTOCOL_VERSION + 1}" in str(info.value)
    assert f"this software speaks {PROTOCOL_VERSION}" in str(info.value)
    with pytest.raises(VersionError):
        check_protocol_version(True)  # type: ignore[arg-type]


def test_unencodable_text_is_an_encode_error() -> None:
    with pytest.raises(EncodeError):
        encode_message(Abandon("a", "bad \udc80 surrogate", 1.0, b"n" * 16))


def test_compute_class_and_precision_fields_are_checked_where_they_travel() -> None:
    """Hello.compute and TrainConfig.precision: strict like every field, named in the error."""
    cc = ComputeClass("cpu", "x", "", "AuthenticAMD", ("avx2",), "2.13.0", "", "", True, 1, ("fp32", "bf16"))
    hello = Hello("0.1", PROTOCOL_VERSION, DeviceInfo("cpu", "x", 1, 1),
                  Benchmark(1.0, 0.1, None, None, 1.0, None, None, "m", {"fp32": 1.0}), 1.0, b"n" * 16, cc)
    raw = msgpack.unpackb(encode_message(hello), raw=False)
    assert decode_message(msgpack.packb(raw), Hello).compute == cc
    for path, value, expect in (
        (("compute", "precisions"), ["fp32", "int4"], "hello.compute: precisions: [1]: expected one of"),
        (("compute", "threads"), True, "hello.compute: threads: expected an integer"),
        (("compute", "isa"), ["avx2"] * 65, "hello.compute: isa: list longer than 64"),
        (("benchmark", "precision_sps"), {"fp32": math.inf}, "hello.benchmark: precision_sps"),
    ):
        bad = msgpack.unpackb(encode_message(hello), raw=False)
        bad[path[0]][path[1]] = value
        assert _fails(msgpack.packb(bad), Hello).startswith(expect)
    missing = msgpack.unpackb(encode_message(hello), raw=False)
    del missing["compute"]
    # a field added with a default may be left out (messages._optional): a hello without a class
    # is the unknown class, which never forms a class of its own (protocol/compute.py)
    assert decode_message(msgpack.packb(missing), Hello).compute == UNKNOWN_CLASS
    assert "compute" not in msgpack.unpackb(encode_message(dataclasses.replace(hello, compute=UNKNOWN_CLASS)), raw=False)
    a = msgpack.unpackb(encode_message(_assignment()), raw=False)
    a["train"]["precision"] = "fp8"
    assert "train: precision: expected one of fp32, tf32, bf16, fp16" in _fails(msgpack.packb(a), Assignment)
