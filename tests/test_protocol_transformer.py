"""The transformer kind (validation, deterministic builds) and every kind's pipeline units:
composed, the units are the model's forward bit for bit; their name maps cover the model's
state; tied embeddings are reported as one group."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from gpuflex.protocol import (
    ModelSpec,
    SpecError,
    build_for_state,
    build_model,
    encode_state,
    manifest,
    param_count,
)
from gpuflex.protocol.pipeline import cut_state, load_unit, pipeline_units, put_state
from torch import nn

torch.set_num_threads(1)

TINY = {"kind": "transformer", "vocab": 256, "context": 32, "layers": 2, "width": 32, "heads": 4}
DROPPING = {**TINY, "dropout": 0.1, "tied_embeddings": False, "mlp_ratio": 2}
STACKS: dict[str, dict[str, Any]] = {
    "mlp": {"kind": "mlp", "input": 16, "hidden": [24, 12], "outputs": 5, "dropout": 0.2},
    "cnn": {"kind": "cnn", "image": [1, 8, 8], "channels": [4, 8], "hidden": [16], "outputs": 10},
    "sequential": {
        "kind": "sequential",
        "input_shape": [1, 8, 8],
        "outputs": 3,
        "task": "regression",
        "layers": [
            {"type": "Conv2d", "in_channels": 1, "out_channels": 4, "kernel_size": 3, "padding": 1},
            {"type": "BatchNorm2d", "num_features": 4},
            {"type": "ReLU"},
            {"type": "MaxPool2d", "kernel_size": 2},
            {"type": "Flatten"},
            {"type": "Linear", "in_features": 64, "out_features": 12},
            {"type": "LayerNorm", "normalized_shape": 12},
            {"type": "GELU"},
            {"type": "Dropout", "p": 0.1},
            {"type": "Linear", "in_features": 12, "out_features": 3},
        ],
    },
    "embedding": {
        "kind": "sequential",
        "input_shape": [6],
        "outputs": 5,
        "layers": [
            {"type": "Embedding", "num_embeddings": 50, "embedding_dim": 8},
            {"type": "Flatten"},
            {"type": "Linear", "in_features": 48, "out_features": 5},
        ],
    },
}
MIXTURE = {**DROPPING, "experts": 4, "top_k": 2, "capacity_factor": 1.0, "router_jitter": 0.1}
ALL = {"tiny": TINY, "dropping": DROPPING, "mixture": MIXTURE, **STACKS}


def _bad(d: dict[str, Any], *needles: str) -> None:
    with pytest.raises(SpecError) as info:
        ModelSpec.from_dict(d)
    text = str(info.value)
    assert "\n" not in text
    for needle in needles:
        assert needle in text, text


def _input(spec: ModelSpec, batch: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    if spec.takes_tokens:
        return torch.randint(0, spec.vocab, (batch, *spec.input_shape), generator=gen)
    return torch.randn(batch, *spec.input_shape, generator=gen)


def test_transformer_builds_like_every_kind() -> None:
    spec = ModelSpec.from_dict(TINY)
    assert spec.task == "language_model" and spec.input_shape == (32,) and spec.outputs == 256
    assert (
        spec.input_dtype == torch.int64
        and spec.target_shape == (32,)
        and spec.sample_bytes == 32 * 8 * 2
    )
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    model = build_model(spec, seed=1)
    assert model(_input(spec)).shape == (3, 32, 256)
    assert sum(p.numel() for p in model.parameters()) == param_count(spec)
    assert [(s.name, s.shape) for s in manifest(spec)][:2] == [
        ("embed.tok", (256, 32)),
        ("embed.pos", (32, 32)),
    ]
    same = encode_state(build_model(spec, seed=1).state_dict())
    assert same == encode_state(model.state_dict())
    assert same != encode_state(build_model(spec, seed=2).state_dict())
    loaded = build_for_state(spec, model.state_dict())
    x = _input(spec)
    assert torch.equal(loaded(x), model(x))


def test_tied_embeddings_hold_one_tensor() -> None:
    tied = ModelSpec.from_dict(TINY)
    untied = ModelSpec.from_dict({**TINY, "tied_embeddings": False})
    names = [s.name for s in manifest(tied)]
    assert "head.weight" not in names and len(names) == len(set(names))
    assert "head.weight" in [s.name for s in manifest(untied)]
    assert param_count(untied) - param_count(tied) == 256 * 32


def test_transformer_spec_errors() -> None:
    _bad({**TINY, "width": 30}, "model.width", "divisible by heads (4)")
    _bad({**TINY, "heads": 0}, "model.heads")
    _bad({**TINY, "vocab": 1}, "model.vocab", "2..")
    _bad({**TINY, "context": 0}, "model.context")
    _bad({**TINY, "layers": 0}, "model.layers")
    _bad({**TINY, "layers": [1]}, "model.layers", "integer")
    _bad({**TINY, "mlp_ratio": 0.5}, "model.mlp_ratio")
    _bad({**TINY, "dropout": 1.0}, "model.dropout")
    _bad({**TINY, "tied_embeddings": 1}, "model.tied_embeddings", "true or false")
    _bad({**TINY, "task": "classification"}, "model.task", "language_model")
    _bad({**TINY, "hidden": [4]}, "model.'hidden'", "unknown key")
    _bad({k: v for k, v in TINY.items() if k != "heads"}, "model.heads", "required")
    _bad({**STACKS["mlp"], "task": "language_model"}, "model.task", 'kind = "transformer"')
    _bad({**TINY, "context": 8192, "heads": 4, "width": 32}, "attention scores", "shorter context")
    _bad({**TINY, "vocab": 1 << 20, "context": 4096, "heads": 1}, "logits")
    _bad({**TINY, "width": 8192, "heads": 8, "layers": 8}, "parameters, more than the limit")


@pytest.mark.parametrize("name", list(ALL))
def test_units_compose_to_the_model_bit_for_bit(name: str) -> None:
    spec = ModelSpec.from_dict(ALL[name])
    model = build_model(spec, seed=3)
    units = pipeline_units(spec)
    state = model.state_dict()
    modules = [load_unit(u, cut_state(u, state)) for u in units.units]
    assert all(p.device.type == "meta" for u in units.units for p in u.module.parameters())
    x = _input(spec)
    for training in (False, True):  # dropout draws the same numbers in the same order
        for m in (model, *modules):
            m.train(training)
        torch.manual_seed(11)
        whole = model(x)
        torch.manual_seed(11)
        h = x
        for m in modules:
            h = m(h)
        assert torch.equal(h, whole), (name, training)


@pytest.mark.parametrize("name", list(ALL))
def test_unit_names_cover_the_state_once_and_put_back(name: str) -> None:
    spec = ModelSpec.from_dict(ALL[name])
    model = build_model(spec, seed=3)
    units = pipeline_units(spec)
    held = [model_name for u in units.units for _, model_name in u.names]
    tied = {g.model_name: len(g.members) for g in units.tied}
    expected = [s.name for s in manifest(spec)]
    assert sorted(set(held)) == sorted(expected)
    assert all(held.count(n) == tied.get(n, 1) for n in expected)
    rebuilt: dict[str, torch.Tensor] = {}
    for u in units.units:
        put_state(u, {k: v.clone() for k, v in cut_state(u, model.state_dict()).items()}, rebuilt)
    assert encode_state({n: rebuilt[n] for n in expected}) == encode_state(model.state_dict())
    with pytest.raises(KeyError):
        put_state(units[0], {}, rebuilt)


def test_transformer_units_and_tied_group() -> None:
    spec = ModelSpec.from_dict(TINY)
    units = pipeline_units(spec)
    assert [u.name for u in units.units] == ["embed", "block_0", "block_1", "head"]
    (group,) = units.tied
    assert group.model_name == "embed.tok" and group.members == ((0, "tok"), (3, "weight"))
    assert units[3].model_name("ln.weight") == "head.ln.weight"
    assert pipeline_units(ModelSpec.from_dict({**TINY, "tied_embeddings": False})).tied == ()


def test_tied_gradients_sum_to_the_models() -> None:
    """What a pipeline does with a tied group: the members' gradients, summed, are the
    model's gradient of that tensor."""
    spec = ModelSpec.from_dict(TINY)
    model = build_model(spec, seed=4)
    units = pipeline_units(spec)
    modules = [load_unit(u, cut_state(u, model.state_dict())) for u in units.units]
    x = _input(spec)
    y = torch.roll(x, -1, dims=1)
    loss_fn = nn.CrossEntropyLoss()
    loss_fn(model(x).flatten(0, 1), y.flatten()).backward()
    h = x
    for m in modules:
        h = m(h)
    loss_fn(h.flatten(0, 1), y.flatten()).backward()
    (group,) = units.tied
    summed = sum(dict(modules[i].named_parameters())[n].grad for i, n in group.members)
    assert torch.allclose(summed, model.embed.tok.grad, rtol=1e-5, atol=1e-7)


def test_stack_units_group_a_layer_with_what_follows_it() -> None:
    units = pipeline_units(ModelSpec.from_dict(STACKS["sequential"]))
    assert [u.name for u in units.units] == ["layers_0_4", "layers_5_8", "layers_9_9"]
    assert dict(units[1].names)["1.weight"] == "6.weight"  # the LayerNorm after the Linear
    assert "1.running_mean" in dict(units[0].names)  # buffers travel with their unit
    leading = {
        "kind": "sequential",
        "input_shape": [2, 4],
        "outputs": 2,
        "layers": [
            {"type": "Flatten"},
            {"type": "Linear", "in_features": 8, "out_features": 4},
            {"type": "ReLU"},
            {"type": "Linear", "in_features": 4, "out_features": 2},
        ],
    }
    units = pipeline_units(ModelSpec.from_dict(leading))
    assert [u.name for u in units.units] == ["layers_0_2", "layers_3_3"]  # Flatten joins the first
