"""Stages that take tensors directly (node/pipeline/direct.py), on 127.0.0.1: a 3-stage pipeline
over direct connections, over the hub's relay, and over both at once (one stage with an address,
the others without) ends with the parameters the in-memory transport gives, bit for bit, after
10 steps; a forged header, an unknown key, an oversize body, a wrong shape and NaN are each
refused in one line and deliver nothing."""

from __future__ import annotations

import socket

import pytest
import torch
from gpuflex.node.errors import PipelineError
from gpuflex.node.pipeline.direct import (
    FRAME,
    MAGIC,
    DirectTransport,
    RoutedTransport,
    StageListener,
    parse_address,
)
from gpuflex.node.pipeline.local import run_stages
from gpuflex.node.pipeline.relay import RelayTransport
from gpuflex.node.pipeline.sealed import encode_tensor, seal_header
from gpuflex.node.pipeline.transport import MemoryNetwork, MessageKey
from gpuflex.protocol.signing import SigningKey
from gpuflex.protocol.tensors import TensorSpec, max_encoded_size

from tests.test_pipeline_engine import ADAM, BATCH, mlp_units, runners_for, step_data
from tests.test_pipeline_relay import HubThread, plan_for, register

torch.set_num_threads(1)

CUT = [0, 2, 5]  # 3 stages: activations (8, 32) and (8, 16)
JOB = "job-direct"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = HubThread(tmp_path_factory)
    yield h
    h.stop()


def _memory_result(schedule: str) -> list[torch.Tensor]:
    runners = runners_for(mlp_units(), CUT, ADAM, schedule, MemoryNetwork())
    run_stages(runners, step_data())
    return [p.detach().clone() for r in runners for p in r.module.parameters()]


def _largest(spec_shapes: list[tuple[int, ...]]) -> int:
    return max(max_encoded_size((TensorSpec("activation", "float32", s),)) for s in spec_shapes)


@pytest.mark.parametrize(
    ("route", "schedule"),
    [
        ("direct", "1f1b"),
        ("direct", "gpipe"),
        ("relay", "1f1b"),
        ("mixed", "1f1b"),
        ("checked", "1f1b"),
    ],
)
def test_direct_relay_and_mixed_pipelines_equal_the_in_memory_one_bit_for_bit(
    hub: HubThread, route: str, schedule: str
) -> None:
    keys = [register(hub) for _ in range(3)]
    job = f"{JOB}-{route}-{schedule}"
    hub.call(lambda: hub.relay.registry.assign(job, plan_for(keys, CUT, 4)))
    peers = {s: k.public_bytes for s, k in enumerate(keys)}
    listeners = [StageListener("127.0.0.1", 0) for _ in range(3)]
    direct_stages = {"direct": {0, 1, 2}, "relay": set(), "mixed": {1}, "checked": {0, 1, 2}}[route]
    relayed: list[MessageKey] = []
    addresses = {s: listeners[s].address for s in direct_stages}
    runners = runners_for(mlp_units(), CUT, ADAM, schedule, MemoryNetwork())
    transports = []
    for s, runner in enumerate(runners):
        direct = DirectTransport(
            keys[s],
            job,
            s,
            addresses=addresses,
            peers=peers,
            listener=listeners[s] if s in direct_stages else None,
            max_message_bytes=_largest([(BATCH, 32), (BATCH, 16)]),
        )
        relay = RelayTransport(
            hub.url, keys[s], job, hub_public_key=hub.hub_key.public_bytes, peers=peers, wait_s=1.0
        )
        if route == "checked":  # steps 0 and 4 through the relay, as a node does at checked steps
            runner.transport = RoutedTransport(
                direct, Counted(relay, relayed), relayed=checked_steps
            )
        else:
            runner.transport = RoutedTransport(direct, relay)
        transports.append(runner.transport)
    try:
        run_stages(runners, step_data())
    finally:
        for t in transports:
            t.close()
        for listener in listeners:
            listener.close()
    got = [p.detach() for r in runners for p in r.module.parameters()]
    want = _memory_result(schedule)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert all(len(t.direct.inbox or ()) == 0 for t in transports)  # every message was taken
    assert len(hub.relay) == 0
    if route == "checked":  # every activation and gradient of steps 0 and 4, none of the others
        assert {k.step for k in relayed} == {0, 4}
        assert len(relayed) == 2 * 4 * 2 * 2  # steps x micro-batches x (2 activations, 2 gradients)


