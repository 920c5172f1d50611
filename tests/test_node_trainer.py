"""node/trainer.py: deterministic, contract-shaped training of one assignment."""

from __future__ import annotations

import copy

import pytest
import torch
from gpuflex.node.errors import TrainError, TrainingStopped
from gpuflex.node.trainer import train_assignment
from gpuflex.protocol.messages import TrainConfig
from gpuflex.protocol.modelspec import ModelSpec, build_model
from gpuflex.protocol.tensors import encode_state

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cfg(**kw) -> TrainConfig:
    base = dict(
        local_epochs=2,
        batch_size=16,
        optimizer="sgd",
        lr=0.05,
        momentum=0.9,
        weight_decay=0.0,
        beta1=0.9,
        beta2=0.999,
        loss="cross_entropy",
        grad_clip=0.0,
    )
    base.update(kw)
    return TrainConfig(**base)


def _data(n: int = 200, d: int = 8, classes: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return [{"x": x[i : i + 64], "y": y[i : i + 64]} for i in range(0, n, 64)]


SPEC = ModelSpec.from_dict(
    {"kind": "mlp", "input": 8, "hidden": [16], "outputs": 3, "dropout": 0.2}
)


def _global():
    return build_model(SPEC, seed=1).state_dict()


def test_same_inputs_give_bit_identical_updates():
    g, chunks = _global(), _data()
    a = train_assignment(SPEC, g, chunks, _cfg(), seed=42, device=CPU)
    b = train_assignment(SPEC, g, chunks, _cfg(), seed=42, device=CPU)
    assert encode_state(a.delta) == encode_state(b.delta)
    assert a.loss == b.loss and a.steps == b.steps == 2 * 13 and a.sample_count == 200


def test_other_seed_gives_other_update_and_global_rng_is_untouched():
    g, chunks = _global(), _data()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = train_assignment(SPEC, g, chunks, _cfg(), seed=1, device=CPU)
    assert torch.equal(torch.get_rng_state(), before)
    b = train_assignment(SPEC, g, chunks, _cfg(), seed=2, device=CPU)
    assert encode_state(a.delta) != encode_state(b.delta)


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_delta_is_trained_minus_global(optimizer):
    g, chunks = _global(), _data()
    r = train_assignment(
        SPEC, g, chunks, _cfg(optimizer=optimizer, lr=0.01, grad_clip=1.0), seed=3, device=CPU
    )
    assert set(r.delta) == set(g)
    for name, t in g.items():
        assert r.delta[name].dtype == t.dtype and r.delta[name].shape == t.shape
        assert r.delta[name].device.type == "cpu"
    assert any(float(v.abs().sum()) > 0 for v in r.delta.values())
    assert r.loss > 0 and r.train_s > 0


def test_global_state_is_not_mutated_and_read_only_views_work():
    from gpuflex.protocol.tensors import decode_state

    g = _global()
    blob = encode_state(g)
    view = decode_state(blob)  # read-only zero-copy tensors, as the node loads them
    train_assignment(SPEC, view, _data(), _cfg(), seed=5, device=CPU)
    assert encode_state(view) == blob


def test_progress_and_should_stop():
    seen: list[float] = []
    train_assignment(SPEC, _global(), _data(), _cfg(), seed=0, device=CPU, progress=seen.append)
    assert seen and seen[-1] == 1.0 and seen == sorted(seen)

    calls = {"n": 0}

    def stop() -> bool:
        calls["n"] += 1
        return calls["n"] > 3

    with pytest.raises(TrainingStopped):
        train_assignment(SPEC, _global(), _data(), _cfg(), seed=0, device=CPU, should_stop=stop)


def test_bad_inputs_refused():
    g = _global()
    with pytest.raises(TrainError, match="labels"):
        train_assignment(
            SPEC,
            g,
            [{"x": torch.zeros(4, 8), "y": torch.tensor([0, 1, 2, 3])}],
            _cfg(),
            seed=0,
            device=CPU,
        )
    with pytest.raises(TrainError, match="expected"):
        train_assignment(
            SPEC,
            g,
            [{"x": torch.zeros(4, 9), "y": torch.zeros(4, dtype=torch.int64)}],
            _cfg(),
            seed=0,
            device=CPU,
        )
    with pytest.raises(TrainError, match="does not fit"):
        bad = dict(g)
        bad.pop(next(iter(bad)))
        train_assignment(SPEC, bad, _data(), _cfg(), seed=0, device=CPU)
    with pytest.raises(TrainError):
        train_assignment(SPEC, g, [], _cfg(), seed=0, device=CPU)


def test_regression_with_mse():
    spec = ModelSpec.from_dict(
        {"kind": "mlp", "input": 4, "hidden": [8], "outputs": 2, "task": "regression"}
    )
    g = build_model(spec, seed=0).state_dict()
    x = torch.randn(50, 4, generator=torch.Generator().manual_seed(0))
    y = x[:, :2] * 2.0
    r1 = train_assignment(spec, g, [{"x": x, "y": y}], _cfg(loss="mse"), seed=9, device=CPU)
    r2 = train_assignment(spec, g, [{"x": x, "y": y}], _cfg(loss="mse"), seed=9, device=CPU)
    assert encode_state(r1.delta) == encode_state(r2.delta)


@pytest.mark.parametrize(
    ("name", "kw"),
    [("sgd", dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
     ("sgd", dict(lr=0.1, momentum=0.0, weight_decay=0.0)),
     ("adam", dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.01)),
     ("adamw", dict(lr=0.01, betas=(0.8, 0.999), weight_decay=0.1))],
)
def test_local_optimizers_match_torch_optim(name, kw):
    """node/optim.py avoids torch.optim's import cost but must follow its update rules."""
    from gpuflex.node.optim import SGD, Adam, clip_grad_norm

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2))
    mine = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2))
    mine.load_state_dict(ref.state_dict())
    if name == "sgd":
        o_ref = torch.optim.SGD(ref.parameters(), foreach=True, **kw)
        o_mine = SGD(list(mine.parameters()), **kw)
    else:
        cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
        o_ref = cls(ref.parameters(), foreach=True, **kw)
        o_mine = Adam(list(mine.parameters()), lr=kw["lr"], betas=kw["betas"],
                      weight_decay=kw["weight_decay"], decoupled=name == "adamw")
    x = torch.randn(40, 6)
    for step in range(5):
        for model, opt in ((ref, o_ref), (mine, o_mine)):
            opt.zero_grad()
            (model(x) ** 2).mean().backward()
            if step % 2:
                if model is ref:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, foreach=True)
                else:
                    clip_grad_norm(list(model.parameters()), 0.05)
            opt.step()
    for a, b in zip(ref.parameters(), mine.parameters(), strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize(
    ("name", "kw"),
    [("sgd", dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
     ("sgd", dict(lr=0.1, momentum=0.0, weight_decay=0.0)),
     ("adam", dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.01)),
     ("adamw", dict(lr=0.01, betas=(0.8, 0.999), weight_decay=0.1))],
)
def test_an_optimizers_state_taken_up_elsewhere_steps_as_the_original(name, kw):
    """A pipeline stage resumed from a checkpoint: export -> import -> step equals stepping on."""
    from gpuflex.node.optim import SGD, Adam

    def make(model):
        params = list(model.parameters())
        if name == "sgd":
            return SGD(params, **kw)
        return Adam(params, lr=kw["lr"], betas=kw["betas"], weight_decay=kw["weight_decay"],
                    decoupled=name == "adamw")

    def step(model, opt, x):
        opt.zero_grad()
        (model(x) ** 2).mean().backward()
        opt.step()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2))
    opt = make(model)
    xs = [torch.randn(40, 6) for _ in range(6)]
    fresh = make(copy.deepcopy(model))
    assert fresh.state_slots() == {} and fresh.steps == 0
    for x in xs[:3]:
        step(model, opt, x)
    slots = {k: [t.clone() for t in v] for k, v in opt.state_slots().items()}
    assert sorted(slots) == ([] if kw.get("momentum", 1) == 0 else
                             ["momentum_buffer"] if name == "sgd" else ["exp_avg", "exp_avg_sq"])
    resumed = copy.deepcopy(model)
    other = make(resumed)
    other.load_state_slots(slots, opt.steps)
    for x in xs[3:]:
        step(model, opt, x)
        step(resumed, other, x)
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="keeps"):
        other.load_state_slots({"nope": [torch.zeros(1)]}, 1)
