"""The protocol's exception tree.

Every failure the protocol package reports is a :class:`ProtocolError`, so an
adapter (the hub's HTTP layer, the node's client) can catch one type and map it
to a status code. Messages are one line a person can act on.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Root of every error raised by ``gpuflex.protocol``."""


class DecodeError(ProtocolError):
    """Bytes that are not a well-formed message, envelope, or tensor blob."""


class EncodeError(ProtocolError):
    """A message object whose field values the wire format does not allow."""


class VersionError(ProtocolError):
    """The peer speaks an incompatible protocol version."""


class SignatureError(ProtocolError):
    """A signature that does not verify, or a signer that is not the one expected."""


class ReplayError(ProtocolError):
    """A stale, future-dated or repeated (timestamp, nonce)."""


class KeyFileError(ProtocolError):
    """A key file that is missing, malformed or readable by others."""


class TensorError(ProtocolError):
    """A tensor blob or state dict that breaks the codec's rules or a manifest."""


class SpecError(ProtocolError):
    """A model or job specification that is invalid; names ``section.key``."""


class DatasetError(ProtocolError):
    """A dataset file or its arrays break the rules (``protocol/dataset.py``): a format the
    protocol does not read, or arrays that do not fit the model spec. ``code`` names the rule
    for the adapters: ``bad_dataset`` (unreadable, wrong format, wrong name, no samples),
    ``bad_shape``, ``non_finite``, ``bad_labels``, ``bad_tokens``."""

    def __init__(self, message: str, *, code: str = "bad_dataset") -> None:
        super().__init__(message)
        self.code = code


class SecAggError(ProtocolError):
    """A secure-aggregation step that is refused or cannot complete (``protocol/secagg.py``):
    a bad roster, share ciphertext or unmask answer, a request that would reveal a client's
    update, or too few shares to unmask the sum."""


__all__ = [
    "DatasetError",
    "DecodeError",
    "EncodeError",
    "KeyFileError",
    "ProtocolError",
    "ReplayError",
    "SecAggError",
    "SignatureError",
    "SpecError",
    "TensorError",
    "VersionError",
]
