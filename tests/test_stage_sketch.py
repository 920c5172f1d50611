"""A stage's sketch of the raw tensor it sends (protocol/stagesketch.py) and the referee's use of it
(hub/policy/stage_check.py): the bytes are at most 1 KiB, deterministic and strictly decoded (every
malformed form one DecodeError line, of either layout; tests/test_protocol_fuzz.py fuzzes the
decoder); behind int8 and subspace_log cuts a stage whose weights are perturbed by 1e-3 sends wire
forms the referee cannot tell from honest work, and its sketch gives it away, its projections
more clearly than its largest entries; projections that are not the tensor's are caught; a sketch
of a cheap part of the tensor (one row computed honestly) is caught by where its entries are; a
first-layout sketch is still judged, by its entries; a stage sketches what it sends at the steps
it is told, through the transports a worker wraps around the relay."""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from gpuflex.hub.policy.stage_check import StageEvidence, sketch_distances
from gpuflex.protocol.boundarycodec import BoundaryCode
from gpuflex.protocol.errors import DecodeError, EncodeError
from gpuflex.protocol.pipeline import load_unit
from gpuflex.protocol.stagesketch import (
    GFS1_ENTRIES,
    MAX_SKETCH_BYTES,
    SKETCH_ENTRIES,
    SKETCH_PROJECTIONS,
    decode_sketch,
    encode_sketch,
    sketch_projections,
    sketch_size,
)
from gpuflex.protocol.tensors import TensorSpec
from torch import Tensor

from tests.test_stage_checks import _judge, _middle_mlp_stage

torch.set_num_threads(1)


def test_a_sketch_is_the_largest_entries_and_projections_of_all_in_at_most_one_kib() -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.randn(16, 8, 64, generator=g)
    data = encode_sketch(t)
    assert len(data) == sketch_size(t.numel()) <= MAX_SKETCH_BYTES and data[:4] == b"GFS2"
    assert encode_sketch(t.clone()) == data  # deterministic
    got = decode_sketch(data, numel=t.numel())
    want = torch.topk(t.abs().flatten(), SKETCH_ENTRIES).indices.sort().values
    assert torch.equal(got.indices, want) and torch.equal(got.values, t.flatten()[want])
    # the projections: signed sums covering every entry, drawn from the entries' bytes
    assert got.projections is not None and got.projections.shape == (SKETCH_PROJECTIONS,)
    flat = t.flatten().numpy()
    sums = sketch_projections(flat, got.seed)
    assert torch.equal(got.projections, torch.from_numpy(sums).float())
    norm = np.square(flat.astype(np.float64)).sum()
    assert abs(np.square(sums).sum() / norm - 1) < 0.5  # about the tensor's norm
    moved = flat.copy()
    moved[int(want[0])] *= 1.01  # another largest entry: other buckets and signs
    assert decode_sketch(encode_sketch(torch.from_numpy(moved))).seed != got.seed
    small = torch.tensor([[3.0, -1.0], [0.5, 2.0]])  # fewer elements than entries: all of them
    tiny = decode_sketch(encode_sketch(small))
    assert tiny.values.tolist() == [3.0, -1.0, 0.5, 2.0]
    assert tiny.projections is not None and float(tiny.projections.abs().sum()) > 0
    with pytest.raises(EncodeError, match="NaN or infinite"):
        encode_sketch(torch.tensor([1.0, float("nan")]))


def _gfs1(t: Tensor) -> bytes:
    """A first-layout sketch of ``t``: its 126 largest entries, no projections."""
    flat = t.flatten()
    count = min(GFS1_ENTRIES, flat.numel())
    idx = torch.topk(flat.abs(), count).indices.sort().values
    head = struct.pack("<4sII", b"GFS1", flat.numel(), count)
    return head + idx.numpy().astype("<u4").tobytes() + flat[idx].numpy().astype("<f4").tobytes()


