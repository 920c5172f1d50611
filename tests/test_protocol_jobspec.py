"""Job specs: TOML into frozen dataclasses, defaults, and errors naming section.key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from gpuflex.protocol import (
    AggregationSpec,
    DataSpec,
    SpecError,
    TrainConfig,
    TrainSpec,
    VerificationSpec,
    load_job_spec,
    parse_job_spec,
)

DIGITS = """
[job]
name = "digits"

[model]
kind = "mlp"
input = 64
hidden = [128]
outputs = 10
activation = "relu"
"""


def _bad(extra: str, *needles: str, base: str = DIGITS) -> str:
    with pytest.raises(SpecError) as info:
        parse_job_spec(base + extra)
    text = str(info.value)
    assert "\n" not in text
    for needle in needles:
        assert needle in text, text
    return text


def test_defaults_exactly_as_the_contract() -> None:
    job = parse_job_spec(DIGITS)
    assert job.name == "digits"
    assert job.model.input_shape == (64,) and job.model.outputs == 10
    assert job.train == TrainSpec(
        rounds=10,
        local_epochs=1,
        batch_size=32,
        optimizer="sgd",
        lr=0.05,
        momentum=0.0,
        weight_decay=0.0,
        beta1=0.9,
        beta2=0.999,
        loss="cross_entropy",
        seed=0,
        grad_clip=0.0,
        round_target_s=10.0,
        deadline_slack=3.0,
    )
    # chunk_size and validation_fraction unset: the hub decides them at submission (hub/policy/datadefaults.py)
    assert job.data == DataSpec(
        chunk_size=None, split="stratified", validation_fraction=None, label_column="label"
    )
    assert job.aggregation == AggregationSpec(
        method="fedavg",
        trim_beta=0.1,
        krum_f=1,
        krum_m=1,
        clip_norm=0.0,
        server_optimizer="none",
        server_lr=1.0,
        server_momentum=0.9,
        server_beta1=0.9,
        server_beta2=0.99,
        server_eps=1e-3,
    )
    assert job.verification == VerificationSpec(
        replication="adaptive",
        quorum=2,
        max_replicas=3,
        tolerance=1e-4,
        trust_after=10,
        cosine_min=-0.3,
        norm_ratio_max=4.0,
        free_rider_norm=1e-7,
        replica_wait_s=30.0,
    )
    assert job == parse_job_spec(DIGITS.encode())
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.train.lr = 1.0  # type: ignore[misc]


def test_full_spec_and_train_config() -> None:
    job = parse_job_spec(
        DIGITS
        + """
[train]
rounds = 3
local_epochs = 2
batch_size = 16
optimizer = "adamw"
lr = 1
weight_decay = 0.01
seed = 42
grad_clip = 1.5

[data]
chunk_size = 32
split = "random"
validation_fraction = 0.2
label_column = "target"

[aggregation]
method = "trimmed_mean"
trim_beta = 0.2
server_optimizer = "fedadam"

