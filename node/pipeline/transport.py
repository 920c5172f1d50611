"""How one stage's tensors reach another: the ``Transport`` interface and its in-memory form.

A message is keyed by the step, the micro-batch, what it carries ("activation" from stage s to
s+1, "gradient" from s to s-1, "tied": a tied parameter's gradient between two stages of one
group, its micro-batch the group's index) and the two stages. ``send`` never waits for the
receiver; ``receive`` waits for the message, then checks it against what the receiver expects
(shape, dtype, finite values) and refuses it in one line otherwise. The relay through the hub
(node/pipeline/relay.py) is the other implementation. ``SendAhead`` puts a transport's sends on
threads of their own, so the next micro-batch's compute starts while a tensor is on its way.

A send may carry the sending stage's ``sketch`` of the raw tensor (protocol/stagesketch.py), at the
steps the hub may check: the relay puts it in the message's signed header; a transport that never
passes the hub (in memory, direct) drops it (those steps go through the relay anyway).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from gpuflex.protocol.messages import RELAY_KINDS
from gpuflex.protocol.tensors import DTYPE_NAMES, TensorSpec

from ..errors import MessageLate, PipelineError


@dataclass(frozen=True)
class MessageKey:
    """Which tensor: ``carries`` (activation, gradient, tied) of ``micro_batch`` at ``step``, from
    stage ``stage`` to stage ``to_stage``."""

    step: int
    micro_batch: int
    carries: str
    stage: int
    to_stage: int

    def __post_init__(self) -> None:
        if self.carries not in RELAY_KINDS:
            raise PipelineError(
                f"a pipeline message carries one of {', '.join(RELAY_KINDS)}, not {self.carries!r}"
            )

    def describe(self) -> str:
        return (
            f"the {self.carries} of step {self.step} micro-batch {self.micro_batch} "
            f"from stage {self.stage} to stage {self.to_stage}"
        )


class Transport(Protocol):
    """Carries tensors between the stages of one job's pipeline."""

    def send(self, key: MessageKey, tensor: torch.Tensor, sketch: bytes = b"") -> None:
        """Hand ``tensor`` on (it may be reused by the caller afterwards), with ``sketch`` where
        the transport carries one; does not wait for the receiver."""

    def receive(self, key: MessageKey, expected: TensorSpec, *, timeout_s: float) -> torch.Tensor:
        """The tensor sent under ``key``, checked against ``expected``; a fresh tensor the caller owns.
        PipelineError when none comes within ``timeout_s`` or it is not what was expected."""


def spec_of(tensor: torch.Tensor, name: str) -> TensorSpec:
    """The (name, dtype, shape) a receiver expects of a tensor like ``tensor``."""
    dtype = DTYPE_NAMES.get(tensor.dtype)
    if dtype is None:
        raise PipelineError(f"a pipeline cannot carry {name} of dtype {tensor.dtype}")
    return TensorSpec(name, dtype, tuple(int(d) for d in tensor.shape))


def check_received(key: MessageKey, tensor: torch.Tensor, expected: TensorSpec) -> torch.Tensor:
    """``tensor`` when it has ``expected``'s dtype and shape and only finite values; PipelineError
    naming the message and what is wrong otherwise."""
    got = spec_of(tensor, key.carries)
    if got.dtype != expected.dtype:
        raise PipelineError(f"{key.describe()} has dtype {got.dtype}, expected {expected.dtype}")
    if got.shape != expected.shape:
        raise PipelineError(
            f"{key.describe()} has shape {list(got.shape)}, expected {list(expected.shape)}"
        )
    if tensor.is_floating_point() and tensor.numel() and not all_finite(tensor):
        raise PipelineError(f"{key.describe()} holds NaN or infinite values; refused")
    return tensor


