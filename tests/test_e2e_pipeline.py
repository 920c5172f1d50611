"""A pipelined transformer end to end on real processes: a real `gpuflex-hub serve` plans the
job's stages over real `gpuflex-node run` processes, each started with a memory cap smaller than
the model's training state; the stages pass activations and gradients through the hub's relay,
checkpoint their units, and the job's final model is downloaded as its owner would.

Each run checks the model against one process training the same steps over the same micro-batches
(gradient accumulation, fp32, SGD with momentum: the node's own optimizer): within 1e-5 relative on
every tensor, so no step was lost or applied twice. One run kills -9 the node of a middle stage
(a spare node is online), one kills -9 the hub; both still end on that model. The hub checks
every stage at every checkpoint step (``verify_rate = 1.0``, hub/domain/pipelines/verify.py):
honest stages are never flagged, so each run keeps its one generation."""

from __future__ import annotations

import itertools
import json
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from gpuflex.hub.ops import cli
from gpuflex.node.trainer import loss_for, make_optimizer
from gpuflex.protocol.dropout import dropout_step
from gpuflex.protocol.messages import TrainConfig
from gpuflex.protocol.modelspec import build_for_state
from gpuflex.protocol.pipeline import micro_batch_slices, step_samples
from gpuflex.protocol.tensors import decode_state

from tests.helpers import stored_blobs
from tests.tooling.cluster import LocalCluster
from tests.tooling.text import stdlib_text, transformer_pipeline_spec

pytestmark = pytest.mark.e2e

STEPS, EVERY, BATCH, MICRO, SEED = 24, 4, 16, 8, 0
SPEC = transformer_pipeline_spec("stdlib-pipeline", batch=BATCH, micro=MICRO, steps=STEPS, every=EVERY, seed=SEED,
                                 tail="verify_rate = 1.0\n")
#: each node's --max-memory: well under the model's training state (parameters, gradients and
#: momentum of ~860k float32 parameters: 10.4 MB), enough for a stage of it and its activations
CAP = "6MB"
HUB_ARGS = ("--long-poll-max", "2", "--min-deadline", "4", "--stage-timeout", "8")


def _submit(
    cluster: LocalCluster, tmp_path: Path, owner: str, capsys: pytest.CaptureFixture[str], extra: str = ""
) -> str:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC + extra)
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(stdlib_text(24_000))
    capsys.readouterr()
    code = cli.main(["job", "submit", str(spec), "--train", str(corpus), "--hub", cluster.url,
                     "--token", owner, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return str(json.loads(out)["id"])


def _pipeline(cluster: LocalCluster, job_id: str, owner: str) -> dict[str, Any]:
    doc = cluster.get_json(f"/v1/jobs/{job_id}", owner)
    return dict(doc.get("pipeline") or {})


def _wait(cluster: LocalCluster, job_id: str, owner: str, what: str, test: Any, timeout_s: float) -> dict[str, Any]:
    give_up = time.monotonic() + timeout_s
    while True:
        try:
            p = _pipeline(cluster, job_id, owner)
        except OSError:  # the hub is restarting
            p = {}
        if p and test(p):
            return p
        assert time.monotonic() < give_up, f"waited {timeout_s:g} s for {what}: {p}"
        time.sleep(0.2)


def _reference(cluster: LocalCluster, job_id: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float]:
    """The job's initial model, one process's model after STEPS steps of the same micro-batches,
    and the initial model's mean loss on the data."""
    blobs = stored_blobs(cluster.hub_dir)
    (model_row,) = cluster.rows("SELECT sha FROM models WHERE job_id = ? AND version = 0", job_id)
    chunks = cluster.rows("SELECT sha FROM chunks WHERE job_id = ? ORDER BY idx", job_id)
    (spec_row,) = cluster.rows("SELECT spec_toml FROM jobs WHERE id = ?", job_id)
    states = [decode_state(blobs[c["sha"]]) for c in chunks]
    x = torch.cat([s["x"] for s in states])
    y = torch.cat([s["y"] for s in states])
    from gpuflex.protocol.jobspec import parse_job_spec

    job = parse_job_spec(spec_row["spec_toml"])
    initial = {k: v.clone() for k, v in decode_state(blobs[model_row["sha"]]).items()}
    cfg: TrainConfig = job.train.train_config("fp32")
    model = build_for_state(job.model, initial).train()
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], cfg)
    loss_fn = loss_for(job.model, cfg)
    with torch.no_grad():
        first_loss = float(loss_fn(model(x), y))
    for step in range(STEPS):
        index = torch.tensor(step_samples(SEED, step, BATCH, int(x.shape[0])))
        opt.zero_grad()
        for i, (lo, hi) in enumerate(micro_batch_slices(BATCH, MICRO)):
            part = index[lo:hi]
            with dropout_step(SEED, step, part=i):
                loss = loss_fn(model(x[part]), y[part]) * ((hi - lo) / BATCH)
            loss.backward()
        opt.step()
    return initial, {k: v.detach().clone() for k, v in model.state_dict().items()}, first_loss