[verification]
replication = 0.25
quorum = 3
max_replicas = 5
"""
    )
    assert job.train.lr == 1.0 and isinstance(job.train.lr, float)
    assert job.verification.replication == 0.25
    cfg = job.train.train_config()
    assert cfg == TrainConfig(2, 16, "adamw", 1.0, 0.0, 0.01, 0.9, 0.999, "cross_entropy", 1.5)


def test_regression_defaults_to_mse() -> None:
    spec = DIGITS.replace('activation = "relu"', 'activation = "relu"\ntask = "regression"')
    assert parse_job_spec(spec).train.loss == "mse"
    _bad('[train]\nloss = "cross_entropy"\n', "train.loss", base=spec)
    _bad('[train]\nloss = "mse"\n', "train.loss")


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        ('[train]\noptimizer = "lbfgs"\n', ("train.optimizer", "sgd, adam, adamw")),
        ("[train]\nlr = 0\n", ("train.lr",)),
        ("[train]\nlr = true\n", ("train.lr",)),
        ('[train]\nlr = "fast"\n', ("train.lr",)),
        ("[train]\nrounds = 0\n", ("train.rounds", "1..")),
        ("[train]\nrounds = 1.5\n", ("train.rounds",)),
        ("[train]\nbatch_size = true\n", ("train.batch_size",)),
        ("[train]\nseed = -1\n", ("train.seed",)),
        ("[train]\nlr = nan\n", ("train.lr",)),
        ("[train]\nlr = inf\n", ("train.lr",)),
        ("[train]\nepochs = 3\n", ("train.'epochs'", "unknown key", "local_epochs")),
        ('[data]\nsplit = "sorted"\n', ("data.split", "random, stratified")),
        ("[data]\nvalidation_fraction = 0.95\n", ("data.validation_fraction",)),
        ('[data]\nlabel_column = ""\n', ("data.label_column",)),
        (
            '[aggregation]\nmethod = "mean"\n',
            ("aggregation.method", "fedavg, median, trimmed_mean, krum, multi_krum"),
        ),
        (
            '[aggregation]\nserver_optimizer = "sgd"\n',
            ("aggregation.server_optimizer", "none, fedavgm, fedadam"),
        ),
        ("[aggregation]\ntrim_beta = 0.5\n", ("aggregation.trim_beta",)),
        ('[verification]\nreplication = "always"\n', ("verification.replication", "adaptive")),
        ("[verification]\nreplication = 1.5\n", ("verification.replication",)),
        ("[verification]\nreplication = true\n", ("verification.replication",)),
        ("[verification]\nquorum = 4\nmax_replicas = 3\n", ("verification.max_replicas", "quorum")),
        ("[extras]\nx = 1\n", ("'extras'", "unknown section", "job, model, train")),
        ("[train.sub]\nx = 1\n", ("train.'sub'",)),
        ("train = 5\n", ()),
    ],
)
def test_errors_name_section_key_and_allowed(extra: str, needles: tuple[str, ...]) -> None:
    _bad(extra, *needles)


def test_model_errors_name_model_key() -> None:
    _bad("", "model.activation", base=DIGITS.replace('"relu"', '"swish"'))
    _bad("", "model.'hiden'", base=DIGITS.replace("hidden", "hiden"))


def test_job_section_required_and_checked() -> None:
    with pytest.raises(SpecError, match=r"job\.name"):
        parse_job_spec(DIGITS.replace('[job]\nname = "digits"\n', ""))
    with pytest.raises(SpecError, match=r"job\.name"):
        parse_job_spec(DIGITS.replace('name = "digits"', "name = 3"))
    with pytest.raises(SpecError, match=r"job\.'owner'"):
        parse_job_spec(DIGITS.replace('name = "digits"', 'name = "d"\nowner = "x"'))
    with pytest.raises(SpecError, match=r"\[model\]"):
        parse_job_spec('[job]\nname = "x"\n')


def test_not_toml_or_not_utf8() -> None:
    with pytest.raises(SpecError, match="TOML"):
        parse_job_spec("[job\nname=")
    with pytest.raises(SpecError, match="UTF-8"):
        parse_job_spec(b"\xff\xfe")
    with pytest.raises(SpecError):
        parse_job_spec(123)  # type: ignore[arg-type]


def test_load_job_spec(tmp_path: Path) -> None:
    path = tmp_path / "spec.toml"
    path.write_text(DIGITS)
    assert load_job_spec(path).name == "digits"
    with pytest.raises(SpecError, match="cannot read"):
        load_job_spec(tmp_path / "missing.toml")


def test_sequential_in_toml() -> None:
    job = parse_job_spec("""
[job]
name = "seq"
[model]
kind = "sequential"
input_shape = [64]
outputs = 10
layers = [
  { type = "Linear", in_features = 64, out_features = 32 },
  { type = "ReLU" },
  { type = "Linear", args = [32, 10] },
]
""")
    assert job.model.kind == "sequential" and len(job.model.layers) == 3


def test_asks_referee_only_when_something_can_be_checked() -> None:
    from gpuflex.protocol.jobspec import VerificationSpec

    assert VerificationSpec().asks_referee()  # adaptive replication, spot-checks on
    none = VerificationSpec(replication=0.0, spot_check=0.0, spot_check_trusted=0.0)
    assert not none.asks_referee()
    assert VerificationSpec(replication=0.0, spot_check=0.0, spot_check_trusted=0.1).asks_referee()
    assert VerificationSpec(replication=0.5, spot_check=0.0, spot_check_trusted=0.0).asks_referee()
    assert VerificationSpec(replication="adaptive", spot_check=0.0, spot_check_trusted=0.0).asks_referee()


def test_linear_lr_scaling_and_where_it_is_refused() -> None:
    spec = parse_job_spec(DIGITS + '[train]\nlr = 0.05\nlr_scaling = "linear"\nlr_scale_max = 4\n')
    t = spec.train
    assert (t.lr_scaling, t.lr_scale_max) == ("linear", 4.0)
    assert t.lr_scale(720, 1440) == 2.0  # half the round's samples: twice the lr
    assert t.lr_scale(100, 1440) == 4.0  # capped
    assert t.lr_scale(1440, 1440) == 1.0 and t.lr_scale(2000, 1440) == 1.0  # never below the spec's lr
    assert parse_job_spec(DIGITS).train.lr_scale(10, 1440) == 1.0  # "none" (the default)
    _bad('[train]\nlr_scaling = "square"\n', "train.lr_scaling", "none, linear")
    _bad('[train]\nlr_scaling = "linear"\nlr_scale_max = 0.5\n', "train.lr_scale_max")
    _bad('[train]\nlr_scaling = "linear"\nlocal_steps = 10\n', "train.lr_scaling", "local_steps")
    _bad('[train]\nlr_scaling = "linear"\n[data]\nsource = "node-local"\n', "train.lr_scaling", "node-local")