def checked_steps(step: int) -> bool:
    return step in (0, 4)


class Counted:
    """A transport that notes the keys it sends."""

    def __init__(self, inner: RelayTransport, sent: list[MessageKey]) -> None:
        self.inner, self.sent = inner, sent

    def send(self, key: MessageKey, tensor: torch.Tensor) -> None:
        self.sent.append(key)
        self.inner.send(key, tensor)

    def receive(self, key: MessageKey, expected: TensorSpec, *, timeout_s: float) -> torch.Tensor:
        return self.inner.receive(key, expected, timeout_s=timeout_s)

    def close(self) -> None:
        self.inner.close()


# -- refusals --------------------------------------------------------------------------------------

ACT = TensorSpec("activation", "float32", (BATCH, 32))
KEY = MessageKey(1, 0, "activation", 0, 1)


@pytest.fixture
def receiver():
    """Stage 1 of job-direct listening on 127.0.0.1; stage 0 is run by ``sender``'s key."""
    sender, own = SigningKey.generate(), SigningKey.generate()
    listener = StageListener("127.0.0.1", 0, open_wait_s=0.5)
    transport = DirectTransport(
        own,
        JOB,
        1,
        addresses={},
        peers={0: sender.public_bytes, 1: own.public_bytes},
        listener=listener,
        max_message_bytes=max_encoded_size((ACT,)),
    )
    yield sender, listener, transport
    transport.close()
    listener.close()


def _send_frame(listener: StageListener, sealed: bytes, body: bytes) -> str:
    """Write one frame; the listener's answer (a refusal line, or "" when it took the frame)."""
    with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as conn:
        conn.sendall(FRAME.pack(MAGIC, len(sealed)) + sealed + body)
        conn.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := conn.recv(4096):
            answer += chunk
    return answer.decode()


def _one_line(answer: str) -> str:
    assert answer.startswith("refused: ") and answer.endswith("\n")
    assert answer.count("\n") == 1
    return answer


def _body(fill: float = 0.5, shape: tuple[int, ...] = (BATCH, 32)) -> bytes:
    return encode_tensor(KEY, torch.full(shape, fill))


def test_a_well_formed_frame_is_delivered(receiver) -> None:
    sender, listener, transport = receiver
    body = _body()
    assert _send_frame(listener, seal_header(sender, JOB, KEY, body), body) == ""
    assert torch.equal(transport.receive(KEY, ACT, timeout_s=5), torch.full((BATCH, 32), 0.5))
    # the same frame again: refused, nothing delivered
    answer = _one_line(_send_frame(listener, seal_header(sender, JOB, KEY, body), body))
    assert "was received already" in answer


def test_a_forged_header_is_refused(receiver) -> None:
    sender, listener, transport = receiver
    body = _body()
    sealed = bytearray(seal_header(sender, JOB, KEY, body))
    sealed[-1] ^= 1  # the signature's last byte
    assert "signature does not verify" in _one_line(_send_frame(listener, bytes(sealed), body))
    assert len(transport.inbox or ()) == 0 and "signature" in listener.refusals[-1]


