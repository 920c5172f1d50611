"""node/devices: a node that trains on several local devices (here: gloo worker processes on the
CPU) gives one process's update, keeps its checkpoint commitment, survives or hands back an
assignment whose worker was killed, and refuses devices it does not have before any work."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from pathlib import Path

import pytest
import torch
from gpuflex.node import cli
from gpuflex.node.benchmark import (
    bench_fingerprint,
    benchmark_for_registration,
    load_cached,
    measure_and_cache,
)
from gpuflex.node.checkpoints import CheckpointRecorder
from gpuflex.node.devices import WorkerGroup, parse_devices
from gpuflex.node.devices.job import CommitSettings
from gpuflex.node.devices.plan import check_offload, choose_engine, training_bytes
from gpuflex.node.errors import ConfigError, TrainError, TrainingStopped
from gpuflex.node.trainer import train_assignment
from gpuflex.protocol.messages import TrainConfig
from gpuflex.protocol.modelspec import ModelSpec, build_model
from gpuflex.protocol.tensors import decode_state
from test_node_support import EventLog, Hub, agent, dataset, spec_toml, wait_for

CPU = torch.device("cpu")
SPEC = ModelSpec.from_dict({"kind": "mlp", "input": 8, "hidden": [24, 16], "outputs": 3, "dropout": 0.2})


def _cfg(**kw) -> TrainConfig:
    base = dict(local_epochs=2, batch_size=16, optimizer="sgd", lr=0.05, momentum=0.9, weight_decay=0.0,
                beta1=0.9, beta2=0.999, loss="cross_entropy", grad_clip=1.0)
    base.update(kw)
    return TrainConfig(**base)


def _chunks(n: int):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
    return [{"x": x[i : i + 32], "y": y[i : i + 32]} for i in range(0, n, 32)]


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp_min(1e-12))
               for k in b if b[k].is_floating_point())


# -- bad input, before any work ------------------------------------------------------------------


@pytest.mark.parametrize(("text", "why"), [
    ("0,1", "CUDA is not available"), ("cuda:0", "CUDA is not available"), ("gpu", "expected all"),
    ("cpu:0", "worker count"), ("cpu:99", "worker count"), ("cpu:x", "worker count"),
])
def test_devices_that_do_not_exist_are_refused(text, why):
    with pytest.raises(ConfigError, match=why) as info:
        parse_devices(text, cuda_count=0)
    assert "\n" not in str(info.value)


def test_device_lists_parse():
    assert parse_devices("all", cuda_count=0).names() == ["cpu"]
    assert parse_devices("all", cuda_count=2).names() == ["cuda:0", "cuda:1"]
    assert parse_devices("1,cuda:0", cuda_count=2).names() == ["cuda:1", "cuda:0"]
    plan = parse_devices("cpu:3", offload="optimizer")
    assert plan.workers == 3 and plan.backend == "gloo" and plan.offload
    with pytest.raises(ConfigError, match="named twice"):
        parse_devices("0,0", cuda_count=2)
    with pytest.raises(ConfigError, match="--offload"):
        parse_devices("cpu:2", offload="params")
    assert parse_devices("0,1", cuda_count=2).backend == "nccl"


def test_offload_without_room_and_engine_choice():
    plan = parse_devices("cpu:2", offload="optimizer")
    with pytest.raises(ConfigError, match="--offload optimizer: the host has"):
        check_offload(plan, budget=8 << 30, host_free=4 << 30)
    check_offload(plan, budget=8 << 30, host_free=9 << 30)
    model, opt = training_bytes(build_model(SPEC, seed=0).state_dict(), _cfg(optimizer="adam"))
    assert opt == model  # two moments = parameters + gradients
    assert choose_engine(model, opt, workers=2, budget=model + opt, offload=False) == "ddp"
    assert choose_engine(model, opt, workers=2, budget=(model + opt) // 2, offload=False) == "fsdp"
    assert choose_engine(model, opt, workers=2, budget=model, offload=True, host_free=opt) == "ddp"
    with pytest.raises(TrainError, match="even sharded"):
        choose_engine(model, opt, workers=2, budget=(model + opt) // 3, offload=False)
    with pytest.raises(TrainError, match="the host has"):
        choose_engine(model, opt, workers=2, budget=model, offload=True, host_free=opt - 1)


@pytest.mark.parametrize(("extra", "why"), [
    (["--devices", "3"], "no CUDA device 3"),
    (["--devices", "cpu:2", "--device", "cpu"], "give one of them"),
    (["--devices", "cpu:2", "--offload", "optimizer", "--max-memory", "1000TiB"], "--offload optimizer: the host"),
])
def test_cli_refuses_bad_devices_in_one_line_before_any_work(tmp_path, capsys, extra, why):
    if extra[1] == "3" and torch.cuda.device_count() > 3:
        pytest.skip("this machine has a CUDA device 3")
    data = tmp_path / "node"
    code = cli.main(["run", "--hub", "http://127.0.0.1:9", "--data-dir", str(data), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and why in err[0], err
    assert not (data / "node.key").exists() and not (data / "devices").exists()


@pytest.mark.parametrize(("extra", "why"), [
    (["--devices", "cpu:2", "--device", "cpu"], "give one of them"),
    (["--offload", "optimizer"], "--offload needs --devices"),
    (["--devices", "3"], "no CUDA device 3"),
])
def test_bench_refuses_bad_devices_in_one_line(tmp_path, capsys, extra, why):
    if extra[1] == "3" and torch.cuda.device_count() > 3:
        pytest.skip("this machine has a CUDA device 3")
    code = cli.main(["bench", "--data-dir", str(tmp_path / "node"), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and why in err[0], err
    assert not (tmp_path / "node" / "bench.json").exists()


def test_the_benchmark_measures_the_whole_node_through_its_workers(tmp_path):
    """A node on several devices registers with what its workers train together, cached apart
    from the one-device figures, and read back without measuring again."""
    events = EventLog()
    group = WorkerGroup(parse_devices("cpu:2"), tmp_path / "work", threads=2, on_event=events.event)
    path = tmp_path / "bench.json"
    results = measure_and_cache(CPU, path, quick=True, group=group)
    trained = len(results["precision_sps"])  # one worker group run per training figure (quick)
    # a worker lost on the way (gloo can abort) is restarted once, as for an assignment: a
    # group more, each said
    retried = [e for e in events.of("workers_lost") if e["action"] == "retry"]
    assert len(retried) == len(events.of("workers_lost")), events.of("workers_lost")
    started = len(events.of("workers")) - len(retried)
    assert results["workers"] == ["cpu", "cpu"] and started == trained >= 1
    assert results["samples_per_s"] == results["precision_sps"]["fp32"] > 0
    assert results["fingerprint"] == bench_fingerprint(CPU, group) != bench_fingerprint(CPU)
    assert load_cached(CPU, path) is None and load_cached(CPU, path, group) == results

    def measured_again() -> None:
        raise AssertionError("measured again")

    message = benchmark_for_registration(CPU, path, group=group, on_measure=measured_again)
    assert message.samples_per_s == results["samples_per_s"] and len(events.of("workers")) == trained


# -- one process's update, on 2 and 3 worker processes ----------------------------------------------


def _reference(chunks, cfg: TrainConfig):
    """One process's update and its checkpoint states, recorded as the node does."""
    result = train_assignment(SPEC, GLOBAL, chunks, cfg, seed=5, device=CPU, on_step=(rec := _Recorder(chunks, cfg)))
    return result, rec


