"""task = "language_model": byte-level text into token windows (the owner's CLI), the hub's
checks of them, the node's training (the loss falls on real text), the hub's evaluation
(next-token loss and accuracy) and the referee's replay of a segment, all on the standard
library's own source text."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from gpuflex.hub.base.errors import Unprocessable
from gpuflex.hub.policy.datafiles import text_as_npz, text_context
from gpuflex.hub.policy.evaluation import evaluate
from gpuflex.hub.policy.referee import judge_segment, pick_segment
from gpuflex.node.checkpoints import CheckpointRecorder, CheckpointStore
from gpuflex.node.errors import TrainError
from gpuflex.node.trainer import stack_chunks, train_assignment
from gpuflex.protocol.checkpoint import auto_every
from gpuflex.protocol.dataset import DatasetError, text_windows, validate_arrays
from gpuflex.protocol.errors import SpecError
from gpuflex.protocol.jobspec import VerificationSpec, parse_job_spec
from gpuflex.protocol.modelfile import load_safetensors_model, model_file_metadata
from gpuflex.protocol.modelspec import build_model
from gpuflex.protocol.tensors import decode_state, state_to_safetensors

from tests.tooling.text import stdlib_text

torch.set_num_threads(1)

CONTEXT = 32
MODEL = f"""[model]
kind = "transformer"
vocab = 256
context = {CONTEXT}
layers = 2
width = 32
heads = 4
"""
SPEC = f"""[job]
name = "lm"