def _forged(data: bytes, how: str) -> bytes:
    """``data`` (GFS2, or GFS1 for the forms named ``gfs1-...``) made malformed ``how``."""
    first = how.startswith("gfs1-")
    head = struct.Struct("<4sII" if first else "<4sIHH")
    magic, numel, count, *projections = head.unpack_from(data)
    how = how.removeprefix("gfs1-")
    idx = np.frombuffer(data, "<u4", count, head.size).copy()
    val = np.frombuffer(data, "<f4", count, head.size + 4 * count).copy()
    tail = data[head.size + 8 * count :]
    sums = np.frombuffer(tail, "<f4").copy()
    if how == "short":
        return data[:-1]
    if how == "long":
        return data + b"\0\0\0\0"
    if how == "magic":
        return b"GFS3" + data[4:]
    if how == "count":
        fewer = head.pack(magic, numel, count - 1, *projections)
        return fewer + idx[1:].tobytes() + val[1:].tobytes() + tail
    if how == "projections":
        return head.pack(magic, numel, count, projections[0] - 1) + data[head.size : -4]
    if how == "range":
        idx[-1] = numel
    elif how == "duplicate":
        idx[1] = idx[0]
    elif how == "unsorted":
        idx[[0, 1]] = idx[[1, 0]]
    elif how == "nan":
        val[3] = np.nan
    elif how == "inf":
        val[3] = -np.inf
    elif how == "sum-nan":
        sums[5] = np.nan
    return data[: head.size] + idx.tobytes() + val.tobytes() + sums.tobytes()


@pytest.mark.parametrize(
    ("how", "words"),
    [
        ("short", "bytes, not"),
        ("long", "is 1020 bytes, not 1024"),
        ("magic", "starts with b'GFS2' \\(or b'GFS1'\\)"),
        ("count", "holds 62 entries, not 61"),
        ("projections", "holds 128 projections, not 127"),
        ("range", "out of its"),
        ("duplicate", "not strictly increasing"),
        ("unsorted", "not strictly increasing"),
        ("nan", "NaN or infinite"),
        ("inf", "NaN or infinite"),
        ("sum-nan", "projections hold NaN or infinite"),
        ("gfs1-short", "bytes, not"),
        ("gfs1-long", "GFS1 sketch of 126 entries is 1020 bytes, not 1024"),
        ("gfs1-count", "holds 126 entries, not 125"),
        ("gfs1-range", "out of its"),
        ("gfs1-unsorted", "not strictly increasing"),
        ("gfs1-nan", "NaN or infinite"),
    ],
)
def test_a_malformed_sketch_is_refused_in_one_line(how: str, words: str) -> None:
    t = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    data = _gfs1(t) if how.startswith("gfs1-") else encode_sketch(t)
    assert decode_sketch(data, numel=256).numel == 256  # well formed as it came
    with pytest.raises(DecodeError, match=words) as err:
        decode_sketch(_forged(data, how))
    assert "\n" not in str(err.value)
    with pytest.raises(DecodeError, match="covers 256 elements, the tensor has 255"):
        decode_sketch(data, numel=255)
    for cut in (0, 3, 11):
        with pytest.raises(DecodeError, match="at least 12 bytes"):
            decode_sketch(data[:cut])


# -- the referee -----------------------------------------------------------------------------------


def _codes(boundary: str) -> tuple[BoundaryCode | None, BoundaryCode | None]:
    if boundary == "fp32":  # as the hub builds them: no code
        return None, None
    rank = 8 if boundary.startswith("subspace") else 0
    before, after = (
        BoundaryCode(boundary, rank, raw=TensorSpec("activation", "float32", (8, w)), seed=0, cut=c)
        for c, w in ((0, 32), (1, 16))
    )
    return before, after


def _sent(
    boundary: str,
    states: list[dict[str, Tensor]],
    units: list[Any],
    sketch: Callable[[Tensor], bytes] = encode_sketch,
) -> StageEvidence:
    """The middle MLP stage's work on one micro-batch with ``states``, as it sends it: the wire
    forms and the sketches (``sketch``'s bytes) of the raw output and input gradient."""
    before, after = _codes(boundary)

    def encode(code: BoundaryCode | None, t: Tensor) -> Tensor:
        return t.detach().clone() if code is None else code.encode(t)

    def decode(code: BoundaryCode | None, t: Tensor) -> Tensor:
        return t.clone() if code is None else code.decode(t)

    g = torch.Generator().manual_seed(0)
    x = encode(before, torch.randn(8, 32, generator=g))
    grad_out = encode(after, torch.randn(8, 16, generator=g))
    received = decode(before, x).requires_grad_(True)
    out = load_unit(units[0], states[0])(received)
    out.backward(decode(after, grad_out))
    assert received.grad is not None
    return StageEvidence(
        x=x, out=encode(after, out), grad_out=grad_out, grad_in=encode(before, received.grad),
        inbound=before, outbound=after,
        out_sketch=decode_sketch(sketch(out.detach())),
        grad_in_sketch=decode_sketch(sketch(received.grad)),
    )  # fmt: skip


