"""The journey with real processes: a `gpuflex-hub serve` process and `gpuflex-node run`
processes over 127.0.0.1, faults injected with real signals (issue 6).

These are the slowest tests in the suite; each keeps its job small (digits, few rounds).
"""

from __future__ import annotations

import hashlib
import json
import random
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.tooling.cluster import LocalCluster, Proc, digits_job

pytestmark = pytest.mark.e2e

FAST_HUB = ("--long-poll-max", "2", "--min-deadline", "4")
# Long polls of 10 s (the demo's setting): every idle node is waiting when a round opens, so
# the work is spread over the nodes however quickly this machine closes rounds.
SPREAD_HUB = ("--long-poll-max", "10", "--min-deadline", "4")

#: these runs kill or hang nodes on purpose: no referee spot-check may wait on a node that is gone
#: (tests/test_e2e_referee.py covers the referee end to end)
NO_REFEREE = "spot_check = 0.0\nspot_check_trusted = 0.0\n"


@pytest.fixture(scope="module")
def bench_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One machine benchmark shared by every node of every test in this module."""
    return tmp_path_factory.mktemp("bench") / "bench.json"


def _wait_event(proc: Proc, event: str, *, timeout_s: float, **match: Any) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for e in proc.events():
            if e.get("event") == event and all(e.get(k) == v for k, v in match.items()):
                return e
        if not proc.alive():
            raise AssertionError(
                f"{proc.name} exited before {event!r}: {proc.log.read_text()[-2000:]}"
            )
        time.sleep(0.05)
    raise AssertionError(f"no {event!r} event from {proc.name} within {timeout_s} s")


def _submit(cluster: LocalCluster, token: str, spec: Path, train: Path, val: Path) -> str:
    import asyncio

    from gpuflex.hub.ops import owner_client as oc

    return str(asyncio.run(oc.submit_job(cluster.url, token, spec, train, val))["id"])


def _hub_cli(argv: list[str], env: dict[str, str], expect_rc: int = 0) -> str:
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "gpuflex.hub", *argv],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == expect_rc, (done.returncode, done.stdout, done.stderr)
    return done.stdout


def _audit_entries(cluster: LocalCluster) -> list[dict[str, Any]]:
    lines = (cluster.hub_dir / "audit.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _centralized_accuracy(train: Path, val: Path, epochs: int = 20) -> float:
    """The same MLP trained centrally with a plain PyTorch loop: the reference point."""
    import numpy as np

    with np.load(train, allow_pickle=False) as t, np.load(val, allow_pickle=False) as v:
        xt, yt = torch.from_numpy(t["x"]), torch.from_numpy(t["y"])
        xv, yv = torch.from_numpy(v["x"]), torch.from_numpy(v["y"])
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(epochs):
        perm = torch.randperm(len(xt), generator=g)
        for i in range(0, len(perm), 32):
            b = perm[i : i + 32]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xt[b]), yt[b]).backward()
            opt.step()
    with torch.no_grad():
        return float((model(xv).argmax(1) == yv).float().mean())


def test_clean_run_reaches_095(tmp_path: Path, bench_cache: Path) -> None:
    """1. A clean run of the digits job reaches at least 0.95 test accuracy."""
    with LocalCluster(workdir=tmp_path, hub_args=SPREAD_HUB, shared_bench_cache=bench_cache) as cluster:
        cluster.start_hub()
        token = cluster.create_token("owner", "alice")
        files = digits_job(tmp_path / "job", rounds=10, local_epochs=3, replication=0.0)
        for i in range(3):
            cluster.start_node(f"n{i}")
        cluster.wait_registered()
        job_id = _submit(cluster, token, files.spec, files.train, files.val)
        status = cluster.wait_job(job_id, token, timeout_s=180)
        assert status["state"] == "done", status
        final = status["history"][-1]["accuracy"]
        central = _centralized_accuracy(files.train, files.val)
        print(f"federated accuracy {final:.4f}, centralized (20 epochs) {central:.4f}")
        assert final >= 0.95
        # the work really was spread: more than one node trained in the run
        trainers = {u["node_id"] for h in status["history"] for u in h["updates"]}
        assert len(trainers) >= 2
        model = cluster.get_bytes(f"/v1/jobs/{job_id}/model", token)
        assert len(model) > 1000


def _run_single_node_job(
    tmp_path: Path, bench_cache: Path, *, kill_hub_in_round: int | None
) -> tuple[bytes, list[str], list[str]]:
    """One node, one shard per round: the run is deterministic end to end.

    Returns the final model bytes, the update hashes the node saw acknowledged, and the
    update hashes included in aggregations according to the hub's audit log.
    """
    # one shard per round needs the whole round in a new node's first shard: no unproven-node cap
    with LocalCluster(
        workdir=tmp_path, hub_args=("--long-poll-max", "2", "--min-deadline", "60", "--unproven-max-chunks", "0")
    ) as cluster:
        cluster.start_hub()
        token = cluster.create_token("owner", "alice")
        files = digits_job(
            tmp_path / "job", rounds=3, local_epochs=8, replication=0.0, round_target_s=86400.0,
            extra_toml=NO_REFEREE,
        )
        if kill_hub_in_round is None:
            node = cluster.start_node("solo")
        else:
            # The killed round's assignment waits 4 s before training (timing only: the update
            # is the honest one), so the kill always lands while the node holds it.
            node = cluster.start_node(
                "solo", attack="stall", extra=("--stall-after", str(kill_hub_in_round), "--stall-s", "4")
            )
        job_id = _submit(cluster, token, files.spec, files.train, files.val)
        if kill_hub_in_round is not None:
            # kill -9 while the node holds the round's shard: the hub has handed it out
            # and must still take the update after restarting.
            held = _wait_event(node, "assignment", timeout_s=120, round=kill_hub_in_round)
            killed_at = time.time()
            cluster.kill_hub(signal.SIGKILL)
            time.sleep(1.0)
            cluster.start_hub()
        status = cluster.wait_job(job_id, token, timeout_s=240)
        assert status["state"] == "done", status
        if kill_hub_in_round is not None:
            # the assignment handed out before the kill was uploaded to the restarted hub
            done = _wait_event(node, "uploaded", timeout_s=5, assignment_id=held["assignment_id"])
            assert done["ok"] and done["ts"] > killed_at, (done, killed_at)
        model = cluster.get_bytes(f"/v1/jobs/{job_id}/model", token)
        acked = [
            e["update_sha256"]
            for e in node.events()
            if e.get("event") == "uploaded" and e.get("ok")
        ]
        included = [
            sha
            for e in _audit_entries(cluster)
            if e["kind"] == "aggregation"
            for sha in e["body"]["included"]
        ]
        return model, acked, included


def test_hub_kill9_mid_round_loses_nothing_and_model_is_identical(tmp_path: Path, bench_cache: Path) -> None:
    """2. kill -9 the hub mid-round, restart it: the job completes, no acknowledged update
    is lost, and the final model's tensors equal an uninterrupted run's, bit for bit."""
    clean_model, clean_acked, clean_included = _run_single_node_job(
        tmp_path / "clean", bench_cache, kill_hub_in_round=None
    )
    model, acked, included = _run_single_node_job(tmp_path / "killed", bench_cache, kill_hub_in_round=2)
    assert set(acked) <= set(included), "an acknowledged update is missing from the aggregates"
    assert included == clean_included, "the accepted update set differs from the uninterrupted run"
    assert _tensors_digest(model) == _tensors_digest(clean_model)  # the files name their own job and hub
    assert len(set(clean_acked)) == 3


def _tensors_digest(safetensors_bytes: bytes) -> str:
    """SHA-256 over a model file's tensors (names, dtypes, shapes, bytes), its metadata aside."""
    from gpuflex.protocol.tensors import state_from_safetensors

    h = hashlib.sha256()
    for name, t in sorted(state_from_safetensors(safetensors_bytes).items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_node_kill9_mid_assignment_shard_is_reassigned(tmp_path: Path, bench_cache: Path) -> None:
    """3. kill -9 a node mid-assignment: its shard goes to another node after the deadline."""
    with LocalCluster(workdir=tmp_path, hub_args=FAST_HUB, shared_bench_cache=bench_cache) as cluster:
        cluster.start_hub()
        token = cluster.create_token("owner", "alice")
        files = digits_job(
            tmp_path / "job", rounds=2, local_epochs=10, replication=0.0, round_target_s=1.0,
            extra_toml=NO_REFEREE,
        )
        # The victim's device hangs before training, so the kill always lands mid-assignment
        # (an honest node finishes this shard in ~0.1 s, faster than the test can react).
        victim = cluster.start_node("victim", attack="stall")
        _wait_event(victim, "registered", timeout_s=60)
        job_id = _submit(cluster, token, files.spec, files.train, files.val)
        first = _wait_event(victim, "assignment", timeout_s=60)
        victim.signal(signal.SIGKILL)
        victim.popen.wait(timeout=10)
        survivor = cluster.start_node("survivor")
        status = cluster.wait_job(job_id, token, timeout_s=240)
        assert status["state"] == "done", status
        (row,) = cluster.rows("SELECT state, shard_id FROM assignments WHERE id = ?", first["assignment_id"])
        assert row["state"] == "expired"
        taken = cluster.rows(
            "SELECT node_id FROM assignments a JOIN shard_chunks sc ON sc.shard_id = a.shard_id "
            "WHERE a.job_id = ? AND a.round = ? AND a.state = 'done'",
            job_id, first["round"],
        )
        assert {r["node_id"] for r in taken} == {survivor.node_id}


def test_restarted_node_keeps_identity_and_cache(tmp_path: Path, bench_cache: Path) -> None:
    """4. A node restarted on the same data folder keeps its identity and its cache, and
    downloads no chunk it already holds."""
    with LocalCluster(workdir=tmp_path, hub_args=FAST_HUB, shared_bench_cache=bench_cache) as cluster:
        cluster.start_hub()
        token = cluster.create_token("owner", "alice")
        files = digits_job(
            tmp_path / "job", rounds=4, local_epochs=1, replication=0.0, round_target_s=86400.0,
            extra_toml=NO_REFEREE,
        )
        # The first run trains one assignment, then hangs on the next until it is stopped:
        # the SIGTERM always lands mid-job, however fast the machine finishes rounds.
        node = cluster.start_node("steady", attack="stall", extra=("--stall-after", "1"))
        first_id = _wait_event(node, "registered", timeout_s=60)["node_id"]
        job_id = _submit(cluster, token, files.spec, files.train, files.val)
        _wait_event(node, "uploaded", timeout_s=120)
        node.signal(signal.SIGTERM)
        assert node.popen.wait(timeout=15) == 0
        before = [e for e in node.events() if e.get("event") == "download"]
        held = {e["sha256"] for e in before if e["kind"] == "chunk"}
        assert held, "the first run downloaded no chunk"
        log_len = len(node.events())

        again = cluster.start_node("steady")  # same data folder
        status = cluster.wait_job(job_id, token, timeout_s=180)
        assert status["state"] == "done"
        after = again.events()[log_len:]
        registered = [e for e in after if e.get("event") == "registered"]
        assert registered and registered[0]["node_id"] == first_id == again.node_id
        assert any(e.get("event") == "uploaded" and e.get("ok") for e in after), "the restart did no work"
        refetched = {
            e["sha256"] for e in after if e.get("event") == "download" and e["kind"] == "chunk"
        }
        assert not (refetched & held), "chunks already in the cache were downloaded again"


@pytest.mark.one_store  # the flagging policy on real nodes; the store calls are the journey's others'
def test_misbehaving_node_flagged_and_excluded_from_aggregate(tmp_path: Path, bench_cache: Path) -> None:
    """5. A misbehaving node is flagged, and its updates are absent from every aggregate
    that the audit log records."""
    with LocalCluster(workdir=tmp_path, hub_args=SPREAD_HUB, shared_bench_cache=bench_cache) as cluster:
        cluster.start_hub()
        token = cluster.create_token("owner", "alice")
        auditor = cluster.create_token("auditor", "carol")
        files = digits_job(tmp_path / "job", rounds=3, local_epochs=1, replication="adaptive")
        honest = [cluster.start_node(f"honest{i}") for i in range(3)]
        bad = cluster.start_node("flipper", attack="sign_flip")
        cluster.wait_registered()
        job_id = _submit(cluster, token, files.spec, files.train, files.val)
        status = cluster.wait_job(job_id, token, timeout_s=240)
        assert status["state"] == "done", status
        flags = cluster.get_json(f"/v1/flags?job={job_id}", auditor)["flags"]
        flagged_nodes = Counter(f["node_id"] for f in flags)
        assert flagged_nodes[bad.node_id] >= 1, flags
        assert not any(flagged_nodes[h.node_id] for h in honest), flags
        bad_shas = {r["sha"] for r in cluster.rows("SELECT sha FROM updates WHERE node_id = ?", bad.node_id)}
        included = {
            sha
            for e in _audit_entries(cluster)
            if e["kind"] == "aggregation"
            for sha in e["body"]["included"]
        }
        assert bad_shas, "the misbehaving node never uploaded"
        assert not (bad_shas & included)

        # The auditor's CLI against the same hub: list, show, confirm, then verify the log.
        env = {"GPUFLEX_HUB": cluster.url, "GPUFLEX_TOKEN": auditor}
        listed = json.loads(_hub_cli(["audit", "list", "--job", job_id, "--json"], env))["flags"]
        assert {f["id"] for f in listed} == {f["id"] for f in flags}
        flag = next(f for f in listed if f["node_id"] == bad.node_id)
        shown = json.loads(_hub_cli(["audit", "show", flag["id"], "--json"], env))
        assert shown["flag"]["evidence"], "a flag must carry its evidence"
        before = next(n for n in cluster.get_json("/v1/nodes", auditor)["nodes"] if bad.node_id in n.values())
        out = _hub_cli(["audit", "verdict", flag["id"], "confirm", "--note", "sign flipped"], env)
        assert "confirmed" in out
        after = next(n for n in cluster.get_json("/v1/nodes", auditor)["nodes"] if bad.node_id in n.values())
        assert before != after, "a confirmed flag must move the node's reputation"
        ok = _hub_cli(["audit", "verify-log", "--from", str(cluster.hub_dir)], env)
        assert ok.startswith("audit log OK")
        entries = _audit_entries(cluster)
        assert entries[-1]["kind"] == "verdict"

        # Tamper with a copy: change one included hash in the first aggregation entry.
        tampered = tmp_path / "tampered"
        tampered.mkdir()
        (tampered / "hub.key").write_bytes((cluster.hub_dir / "hub.key").read_bytes())
        (tampered / "hub.key").chmod(0o600)
        lines = (cluster.hub_dir / "audit.jsonl").read_text().splitlines(keepends=True)
        victim = next(i for i, line in enumerate(lines) if '"aggregation"' in line)
        lines[victim] = lines[victim].replace('"included":["', '"included":["f', 1)
        (tampered / "audit.jsonl").write_text("".join(lines))
        bad_run = _hub_cli(["audit", "verify-log", "--from", str(tampered)], env, expect_rc=1)
        assert f"line {victim + 1}:" in bad_run and "TAMPERED" in bad_run  # 1-based, as editors count


def test_churn_every_chunk_counted_once(tmp_path: Path, bench_cache: Path) -> None:
    """6. Ten nodes join and leave at random during a 10-round job; every chunk of every
    round is counted exactly once."""
    rng = random.Random(6)
    with LocalCluster(
        workdir=tmp_path, hub_args=("--long-poll-max", "1", "--min-deadline", "3")
    ) as cluster:
        cluster.start_hub()
        token = cluster.create_token("owner", "alice")
        files = digits_job(
            tmp_path / "job", rounds=10, local_epochs=4, replication=0.0, round_target_s=0.05,
            extra_toml=NO_REFEREE,
        )
        job_id = _submit(cluster, token, files.spec, files.train, files.val)
        live: dict[str, Proc] = {name: cluster.start_node(name) for name in ("c0", "c1", "c2")}
        started = len(live)
        stopped = 0
        deadline = time.monotonic() + 300
        while True:
            state = cluster.get_json(f"/v1/jobs/{job_id}", token)["state"]
            if state != "running" and state != "queued":
                break
            assert time.monotonic() < deadline, "churned job did not finish"
            name = f"c{rng.randrange(10)}"
            if name in live and live[name].alive():
                sig = signal.SIGKILL if rng.random() < 0.5 else signal.SIGTERM
                live[name].signal(sig)
                live[name].popen.wait(timeout=15)
                del live[name]
                stopped += 1
            elif len(live) < 5:
                live[name] = cluster.start_node(name)
                started += 1
            if not any(p.alive() for p in live.values()):
                live["anchor"] = cluster.start_node("anchor")
            time.sleep(rng.uniform(0.2, 0.8))
        status = cluster.get_json(f"/v1/jobs/{job_id}", token)
        assert status["state"] == "done", status
        assert started >= 5 and stopped >= 2, (started, stopped)
        chunks = {r["sha"] for r in cluster.rows("SELECT sha FROM chunks WHERE job_id = ?", job_id)}
        rows = cluster.rows(
            "SELECT u.round, sc.chunk_sha FROM updates u JOIN shard_chunks sc ON sc.shard_id = u.shard_id "
            "WHERE u.job_id = ? AND u.status = 'included'",
            job_id,
        )
        per_round: dict[int, Counter[str]] = {}
        for r in rows:
            per_round.setdefault(r["round"], Counter())[r["chunk_sha"]] += 1
        assert sorted(per_round) == list(range(10))
        for rnd, counts in per_round.items():
            assert set(counts) == chunks, f"round {rnd} missed chunks"
            assert max(counts.values()) == 1, f"round {rnd} counted a chunk twice"
