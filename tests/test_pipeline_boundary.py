"""Pipeline boundary encodings (protocol/boundary.py, protocol/boundarycodec.py): each round-trips
within its error, the subspace codes are at least 16x smaller than fp32, the job spec refuses what
does not fit in one line, stages that train through each encoding lower the loss, and a receiving
stage refuses an encoded tensor of the wrong form, or one no encoder makes, in one line."""

from __future__ import annotations

import math
import re

import pytest
import torch
from gpuflex.node.errors import AssignmentRejected, PipelineError
from gpuflex.node.pipeline.stage import StageRunner
from gpuflex.node.pipeline.transport import MemoryNetwork, MessageKey
from gpuflex.node.stagework import check_stage_assignment
from gpuflex.node.trainer import make_optimizer
from gpuflex.protocol.boundary import (
    BOUNDARIES,
    LOG_SCALED,
    RANKED,
    check_boundary,
    encoded_crossing,
)
from gpuflex.protocol.boundarycodec import BoundaryCode, shared_basis, subspace_basis
from gpuflex.protocol.errors import SpecError, TensorError
from gpuflex.protocol.jobspec import parse_job_spec
from gpuflex.protocol.tensors import TensorSpec, encode_state
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from tests.test_stage_worker import ADAM, SGD_LM, STACK, TRANSFORMER, Job, max_rel_diff

torch.set_num_threads(1)

RAW = TensorSpec("activation", "float32", (4, 16, 64))


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(RAW.shape, generator=torch.Generator().manual_seed(seed)) * 3


def _code(boundary: str, rank: int = 0, raw: TensorSpec = RAW) -> BoundaryCode:
    return BoundaryCode(boundary, rank, raw=raw, seed=11, cut=1)


def test_fp32_hands_the_very_tensor_through() -> None:
    x = _x()
    code = _code("fp32")
    assert code.encode(x) is x and code.decode(x) is x and code.wire == RAW


@pytest.mark.parametrize(
    ("boundary", "dtype", "width", "error"),
    [
        ("fp16", "float16", 64, 2**-11),
        ("bf16", "bfloat16", 64, 2**-8),
        ("int8", "int8", 68, 1 / 254),
    ],
)
def test_each_encoding_round_trips_within_its_error(
    boundary: str, dtype: str, width: int, error: float
) -> None:
    x = _x()
    code = _code(boundary)
    wire = code.encode(x)
    assert (code.wire.dtype, code.wire.shape) == (dtype, (4, 16, width))
    assert (str(wire.dtype).removeprefix("torch."), tuple(wire.shape)) == (dtype, (4, 16, width))
    back = code.decode(wire)
    assert back.dtype == torch.float32 and back.shape == x.shape
    # the error of each row against the row's largest magnitude
    row_max = x.abs().amax(dim=-1, keepdim=True)
    assert float(((back - x).abs() / row_max).max()) <= error * 1.01
    assert float(((back - x).abs() / row_max).max()) > 0  # it is lossy


@pytest.mark.parametrize("rank", [7, 8])
def test_the_subspace_code_keeps_its_subspace_and_is_16x_smaller(rank: int) -> None:
    code = _code("subspace", rank=rank)
    basis = subspace_basis(11, 1, 64, rank)
    assert torch.allclose(basis.T @ basis, torch.eye(rank), atol=1e-6)
    assert torch.equal(basis, subspace_basis(11, 1, 64, rank))  # every stage builds the same one
    assert not torch.equal(basis, subspace_basis(11, 2, 64, rank))  # each cut its own
    x = _x()
    coefficients = x @ basis  # (..., rank): what the bottleneck lets through
    back = code.decode(code.encode(x))
    # each coefficient within half a 4-bit level (its row's largest / 7) of its value
    half_level = coefficients.abs().amax(dim=-1, keepdim=True) / 14
    assert bool(((back @ basis - coefficients).abs() <= half_level * 1.001).all())
    assert torch.allclose(back, (back @ basis) @ basis.T, atol=1e-5)  # nothing outside it
    # the gradient goes back through the same map: its chain rule, up to the rounding
    assert code.wire == TensorSpec("activation", "int8", (4, 16, 8))  # 4 bytes + the scale's 4
    fp32_bytes = len(encode_state({"activation": x}))
    sub_bytes = len(encode_state({"activation": code.encode(x)}))
    assert code.ratio() >= 16 and sub_bytes * 16 <= fp32_bytes, (fp32_bytes, sub_bytes)


