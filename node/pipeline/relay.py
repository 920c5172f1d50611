"""``Transport`` through the hub's relay (POST/GET /v1/relay): stages behind NAT never connect
to each other, only to the hub.

A tensor travels as one GFT1 blob (protocol/tensors.py); its header, a RelayHeader naming the
job, step, micro-batch, what it carries, both stages and the blob's size and SHA-256, is sealed
with the node's key like every request it makes. The receiver gets the sender's sealed header
as it came and checks it (the signature; the sender's key when ``peers`` names it; the key
fields; size and hash) before it decodes the bytes, then checks shape, dtype and finiteness.

Blocking (``http.client``): a stage runs in its own thread, whose compute blocks anyway.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import http.client
import json
import random
import socket
import threading
import time
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

import torch
from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.messages import Ack, RelayHeader, RelayTake
from gpuflex.protocol.signing import SigningKey, new_nonce, open_sealed, seal
from gpuflex.protocol.tensors import TensorSpec, encode_state

from ..errors import MessageLate, PipelineError, StaleGeneration
from .sealed import open_body, open_header
from .transport import MessageKey

RELAY_HEADER = "X-GPUFlex-Relay"
_RETRY = (429, 502, 503, 504)


class RelayTransport:
    """The stages of ``job_id`` on this node, talking through the relay of the hub at ``base_url``.

    ``hub_public_key``: the pinned hub key its answers must be sealed with (None: not checked);
    ``peers``: stage -> the public key of the node running it, when known (the sender of each
    received tensor is then checked); ``wait_s``: one long-poll's wait; ``generation``: the
    pipeline plan's generation its messages belong to (StageAssignment.generation); a relay that
    answers 409 ``stale_generation`` raises StaleGeneration.
    """

    def __init__(
        self,
        base_url: str,
        key: SigningKey,
        job_id: str,
        *,
        hub_public_key: bytes | None = None,
        peers: Mapping[int, bytes] | None = None,
        wait_s: float = 20.0,
        send_timeout_s: float = 60.0,
        clock: Callable[[], float] = time.time,
        generation: int = 0,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise PipelineError(f"the hub's address {base_url!r} is not an http(s) URL")
        self._parts = parts
        self.key = key
        self.job_id = job_id
        self.hub_public_key = hub_public_key
        self.peers = dict(peers or {})
        self.wait_s = wait_s
        self.send_timeout_s = send_timeout_s
        self.clock = clock
        self.generation = generation
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()
        self._aborted = False

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def abort(self) -> None:
        """From another thread: end the request under way at once (its socket shut down) and
        refuse every later one; ``close`` still lets the connection go."""
        with self._lock:
            self._aborted = True
            sock = self._conn.sock if self._conn is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        """The kept connection, connected; PipelineError once ``abort`` was called."""
        with self._lock:
            if self._aborted:
                raise PipelineError("the relay transport is closed")
            if self._conn is None:
                cls = (
                    http.client.HTTPSConnection
                    if self._parts.scheme == "https"
                    else http.client.HTTPConnection
                )
                self._conn = cls(self._parts.hostname or "", self._parts.port, timeout=timeout_s)
            conn = self._conn
        conn.timeout = timeout_s
        if conn.sock is None:
            conn.connect()
        with self._lock:  # an abort during the connect has not seen this socket
            if self._aborted:
                raise PipelineError("the relay transport is closed")
        return conn

    def _request(
        self, method: str, headers: dict[str, str], body: bytes | None, timeout_s: float
    ) -> tuple[int, Mapping[str, str], bytes]:
        """One request on the kept connection (reopened once if the hub closed it)."""
        for attempt in (0, 1):
            try:
                conn = self._connection(timeout_s)
                conn.request(method, "/v1/relay", body=body, headers=headers)
                resp = conn.getresponse()
                return resp.status, {k: v for k, v in resp.getheaders()}, resp.read()
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                if attempt or self._aborted:
                    raise PipelineError(
                        f"the hub's relay cannot be reached: {type(exc).__name__}: {exc}"
                    ) from None
        raise AssertionError("unreachable")

    def send(self, key: MessageKey, tensor: torch.Tensor, sketch: bytes = b"") -> None:
        body = encode_state({key.carries: tensor.detach().to("cpu").contiguous()})
        header = RelayHeader(
            job_id=self.job_id,
            step=key.step,
            micro_batch=key.micro_batch,
            carries=key.carries,
            stage=key.stage,
            to_stage=key.to_stage,
            sha256=hashlib.sha256(body).hexdigest(),
            size=len(body),
            timestamp=self.clock(),
            nonce=new_nonce(),
            generation=self.generation,
            sketch=sketch,
        )
        give_up = time.monotonic() + self.send_timeout_s
        delay = 0.02
        while True:
            sealed = seal(self.key, header)
            status, _, answer = self._request(
                "POST",
                {RELAY_HEADER: _b64(sealed), "Content-Type": "application/octet-stream"},
                body,
                30.0,
            )
            if status == 200:
                self._check_ack(answer, key)
                return
            _check_generation(status, answer, key)
            if status not in _RETRY or time.monotonic() >= give_up:
                raise PipelineError(
                    f"the hub's relay refused {key.describe()}: {_refusal(status, answer)}"
                )
            time.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 1.0)
            header = dataclasses.replace(header, timestamp=self.clock(), nonce=new_nonce())

    def _check_ack(self, answer: bytes, key: MessageKey) -> None:
        if self.hub_public_key is None:
            return
        try:
            open_sealed(answer, Ack, signer=self.hub_public_key)
        except ProtocolError as exc:
            raise PipelineError(
                f"the relay's answer for {key.describe()} is not the pinned hub's: {exc}"
            ) from None

    def receive(self, key: MessageKey, expected: TensorSpec, *, timeout_s: float) -> torch.Tensor:
        sealed_b64, body = self.fetch(key, timeout_s=timeout_s)
        return self.open(key, expected, sealed_b64, body)

    def fetch(self, key: MessageKey, *, timeout_s: float) -> tuple[str, bytes]:
        """The message under ``key`` as the hub hands it over, not yet checked: the sender's
        sealed header (base64) and the tensor's bytes. ``open`` checks them."""
        give_up = time.monotonic() + timeout_s
        while True:
            left = give_up - time.monotonic()
            if left <= 0:
                raise MessageLate(f"{key.describe()} did not arrive within {timeout_s:g} s")
            take = RelayTake(
                job_id=self.job_id,
                step=key.step,
                micro_batch=key.micro_batch,
                carries=key.carries,
                stage=key.stage,
                to_stage=key.to_stage,
                wait_s=min(self.wait_s, max(left, 0.0)),
                timestamp=self.clock(),
                nonce=new_nonce(),
                generation=self.generation,
            )
            status, headers, body = self._request(
                "GET",
                {"X-GPUFlex-Auth": _b64(seal(self.key, take))},
                None,
                min(self.wait_s, left) + 30.0,
            )
            if status == 204:
                continue
            if status in _RETRY:  # the hub is busy or restarting: ask again shortly
                time.sleep(min(0.2, max(give_up - time.monotonic(), 0.0)))
                continue
            _check_generation(status, body, key)
            if status != 200:
                raise PipelineError(
                    f"the hub's relay refused to hand over {key.describe()}: "
                    f"{_refusal(status, body)}"
                )
            return headers.get(RELAY_HEADER, ""), body

    def open(
        self, key: MessageKey, expected: TensorSpec, sealed_b64: str, body: bytes
    ) -> torch.Tensor:
        """The sender's sealed header checked, then the bytes against it, then the tensor."""
        try:
            sealed = base64.urlsafe_b64decode(sealed_b64 + "=" * (-len(sealed_b64) % 4))
        except ValueError as exc:
            raise PipelineError(
                f"{key.describe()} came without a valid signed header: {exc}"
            ) from None
        hdr, _ = open_header(
            sealed, job_id=self.job_id, peers=self.peers, key=key, generation=self.generation
        )
        return open_body(hdr, body, key, expected)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii")


def _check_generation(status: int, body: bytes, key: MessageKey) -> None:
    """StaleGeneration when the relay says this plan's generation is over."""
    if status != 409:
        return
    try:
        code = json.loads(body.decode("utf-8", "replace")).get("error")
    except (ValueError, AttributeError):
        return
    if code == "stale_generation":
        raise StaleGeneration(f"the hub's relay refused {key.describe()}: {_refusal(status, body)}")


def _refusal(status: int, body: bytes) -> str:
    try:
        obj = json.loads(body.decode("utf-8", "replace"))
        return (
            f"{status} {obj.get('error', '')}: {' '.join(str(obj.get('detail', '')).split())[:300]}"
        )
    except (ValueError, AttributeError):
        return f"{status} {body[:120].decode('utf-8', 'replace')}"


__all__ = ["RELAY_HEADER", "RelayTransport"]
