"""The hub runs a pipelined job: a real hub on 127.0.0.1 and SQLite, nodes registered and polling
with signed requests, each stage driven by the node's own engine (StageRunner over the relay).

- submission checks [pipeline] and the job gets no data-parallel shard;
- a 2-stage pipeline trains to the same parameters as one process accumulating the same
  micro-batches, checkpoints commit steps, and the final model is the job's;
- a stage node that goes silent is lost: the next generation resumes from the committed step,
  the surviving node keeps its units, the old generation's calls get stale answers;
- a hub restart (a graceful stop, and kill -9 of `gpuflex-hub serve`) resumes from the committed
  step in a new generation;
- bad checkpoints and reports are refused in one line and change nothing.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from gpuflex.hub.server.appkeys import LEDGER
from gpuflex.protocol.messages import NoWork, RelayHeader
from gpuflex.protocol.signing import new_nonce, open_sealed, seal
from gpuflex.protocol.tensors import decode_state, encode_state

from tests.helpers import RELAXED_SERVE_ARGS, open_store, store_args, stored_blobs
from tests.pipeline_hub import DIGITS_SPEC as SPEC
from tests.pipeline_hub import (
    HubThread,
    ack_of,
    b64,
    drive_all,
    error_of,
    fetch_blob,
    job_data,
    max_rel_diff,
    poll,
    poll_until,
    reference,
    register,
    request,
    send_checkpoint,
    send_report,
    submit,
    work,
)

torch.set_num_threads(1)



def status(hub: HubThread, job_id: str) -> dict:
    code, _, body = request(
        hub.url,
        "GET",
        f"/v1/jobs/{job_id}",
        None,
        {"Authorization": f"Bearer {hub.tokens['owner']}"},
    )
    assert code == 200, body
    return json.loads(body)


def wait_state(hub: HubThread, job_id: str, state: str, timeout_s: float = 30.0) -> dict:
    give_up = time.monotonic() + timeout_s
    while True:
        doc = status(hub, job_id)
        if doc["state"] == state:
            return doc
        assert time.monotonic() < give_up, f"job still {doc['state']}: {doc.get('pipeline')}"
        time.sleep(0.1)


def model_of(hub: HubThread, key, sa) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in decode_state(fetch_blob(hub.url, key, sa.model_hash)).items()}


def final_model(hub: HubThread, doc: dict) -> dict[str, torch.Tensor]:
    return {
        k: v.clone()
        for k, v in decode_state(stored_blobs(hub.hub.data_dir)[doc["model_hash"]]).items()
    }


def _trains_like_one_process(hub: HubThread, keys, got, job_id: str, *, steps: int) -> dict:
    """Drive every stage of ``got`` to the job's end; the job's final model equals one process
    accumulating the same micro-batches (<= 1e-5). The finished job's status."""
    start = model_of(hub, keys[0], got[0])
    first = next(i for i, sa in enumerate(got) if sa.stage == 0)
    x, y = job_data(hub.url, keys[first], got[first])
    runs = drive_all(hub, keys, got)
    assert all(r.error is None for r in runs), [r.error for r in runs]
    doc = wait_state(hub, job_id, "done")
    want = reference(got[0].model_spec, start, got[0], x, y, steps)
    assert (
        max_rel_diff(final_model(hub, doc), {k: v.detach() for k, v in want.state_dict().items()})
        <= 1e-5
    )
    return doc


@pytest.fixture
def hub(tmp_path, request):
    h = HubThread(tmp_path / "hub", stage_timeout_s=getattr(request, "param", 10.0))
    yield h
    h.stop()


def test_a_bad_pipeline_section_is_refused_at_submission_in_one_line(hub, tmp_path) -> None:
    for spec, words in (
        (
            SPEC.format(stages=4, steps=4, every=2),
            "pipeline.stages = 4, but the model has 3 pipeline units",
        ),
        (
            SPEC.format(stages=2, steps=4, every=2).replace(
                "micro_batches = 4", "micro_batches = 5"
            ),
            "does not divide train.batch_size",
        ),
        (
            SPEC.format(stages=2, steps=4, every=2).replace("hidden = [32, 16]", "hidden = []"),
            "nothing to cut into stages",
        ),
        (
            SPEC.format(stages=2, steps=4, every=2) + 'boundary = "subspace_log"\n',
            "the subspace_log boundary needs a rank of at least 1",
        ),
    ):
        code, doc = submit(hub, tmp_path, spec)
        assert code == 422 and doc["error"] == "bad_spec" and words in doc["detail"], doc
        assert "\n" not in doc["detail"]