def test_the_subspace_log_code_spends_its_scale_bytes_on_directions() -> None:
    code, other_side = _code("subspace_log", rank=28), _code("subspace_log", rank=28)
    basis = shared_basis(11, 64, 28)
    assert torch.allclose(basis.T @ basis, torch.eye(28), atol=1e-6)
    assert torch.equal(basis, subspace_basis(11, 0, 64, 28))  # cut 0's, at every cut
    cut_2 = BoundaryCode("subspace_log", 28, raw=RAW, seed=11, cut=2)
    assert torch.equal(cut_2.decode(code.encode(_x(3))), code.decode(code.encode(_x(3))))
    x = _x()
    coefficients = x @ basis
    wire = code.encode(x)
    assert code.wire == TensorSpec("activation", "int8", (4, 16, 15))  # 14 bytes + a scale byte
    back = other_side.decode(wire)  # the receiver builds its own code: the same basis
    assert torch.equal(back, code.decode(wire))
    # each coefficient within half a level of its row's scale, rounded up by at most 2**(1/4)
    half_level = coefficients.abs().amax(dim=-1, keepdim=True) / 14 * 2**0.25
    assert bool(((back @ basis - coefficients).abs() <= half_level * 1.001).all())
    assert torch.allclose(back, (back @ basis) @ basis.T, atol=1e-5)  # nothing outside it
    assert code.ratio() >= 16 and code.ratio() > _code("subspace", rank=24).ratio()
    # with GFT1's header, for a micro-batch of the bench's (128 rows of 64 floats) and above
    big = TensorSpec("activation", "float32", (4, 32, 64))
    x = torch.randn(big.shape, generator=torch.Generator().manual_seed(1))
    sent = _code("subspace_log", rank=28, raw=big).encode(x)
    fp32_bytes, sent_bytes = len(encode_state({"a": x})), len(encode_state({"a": sent}))
    assert sent_bytes * 16 <= fp32_bytes, (fp32_bytes, sent_bytes)


@pytest.mark.parametrize("magnitude", [0.0, 1e-12, 1e-6, 1.0, 1e3])
def test_the_subspace_log_scale_spans_gradients_and_activations(magnitude: float) -> None:
    code = _code("subspace_log", rank=8)
    basis = shared_basis(11, 64, 8)
    x = _x() * magnitude
    coefficients = x @ basis
    back = code.decode(code.encode(x)) @ basis
    half_level = coefficients.abs().amax(dim=-1, keepdim=True) / 14 * 2**0.25
    assert bool(((back - coefficients).abs() <= half_level * 1.001).all())
    assert back.dtype == torch.float32 and bool(torch.isfinite(back).all())


def test_the_subspace_scaled_code_sends_subspace_logs_wire_and_decodes_it_width_over_rank_larger() -> (
    None
):
    code, log = _code("subspace_scaled", rank=28), _code("subspace_log", rank=28)
    assert code.wire == log.wire == TensorSpec("activation", "int8", (4, 16, 15))
    x = _x()
    wire = code.encode(x)
    assert torch.equal(wire, log.encode(x))  # the same bytes: the same basis, levels and scale
    back = code.decode(wire)
    assert back.dtype == torch.float32 and back.shape == x.shape
    assert torch.allclose(back, log.decode(wire) * (64 / 28), rtol=1e-5, atol=1e-5)
    assert torch.equal(back, _code("subspace_scaled", rank=28).decode(wire))  # either side's
    # a linear map (up to the rounding) that is its own transpose: the gradient's chain rule
    basis = shared_basis(11, 64, 28)
    assert torch.allclose(back, (x @ basis @ basis.T) * (64 / 28), atol=float(x.abs().max()) / 5)
    big = TensorSpec("activation", "float32", (4, 32, 64))
    x = torch.randn(big.shape, generator=torch.Generator().manual_seed(1))
    sent = _code("subspace_scaled", rank=28, raw=big).encode(x)
    assert len(encode_state({"a": sent})) * 16 <= len(encode_state({"a": x}))


