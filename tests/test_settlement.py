"""Settling a shard at upload (hub/policy/settlement.py), and the one training config a shard's
node and the referee both use (JobState.train_config)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from gpuflex.hub.model.job import ChunkInfo, JobState
from gpuflex.hub.policy.settlement import Settlement, settle_at_upload
from gpuflex.hub.policy.verification import Reputation
from gpuflex.protocol.jobspec import VerificationSpec, parse_job_spec
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import digits_spec

SPEC = VerificationSpec(spot_check=0.25, spot_check_trusted=0.1, trust_after=3)
TRUSTED = Reputation(consecutive_agreements=3)
NEW = Reputation()


def lone(**kw: Any) -> Settlement:
    """The decision on an open shard wanting one update, none in yet, no trend measured, by an
    untrusted node, with a draw the spot-check misses; ``kw`` changes one of these."""
    args: dict[str, Any] = {"wanted": 1, "accepted": 0, "shard_state": "open", "trend_measured": False,
                               "reputation": NEW, "spec": SPEC, "spot_draw": 0.9}
    return settle_at_upload(**(args | kw))


def test_a_lone_update_of_an_open_unreplicated_shard_settles_it():
    assert lone() == Settlement(True, "lone_update")


@pytest.mark.parametrize(("change", "reason"), [
    ({"wanted": 2}, "replicated"),
    ({"accepted": 1}, "not_first"),
    ({"shard_state": "settled"}, "not_open"),
    ({"shard_state": "dropped"}, "not_open"),
    ({"trend_measured": True}, "trend"),
    ({"spot_draw": 0.2}, "spot_check"),
])
def test_the_engine_decides_every_other_shard(change, reason):
    assert lone(**change) == Settlement(False, reason)


def test_the_spot_check_draws_against_the_rate_for_the_nodes_trust():
    # 0.2 is under the untrusted rate (0.25) but over the trusted one (0.1)
    assert lone(spot_draw=0.2).reason == "spot_check"
    assert lone(spot_draw=0.2, reputation=TRUSTED).settles
    assert lone(spot_draw=0.05, reputation=TRUSTED).reason == "spot_check"
    # a banned node or one on probation is not trusted, whatever its run
    assert lone(spot_draw=0.2, reputation=dataclasses.replace(TRUSTED, probation=True)).reason == "spot_check"
    assert lone(spot_draw=0.2, reputation=dataclasses.replace(TRUSTED, banned=True)).reason == "spot_check"


def test_without_spot_checks_no_draw_stops_a_lone_update():
    off = VerificationSpec(spot_check=0.0, spot_check_trusted=0.0)
    assert lone(spec=off, spot_draw=0.0).settles


@given(wanted=st.integers(1, 4), accepted=st.integers(0, 3), state=st.sampled_from(["open", "settled", "dropped"]),
       trend=st.booleans(), run=st.integers(0, 5), banned=st.booleans(), probation=st.booleans(),
       spot=st.sampled_from([0.0, 0.1, 0.5, 1.0]), spot_trusted=st.sampled_from([0.0, 0.05, 1.0]),
       draw=st.floats(0.0, 1.0, exclude_max=True))
def test_it_settles_exactly_when_every_condition_holds(wanted, accepted, state, trend, run, banned, probation,
                                                       spot, spot_trusted, draw):
    spec = VerificationSpec(spot_check=spot, spot_check_trusted=spot_trusted, trust_after=3)
    rep = Reputation(consecutive_agreements=run, banned=banned, probation=probation)
    trusted = run >= 3 and not banned and not probation
    rate = spot_trusted if trusted else spot
    expected = wanted == 1 and accepted == 0 and state == "open" and not trend and not (rate > 0 and draw < rate)
    got = settle_at_upload(wanted=wanted, accepted=accepted, shard_state=state, trend_measured=trend,
                           reputation=rep, spec=spec, spot_draw=draw)
    assert got.settles == expected
    assert (got.reason == "lone_update") == expected


# -- JobState.train_config ------------------------------------------------------------------------
def job_of(spec_text: str, chunks: int = 20, chunk_samples: int = 10) -> JobState:
    job = JobState(id="j-1", owner="o", name="n", spec=parse_job_spec(spec_text), state="running", round=0,
                   rounds=2, model_hash="0" * 64, model_size=1,
                   chunks=[ChunkInfo(i, f"{i:064x}", chunk_samples, 100) for i in range(chunks)],
                   val_sha=None, opt_state_sha=None, created_at=0.0)
    job.open_round()
    return job


LINEAR = digits_spec(spot_check=0.25).replace("seed = 0\n", 'seed = 0\nlr_scaling = "linear"\nlr_scale_max = 4\n')


def test_a_shards_config_scales_the_lr_for_its_share_of_the_round():
    job = job_of(LINEAR)  # a round of 200 samples
    assert job.train_config(100).lr == pytest.approx(0.05 * 2)
    assert job.train_config(50).lr == pytest.approx(0.05 * 4)
    assert job.train_config(10).lr == pytest.approx(0.05 * 4)  # capped at lr_scale_max
    assert job.train_config(200).lr == pytest.approx(0.05)
    assert job_of(digits_spec()).train_config(10).lr == pytest.approx(0.05)  # lr_scaling "none"


def test_a_shards_config_carries_the_jobs_settings_and_the_nodes_precision():
    job = job_of(LINEAR)
    cfg = job.train_config(50, "bf16")
    assert cfg == dataclasses.replace(job.spec.train.train_config("bf16"), lr=cfg.lr, commit=True,
                                      checkpoint_every=int(job.spec.verification.checkpoint_every),
                                      update=job.spec.communication.update,
                                      topk_fraction=job.spec.communication.topk_fraction,
                                      error_feedback=job.spec.communication.error_feedback)
    assert cfg.precision == "bf16" and not cfg.secagg
    assert job.train_config(50).precision == "fp32"  # the referee's replay: "auto" reads as fp32
    # a job that can never ask the referee spares its nodes the commitment
    assert not job_of(digits_spec()).train_config(50).commit


def test_a_secure_aggregation_jobs_config_carries_its_settings():
    text = """
[job]
name = "secagg"
[model]
kind = "mlp"
input = 64
hidden = [16]
outputs = 10
[train]
rounds = 2
batch_size = 32
lr = 0.1
[data]
source = "node-local"
max_samples = 1000
quorum = 3
round_deadline_s = 30
[privacy]
secure_aggregation = true
secagg_bits = 20
"""
    cfg = job_of(text).train_config(100)
    p = parse_job_spec(text).privacy
    assert (cfg.secagg, cfg.secagg_clip, cfg.secagg_bits, cfg.secagg_max_samples) == (True, p.secagg_clip, 20, 1000)