def test_a_two_stage_pipeline_equals_one_process_and_its_model_is_the_jobs(hub, tmp_path) -> None:
    keys = [register(hub.url, "10.0.0.5:7070"), register(hub.url)]
    code, job = submit(hub, tmp_path, SPEC.format(stages=2, steps=6, every=3))
    assert code == 201, job
    got = poll_until(hub, keys)
    assert sorted(sa.stage for sa in got) == [0, 1] and {sa.generation for sa in got} == {1}
    addresses = dict(zip(got[0].stage_nodes, got[0].stage_addresses, strict=True))
    assert addresses == {keys[0].fingerprint: "10.0.0.5:7070", keys[1].fingerprint: ""}
    assert all(sa.first_step == 0 and sa.end_step == 6 and sa.micro_batches == 4 for sa in got)
    assert hub.call(lambda: hub.hub.app[LEDGER].scheduler.jobs[job["id"]].live_count()) == 0
    again, _ = open_sealed(
        work(hub, keys[0], 0.2), NoWork, signer=hub.hub_key
    )  # a stage is handed once
    assert (
        again.reason == "this node runs a pipeline stage: it takes other work once the stage ends"
    )
    doc = status(hub, job["id"])
    assert (
        doc["pipeline"]["generation"]["number"] == 1
        and len(doc["pipeline"]["generation"]["stages"]) == 2
    )
    doc = _trains_like_one_process(hub, keys, got, job["id"], steps=6)
    p = doc["pipeline"]
    assert p["committed_step"] == 6 and p["steps"] == 6
    assert [r["generation"] for r in p["generations"]] == [1] and p["generations"][0][
        "measured_step_s"
    ] > 0
    conn = open_store(hub.hub.data_dir)
    try:
        units = conn.execute("SELECT unit, step FROM unit_states ORDER BY step, unit").fetchall()
        reports = conn.execute("SELECT COUNT(*), COUNT(loss) FROM stage_reports").fetchone()
    finally:
        conn.close()
    assert units == [(0, 3), (1, 3), (2, 3), (0, 6), (1, 6), (2, 6)]
    assert reports == (12, 6), "each stage reports each step; the last stage its loss"


def test_two_pipelines_share_each_step_and_train_what_one_process_does(
    hub, tmp_path, monkeypatch, capsys
) -> None:
    """Hybrid data + pipeline parallelism: 4 nodes and ``pipelines = 2`` make two pipelines of
    2 stages, cut the same, each training 2 of the step's 4 micro-batches and summing its
    stages' gradients with the other's through the relay. The job's final model equals one
    process accumulating all 4; only pipeline 0 checkpoints; status shows both pipelines."""
    keys = [register(hub.url) for _ in range(4)]
    for key in keys:  # every node asks for work before the job comes: all four are idle
        work(hub, key, 0.1)
    code, job = submit(hub, tmp_path, SPEC.format(stages=2, steps=6, every=3) + "pipelines = 2\n")
    assert code == 201, job
    got = poll_until(hub, keys)
    assert {sa.lanes for sa in got} == {2} and sorted(sa.stage for sa in got) == [0, 1, 2, 3]
    assert {sa.micro_batches for sa in got} == {2}
    assert got[0].stage_starts[:2] == got[0].stage_starts[2:]
    assert {len(sa.chunks) > 0 for sa in got} == {True}  # every stage is a first or a last one
    second = next(i for i, sa in enumerate(got) if sa.stage == 2)
    status_code, body = send_checkpoint(
        hub.url, keys[second], got[second], got[second].unit_start, 3, b"x"
    )
    assert status_code == 403 and error_of(body) == (
        "not_your_unit",
        "stage 2 is in pipeline 1 of 2: every pipeline holds the same state, and pipeline 0"
        " checkpoints it",
    )
    doc = _trains_like_one_process(hub, keys, got, job["id"], steps=6)
    (past,) = doc["pipeline"]["generations"]
    assert (past["pipelines"], past["stages"]) == (2, 2) and past["loss"] > 0
    out = cli_status(hub, job["id"], monkeypatch, capsys)
    assert "2 pipelines of 2 stages" not in out  # the generation is over: its line says so below
    assert "generation 1 (from step 0, 2 stages" in out


