"""Aggregation strategies (hub/policy/strategy.py), the weighting and late-carry rules
(strategy.aggregation_weights, hub/policy/late.py) and the job spec's optional
``[aggregation] strategy``: every existing spec means the strategy its fields name, a registered
strategy is chosen by name and run by the round engine untouched."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
from gpuflex.hub.domain.rounds import RoundEngine
from gpuflex.hub.model.job import JobState, ShardState, UpdateState
from gpuflex.hub.policy import strategy as st
from gpuflex.hub.policy.aggregation import AggregationError, aggregate
from gpuflex.hub.policy.late import Straggler, carry_late
from gpuflex.hub.policy.server_optimizer import ServerOptimizer
from gpuflex.hub.storage.blobs import BlobStore
from gpuflex.protocol.errors import SpecError
from gpuflex.protocol.jobspec import AggregationSpec, derived_strategy, parse_job_spec, strategy_of
from gpuflex.protocol.modelspec import build_model
from gpuflex.protocol.tensors import decode_state, encode_state
from torch import Tensor

HEAD = """
[job]
name = "s"
[model]
kind = "mlp"
input = 8
hidden = [16]
outputs = 3
"""
SILOS = """
[data]
source = "node-local"
quorum = 3
"""


def _spec(aggregation: str = "", privacy: str = "", data: str = "") -> str:
    return HEAD + data + ("[aggregation]\n" + aggregation if aggregation else "") + (
        "[privacy]\n" + privacy if privacy else "")


@pytest.mark.parametrize(("text", "name"), [
    (_spec(), "fedavg"),
    (_spec('method = "median"\n'), "median"),
    (_spec('method = "krum"\nserver_optimizer = "fedadam"\nserver_lr = 0.1\n'), "krum"),
    (_spec('server_optimizer = "fedavgm"\n'), "fedavgm"),
    (_spec('server_optimizer = "fedadam"\nserver_lr = 0.1\n'), "fedadam"),
    (_spec('server_optimizer = "nesterov"\n'), "fedavg"),
    (_spec(privacy='dp = "central"\n', data=SILOS), "central_dp"),
    (_spec(privacy="secure_aggregation = true\n", data=SILOS), "secure_aggregation"),
])
def test_a_spec_without_a_strategy_means_the_one_its_fields_name(text: str, name: str) -> None:
    spec = parse_job_spec(text)
    assert spec.aggregation.strategy is None
    assert strategy_of(spec) == st.strategy_name(spec) == name
    assert name in st.registered()
    line = f'strategy = "{name}"\n'
    named_text = (text.replace("[aggregation]\n", "[aggregation]\n" + line) if "[aggregation]\n" in text
                  else text + "[aggregation]\n" + line)
    named = parse_job_spec(named_text)  # naming it changes nothing else
    assert named.aggregation.strategy == name and strategy_of(named) == name
    assert dataclasses.replace(named, aggregation=dataclasses.replace(named.aggregation, strategy=None)) == spec


def test_a_named_strategy_that_contradicts_the_fields_or_the_privacy_is_refused() -> None:
    with pytest.raises(SpecError, match=r"aggregation\.strategy: this spec's fields mean 'fedavg', not 'median'"):
        parse_job_spec(_spec('strategy = "median"\n'))
    with pytest.raises(SpecError, match=r"aggregation\.strategy: this spec's fields mean 'central_dp'"):
        parse_job_spec(_spec('strategy = "my_rule"\n', privacy='dp = "central"\n', data=SILOS))
    with pytest.raises(SpecError, match=r"aggregation\.strategy: expected a name"):
        parse_job_spec(_spec('strategy = "My Rule"\n'))
    with pytest.raises(SpecError, match=r"aggregation\.strategy"):
        parse_job_spec(_spec("strategy = 3\n"))
    spec = parse_job_spec(_spec('method = "median"\nstrategy = "my_rule"\n'))
    assert strategy_of(spec) == "my_rule" and derived_strategy(spec.aggregation, spec.privacy) == "median"
    with pytest.raises(AggregationError, match="this hub has no strategy 'my_rule'"):
        st.check_registered(spec)


def test_the_weighting_rule() -> None:
    cs = [st.Contribution("a", "n1", 100, 0.5, 1.0), st.Contribution("b", "n2", 30, 1.0, 0.25)]
    w = st.aggregation_weights(cs, central_dp=False)
    assert w == st.Weighting((50.0, 30.0), (1.0, 0.25), bounds_applied=True)
    dp = st.aggregation_weights(cs, central_dp=True)
    assert dp == st.Weighting((1.0, 1.0), (1.0, 1.0), bounds_applied=False)


@pytest.mark.parametrize(("kw", "carried"), [
    ({"node_local": True, "late": "next", "secure_aggregation": False, "last_round": False}, ("a",)),
    ({"node_local": True, "late": "drop", "secure_aggregation": False, "last_round": False}, ()),
    ({"node_local": False, "late": "next", "secure_aggregation": False, "last_round": False}, ()),
    ({"node_local": True, "late": "next", "secure_aggregation": True, "last_round": False}, ()),
    ({"node_local": True, "late": "next", "secure_aggregation": False, "last_round": True}, ()),
])
def test_late_updates_are_carried_once_into_the_next_round(kw: dict[str, object], carried: tuple[str, ...]) -> None:
    # b was carried already, c's shard is gone: neither is carried again
    stragglers = [Straggler("a", None, True), Straggler("b", 3, True), Straggler("c", None, False)]
    out = carry_late(stragglers, **kw)  # type: ignore[arg-type]
    assert out.carried == carried
    assert out.cancelled == tuple(s.assignment_id for s in stragglers if s.assignment_id not in carried)


def _deltas(n: int) -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [{"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)} for _ in range(n)]


def test_the_builtin_rules_aggregate_as_the_functions_they_wrap() -> None:
    deltas = _deltas(5)
    cs = [st.Contribution(f"u{i}", f"n{i}", 10 + i, 1.0, 0.5 if i == 2 else 1.0) for i in range(5)]
    for method in ("fedavg", "median", "trimmed_mean", "krum", "multi_krum"):
        spec = parse_job_spec(_spec(f'method = "{method}"\n'))
        s = st.strategy_for(st.StrategyContext(spec=spec))
        plan = s.configure(cs)
        got = s.aggregate(deltas, plan, model={}).delta
        want = aggregate(deltas, [10.0, 11.0, 12.0, 13.0, 14.0], spec.aggregation, scales=[1, 1, 0.5, 1, 1])
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert s.server_optimizer().kind == "none"


def test_central_dp_clips_and_averages_with_equal_weights() -> None:
    spec = parse_job_spec(_spec(privacy='dp = "central"\nclip_norm = 0.5\nnoise_multiplier = 0.0\n', data=SILOS))
    s = st.strategy_for(st.StrategyContext(spec=spec))
    assert isinstance(s, st.CentralDP)
    deltas = _deltas(3)
    cs = [st.Contribution(f"u{i}", f"n{i}", 10 * (i + 1), 0.1, 0.1) for i in range(3)]
    plan = s.configure(cs)
    assert plan.weighting.weights == (1.0, 1.0, 1.0) and not plan.weighting.bounds_applied
    out = s.aggregate(deltas, plan, model={})
    norms = [float(torch.cat([t.reshape(-1) for t in d.values()]).norm()) for d in deltas]
    want = aggregate(deltas, [1.0] * 3, AggregationSpec(), scales=[min(1.0, 0.5 / n) for n in norms])
    assert all(torch.allclose(out.delta[k], want[k]) for k in want)
    assert out.evidence["privacy"]["updates"] == 3 and out.evidence["privacy"]["noise_std"] == 0.0


def test_a_strategy_is_registered_once() -> None:
    with pytest.raises(ValueError, match="registered already"):
        st.register("fedavg")(st.FedAvg)


@st.register("test_hold_still")
class HoldStill:
    """A contributed strategy: every update counts, and the model does not move."""

    opens_updates: ClassVar[bool] = True
    seen: ClassVar[list[tuple[str, ...]]] = []

    def __init__(self, *, spec: AggregationSpec) -> None:
        self.spec = spec

    @classmethod
    def from_context(cls, ctx: st.StrategyContext) -> HoldStill:
        return cls(spec=ctx.spec.aggregation)

    def configure(self, contributions: Sequence[st.Contribution]) -> st.RoundPlan:
        return st.RoundPlan(tuple(c.update_id for c in contributions), st.sample_weighting(contributions))

    def aggregate(self, deltas: Sequence[Mapping[str, Tensor]], plan: st.RoundPlan, *,
                  model: Mapping[str, Tensor]) -> st.Aggregate:
        HoldStill.seen.append(plan.included)
        return st.Aggregate({k: torch.zeros_like(t) for k, t in deltas[0].items()}, {"held": len(deltas)})

    def server_optimizer(self) -> ServerOptimizer:
        return ServerOptimizer.from_spec(self.spec)


def test_the_round_engine_runs_a_registered_strategy_the_spec_names(tmp_path: Path) -> None:
    spec = parse_job_spec(_spec('strategy = "test_hold_still"\n'))
    st.check_registered(spec)
    blobs = BlobStore(tmp_path / "blobs")
    state = {k: v.detach().clone() for k, v in build_model(spec.model, 0).state_dict().items()}
    model = encode_state(state)
    engine = RoundEngine(store=None, blobs=blobs, scheduler=SimpleNamespace(nodes={}),  # type: ignore[arg-type]
                         metrics=None, signal=None, audit=SimpleNamespace(append=lambda *_: None),  # type: ignore[arg-type]
                         audit_secret=b"k")
    job = JobState(id="j", owner="o", name="s", spec=spec, state="running", round=0, rounds=2,
                   model_hash=blobs.put(model), model_size=len(model), chunks=[], val_sha=None,
                   opt_state_sha=None, created_at=time.time())
    reps, shard_of = [], {}
    for i, d in enumerate(_model_deltas(state, 2)):
        u = UpdateState(id=f"u{i}", assignment_id=f"a{i}", shard_id=f"s{i}", node_id=f"n{i}",
                        sha=blobs.put(encode_state(d)), size=0, sample_count=8, loss=1.0, train_s=1.0,
                        received_at=0.0, elapsed_s=1.0)
        reps.append(u)
        shard_of[u.id] = ShardState(id=u.shard_id, job_id=job.id, round=0, seq=i, seed=0, chunk_idxs=(i,),
                                    samples=8, replica_group="g", wanted=1)
    reps.sort(key=lambda u: (u.sha, u.id))
    result = engine.closing.aggregation.aggregate(job, reps, shard_of, {})
    assert HoldStill.seen[-1] == tuple(u.id for u in reps)
    assert result.evidence["held"] == 2
    new = decode_state(blobs.read(result.model_hash))
    assert all(torch.equal(new[k], state[k]) for k in state)


def _model_deltas(state: Mapping[str, Tensor], n: int) -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(9)
    return [{k: torch.randn(t.shape, generator=g) * 1e-3 for k, t in state.items()} for _ in range(n)]
