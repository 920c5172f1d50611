"""fp16 segments and the loss scaler (protocol/lossscale.py): a node training in fp16 skips
the steps whose scaled gradients overflow; its checkpoints carry the scaler's state, and the
referee's replay scales, skips and backs off the same way. Real training, on the CPU (torch's
CPU autocast runs float16 too)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from gpuflex.hub.policy.referee import judge_segment
from gpuflex.node.checkpoints import CheckpointRecorder, CheckpointStore
from gpuflex.node.trainer import train_assignment
from gpuflex.protocol.checkpoint import auto_every
from gpuflex.protocol.errors import TensorError
from gpuflex.protocol.jobspec import VerificationSpec, parse_job_spec
from gpuflex.protocol.lossscale import LossScaler
from gpuflex.protocol.modelspec import build_model
from gpuflex.protocol.tensors import decode_state

from tests.helpers import digits_arrays

#: targets in the thousands: at the initial scale (2**16) the first steps' fp16 gradients overflow
SPEC = ('[job]\nname = "fp16"\n[model]\nkind = "mlp"\ninput = 64\nhidden = [64]\noutputs = 1\ntask = "regression"\n'
        '[train]\nlocal_epochs = 2\nbatch_size = 32\noptimizer = "sgd"\nlr = 1e-7\nmomentum = 0.9\n')


def _train(tmp: Path, seed: int = 5):
    job = parse_job_spec(SPEC)
    xtr, ytr, _, _ = digits_arrays()
    x = torch.from_numpy(xtr[:320].copy())
    y = torch.from_numpy(ytr[:320].copy()).float().reshape(-1, 1) * 500.0 + 1000.0
    cfg = dataclasses.replace(job.train.train_config(), precision="fp16")
    state = {k: v.detach().clone() for k, v in build_model(job.model, seed=0).state_dict().items()}
    total = math.ceil(320 / cfg.batch_size) * cfg.local_epochs
    store = CheckpointStore(tmp / "ckpt")
    rec = CheckpointRecorder(total_steps=total, every=auto_every(total), precision="fp16", store=store,
                             assignment_id="as-1")
    res = train_assignment(job.model, state, [{"x": x, "y": y}], cfg, seed, device=torch.device("cpu"), on_step=rec)
    commitment = rec.commitment()  # waits for the recorder's writes
    states = {}
    for step in rec.steps:
        data = store.read("as-1", step)
        assert data is not None
        states[step] = {k: v.clone() for k, v in decode_state(bytearray(data)).items()}
    return job, cfg, x, y, state, res, commitment, states


def _judge(t, segment: int):
    job, cfg, x, y, state, res, c, states = t
    return judge_segment(update_id="u-1", node_id="n-1", round=0, spec=job.model, cfg=cfg, seed=5, commitment=c,
                         segment=segment, states=states, global_state=state, delta=res.delta, x=x, y=y,
                         tolerance=VerificationSpec().segment_tolerance_low, onednn=True)


def test_checkpoints_carry_the_scaler_and_the_first_steps_were_skipped(tmp_path: Path) -> None:
    *_, states = _train(tmp_path)
    first, last = states[min(states)], states[max(states)]
    assert float(first["amp.scale"]) == 2.0**16 and int(first["amp.growth"]) == 0
    assert float(last["amp.scale"]) < 2.0**16, "the node's scale backed off: it skipped overflowing steps"


def test_every_fp16_segment_reproduces_with_the_scaler_modelled(tmp_path: Path) -> None:
    """Without the scaler in the replay (a plain fp32 replay of the fp16 claim), segment 0, whose
    overflowing steps the node skipped, came back as a mismatch: an honest node flagged."""
    t = _train(tmp_path)
    for seg in range(len(t[6].norms)):
        v = _judge(t, seg)
        assert v.outcome == "reproduced", (seg, v.evidence)
        assert v.evidence["distance"] < 1e-3, (seg, v.evidence)


def test_a_checkpoint_scale_that_is_not_finite_is_refused() -> None:
    bad = {"amp.scale": torch.tensor([float("nan")]), "amp.growth": torch.tensor([0], dtype=torch.int32)}
    with pytest.raises(TensorError, match=r"amp\.scale"):
        LossScaler.from_state(bad, torch.device("cpu"))
