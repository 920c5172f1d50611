"""How a node's stage reaches the other stages of its pipeline: through the hub's relay, or
straight to the stages that advertise a direct address (``gpuflex-node run --stage-listen``,
carried in ``StageAssignment.stage_addresses``), with the relay for the rest.

The relay's sends go out on threads of their own (``SendAhead``, ``relay_in_flight`` of them in
flight), so the next micro-batch starts at once, and its receives are asked for ahead of need
(``Prefetch``) from the stage's schedule. When any stage is direct, a ``RoutedTransport`` picks the way per receiving stage, so
both ends of every message agree, and the sends go out on a thread of their own as well; this node listens on its own address for its stage's tensors,
refusing any larger than the largest tensor its pipeline can send (a boundary's activation for
one micro-batch, or a tied parameter's gradient).

At the steps the hub may check (``checked_step``: the generation's first step and each checkpoint
step before its end, run with parameters the hub holds), activations and gradients go through
the relay even between stages with addresses: the hub re-executes a secret sample of those
steps' micro-batches from what passed its relay (hub/domain/pipelines/verify.py), and the node
cannot tell which."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from gpuflex.protocol.messages import StageAssignment
from gpuflex.protocol.modelspec import ModelSpec
from gpuflex.protocol.pipeline import lane_counts, lane_place, pipeline_units
from gpuflex.protocol.tensors import DTYPE_NAMES, TensorSpec, max_encoded_size
from torch import nn

from .pipeline.direct import DirectTransport, RoutedTransport, StageListener, parse_address
from .pipeline.prefetch import Prefetch
from .pipeline.relay import RelayTransport
from .pipeline.stage import boundary_specs, replica_length
from .pipeline.transport import SendAhead, Transport

#: relay sends in flight at once, each on its own connection (a relay send waits for the hub's
#: answer), and relay receives asked for ahead of need (node/pipeline/prefetch.py): at least
#: these, and one of each per micro-batch of a step up to ``IN_FLIGHT_MAX`` (a GPipe stage sends
#: a step's activations in one burst; on a line with a long round trip, a burst larger than the
#: sends in flight waits a round trip for each answer)
SEND_POOL = 4
RECEIVE_AHEAD = 8
#: each one in flight is a thread and a connection on the node and a connection the hub holds
#: open: 96 each way covers a GPipe burst of 64 micro-batches with room to spare, and keeps a
#: 4-stage pipeline under 800 of the hub's sockets (many systems allow a process 1,024 files)
IN_FLIGHT_MAX = 96


def relay_in_flight(a: StageAssignment) -> tuple[int, int]:
    """(sends, receives) of stage ``a`` kept in flight through the relay at once."""
    per_step = max(lane_counts(a.micro_batches, a.lanes, a.lane_micro_batches))
    return (
        min(max(SEND_POOL, per_step), IN_FLIGHT_MAX),
        min(max(RECEIVE_AHEAD, per_step), IN_FLIGHT_MAX),
    )


def largest_message_bytes(a: StageAssignment) -> int:
    """The encoded size of the largest tensor a stage of ``a``'s pipeline sends another: a cut's
    activation (or its gradient) for one micro-batch, a tied parameter's gradient, or (pipelines
    sharing the steps) one unit's flattened parameter gradients."""
    spec = ModelSpec.from_dict(a.model_spec)
    units = pipeline_units(spec)
    bounds = [*lane_place(a.stage_starts, a.lanes, a.stage).starts, len(units)]
    stages = [
        copy.deepcopy(nn.Sequential(*(u.module for u in units.units[lo:hi]))).eval()
        for lo, hi in itertools.pairwise(bounds)
    ]
    micro = a.batch_size // sum(lane_counts(a.micro_batches, a.lanes, a.lane_micro_batches))
    example = torch.zeros((micro, *spec.input_shape), dtype=spec.input_dtype)
    specs = list(boundary_specs(stages, example))
    for group in units.tied:
        index, name = group.members[0]
        tensor = units.units[index].module.state_dict()[name]
        specs.append(TensorSpec("tied", DTYPE_NAMES[tensor.dtype], tuple(tensor.shape)))
    if a.lanes > 1:
        specs += [
            TensorSpec("replica", "float32", (replica_length(u.module),)) for u in units.units
        ]
    return max((max_encoded_size((s,)) for s in specs), default=0)


def checked_step(a: StageAssignment, step: int) -> bool:
    """Is ``step`` one the hub may check (its parameters durable on the hub): ``a``'s first step,
    or a checkpoint step before its end? The same rule as the hub's ``verifiable_steps``."""
    return step == a.first_step or (
        a.first_step < step < a.end_step and step % a.checkpoint_every == 0
    )


@dataclass
class StageLinks:
    """The transport of one stage of ``a`` and what it holds open; ``close`` lets all of it go."""

    transport: Transport
    _closers: list[Callable[[], Any]] = field(default_factory=list)

    def close(self) -> None:
        for close in self._closers:
            close()


def stage_links(
    a: StageAssignment,
    relay: Callable[[], RelayTransport],
    *,
    key: Any,
) -> StageLinks:
    """The links of stage ``a.stage``: ``relay`` makes a relay transport (with ``a``'s generation);
    ``key`` signs the direct messages."""
    addresses = {s: addr for s, addr in enumerate(a.stage_addresses) if addr}
    if not addresses:
        sends, receives = relay_in_flight(a)
        senders = [relay() for _ in range(sends)]
        receiver = Prefetch(relay, depth=receives)
        ahead = SendAhead(senders, receiver)
        return StageLinks(ahead, [ahead.close, *(s.close for s in senders), receiver.close])
    own = addresses.get(a.stage)
    listener = StageListener(*parse_address(own)) if own else None
    direct = DirectTransport(
        key,
        a.job_id,
        a.stage,
        addresses=addresses,
        peers=dict(enumerate(a.stage_keys)),
        listener=listener,
        max_message_bytes=largest_message_bytes(a),
        generation=a.generation,
    )
    # sends go out on a thread of their own (one: each link's frames stay in order), so the
    # stage computes, and receives, while a tensor is on its way; each side its own relay
    send_relay, receive_relay = relay(), relay()
    sender = RoutedTransport(direct, send_relay, relayed=lambda step: checked_step(a, step))
    receiver = RoutedTransport(direct, receive_relay, relayed=lambda step: checked_step(a, step))
    ahead = SendAhead([sender], receiver)
    closers: list[Callable[[], Any]] = [ahead.close, direct.close, send_relay.close]
    closers.append(receive_relay.close)
    if listener is not None:
        closers.append(listener.close)
    return StageLinks(ahead, closers)


__all__ = ["StageLinks", "checked_step", "largest_message_bytes", "relay_in_flight", "stage_links"]