def test_a_key_that_runs_no_stage_is_refused(receiver) -> None:
    _, listener, transport = receiver
    body = _body()
    stranger = SigningKey.generate()
    answer = _one_line(_send_frame(listener, seal_header(stranger, JOB, KEY, body), body))
    assert "not by stage 0's node" in answer
    unknown_stage = MessageKey(1, 0, "gradient", 2, 1)
    answer = _one_line(_send_frame(listener, seal_header(stranger, JOB, unknown_stage, body), body))
    assert "runs no stage of this pipeline" in answer
    assert len(transport.inbox or ()) == 0


def test_an_oversize_body_is_refused_before_it_is_read(receiver) -> None:
    sender, listener, transport = receiver
    big = _body(shape=(BATCH, 4096))
    # only the header travels: the listener refuses on the signed size alone
    with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as conn:
        sealed = seal_header(sender, JOB, KEY, big)
        conn.sendall(FRAME.pack(MAGIC, len(sealed)) + sealed)
        answer = conn.recv(4096).decode()
    assert "this stage takes at most" in _one_line(answer)
    with pytest.raises(PipelineError, match="this stage takes at most") as info:
        transport.receive(KEY, ACT, timeout_s=5)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (_body(shape=(BATCH, 31)), r"has shape \[8, 31\], expected \[8, 32\]"),
        (_body(fill=float("nan")), "holds NaN or infinite values; refused"),
    ],
    ids=["shape", "nan"],
)
def test_a_wrong_tensor_from_the_right_stage_is_refused(receiver, body: bytes, words: str) -> None:
    sender, listener, transport = receiver
    assert _send_frame(listener, seal_header(sender, JOB, KEY, body), body) == ""
    with pytest.raises(PipelineError, match=words) as info:
        transport.receive(KEY, ACT, timeout_s=5)
    assert "\n" not in str(info.value)


def test_a_sender_hears_the_refusal_in_one_line(receiver) -> None:
    _, listener, _ = receiver
    stranger = SigningKey.generate()
    out = DirectTransport(
        stranger, JOB, 0, addresses={1: listener.address}, peers={}, send_timeout_s=5
    )
    out.send(KEY, torch.zeros(BATCH, 32))
    with pytest.raises(PipelineError, match=r"^stage 1 refused: .*not by stage 0's node") as info:
        out.close()
    assert "\n" not in str(info.value)


def test_a_connection_that_sends_no_frame_is_closed_and_their_number_is_bounded() -> None:
    listener = StageListener("127.0.0.1", 0, first_frame_s=0.3, max_connections=2)
    try:
        idle = socket.create_connection(("127.0.0.1", listener.port), timeout=5)
        second = socket.create_connection(("127.0.0.1", listener.port), timeout=5)
        third = socket.create_connection(("127.0.0.1", listener.port), timeout=5)
        assert third.recv(1) == b""  # over the bound: closed at once
        assert idle.recv(1) == b"" and second.recv(1) == b""  # no frame within 0.3 s: closed
        for conn in (idle, second, third):
            conn.close()
    finally:
        listener.close()


def test_addresses_are_host_and_port() -> None:
    assert parse_address("10.0.0.2:7000") == ("10.0.0.2", 7000)
    assert parse_address("[::1]:7000") == ("::1", 7000)
    for bad in ("10.0.0.2", ":7000", "host:0", "host:70000", "host:x"):
        with pytest.raises(PipelineError, match="is not HOST:PORT"):
            parse_address(bad)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("10.0.0.2", "expected HOST:PORT"),
        ("10.0.0.2:0", "expected HOST:PORT"),
        ("0.0.0.0:7000", "not a wildcard"),
        ("[::]:7000", "not a wildcard"),
    ],
)
def test_a_bad_stage_listen_stops_the_node_before_it_starts(capsys, text: str, words: str) -> None:
    from gpuflex.node.cli import main

    code = main(["run", "--hub", "http://127.0.0.1:9", "--stage-listen", text])
    err = capsys.readouterr().err.strip()
    assert code != 0 and err.count("\n") == 0
    assert err.startswith(f"gpuflex-node: error: --stage-listen {text[:60]!r}") and words in err
