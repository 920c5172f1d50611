"""Ed25519 identities, signed envelopes and replay protection.

A signature covers ``domain(kind) + payload`` where ``payload`` is the exact
message bytes that travel. ``open_sealed`` verifies those received bytes first
and only then decodes them, so nothing is ever re-serialised for verification,
and a signature made for one message kind never verifies as another.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import heapq
import math
import os
import re
import secrets
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final, TypeVar

import msgpack
import nacl.bindings
import nacl.exceptions
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from .errors import DecodeError, KeyFileError, ReplayError, SignatureError
from .messages import MESSAGE_KINDS, decode_message, encode_message, unpack_strict
from .sodium import NOGIL, SIGNATURE_BYTES

M = TypeVar("M")

PUBLIC_KEY_BYTES: Final = 32
NONCE_BYTES: Final = 16
MAX_PAYLOAD_BYTES: Final = 1 << 20
MAX_ENVELOPE_BYTES: Final = MAX_PAYLOAD_BYTES + 256
MAX_KEY_FILE_BYTES: Final = 4096
FINGERPRINT_PREFIX: Final = "gf1-"
#: what ``fingerprint`` writes: the prefix and five groups of four base32 characters (a-z, 2-7)
FINGERPRINT_RE: Final = re.compile(r"gf1(?:-[a-z2-7]{4}){5}")


def domain(kind: str) -> bytes:
    """Domain-separation prefix for a message kind: ``b"gpuflex/v1/<kind>\\0"``."""
    return b"gpuflex/v1/" + kind.encode() + b"\0"


def fingerprint(public_bytes: bytes) -> str:
    """``gf1-`` + 5 dash-separated groups of 4 lowercase base32 chars of sha256(pk)."""
    if not isinstance(public_bytes, bytes) or len(public_bytes) != PUBLIC_KEY_BYTES:
        raise SignatureError(f"a public key is {PUBLIC_KEY_BYTES} bytes")
    return _fingerprint(public_bytes)


@functools.lru_cache(maxsize=8192)
def _fingerprint(public_bytes: bytes) -> str:
    """Of recent signers (a hub hears from the same nodes all day, several times a request); bounded."""
    digest = hashlib.sha256(public_bytes).digest()
    text = base64.b32encode(digest).decode("ascii").lower()[:20]
    return FINGERPRINT_PREFIX + "-".join(text[i : i + 4] for i in range(0, 20, 4))


def is_fingerprint(text: object) -> bool:
    """Is ``text`` written as a key fingerprint (``gf1-abcd-efgh-ijkl-mnop-qrst``)? Only the form."""
    return isinstance(text, str) and FINGERPRINT_RE.fullmatch(text) is not None


def new_nonce() -> bytes:
    """16 fresh random bytes for a request nonce."""
    return secrets.token_bytes(NONCE_BYTES)


def verify(public_bytes: bytes, kind: str, payload: bytes, signature: bytes) -> None:
    """Raise SignatureError unless ``signature`` covers ``domain(kind) + payload``.

    libsodium's Ed25519 (PyNaCl): it verifies in about half the time of OpenSSL's through
    ``cryptography`` (docs/performance.md has the figures), and it refuses small-order public keys, with which OpenSSL's check lets one
    signature verify for every message. Signatures are the same: Ed25519 signing is deterministic.
    The call keeps the GIL where it can (protocol/sodium.py).
    """
    if not isinstance(public_bytes, bytes) or len(public_bytes) != PUBLIC_KEY_BYTES:
        raise SignatureError(f"signer public key must be {PUBLIC_KEY_BYTES} bytes")
    if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
        raise SignatureError(f"signature must be {SIGNATURE_BYTES} bytes")
    message = domain(kind) + bytes(payload)
    if NOGIL is not None:
        valid = NOGIL.verify(signature, message, public_bytes)
    else:
        try:
            nacl.bindings.crypto_sign_open(signature + message, public_bytes)
            valid = True
        except (nacl.exceptions.BadSignatureError, nacl.exceptions.CryptoError, ValueError):
            valid = False
    if not valid:
        raise SignatureError(
            f"signature does not verify for {'an' if kind[:1] in 'aeiou' else 'a'} {kind!r} message"
            f" from {fingerprint(public_bytes)}"
        )


class SigningKey:
    """An Ed25519 private key: a node's identity or the hub's."""

    __slots__ = ("_private", "_public", "_secret")

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private  # the key file's form (PKCS#8 PEM, through cryptography)
        self._public = private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        seed = private.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        _, self._secret = nacl.bindings.crypto_sign_seed_keypair(seed)  # libsodium signs (see verify)

    @classmethod
    def generate(cls) -> SigningKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> SigningKey:
        """Deterministic key from 32 raw private bytes (tests, fixtures)."""
        if not isinstance(seed, bytes) or len(seed) != 32:
            raise KeyFileError("an Ed25519 private key is 32 bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @property
    def public_bytes(self) -> bytes:
        return self._public

    @property
    def fingerprint(self) -> str:
        return fingerprint(self._public)

    def private_bytes(self) -> bytes:
        return self._private.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )

    def sign(self, kind: str, payload: bytes) -> bytes:
        """Sign ``domain(kind) + payload``; returns the 64-byte signature (holding the GIL where it
        can: protocol/sodium.py)."""
        message = domain(kind) + bytes(payload)
        if NOGIL is not None:
            return NOGIL.sign(message, self._secret)
        signed: bytes = nacl.bindings.crypto_sign(message, self._secret)
        return signed[:SIGNATURE_BYTES]

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the key as PKCS#8 PEM; the file is created 0600 and replaced atomically."""
        target = Path(path)
        pem = self._private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".key-", dir=target.parent)  # mkstemp creates 0600
        try:
            if hasattr(os, "fchmod"):
                os.fchmod(fd, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(pem)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        _fsync_dir(target.parent)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SigningKey:
        """Read a key written by ``save``; refuses a file others may read."""
        target = Path(path)
        try:
            info = os.stat(target)
        except FileNotFoundError:
            raise KeyFileError(f"key file {target} does not exist") from None
        except OSError as exc:
            raise KeyFileError(f"cannot read key file {target}: {exc.strerror}") from None
        if not stat.S_ISREG(info.st_mode):
            raise KeyFileError(f"key file {target} is not a regular file")
        if os.name == "posix" and info.st_mode & 0o077:
            raise KeyFileError(
                f"key file {target} is readable by other users "
                f"(mode {stat.S_IMODE(info.st_mode):04o}); run: chmod 600 {target}"
            )
        if info.st_size > MAX_KEY_FILE_BYTES:
            raise KeyFileError(f"key file {target} is too large to be a key")
        try:
            data = target.read_bytes()
        except OSError as exc:
            raise KeyFileError(f"cannot read key file {target}: {exc.strerror}") from None
        try:
            private = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError):
            raise KeyFileError(
                f"key file {target} is not an unencrypted PEM Ed25519 key; "
                "move it aside to create a new identity"
            ) from None
        if not isinstance(private, Ed25519PrivateKey):
            raise KeyFileError(f"key file {target} holds a non-Ed25519 key")
        return cls(private)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> SigningKey:
        """Load the key at ``path``, or generate and save one if it does not exist."""
        if Path(path).exists():
            return cls.load(path)
        key = cls.generate()
        key.save(path)
        return key

    def __repr__(self) -> str:
        return f"SigningKey({self.fingerprint})"