def _perturbed(states: list[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        {
            k: v * (1 + 1e-3 * (torch.randint(0, 2, v.shape, generator=g) * 2 - 1))
            for k, v in s.items()
        }
        for s in states
    ]


@pytest.mark.parametrize("boundary", ["fp32", "int8", "subspace_log"])
def test_honest_work_reproduces_its_sketches(boundary: str) -> None:
    units, states = _middle_mlp_stage()
    verdict = _judge(units, states, _sent(boundary, states, units))
    assert verdict.ok, verdict.evidence
    ev = verdict.evidence
    parts = ("", "_rank", "_projection")
    keys = {f"{d}_sketch{r}_distance" for d in ("forward", "backward") for r in parts}
    assert keys <= set(ev) and all(ev[k] < 1e-6 for k in keys), ev


@pytest.mark.parametrize("boundary", ["int8", "subspace_log"])
def test_perturbed_weights_the_wire_hides_are_caught_by_the_sketch(boundary: str) -> None:
    """Under subspace_log the wire shows nothing of the perturbation; under int8 only the part
    that crossed a level's edge or moved a row's scale. The sketch sees it in full, by its
    entries and by its projections."""
    units, states = _middle_mlp_stage()
    sent = _sent(boundary, _perturbed(states), units)
    unsketched = _judge(
        units, states, dataclasses.replace(sent, out_sketch=None, grad_in_sketch=None)
    )
    verdict = _judge(units, states, sent)
    ev = verdict.evidence
    assert not verdict.ok and ev["threshold"] == 1e-4, ev
    for way in ("forward", "backward"):
        wire = ev[f"{way}_distance"]
        for part in ("sketch", "sketch_projection"):
            assert ev[f"{way}_{part}_distance"] > max(3 * ev["threshold"], 2 * wire), ev
    if boundary == "subspace_log":  # what an older node's messages let the referee see: nothing
        assert unsketched.ok, unsketched.evidence


def _residual(fault: float) -> Tensor:
    """A residual stream's raw tensor: the stage's input passed through, with two outlier
    channels (the largest entries), plus the stage's own contribution, off by ``fault``."""
    g = torch.Generator().manual_seed(4)
    passed = torch.randn(8, 32, 64, generator=g)
    passed[..., :2] *= 4.0
    own = 0.5 * torch.randn(8, 32, 64, generator=g)
    return passed + own * (1 + fault * torch.sign(torch.randn(own.shape, generator=g)))


def test_the_projections_show_a_fault_the_largest_entries_understate() -> None:
    """A 1e-3 fault in what a stage adds to a residual stream: the largest entries are the input
    passed through, so the entries part (either layout) shows a fraction of it; the projections
    show it at about its size over the whole tensor, as the fp32 wire would."""
    honest, faulty = _residual(0.0), _residual(1e-3)
    whole = float((faulty - honest).norm() / honest.norm())
    old = sketch_distances(decode_sketch(_gfs1(faulty)), honest)
    new = sketch_distances(decode_sketch(encode_sketch(faulty)), honest)
    assert set(old) == {"sketch", "sketch_rank"}  # a GFS1 sketch: its entries alone
    assert old["sketch"] < 1e-4 and new["sketch"] < 1e-4, (old, new)
    assert 0.7 * whole < new["sketch_projection"] < 1.4 * whole, (new, whole)
    assert new["sketch_projection"] > 1e-4 and new["sketch_projection"] > 3 * old["sketch"]
    same = sketch_distances(decode_sketch(encode_sketch(honest.clone())), honest)
    assert max(same.values()) < 1e-7, same


def test_projections_that_are_not_the_tensors_are_caught() -> None:
    """A stage whose entries are the honest tensor's but whose projections are not: those of a
    perturbed tensor under the same buckets and signs, zeros, or a tenth off."""
    honest, faulty = _residual(0.0), _residual(1e-3)
    data = encode_sketch(honest)
    entries = data[: -4 * SKETCH_PROJECTIONS]
    seed = decode_sketch(data).seed
    forged = {
        "perturbed": sketch_projections(faulty.flatten().numpy(), seed),
        "zeros": np.zeros(SKETCH_PROJECTIONS),
        "scaled": 1.1 * sketch_projections(honest.flatten().numpy(), seed),
    }
    for how, sums in forged.items():
        got = sketch_distances(decode_sketch(entries + sums.astype("<f4").tobytes()), honest)
        assert got["sketch"] == got["sketch_rank"] == 0.0, (how, got)
        assert got["sketch_projection"] > 3e-4, (how, got)


def test_a_first_layout_sketch_is_judged_by_its_entries() -> None:
    """A GFS1 sketch (a node of the same protocol version may send one): honest work reproduces
    it, without a projection distance."""
    units, states = _middle_mlp_stage()
    verdict = _judge(units, states, _sent("int8", states, units, _gfs1))
    assert verdict.ok, verdict.evidence
    assert "forward_sketch_distance" in verdict.evidence
    assert not any("projection" in k for k in verdict.evidence), verdict.evidence


def test_a_sketch_of_a_part_computed_honestly_is_caught_by_where_its_entries_are() -> None:
    """A stage that computed one row honestly and sketches that row's entries, or sketches the
    entries nearest zero: their values are right, but larger entries lie outside them."""
    t = torch.randn(8, 200, generator=torch.Generator().manual_seed(2))
    honest = decode_sketch(encode_sketch(t))
    same = sketch_distances(honest, t)
    assert same["sketch"] == same["sketch_rank"] == 0.0 and same["sketch_projection"] < 1e-7
    row = decode_sketch(encode_sketch(t[0]))
    forged = dataclasses.replace(row, numel=t.numel())
    got = sketch_distances(forged, t)
    assert got["sketch"] == 0.0 and got["sketch_rank"] > 0.1 and got["sketch_projection"] > 0.1
    assert set(sketch_distances(row, t).values()) == {float("inf")}  # another size
    # the entries nearest zero, with their true values
    small = torch.topk(t.abs().flatten(), SKETCH_ENTRIES, largest=False).indices.sort().values
    near_zero = dataclasses.replace(honest, indices=small, values=t.flatten()[small])
    assert sketch_distances(near_zero, t)["sketch_rank"] > 0.5


# -- the sending stage -----------------------------------------------------------------------------


class Recording:
    """An in-memory transport that keeps each sketch sent with a tensor, and the tensor."""

    def __init__(self, network: Any, sketches: dict[Any, tuple[bytes, Tensor]]) -> None:
        self.inner, self.sketches = network.transport(), sketches

    def send(self, key: Any, tensor: Tensor, sketch: bytes = b"") -> None:
        if sketch:
            self.sketches[key] = (sketch, tensor.detach().clone())
        self.inner.send(key, tensor)

    def receive(self, key: Any, expected: Any, *, timeout_s: float) -> Tensor:
        return self.inner.receive(key, expected, timeout_s=timeout_s)


def test_a_stage_sketches_what_it_sends_at_the_checked_steps_through_its_transports() -> None:
    """StageRunner(sketched=...): each activation and gradient of step 0 (not step 1) carries the
    sketch of the very tensor sent (fp32 cuts); it passes through the worker's transports
    (TimedTransport, SendAhead, RoutedTransport to the relay at a relayed step)."""
    from gpuflex.node.pipeline.direct import DirectTransport, RoutedTransport
    from gpuflex.node.pipeline.local import run_stages
    from gpuflex.node.pipeline.transport import MemoryNetwork, MessageKey, SendAhead
    from gpuflex.node.pipeline.worker import TimedTransport
    from gpuflex.protocol.signing import SigningKey

    from tests.test_pipeline_engine import ADAM, CUTS, mlp_units, runners_for, step_data

    network, sketches = MemoryNetwork(), dict[Any, tuple[bytes, Tensor]]()

    class Net:
        def transport(self) -> Recording:
            return Recording(network, sketches)

    runners = runners_for(mlp_units(), CUTS[3], ADAM, "1f1b", Net())
    for r in runners:
        r.sketched = lambda step: step == 0
    run_stages(runners, step_data(steps=2))
    kinds = {(k.step, k.carries) for k in sketches}
    assert kinds == {(0, "activation"), (0, "gradient")}, kinds
    for sketch, sent in sketches.values():
        got = decode_sketch(sketch, numel=sent.numel())
        assert torch.equal(got.values, sent.flatten()[got.indices])
        sums = sketch_projections(sent.flatten().numpy(), got.seed)
        assert torch.equal(got.projections, torch.from_numpy(sums).float())
    # the wrappers a worker puts around its relay pass a sketch on
    relay, sketches = Recording(network, {}), {}
    relay.sketches = sketches
    direct = DirectTransport(SigningKey.generate(), "j", 0, addresses={1: "127.0.0.1:9"}, peers={})
    routed = RoutedTransport(direct, relay, relayed=lambda step: step == 0)
    outer = TimedTransport(SendAhead([routed], routed))
    key = MessageKey(0, 0, "activation", 0, 1)
    outer.send(key, torch.ones(3), b"sketch")
    outer.flush()
    assert sketches[key][0] == b"sketch"
