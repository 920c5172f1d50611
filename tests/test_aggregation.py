"""Aggregation rules and server optimizers: properties, limits, purity."""

from __future__ import annotations

import contextlib
import copy
import mmap
import os

import pytest
import torch
from gpuflex.hub.policy.aggregation import (
    METHODS,
    AggregationError,
    aggregate,
    aggregate_detailed,
    clip_factors,
    coordinate_median,
    fedavg,
    krum_select,
    readonly_mapping,
    trimmed_mean,
    update_norm,
)
from gpuflex.hub.policy.server_optimizer import ServerOptimizer
from gpuflex.protocol.jobspec import AggregationSpec
from hypothesis import given, settings
from hypothesis import strategies as st

torch.set_num_threads(1)


def spec(method="fedavg", **kw):
    base = dict(method=method, trim_beta=0.2, krum_f=1, krum_m=1, clip_norm=0.0)
    base.update(kw)
    return AggregationSpec(**base)


def make_updates(n, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "w": torch.randn(6, 5, generator=g) * scale,
            "b": torch.randn(5, generator=g) * scale,
            "steps": torch.tensor(7),
        }
        for _ in range(n)
    ]


def honest_plus_attacker(n_honest=8, n_bad=1, factor=-50.0):
    g = torch.Generator().manual_seed(1)
    centre = {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g)}
    honest = [
        {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in centre.items()}
        for _ in range(n_honest)
    ]
    bad = [{k: v * factor for k, v in centre.items()} for _ in range(n_bad)]
    return centre, honest + bad


def dist(a, b):
    return sum(float((a[k].double() - b[k].double()).norm() ** 2) for k in a) ** 0.5


def test_fedavg_equals_naive_weighted_mean():
    ups = make_updates(5)
    w = [10, 20, 30, 5, 64]
    out = fedavg(ups, w)
    for k in ("w", "b"):
        naive = sum(wi * u[k].double() for wi, u in zip(w, ups)) / sum(w)
        assert out[k].dtype == torch.float32
        assert torch.allclose(out[k].double(), naive, atol=1e-6)
    assert "steps" not in out  # non-floating tensors are the hub's business


def test_fedavg_is_deterministic_and_independent_of_slice_size():
    ups = make_updates(7, seed=3)
    w = [1, 2, 3, 4, 5, 6, 7]
    ref = fedavg(ups, w)
    for s in (1, 3, 7, 29, 1 << 20):
        out = fedavg(ups, w, slice_elems=s)
        assert all(torch.equal(out[k], ref[k]) for k in ref)


@pytest.mark.parametrize("method", METHODS)
def test_slice_size_does_not_change_results(method):
    ups = make_updates(7, seed=4)
    sp = spec(method, krum_m=3)
    ref = aggregate(ups, [1] * 7, sp)
    for s in (1, 4, 13):
        out = aggregate(ups, [1] * 7, sp, slice_elems=s)
        assert all(torch.equal(out[k], ref[k]) for k in ref), (method, s)


@pytest.mark.parametrize("method", METHODS)
def test_inputs_are_not_mutated(method):
    ups = make_updates(7, seed=5)
    ups[0]["w"] = torch.randn(5, 6).t()  # a non-contiguous view must work as well
    before = copy.deepcopy(ups)
    ids = [id(u) for u in ups]
    w = [3, 1, 4, 1, 5, 9, 2]
    w_before = list(w)
    aggregate(ups, w, spec(method, krum_m=2, clip_norm=1.0), slice_elems=4)
    assert [id(u) for u in ups] == ids and w == w_before
    for a, b in zip(ups, before):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_fedavg_over_read_only_mmap_views(tmp_path):
    from gpuflex.protocol.tensors import decode_state, encode_state

    ups = make_updates(4, seed=6)
    views, handles = [], []
    for i, u in enumerate(ups):
        p = tmp_path / f"u{i}.gft"
        p.write_bytes(encode_state(u))
        fh = open(p, "rb")
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        handles.append((fh, mm))
        views.append(decode_state(mm))
    try:
        out = aggregate(views, [1, 2, 3, 4], spec("fedavg"))
        ref = fedavg(ups, [1, 2, 3, 4])
        assert all(torch.equal(out[k], ref[k]) for k in ref)
    finally:
        del views
        for fh, mm in handles:
            try:
                mm.close()
            except BufferError:  # a view still alive in this frame; the GC releases it
                pass
            fh.close()


@pytest.mark.parametrize("method", ["median", "trimmed_mean", "krum", "multi_krum"])
def test_robust_rules_resist_a_scaled_attacker(method):
    centre, ups = honest_plus_attacker(n_honest=8, n_bad=1, factor=-50.0)
    robust = aggregate(ups, [1] * 9, spec(method, trim_beta=0.2, krum_f=1, krum_m=4))
    plain = aggregate(ups, [1] * 9, spec("fedavg"))
    assert dist(robust, centre) < 0.1 * dist(
        centre, {k: torch.zeros_like(v) for k, v in centre.items()}
    )
    assert dist(plain, centre) > 10 * dist(robust, centre)