def test_averaged_over_the_jobs_random_bases_the_subspace_scaled_code_returns_the_tensor() -> None:
    """subspace_log keeps rank / width of a tensor on average over bases; subspace_scaled all of it."""
    raw = TensorSpec("activation", "float32", (2, 64))
    x = torch.randn(raw.shape, generator=torch.Generator().manual_seed(5))
    mean = {b: torch.zeros(raw.shape) for b in LOG_SCALED}
    for seed in range(48):
        for b in LOG_SCALED:
            code = BoundaryCode(b, 16, raw=raw, seed=seed, cut=0)
            mean[b] += code.decode(code.encode(x)) / 48
    assert float((mean["subspace_scaled"] - x).norm() / x.norm()) < 0.35
    assert float((mean["subspace_log"] - x * 16 / 64).norm() / x.norm()) < 0.1


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(LOG_SCALED), st.binary(min_size=2 * 5, max_size=2 * 5))
def test_any_bytes_a_log_scaled_receiver_gets_decode_finite_or_are_refused_in_one_line(
    boundary: str, data: bytes
) -> None:
    code = BoundaryCode(boundary, 8, raw=TensorSpec("a", "float32", (2, 16)), seed=3, cut=0)
    wire = torch.frombuffer(bytearray(data), dtype=torch.int8).reshape(2, 5)
    try:
        back = code.decode(wire)
    except TensorError as exc:
        assert "\n" not in str(exc) and "scale byte 255" in str(exc)
        assert 255 in (data[4], data[9])
        return
    assert back.shape == (2, 16) and bool(torch.isfinite(back).all())


def test_encoded_crossing_refuses_what_does_not_fit_in_one_line() -> None:
    assert encoded_crossing((2, 6, 8), "float32", "fp32", 0) == ("float32", (2, 6, 8))
    assert encoded_crossing((2, 6, 8), "float32", "subspace", 3) == ("int8", (2, 6, 6))
    assert encoded_crossing((2, 6, 8), "float32", "int8", 0) == ("int8", (2, 6, 12))
    assert encoded_crossing((2, 6, 8), "float32", "subspace_log", 5) == ("int8", (2, 6, 4))
    for shape, dtype, boundary, rank, says in [
        ((2, 8), "float32", "subspace", 8, "does not compress a cut 8 wide"),
        ((2, 8), "float32", "subspace", 0, "needs a rank of at least 1"),
        ((2, 8), "float32", "fp16", 4, "only the subspace boundary has a rank"),
        ((2, 8), "float32", "subspace_log", 8, "does not compress a cut 8 wide"),
        ((2, 8), "float32", "subspace_log", 0, "subspace_log boundary needs a rank"),
        ((2, 8), "float32", "fp8", 0, "expected one of fp32, fp16, bf16, int8, subspace"),
        ((2, 8), "int64", "int8", 0, "encodes a floating tensor"),
    ]:
        with pytest.raises(SpecError, match=says) as info:
            encoded_crossing(shape, dtype, boundary, rank)
        assert "\n" not in str(info.value)


SPEC = """
[job]
name = "lm"
[model]
kind = "transformer"
vocab = 32
context = 8
layers = 2
width = 16
heads = 2
[pipeline]
stages = 2
"""


def test_the_job_spec_chooses_the_boundary_and_refuses_an_inconsistent_one() -> None:
    assert parse_job_spec(SPEC).pipeline.boundary == "fp32"  # type: ignore[union-attr]
    spec = parse_job_spec(SPEC + 'boundary = "subspace"\nboundary_rank = 4\n').pipeline
    assert spec is not None and (spec.boundary, spec.boundary_rank) == ("subspace", 4)
    spec = parse_job_spec(SPEC + 'boundary = "subspace_log"\nboundary_rank = 12\n').pipeline
    assert spec is not None and (spec.boundary, spec.boundary_rank) == ("subspace_log", 12)
    spec = parse_job_spec(SPEC + 'boundary = "subspace_scaled"\nboundary_rank = 6\n').pipeline
    assert spec is not None and (spec.boundary, spec.boundary_rank) == ("subspace_scaled", 6)
    for extra, says in [
        ('boundary = "fp64"', "pipeline.boundary: expected one of"),
        ('boundary = "subspace"\nboundary_rank = 16', "does not compress a cut 16 wide"),
        ('boundary = "subspace"', "needs a rank of at least 1"),
        ('boundary = "int8"\nboundary_rank = 4', "only the subspace boundary has a rank"),
        ('boundary = "subspace_log"', "subspace_log boundary needs a rank"),
        ('boundary = "subspace_log"\nboundary_rank = 16', "does not compress a cut 16 wide"),
        ('boundary = "subspace_scaled"', "subspace_scaled boundary needs a rank"),
        ('boundary = "subspace_scaled"\nboundary_rank = 16', "does not compress a cut 16 wide"),
    ]:
        with pytest.raises(SpecError, match=says) as info:
            parse_job_spec(SPEC + extra + "\n")
        assert "\n" not in str(info.value)
    check_boundary("subspace", 4)  # a stack's widths are checked when it is cut


