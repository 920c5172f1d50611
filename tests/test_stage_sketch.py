"""A stage's sketch of the raw tensor it sends (protocol/stagesketch.py) and the referee's use of it
(hub/policy/stage_check.py): the bytes are at most 1 KiB, deterministic and strictly decoded (every
malformed form one DecodeError line; tests/test_protocol_fuzz.py fuzzes the decoder); behind int8
and subspace_log cuts a stage whose weights are perturbed by 1e-3 sends wire forms the referee
cannot tell from honest work, and its sketch gives it away; a sketch of a cheap part of the
tensor (one row computed honestly) is caught by where its entries are; a stage sketches what it
sends at the steps it is told, through the transports a worker wraps around the relay."""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import numpy as np
import pytest
import torch
from gpuflex.hub.policy.stage_check import StageEvidence, sketch_distances
from gpuflex.protocol.boundarycodec import BoundaryCode
from gpuflex.protocol.errors import DecodeError, EncodeError
from gpuflex.protocol.pipeline import load_unit
from gpuflex.protocol.stagesketch import (
    MAX_SKETCH_BYTES,
    SKETCH_ENTRIES,
    decode_sketch,
    encode_sketch,
    sketch_size,
)
from gpuflex.protocol.tensors import TensorSpec
from torch import Tensor

from tests.test_stage_checks import _judge, _middle_mlp_stage

torch.set_num_threads(1)


def test_a_sketch_is_the_largest_entries_in_at_most_one_kib_and_decodes_to_them() -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.randn(16, 8, 64, generator=g)
    data = encode_sketch(t)
    assert len(data) == sketch_size(t.numel()) <= MAX_SKETCH_BYTES
    assert encode_sketch(t.clone()) == data  # deterministic
    got = decode_sketch(data, numel=t.numel())
    want = torch.topk(t.abs().flatten(), SKETCH_ENTRIES).indices.sort().values
    assert torch.equal(got.indices, want) and torch.equal(got.values, t.flatten()[want])
    small = torch.tensor([[3.0, -1.0], [0.5, 2.0]])  # fewer elements than entries: all of them
    assert decode_sketch(encode_sketch(small)).values.tolist() == [3.0, -1.0, 0.5, 2.0]
    with pytest.raises(EncodeError, match="NaN or infinite"):
        encode_sketch(torch.tensor([1.0, float("nan")]))


def _forged(data: bytes, how: str) -> bytes:
    magic, numel, count = struct.unpack_from("<4sII", data)
    idx = np.frombuffer(data, "<u4", count, 12).copy()
    val = np.frombuffer(data, "<f4", count, 12 + 4 * count).copy()
    if how == "short":
        return data[:-1]
    if how == "magic":
        return b"GFS2" + data[4:]
    if how == "count":
        return struct.pack("<4sII", magic, numel, count - 1) + idx[1:].tobytes() + val[1:].tobytes()
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
    return data[:12] + idx.tobytes() + val.tobytes()


@pytest.mark.parametrize(
    ("how", "words"),
    [
        ("short", "bytes, not"),
        ("magic", "starts with"),
        ("count", "holds 126 entries, not 125"),
        ("range", "out of its"),
        ("duplicate", "not strictly increasing"),
        ("unsorted", "not strictly increasing"),
        ("nan", "NaN or infinite"),
        ("inf", "NaN or infinite"),
    ],
)
def test_a_malformed_sketch_is_refused_in_one_line(how: str, words: str) -> None:
    data = encode_sketch(torch.randn(4, 64))
    with pytest.raises(DecodeError, match=words) as err:
        decode_sketch(_forged(data, how))
    assert "\n" not in str(err.value)
    with pytest.raises(DecodeError, match="covers 256 elements, the tensor has 255"):
        decode_sketch(data, numel=255)


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


def _sent(boundary: str, states: list[dict[str, Tensor]], units: list[Any]) -> StageEvidence:
    """The middle MLP stage's work on one micro-batch with ``states``, as it sends it: the wire
    forms and the sketches of the raw output and input gradient."""
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
        out_sketch=decode_sketch(encode_sketch(out)),
        grad_in_sketch=decode_sketch(encode_sketch(received.grad)),
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
    keys = {f"{d}_sketch{r}_distance" for d in ("forward", "backward") for r in ("", "_rank")}
    assert keys <= set(ev) and all(ev[k] < 1e-6 for k in keys), ev


@pytest.mark.parametrize("boundary", ["int8", "subspace_log"])
def test_perturbed_weights_the_wire_hides_are_caught_by_the_sketch(boundary: str) -> None:
    """Under subspace_log the wire shows nothing of the perturbation; under int8 only the part
    that crossed a level's edge or moved a row's scale. The sketch sees it in full."""
    units, states = _middle_mlp_stage()
    sent = _sent(boundary, _perturbed(states), units)
    unsketched = _judge(
        units, states, dataclasses.replace(sent, out_sketch=None, grad_in_sketch=None)
    )
    verdict = _judge(units, states, sent)
    ev = verdict.evidence
    assert not verdict.ok and ev["threshold"] == 1e-4, ev
    for way in ("forward", "backward"):
        wire, sketch = ev[f"{way}_distance"], ev[f"{way}_sketch_distance"]
        assert sketch > 3 * ev["threshold"] and sketch > 2 * wire, ev
    if boundary == "subspace_log":  # what an older node's messages let the referee see: nothing
        assert unsketched.ok, unsketched.evidence


def test_a_sketch_of_a_part_computed_honestly_is_caught_by_where_its_entries_are() -> None:
    """A stage that computed one row honestly and sketches that row's entries, or sketches the
    entries nearest zero: their values are right, but larger entries lie outside them."""
    t = torch.randn(8, 200, generator=torch.Generator().manual_seed(2))
    honest = decode_sketch(encode_sketch(t))
    assert sketch_distances(honest, t) == (0.0, 0.0)
    row = decode_sketch(encode_sketch(t[0]))
    forged = dataclasses.replace(row, numel=t.numel())
    values, rank = sketch_distances(forged, t)
    assert values == 0.0 and rank > 0.1
    assert sketch_distances(row, t) == (float("inf"), float("inf"))  # another size
    # the 126 entries nearest zero, with their true values
    small = torch.topk(t.abs().flatten(), SKETCH_ENTRIES, largest=False).indices.sort().values
    near_zero = dataclasses.replace(honest, indices=small, values=t.flatten()[small])
    assert sketch_distances(near_zero, t)[1] > 0.5


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
