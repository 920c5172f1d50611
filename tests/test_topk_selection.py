"""topk's selection (protocol/encoding._top_positions): the faster selection through a sampled
threshold keeps exactly the positions the top-k over the whole input kept (the k largest |x|,
ties at the cut to the lowest positions), so a node, the hub and the referee agree on every code
whichever build encodes."""

from __future__ import annotations

import math

import pytest
import torch
from gpuflex.protocol.encoding import UpdateEncoding, _top_positions, _top_positions_sampled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def reference(flat: torch.Tensor, k: int) -> torch.Tensor:
    """The selection as it was defined before the sampled threshold (a top-k over everything)."""
    if k == 0:
        return torch.zeros(0, dtype=torch.int64)
    mag = flat.abs()
    cut = torch.topk(mag, k, sorted=False).values.min()
    above = torch.nonzero(mag > cut).reshape(-1)
    at = torch.nonzero(mag == cut).reshape(-1)[: k - above.numel()]
    return torch.cat([above, at]).sort().values


FEW = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, math.inf, -math.inf, 1e-30, 3.4e38]
values = st.one_of(
    st.sampled_from(FEW),  # ties everywhere, signed zeros, infinities
    st.floats(allow_nan=False, width=32),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(xs=st.lists(values, min_size=1, max_size=300), data=st.data())
def test_the_sampled_selection_keeps_exactly_what_topk_kept(xs: list[float], data: st.DataObject) -> None:
    flat = torch.tensor(xs, dtype=torch.float32)
    n = flat.numel()
    k = data.draw(st.integers(1, n), label="k")
    samples = data.draw(st.integers(1, n + 3), label="samples")
    want = reference(flat, k)
    got = _top_positions_sampled(flat, k, samples)
    if got is not None:  # None: it could not tell, and _top_positions selects the slow way
        assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(_top_positions(flat, k), want)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 20_000), fraction=st.floats(1e-4, 1.0),
       kind=st.sampled_from(["randn", "few", "sparse", "zeros", "blocks"]), samples=st.integers(1, 4096))
def test_the_sampled_selection_on_larger_inputs(seed: int, n: int, fraction: float, kind: str, samples: int) -> None:
    flat = _input(kind, n, seed)
    k = min(n, max(1, math.ceil(fraction * n)))
    got = _top_positions_sampled(flat, k, samples)
    want = reference(flat, k)
    if got is not None:
        assert torch.equal(got, want)
    assert torch.equal(_top_positions(flat, k), want)


def _input(kind: str, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "randn":
        return torch.randn(n, generator=g) * 1e-3
    if kind == "few":  # a handful of magnitudes: ties at every cut
        return torch.randint(-3, 4, (n,), generator=g).float() * 0.25
    if kind == "sparse":  # mostly zeros: the cut falls among the zeros
        return torch.where(torch.rand(n, generator=g) < 0.01, torch.randn(n, generator=g), torch.zeros(n))
    if kind == "zeros":
        return torch.zeros(n) * (-1.0 if seed % 2 else 1.0)  # -0.0 too
    # large values bunched in one stretch: a strided sample misjudges the threshold
    x = torch.randn(n, generator=g) * 1e-6
    x[n // 3 : n // 3 + max(1, n // 50)] *= 1e6
    return x


@pytest.mark.parametrize("kind", ["randn", "few", "sparse", "zeros", "blocks"])
@pytest.mark.parametrize("fraction", [0.01, 0.02, 0.3])
def test_a_model_sized_input_takes_the_fast_path_and_keeps_the_same_positions(kind: str, fraction: float) -> None:
    n = 1_000_003
    flat = _input(kind, n, 7)
    k = math.ceil(fraction * n)
    want = reference(flat, k)
    assert torch.equal(_top_positions(flat, k), want)
    if kind != "blocks":
        assert _top_positions_sampled(flat, k, 1 << 16) is not None  # the fast path did the work


def test_nan_falls_back_to_the_old_order() -> None:
    flat = torch.randn(100_000, generator=torch.Generator().manual_seed(3))
    flat[[5, 777, 90_000]] = math.nan
    assert _top_positions_sampled(flat, 1000, 1 << 16) is None
    assert torch.equal(_top_positions(flat, 1000), reference(flat, 1000))


def test_the_encoded_update_is_the_same_bytes() -> None:
    g = torch.Generator().manual_seed(11)
    delta = {"a.weight": torch.randn(300, 700, generator=g) * 1e-3, "a.bias": torch.zeros(300),
             "b.weight": torch.randn(10, 300, generator=g)}
    enc = UpdateEncoding("topk", 0.01, error_feedback=True)
    wire = enc.encode(delta).wire
    flat = torch.cat([t.reshape(-1) for t in delta.values()])
    idx = reference(flat, enc.kept(flat.numel()))
    assert torch.equal(wire["topk:index"], idx.to(torch.int32))
    assert torch.equal(wire["topk:value"], flat[idx])
