"""The GFT1 tensor codec: round-trips, zero-copy decode, header validation."""

from __future__ import annotations

import struct
import warnings
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from gpuflex.protocol import (
    DecodeError,
    ProtocolError,
    StateEncoder,
    TensorError,
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
from gpuflex.protocol.tensors import ALIGN, DTYPES, MAX_TENSORS, PREFIX
from hypothesis import given, settings
from hypothesis import strategies as st

torch.set_num_threads(1)

NAMES = st.text(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:/-", min_size=1, max_size=40
)
SHAPES = st.lists(st.integers(0, 5), max_size=4).map(tuple)


def _tensor(dtype_name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dtype = DTYPES[dtype_name]
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(2**62)), min(info.max, 2**62)
    return torch.randint(low, high, shape, generator=g, dtype=dtype)


states = st.dictionaries(
    NAMES,
    st.tuples(st.sampled_from(sorted(DTYPES)), SHAPES, st.integers(0, 2**31)),
    max_size=6,
).map(lambda d: {k: _tensor(*v) for k, v in d.items()})


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name


@settings(max_examples=150, deadline=None)
@given(states)
def test_round_trip(state: dict[str, torch.Tensor]) -> None:
    blob = encode_state(state)
    assert isinstance(blob, bytes)
    _same(decode_state(blob), state)
    _same(decode_state(bytearray(blob)), state)
    _same(decode_state(memoryview(blob)), state)
    assert [i.spec for i in read_header(blob)] == list(manifest_of(state))
    for info in read_header(blob):
        assert info.offset % ALIGN == 0
    assert encode_state(decode_state(blob)) == blob  # deterministic


@settings(max_examples=60, deadline=None)
@given(st.lists(states, min_size=1, max_size=4))
def test_reusing_encoder_gives_the_same_bytes(sequence: list[dict[str, torch.Tensor]]) -> None:
    """A StateEncoder's output equals encode_state's, however earlier encodes left its buffer."""
    encoder = StateEncoder()
    for state in sequence:
        view = encoder.encode(state)
        assert bytes(view) == encode_state(state)
        _same(decode_state(view), state)
    assert encoder.capacity >= max(len(encode_state(s)) for s in sequence)


def test_encoder_keeps_earlier_views_when_it_grows() -> None:
    encoder = StateEncoder()
    small = {"a": torch.arange(4, dtype=torch.float32)}
    first = encoder.encode(small)
    decoded = decode_state(first)
    encoder.encode({"big": torch.ones(1000)})  # grows: a new buffer, the old one untouched
    assert torch.equal(decoded["a"], small["a"])
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    strided = {"t": base.t(), "s": base[:, ::2], "w": torch.nn.Parameter(torch.ones(3))}
    assert bytes(encoder.encode(strided)) == encode_state(strided)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (7,), (3, 5, 2), (1, 1, 1, 1, 1)])
def test_every_dtype_and_odd_shapes(dtype: str, shape: tuple[int, ...]) -> None:
    state = {"t": _tensor(dtype, shape, 1), "u": _tensor(dtype, (3,), 2)}
    _same(decode_state(encode_state(state)), state)


def test_bf16_bits_preserved() -> None:
    t = torch.tensor([1.0, -2.5, float("inf"), 3.0e38], dtype=torch.bfloat16)
    back = decode_state(encode_state({"b": t}))["b"]
    assert torch.equal(back.view(torch.int16), t.view(torch.int16))


def test_non_contiguous_and_grad_inputs() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    w = torch.nn.Parameter(torch.ones(3))
    state = {"t": base.t(), "s": base[:, ::2], "w": w}
    back = decode_state(encode_state(state))
    assert torch.equal(back["t"], base.t()) and torch.equal(back["s"], base[:, ::2])
    assert not back["w"].requires_grad


