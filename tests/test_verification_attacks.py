"""The attack catalogue itself (tests/tooling/attacks.py): transforms, agents, CLI."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tests.tooling import attacks as atk

torch.set_num_threads(1)


def delta():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(8, 4, generator=g),
        "b": torch.randn(4, generator=g),
        "n": torch.tensor(3),
    }


def norm(d):
    return math.sqrt(
        sum(float(t.double().pow(2).sum()) for t in d.values() if t.is_floating_point())
    )


def test_pure_transforms_return_new_tensors_and_do_what_they_say():
    d = delta()
    before = {k: v.clone() for k, v in d.items()}
    assert torch.equal(atk.sign_flip(d)["w"], -d["w"])
    assert torch.equal(atk.scale(d, 10.0)["b"], d["b"] * 10)
    assert all(torch.count_nonzero(t) == 0 for k, t in atk.zero_update(d).items() if k != "n")
    noisy = atk.gaussian_noise(d, relative=10.0, seed=1)
    extra = {k: noisy[k] - d[k] for k in ("w", "b")}
    assert 7.0 < norm(extra) / norm(d) < 13.0
    assert torch.equal(atk.gaussian_noise(d, seed=1)["w"], noisy["w"])  # deterministic per seed
    assert torch.equal(atk.sign_flip(d)["n"], d["n"])  # non-floating copied
    assert all(torch.equal(d[k], before[k]) for k in d)


def test_data_transforms():
    chunk = {"x": torch.zeros(6, 2), "y": torch.tensor([0, 1, 2, 9, 5, 4])}
    assert atk.flip_labels(chunk, 10)["y"].tolist() == [9, 8, 7, 0, 4, 5]
    one = atk.half_of_chunks([chunk])
    assert sum(int(c["x"].shape[0]) for c in one) == 3  # a one-chunk shard is halved too
    three = atk.half_of_chunks([chunk, chunk, chunk])
    assert sum(int(c["x"].shape[0]) for c in three) == 9


def test_attack_objects_around_a_train_result():
    from gpuflex.node.trainer import TrainResult

    r1 = TrainResult(delta=delta(), sample_count=64, loss=0.5, train_s=0.2, steps=2)
    r2 = TrainResult(delta=atk.scale(delta(), 2.0), sample_count=64, loss=0.4, train_s=0.2, steps=2)
    stale = atk.make_attack("stale_replay")
    assert stale.finish(r1, claimed_samples=64, seed=1) is r1  # the first one is honest
    replay = stale.finish(r2, claimed_samples=64, seed=2)
    assert torch.allclose(replay.delta["w"], r1.delta["w"], atol=1e-5)
    assert not torch.equal(replay.delta["w"], r1.delta["w"])  # not byte-identical
    lazy = atk.make_attack("half_shard").finish(
        TrainResult(delta=delta(), sample_count=32, loss=0.5, train_s=0.1, steps=1),
        claimed_samples=64,
        seed=0,
    )
    assert lazy.sample_count == 64 and lazy.train_s == pytest.approx(0.2)
    rider = atk.make_attack("free_rider").finish(r1, claimed_samples=64, seed=0)
    assert norm(rider.delta) == 0.0 and rider.sample_count == 64
    with pytest.raises(ValueError, match="unknown attack"):
        atk.make_attack("nope")


def test_agent_subclass_overrides_the_contract_hooks():
    from gpuflex.node.agent import NodeAgent
    from gpuflex.node.trainer import TrainResult

    cls = atk.agent_class("sign_flip")
    assert issubclass(cls, NodeAgent) and cls.__name__ == "SignFlipAgent"
    agent = object.__new__(cls)  # hooks only: no key, no data dir, no network
    agent.attack = atk.make_attack("sign_flip")
    assignment = SimpleNamespace(
        chunks=[SimpleNamespace(samples=64)] * 3, seed=7, model_spec={"outputs": 10}
    )
    r = TrainResult(delta=delta(), sample_count=192, loss=0.5, train_s=0.2, steps=6)
    out = agent.transform_update(assignment, r)
    assert torch.equal(out.delta["w"], -r.delta["w"])
    assert NodeAgent.transform_update(agent, assignment, r) is r  # the shipped node: identity


def test_cli_runs_the_real_node_cli_with_the_attack_agent(monkeypatch):
    from gpuflex.node import cli

    seen = {}

    def fake_main(argv=None, *, agent_cls=None):
        seen["argv"], seen["cls"] = argv, agent_cls
        return 0

    monkeypatch.setattr(cli, "main", fake_main)
    rc = atk.main(
        [
            "--attack",
            "half_shard",
            "run",
            "--hub",
            "http://127.0.0.1:1",
            "--data-dir",
            "/tmp/x",
            "--once",
        ]
    )
    assert rc == 0
    assert seen["argv"] == ["run", "--hub", "http://127.0.0.1:1", "--data-dir", "/tmp/x", "--once"]
    assert seen["cls"].__name__ == "HalfShardAgent"


def _record(uid, node, d):
    from gpuflex.hub.policy.update_record import UpdateRecord

    return UpdateRecord(
        update_id=uid,
        node_id=node,
        shard_id="s0",
        samples_claimed=64,
        shard_samples=64,
        loss=0.5,
        train_s=0.2,
        node_samples_per_s=0.0,
        delta=d,
    )


def test_the_round_policy_does_not_let_an_identical_pair_of_attackers_settle_a_shard():
    """Deterministic attacks agree with themselves: two colluders handed the same shard must
    not settle it (hub/policy.decide_shard, the function the hub and the bench run)."""
    from gpuflex.hub.policy.reputation import Reputation
    from gpuflex.hub.policy.round_policy import (
        Drop,
        ReplicaState,
        Settle,
        WaitForMore,
        decide_shard,
    )
    from gpuflex.protocol.jobspec import VerificationSpec

    spec = VerificationSpec()
    bad = atk.sign_flip(delta())
    c1, c2 = _record("u1", "c1", bad), _record("u2", "c2", atk.sign_flip(delta()))
    new = {"c1": Reputation(), "c2": Reputation(), "h": Reputation()}
    pair = decide_shard([c1, c2], spec, ReplicaState(wanted=2), new)
    assert isinstance(pair, WaitForMore) and pair.wanted == 3
    # The third replica (untrusted, honest) blatantly dissents: the pair's majority stands for
    # now, and review_round then meets their sign-flipped canonical (the vouching rule).
    h = _record("u3", "h", delta())
    three = decide_shard([c1, c2, h], spec, ReplicaState(wanted=3), new)
    assert isinstance(three, Settle) and three.flagged_nodes == ("h",)
    # A trusted third replica: the plain majority rule, and still never the pair's word alone.
    trusted = dict(new, h=Reputation(consecutive_agreements=spec.trust_after))
    assert isinstance(decide_shard([c1, c2, h], spec, ReplicaState(wanted=3), trusted), Settle)
    # Nobody could take a third replica: the unanimous pair settles UNVERIFIED (no agreement
    # credit, so neither colluder moves toward trust); a split that times out is dropped.
    lonely = decide_shard([c1, c2], spec, ReplicaState(wanted=2, taker=False), new)
    assert (
        isinstance(lonely, Settle)
        and lonely.unverified == "replica_wait"
        and lonely.agreed_nodes == ()
    )
    split = decide_shard([c1, h], spec, ReplicaState(wanted=2, waited_s=spec.replica_wait_s), new)
    assert isinstance(split, Drop) and split.reason == "inconclusive" and split.flags == ()
