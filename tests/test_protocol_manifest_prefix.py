"""A streamed GFT1 blob's manifest is judged from its first bytes (prefix + header)."""

from __future__ import annotations

import pytest
import torch
from gpuflex.protocol.errors import DecodeError, ProtocolError, TensorError
from gpuflex.protocol.tensors import (
    check_manifest_prefix,
    encode_state,
    header_span,
    manifest_of,
    read_header,
    read_header_prefix,
)
from hypothesis import given, settings
from hypothesis import strategies as st

STATE = {"0.weight": torch.zeros(8, 4), "0.bias": torch.zeros(8), "2.weight": torch.zeros(3, 8)}


def test_prefix_reads_the_same_header_as_the_whole_blob():
    blob = encode_state(STATE)
    span = header_span(blob[:16])
    assert span < len(blob)
    assert read_header_prefix(blob[:span], len(blob)) == read_header(blob)
    check_manifest_prefix(blob[:span], len(blob), manifest_of(STATE))


def test_prefix_refusals_name_the_tensor():
    want = manifest_of(STATE)
    for state, words in (
        (STATE | {"extra": torch.zeros(2)}, ("'extra'", "not part of the model")),
        ({("0.w" if k == "0.weight" else k): v for k, v in STATE.items()}, ("'0.w'", "'0.weight'")),
        (STATE | {"0.bias": torch.zeros(9)}, ("'0.bias'", "shape")),
        (STATE | {"0.bias": torch.zeros(8, dtype=torch.float64)}, ("'0.bias'", "dtype")),
    ):
        blob = encode_state(state)
        with pytest.raises(TensorError) as info:
            check_manifest_prefix(blob[: header_span(blob)], len(blob), want)
        assert all(w in str(info.value) for w in words), str(info.value)


def test_prefix_length_rules():
    blob = encode_state(STATE)
    span = header_span(blob)
    with pytest.raises(DecodeError):
        header_span(b"GFT")
    with pytest.raises(DecodeError):
        header_span(b"NOPE" + blob[4:16])
    with pytest.raises(DecodeError):  # the header is not all there
        read_header_prefix(blob[: span - 1], len(blob))
    with pytest.raises(DecodeError):  # declared length disagrees with the header
        read_header_prefix(blob[:span], len(blob) + 64)
    with pytest.raises(DecodeError):  # more bytes than the declared blob
        read_header_prefix(blob, len(blob) - 1)


@settings(max_examples=300, deadline=None)
@given(cut=st.integers(0, 400), flip=st.integers(0, 399), bit=st.integers(1, 255), total=st.integers(0, 1 << 20))
def test_hostile_prefixes_raise_protocol_errors_only(cut, flip, bit, total):
    blob = bytearray(encode_state(STATE))
    i = flip % len(blob)
    blob[i] ^= bit
    prefix = bytes(blob[:cut])
    try:
        span = header_span(prefix)
        read_header_prefix(prefix[:span], total)
    except ProtocolError:
        pass
