"""The secure-aggregation messages (protocol/secagg.py; hub/policy/secagg.py runs the server's
side): the node's keys, its polls, the roster and phase the hub reports, the encrypted shares,
the masked update and the unmasking shares. Re-exported by protocol/messages.py, whose registry
(MESSAGE_TYPES) holds them like every other message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar, Final

from .fields import (
    ID_RE,
    MAX_LIST,
    Blob,
    BlobIdStr,
    Bytes,
    Count,
    Float,
    IdStr,
    Int,
    Nested,
    Nonce,
    Seq,
    ShortText,
    Text,
    Timestamp,
)

# -- secure aggregation (protocol/secagg.py; hub/policy/secagg.py runs the server's side) ------------
#: the phases of a round's secure aggregation, as the hub reports them to a node
SECAGG_PHASES: Final = ("keys", "shares", "masked", "unmask", "done", "aborted")
CIPHERTEXT_MAX: Final = 1024


@dataclass(frozen=True)
class SecAggKeys:
    """Node -> hub, POST /v1/secagg/keys: the node's two public keys for this round (X25519: one
    to encrypt the shares others send it, one for its pairwise masks), after it trained."""

    KIND: ClassVar[str] = "secagg_keys"
    assignment_id: IdStr
    c_pk: Annotated[bytes, Blob(32)]
    s_pk: Annotated[bytes, Blob(32)]
    timestamp: Timestamp
    nonce: Nonce


@dataclass(frozen=True)
class SecAggPoll:
    """Node -> hub, POST /v1/secagg/poll: where the round's secure aggregation stands (answered
    with a SecAggState), at once or when it moves on (``after``, ``wait_s``)."""

    KIND: ClassVar[str] = "secagg_poll"
    assignment_id: IdStr
    timestamp: Timestamp
    nonce: Nonce
    #: a long-poll: the hub answers once this node's phase is no longer ``after`` (the phase it last
    #: saw), or after ``wait_s`` (at most the hub's long-poll limit); 0 answers at once
    after: Annotated[str, Text(16, choices=("", *SECAGG_PHASES))] = ""
    wait_s: Annotated[float, Float(0.0, 60.0)] = 0.0


@dataclass(frozen=True)
class RosterMember:
    node_id: IdStr
    c_pk: Annotated[bytes, Blob(32)]
    s_pk: Annotated[bytes, Blob(32)]


@dataclass(frozen=True)
class Sealed:
    """A ciphertext from or to one node (``node_id``: the receiver in SecAggShares, the sender in
    a SecAggState's inbox); the hub cannot read it."""

    node_id: IdStr
    ciphertext: Annotated[bytes, Bytes(CIPHERTEXT_MAX, 1)]


@dataclass(frozen=True)
class UnmaskShare:
    """One share a node hands over to unmask the sum: of node ``node_id``'s self-mask seed
    (``kind`` "b", a node whose masked update came) or of its mask key (``kind`` "s", a node that
    dropped out after sharing its keys); never both for one node."""

    node_id: IdStr
    kind: Annotated[str, Text(1, choices=("b", "s"))]
    share: Annotated[bytes, Bytes(CIPHERTEXT_MAX, 1)]


@dataclass(frozen=True)
class SecAggState:
    """Hub -> node: the round's secure aggregation as far as it concerns this node. ``roster`` and
    ``threshold`` from phase "shares" on; ``survivors`` (who shared) and ``inbox`` (the shares sent
    to this node) from "masked" on; ``alive`` (whose masked update came) and ``dropped`` in
    "unmask"; ``detail`` says why a round was "aborted"."""

    KIND: ClassVar[str] = "secagg_state"
    assignment_id: IdStr
    phase: Annotated[str, Text(16, choices=SECAGG_PHASES)]
    roster: Annotated[tuple[RosterMember, ...], Seq(Nested(RosterMember), MAX_LIST)] = ()
    threshold: Annotated[int, Int(0, MAX_LIST)] = 0
    survivors: Annotated[tuple[str, ...], Seq(Text(64, pattern=ID_RE), MAX_LIST)] = ()
    inbox: Annotated[tuple[Sealed, ...], Seq(Nested(Sealed), MAX_LIST)] = ()
    alive: Annotated[tuple[str, ...], Seq(Text(64, pattern=ID_RE), MAX_LIST)] = ()
    dropped: Annotated[tuple[str, ...], Seq(Text(64, pattern=ID_RE), MAX_LIST)] = ()
    detail: ShortText = ""


@dataclass(frozen=True)
class SecAggShares:
    """Node -> hub, POST /v1/secagg/shares: this node's encrypted shares, one per other member."""

    KIND: ClassVar[str] = "secagg_shares"
    assignment_id: IdStr
    shares: Annotated[tuple[Sealed, ...], Seq(Nested(Sealed), MAX_LIST)]
    timestamp: Timestamp
    nonce: Nonce


@dataclass(frozen=True)
class SecAggMasked:
    """Node -> hub, POST /v1/secagg/masked (header X-GPUFlex-Masked; the body is the masked vector,
    uint32 little-endian, ``size`` bytes of SHA-256 ``sha256``): what the node trained, masked.
    ``sample_count``, ``loss`` and ``train_s`` are the plain figures every update reports."""

    KIND: ClassVar[str] = "secagg_masked"
    assignment_id: IdStr
    sha256: BlobIdStr
    size: Count
    sample_count: Count
    loss: Annotated[float, Float(0.0, 1e12)]
    train_s: Annotated[float, Float(0.0, 1e9)]
    timestamp: Timestamp
    nonce: Nonce


@dataclass(frozen=True)
class SecAggUnmask:
    """Node -> hub, POST /v1/secagg/unmask: the shares the hub asked for (SecAggState "unmask")."""

    KIND: ClassVar[str] = "secagg_unmask"
    assignment_id: IdStr
    shares: Annotated[tuple[UnmaskShare, ...], Seq(Nested(UnmaskShare), MAX_LIST)]
    timestamp: Timestamp
    nonce: Nonce