def test_a_lora_job_with_int8_frozen_weights_pipelines_and_trains_only_its_adapters(
    hub, tmp_path
) -> None:
    """``finetune = "lora"`` with ``[pipeline]``: each stage holds its units' frozen weights in
    int8 and trains their adapters; the final model equals one process accumulating the same
    micro-batches, its frozen weights are the initial ones, and the owner downloads it merged."""
    keys = [register(hub.url), register(hub.url)]
    lora = 'momentum = 0.9\nfinetune = "lora"\nlora_rank = 4\nfrozen_precision = "int8"\n'
    code, job = submit(hub, tmp_path, SPEC.format(stages=2, steps=4, every=2).replace("momentum = 0.9\n", lora))
    assert code == 201, job
    got = poll_until(hub, keys)
    start = model_of(hub, keys[0], got[0])
    doc = _trains_like_one_process(hub, keys, got, job["id"], steps=4)
    final = final_model(hub, doc)
    frozen = [k for k in final if k.endswith("weight_q")]
    assert len(frozen) == 3 and all(final[k].dtype == torch.int8 for k in frozen)
    assert all(torch.equal(final[k], start[k]) for k in final if not k.endswith(("lora_a", "lora_b")))
    assert all(not torch.equal(final[k], start[k]) for k in final if k.endswith("lora_b"))
    code, _, body = request(
        hub.url, "GET", f"/v1/jobs/{job['id']}/model", None,
        {"Authorization": f"Bearer {hub.tokens['owner']}"},
    )  # fmt: skip
    assert code == 200 and b"lora_a" not in body and b"weight_q" not in body  # the merged plain model


def _stale_answers(hub: HubThread, key, sa) -> None:
    """Generation ``sa.generation`` is over: the relay, the reports and the checkpoints say so."""
    body = encode_state({"activation": torch.zeros(8, 32)})
    import hashlib

    hdr = RelayHeader(
        job_id=sa.job_id,
        step=sa.first_step,
        micro_batch=0,
        carries="activation",
        stage=0,
        to_stage=1,
        sha256=hashlib.sha256(body).hexdigest(),
        size=len(body),
        timestamp=time.time(),
        nonce=new_nonce(),
        generation=sa.generation,
    )
    code, _, answer = request(
        hub.url, "POST", "/v1/relay", body, {"X-GPUFlex-Relay": b64(seal(key, hdr))}
    )
    assert code == 409 and error_of(answer)[0] == "stale_generation", answer
    code, answer = send_report(hub.url, key, sa, sa.first_step + 1)
    assert code == 200 and not ack_of(hub, answer).ok
    code, answer = send_checkpoint(hub.url, key, sa, sa.unit_start, sa.end_step, b"x")
    assert code == 409 and error_of(answer)[0] == "stale_generation", answer