@pytest.mark.parametrize("boundary", BOUNDARIES)
def test_three_stages_train_through_each_encoding(boundary: str) -> None:
    rank = 6 if boundary in RANKED else 0
    job = Job(TRANSFORMER, SGD_LM)
    outcomes = job.run([0, 1, 3], boundary=boundary, boundary_rank=rank, end_step=30)
    assert [o.ended for o in outcomes] == ["done"] * 3, outcomes
    losses = [r.loss or 0.0 for r in job.hub.reports if r.stage == 2]
    assert sum(losses[-5:]) < 0.95 * sum(losses[:5]), losses
    drift = max_rel_diff(job.hub.model_at(TRANSFORMER, 30), job.reference(30))
    if boundary == "fp32":
        assert drift <= 1e-5
    elif boundary not in RANKED:  # a rounded boundary stays near the exact run
        assert drift <= 0.1, drift


def test_a_rank_not_below_the_cuts_width_fails_the_stage_in_one_line() -> None:
    job = Job(STACK, ADAM)  # its cuts are 16 and 8 wide
    outcomes = job.run([0, 2, 3], timeout_s=1.0, boundary="subspace", boundary_rank=8)
    assert outcomes[1].ended == "failed"
    assert "cut 1 of the pipeline cannot travel so" in outcomes[1].detail
    assert "does not compress a cut 8 wide" in outcomes[1].detail
    assert "\n" not in outcomes[1].detail


def _receiver(boundary: str, rank: int = 0) -> tuple[StageRunner, MemoryNetwork]:
    raw = TensorSpec("activation", "float32", (2, 8))
    module = nn.Linear(8, 3)
    network = MemoryNetwork()
    runner = StageRunner(
        module=module,
        stage=1,
        stages=2,
        transport=network.transport(),
        optimizer=make_optimizer(list(module.parameters()), ADAM),
        inbound=raw,
        loss_fn=nn.CrossEntropyLoss(),
        timeout_s=5.0,
        inbound_code=BoundaryCode(boundary, rank, raw=raw, seed=1, cut=0),
    )
    return runner, network


def _bad_int8_scale() -> torch.Tensor:
    wire = BoundaryCode("int8", 0, raw=TensorSpec("a", "float32", (2, 8)), seed=1, cut=0).encode(
        torch.ones(2, 8)
    )
    wire[0, 8:] = torch.tensor([float("nan")]).view(torch.int8)
    return wire


def _log_scale_of_a_nan_row() -> torch.Tensor:
    code = BoundaryCode("subspace_log", 2, raw=TensorSpec("a", "float32", (2, 8)), seed=1, cut=0)
    sent = torch.ones(2, 8)
    sent[1, 3] = float("nan")
    return code.encode(sent)  # the sender marks the row it could not scale


@pytest.mark.parametrize(
    ("boundary", "rank", "sent", "says"),
    [
        ("int8", 0, torch.zeros(2, 8), "has dtype float32, expected int8"),
        ("int8", 0, torch.zeros(2, 40, dtype=torch.int8), "has shape [2, 40], expected [2, 12]"),
        ("subspace", 2, torch.zeros(2, 12, dtype=torch.int8), "has shape [2, 12], expected [2, 5]"),
        ("bf16", 0, torch.zeros(2, 8, dtype=torch.float16), "has dtype float16, expected bfloat16"),
        ("fp16", 0, torch.full((2, 8), float("inf"), dtype=torch.float16), "NaN or infinite"),
        ("int8", 0, _bad_int8_scale(), "carries a scale that is negative, NaN or infinite"),
        ("subspace_log", 2, torch.zeros(2, 5, dtype=torch.int8), "shape [2, 5], expected [2, 2]"),
        ("subspace_log", 2, _log_scale_of_a_nan_row(), "carries the scale byte 255"),
        ("subspace_scaled", 2, torch.zeros(2, 2, dtype=torch.int16), "has dtype int16"),
        ("subspace_scaled", 2, _log_scale_of_a_nan_row(), "subspace_scaled row carries"),
    ],
)
def test_a_malformed_encoded_boundary_is_refused_in_one_line(
    boundary: str, rank: int, sent: torch.Tensor, says: str
) -> None:
    runner, network = _receiver(boundary, rank)
    before = [p.detach().clone() for p in runner.module.parameters()]
    network.transport().send(MessageKey(0, 0, "activation", 0, 1), sent)
    with pytest.raises(PipelineError, match=re.escape(says)) as info:
        runner.run_step(0, 1, targets=[torch.zeros(2, dtype=torch.long)])
    assert "\n" not in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.module.parameters(), strict=True))