def test_krum_never_selects_the_attackers():
    _, ups = honest_plus_attacker(n_honest=7, n_bad=2, factor=10.0)
    selected, scores = krum_select(ups, f=2, m=5)
    assert len(scores) == 9
    assert all(i < 7 for i in selected)
    det = aggregate_detailed(ups, [1] * 9, spec("multi_krum", krum_f=2, krum_m=5))
    assert det.selected == selected


def test_limits_on_f_are_enforced():
    ups = make_updates(4)
    with pytest.raises(AggregationError, match="needs more than 4 updates"):
        aggregate(ups, [1] * 4, spec("krum", krum_f=1))
    aggregate(make_updates(5), [1] * 5, spec("krum", krum_f=1))  # n = 2f + 3 is fine
    with pytest.raises(AggregationError, match="krum_m"):
        aggregate(make_updates(5), [1] * 5, spec("multi_krum", krum_f=1, krum_m=5))
    # beta < 0.5 implies 2*floor(beta*n) < n, so the range check enforces the limit.
    with pytest.raises(AggregationError, match=r"\[0, 0.5\)"):
        trimmed_mean(make_updates(4), 0.5)
    with pytest.raises(AggregationError, match="method"):
        aggregate(ups, [1] * 4, spec("mean"))


def test_trimmed_mean_of_three_with_one_trimmed_is_the_median():
    out = trimmed_mean(make_updates(3), 0.4)
    med = coordinate_median(make_updates(3))
    assert all(torch.allclose(out[k], med[k]) for k in out)  # 3 values, 1 trimmed each side


def test_bad_inputs_raise_one_line_errors():
    with pytest.raises(AggregationError, match="no updates"):
        aggregate([], [], spec())
    ups = make_updates(3)
    with pytest.raises(AggregationError, match="3 updates but 2 weights"):
        aggregate(ups, [1, 2], spec())
    with pytest.raises(AggregationError, match="sum to zero"):
        aggregate(ups, [0, 0, 0], spec())
    odd = make_updates(3)
    odd[1] = {"w": torch.zeros(5, 6), "b": torch.zeros(5)}
    with pytest.raises(AggregationError, match="update 1 tensor 'w'"):
        aggregate(odd, [1, 1, 1], spec())
    bad = make_updates(3)
    bad[2]["b"] = bad[2]["b"].clone()
    bad[2]["b"][0] = float("inf")
    with pytest.raises(AggregationError, match="not finite"):
        aggregate(bad, [1, 1, 1], spec())


def test_clipping_bounds_every_update():
    ups = make_updates(3, scale=10.0)
    norms = [update_norm(u) for u in ups]
    f = clip_factors(ups, 1.0)
    assert all(abs(n * fi - 1.0) < 1e-9 for n, fi in zip(norms, f))
    one = aggregate(ups[:1], [1], spec(clip_norm=1.0))
    assert abs(update_norm(one) - 1.0) < 1e-5
    assert clip_factors(ups, 0.0) == [1.0, 1.0, 1.0]
    big = aggregate(ups[:1], [1], spec(clip_norm=1e9))
    assert torch.equal(big["w"], ups[0]["w"])


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 7),
    seed=st.integers(0, 10_000),
    slice_elems=st.integers(1, 40),
)
def test_property_median_and_trimmed_mean_stay_within_range(n, seed, slice_elems):
    ups = make_updates(n, seed=seed)
    stacked = {k: torch.stack([u[k] for u in ups]) for k in ("w", "b")}
    for out in (
        coordinate_median(ups, slice_elems=slice_elems),
        trimmed_mean(ups, 0.2, slice_elems=slice_elems),
        fedavg(ups, list(range(1, n + 1)), slice_elems=slice_elems),
    ):
        for k, s in stacked.items():
            assert torch.all(out[k] >= s.min(0).values - 1e-6)
            assert torch.all(out[k] <= s.max(0).values + 1e-6)


# ------------------------------------------------------------------ server optimizers


def model_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(4, 3, generator=g),
        "b": torch.randn(3, generator=g),
        "n": torch.tensor(5),
    }


def test_server_optimizer_none_is_plain_fedavg_and_pure():
    g = model_state()
    d = {"w": torch.ones(4, 3), "b": torch.ones(3)}
    g0, d0 = copy.deepcopy(g), copy.deepcopy(d)
    new = ServerOptimizer().step(g, d)
    assert torch.equal(new["w"], g["w"] + 1) and torch.equal(new["n"], g["n"])
    assert all(torch.equal(g[k], g0[k]) for k in g) and all(torch.equal(d[k], d0[k]) for k in d)
    half = ServerOptimizer(lr=0.5).step(g, d)
    assert torch.allclose(half["b"], g["b"] + 0.5)


