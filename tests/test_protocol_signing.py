"""Signatures over exact bytes, envelopes, key files and replay protection."""

from __future__ import annotations

import os
import re
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import nacl.bindings
import pytest
from gpuflex.protocol import (
    Abandon,
    DecodeError,
    Heartbeat,
    KeyFileError,
    ProtocolError,
    ReplayError,
    ReplayGuard,
    SignatureError,
    SigningKey,
    domain,
    encode_message,
    fingerprint,
    new_nonce,
    open_sealed,
    seal,
    signing,
    sodium,
)
from gpuflex.protocol.signing import open_envelope, seal_bytes, verify
from hypothesis import given, settings
from hypothesis import strategies as st

KEY = SigningKey.from_seed(bytes(range(32)))
OTHER = SigningKey.from_seed(bytes(range(1, 33)))
HB = Heartbeat(assignment_id="a-1", progress=0.25, timestamp=1000.0, nonce=b"\x01" * 16)
SEALED = seal(KEY, HB)
PAYLOAD, SIGNER, SIG = open_envelope(SEALED)


def _envelope(payload: bytes, signer: bytes, sig: bytes) -> bytes:
    return msgpack.packb({"payload": payload, "signer": signer, "sig": sig}, use_bin_type=True)


def test_round_trip_returns_signer() -> None:
    msg, signer = open_sealed(SEALED, Heartbeat)
    assert msg == HB and signer == KEY.public_bytes
    assert open_sealed(SEALED, Heartbeat, signer=KEY.public_bytes)[0] == HB


def test_payload_is_the_exact_encoded_message() -> None:
    assert PAYLOAD == encode_message(HB)
    assert SIGNER == KEY.public_bytes and len(SIG) == 64
    verify(KEY.public_bytes, "heartbeat", PAYLOAD, SIG)


@settings(max_examples=300, deadline=None)
@given(index=st.integers(0, len(PAYLOAD) - 1), flip=st.integers(1, 255))
def test_flipping_any_payload_byte_fails(index: int, flip: int) -> None:
    bad = bytearray(PAYLOAD)
    bad[index] ^= flip
    with pytest.raises(SignatureError):
        open_sealed(_envelope(bytes(bad), SIGNER, SIG), Heartbeat)


@settings(max_examples=300, deadline=None)
@given(index=st.integers(0, 63), flip=st.integers(1, 255))
def test_flipping_any_signature_byte_fails(index: int, flip: int) -> None:
    bad = bytearray(SIG)
    bad[index] ^= flip
    with pytest.raises(SignatureError):
        open_sealed(_envelope(PAYLOAD, SIGNER, bytes(bad)), Heartbeat)


@settings(max_examples=300, deadline=None)
@given(index=st.integers(0, len(SEALED) - 1), flip=st.integers(1, 255))
def test_flipping_any_envelope_byte_fails(index: int, flip: int) -> None:
    bad = bytearray(SEALED)
    bad[index] ^= flip
    with pytest.raises(ProtocolError):
        open_sealed(bytes(bad), Heartbeat)


def test_cross_kind_signature_fails() -> None:
    # A heartbeat's signature never verifies as an abandon, and vice versa.
    with pytest.raises(SignatureError):
        open_sealed(SEALED, Abandon)
    # Same payload bytes signed under another kind's domain are refused.
    forged = seal_bytes(KEY, "abandon", PAYLOAD)
    with pytest.raises(SignatureError):
        open_sealed(forged, Heartbeat)
    assert domain("heartbeat") == b"gpuflex/v1/heartbeat\0"


def test_wrong_signer_refused() -> None:
    with pytest.raises(SignatureError, match="gf1-"):
        open_sealed(SEALED, Heartbeat, signer=OTHER.public_bytes)
    # Swapping in another public key breaks the signature.
    with pytest.raises(SignatureError):
        open_sealed(_envelope(PAYLOAD, OTHER.public_bytes, SIG), Heartbeat)