def test_a_stage_assignment_with_an_inconsistent_boundary_is_refused_in_one_line() -> None:
    job = Job(STACK, ADAM)
    good = job.assignment([0, 2], 1, boundary="subspace", boundary_rank=4)
    assert check_stage_assignment(good, node_id="node-1") == STACK
    for over, says in [
        ({"boundary": "int8", "boundary_rank": 4}, "only the subspace boundary has a rank"),
        ({"boundary": "subspace", "boundary_rank": 0}, "needs a rank of at least 1"),
        ({"boundary": "subspace_log", "boundary_rank": 0}, "needs a rank of at least 1"),
        ({"boundary": "subspace_scaled", "boundary_rank": 0}, "needs a rank of at least 1"),
    ]:
        with pytest.raises(AssignmentRejected, match=says) as info:
            check_stage_assignment(job.assignment([0, 2], 1, **over), node_id="node-1")
        assert "\n" not in str(info.value)


# -- how far a raw tensor lies from a wire form (what the hub's referee measures) --------------

CODES = [
    ("fp32", 0),
    ("fp16", 0),
    ("bf16", 0),
    ("int8", 0),
    ("subspace", 8),
    ("subspace_log", 8),
    ("subspace_scaled", 8),
]


@pytest.mark.parametrize(("boundary", "rank"), CODES, ids=[b for b, _ in CODES])
def test_a_recomputed_tensor_is_measured_against_its_wire_form_rounding_and_all(
    boundary: str, rank: int
) -> None:
    """The tensor that was encoded, and its decoded form, lie in what the wire stands for; a
    recomputation off by rounding noise (1e-7 relative, what compute classes differ by) stays
    far below the 1e-4 threshold even where it rounds to a neighbouring level; a 1e-2 change of
    every value does not."""
    x = _x(1)
    code = _code(boundary, rank)
    wire = code.encode(x)
    norm = float(x.norm())
    assert code.distance(wire, x) / norm < 1e-6
    assert code.distance(wire, code.decode(wire) / code.gain) / norm < 1e-6  # gain: 1 but one
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    assert code.distance(wire, x * (1 + 1e-7 * noise)) / norm < 1e-6
    signs = torch.sign(torch.randn(x.shape, generator=torch.Generator().manual_seed(3)))
    assert code.distance(wire, x * (1 + 1e-2 * signs)) / norm > 1e-4


def test_a_value_rounded_to_the_next_level_costs_only_its_distance_to_the_edge() -> None:
    """int8: a row of 1.0 and a value just under the edge between levels 63 and 64 (63.5/127);
    recomputed just over it, it encodes to 64: the gap is what it lies past the edge, not the
    level's width; a row whose largest value moves moves the scale, which the wire holds exactly."""
    raw = TensorSpec("activation", "float32", (1, 4))
    code = BoundaryCode("int8", 0, raw=raw, seed=0, cut=0)
    edge = 63.5 / 127
    sent = torch.tensor([[1.0, edge - 1e-6, 0.25, -0.5]])
    wire = code.encode(sent)
    recomputed = torch.tensor([[1.0, edge + 1e-6, 0.25, -0.5]])
    assert code.encode(recomputed)[0, 1] != wire[0, 1]  # the rounding flipped
    assert code.distance(wire, recomputed) == pytest.approx(1e-6, rel=0.1)
    bigger = torch.tensor([[1.001, edge - 1e-6, 0.25, -0.5]])
    assert code.distance(wire, bigger) == pytest.approx(1e-3, rel=0.05)


def test_a_wire_form_no_encoder_makes_is_infinitely_far() -> None:
    x = _x(4)
    for boundary, rank in (
        ("int8", 0),
        ("subspace", 8),
        *((b, 8) for b in LOG_SCALED),
        ("fp16", 0),
    ):
        code = _code(boundary, rank)
        wire = code.encode(x)
        bad = wire.clone()
        if boundary == "int8":
            bad[..., 0] = -128  # a level out of range
        elif boundary == "subspace":
            bad[..., -4:] = torch.tensor([0, 0, -64, 127], dtype=torch.int8)  # a NaN scale
        elif boundary in LOG_SCALED:
            bad[..., -1] = -1  # the scale byte 255
        else:
            bad[0, 0, 0] = float("inf")
        assert math.isinf(code.distance(bad, x)), boundary
        assert math.isinf(code.distance(wire, x[..., :1, :])), boundary  # another shape