def test_fedavgm_and_fedadam_follow_their_formulas():
    g = model_state()
    ds = [
        {"w": torch.full((4, 3), float(i + 1)), "b": torch.full((3,), -float(i))} for i in range(3)
    ]
    opt = ServerOptimizer(kind="fedavgm", lr=0.1, momentum=0.5)
    state, v = g, torch.zeros(3)
    for d in ds:
        v = 0.5 * v + d["b"]
        expect = state["b"] + 0.1 * v
        state = opt.step(state, d)
        assert torch.allclose(state["b"], expect)
    opt = ServerOptimizer(kind="fedadam", lr=0.01, beta1=0.9, beta2=0.99, eps=1e-3)
    state, m, vv = g, torch.zeros(4, 3), torch.zeros(4, 3)
    for d in ds:
        m = 0.9 * m + 0.1 * d["w"]
        vv = 0.99 * vv + 0.01 * d["w"] ** 2
        expect = state["w"] + 0.01 * m / (vv.sqrt() + 1e-3)
        state = opt.step(state, d)
        assert torch.allclose(state["w"], expect, atol=1e-6)


def test_nesterov_is_torch_sgd_with_nesterov_momentum_on_the_pseudo_gradient():
    """DiLoCo's outer step: torch.optim.SGD(nesterov=True) applied to -delta, step for step."""
    ds = [{"w": torch.randn(4, 3, dtype=torch.float64)} for _ in range(5)]
    opt = ServerOptimizer(kind="nesterov", lr=0.7, momentum=0.9)
    state = {"w": torch.randn(4, 3, dtype=torch.float64)}
    ref = torch.nn.Parameter(state["w"].clone())
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    for d in ds:
        state = opt.step(state, d)
        ref.grad = -d["w"]
        sgd.step()
        assert torch.allclose(state["w"], ref.detach(), atol=1e-12)
    # and it differs from plain server momentum (fedavgm) after the first step
    m = ServerOptimizer(kind="fedavgm", lr=0.7, momentum=0.9)
    s0 = {"w": torch.zeros(4, 3, dtype=torch.float64)}
    n = ServerOptimizer(kind="nesterov", lr=0.7, momentum=0.9)
    assert not torch.allclose(m.step(s0, ds[0])["w"], n.step(s0, ds[0])["w"])


@pytest.mark.parametrize("kind", ["none", "fedavgm", "fedadam", "nesterov"])
def test_server_optimizer_state_round_trips_through_the_tensor_codec(kind):
    from gpuflex.protocol.tensors import decode_state, encode_state

    ds = [{"w": torch.randn(4, 3), "b": torch.randn(3)} for _ in range(4)]
    a = ServerOptimizer(kind=kind, lr=0.05)
    sa = model_state()
    for d in ds[:2]:
        sa = a.step(sa, d)
    b = ServerOptimizer(kind=kind, lr=0.05)
    b.load_state_dict(decode_state(encode_state(a.state_dict())))
    sb = {k: v.clone() for k, v in sa.items()}
    for d in ds[2:]:
        sa, sb = a.step(sa, d), b.step(sb, d)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert int(b.state_dict()["meta.step"][0]) == 4


def test_server_optimizer_refuses_bad_config_and_foreign_state():
    with pytest.raises(AggregationError, match="server_optimizer"):
        ServerOptimizer(kind="sgd")
    with pytest.raises(AggregationError, match="server_beta1"):
        ServerOptimizer(kind="fedadam", beta1=1.0)
    st_ = ServerOptimizer(kind="fedavgm").state_dict()
    with pytest.raises(AggregationError, match="'fedavgm' but this job uses 'fedadam'"):
        ServerOptimizer(kind="fedadam").load_state_dict(st_)
    with pytest.raises(AggregationError, match="lacks"):
        ServerOptimizer().load_state_dict({})
    with pytest.raises(AggregationError, match="does not fit"):
        ServerOptimizer().step(model_state(), {"w": torch.zeros(3, 4)})
    opt = ServerOptimizer.from_spec(AggregationSpec(server_optimizer="fedadam", server_lr=0.1))
    assert opt.kind == "fedadam" and opt.lr == 0.1 and opt.eps == 1e-3


