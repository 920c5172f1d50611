"""``Transport`` straight from stage to stage: a node that accepts connections (``gpuflex-node run
--stage-listen HOST:PORT``, its Hello.stage_address) takes the other stages' tensors on its own
``StageListener``; a sender connects to the receiving stage's advertised address.

Each message is one frame on a kept TCP connection: ``GFP1``, the sealed header's length (4
bytes, big-endian), the sender's sealed ``RelayHeader`` (the relay's, node/pipeline/sealed.py),
then the GFT1 body of the header's signed size. The listener reads the header, checks it (the
signature; the signer runs the sending stage in ``peers``, an unknown key is refused; the job,
the generation, a stage that runs here) and the body's size against the tensor it may be (the
tensor the stage is waiting for, else the largest it takes), all before it reads the body.
``receive`` then checks the bytes against the signed size and SHA-256 and the tensor's shape,
dtype and finiteness, as the relay's receiver does. A refused frame is answered with one line
(``refused: ...``) and the connection is closed; what a known sender sent is refused to the
stage waiting for it too.

``send`` waits for no answer: the sending stage's thread encodes, seals and writes the frame, and
the receiving listener reads every frame as it comes (into the stage's inbox), so a write waits
for the kernel's socket buffer, never for the receiving stage's compute. No thread hand-off on
the sending side: the tensor's bytes are in the kernel when ``send`` returns. A failure, or the
receiver's refusal line, is raised by that ``send`` or the next, and by ``close``. Blocking
sockets: a stage runs in its own thread anyway.
``RoutedTransport`` sends directly to the stages that have an address and through the relay to
the rest.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

import torch
from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.messages import RelayHeader, decode_message
from gpuflex.protocol.signing import SigningKey, open_envelope
from gpuflex.protocol.tensors import TensorSpec, max_encoded_size

from ..errors import MessageLate, PipelineError
from .sealed import encode_tensor, open_body, open_header, seal_header
from .transport import MessageKey, Transport

log = logging.getLogger(__name__)

FRAME: Final = struct.Struct(">4sI")
MAGIC: Final = b"GFP1"
#: a sealed RelayHeader takes about 300 bytes
MAX_SEALED_HEADER: Final = 4096
#: what one inbox holds at most, in all, before it refuses more
MAX_HELD_BYTES: Final = 1 << 30
#: the kernel's buffers on a stage connection (each side): a step's few messages fit in them, so
#: a sender writes them at once whatever the receiving process is doing (the kernel may cap it)
SOCKET_BUFFER: Final = 4 << 20
#: what a refused connection still reads (and drops) before it closes
DRAIN_BYTES: Final = 16 << 20


def parse_address(text: str, what: str = "a stage address") -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"``) as (host, port); PipelineError in one line otherwise."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PipelineError(f"{what} {text!r} is not HOST:PORT (a port from 1 to 65535)")
    return host, int(port)


def _recv_exact(conn: socket.socket, n: int, *, eof_ok: bool = False) -> bytearray | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            if eof_ok and got == 0:
                return None
            raise PipelineError(f"the connection closed {got} bytes into a {n}-byte read")
        got += k
    return buf


# -- the receiving side -----------------------------------------------------------------------------


@dataclass
class Inbox:
    """What stage ``stage`` of ``job_id`` (generation ``generation``) is sent directly: each
    message kept once under its key until ``receive`` takes it. ``max_message_bytes``: the
    encoded size of the largest tensor the stage takes."""

    job_id: str
    stage: int
    generation: int
    peers: Mapping[int, bytes]
    max_message_bytes: int
    max_held_bytes: int = MAX_HELD_BYTES
    held_bytes: int = 0
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _held: dict[MessageKey, tuple[RelayHeader, bytearray]] = field(default_factory=dict)
    _refused: dict[MessageKey, str] = field(default_factory=dict)
    _waiting: dict[MessageKey, TensorSpec] = field(default_factory=dict)
    _taken: set[MessageKey] = field(default_factory=set)

    def __len__(self) -> int:
        with self._cond:
            return len(self._held)

    def admit(self, key: MessageKey, hdr: RelayHeader) -> None:
        """Refuse (PipelineError) a message not to this stage, one received already, or one larger
        than the tensor it may be, before its body is read."""
        if key.to_stage != self.stage:
            raise PipelineError(f"{key.describe()} is not for stage {self.stage}")
        with self._cond:
            spec = self._waiting.get(key)
            limit = (
                max_encoded_size((TensorSpec(key.carries, spec.dtype, spec.shape),))
                if spec is not None
                else self.max_message_bytes
            )
            if hdr.size > limit:
                raise PipelineError(
                    f"{key.describe()} is {hdr.size} bytes; this stage takes at most {limit}"
                )
            if key in self._held or key in self._taken:
                raise PipelineError(f"{key.describe()} was received already; refused")
            if self.held_bytes + hdr.size > self.max_held_bytes:
                raise PipelineError(f"stage {self.stage}'s inbox is full; {key.describe()} refused")

    def put(self, key: MessageKey, hdr: RelayHeader, body: bytearray) -> None:
        with self._cond:
            self._held[key] = (hdr, body)
            self.held_bytes += len(body)
            self._cond.notify_all()

    def refuse(self, key: MessageKey, line: str) -> None:
        """``line`` is what the stage waiting for ``key`` is told."""
        with self._cond:
            self._refused[key] = line
            self._cond.notify_all()

    def take(self, key: MessageKey, expected: TensorSpec, timeout_s: float) -> torch.Tensor:
        give_up = time.monotonic() + timeout_s
        with self._cond:
            self._waiting[key] = expected
            try:
                while key not in self._held and key not in self._refused:
                    left = give_up - time.monotonic()
                    if left <= 0:
                        raise MessageLate(f"{key.describe()} did not arrive within {timeout_s:g} s")
                    self._cond.wait(left)
            finally:
                del self._waiting[key]
            if key in self._refused:
                raise PipelineError(self._refused.pop(key))
            hdr, body = self._held.pop(key)
            self.held_bytes -= len(body)
            self._remember(key)
        return open_body(hdr, body, key, expected)

    def _remember(self, key: MessageKey) -> None:
        """Keys taken (a frame sent again is refused), kept for this step and the one before."""
        self._taken.add(key)
        if len(self._taken) > 64:
            self._taken = {k for k in self._taken if k.step >= key.step - 1}


class StageListener:
    """Accepts other stages' tensors on ``host:port`` (port 0: any free one) for the inboxes
    opened on it: one thread accepts, one thread per connection reads. A frame for a stage
    not (yet) opened here waits up to ``open_wait_s`` for it. A connection must deliver its first
    frame within ``first_frame_s`` (a stage's sender idles as long as it likes after that), and
    at most ``max_connections`` are open at once: a stranger cannot hold the threads."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        open_wait_s: float = 30.0,
        first_frame_s: float = 60.0,
        max_connections: int = 256,
    ) -> None:
        try:
            self._sock = socket.create_server((host, port), reuse_port=False)
        except OSError as exc:
            raise PipelineError(f"cannot listen for stages on {host}:{port}: {exc}") from None
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        self.host = host
        self.port = int(self._sock.getsockname()[1])
        self.open_wait_s = open_wait_s
        self.first_frame_s = first_frame_s
        self.max_connections = max_connections
        self._cond = threading.Condition()
        self._inboxes: dict[tuple[str, int, int], Inbox] = {}
        self._conns: set[socket.socket] = set()
        self._closed = False
        self.refusals: list[str] = []  # the latest refusals, one line each (newest last)
        self._thread = threading.Thread(
            target=self._accept, name="gpuflex-stage-listener", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def open(
        self,
        job_id: str,
        stage: int,
        *,
        peers: Mapping[int, bytes],
        max_message_bytes: int,
        generation: int = 0,
    ) -> Inbox:
        inbox = Inbox(job_id, stage, generation, dict(peers), max_message_bytes)
        with self._cond:
            self._inboxes[(job_id, stage, generation)] = inbox
            self._cond.notify_all()
        return inbox

    def discard(self, inbox: Inbox) -> None:
        with self._cond:
            key = (inbox.job_id, inbox.stage, inbox.generation)
            if self._inboxes.get(key) is inbox:
                del self._inboxes[key]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            conns = list(self._conns)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(5)

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            with self._cond:
                if self._closed:
                    conn.close()
                    return
                if len(self._conns) >= self.max_connections:
                    log.warning(
                        "stage listener: %d connections open; %s:%s refused",
                        len(self._conns),
                        peer[0],
                        peer[1],
                    )
                    conn.close()
                    continue
                self._conns.add(conn)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self.first_frame_s)
            threading.Thread(
                target=self._serve, args=(conn, f"{peer[0]}:{peer[1]}"), daemon=True
            ).start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        """Read frames off one connection until it closes or one is refused."""
        try:
            if self._read_frame(conn, peer):
                conn.settimeout(None)  # a known stage's connection: it may idle between steps
                while self._read_frame(conn, peer):
                    pass
        except OSError:
            pass
        finally:
            with self._cond:
                self._conns.discard(conn)
            conn.close()

    def _read_frame(self, conn: socket.socket, peer: str) -> bool:
        """One frame into its inbox (False: the connection ended or the frame was refused)."""
        inbox: Inbox | None = None
        key: MessageKey | None = None
        try:
            head = _recv_exact(conn, FRAME.size, eof_ok=True)
            if head is None:
                return False
            magic, length = FRAME.unpack(head)
            if magic != MAGIC or not 0 < length <= MAX_SEALED_HEADER:
                raise PipelineError(f"a connection from {peer} sent something other than a frame")
            sealed = bytes(_recv_exact(conn, length) or b"")
            inbox = self._inbox_for(sealed, peer)
            hdr, key = open_header(
                sealed,
                job_id=inbox.job_id,
                peers=inbox.peers,
                generation=inbox.generation,
                known_senders_only=True,
            )
            inbox.admit(key, hdr)
            body = _recv_exact(conn, hdr.size) or bytearray()
        except PipelineError as exc:
            self._refuse(conn, str(exc), inbox, key)
            return False
        inbox.put(key, hdr, body)
        return True

    def _inbox_for(self, sealed: bytes, peer: str) -> Inbox:
        """The inbox a frame is addressed to (read from its header before the signature is
        checked, to find the keys to check it with)."""
        try:
            hdr = decode_message(open_envelope(sealed)[0], RelayHeader)
        except ProtocolError as exc:
            raise PipelineError(
                f"a frame from {peer} came without a valid signed header: {exc}"
            ) from None
        where = (hdr.job_id, hdr.to_stage, hdr.generation)
        give_up = time.monotonic() + self.open_wait_s
        with self._cond:
            while where not in self._inboxes and not self._closed:
                left = give_up - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            inbox = self._inboxes.get(where)
        if inbox is None:
            raise PipelineError(
                f"a frame from {peer} is for stage {hdr.to_stage} of job {hdr.job_id!r} "
                f"(generation {hdr.generation}), which does not run here"
            )
        return inbox

    def _refuse(
        self, conn: socket.socket, line: str, inbox: Inbox | None, key: MessageKey | None
    ) -> None:
        line = " ".join(line.split())
        log.warning("stage listener: %s", line)
        with self._cond:
            self.refusals = [*self.refusals[-99:], line]
        if inbox is not None and key is not None:
            inbox.refuse(key, line)
        with contextlib.suppress(OSError):
            conn.sendall(f"refused: {line}\n".encode()[:4096])
            conn.shutdown(socket.SHUT_WR)
            # what the sender still writes is read and dropped for a moment, so that it reads the
            # line (closing on unread bytes would reset the connection before it does)
            conn.settimeout(1.0)
            give_up, dropped = time.monotonic() + 1.0, 0
            while dropped < DRAIN_BYTES and time.monotonic() < give_up:
                if not (n := len(conn.recv(1 << 16))):
                    break
                dropped += n


