"""A stage's relay receives asked for ahead (node/pipeline/prefetch.py) and its relay sends kept in
flight on several connections (SendAhead's pool), through a real hub on 127.0.0.1: a pipeline
over them still equals gradient accumulation; a fetched tensor is taken from the hub before the
stage asks for it, yet a forged or wrong-shape one is still refused; a refused send reaches the
stage in one line; closing leaves no thread behind."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from gpuflex.node.errors import PipelineError
from gpuflex.node.pipeline.local import run_stages
from gpuflex.node.pipeline.prefetch import Prefetch
from gpuflex.node.pipeline.relay import RelayTransport
from gpuflex.node.pipeline.stage import TiedGroup
from gpuflex.node.pipeline.transport import MemoryNetwork, MessageKey, SendAhead
from gpuflex.protocol.signing import SigningKey
from gpuflex.protocol.tensors import TensorSpec
from torch import nn

from tests.test_pipeline_engine import (
    ADAM,
    BATCH,
    CUTS,
    Tied,
    accumulate,
    max_rel_diff,
    mlp_units,
    runners_for,
    step_data,
)
from tests.test_pipeline_relay import HubThread, plan_for, register

torch.set_num_threads(1)

ACTIVATION = TensorSpec("activation", "float32", (BATCH, 32))


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = HubThread(tmp_path_factory)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def pair(hub: HubThread):
    """Job "job-ahead", 2 stages (steps 0..9): its two nodes' keys."""
    keys = [register(hub), register(hub)]
    hub.call(lambda: hub.relay.registry.assign("job-ahead", plan_for(keys, [0, 3], 4, end_step=10)))
    return keys


def _relay(hub: HubThread, key: SigningKey, job: str, peers: dict[int, bytes]):
    return lambda: RelayTransport(
        hub.url, key, job, hub_public_key=hub.hub_key.public_bytes, peers=peers, wait_s=1.0
    )


def _threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("gpuflex-")}


def _wait(condition, timeout_s: float = 2.0) -> None:
    give_up = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < give_up, "timed out"
        time.sleep(0.005)


def _activation(step: int, micro_batch: int) -> MessageKey:
    return MessageKey(step, micro_batch, "activation", 0, 1)


