"""CUDA only (skipped without a GPU): node/devices with NCCL between CUDA devices. Worker
processes on the node's GPUs give one process's update on the first GPU, DDP and FSDP2 alike;
one GPU alone checks the optimizer offloaded to the host and FSDP on a one-worker mesh.

Run on a GPU machine:
    .venv/bin/python -m pytest -q tests/test_node_devices_cuda.py
"""

from __future__ import annotations

import pytest
import torch
from gpuflex.node.devices import WorkerGroup, parse_devices
from gpuflex.node.trainer import train_assignment
from gpuflex.protocol.messages import TrainConfig
from gpuflex.protocol.modelspec import ModelSpec, build_model

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"),
]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

SPEC = ModelSpec.from_dict({"kind": "mlp", "input": 32, "hidden": [256, 128], "outputs": 10, "dropout": 0.1})
CFG = TrainConfig(local_epochs=2, batch_size=32, optimizer="adamw", lr=1e-3, momentum=0.0, weight_decay=0.01,
                  beta1=0.9, beta2=0.999, loss="cross_entropy", grad_clip=1.0)


def _chunks():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(300, 32, generator=g), torch.randint(0, 10, (300,), generator=g)
    return [{"x": x[i : i + 100], "y": y[i : i + 100]} for i in range(0, 300, 100)]


def _max_rel(a, b) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp_min(1e-12))
               for k in b if b[k].is_floating_point())


def _compare(tmp_path, devices: str, engine: str, *, offload: str | None = None, max_memory: int | None = None):
    state = build_model(SPEC, seed=1).state_dict()
    ref = train_assignment(SPEC, state, _chunks(), CFG, seed=3, device=torch.device("cuda", 0))
    events: list[dict] = []
    group = WorkerGroup(parse_devices(devices, offload=offload), tmp_path / "work", engine=engine,
                        max_memory_bytes=max_memory, restarts=0,
                        on_event=lambda name, **f: events.append({"event": name, **f}))
    got = group.train(SPEC, state, _chunks(), CFG, seed=3)
    assert got.steps == ref.steps
    rel = _max_rel(got.delta, ref.delta)
    print(f"\n{devices} {events[0]['engine']} offload={offload}: max relative difference {rel:.2e}")
    assert rel <= 1e-5
    return events[0]["engine"]


def test_one_gpu_with_the_optimizer_on_the_host(tmp_path):
    _compare(tmp_path, "0", "ddp", offload="optimizer")


def test_fsdp_on_a_one_gpu_mesh(tmp_path):
    _compare(tmp_path, "0", "fsdp", offload="optimizer")


@two_gpus
@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_two_gpus_give_one_gpu_update(tmp_path, engine):
    _compare(tmp_path, "0,1", engine)


@two_gpus
def test_a_model_larger_than_one_gpu_budget_is_sharded(tmp_path):
    floats = sum(t.numel() for t in build_model(SPEC, seed=1).state_dict().values()) * 4
    assert _compare(tmp_path, "0,1", "auto", max_memory=4 * floats + 1024)  # adamw: 4 copies; half of it per GPU == "fsdp"