def cli_status(hub: HubThread, job_id: str, monkeypatch, capsys) -> str:
    from gpuflex.hub.ops import cli

    monkeypatch.setenv("GPUFLEX_HUB", hub.url)
    monkeypatch.setenv("GPUFLEX_TOKEN", hub.tokens["owner"])
    capsys.readouterr()
    assert cli.main(["job", "status", job_id]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("hub", [8.0], indirect=True)
def test_a_lost_stage_node_is_replaced_from_the_committed_step(
    hub, tmp_path, monkeypatch, capsys
) -> None:
    keys = [register(hub.url) for _ in range(3)]
    code, job = submit(hub, tmp_path, SPEC.format(stages=2, steps=6, every=2))
    assert code == 201, job
    # two of the three nodes poll first: they get the stages; the third waits idle
    first = poll_until(hub, keys[:2])
    lost = next(i for i, sa in enumerate(first) if sa.stage == 1)
    kept = 1 - lost
    start = model_of(hub, keys[0], first[0])
    x, y = job_data(hub.url, keys[kept], first[kept])
    # the last stage's node checkpoints step 2, then dies before reporting step 3
    runs = drive_all(hub, keys[:2], first, options={lost: {"stop_at": 3, "report_last": False}})
    assert runs[lost].error is None and runs[kept].error is not None, (
        "the survivor stops on stale answers"
    )
    second = poll_until(hub, [keys[kept], keys[2]])
    assert {sa.generation for sa in second} == {2} and all(sa.first_step == 2 for sa in second)
    assert (second[0].stage, second[0].unit_start, second[0].unit_end) == (
        first[kept].stage,
        first[kept].unit_start,
        first[kept].unit_end,
    ), "the survivor keeps its units"
    assert [u.unit for u in second[1].unit_states] == list(
        range(second[1].unit_start, second[1].unit_end)
    )
    _stale_answers(hub, keys[kept], first[kept])
    other = (
        second[1].unit_states[0].sha256
    )  # a unit state of the other stage: not the survivor's to read
    assert _blob_status(hub, keys[kept], other) == 403 and _blob_status(hub, keys[2], other) == 200
    assert _blob_status(hub, keys[lost], second[0].model_hash) == 403, (
        "the lost node holds no stage"
    )
    runs = drive_all(hub, [keys[kept], keys[2]], second)
    assert all(r.error is None for r in runs), [r.error for r in runs]
    doc = wait_state(hub, job["id"], "done")
    want = reference(first[0].model_spec, start, first[0], x, y, 6)
    assert (
        max_rel_diff(final_model(hub, doc), {k: v.detach() for k, v in want.state_dict().items()})
        <= 1e-5
    )
    (old, new) = doc["pipeline"]["generations"]
    assert old["reason"] == "the first plan" and old["ended_at"] is not None
    assert (
        new["first_step"] == 2
        and "sent no report" in new["reason"]
        and keys[lost].fingerprint in new["reason"]
    )


def test_a_cancelled_pipelined_job_ends_its_generation(hub, tmp_path) -> None:
    keys = [register(hub.url) for _ in range(2)]
    code, job = submit(hub, tmp_path, SPEC.format(stages=2, steps=4, every=2))
    assert code == 201, job
    got = poll_until(hub, keys)
    code, _, body = request(
        hub.url,
        "POST",
        f"/v1/jobs/{job['id']}/cancel",
        None,
        {"Authorization": f"Bearer {hub.tokens['owner']}"},
    )
    assert code == 200 and json.loads(body)["state"] == "cancelled"
    code, answer = send_report(hub.url, keys[0], got[0], 1)
    assert code == 200 and not ack_of(hub, answer).ok
    code, answer = send_checkpoint(hub.url, keys[0], got[0], got[0].unit_start, 2, b"x")
    assert (code, error_of(answer)[0]) == (409, "stale_generation")
    give_up = time.monotonic() + 10
    while hub.call(lambda: job["id"] in hub.hub.app[LEDGER].pipelines.jobs):
        assert time.monotonic() < give_up, "the cancelled job's pipeline is still held"
        time.sleep(0.1)
    assert poll(hub, keys[0], 0.2) is None


def _blob_status(hub: HubThread, key, sha: str) -> int:
    from gpuflex.protocol.messages import BlobRequest

    auth = BlobRequest(sha256=sha, timestamp=time.time(), nonce=new_nonce())
    code, _, _ = request(
        hub.url, "GET", f"/v1/blobs/{sha}", None, {"X-GPUFlex-Auth": b64(seal(key, auth))}
    )
    return code


def test_a_failed_report_replans_at_once(hub, tmp_path) -> None:
    keys = [register(hub.url) for _ in range(2)]
    code, job = submit(hub, tmp_path, SPEC.format(stages=2, steps=4, every=2))
    assert code == 201, job
    got = poll_until(hub, keys)
    code, answer = send_report(
        hub.url, keys[0], got[0], 0, failed="a peer's tensor did not come within 60 s"
    )
    assert code == 200 and not ack_of(hub, answer).ok
    again = poll_until(hub, keys)
    assert {sa.generation for sa in again} == {2}
    reasons = [g["reason"] for g in status(hub, job["id"])["pipeline"]["generations"]]
    assert "stopped: a peer's tensor did not come within 60 s" in reasons[1]


SGD_LINES = 'optimizer = "sgd"\nlr = 0.05\nmomentum = 0.9'


@pytest.mark.parametrize("stages", [2, 3])
def test_a_restarted_hub_resumes_from_the_committed_step_in_a_new_generation(
    tmp_path, stages
) -> None:
    """2 stages under SGD with momentum; 3 stages (one unit each) under Adam, its moments and step
    count carried through the checkpoints."""
    spec = SPEC.format(stages=stages, steps=6, every=2)
    if stages == 3:
        spec = spec.replace(SGD_LINES, 'optimizer = "adam"\nlr = 0.01')
    hub = HubThread(tmp_path / "hub", stage_timeout_s=30.0)
    try:
        keys = [register(hub.url) for _ in range(stages)]
        code, job = submit(hub, tmp_path, spec)
        assert code == 201, job
        first = poll_until(hub, keys)
        assert (
            first[0].train.optimizer == ("adam" if stages == 3 else "sgd")
            and len(first[0].stage_nodes) == stages
        )
        start = model_of(hub, keys[0], first[0])
        x, y = job_data(
            hub.url,
            keys[next(i for i, s in enumerate(first) if s.stage == 0)],
            next(s for s in first if s.stage == 0),
        )
        runs = drive_all(hub, keys, first, options={i: {"stop_at": 4} for i in range(stages)})
        assert all(r.error is None for r in runs)
    finally:
        hub.stop()
    hub = HubThread(tmp_path / "hub", tokens=hub.tokens, stage_timeout_s=30.0)
    try:
        second = poll_until(hub, keys)
        assert {sa.generation for sa in second} == {2} and {sa.first_step for sa in second} == {4}
        runs = drive_all(hub, keys, second)
        assert all(r.error is None for r in runs), [r.error for r in runs]
        doc = wait_state(hub, job["id"], "done")
        want = reference(first[0].model_spec, start, first[0], x, y, 6)
        assert (
            max_rel_diff(
                final_model(hub, doc), {k: v.detach() for k, v in want.state_dict().items()}
            )
            <= 1e-5
        )
        assert "the hub restarted" in doc["pipeline"]["generations"][1]["reason"]
    finally:
        hub.stop()


def test_bad_checkpoints_and_reports_are_refused_in_one_line_and_change_nothing(tmp_path) -> None:
    hub = HubThread(tmp_path / "hub", stage_timeout_s=60.0)
    try:
        _bad_inputs(hub, tmp_path)
    finally:
        hub.stop()


def _bad_inputs(hub: HubThread, tmp_path) -> None:
    keys = [register(hub.url) for _ in range(2)]
    code, job = submit(hub, tmp_path, SPEC.format(stages=2, steps=4, every=2))
    assert code == 201, job
    got = poll_until(hub, keys)
    s0 = next(i for i, sa in enumerate(got) if sa.stage == 0)
    k0, a0 = keys[s0], got[s0]
    stranger = register(hub.url)
    unit = a0.unit_start
    units = {u: torch.randn(32, 64) for u in ("0.weight",)} | {"0.bias": torch.randn(32)}
    good = encode_state(
        units | {f"optim.momentum_buffer.{k}": torch.zeros_like(v) for k, v in units.items()}
    )
    nan = dict(units)
    nan["0.bias"] = torch.full((32,), float("nan"))
    cases = [
        (dict(key=stranger), 403, "not_your_stage"),
        (dict(stage=1 - a0.stage), 403, "not_your_stage"),
        (dict(unit=a0.unit_end), 403, "not_your_unit"),
        (dict(generation=a0.generation + 1), 409, "stale_generation"),
        (dict(job_id="j-0000000000000000"), 404, "unknown_job"),
        (dict(step=1), 400, "not_a_checkpoint_step"),
        (dict(size=1 << 30), 413, "too_large"),
        (dict(sha="ab" * 32), 422, "hash_mismatch"),
        (dict(body=encode_state({"0.weight": units["0.weight"]})), 422, "bad_state"),
        (dict(body=encode_state(units | {"extra": torch.zeros(1)})), 422, "bad_state"),
        (
            dict(body=encode_state({"0.weight": torch.zeros(3, 3), "0.bias": units["0.bias"]})),
            422,
            "bad_state",
        ),
        (dict(body=encode_state(nan)), 422, "nonfinite"),
    ]
    for change, want_status, want_code in cases:
        args = dict(key=k0, unit=unit, step=2, body=good) | change
        key, body = args.pop("key"), args.pop("body")
        code, answer = send_checkpoint(
            hub.url, key, a0, args.pop("unit"), args.pop("step"), body, **args
        )
        assert (code, error_of(answer)[0]) == (want_status, want_code), (change, answer)
    for change, want_status, want_code in (
        (dict(key=stranger), 403, "not_your_stage"),
        (dict(job_id="j-0000000000000000"), 404, "unknown_job"),
        (dict(steps_done=99), 400, "bad_step"),
        (dict(compute_s=0.01, update_s=0.02), 400, "bad_report"),
    ):
        args = dict(key=k0, steps_done=1) | change
        code, answer = send_report(hub.url, args.pop("key"), a0, args.pop("steps_done"), **args)
        assert (code, error_of(answer)[0]) == (want_status, want_code), (change, answer)
    code, answer = send_report(hub.url, k0, a0, 1, generation=a0.generation + 1)
    assert code == 200 and not ack_of(hub, answer).ok
    conn = open_store(hub.hub.data_dir)
    try:
        assert conn.execute("SELECT COUNT(*) FROM unit_states").fetchone()[0] == 0
        assert conn.execute("SELECT COUNT(*) FROM stage_reports").fetchone()[0] == 0
        assert conn.execute("SELECT committed_step FROM pipelines").fetchone()[0] == 0
    finally:
        conn.close()
    code, answer = send_checkpoint(hub.url, k0, a0, unit, 2, good)
    assert code == 200 and ack_of(hub, answer).ok, answer
    assert poll(hub, stranger, 0.2) is None


def test_a_pipelined_job_waits_for_nodes_with_the_planners_line(
    hub, tmp_path, monkeypatch, capsys
) -> None:
    register(hub.url)
    code, job = submit(hub, tmp_path, SPEC.format(stages=2, steps=4, every=2))
    assert code == 201, job
    give_up = time.monotonic() + 10
    while "needs" not in ((p := status(hub, job["id"])["pipeline"])["waiting"] or ""):
        assert time.monotonic() < give_up, p
        time.sleep(0.1)
    assert p["generation"] is None
    assert p["waiting"] == "the pipeline needs 2 nodes with a memory offer; 0 idle nodes are online"
    out = cli_status(hub, job["id"], monkeypatch, capsys)
    assert "step 0/4 committed" in out and f"waiting: {p['waiting']}" in out


def plan_of(hub: HubThread, job_id: str) -> dict:
    code, _, body = request(
        hub.url,
        "GET",
        f"/v1/jobs/{job_id}/plan",
        None,
        {"Authorization": f"Bearer {hub.tokens['owner']}"},
    )
    assert code == 200, body
    return json.loads(body)


def test_a_stages_reported_compute_time_is_its_nodes_speed_in_the_offers(hub, tmp_path) -> None:
    from gpuflex.hub.ops.cli_plan import plan_lines

    keys = [register(hub.url), register(hub.url)]
    code, job = submit(hub, tmp_path, SPEC.format(stages=2, steps=8, every=4))
    assert code == 201, job
    sa = poll_until(hub, keys)[0]
    node = keys[0].fingerprint

    def offer() -> dict:
        nodes = plan_of(hub, job["id"])["offers"]["nodes"]
        return next(n for n in nodes if n["node_id"] == node)

    benchmark = offer()
    assert benchmark["speed_from"] == "benchmark" and benchmark["speed_steps"] == 0
    # two slow warm-up steps, then 0.5 s steps with one outlier (a step that says it took 1 ms);
    # 0.1 s of each 0.5 s step was its end (the optimizer step), which the outlier does not say,
    # and each unit took 2 ms per micro-batch whatever its size
    for done, compute_s in enumerate((9.0, 9.0, 0.5, 0.5, 0.001, 0.5), 1):
        update_s = 0.1 if compute_s == 0.5 else 0.0
        code, answer = send_report(
            hub.url, keys[0], sa, done, compute_s=compute_s, update_s=update_s, unit_overhead_s=0.002
        )
        assert code == 200 and ack_of(hub, answer).ok, answer
    cut = hub.call(lambda: hub.hub.app[LEDGER].pipelines.known_cut(job["id"]))
    units = cut.costs[sa.unit_start : sa.unit_end]
    # the step's 32 samples through the stage's units in the 0.4 s before its end, less the
    # fixed 2 ms per unit and micro-batch; the update: the units' state in 0.1 s
    work = 32 * sum(u.flops for u in units)
    fixed = 0.002 * len(units) * sa.micro_batches
    assert 0 < fixed < 0.2
    measured = offer()
    assert measured["speed_from"] == "stage_reports" and measured["speed_steps"] == 4
    assert measured["flops_per_s"] == pytest.approx(work / (0.4 - fixed))
    assert measured["unit_overhead_s"] == pytest.approx(0.002)
    assert measured["update_bytes_per_s"] == pytest.approx(sum(u.state_bytes for u in units) / 0.1)
    assert measured["flops_per_s"] != pytest.approx(benchmark["flops_per_s"], rel=0.1)
    doc = plan_of(hub, job["id"])
    assert f"speed of {node}: measured on its stage, median of 4 step(s)" in plan_lines(doc)
    # the node not measured: its benchmark (the same as the measured node's) on the measured scale
    other = next(n for n in doc["offers"]["nodes"] if n["node_id"] != node)
    assert other["speed_from"] == "benchmark" and other["speed_steps"] == 0
    assert other["update_bytes_per_s"] is None and other["unit_overhead_s"] is None
    scale = doc["offers"]["speed"]["benchmark_scale"]
    assert scale == pytest.approx(measured["flops_per_s"] / benchmark["flops_per_s"])
    assert other["flops_per_s"] == pytest.approx(measured["flops_per_s"])
    assert f"benchmarks scaled x{scale:.3g} to the measured nodes' speeds" in plan_lines(doc)


def test_serve_takes_a_stage_timeout_and_refuses_a_bad_one_in_one_line(tmp_path, capsys) -> None:
    from gpuflex.hub.ops import cli

    parser = cli.build_parser()
    args = parser.parse_args(["serve", "--data", str(tmp_path), "--stage-timeout", "12.5"])
    assert cli._serve_config(args).stage_timeout_s == 12.5
    args = parser.parse_args(["serve", "--data", str(tmp_path), "--stage-timeout", "0"])
    assert cli._serve_config(args) is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--stage-timeout must be a number of seconds above 0" in err


@dataclass
class _ServedHub:
    """A `gpuflex-hub serve` process as the stage driver reads a hub: its URL, key and tokens."""

    url: str
    hub_key: bytes
    tokens: dict[str, str]


def _serve(data_dir: Path, port: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpuflex.hub",
            "serve",
            "--data",
            str(data_dir),
            "--port",
            port,
            "--long-poll-max",
            "1",
            "--stage-timeout",
            "60",
            *RELAXED_SERVE_ARGS,
            *store_args(data_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if "listening on" in line:
            return proc
    raise AssertionError("the hub did not start again")


def test_a_hub_killed_with_sigkill_resumes_the_pipeline_from_its_committed_step(
    hub_process, tmp_path
) -> None:
    hp = hub_process
    _, _, body = request(hp.url, "GET", "/v1/hub")
    hub = _ServedHub(
        hp.url, bytes.fromhex(json.loads(body)["public_key"]), {"owner": hp.token("owner", "olga")}
    )
    keys = [register(hub.url) for _ in range(2)]
    code, job = submit(hub, tmp_path, SPEC.format(stages=2, steps=6, every=2))
    assert code == 201, job
    first = poll_until(hub, keys)
    s0 = next(i for i, sa in enumerate(first) if sa.stage == 0)
    start = model_of(hub, keys[0], first[0])
    x, y = job_data(hub.url, keys[s0], first[s0])
    runs = drive_all(hub, keys, first, options={0: {"stop_at": 4}, 1: {"stop_at": 4}})
    assert all(r.error is None for r in runs)
    hp.proc.kill()  # kill -9, right after step 4 was committed
    hp.proc.wait(timeout=30)
    proc = _serve(hp.data_dir, hp.url.rsplit(":", 1)[1])
    try:
        second = poll_until(hub, keys)
        assert {sa.generation for sa in second} == {2} and {sa.first_step for sa in second} == {4}
        runs = drive_all(hub, keys, second)
        assert all(r.error is None for r in runs), [r.error for r in runs]
        doc = wait_state(hub, job["id"], "done")
        want = reference(first[0].model_spec, start, first[0], x, y, 6)
        assert max_rel_diff(final_model_of(hub, keys[0], doc), _state(want)) <= 1e-5
        assert "the hub restarted" in doc["pipeline"]["generations"][1]["reason"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in module.state_dict().items()}


def final_model_of(hub: _ServedHub, key, doc: dict) -> dict[str, torch.Tensor]:
    """The job's final model, downloaded as its owner would (safetensors, GET /v1/jobs/{id}/model)."""
    from safetensors.torch import load

    code, _, body = request(
        hub.url,
        "GET",
        f"/v1/jobs/{doc['id']}/model",
        None,
        {"Authorization": f"Bearer {hub.tokens['owner']}"},
    )
    assert code == 200, body[:200]
    return dict(load(body))
