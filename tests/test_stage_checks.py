"""The hub verifies pipeline stages' work (hub/domain/pipelines/verify.py, hub/policy/stage_check.py):
a real hub on 127.0.0.1 and SQLite, three real StageRunners over the relay, ``verify_rate = 1.0``
(every stage at every step run with durable parameters: steps 0 and 2 of 4).

- an honest run is never flagged, and every drawn check runs;
- each injected fault is caught, and its flag (``stage_mismatch``) names the stage, the step and
  the micro-batch, and suspends the node: weights perturbed by 1e-3 relative while the
  checkpoints hold the honest ones, a skipped layer, stale parameters, a bf16 forward, crafted
  gradients sent back;
- the same with the boundary encoded (int8, subspace): the relay keeps wire forms, the referee
  decodes what the stage received and measures what it sent by ``BoundaryCode.distance``
  (honest runs and a few of the faults here; bench/stage_checks.py runs every fault).
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import torch
from gpuflex.hub.server.appkeys import LEDGER
from torch import Tensor, nn

from tests.pipeline_hub import (
    DIGITS_SPEC,
    HubThread,
    drive_all,
    poll_until,
    register,
    request,
    submit,
    work,
)

torch.set_num_threads(1)

SPEC = DIGITS_SPEC.format(stages=3, steps=4, every=2) + "verify_rate = 1.0\n"


@pytest.fixture
def hub(tmp_path):
    h = HubThread(tmp_path / "hub", stage_timeout_s=10.0)
    yield h
    h.stop()


def checks(hub: HubThread) -> dict[str, int]:
    return hub.call(lambda: dict(hub.hub.app[LEDGER].pipelines.checks.counts))


def flags(hub: HubThread) -> list[dict[str, Any]]:
    code, _, body = request(
        hub.url, "GET", "/v1/flags", None, {"Authorization": f"Bearer {hub.tokens['auditor']}"}
    )
    assert code == 200, body
    return json.loads(body)["flags"]


def wait_for(what: Any, timeout_s: float = 30.0) -> Any:
    give_up = time.monotonic() + timeout_s
    while not (got := what()):
        assert time.monotonic() < give_up, "timed out"
        time.sleep(0.1)
    return got


def run_pipeline(
    hub: HubThread, tmp_path, tamper: dict[int, Any], boundary: str = ""
) -> tuple[list, list]:
    """The three stages of SPEC (its [pipeline] section plus ``boundary``'s lines), each stage
    in ``tamper`` changed by its fault."""
    keys = [register(hub.url) for _ in range(3)]
    code, job = submit(hub, tmp_path, SPEC + boundary)
    assert code == 201, job
    got = poll_until(hub, keys)
    options = {
        i: {"tamper": tamper[sa.stage], "timeout_s": 15.0}
        for i, sa in enumerate(got)
        if sa.stage in tamper
    }
    drive_all(hub, keys, got, options=options)
    return keys, got


#: the encoded boundaries the checks run under: each cut's tensors travel int8 per row, or
#: projected onto 8 directions at 4 bits (the cuts are 32 and 16 wide)
INT8 = 'boundary = "int8"\n'
SUBSPACE = 'boundary = "subspace"\nboundary_rank = 8\n'
SUBSPACE_LOG = 'boundary = "subspace_log"\nboundary_rank = 8\n'


@pytest.mark.parametrize(
    "boundary", ["", INT8, SUBSPACE, SUBSPACE_LOG], ids=["fp32", "int8", "subspace", "subspace_log"]
)
def test_an_honest_three_stage_pipeline_is_checked_and_never_flagged(
    hub, tmp_path, boundary
) -> None:
    run_pipeline(hub, tmp_path, {}, boundary)
    done = wait_for(lambda: (c := checks(hub))["checked"] == c["drawn"] and c)
    assert done["drawn"] == 6 and done["flagged"] == 0, done  # 3 stages x steps 0 and 2
    assert flags(hub) == []
    verdicts = hub.call(lambda: list(hub.hub.app[LEDGER].pipelines.checks.verdicts))
    assert all(v.ok for _, v in verdicts) and len(verdicts) == 6
    # the checks are tight: honest work reproduces far below the threshold, its sketches too
    for _, v in verdicts:
        assert any(k.endswith("_sketch_distance") for k in v.evidence), v.evidence
        for k, d in v.evidence.items():
            if k.endswith("_distance"):
                assert d < 1e-6, v.evidence


# -- the faults: each changes what the stage computes, never what it checkpoints ----------------


class Perturbed(nn.Module):
    """Runs its stage with every weight perturbed by 1e-3 relative; trains (and checkpoints) the
    honest ones."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        g = torch.Generator().manual_seed(1)
        self.signs = {
            n: torch.randint(0, 2, p.shape, generator=g).float() * 2 - 1
            for n, p in inner.named_parameters()
        }

    def forward(self, x: Tensor) -> Tensor:
        params = {n: p * (1 + 1e-3 * self.signs[n]) for n, p in self.inner.named_parameters()}
        return torch.func.functional_call(self.inner, params, (x,))


class Bf16(nn.Module):
    """Runs its stage's forward in bf16 autocast (a precision swap)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(x).float()


def perturbed(runner: Any) -> None:
    runner.module = Perturbed(runner.module)


def bf16(runner: Any) -> None:
    runner.module = Bf16(runner.module)


def skipped_layer(runner: Any) -> None:
    unit = runner.module[0]
    assert isinstance(unit[1], nn.ReLU)
    unit[1] = nn.Identity()


class Stale:
    """The stage computes each step with the parameters of the step before (one version
    behind), and applies its gradients to the current ones."""

    def __init__(self, runner: Any) -> None:
        self.inner = runner.optimizer
        self.params = list(runner.module.parameters())
        self.previous = [p.detach().clone() for p in self.params]
        self.current = self.previous

    def zero_grad(self) -> None:
        self.inner.zero_grad()
        self.current = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, old in zip(self.params, self.previous, strict=True):
                p.copy_(old)

    def step(self) -> None:
        with torch.no_grad():
            for p, now in zip(self.params, self.current, strict=True):
                p.copy_(now)
        self.inner.step()
        self.previous = self.current


def stale(runner: Any) -> None:
    runner.optimizer = Stale(runner)


def crafted(runner: Any) -> None:
    """Sends back the negated gradient of its input (before its boundary code encodes it)."""
    send = runner._send

    def negated(key: Any, tensor: Tensor, code: Any) -> None:
        send(key, -tensor if key.carries == "gradient" else tensor, code)

    runner._send = negated


@pytest.mark.parametrize(
    ("fault", "stage", "first_step", "boundary"),
    [
        (perturbed, 1, 0, ""),
        (skipped_layer, 0, 0, ""),
        (stale, 1, 2, ""),  # at step 0 the step before is the same model
        (bf16, 2, 0, ""),
        (crafted, 2, 0, ""),
        # the same faults behind encoded boundaries: what the stage sent is its output's wire form
        (perturbed, 1, 0, INT8),
        (stale, 1, 2, SUBSPACE),
        # a 1e-3 perturbation the wire hides under subspace_log: the sketch shows it
        (perturbed, 1, 0, SUBSPACE_LOG),
    ],
    ids=[
        "perturbed_1e-3",
        "skipped_layer",
        "stale_parameters",
        "bf16_forward",
        "crafted_gradients",
        "perturbed_1e-3-int8",
        "stale_parameters-subspace",
        "perturbed_1e-3-subspace_log",
    ],
)
def test_each_injected_fault_is_caught_with_its_evidence(
    hub, tmp_path, fault, stage, first_step, boundary
) -> None:
    _, got = run_pipeline(hub, tmp_path, {stage: fault}, boundary)
    found = wait_for(lambda: [f for f in flags(hub) if f["reason"] == "stage_mismatch"])
    node = got[[sa.stage for sa in got].index(stage)].node_id
    assert {f["node_id"] for f in found} == {node}, found
    f = found[0]
    ev = f["evidence"]
    assert ev["stage"] == stage and ev["step"] >= first_step and 0 <= ev["micro_batch"] < 4, ev
    assert ev["check"] == "stage_replay" and ev["threshold"] == 1e-4
    assert ev["boundary"] == (boundary.split('"')[1] if boundary else "fp32"), ev
    distances = [v for k, v in ev.items() if k.endswith("_distance")]
    assert max(distances) > ev["threshold"], ev
    assert f["suspends"] is True
    assert f"stage{stage}/step{ev['step']}/mb{ev['micro_batch']}" in f["update_id"]
    suspended = hub.call(lambda: hub.hub.app[LEDGER].scheduler.nodes[node].suspended)
    assert suspended is not None and "stage_mismatch" in suspended
    # the auditor's view of the flag, as for any other flag
    code, _, body = request(
        hub.url,
        "GET",
        f"/v1/flags/{f['id']}",
        None,
        {"Authorization": f"Bearer {hub.tokens['auditor']}"},
    )
    assert code == 200 and json.loads(body)["evidence"]["stage"] == stage, body
    # honest stages are never flagged
    assert all(f["node_id"] == node for f in flags(hub))
    if fault is perturbed:  # caught on every pick of the stage that was checked
        verdicts = hub.call(lambda: list(hub.hub.app[LEDGER].pipelines.checks.verdicts))
        mine = [v for what, v in verdicts if f" stage {stage} " in what]
        assert mine and not any(v.ok for v in mine), mine
        assert all(v.evidence["forward_sketch_projection_distance"] > 1e-4 for v in mine), mine


def test_verify_rate_is_a_share_and_defaults_to_five_percent() -> None:
    from gpuflex.protocol.errors import SpecError
    from gpuflex.protocol.jobspec import parse_job_spec

    assert parse_job_spec(SPEC.replace("verify_rate = 1.0\n", "")).pipeline.verify_rate == 0.05
    for bad in ("1.5", "-0.1", '"all"'):
        with pytest.raises(
            SpecError, match=r"pipeline\.verify_rate: expected a number in \[0, 1\]"
        ):
            parse_job_spec(SPEC.replace("verify_rate = 1.0", f"verify_rate = {bad}"))


def _header(step: int, carries: str, stage: int, to_stage: int) -> Any:
    from gpuflex.protocol.messages import RelayHeader
    from gpuflex.protocol.signing import new_nonce

    return RelayHeader(
        job_id="j-1",
        step=step,
        micro_batch=0,
        carries=carries,
        stage=stage,
        to_stage=to_stage,
        sha256="0" * 64,
        size=10,
        timestamp=time.time(),
        nonce=new_nonce(),
        generation=1,
    )


def test_a_pick_runs_once_its_tensors_and_its_states_are_in_either_order_within_its_memory() -> (
    None
):
    from gpuflex.hub.domain.pipelines.verify import Pick, StageChecks

    checks = StageChecks(store=None, blobs=None, scheduler=None, on_flag=lambda: None, max_bytes=45)  # type: ignore[arg-type]
    pick = Pick("j-1", 1, 1, 3, 2, 0, 4, "node", (1, 2))
    checks.picks[("j-1", 1, 2, 0, 1)] = pick
    # stage 1's input, output, the gradient back to it, and the one it sends back; and others'
    for carries, a, b in (
        ("activation", 0, 1),
        ("activation", 1, 2),
        ("gradient", 2, 1),
        ("gradient", 1, 0),
        ("tied", 0, 2),
    ):
        checks.observe(_header(2, carries, a, b), b"x" * 10)
    checks.observe(_header(3, "activation", 0, 1), b"y" * 10)  # another step: not kept
    assert set(pick.kept) == {"x", "out", "grad_out", "grad_in"} and checks.held_bytes == 40
    assert checks._ready.empty()  # its states are not durable yet
    checks.durable("j-1", 1, 2, {})
    assert checks._ready.get_nowait() is pick and not checks.picks
    # a pick that would take the checks past their memory is dropped, unchecked
    late = Pick("j-1", 1, 0, 3, 4, 0, 4, "node", (0, 1))
    checks.picks[("j-1", 1, 4, 0, 0)] = late
    checks.observe(_header(4, "activation", 0, 1), b"z" * 10)
    assert not checks.picks and checks.counts["dropped"] == 1 and checks.held_bytes == 40


def test_a_faulty_stage_of_the_second_of_two_pipelines_is_caught_and_the_rest_are_not(
    hub, tmp_path
) -> None:
    """Pipelines sharing the steps are checked slot by slot: stage 0 of pipeline 1 (slot 2) runs
    perturbed weights; its flag names its micro-batches (2 and 3 of the step's 4) and no other
    node is flagged."""
    keys = [register(hub.url) for _ in range(4)]
    for key in keys:  # all four idle before the job comes
        work(hub, key, 0.1)
    spec = DIGITS_SPEC.format(stages=2, steps=4, every=2) + "verify_rate = 1.0\npipelines = 2\n"
    code, job = submit(hub, tmp_path, spec)
    assert code == 201, job
    got = poll_until(hub, keys)
    assert {sa.lanes for sa in got} == {2}
    slot = [sa.stage for sa in got].index(2)
    drive_all(hub, keys, got, options={slot: {"tamper": perturbed, "timeout_s": 15.0}})
    found = wait_for(lambda: [f for f in flags(hub) if f["reason"] == "stage_mismatch"])
    assert {f["node_id"] for f in found} == {got[slot].node_id}, found
    ev = found[0]["evidence"]
    assert ev["stage"] == 2 and 2 <= ev["micro_batch"] < 4, ev
    assert all(f["node_id"] == got[slot].node_id for f in flags(hub))


def _middle_mlp_stage() -> tuple[list[Any], list[dict[str, Tensor]]]:
    """The digits MLP's middle unit and its state, seed 0: a stage behind two cuts."""
    from gpuflex.protocol.modelspec import ModelSpec, build_model
    from gpuflex.protocol.pipeline import cut_state, pipeline_units

    spec = ModelSpec.from_dict({"kind": "mlp", "input": 64, "hidden": [32, 16], "outputs": 10})
    units = pipeline_units(spec).units[1:2]
    return units, [cut_state(u, build_model(spec, seed=0).state_dict()) for u in units]


def _stage_work(
    units: list[Any],
    states: list[dict[str, Tensor]],
    before: Any,
    after: Any,
    x: Tensor,
    grad_out: Tensor,
    decoded_grad_out: Tensor,
) -> Any:
    """The evidence of a stage that ran ``x`` forward and ``decoded_grad_out`` backward."""
    from gpuflex.hub.policy.stage_check import StageEvidence
    from gpuflex.protocol.pipeline import load_unit

    stage = load_unit(units[0], states[0])
    received = before.decode(x).requires_grad_(True)
    out = stage(received)
    out.backward(decoded_grad_out)
    assert received.grad is not None
    return StageEvidence(
        x=x, out=after.encode(out), grad_out=grad_out, grad_in=before.encode(received.grad),
        inbound=before, outbound=after,
    )  # fmt: skip


def _judge(units: list[Any], states: list[dict[str, Tensor]], evidence: Any) -> Any:
    from gpuflex.hub.policy.stage_check import judge_stage

    return judge_stage(units, states, evidence, seed=0, step=0, micro_batch=0, tolerance=1e-4)


def test_the_referee_decodes_what_a_stage_received_and_measures_what_it_sent_by_its_code() -> None:
    """Pure (judge_stage): the middle stage of the digits MLP behind int8 cuts. Its honest wire
    forms reproduce; an output 1e-2 off, and an input whose scale is NaN, do not."""
    import dataclasses

    from gpuflex.protocol.boundarycodec import BoundaryCode
    from gpuflex.protocol.pipeline import load_unit
    from gpuflex.protocol.tensors import TensorSpec

    units, states = _middle_mlp_stage()
    before, after = (
        BoundaryCode("int8", 0, raw=TensorSpec("activation", "float32", (8, w)), seed=0, cut=c)
        for c, w in ((0, 32), (1, 16))
    )
    g = torch.Generator().manual_seed(0)
    x = before.encode(torch.randn(8, 32, generator=g))
    grad_out = after.encode(torch.randn(8, 16, generator=g))
    honest = _stage_work(units, states, before, after, x, grad_out, after.decode(grad_out))
    out = load_unit(units[0], states[0])(before.decode(x))

    def judge(evidence: Any) -> Any:
        return _judge(units, states, evidence)

    verdict = judge(honest)
    assert (
        verdict.ok
        and max(verdict.evidence["forward_distance"], verdict.evidence["backward_distance"]) < 1e-6
    )
    off = judge(dataclasses.replace(honest, out=after.encode(out * 1.01)))
    assert not off.ok and off.evidence["forward_distance"] > 1e-4, off.evidence
    nan = x.clone()
    nan[0, -4:] = torch.tensor([0, 0, -64, 127], dtype=torch.int8)  # the row's scale: NaN
    refused = judge(dataclasses.replace(honest, x=nan))
    assert not refused.ok and "does not decode" in refused.evidence["why"], refused.evidence


def test_the_referee_decodes_subspace_scaled_cuts_with_their_gain() -> None:
    """Pure (judge_stage): the middle stage of the digits MLP behind subspace_scaled cuts (rank 8,
    decoded 32/8 and 16/8 times larger). Honest work reproduces; a stage that decoded the
    gradient it got back without the gain (as subspace_log would) sends an input gradient the
    referee does not reproduce."""
    import dataclasses

    from gpuflex.protocol.boundarycodec import BoundaryCode
    from gpuflex.protocol.pipeline import load_unit
    from gpuflex.protocol.tensors import TensorSpec

    units, states = _middle_mlp_stage()
    codes = [
        BoundaryCode(b, 8, raw=TensorSpec("activation", "float32", (8, w)), seed=0, cut=c)
        for b in ("subspace_scaled", "subspace_log")
        for c, w in ((0, 32), (1, 16))
    ]
    before, after, _, after_unscaled = codes
    g = torch.Generator().manual_seed(0)
    x = before.encode(torch.randn(8, 32, generator=g))
    grad_out = after.encode(torch.randn(8, 16, generator=g))

    def evidence(decoded_grad_out: Tensor) -> Any:
        return _stage_work(units, states, before, after, x, grad_out, decoded_grad_out)

    def judge(e: Any) -> Any:
        return _judge(units, states, e)

    honest = judge(evidence(after.decode(grad_out)))
    assert honest.ok and honest.evidence["backward_distance"] < 1e-6, honest.evidence
    unscaled = judge(evidence(after_unscaled.decode(grad_out)))
    assert not unscaled.ok and unscaled.evidence["backward_distance"] > 1e-2, unscaled.evidence
    wrong = judge(dataclasses.replace(evidence(after.decode(grad_out)), out=after.encode(
        load_unit(units[0], states[0])(before.decode(x) / before.gain)
    )))  # fmt: skip
    assert not wrong.ok and wrong.evidence["forward_distance"] > 1e-2, wrong.evidence