def test_envelope_strict() -> None:
    for bad in (
        msgpack.packb({"payload": PAYLOAD, "signer": SIGNER}),
        msgpack.packb(
            {"payload": PAYLOAD, "signer": SIGNER, "sig": SIG, "x": 1}, use_bin_type=True
        ),
        msgpack.packb({"payload": "text", "signer": SIGNER, "sig": SIG}, use_bin_type=True),
        _envelope(PAYLOAD, SIGNER[:31], SIG),
        _envelope(PAYLOAD, SIGNER, SIG[:63]),
        SEALED + b"\x00",
        b"",
        msgpack.packb([PAYLOAD, SIGNER, SIG], use_bin_type=True),
    ):
        with pytest.raises(DecodeError):
            open_sealed(bad, Heartbeat)


def test_invalid_public_key_point_refused() -> None:
    with pytest.raises(ProtocolError):
        open_sealed(_envelope(PAYLOAD, b"\xff" * 32, SIG), Heartbeat)


def test_fingerprint_format() -> None:
    fpr = KEY.fingerprint
    assert re.fullmatch(r"gf1-[a-z2-7]{4}(-[a-z2-7]{4}){4}", fpr)
    assert fpr == fingerprint(KEY.public_bytes)
    assert fpr != OTHER.fingerprint
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,64}", fpr)  # usable as a node id
    with pytest.raises(ProtocolError):
        fingerprint(b"short")


def test_new_nonce() -> None:
    a, b = new_nonce(), new_nonce()
    assert len(a) == 16 and a != b


# ---------------------------------------------------------------------------
# Key files.


def test_key_file_created_0600_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "node.key"
    key = SigningKey.generate()
    key.save(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    loaded = SigningKey.load(path)
    assert loaded.public_bytes == key.public_bytes
    assert loaded.private_bytes() == key.private_bytes()
    assert [p.name for p in path.parent.iterdir()] == ["node.key"]  # no temp files left


def test_key_file_overwrite_is_atomic_and_0600(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    path.write_bytes(b"old")
    os.chmod(path, 0o644)
    KEY.save(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert SigningKey.load(path).public_bytes == KEY.public_bytes


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660, 0o666])
def test_group_or_world_readable_key_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "node.key"
    KEY.save(path)
    os.chmod(path, mode)
    with pytest.raises(KeyFileError) as info:
        SigningKey.load(path)
    assert f"chmod 600 {path}" in str(info.value)


def test_load_or_create(tmp_path: Path) -> None:
    path = tmp_path / "hub.key"
    first = SigningKey.load_or_create(path)
    assert SigningKey.load_or_create(path).public_bytes == first.public_bytes


@pytest.mark.parametrize(
    "content", [b"", b"garbage", b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"]
)
def test_malformed_key_file_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "node.key"
    path.write_bytes(content)
    os.chmod(path, 0o600)
    with pytest.raises(KeyFileError):
        SigningKey.load(path)


def test_missing_key_file(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="does not exist"):
        SigningKey.load(tmp_path / "absent.key")


def test_key_repr_has_no_secret() -> None:
    assert KEY.fingerprint in repr(KEY)
    assert KEY.private_bytes().hex() not in repr(KEY)


# ---------------------------------------------------------------------------
# Replay guard.


class Clock:
    def __init__(self, now: float = 10_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_replay_fresh_then_repeat_refused() -> None:
    clock = Clock()
    guard = ReplayGuard(window_s=60, clock=clock)
    guard.check(b"s" * 32, clock.now, b"n" * 16)
    with pytest.raises(ReplayError, match="already used"):
        guard.check(b"s" * 32, clock.now, b"n" * 16)
    guard.check(b"t" * 32, clock.now, b"n" * 16)  # nonces are per signer


def test_replay_guard_refuses_what_was_signed_before_it_started() -> None:
    """A restarted hub has an empty nonce memory: anything signed before its start is refused."""
    clock = Clock()
    before = (b"s" * 32, clock.now - 5, new_nonce())
    ReplayGuard(window_s=60, clock=clock).check(*before)  # the old hub accepted it
    restarted = ReplayGuard(window_s=60, clock=clock, not_before=clock.now - 1)
    with pytest.raises(ReplayError, match="before this hub started"):
        restarted.check(*before)
    restarted.check(b"s" * 32, clock.now - 0.5, new_nonce())  # signed after the start: fine


def test_replay_stale_and_future_refused() -> None:
    clock = Clock()
    guard = ReplayGuard(window_s=60, clock=clock)
    with pytest.raises(ReplayError, match="old"):
        guard.check(b"s", clock.now - 61, new_nonce())
    with pytest.raises(ReplayError, match="future"):
        guard.check(b"s", clock.now + 61, new_nonce())
    guard.check(b"s", clock.now - 59, new_nonce())
    guard.check(b"s", clock.now + 59, new_nonce())
    for bad in (float("nan"), float("inf"), True):
        with pytest.raises(ReplayError):
            guard.check(b"s", bad, new_nonce())
    with pytest.raises(ReplayError):
        guard.check(b"s", clock.now, b"")


def test_replay_guard_full_fails_closed_then_recovers() -> None:
    clock = Clock()
    guard = ReplayGuard(window_s=60, max_entries=3, clock=clock)
    for i in range(3):
        guard.check(b"s", clock.now, bytes([i]) * 16)
    with pytest.raises(ReplayError, match="full"):
        guard.check(b"s", clock.now, b"\x09" * 16)
    # A nonce still inside its window is never forgotten.
    with pytest.raises(ReplayError):
        guard.check(b"s", clock.now, b"\x00" * 16)
    clock.now += 61  # the old entries leave the window
    guard.check(b"s", clock.now, b"\x09" * 16)
    assert len(guard) == 1


def test_replay_nonce_remembered_while_timestamp_valid() -> None:
    clock = Clock()
    guard = ReplayGuard(window_s=60, clock=clock)
    ts = clock.now + 50  # future-dated within the window: valid until now + 110
    guard.check(b"s", ts, b"x" * 16)
    clock.now += 100
    with pytest.raises(ReplayError, match="already used"):
        guard.check(b"s", ts, b"x" * 16)
    clock.now += 20
    with pytest.raises(ReplayError, match="old"):
        guard.check(b"s", ts, b"x" * 16)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.floats(-100, 100), st.binary(min_size=16, max_size=16)),
        max_size=40,
    )
)
def test_replay_guard_never_accepts_twice(events: list[tuple[int, float, bytes]]) -> None:
    clock = Clock()
    guard = ReplayGuard(window_s=30, max_entries=10, clock=clock)
    accepted: set[tuple[int, bytes]] = set()
    for signer, offset, nonce in events:
        try:
            guard.check(bytes([signer]), clock.now + offset, nonce)
        except ReplayError:
            continue
        assert (signer, nonce) not in accepted
        accepted.add((signer, nonce))
        assert len(guard) <= 10