class _Recorder(CheckpointRecorder):
    """Keeps each checkpoint state in memory (besides its hash)."""

    def __init__(self, chunks, cfg: TrainConfig) -> None:
        from gpuflex.protocol.checkpoint import auto_every
        from gpuflex.protocol.workload import assignment_steps

        total = assignment_steps(sum(len(c["x"]) for c in chunks), cfg.batch_size, cfg.local_epochs, cfg.local_steps)
        super().__init__(total_steps=total, every=auto_every(total), precision=cfg.precision)
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def record(self, step, state):
        self.states[step] = dict(state)
        super().record(step, state)


GLOBAL = build_model(SPEC, seed=1).state_dict()


def _check_equivalent(tmp_path: Path, *, devices: str, engine: str, cfg: TrainConfig, n: int) -> None:
    chunks = _chunks(n)
    ref, rec = _reference(chunks, cfg)
    root = tmp_path / "checkpoints"
    commit = CommitSettings(root=str(root), assignment_id="a1", total_steps=rec.total_steps, every=rec.every,
                            precision="fp32")
    events = EventLog()
    # one restart, as a node runs: gloo's TCP transport can, rarely, abort a worker (SIGABRT from a
    # race in its pair code); the group then trains again from the start and must still be exact
    group = WorkerGroup(parse_devices(devices), tmp_path / "work", engine=engine, threads=2, restarts=1,
                        on_event=events.event)
    got = group.train(SPEC, GLOBAL, chunks, cfg, seed=5, commit=commit)
    assert events.of("workers")[0]["engine"] == engine
    assert len(events.of("workers_lost")) <= 1 and len(events.of("workers")) == 1 + len(events.of("workers_lost"))
    assert got.steps == ref.steps and got.sample_count == ref.sample_count
    assert _max_rel(got.delta, ref.delta) <= 1e-5
    assert abs(got.loss - ref.loss) <= 1e-5 * abs(ref.loss)
    # the commitment: the same steps, each state one process's (gathered whole, not a shard)
    c, r = got.commitment, rec.commitment()
    assert c is not None and (c.every, c.steps, len(c.hashes)) == (r.every, r.steps, len(r.hashes))
    assert max(abs(a - b) / max(b, 1e-12) for a, b in zip(c.norms, r.norms, strict=True)) <= 1e-5
    for step, state in rec.states.items():
        stored = decode_state((root / "a1" / f"{step}.gft").read_bytes())
        assert set(stored) == set(state) and _max_rel(stored, state) <= 1e-5, step
    assert not list((tmp_path / "work").iterdir())  # the run folder is gone