def _rss_file_kb():
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssFile:"):
                return int(line.split()[1])
    return None


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_reading_mmapped_updates_does_not_keep_their_pages_resident(tmp_path):
    from gpuflex.protocol.tensors import decode_state, encode_state

    ups = [{"w": torch.randn(1 << 20)} for _ in range(3)]  # 4 MB each
    handles, views = [], []
    registered = contextlib.ExitStack()
    for i, u in enumerate(ups):
        p = tmp_path / f"u{i}.gft"
        p.write_bytes(encode_state(u))
        fh = open(p, "rb")
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        handles.append((fh, mm))
        views.append(decode_state(mm))
    # not registered (as the hub's open_deltas registers its mappings): nothing is dropped
    for v in views:
        float(v["w"].sum())  # fault every page in
    before = _rss_file_kb()
    aggregate(views, [1, 1, 1], spec("median"), slice_elems=1 << 18)
    assert before - _rss_file_kb() < 1024
    with registered:
        for _, mm in handles:
            registered.enter_context(readonly_mapping(mm))
        before = _rss_file_kb()
        out = aggregate(views, [1, 1, 1], spec("median"), slice_elems=1 << 18)
        after = _rss_file_kb()
    assert before - after > 8 * 1024, (before, after)  # >= 8 of the 12 MB dropped
    ref = coordinate_median(ups)
    assert torch.equal(out["w"], ref["w"])  # and ordinary tensors were left intact
    del views
    for fh, mm in handles:
        try:
            mm.close()
        except BufferError:
            pass
        fh.close()


def test_small_model_fast_path_gives_the_same_bits_as_the_sliced_path(monkeypatch):
    import gpuflex.hub.policy.aggregation as agg

    ups = make_updates(9, seed=11)
    w = [0.5 + i for i in range(9)]
    fast = fedavg(ups, w)
    monkeypatch.setattr(agg, "SMALL_MODEL_ELEMS", 0)
    for s in (1, 7, 1 << 20):
        sliced = fedavg(ups, w, slice_elems=s)
        assert all(torch.equal(fast[k], sliced[k]) for k in fast)


# -- Bulyan ---------------------------------------------------------------------------------------


def _bulyan_reference(xs: list[list[float]], f: int) -> tuple[list[int], list[float]]:
    """Bulyan written out from the paper, plainly: repeated Krum over what is left, then per
    coordinate the mean of the n - 4f selected values nearest the (lower) median."""
    import numpy as np

    a = np.asarray(xs, dtype=np.float64)
    n = len(a)
    d = ((a[:, None, :] - a[None, :, :]) ** 2).sum(axis=2)
    left, chosen = list(range(n)), []
    while len(chosen) < n - 2 * f:
        k = max(1, len(left) - f - 2)
        score = {i: float(np.sort([d[i, j] for j in left if j != i])[:k].sum()) for i in left}
        best = min(left, key=lambda i: (score[i], i))
        chosen.append(best)
        left.remove(best)
    chosen.sort()
    sel = a[chosen]
    beta = len(chosen) - 2 * f
    out = []
    for c in range(a.shape[1]):
        col = sel[:, c]
        med = np.sort(col)[(len(col) - 1) // 2]
        near = np.argsort(np.abs(col - med), kind="stable")[:beta]
        out.append(float(col[near].sum() / beta))
    return chosen, out


@settings(max_examples=40, deadline=None)
@given(n=st.integers(7, 12), f=st.integers(1, 2), seed=st.integers(0, 10_000), slice_elems=st.sampled_from([1, 3, 64]))
def test_bulyan_matches_the_papers_rule(n, f, seed, slice_elems):
    if n < 4 * f + 3:
        return
    g = torch.Generator().manual_seed(seed)
    deltas = [{"w": torch.randn(5, generator=g), "b": torch.randn(2, generator=g)} for _ in range(n)]
    from gpuflex.hub.policy.aggregation import bulyan

    out, selected, _ = bulyan(deltas, f, slice_elems=slice_elems)
    want_sel, want = _bulyan_reference([torch.cat([d["w"], d["b"]]).double().tolist() for d in deltas], f)
    assert selected == want_sel
    got = torch.cat([out["w"], out["b"]]).double()
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-6)


def test_bulyan_holds_against_f_attackers_where_fedavg_does_not():
    g = torch.Generator().manual_seed(1)
    honest = [{"w": 1.0 + 0.1 * torch.randn(50, generator=g)} for _ in range(9)]
    attackers = [{"w": torch.full((50,), -100.0)} for _ in range(2)]
    spec = AggregationSpec(method="bulyan", krum_f=2)
    got = aggregate(honest + attackers, [1.0] * 11, spec)["w"]
    assert float((got - 1.0).abs().max()) < 0.2
    assert float(aggregate(honest + attackers, [1.0] * 11, AggregationSpec())["w"].mean()) < -10


def test_bulyan_needs_4f_plus_3_updates_and_says_so():
    deltas = [{"w": torch.ones(3) * i} for i in range(10)]
    with pytest.raises(AggregationError, match="Bulyan with f=2 needs at least 11 updates, got 10"):
        aggregate(deltas, [1.0] * 10, AggregationSpec(method="bulyan", krum_f=2))