{MODEL}
[train]
optimizer = "adam"
lr = 0.003
batch_size = 32
local_epochs = 2
"""


def _windows(n_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = text_windows(stdlib_text(n_bytes), CONTEXT, what="text")
    return torch.from_numpy(data.x), torch.from_numpy(data.y)


def test_text_becomes_next_token_windows() -> None:
    text = stdlib_text(10_000)
    data = text_windows(text, CONTEXT, what="text")
    n = (len(text) - 1) // CONTEXT
    assert data.x.shape == data.y.shape == (n, CONTEXT) and data.x.dtype == data.y.dtype == np.int64
    flat = np.frombuffer(text, dtype=np.uint8)
    assert np.array_equal(data.x.reshape(-1), flat[: n * CONTEXT])
    assert np.array_equal(data.y.reshape(-1), flat[1 : n * CONTEXT + 1])  # the next byte everywhere
    with pytest.raises(DatasetError, match="not UTF-8"):
        text_windows(b"ok \xff\xfe", 2, what="text")
    with pytest.raises(DatasetError, match="at least 33 bytes"):
        text_windows(b"short", CONTEXT, what="text")


def test_the_hub_checks_dtype_shape_and_token_range() -> None:
    spec = parse_job_spec(SPEC).model
    x, y = _windows(4_000)
    ok = validate_arrays(x.numpy(), y.numpy(), spec, what="train")
    assert ok.x.dtype == np.int64 and ok.y.shape == y.shape

    def refused(xa: np.ndarray, ya: np.ndarray, *needles: str) -> None:
        with pytest.raises(DatasetError) as info:
            validate_arrays(xa, ya, spec, what="train")
        assert "\n" not in str(info.value)
        for needle in needles:
            assert needle in str(info.value), str(info.value)

    xs, ys = x.numpy(), y.numpy()
    refused(xs.astype(np.float32), ys, "x holds token ids", "float32")
    refused(xs, ys[:, :16], "y must have shape (n, 32)")
    refused(xs[:, :16], ys[:, :16], "x must have shape (n, 32)")
    refused(xs + 256, ys, "0..255", "found")
    refused(xs, -ys, "token ids in y")


def test_specs_pair_the_task_with_its_model_and_loss() -> None:
    assert parse_job_spec(SPEC).train.loss == "cross_entropy"
    with pytest.raises(SpecError, match="language_model trains with cross_entropy"):
        parse_job_spec(SPEC + 'loss = "mse"\n')
    with pytest.raises(SpecError, match='needs kind = "transformer"'):
        parse_job_spec(
            '[job]\nname = "x"\n[model]\nkind = "mlp"\ninput = 4\noutputs = 2\ntask = "language_model"\n'
        )


def test_the_owner_cli_cuts_text_by_the_specs_context(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(stdlib_text(5_000))
    assert text_context(SPEC.encode(), "--train") == CONTEXT
    out = text_as_npz(corpus, CONTEXT, tmp_path / "train.npz", "--train")
    with np.load(out, allow_pickle=False) as npz:
        assert npz["x"].shape == ((5_000 - 1) // CONTEXT, CONTEXT) and npz["y"].dtype == np.int64
    # not a transformer: not text, the dataset checks apply
    assert text_context(b'[model]\nkind = "mlp"\n', "--train") is None
    with pytest.raises(Unprocessable, match=r"model\.context"):
        text_context(b'[model]\nkind = "transformer"\ncontext = "long"\n', "--train")
    (tmp_path / "bad.txt").write_bytes(b"\xff" * 100)
    with pytest.raises(Unprocessable, match="not UTF-8"):
        text_as_npz(tmp_path / "bad.txt", CONTEXT, tmp_path / "bad.npz", "--train")


def test_the_trainer_refuses_windows_that_do_not_fit() -> None:
    spec = parse_job_spec(SPEC).model
    x, y = _windows(2_000)
    assert stack_chunks(spec, [{"x": x, "y": y}])[1].shape == y.shape
    with pytest.raises(TrainError, match="expected int64"):
        stack_chunks(spec, [{"x": x, "y": y[:, 0]}])
    with pytest.raises(TrainError, match="token ids outside"):
        stack_chunks(spec, [{"x": x + 300, "y": y}])


def test_training_on_real_text_lowers_the_next_token_loss_and_the_referee_reproduces_it(
    tmp_path: Path,
) -> None:
    job = parse_job_spec(SPEC)
    x, y = _windows(40_000)
    train_x, train_y, val = x[:1000], y[:1000], {"x": x[1000:], "y": y[1000:]}
    cfg = job.train.train_config(precision="fp32")
    global_state = {
        k: v.detach().clone() for k, v in build_model(job.model, seed=0).state_dict().items()
    }
    before = evaluate(job, global_state, val)
    assert abs(before["loss"] - math.log(256)) < 0.5 and 0.0 <= before["accuracy"] <= 1.0

    steps = math.ceil(1000 / cfg.batch_size) * cfg.local_epochs
    store = CheckpointStore(tmp_path / "ckpt")
    rec = CheckpointRecorder(
        total_steps=steps,
        every=auto_every(steps),
        precision="fp32",
        store=store,
        assignment_id="as-1",
    )
    result = train_assignment(
        job.model,
        global_state,
        [{"x": train_x, "y": train_y}],
        cfg,
        11,
        device=torch.device("cpu"),
        on_step=rec,
    )
    trained = {k: global_state[k] + result.delta[k] for k in global_state}
    after = evaluate(job, trained, val)
    # the bytes of source code are far from uniform
    assert after["loss"] < before["loss"] - 1.0, (before, after)
    assert after["accuracy"] > before["accuracy"] + 0.1, (before, after)

    commitment = rec.commitment()  # waits for the recorder's background writes
    states = {}
    for step in rec.steps:
        data = store.read("as-1", step)
        assert data is not None
        states[step] = dict(decode_state(bytearray(data)))
    verdict = judge_segment(
        update_id="u-1",
        node_id="n-1",
        round=0,
        spec=job.model,
        cfg=cfg,
        seed=11,
        commitment=commitment,
        segment=pick_segment(commitment),
        states=states,
        global_state=global_state,
        delta=result.delta,
        x=train_x,
        y=train_y,
        tolerance=VerificationSpec().segment_tolerance,
    )
    assert verdict.outcome == "reproduced", verdict.evidence
    forged = dict(result.delta)
    forged["embed.tok"] = forged["embed.tok"] * 3
    lied = judge_segment(
        update_id="u-1",
        node_id="n-1",
        round=0,
        spec=job.model,
        cfg=cfg,
        seed=11,
        commitment=commitment,
        segment=len(commitment.norms) - 1,
        states={
            **states,
            commitment.steps: {
                **states[commitment.steps],
                "model.embed.tok": global_state["embed.tok"] + forged["embed.tok"],
            },
        },
        global_state=global_state,
        delta=forged,
        x=train_x,
        y=train_y,
        tolerance=VerificationSpec().segment_tolerance,
    )
    assert lied.outcome != "reproduced", dataclasses.asdict(lied)


def test_the_model_file_rebuilds_the_transformer(tmp_path: Path) -> None:
    spec = parse_job_spec(SPEC).model
    model = build_model(spec, seed=2)
    meta = model_file_metadata(spec, job_id="j", round_=0, hub_fingerprint="f")
    path = tmp_path / "model.safetensors"
    path.write_bytes(state_to_safetensors(model.state_dict(), meta))
    loaded = load_safetensors_model(path)
    x, _ = _windows(1_000)
    model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_job_submit_names_a_bad_text_file_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuflex.hub.ops import cli

    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    for name, data, expected in (
        ("latin1.txt", "café au lait, ".encode("latin-1") * 20, "not UTF-8 text"),
        ("short.txt", b"tiny", "hold no window of 32 tokens"),
    ):
        (tmp_path / name).write_bytes(data)
        code = cli.main(
            [
                "job",
                "submit",
                str(spec),
                "--train",
                str(tmp_path / name),
                "--hub",
                "http://127.0.0.1:9",
                "--token",
                "gft_x",
            ]
        )
        err = capsys.readouterr().err
        assert (
            code == 1 and len(err.strip().splitlines()) == 1 and expected in err and name in err
        ), err
    (tmp_path / "ok.txt").write_bytes(stdlib_text(2_000))
    code = cli.main(
        [
            "job",
            "submit",
            str(spec),
            "--train",
            str(tmp_path / "ok.txt"),
            "--hub",
            "http://127.0.0.1:9",
            "--token",
            "gft_x",
        ]
    )
    assert (
        code == 1 and "cannot reach the hub" in capsys.readouterr().err
    )  # cut and ready to upload