# -- the sending side -------------------------------------------------------------------------------


class _Link:
    """The kept connection to one receiving stage, written by the sending stage's own thread."""

    def __init__(
        self,
        address: str,
        to_stage: int,
        seal: Callable[[MessageKey, bytes], bytes],
        timeout_s: float,
    ) -> None:
        self.host, self.port = parse_address(address, f"stage {to_stage}'s address")
        self.to_stage = to_stage
        self.seal = seal
        self.timeout_s = timeout_s
        self.error: PipelineError | None = None
        self._conn: socket.socket | None = None

    def put(self, key: MessageKey, body: bytes) -> None:
        if self.error is not None:
            raise self.error
        self._write(key, body)

    def _write(self, key: MessageKey, body: bytes) -> None:
        try:
            sealed = self.seal(key, body)
            if self._conn is None:
                self._conn = self._connect()
            self._conn.sendall(FRAME.pack(MAGIC, len(sealed)) + sealed)
            self._conn.sendall(body)
        except OSError as exc:
            self.error = self._failure(key, exc)
            raise self.error from None
        except PipelineError as exc:
            self.error = exc
            raise

    def close(self) -> None:
        """The end of the stream: the receiver closes its side once it has read every frame, or
        answers a refusal (raised here, as any earlier failure is)."""
        conn, self._conn = self._conn, None
        if conn is None:
            if self.error is not None:
                raise self.error
            return
        try:
            if self.error is None:
                conn.shutdown(socket.SHUT_WR)
                answer = conn.recv(4096)
                if answer:
                    said = " ".join(answer.decode("utf-8", "replace").split())
                    self.error = PipelineError(f"stage {self.to_stage} {said}")
        except OSError as exc:
            self.error = PipelineError(f"stage {self.to_stage} closed the connection: {exc}")
        finally:
            conn.close()
        if self.error is not None:
            raise self.error

    def _connect(self) -> socket.socket:
        give_up = time.monotonic() + self.timeout_s
        delay = 0.02
        while True:
            try:
                conn = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
                return conn
            except OSError as exc:
                if time.monotonic() >= give_up:
                    raise PipelineError(
                        f"stage {self.to_stage} at {self.host}:{self.port} cannot be reached: {exc}"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _failure(self, key: MessageKey, exc: OSError) -> PipelineError:
        """What went wrong, in one line: the receiver's refusal when it sent one."""
        answer = b""
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.settimeout(1.0)
                answer = self._conn.recv(4096)
        said = " ".join(answer.decode("utf-8", "replace").split())
        return PipelineError(
            f"stage {self.to_stage} {said}"
            if said
            else f"sending {key.describe()} to stage {self.to_stage} failed: {exc}"
        )


class DirectTransport:
    """Stage ``stage`` of ``job_id``: sends to the stages in ``addresses`` ("host:port"; "" or
    absent: none) over kept connections, and receives what is sent to it on ``listener``
    (when given). ``peers``: stage -> the public key of the node running it; a message signed
    by any other key is refused. ``max_message_bytes``: the encoded size of the largest tensor
    this stage receives (``max_encoded_size``); a larger one is refused before it is read."""

    def __init__(
        self,
        key: SigningKey,
        job_id: str,
        stage: int,
        *,
        addresses: Mapping[int, str],
        peers: Mapping[int, bytes],
        listener: StageListener | None = None,
        max_message_bytes: int = 0,
        generation: int = 0,
        send_timeout_s: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.key = key
        self.job_id = job_id
        self.stage = stage
        self.addresses = {s: a for s, a in addresses.items() if a}
        self.generation = generation
        self.send_timeout_s = send_timeout_s
        self.clock = clock
        self.inbox = (
            listener.open(
                job_id,
                stage,
                peers=peers,
                max_message_bytes=max_message_bytes,
                generation=generation,
            )
            if listener is not None
            else None
        )
        self._listener = listener
        self._links: dict[int, _Link] = {}

    def _seal(self, key: MessageKey, body: bytes) -> bytes:
        return seal_header(
            self.key, self.job_id, key, body, generation=self.generation, clock=self.clock
        )

    def send(self, key: MessageKey, tensor: torch.Tensor, sketch: bytes = b"") -> None:
        """``sketch`` is dropped: only the hub reads one, and the steps it may check go through
        the relay (``RoutedTransport``'s ``relayed``)."""
        link = self._links.get(key.to_stage)
        if link is None:
            address = self.addresses.get(key.to_stage)
            if address is None:
                raise PipelineError(f"stage {key.to_stage} has no direct address")
            link = self._links[key.to_stage] = _Link(
                address, key.to_stage, self._seal, self.send_timeout_s
            )
        link.put(key, encode_tensor(key, tensor))

    def receive(self, key: MessageKey, expected: TensorSpec, *, timeout_s: float) -> torch.Tensor:
        if self.inbox is None:
            raise PipelineError(f"stage {self.stage} does not listen for {key.describe()}")
        return self.inbox.take(key, expected, timeout_s)

    def close(self) -> None:
        """Every tensor sent is written (PipelineError: the first that could not be), and this
        stage's inbox closes."""
        links, self._links = list(self._links.values()), {}
        if self._listener is not None and self.inbox is not None:
            self._listener.discard(self.inbox)
        errors = []
        for link in links:
            try:
                link.close()
            except PipelineError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


class RoutedTransport:
    """Direct to the stages ``direct`` has an address for, through ``relay`` to the rest: a
    message travels the way its receiving stage takes tensors, so both ends agree. ``relayed``:
    the steps whose activations and gradients go through the relay whatever the addresses (the
    steps the hub may check, node/stagelinks.checked_step: both ends know them from the plan)."""

    def __init__(
        self,
        direct: DirectTransport,
        relay: Transport,
        relayed: Callable[[int], bool] | None = None,
    ) -> None:
        self.direct = direct
        self.relay = relay
        self.relayed = relayed

    def _via(self, key: MessageKey) -> Transport:
        if (
            self.relayed is not None
            and key.carries in ("activation", "gradient")
            and self.relayed(key.step)
        ):
            return self.relay
        return self.direct if key.to_stage in self.direct.addresses else self.relay

    def send(self, key: MessageKey, tensor: torch.Tensor, sketch: bytes = b"") -> None:
        via = self._via(key)
        if sketch:
            via.send(key, tensor, sketch)
        else:
            via.send(key, tensor)

    def receive(self, key: MessageKey, expected: TensorSpec, *, timeout_s: float) -> torch.Tensor:
        return self._via(key).receive(key, expected, timeout_s=timeout_s)

    def close(self) -> None:
        try:
            self.direct.close()
        finally:
            close = getattr(self.relay, "close", None)
            if close is not None:
                close()


__all__ = [
    "DirectTransport",
    "Inbox",
    "RoutedTransport",
    "StageListener",
    "parse_address",
]
