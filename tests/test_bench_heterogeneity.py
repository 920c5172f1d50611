"""bench/heterogeneity.py's core on a tiny configuration, so the bench cannot rot.

Real training (the node's trainer, inside each compute class) and the hub's real round policy,
as the bench runs them: 2 rounds, 1 local epoch, 4 chunks, 8 nodes in 2 classes (fp32, bf16).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import heterogeneity as het  # noqa: E402
from gpuflex.hub.policy import verification as vf  # noqa: E402
from gpuflex.node.device import compute_class  # noqa: E402
from gpuflex.protocol.compute import class_key  # noqa: E402

TINY = het.Setup(rounds=2, epochs=1, chunks=4, classes=("fp32", "bf16"), attacks=("sign_flip",), n_nodes=8)


@pytest.fixture(scope="module")
def mlp_job() -> dict:
    return het.run_job("mlp", TINY, log=lambda _line: None)


def test_class_keys_are_the_products_and_differ():
    before = torch.get_num_threads()
    keys = {c: het.key_of(c) for c in het.CLASSES}
    assert torch.get_num_threads() == before  # the class context restores the thread count
    assert len(set(keys.values())) == len(keys), keys  # four distinct classes
    with het.numeric_class("fp32-t2") as (precision, _, _):
        assert keys["fp32-t2"] == class_key(compute_class(torch.device("cpu")), precision)
    assert keys["bf16"].endswith("|bf16") and "|no-onednn|" in keys["fp32-nodnn"] and "|t2|" in keys["fp32-t2"]


def test_the_policy_gets_the_members_class_keys():
    world = het.make_world("mlp", epochs=1, chunks=4)
    sim = het.HeteroSimulation(world, None, 0, 1, classes=["fp32", "bf16"], n_nodes=4)
    mixed = sim.replica_state(2, 0.0, True, {"n00", "n01"})
    same = sim.replica_state(2, 0.0, True, {"n00", "n02"})
    assert mixed.comparison == "cross_class" and mixed.class_keys["n01"].endswith("|bf16")
    assert same.comparison == "same_class"


def test_crafted_update_flips_the_output_layer_under_the_norm_bound():
    delta = {"0.weight": torch.ones(3, 2), "0.bias": torch.ones(3), "2.weight": torch.full((2, 3), 2.0),
             "2.bias": torch.ones(2), "steps": torch.tensor(4)}
    out = het.craft(delta)
    assert torch.equal(out["2.weight"], -2.0 * het.COLLUDE_SCALE * torch.ones(2, 3))
    assert torch.equal(out["0.bias"], het.COLLUDE_SCALE * torch.ones(3))
    assert torch.equal(out["steps"], delta["steps"])
    norm = math.sqrt(sum(float((t.double() ** 2).sum()) for k, t in out.items() if t.is_floating_point()))
    base = math.sqrt(sum(float((t.double() ** 2).sum()) for k, t in delta.items() if t.is_floating_point()))
    assert norm == pytest.approx(het.COLLUDE_SCALE * base) and het.COLLUDE_SCALE < het.VSPEC.norm_bound


def test_the_adaptive_adversary_bends_its_inverted_layer_just_over_the_trend_threshold():
    """What it sends stays over trend_cosine_min by the hub's own measure, and is still the
    inverted output layer in every direction the trend does not cover."""
    gen = torch.Generator().manual_seed(3)
    delta = {"0.weight": torch.randn(4, 3, generator=gen), "0.bias": torch.randn(4, generator=gen),
             "2.weight": torch.randn(2, 4, generator=gen), "2.bias": torch.randn(2, generator=gen)}
    trend = {k: v * 0.5 + 0.1 * torch.randn(v.shape, generator=gen) for k, v in delta.items()}
    then = {k: torch.zeros_like(v) for k, v in delta.items()}
    plain = het.craft(delta)
    assert vf.trend_alignment(plain, trend, then)[0] < 0.0  # the inverted layer points against it
    out = het.craft_adaptive(delta, trend)
    cos, _ = vf.trend_alignment(out, trend, then)
    assert cos == pytest.approx(het.ADAPTIVE_COSINE, abs=1e-6) and cos >= het.VSPEC.trend_cosine_min
    assert all(torch.equal(out[k], plain[k]) for k in ("0.weight", "0.bias"))  # the other layers as crafted
    no_trend = het.craft_adaptive(delta, None)
    assert all(torch.equal(no_trend[k], plain[k]) for k in plain)


def test_the_forgers_commitment_binds_its_craft_and_only_its_last_segment_gives_it_away():
    """The forger (FORGER): its forged last state binds the uploaded update, its norms pass the
    path-length check and the norm test, every segment but the last reproduces, the last does not."""
    from gpuflex.hub.policy.referee import judge_segment, replay_onednn

    world = het.make_world("mlp", epochs=2, chunks=4)
    chunks, cfg, state = world["chunks"][:2], world["cfg"], world["state0"]
    honest, states = het.rb.train_committed(world["spec"], state, chunks, cfg, seed=5)
    work = het.rb.Work(vf.UpdateRecord(update_id="u", node_id="n", shard_id="s", samples_claimed=128,
                                       shard_samples=128, loss=1.0, train_s=1.0, node_samples_per_s=0.0,
                                       delta=het.craft(honest.delta)),
                       "sha", True, honest.commitment, states, chunks, 5, state)
    forged = het.forge(work, state)
    c = forged.commitment
    assert c is not None and c.hashes[:-1] == honest.commitment.hashes[:-1] and c.hashes[-1] != honest.commitment.hashes[-1]
    norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in forged.rec.delta.values() if t.is_floating_point()))
    assert norm <= forged.rec.path_length  # scaled down to the path its claims add up to
    assert vf.review_round([forged.rec], 10.0, het.VSPEC).flags == []  # the path-length check passes
    x, y = het.rb.stack_data(chunks)
    outcomes = [judge_segment(update_id="u", node_id="n", round=0, spec=world["spec"], cfg=cfg, seed=5, commitment=c,
                              segment=i, states=forged.states, global_state=state, delta=forged.rec.delta, x=x, y=y,
                              tolerance=het.VSPEC.segment_tolerance, onednn=replay_onednn(None)).outcome
                for i in range(len(c.norms))]
    assert outcomes == ["reproduced"] * (len(c.norms) - 1) + ["mismatch"], outcomes


def test_a_tiny_job_runs_every_part(mlp_job):
    runs = mlp_job["runs"]
    assert het.rb.CHUNKS_PER_SHARD == 2  # robustness.py's shard size is back after the job
    assert list(runs) == ["plain_fp32", "only_bf16", "mixed_clean", "sign_flip", "coordinated",
                          "coordinated_patient", "coordinated_adaptive", "coordinated_forger", "adaptive_full_audit",
                          "adaptive_full_audit_every1", "forger_full_audit"]
    plain = runs["plain_fp32"]
    steps = math.ceil(TINY.chunks_per_shard * 64 / 32) * TINY.epochs
    shards = TINY.chunks // TINY.chunks_per_shard * TINY.rounds
    assert plain["trainings"] == plain["shards"] == shards  # no replica: every shard trained once
    assert plain["steps"] == plain["shards"] * steps and plain["cross_class_pairs"] == 0
    assert plain["referee_checks"] == 0  # the plain baseline: no replica, no referee
    mixed = runs["mixed_clean"]
    assert mixed["trainings"] > mixed["shards"]  # new nodes are replicated
    assert mixed["cross_class_pairs"] > 0  # replicas met across classes and were compared
    assert mixed["cross_class_bitwise_equal"] < mixed["cross_class_pairs"]  # fp32 and bf16 differ
    assert mixed["cross_class_flagged"] == 0 and mixed["honest_flagged"] == 0  # honest divergence is no flag
    assert mixed["honest_flags_by_reason"] == {}
    assert mixed["referee_checks"] > 0  # disagreeing cross-class replicas went to the referee
    assert runs["only_bf16"]["cross_class_pairs"] == 0
    assert mixed["verify_cpu_s"] > 0 and mixed["train_cpu_s"] > 0
    # one sign_flip attacker in every class, and every malicious update accounted for
    assert runs["sign_flip"]["attackers_by_class"] == {"bf16": 1, "fp32": 1}
    assert runs["coordinated"]["attackers_by_class"] == {"bf16": 1, "fp32": 1}
    assert runs["mixed_clean"]["attackers_by_class"] == {"bf16": 0, "fp32": 0}
    cells = runs["sign_flip"]["by_attack_class"]
    assert set(cells) <= {"sign_flip/fp32", "sign_flip/bf16"}
    assert sum(c["submitted"] for c in cells.values()) == runs["sign_flip"]["malicious_updates"] > 0
    assert runs["coordinated"]["malicious_updates"] > 0
    for r in runs.values():
        assert 0.0 <= r["accuracy"] <= 1.0
    assert set(mlp_job["accuracy_gap_points"]) == {"fp32", "bf16"} and mlp_job["accuracy_gap_points"]["fp32"] == 0


def test_figures_and_verdicts(mlp_job):
    jobs = {"mlp": mlp_job}
    fig = het.figures(jobs)
    runs = [r for n, r in mlp_job["runs"].items()
            if n not in ("plain_fp32", *het.AUDIT_RUNS)]
    assert fig["cross_class_pairs"] == sum(r["cross_class_pairs"] for r in runs) > 0
    assert fig["honest_flagged"] == sum(r["honest_flagged"] for r in runs)
    assert fig["malicious_updates"] == mlp_job["runs"]["sign_flip"]["malicious_updates"]
    assert 0.0 <= fig["detection_rate"] <= 1.0
    assert fig["colluder_inclusion"]["coordinated"]["submitted"] == mlp_job["runs"]["coordinated"]["malicious_updates"]
    assert fig["colluder_inclusion"]["coordinated"]["submitted"] > 0
    # the patient adversary is not trusted within 2 rounds: it trains honestly, nothing is crafted
    assert mlp_job["runs"]["coordinated_patient"]["malicious_updates"] == 0
    assert mlp_job["runs"]["coordinated_adaptive"]["malicious_updates"] == 0
    assert mlp_job["runs"]["coordinated_forger"]["malicious_updates"] == 0
    assert fig["colluder_inclusion_forger_full_audit"] == {"aggregated": 0, "submitted": 0}
    assert fig["colluder_inclusion_full_audit"] == {"aggregated": 0, "submitted": 0}
    assert fig["referee_steps_fraction_full_audit"] == (mlp_job["runs"]["adaptive_full_audit"]["referee_steps"] or 0) / \
        mlp_job["runs"]["adaptive_full_audit"]["steps"]
    fine, coarse = mlp_job["runs"]["adaptive_full_audit_every1"], mlp_job["runs"]["adaptive_full_audit"]
    assert fine["steps"] == coarse["steps"]  # the same work, committed at every step
    assert fig["node_commit_cost_every1_vs_default"] == fine["train_cpu_s"] / coarse["train_cpu_s"] - 1
    assert fig["verification_cost_fraction_full_audit_every1"] == fine["verify_cpu_s"] / fine["train_cpu_s"]
    assert set(fig["accuracy_gap_points"]) == {"mlp/fp32", "mlp/bf16"}
    check = het.verdicts(fig)
    assert check["cross_class_pairs"]["met"] is False  # 2 rounds cannot reach 1,000 pairs
    assert check["honest_flagged"]["met"] is (fig["honest_flagged"] == 0)


def test_main_writes_the_results(tmp_path, capsys):
    out = tmp_path / "h.json"
    assert het.main(["--rounds", "1", "--epochs", "1", "--chunks", "4", "--jobs", "seq", "--classes", "fp32,bf16",
                     "--attacks", "free_rider", "--no-coordinated", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["bench"] == "heterogeneity" and set(data["jobs"]) == {"seq"}
    assert data["classes"]["bf16"]["class_key"].endswith("|bf16")
    assert set(data["met"]) == set(het.TARGETS)
    text = capsys.readouterr().out
    assert "seq  mixed_clean" in text and "cross_class_pairs" in text
    with pytest.raises(SystemExit):
        het.main(["--classes", "fp64", "--out", str(tmp_path / "x.json")])