def _fsync_dir(directory: Path) -> None:
    if os.name != "posix":
        return
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------
# Envelopes.


def seal_bytes(key: SigningKey, kind: str, payload: bytes) -> bytes:
    """Wrap already-encoded ``payload`` of ``kind`` in a signed envelope."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise SignatureError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    envelope = {"payload": bytes(payload), "signer": key.public_bytes, "sig": key.sign(kind, payload)}
    packed: bytes = msgpack.packb(envelope, use_bin_type=True)
    return packed


def seal(key: SigningKey, msg: object) -> bytes:
    """``encode_message(msg)``, sign it under its kind's domain, return envelope bytes."""
    payload = encode_message(msg)
    kind: str = type(msg).KIND  # type: ignore[attr-defined]  # encode_message checked it
    return seal_bytes(key, kind, payload)


def open_envelope(data: bytes | bytearray | memoryview) -> tuple[bytes, bytes, bytes]:
    """Parse an envelope without verifying: returns (payload, signer, sig)."""
    obj = unpack_strict(
        data, "envelope", max_bytes=MAX_ENVELOPE_BYTES, max_bin_len=MAX_PAYLOAD_BYTES
    )
    if not isinstance(obj, dict):
        raise DecodeError(f"envelope: expected a msgpack map, got {type(obj).__name__}")
    if set(obj) != {"payload", "signer", "sig"}:
        names = ", ".join(sorted(repr(k)[:40] for k in obj))
        raise DecodeError(f"envelope: expected keys payload, signer, sig; got {names}")
    payload, signer, sig = obj["payload"], obj["signer"], obj["sig"]
    if not isinstance(payload, bytes):
        raise DecodeError("envelope.payload: expected bytes")
    if not isinstance(signer, bytes) or len(signer) != PUBLIC_KEY_BYTES:
        raise DecodeError(f"envelope.signer: expected {PUBLIC_KEY_BYTES} bytes")
    if not isinstance(sig, bytes) or len(sig) != SIGNATURE_BYTES:
        raise DecodeError(f"envelope.sig: expected {SIGNATURE_BYTES} bytes")
    return payload, signer, sig