def _say(line: str) -> None:
    """A figure of the run, on the terminal even when pytest captures the test's output."""
    print(line, file=sys.__stderr__)


def _check_final(cluster: LocalCluster, job_id: str, owner: str, tolerance: float = 1e-5) -> None:
    """The job ends on one process's model (``tolerance``: the largest relative difference of any
    tensor), and its loss on the job's text fell."""
    from safetensors.torch import load

    status = cluster.wait_job(job_id, owner, timeout_s=240)
    assert status["state"] == "done", status.get("pipeline")
    got = dict(load(cluster.get_bytes(f"/v1/jobs/{job_id}/model", owner)))
    initial, want, first_loss = _reference(cluster, job_id)
    assert sorted(got) == sorted(want)
    worst = max(float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-12)) for k in want)
    moved = max(float((want[k] - initial[k]).abs().max()) for k in want)
    _say(f"\nfinal model vs one process: max relative difference {worst:.2e} (the model moved {moved:.3f})")
    assert moved > 1e-3  # it trained
    assert worst <= tolerance
    blobs = stored_blobs(cluster.hub_dir)
    (spec_row,) = cluster.rows("SELECT spec_toml FROM jobs WHERE id = ?", job_id)
    from gpuflex.protocol.jobspec import parse_job_spec

    job = parse_job_spec(spec_row["spec_toml"])
    chunks = cluster.rows("SELECT sha FROM chunks WHERE job_id = ? ORDER BY idx", job_id)
    states = [decode_state(blobs[c["sha"]]) for c in chunks]
    x, y = torch.cat([s["x"] for s in states]), torch.cat([s["y"] for s in states])
    loss_fn = loss_for(job.model, job.train.train_config("fp32"))
    with torch.no_grad():
        last_loss = float(loss_fn(build_for_state(job.model, got).eval()(x), y))
    _say(f"loss on the job's text: {first_loss:.3f} at step 0, {last_loss:.3f} after {STEPS} steps")
    assert last_loss < first_loss - 0.3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(cluster: LocalCluster, names: list[str], listening: tuple[str, ...] = ()) -> None:
    for name in names:
        listen = ("--stage-listen", f"127.0.0.1:{_free_port()}") if name in listening else ()
        cluster.start_node(name, extra=("--max-memory", CAP, *listen))
    cluster.wait_registered()