# -- libsodium (PyNaCl) signs and verifies: the same signatures as OpenSSL's, stricter checks ------


def test_signatures_are_the_ones_openssl_makes_and_openssl_made_ones_verify():
    """Ed25519 is deterministic: a node or hub of an earlier release (signing through cryptography's
    OpenSSL) and this one make the same bytes, so they verify each other's messages."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    seed = bytes(range(32))
    openssl = Ed25519PrivateKey.from_private_bytes(seed)
    key = SigningKey.from_seed(seed)
    for kind, payload in (("work", b""), ("hello", b"x" * 1000), ("update", os.urandom(300))):
        made = openssl.sign(domain(kind) + payload)
        assert key.sign(kind, payload) == made
        verify(key.public_bytes, kind, payload, made)
        openssl.public_key().verify(key.sign(kind, payload), domain(kind) + payload)


def test_a_small_order_public_key_cannot_sign_every_message():
    """With the identity point as public key, R = identity and S = 0 'verify' for any message under
    OpenSSL's check (cryptography accepts it): anyone could sign as that identity. libsodium
    refuses small-order keys, so the envelope is refused in one line."""
    identity = bytes([1]) + bytes(31)
    universal = identity + bytes(32)
    with pytest.raises(SignatureError, match="does not verify"):
        verify(identity, "work", b"anything at all", universal)
    envelope = msgpack.packb({"payload": encode_message(Heartbeat(assignment_id="a-1", progress=0.5,
                                                                  timestamp=1.0, nonce=new_nonce())),
                              "signer": identity, "sig": universal}, use_bin_type=True)
    with pytest.raises(SignatureError, match="does not verify"):
        open_sealed(envelope, Heartbeat)


def test_a_flipped_bit_anywhere_is_refused():
    key = SigningKey.generate()
    payload = b"some payload bytes"
    sig = key.sign("work", payload)
    for i in range(0, 64 * 8, 37):
        bad = bytearray(sig)
        bad[i // 8] ^= 1 << (i % 8)
        with pytest.raises(SignatureError):
            verify(key.public_bytes, "work", payload, bytes(bad))
    with pytest.raises(SignatureError):
        verify(key.public_bytes, "hello", payload, sig)  # another kind's domain
    with pytest.raises(SignatureError):
        verify(key.public_bytes, "work", payload + b"!", sig)


# -- libsodium through ctypes.PyDLL keeps the GIL (protocol/sodium.py) ------------------------------


def _counted_beside(call: Callable[[], object]) -> int:
    """How far a busy thread counts while ``call`` runs on this one."""
    count, stop = [0], threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        time.sleep(0.05)
        before = count[0]
        call()
        return count[0] - before
    finally:
        stop.set()
        thread.join()


def test_signing_and_verifying_keep_the_gil_where_pynacls_bindings_let_it_go():
    """A 32 MiB message takes libsodium over 100 ms to check: through PyNaCl's cffi bindings another
    thread runs all that time, through protocol/sodium.py at most for the switch interval around it."""
    assert sodium.NOGIL is not None, "PyNaCl's libsodium did not load through ctypes.PyDLL here"
    public, secret = nacl.bindings.crypto_sign_seed_keypair(bytes(32))
    message = bytes(32 << 20)
    signature = nacl.bindings.crypto_sign(message, secret)[:64]
    held = _counted_beside(lambda: sodium.NOGIL.verify(signature, message, public))
    released = _counted_beside(lambda: nacl.bindings.crypto_sign_open(signature + message, public))
    assert held < released / 4, (held, released)
    held = _counted_beside(lambda: sodium.NOGIL.sign(message, secret))
    released = _counted_beside(lambda: nacl.bindings.crypto_sign(message, secret))
    assert held < released / 4, (held, released)


@given(st.binary(min_size=32, max_size=32), st.binary(max_size=2048), st.integers(0, 64 * 8 - 1))
@settings(max_examples=200, deadline=None)
def test_the_gil_keeping_calls_agree_with_pynacls(seed: bytes, message: bytes, bit: int) -> None:
    assert sodium.NOGIL is not None
    public, secret = nacl.bindings.crypto_sign_seed_keypair(seed)
    made = nacl.bindings.crypto_sign(message, secret)[:64]
    assert sodium.NOGIL.sign(message, secret) == made
    assert sodium.NOGIL.verify(made, message, public)
    flipped = bytearray(made)
    flipped[bit // 8] ^= 1 << (bit % 8)
    assert not sodium.NOGIL.verify(bytes(flipped), message, public)
    assert not sodium.NOGIL.verify(made, message + b"\0", public)


def test_without_the_gil_keeping_calls_pynacls_bindings_sign_and_check(monkeypatch: pytest.MonkeyPatch):
    """Where PyNaCl's library does not export libsodium's detached calls (NOGIL is None), signing and
    verifying go through PyNaCl's bindings, with the same results."""
    key = SigningKey.from_seed(bytes(range(32)))
    with_nogil = key.sign("work", b"payload")
    monkeypatch.setattr(signing, "NOGIL", None)
    assert key.sign("work", b"payload") == with_nogil
    verify(key.public_bytes, "work", b"payload", with_nogil)
    with pytest.raises(SignatureError, match="does not verify"):
        verify(key.public_bytes, "work", b"payload!", with_nogil)
    identity = bytes([1]) + bytes(31)
    with pytest.raises(SignatureError, match="does not verify"):
        verify(identity, "work", b"anything at all", identity + bytes(32))


@settings(max_examples=100, deadline=None)
@given(public=st.binary(min_size=32, max_size=32), text=st.text(max_size=40))
def test_is_fingerprint_takes_every_fingerprint_and_only_that_form(public, text):
    from gpuflex.protocol.signing import fingerprint, is_fingerprint

    assert is_fingerprint(fingerprint(public))
    assert not is_fingerprint(fingerprint(public).upper()) and not is_fingerprint(fingerprint(public) + "a")
    assert is_fingerprint(text) == (len(text) == 29 and text.startswith("gf1-")
                                    and all(c in "abcdefghijklmnopqrstuvwxyz234567" for c in text[4:].replace("-", ""))
                                    and [len(g) for g in text[4:].split("-")] == [4] * 5)
    assert not is_fingerprint("not-a-key") and not is_fingerprint(None)