def open_sealed(
    data: bytes | bytearray | memoryview, expected: type[M], *, signer: bytes | None = None
) -> tuple[M, bytes]:
    """Verify then decode a sealed message; returns (message, signer public key).

    The signature is checked over the exact payload bytes received, with the
    domain of ``expected.KIND``; if ``signer`` is given the envelope must be
    signed by that key. Only then is the payload decoded.
    """
    kind = getattr(expected, "KIND", None)
    if not isinstance(kind, str) or MESSAGE_KINDS.get(kind) is not expected:
        raise DecodeError(f"{getattr(expected, '__name__', expected)!r} is not a message type")
    payload, actual_signer, sig = open_envelope(data)
    if signer is not None and actual_signer != signer:
        raise SignatureError(
            f"message signed by {fingerprint(actual_signer)}, expected "
            f"{fingerprint(signer) if len(signer) == PUBLIC_KEY_BYTES else 'another key'}"
        )
    verify(actual_signer, kind, payload, sig)
    return decode_message(payload, expected), actual_signer


# ---------------------------------------------------------------------------
# Replay protection.


class ReplayGuard:
    """Refuses stale, future-dated and repeated (signer, nonce) pairs.

    Pure: the clock is injected. A nonce is remembered until its timestamp has
    left the window, after which the timestamp check alone refuses it. Memory is
    bounded by ``max_entries``; when full of still-live nonces the guard refuses
    new requests (fails closed) rather than forgetting one.

    ``not_before``: the moment this guard's memory began (a hub passes its start
    time). Nonces seen before it are not known, so a request signed earlier is
    refused as a possible replay across a restart; a client simply signs again.
    """

    def __init__(
        self,
        window_s: float = 300.0,
        max_entries: int = 200_000,
        clock: Callable[[], float] = time.time,
        not_before: float | None = None,
    ) -> None:
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError("window_s must be a positive finite number")
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.window_s = float(window_s)
        self.max_entries = int(max_entries)
        self._clock = clock
        self.not_before = not_before
        self._seen: dict[tuple[bytes, bytes], float] = {}
        self._expiry: list[tuple[float, bytes, bytes]] = []

    def __len__(self) -> int:
        return len(self._seen)

    def _prune(self, now: float) -> None:
        heap = self._expiry
        while heap and heap[0][0] < now:
            _, signer, nonce = heapq.heappop(heap)
            self._seen.pop((signer, nonce), None)

    def check(self, signer: bytes, timestamp: float, nonce: bytes) -> None:
        """Accept (and remember) a fresh request, or raise ReplayError."""
        now = self._clock()
        if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)):
            raise ReplayError("request timestamp is not a number")
        if not math.isfinite(timestamp):
            raise ReplayError("request timestamp is not finite")
        if not isinstance(nonce, bytes) or not 8 <= len(nonce) <= 64:
            raise ReplayError("request nonce must be 8..64 bytes")
        if timestamp < now - self.window_s:
            raise ReplayError(
                f"request timestamp is {now - timestamp:.0f}s old (window {self.window_s:.0f}s); "
                "check the node's clock"
            )
        if self.not_before is not None and timestamp < self.not_before:
            raise ReplayError(
                f"request was signed {self.not_before - timestamp:.1f}s before this hub started; nonces from "
                "before a restart are not remembered, so it is refused as a possible replay (sign it again)"
            )
        if timestamp > now + self.window_s:
            raise ReplayError(
                f"request timestamp is {timestamp - now:.0f}s in the future "
                f"(window {self.window_s:.0f}s); check the node's clock"
            )
        self._prune(now)
        key = (bytes(signer), nonce)
        if key in self._seen:
            raise ReplayError("request nonce was already used (replay)")
        if len(self._seen) >= self.max_entries:
            raise ReplayError("replay guard is full; retry shortly")
        expiry = float(timestamp) + self.window_s
        self._seen[key] = expiry
        heapq.heappush(self._expiry, (expiry, key[0], key[1]))


__all__ = [
    "NONCE_BYTES",
    "PUBLIC_KEY_BYTES",
    "SIGNATURE_BYTES",
    "ReplayGuard",
    "SigningKey",
    "domain",
    "fingerprint",
    "is_fingerprint",
    "new_nonce",
    "open_envelope",
    "open_sealed",
    "seal",
    "seal_bytes",
    "verify",
]