@pytest.mark.parametrize(
    ("listening", "boundary"),
    # both kill -9 runs below run on PostgreSQL too (each trains through the relay to the end
    # and checks the model against one process): these three, on SQLite only
    [pytest.param((), "", marks=pytest.mark.one_store),
     pytest.param(("a", "b", "c"), "", marks=pytest.mark.one_store),
     pytest.param((), 'boundary = "int8"\n', marks=pytest.mark.one_store)],
    ids=["relay", "direct-and-relay", "int8-boundary"],
)
def test_four_capped_nodes_train_a_transformer_in_four_stages_like_one_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], listening: tuple[str, ...], boundary: str
) -> None:
    """Through the hub's relay only; with three of the four nodes taking their stage's tensors
    directly (the fourth, behind NAT, through the relay); and with every cut's activations and
    gradients crossing in int8 (per row: close to one process's model, not equal to it)."""
    with LocalCluster(workdir=tmp_path, hub_args=HUB_ARGS) as cluster:
        cluster.start_hub()
        _start(cluster, ["a", "b", "c", "d"], listening)
        owner = cluster.create_token("owner", "alice")
        job_id = _submit(cluster, tmp_path, owner, capsys, boundary)
        p = _wait(cluster, job_id, owner, "a generation", lambda p: p.get("generation"), 120)
        g = p["generation"]
        assert len(g["stages"]) == 4 and len({s["node_id"] for s in g["stages"]}) == 4
        assert all(0 < s["memory_bytes"] <= 6e6 for s in g["stages"]), g["stages"]
        direct = [n.node_id for n in cluster.nodes() if n.data_dir.name in listening]
        _check_final(cluster, job_id, owner, tolerance=5e-2 if boundary else 1e-5)
        p = _pipeline(cluster, job_id, owner)
        assert p["committed_step"] == STEPS and len(p["generations"]) == 1, p
        stages = [s["node_id"] for s in g["stages"]]
        if listening:  # two neighbouring stages on listening nodes: their tensors went directly
            assert any(a in direct and b in direct for a, b in itertools.pairwise(stages))
        capsys.readouterr()
        assert cli.main(["job", "status", job_id, "--hub", cluster.url, "--token", owner]) == 0
        shown = capsys.readouterr().out
        assert "stage" in shown and f"{STEPS}" in shown, shown


def test_kill_9_of_a_middle_stage_node_resumes_on_the_spare_from_the_committed_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with LocalCluster(workdir=tmp_path, hub_args=HUB_ARGS) as cluster:
        cluster.start_hub()
        _start(cluster, ["a", "b", "c", "d", "spare"])
        owner = cluster.create_token("owner", "alice")
        job_id = _submit(cluster, tmp_path, owner, capsys)
        p = _wait(cluster, job_id, owner, "a committed checkpoint", lambda p: p.get("committed_step", 0) >= EVERY
                  and p.get("generation"), 180)
        victim = p["generation"]["stages"][1]["node_id"]
        (proc,) = [n for n in cluster.nodes() if n.node_id == victim]
        killed_at = time.monotonic()
        proc.signal(signal.SIGKILL)
        p = _wait(cluster, job_id, owner, "a second generation", lambda p: len(p.get("generations", [])) >= 2
                  and p.get("generation") and p["generation"]["steps_done"] > p["generation"]["first_step"], 120)
        _say(f"a step done in the new generation {time.monotonic() - killed_at:.1f} s after the kill")
        g = p["generation"]
        assert victim not in {s["node_id"] for s in g["stages"]}
        assert g["first_step"] % EVERY == 0 and g["first_step"] >= EVERY
        # the survivors keep their units and load them from their own caches: the only unit
        # states the hub serves are the victim's, which the spare takes
        assert g["state_bytes_served"] == g["state_bytes_moved"] > 0, g
        _check_final(cluster, job_id, owner)


def test_kill_9_of_the_hub_mid_pipeline_resumes_from_the_committed_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with LocalCluster(workdir=tmp_path, hub_args=HUB_ARGS) as cluster:
        cluster.start_hub()
        _start(cluster, ["a", "b", "c", "d"])
        owner = cluster.create_token("owner", "alice")
        job_id = _submit(cluster, tmp_path, owner, capsys)
        _wait(cluster, job_id, owner, "a committed checkpoint", lambda p: p.get("committed_step", 0) >= EVERY, 180)
        cluster.kill_hub(signal.SIGKILL)
        cluster.start_hub()
        p = _wait(cluster, job_id, owner, "a generation after the restart",
                  lambda p: len(p.get("generations", [])) >= 2 and p.get("generation"), 120)
        assert "restart" in p["generation"]["reason"], p["generation"]
        _check_final(cluster, job_id, owner)
