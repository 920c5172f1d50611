"""libsodium's Ed25519, called without letting go of the GIL.

PyNaCl's bindings (cffi) release the GIL around every C call. For a call of 20 to 60 µs on a busy
event loop that is a loss: another thread (the hub's store writer, its blob pack, a round's
close) takes the GIL, and the loop then waits to get it back. In the serving hub a signature
check took 104 µs of the event loop's time against 56 µs alone, and signing 40 against 20
(cProfile of `gpuflex-hub serve` under bench/hub_load.py's 1,000 nodes).

``ctypes.PyDLL`` calls the same functions of the same library (the libsodium that PyNaCl's wheel
carries and PyNaCl has initialised) holding the GIL. Its detached calls make and check the same
signatures as PyNaCl's combined ones (Ed25519 signing is deterministic; libsodium's
``crypto_sign_open`` is its detached check on the split message), small-order keys refused
alike. Where that library does not export them, or a self-test of the pair against PyNaCl fails,
``NOGIL`` is None and protocol/signing.py uses PyNaCl's bindings.
"""

from __future__ import annotations

import ctypes
import importlib.util
from typing import Final

import nacl.bindings
import nacl.exceptions

__all__ = ["NOGIL", "SIGNATURE_BYTES", "Ed25519"]

#: an Ed25519 signature's length (protocol/signing.py takes it from here)
SIGNATURE_BYTES: Final = 64


class Ed25519:
    """libsodium's ``crypto_sign_ed25519_detached`` / ``_verify_detached`` through ``ctypes.PyDLL``."""

    def __init__(self, library: str) -> None:
        lib = ctypes.PyDLL(library)
        self._sign = lib.crypto_sign_ed25519_detached
        self._sign.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_ulonglong,
                               ctypes.c_char_p]
        self._sign.restype = ctypes.c_int
        self._verify = lib.crypto_sign_ed25519_verify_detached
        self._verify.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulonglong, ctypes.c_char_p]
        self._verify.restype = ctypes.c_int

    def sign(self, message: bytes, secret: bytes) -> bytes:
        """The 64-byte signature of ``message`` by libsodium's 64-byte secret key ``secret``."""
        if len(secret) != 64:
            raise ValueError("an Ed25519 secret key is 64 bytes")
        out = ctypes.create_string_buffer(SIGNATURE_BYTES)
        if self._sign(out, None, message, len(message), secret) != 0:
            raise ValueError("libsodium could not sign")
        return out.raw

    def verify(self, signature: bytes, message: bytes, public: bytes) -> bool:
        """Does ``signature`` verify for ``message`` under the 32-byte key ``public``?"""
        if len(signature) != SIGNATURE_BYTES or len(public) != 32:
            return False
        return bool(self._verify(signature, message, len(message), public) == 0)


def _self_tested(ed: Ed25519) -> Ed25519 | None:
    """``ed`` if it makes PyNaCl's signature and checks as PyNaCl does, else None."""
    public, secret = nacl.bindings.crypto_sign_seed_keypair(bytes(range(32)))
    message = b"gpuflex sodium self-test\0" + bytes(range(256))
    expected = nacl.bindings.crypto_sign(message, secret)[:SIGNATURE_BYTES]
    forged = bytes([expected[0] ^ 1]) + expected[1:]
    identity = bytes([1]) + bytes(31)  # a small-order key, under which R = identity, S = 0 fits any message
    ok = (ed.sign(message, secret) == expected and ed.verify(expected, message, public)
          and not ed.verify(forged, message, public) and not ed.verify(expected, message + b"x", public)
          and not ed.verify(identity + bytes(32), message, identity))
    return ed if ok else None


def _load() -> Ed25519 | None:
    spec = importlib.util.find_spec("nacl._sodium")
    if spec is None or not spec.origin:
        return None
    try:
        return _self_tested(Ed25519(spec.origin))
    except (OSError, AttributeError, ValueError, nacl.exceptions.CryptoError):
        return None


#: libsodium's Ed25519 holding the GIL, or None where PyNaCl's library does not offer it
NOGIL: Final = _load()