#: CPU dtypes numpy checks in place (about 20 times faster than torch.isfinite, which makes a
#: boolean tensor first)
_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN and no infinity in the floating-point ``tensor``."""
    if tensor.device.type == "cpu" and tensor.dtype in _NUMPY_FLOATS:
        return bool(np.isfinite(tensor.detach().numpy()).all())
    return bool(torch.isfinite(tensor).all())


class SendAhead:
    """``Transport`` whose sends go out on threads of their own, one per ``sender`` (a relay's
    holds one connection and waits for each answer: several keep several sends in flight), while
    ``receiver`` serves receives on the caller's thread. ``send`` keeps a CPU copy of the tensor
    and returns; at most ``depth`` tensors wait. A send that fails is raised by the next
    ``send``, ``receive`` or ``flush``, and nothing more goes out; ``flush`` returns once every
    tensor sent is delivered (a step's end). ``expect`` passes a stage's coming receives on to
    a ``receiver`` that asks for them ahead. What travels does not change, and each receiver
    takes each tensor by its key, whatever order they arrive in: the training is the same bit
    for bit."""

    def __init__(
        self,
        sender: Transport | Sequence[Transport],
        receiver: Transport,
        *,
        depth: int = 64,
    ) -> None:
        self.senders = list(sender) if isinstance(sender, Sequence) else [sender]
        if not self.senders:
            raise PipelineError("sending ahead needs at least one sender")
        self.receiver = receiver
        self._queue: queue.Queue[tuple[MessageKey, torch.Tensor, bytes] | None] = queue.Queue(depth)
        self._error: BaseException | None = None
        self._dropping = False
        self._threads = [
            threading.Thread(target=self._drain, args=(s,), name=f"gpuflex-send-ahead-{i}")
            for i, s in enumerate(self.senders)
        ]
        for thread in self._threads:
            thread.daemon = True
            thread.start()

    def _drain(self, sender: Transport) -> None:
        while (item := self._queue.get()) is not None:
            try:
                if self._error is None and not self._dropping:  # after a failure, none goes
                    key, tensor, sketch = item
                    if sketch:
                        sender.send(key, tensor, sketch)
                    else:
                        sender.send(key, tensor)
            except BaseException as exc:  # raised on the caller's thread (``_raise``)
                if self._error is None:
                    self._error = exc
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def send(self, key: MessageKey, tensor: torch.Tensor, sketch: bytes = b"") -> None:
        self._raise()
        if self._dropping or not all(t.is_alive() for t in self._threads):
            raise PipelineError(f"{key.describe()} cannot be sent: the sender is closed")
        self._queue.put((key, tensor.detach().to("cpu", copy=True), sketch))

    def receive(self, key: MessageKey, expected: TensorSpec, *, timeout_s: float) -> torch.Tensor:
        self._raise()
        return self.receiver.receive(key, expected, timeout_s=timeout_s)

    def expect(self, keys: Sequence[MessageKey]) -> None:
        """The receives the stage will make next, for a receiver that asks for them ahead."""
        ahead = getattr(self.receiver, "expect", None)
        if ahead is not None:
            ahead(keys)

    def flush(self) -> None:
        """Wait until every tensor sent has gone; the first failure, if any."""
        self._queue.join()
        self._raise()

    def close(self) -> None:
        """Stop the sending threads, dropping what still waits (idempotent): the stage is over."""
        self._dropping = True
        # one end marker per thread still running, counted before any is put: a thread ends only
        # on a marker, and any thread may take any marker
        for _ in [t for t in self._threads if t.is_alive()]:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()


class MemoryNetwork:
    """The stages of one process (threads), connected by one queue per message."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[MessageKey, queue.Queue[torch.Tensor]] = {}

    def box(self, key: MessageKey) -> queue.Queue[torch.Tensor]:
        with self._lock:
            return self._queues.setdefault(key, queue.Queue(maxsize=1))

    def drop(self, key: MessageKey) -> None:
        with self._lock:
            self._queues.pop(key, None)

    def transport(self) -> MemoryTransport:
        return MemoryTransport(self)


class MemoryTransport:
    """``Transport`` over a ``MemoryNetwork``: for tests, and for stages that share a machine."""

    def __init__(self, network: MemoryNetwork) -> None:
        self.network = network

    def send(self, key: MessageKey, tensor: torch.Tensor, sketch: bytes = b"") -> None:
        try:
            self.network.box(key).put_nowait(tensor.detach().to("cpu", copy=True))
        except queue.Full:
            raise PipelineError(f"{key.describe()} was already sent") from None

    def receive(self, key: MessageKey, expected: TensorSpec, *, timeout_s: float) -> torch.Tensor:
        try:
            tensor = self.network.box(key).get(timeout=timeout_s)
        except queue.Empty:
            raise MessageLate(f"{key.describe()} did not arrive within {timeout_s:g} s") from None
        self.network.drop(key)
        return check_received(key, tensor, expected)


__all__ = [
    "MemoryNetwork",
    "MemoryTransport",
    "MessageKey",
    "SendAhead",
    "Transport",
    "all_finite",
    "check_received",
    "spec_of",
]
