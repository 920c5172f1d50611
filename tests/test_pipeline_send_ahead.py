"""node/pipeline/transport.SendAhead: sends on a thread of their own change nothing in what a
pipeline computes (bit for bit), and a send that fails stops the stage in one line."""

from __future__ import annotations

import copy

import pytest
import torch
from gpuflex.node.errors import PipelineError
from gpuflex.node.pipeline.local import run_stages
from gpuflex.node.pipeline.transport import MemoryNetwork, MessageKey, SendAhead

from tests.test_pipeline_engine import ADAM, CUTS, mlp_units, runners_for, step_data

torch.set_num_threads(1)


class AheadNetwork:
    """A MemoryNetwork whose transports send ahead."""

    def __init__(self) -> None:
        self.network = MemoryNetwork()
        self.made: list[SendAhead] = []

    def transport(self) -> SendAhead:
        t = SendAhead(self.network.transport(), self.network.transport())
        self.made.append(t)
        return t


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_sending_ahead_trains_bit_for_bit_the_same(schedule: str) -> None:
    units = mlp_units()
    data = step_data(steps=4)
    plain = runners_for(copy.deepcopy(units), CUTS[3], ADAM, schedule, MemoryNetwork())
    want = run_stages(plain, data)
    ahead_network = AheadNetwork()
    ahead = runners_for(copy.deepcopy(units), CUTS[3], ADAM, schedule, ahead_network)
    got = run_stages(ahead, data)
    for t in ahead_network.made:
        t.flush()
        t.close()
    assert got == want
    for a, b in zip(ahead, plain, strict=True):
        for p, q in zip(a.module.parameters(), b.module.parameters(), strict=True):
            assert torch.equal(p, q)


class Refusing:
    def send(self, key: MessageKey, tensor: torch.Tensor) -> None:
        raise PipelineError(f"the hub's relay refused {key.describe()}: 413 too_large")

    def receive(self, key, expected, *, timeout_s):  # pragma: no cover - not reached
        raise AssertionError


def test_a_send_that_fails_is_raised_at_the_next_call_and_the_rest_is_dropped() -> None:
    ahead = SendAhead(Refusing(), MemoryNetwork().transport())
    key = MessageKey(0, 0, "activation", 0, 1)
    ahead.send(key, torch.zeros(2))  # returns at once
    with pytest.raises(PipelineError, match="413 too_large") as info:
        ahead.flush()
    assert "\n" not in str(info.value)
    with pytest.raises(PipelineError, match="413 too_large"):
        ahead.send(MessageKey(0, 1, "activation", 0, 1), torch.zeros(2))
    ahead.close()
    ahead.close()  # idempotent
