"""Keyed dropout (protocol/dropout.py): masks that are a function of (seed, step, part, slot)
alone, so the hub's CPU referee replays a node's dropout whatever device the node trained on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpuflex.protocol.dropout import KeyedDropout, dropout_step, keep_mask
from gpuflex.protocol.jobspec import parse_job_spec
from gpuflex.protocol.modelspec import build_model

from tests.test_verification_referee import judge, train

CPU = torch.device("cpu")


def test_a_mask_is_a_function_of_its_key_alone() -> None:
    torch.manual_seed(1)
    a = keep_mask((64, 257), 0.3, 11, 5, 0, 2, CPU)
    torch.manual_seed(2)  # the device's generator plays no part
    assert torch.equal(a, keep_mask((64, 257), 0.3, 11, 5, 0, 2, CPU))
    others = [keep_mask((64, 257), 0.3, *key, CPU) for key in
              ((12, 5, 0, 2), (11, 6, 0, 2), (11, 5, 1, 2), (11, 5, 0, 3), (11 + (1 << 32), 5, 0, 2))]
    for other in others:
        assert 0.3 < (a != other).float().mean().item() < 0.5  # independent masks differ in ~42 %


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_the_share_dropped_is_p(p: float) -> None:
    kept = keep_mask((1 << 18,), p, 3, 0, 0, 0, CPU).float().mean().item()
    assert abs(kept - (1 - p)) < 0.005, kept


def test_keyed_dropout_scales_like_torch_and_is_identity_in_eval() -> None:
    layer = KeyedDropout(0.25, slot=4)
    x = torch.ones(8, 1000)
    with dropout_step(7, 3):
        y = layer(x)
    kept = y != 0
    assert torch.equal(kept, keep_mask(x.shape, 0.25, 7, 3, 0, 4, CPU))
    assert torch.allclose(y[kept], torch.full_like(y[kept], 1 / 0.75))
    layer.eval()
    with dropout_step(7, 3):
        assert torch.equal(layer(x), x)


def test_outside_a_step_the_layer_is_torchs_dropout() -> None:
    layer = KeyedDropout(0.5, slot=0)
    torch.manual_seed(0)
    a = layer(torch.ones(4096))
    torch.manual_seed(0)
    assert torch.equal(a, torch.nn.functional.dropout(torch.ones(4096), 0.5))


def test_built_models_use_keyed_dropout_in_their_own_slots() -> None:
    mlp = parse_job_spec('[job]\nname = "d"\n[model]\nkind = "mlp"\ninput = 4\nhidden = [8, 8]\noutputs = 2\n'
                         'dropout = 0.2\n').model
    slots = [m.slot for m in build_model(mlp, seed=0).modules() if isinstance(m, KeyedDropout)]
    assert len(slots) == 2 and len(set(slots)) == 2
    seq = parse_job_spec('[job]\nname = "d"\n[model]\nkind = "sequential"\ninput_shape = [4]\noutputs = 2\n'
                         'layers = [{type = "Linear", in_features = 4, out_features = 8}, {type = "Dropout", p = 0.3},'
                         ' {type = "Linear", in_features = 8, out_features = 2}]\n').model
    layers = [m for m in build_model(seq, seed=0).modules() if isinstance(m, KeyedDropout)]
    assert [(m.slot, m.p) for m in layers] == [(1, 0.3)]


def test_a_segment_trained_with_dropout_reproduces_exactly(tmp_path: Path) -> None:
    t = train(tmp_path, "mlp_dropout", threads=1)
    plain = train(tmp_path / "again", "mlp_dropout", threads=1)
    assert all(torch.equal(t.delta[k], plain.delta[k]) for k in t.delta), "same seed, same masks"
    for seg in range(len(t.commitment.norms)):
        v = judge(t, segment=seg, threads=1)
        assert v.outcome == "reproduced" and v.evidence["distance"] == 0.0, (seg, v.evidence)


def test_a_node_whose_masks_came_from_its_devices_generator_does_not_reproduce(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a GPU node's torch dropout looked like to the CPU referee: masks drawn from the
    device's own generator. The check can fail: such a segment does not reproduce."""
    import contextlib

    import gpuflex.node.trainer as trainer

    monkeypatch.setattr(trainer, "dropout_step", lambda *_a: contextlib.nullcontext())
    t = train(tmp_path, "mlp_dropout", threads=1)
    v = judge(t, segment=1, threads=1)
    assert v.outcome != "reproduced" and v.evidence["distance"] > 1e-3, v.evidence


def test_a_transformer_keys_every_dropout_in_its_own_slot() -> None:
    spec = parse_job_spec('[job]\nname = "t"\n[model]\nkind = "transformer"\nvocab = 256\ncontext = 16\nlayers = 3\n'
                          'width = 32\nheads = 4\ndropout = 0.1\n').model
    model = build_model(spec, seed=0)
    slots = sorted(m.slot for m in model.modules() if isinstance(m, KeyedDropout))
    assert slots == list(range(1 + 2 * 3))
    assert not any(type(m) is torch.nn.Dropout for m in model.modules())
    model.train()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with dropout_step(3, 1):
        a = model(x)
    with dropout_step(3, 1):
        assert torch.equal(a, model(x)), "one step's masks, drawn twice"
    with dropout_step(3, 2):
        assert not torch.equal(a, model(x))