def test_decode_is_zero_copy_and_silent() -> None:
    state = {"a": torch.randn(1000), "b": torch.arange(10, dtype=torch.int64)}
    blob = encode_state(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = decode_state(blob)
    base = np.frombuffer(blob, dtype=np.uint8).ctypes.data
    for t in out.values():
        assert base <= t.data_ptr() < base + len(blob)
    # a writable buffer shows writes through the view
    buf = bytearray(blob)
    view = decode_state(buf)["a"]
    view[0] = 42.0
    assert decode_state(buf)["a"][0] == 42.0


def test_decoded_state_exports_to_safetensors() -> None:
    state = {
        "w": torch.randn(4, 3),
        "b": torch.zeros(3, dtype=torch.bfloat16),
        "n": torch.tensor(5),
    }
    back = state_from_safetensors(state_to_safetensors(decode_state(encode_state(state))))
    assert set(back) == set(state)
    for k in state:
        assert torch.equal(back[k], state[k])


def test_safetensors_refuses_garbage() -> None:
    with pytest.raises(DecodeError):
        state_from_safetensors(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")


def test_load_state_file_uses_mmap(tmp_path: Path) -> None:
    state = {"w": torch.randn(64, 64)}
    path = tmp_path / "model.gft"
    path.write_bytes(encode_state(state))
    _same(load_state_file(path), state)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    with pytest.raises(DecodeError):
        load_state_file(empty)


def test_unsupported_inputs_refused() -> None:
    with pytest.raises(TensorError, match="dtype"):
        encode_state({"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(TensorError, match="name"):
        encode_state({"bad name": torch.zeros(2)})
    with pytest.raises(TensorError):
        encode_state({"x": [1, 2]})  # type: ignore[dict-item]
    with pytest.raises(TensorError):
        encode_state({"s": torch.zeros(3).to_sparse()})


# ---------------------------------------------------------------------------
# Hostile headers, crafted by hand.


def _blob(
    entries: list[object], data: bytes, *, data_bytes: int | None = None, header: object = None
) -> bytes:
    head = msgpack.packb(
        header
        if header is not None
        else {"tensors": entries, "data_bytes": len(data) if data_bytes is None else data_bytes},
        use_bin_type=True,
    )
    start = (PREFIX.size + len(head) + ALIGN - 1) // ALIGN * ALIGN
    return (
        PREFIX.pack(b"GFT1", 1, 0, len(head), 0)
        + head
        + bytes(start - PREFIX.size - len(head))
        + data
    )


def _refused(blob: bytes, match: str | None = None) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_state(blob)
    with pytest.raises(ProtocolError, match=match):
        read_header(blob)


def test_handmade_blob_decodes() -> None:
    blob = _blob([["x", "float32", [2], 0, 8]], struct.pack("<2f", 1.0, 2.0))
    assert decode_state(blob)["x"].tolist() == [1.0, 2.0]


@pytest.mark.parametrize(
    ("entries", "data", "match"),
    [
        ([["x", "float32", [2], 4, 8]], bytes(12), "aligned"),
        ([["x", "float32", [3], 0, 8]], bytes(8), "does not match shape"),
        ([["x", "float32", [2], 0, 16]], bytes(8), "outside"),
        ([["x", "complex64", [1], 0, 8]], bytes(8), "not allowed"),
        ([["x", "float32", [2], 0, 8], ["x", "float32", [2], 64, 8]], bytes(72), "twice"),
        ([["x", "float32", [32], 0, 128], ["y", "float32", [2], 64, 8]], bytes(128), "overlaps"),
        ([["bad name", "float32", [2], 0, 8]], bytes(8), "name"),
        ([["x", "float32", [-1], 0, 0]], b"", "shape"),
        ([["x", "float32", [True], 0, 4]], bytes(4), "shape"),
        ([["x", "float32", [2], 0]], bytes(8), "entry"),
        ([["x", "float32", [1] * 17, 0, 4]], bytes(4), "dimensions|shape"),
    ],
)
def test_bad_header_entries_refused(entries: list[object], data: bytes, match: str) -> None:
    _refused(_blob(entries, data), match)


def test_bool_data_must_be_0_or_1() -> None:
    blob = _blob([["x", "bool", [2], 0, 2]], b"\x00\x07")
    read_header(blob)  # the header alone is fine; the data is checked on decode
    with pytest.raises(TensorError, match="0/1"):
        decode_state(blob)


def test_bad_framing_refused() -> None:
    good = _blob([["x", "float32", [2], 0, 8]], bytes(8))
    _refused(good + b"\x00", "length")
    _refused(good[:-1], "length")
    _refused(b"GFT2" + good[4:], "magic")
    _refused(good[:4] + struct.pack("<H", 2) + good[6:], "version")
    _refused(good[:6] + struct.pack("<H", 1) + good[8:], "flags")
    _refused(good[:8] + struct.pack("<I", 1 << 30) + good[12:], "header")
    _refused(good[:10], "shorter")
    _refused(_blob([], b"", header=[1, 2]), "header")
    _refused(_blob([], b"", header={"tensors": [], "data_bytes": -1}), "data_bytes")
    _refused(_blob([], b"", header={"tensors": {}, "data_bytes": 0}), "tensors")
    padded = bytearray(good)
    padded[
        PREFIX.size
        + len(msgpack.packb({"tensors": [["x", "float32", [2], 0, 8]], "data_bytes": 8}))
    ] = 1
    _refused(bytes(padded), "padding")


def test_limits() -> None:
    blob = encode_state({"x": torch.zeros(100)})
    with pytest.raises(TensorError, match="limit"):
        decode_state(blob, max_total_bytes=len(blob) - 1)
    entries = [[f"t{i}", "uint8", [0], 0, 0] for i in range(MAX_TENSORS + 1)]
    _refused(_blob(entries, b""))
    with pytest.raises(ProtocolError):
        decode_state("not bytes")  # type: ignore[arg-type]


def test_empty_state() -> None:
    assert decode_state(encode_state({})) == {}


# ---------------------------------------------------------------------------
# Manifests and finiteness.


def test_check_manifest_names_the_tensor() -> None:
    state = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
    manifest = manifest_of(state)
    check_manifest(state, manifest)
    check_manifest(encode_state(state), manifest)
    with pytest.raises(TensorError, match="'b' is missing"):
        check_manifest({"w": state["w"]}, manifest)
    with pytest.raises(TensorError, match="'extra'"):
        check_manifest({**state, "extra": torch.zeros(1)}, manifest)
    with pytest.raises(TensorError, match="'w' has shape"):
        check_manifest(encode_state({"w": torch.zeros(3, 2), "b": state["b"]}), manifest)
    with pytest.raises(TensorError, match="'b' has dtype"):
        check_manifest({"w": state["w"], "b": torch.zeros(3, dtype=torch.float64)}, manifest)
    assert manifest[0] == TensorSpec("w", "float32", (2, 3))


def test_check_finite_names_the_tensor() -> None:
    check_finite({"a": torch.ones(3), "i": torch.tensor([1, 2]), "e": torch.zeros(0)})
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(TensorError, match="'b'"):
            check_finite({"a": torch.ones(3), "b": torch.tensor([0.0, bad], dtype=torch.bfloat16)})


def _first_nonfinite(state: dict[str, torch.Tensor]) -> str | None:
    """What check_finite says of a state: the tensor it names, or None."""
    try:
        check_finite(state)
    except TensorError as exc:
        return next(name for name in state if repr(name) in str(exc))
    return None


@settings(max_examples=200, deadline=None)
@given(states, st.data())
def test_check_blob_agrees_with_decode_and_check_finite(state: dict[str, torch.Tensor], data: st.DataObject) -> None:
    """check_blob reads the bytes in place (numpy, bfloat16 by its bits); what it finds must be what
    decode_state + check_finite find on the same bytes, for every dtype, NaN and +-inf anywhere."""
    for name, t in state.items():
        if t.is_floating_point() and t.numel() and data.draw(st.booleans(), label=f"spoil {name}"):
            flat = t.view(-1)
            flat[data.draw(st.integers(0, flat.numel() - 1))] = data.draw(
                st.sampled_from([float("nan"), float("inf"), -float("inf")]))
    blob = encode_state(state)
    assert check_blob(blob, manifest_of(state)) == _first_nonfinite(decode_state(blob))


def test_check_blob_refuses_what_decode_and_check_manifest_refuse() -> None:
    state = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
    blob = encode_state(state)
    assert check_blob(blob, manifest_of(state)) is None
    assert check_blob(memoryview(blob), manifest_of(state)) is None
    with pytest.raises(TensorError, match="'b' is missing"):
        check_blob(encode_state({"w": state["w"]}), manifest_of(state))
    with pytest.raises(TensorError, match="'w' has shape"):
        check_blob(encode_state({"w": torch.zeros(3, 2), "b": state["b"]}), manifest_of(state))
    with pytest.raises(TensorError, match="0/1"):  # as decode_state, before any finiteness
        check_blob(_blob([["x", "bool", [2], 0, 2]], b"\x00\x07"), (TensorSpec("x", "bool", (2,)),))
    with pytest.raises(DecodeError):
        check_blob(blob[:-1], manifest_of(state))


def test_a_header_seen_before_is_checked_once_and_each_blob_still_whole() -> None:
    """_header remembers a checked header (every update of a job carries the same one); what
    depends on the blob itself (its length, the padding, the data) is checked every time."""
    from gpuflex.protocol.tensors import _header

    a, b = encode_state({"w": torch.ones(3)}), encode_state({"w": torch.full((3,), 2.0)})
    _header.cache_clear()
    assert decode_state(a)["w"].tolist() == [1.0] * 3 and decode_state(b)["w"].tolist() == [2.0] * 3
    assert _header.cache_info().hits >= 1  # the second blob's header came from the cache
    with pytest.raises(DecodeError, match="does not match header"):
        decode_state(b + b"\x00")  # the same header, one byte too many
    with pytest.raises(DecodeError, match="does not match header"):
        decode_state(b[:-4])


def test_decode_calls_no_torch_operator_but_for_bfloat16() -> None:
    """decode_state views the data through numpy (protocol/tensors.py NUMPY_DTYPES): a torch operator
    releases the GIL, which a worker thread then waits to get back from a busy event loop. Under a
    dispatch mode a tensor made from numpy shows as aten.lift_fresh; anything else is an operator."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    state = {name: _tensor(name, (2, 3), 0) for name in DTYPES}
    blob = encode_state(state)
    with Ops() as ops:
        decoded = decode_state(blob)
    assert [op for op in ops.seen if op != "aten.lift_fresh.default"] == ["aten.view.default"]  # bfloat16's
    _same(decoded, state)


def test_blob_ids() -> None:
    h = sha256_hex(b"abc")
    assert is_blob_id(h) and h == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert not is_blob_id(h.upper()) and not is_blob_id(h[:-1]) and not is_blob_id(None)


@settings(max_examples=150, deadline=None)
@given(specs=st.lists(st.tuples(st.sampled_from(sorted(DTYPES)), st.lists(st.integers(0, 70), max_size=3)),
                      max_size=12),
       order=st.randoms(use_true_random=False))
def test_max_encoded_size_bounds_every_encoding_of_a_manifest_in_any_order(specs, order):
    """No encoder output for a manifest's tensors, whatever their order, is larger than
    max_encoded_size; and the bound is close (one alignment of the header and of each tensor)."""
    from gpuflex.protocol.tensors import manifest_of, max_encoded_size

    state = {f"layer{i}.w": torch.zeros(tuple(shape), dtype=DTYPES[dtype]) for i, (dtype, shape) in enumerate(specs)}
    bound = max_encoded_size(manifest_of(state))
    names = list(state)
    order.shuffle(names)
    size = len(encode_state({name: state[name] for name in names}))
    assert size <= bound <= size + ALIGN * (len(state) + 1) + 16 * len(state) + 16
