"""The sparse download's step (hub/downlink.sparse_step): the fused float32 path publishes the
same model and keeps the same residual, bit for bit, as encoding the change with topk and
error feedback and decoding the wire (``_encode_decode``, the definition)."""

from __future__ import annotations

import math

import pytest
import torch
from gpuflex.hub.policy import downlink
from gpuflex.protocol.errors import TensorError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers: -0.0 and 0.0 differ, and so do NaN payloads."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(bits(a[k]), bits(b[k])), k


def both(old, new, fraction, residual):
    ref = downlink._encode_decode(old, new, fraction, residual)
    got = downlink.sparse_step(old, new, fraction, residual)
    same(got[0], ref[0])
    same(got[1], ref[1])
    return got


FEW = [0.0, -0.0, 1.0, -1.0, 0.25, -0.25, 3.0, 1e-30]
vals = st.one_of(st.sampled_from(FEW), st.floats(-1e6, 1e6, allow_nan=False, width=32))


def tensor(draw, shape):
    n = math.prod(shape)
    return torch.tensor(draw(st.lists(vals, min_size=n, max_size=n)), dtype=torch.float32).reshape(shape)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), fraction=st.floats(1e-3, 1.0),
       residual_kind=st.sampled_from(["none", "empty", "all", "some"]))
def test_the_fused_step_is_the_encoding_bit_for_bit(data, fraction, residual_kind) -> None:
    shapes = {"a.weight": (data.draw(st.integers(1, 9)), data.draw(st.integers(1, 9))),
              "a.bias": (data.draw(st.integers(0, 9)),), "b.weight": (data.draw(st.integers(1, 30)),)}
    old = {k: tensor(data.draw, s) for k, s in shapes.items()}
    old["bn.num_batches_tracked"] = torch.tensor(3)
    new = {k: tensor(data.draw, s) for k, s in shapes.items()}
    new["bn.num_batches_tracked"] = torch.tensor(4)
    if data.draw(st.booleans()):  # many unchanged elements: ties at zero, signed zeros kept
        for k in shapes:
            new[k] = torch.where(torch.rand(new[k].shape) < 0.7, old[k], new[k])
    residual = {"none": None, "empty": {}, "all": {k: tensor(data.draw, s) for k, s in shapes.items()},
                "some": {"b.weight": tensor(data.draw, shapes["b.weight"])}}[residual_kind]
    published, _ = both(old, new, fraction, residual)
    assert torch.equal(published["bn.num_batches_tracked"], torch.tensor(4))


@pytest.mark.parametrize("fraction", [0.01, 0.02, 0.5])
def test_a_model_sized_step(fraction: float, monkeypatch) -> None:
    g = torch.Generator().manual_seed(5)
    old = {"w1": torch.randn(700, 1024, generator=g), "b1": torch.zeros(700), "w2": torch.randn(10, 700, generator=g),
           "b2": -torch.zeros(10)}
    new = {k: v + torch.randn(v.shape, generator=g) * 1e-3 for k, v in old.items()}
    new["b2"] = old["b2"].clone()  # unchanged: -0.0 stays as the decoded zeros leave it
    residual = {k: torch.randn(v.shape, generator=g) * 1e-4 for k, v in old.items()}
    published, kept = both(old, new, fraction, residual)
    # and the fused path did it (the definition is not called)
    monkeypatch.setattr(downlink, "_encode_decode", lambda *a: pytest.fail("took the slow path"))
    again = downlink.sparse_step(old, new, fraction, residual)
    same(again[0], published)
    same(again[1], kept)


def test_other_dtypes_take_the_encoding() -> None:
    old = {"w": torch.randn(50, dtype=torch.float16), "v": torch.randn(20)}
    new = {"w": torch.randn(50, dtype=torch.float16), "v": torch.randn(20)}
    both(old, new, 0.1, None)
    both(old, {"w": new["w"].double(), "v": new["v"]}, 0.1, None)
    both({"n": torch.tensor(1)}, {"n": torch.tensor(2)}, 0.1, None)  # nothing floating


def test_what_the_encoding_refuses_is_refused() -> None:
    old = {"w": torch.zeros(100)}
    new = {"w": torch.zeros(100)}
    new["w"][7] = math.inf
    for step in (downlink.sparse_step, downlink._encode_decode):
        with pytest.raises(TensorError, match="'topk:value' contains NaN or infinite values"):
            step(old, new, 0.05, None)
        with pytest.raises(TensorError, match="residual of shape"):
            step(old, old, 0.05, {"w": torch.zeros(99)})
