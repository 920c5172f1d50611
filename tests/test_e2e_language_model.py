"""A transformer language model trained end to end through the data-parallel path: the owner
submits the standard library's own source text (`gpuflex-hub job submit --train corpus.txt`),
a real `gpuflex-hub serve` cuts its windows into chunks, two real `gpuflex-node run` processes
train them, and the validation loss per position falls round after round; the same with
mixture-of-experts MLPs (each node holding every expert)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from gpuflex.hub.ops import cli

from tests.tooling.cluster import LocalCluster
from tests.tooling.text import stdlib_text

pytestmark = pytest.mark.e2e

ROUNDS = 4
SPEC = f"""[job]
name = "stdlib-bytes"

[model]
kind = "transformer"
vocab = 256
context = 32
layers = 2
width = 32
heads = 4
dropout = 0.0
{{experts}}
[train]
rounds = {ROUNDS}
local_epochs = 1
batch_size = 32
optimizer = "adam"
lr = 0.003
round_target_s = 2.0

[data]
chunk_size = 128
validation_fraction = 0.1
"""


MOE = "experts = 4\ntop_k = 2\nrouter_jitter = 0.01\naux_loss_weight = 0.03\n"


@pytest.mark.one_store  # a model kind on real nodes: its store traffic is any job's
@pytest.mark.parametrize("experts", ["", MOE], ids=["dense", "experts"])
def test_a_transformer_learns_the_standard_librarys_bytes_on_real_nodes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], experts: str
) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.replace("{experts}", experts))
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(stdlib_text(64_000))  # 1999 windows of 32 bytes
    with LocalCluster(
        workdir=tmp_path, hub_args=("--long-poll-max", "2", "--min-deadline", "4")
    ) as cluster:
        cluster.start_hub()
        cluster.start_node("a")
        cluster.start_node("b")
        cluster.wait_registered()
        owner = cluster.create_token("owner", "alice")
        capsys.readouterr()
        code = cli.main(
            [
                "job",
                "submit",
                str(spec),
                "--train",
                str(corpus),
                "--hub",
                cluster.url,
                "--token",
                owner,
                "--json",
            ]
        )
        out, err = capsys.readouterr()
        assert code == 0, err
        job = json.loads(out)
        assert job["chunks"] >= 2, job  # the held-out tenth aside, the windows make several chunks
        status = cluster.wait_job(job["id"], owner, timeout_s=300)
    assert status["state"] == "done", status
    history = status["history"]
    assert len(history) == ROUNDS
    losses = [h["loss"] for h in history]
    assert all(a > b for a, b in itertools.pairwise(losses)), losses
    assert losses[-1] < 4.0, losses  # ln 256 = 5.55: a uniform guess over bytes
    assert history[-1]["accuracy"] > history[0]["accuracy"], history
    assert all(h["flags"] == [] for h in history)