@pytest.mark.e2e
def test_ddp_on_two_workers_gives_one_process_update(tmp_path):
    _check_equivalent(tmp_path, devices="cpu:2", engine="ddp", cfg=_cfg(), n=70)


@pytest.mark.e2e
def test_fsdp_on_three_workers_with_offload_gives_one_process_update(tmp_path):
    # 66 samples in batches of 16: the last batch has 2, fewer than the workers
    _check_equivalent(tmp_path, devices="cpu:3", engine="fsdp", n=66,
                      cfg=_cfg(optimizer="adamw", lr=0.01, weight_decay=0.01))


# -- a worker killed mid-assignment ------------------------------------------------------------------


@pytest.mark.e2e
def test_kill_9_of_a_worker_trains_again_with_fresh_workers(tmp_path):  # DDP, the optimizer on the host
    chunks, cfg = _chunks(64), _cfg(local_epochs=1, local_steps=400, grad_clip=0.0)
    ref = train_assignment(SPEC, GLOBAL, chunks, cfg, seed=5, device=CPU)
    events = EventLog()
    killed = threading.Event()

    def progress(_fraction: float) -> None:
        if not killed.is_set():
            killed.set()
            os.kill(events.of("workers")[-1]["pids"][1], signal.SIGKILL)

    group = WorkerGroup(parse_devices("cpu:2", offload="optimizer"), tmp_path / "work", engine="ddp", threads=2,
                        restarts=1, on_event=events.event)
    got = group.train(SPEC, GLOBAL, chunks, cfg, seed=5, progress=progress)
    lost = events.of("workers_lost")
    assert killed.is_set() and len(lost) == 1 and lost[0]["action"] == "retry", events.events
    assert "killed by signal 9" in lost[0]["detail"]
    assert len(events.of("workers")) == 2 and _max_rel(got.delta, ref.delta) <= 1e-5


@pytest.mark.e2e
async def test_kill_9_of_a_worker_hands_the_assignment_back(tmp_path):
    torch.set_num_threads(1)
    hub = await Hub(tmp_path / "hub", min_deadline_s=600).start()  # workers start slowly on a busy machine
    events = EventLog()
    node = agent(tmp_path / "node", hub.url, events, devices="cpu:2", worker_restarts=0, threads=2)
    task = asyncio.create_task(node.run())
    try:
        await hub.submit(spec_toml(rounds=1, epochs=400, chunk_size=256), dataset(n=256))
        await wait_for(lambda: node.current is not None and node.current.progress > 0, timeout=120, step=0.05)
        os.kill(events.of("workers")[-1]["pids"][1], signal.SIGKILL)
        abandoned = await wait_for(lambda: events.of("abandoned"), timeout=60)
        assert abandoned[0]["reason"].startswith("worker process lost: worker 1") and abandoned[0]["hub_told"]
        assert "uploaded" not in events.names()
        first = events.of("assignment")[0]["assignment_id"]
        rows = hub.db_rows("SELECT state FROM assignments WHERE id = ?", (first,))
        assert [r["state"] for r in rows] == ["abandoned"]
        # the shard is free again at once: the node (the only one) takes it anew, a clean retry
        again = await wait_for(lambda: events.of("assignment")[1:], timeout=60)
        assert again[0]["assignment_id"] != first and again[0]["round"] == 0
    finally:
        node.request_exit("test")
        await asyncio.wait_for(task, 30)
        await hub.stop()


@pytest.mark.e2e
def test_a_pause_stops_the_workers_and_a_state_that_does_not_fit_is_refused(tmp_path):
    chunks, cfg = _chunks(64), _cfg(local_epochs=1, local_steps=2000)
    events = EventLog()
    group = WorkerGroup(parse_devices("cpu:2"), tmp_path / "work", engine="ddp", threads=2, restarts=1,
                        on_event=events.event)
    seen = threading.Event()
    with pytest.raises(TrainingStopped):
        group.train(SPEC, GLOBAL, chunks, cfg, seed=5, progress=lambda _f: seen.set(), should_stop=seen.is_set)
    for pid in events.of("workers")[0]["pids"]:  # stopped and reaped, not retried
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert len(events.of("workers")) == 1 and not list((tmp_path / "work").iterdir())
    other = build_model(ModelSpec.from_dict({"kind": "mlp", "input": 8, "hidden": [5], "outputs": 3}), seed=0)
    with pytest.raises(TrainError, match="global model does not fit the spec"):
        group.train(SPEC, other.state_dict(), chunks, _cfg(), seed=5)
    assert len(events.of("workers")) == 2 and not events.of("workers_lost")  # refused, not retried