class Recording:
    """A MemoryTransport that records what its stage expects and what it receives."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.expected: list[MessageKey] = []
        self.received: list[MessageKey] = []

    def send(self, key, tensor) -> None:
        self.inner.send(key, tensor)

    def receive(self, key, expected, *, timeout_s):
        self.received.append(key)
        return self.inner.receive(key, expected, timeout_s=timeout_s)

    def expect(self, keys) -> None:
        self.expected += keys


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_stage_expects_exactly_what_it_then_receives_in_that_order(schedule: str) -> None:
    torch.manual_seed(0)
    first = nn.Linear(12, 32)
    units = [first, nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), Tied(first), nn.Linear(12, 5)]
    groups = (TiedGroup(((0, "0.weight"), (2, "0.weight"))),)
    network = MemoryNetwork()
    runners = runners_for(units, [0, 2, 4], ADAM, schedule, network, tied=groups)
    recorders = []
    for runner in runners:
        runner.transport = recorder = Recording(network.transport())
        recorders.append(recorder)
    run_stages(runners, step_data(steps=2))
    for recorder in recorders:
        assert recorder.received and recorder.expected == recorder.received


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_pipeline_asking_ahead_equals_gradient_accumulation(hub, schedule: str) -> None:
    keys = [register(hub) for _ in range(3)]
    job = f"job-ahead-eq-{schedule}"
    hub.call(lambda: hub.relay.registry.assign(job, plan_for(keys, CUTS[3], 4)))
    peers = {s: k.public_bytes for s, k in enumerate(keys)}
    units = mlp_units()
    reference = nn.Sequential(*copy.deepcopy(units))
    data = step_data(steps=3)
    want = accumulate(reference, data, ADAM)
    runners = runners_for(units, CUTS[3], ADAM, schedule, MemoryNetwork())
    links = []
    for runner, key in zip(runners, keys, strict=True):
        relay = _relay(hub, key, job, peers)
        runner.transport = ahead = SendAhead([relay(), relay()], Prefetch(relay, depth=3))
        links.append(ahead)
    try:
        got = run_stages(runners, data)
        for ahead in links:
            ahead.flush()
    finally:
        for ahead in links:
            ahead.close()
            ahead.receiver.close()
            for sender in ahead.senders:
                sender.close()
    assert max_rel_diff([r.module for r in runners], reference) <= 1e-5
    assert got == pytest.approx(want, rel=1e-5)
    assert len(hub.relay) == 0  # every message was taken


def test_the_receiver_fetches_ahead_and_still_checks_what_it_fetched(hub, pair) -> None:
    peers = {s: k.public_bytes for s, k in enumerate(pair)}
    sender = _relay(hub, pair[0], "job-ahead", peers)()
    receiver = Prefetch(_relay(hub, pair[1], "job-ahead", peers), depth=2)
    try:
        receiver.expect([_activation(1, i) for i in range(3)])
        for i in range(3):
            sender.send(_activation(1, i), torch.full((BATCH, 32), float(i)))
        # the first two are taken from the hub before the stage asks for them; the third
        # waits for room in the inbox
        _wait(lambda: len(hub.relay) == 1)
        assert torch.equal(
            receiver.receive(_activation(1, 0), ACTIVATION, timeout_s=5), torch.zeros(BATCH, 32)
        )
        _wait(lambda: len(hub.relay) == 0)
        with pytest.raises(
            PipelineError, match=r"is larger than a float32 \[8, 16\] tensor"
        ) as info:
            receiver.receive(
                _activation(1, 1), TensorSpec("activation", "float32", (BATCH, 16)), timeout_s=5
            )
        assert "\n" not in str(info.value)
        assert torch.equal(
            receiver.receive(_activation(1, 2), ACTIVATION, timeout_s=5),
            torch.full((BATCH, 32), 2.0),
        )
    finally:
        receiver.close()
        sender.close()


def test_a_fetched_tensor_not_signed_by_its_stages_node_is_refused(hub, pair) -> None:
    sender = _relay(hub, pair[0], "job-ahead", {})()
    forged = {0: SigningKey.generate().public_bytes, 1: pair[1].public_bytes}
    receiver = Prefetch(_relay(hub, pair[1], "job-ahead", forged), depth=1)
    try:
        receiver.expect([_activation(2, 0)])
        sender.send(_activation(2, 0), torch.ones(BATCH, 32))
        _wait(lambda: len(hub.relay) == 0)
        with pytest.raises(PipelineError, match="stage 0") as info:
            receiver.receive(_activation(2, 0), ACTIVATION, timeout_s=5)
        assert "\n" not in str(info.value)
    finally:
        receiver.close()
        sender.close()


def test_a_refused_send_from_the_pool_reaches_the_stage_in_one_line(hub, pair) -> None:
    # stage 1's node sends as stage 0: the hub refuses every one of them
    relay = _relay(hub, pair[1], "job-ahead", {})
    ahead = SendAhead([relay(), relay(), relay()], MemoryNetwork().transport())
    try:
        # the first refusal surfaces at the next send or at the flush, whichever comes first
        with pytest.raises(PipelineError, match="403 not_your_stage") as info:
            for i in range(4):
                ahead.send(_activation(3, i), torch.zeros(BATCH, 32))
            ahead.flush()
        assert "\n" not in str(info.value)
        with pytest.raises(PipelineError, match="403 not_your_stage"):
            ahead.send(_activation(3, 4), torch.zeros(BATCH, 32))
    finally:
        ahead.close()
        for sender in ahead.senders:
            sender.close()
    assert len(hub.relay) == 0


def test_a_tensor_that_never_comes_times_out_and_closing_leaves_no_thread(hub, pair) -> None:
    before = _threads()
    receiver = Prefetch(_relay(hub, pair[1], "job-ahead", {}), depth=3)
    relay = _relay(hub, pair[0], "job-ahead", {})
    ahead = SendAhead([relay(), relay()], receiver)
    ahead.expect([_activation(4, i) for i in range(4)])
    _wait(lambda: len(receiver._asked) == 3)  # three GETs long-polling the hub
    t0 = time.monotonic()
    with pytest.raises(PipelineError, match=r"did not arrive within 0.2 s"):
        ahead.receive(_activation(4, 0), ACTIVATION, timeout_s=0.2)
    ahead.close()
    receiver.close()
    receiver.close()  # idempotent
    assert time.monotonic() - t0 < 1.5  # the long-polls were ended, not waited out
    assert _threads() == before
    with pytest.raises(PipelineError, match="closed"):
        receiver.receive(_activation(4, 1), ACTIVATION, timeout_s=1)
