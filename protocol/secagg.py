"""Secure aggregation: the cryptographic core, pure (no I/O, no clock, no network).

One round of a federated job, after Bonawitz et al. 2017, "Practical Secure Aggregation for
Privacy-Preserving Machine Learning" (the pieces SecAgg+ in Flower uses as well). ``n`` clients
each hold an update quantized to a uint32 vector of length ``L``; the server learns the sum
mod 2^32 of the vectors of the clients that finished, never one client's vector, even when
clients drop out after sharing their keys.

The round, in the order the adapters drive it::

    0. each client: SecAggClient(...)        -> .entry (node id, c_pk, s_pk) to the server
    1. server: roster = every entry received (U1); t = threshold_for(len(roster))
       each client: shares_for(roster, t)    -> {peer: ciphertext}; the server routes them
    2. server: U2 = clients whose shares arrived
       each client: receive(inbox); mask(q, U2) -> masked vector to the server
    3. server: U3 = clients whose masked vector arrived (add_masked)
       each client in U3: unmask_shares(U3, U2 \\ U3) -> answer to the server (add_unmask)
    4. server: result(U2, U3)                -> sum of the q of U3, mod 2^32

Security properties (honest-but-curious server and clients; any coalition of fewer than ``t``
clients, with or without the server, learns nothing about an honest client's vector beyond the
sum it is part of):

* Every vector is hidden by a self mask ``PRG(b_i)`` and by pairwise masks ``+-PRG(s_ij)``
  that cancel in the sum. ``b_i`` and ``s_sk_i`` are Shamir-shared ``t``-of-``n``; the server
  asks, per client, for the shares of exactly one of the two: ``b`` for a client whose masked
  vector it holds (to strip its self mask), ``s_sk`` for one that dropped (to strip the pairwise
  masks it left in the others' vectors). An honest client never gives both kinds for one node
  (``unmask_shares`` refuses) and answers one unmask request per round, and ``t`` is a strict
  majority, so even a server that tells different clients different stories cannot collect
  ``t`` shares of both kinds for one node: that would need ``2t > n`` distinct holders.
* The shares travel through the server encrypted (AES-256-GCM, key from X25519 + HKDF-SHA256)
  and bound to (job, round, sender, receiver): the server cannot read, redirect or replay them.
* ``t-1`` shares of a secret are independent of it (Shamir over GF(2^521 - 1)); a server with
  fewer than ``t`` answers for a node cannot strip its mask and ``result`` refuses.
* A wrong share in an unmask answer never silently corrupts the sum; ``result`` raises. How it
  is detected: an ``s`` share through the reconstructed key, whose X25519 public key must equal
  the roster's ``s_pk``; a ``b`` share through a commitment ``H(b)`` that the owner put in every
  share ciphertext and each holder repeats in its answer (all must agree, and the reconstructed
  ``b`` must hash to it). With more than ``t`` answers for a node, every extra share must also
  lie on the polynomial interpolated from the first ``t`` (by evaluation point), which is
  stronger than comparing the secrets of two ``t``-subsets; when exactly one holder's share is
  off and that can be told (``t + 2`` answers or more), the error names it. An altered share
  can only go unnoticed if *all* the holders used for that node collude, who could then equally
  have reported any sum.
* Not covered here (the adapters' job): authenticating who sent what to the server (signed
  envelopes), and the malicious-server consistency round of the paper (clients signing U3).

Formats (all integers big-endian):

* ``binding`` (the HKDF ``info`` and the AES-GCM AAD of a share ciphertext):
  ``b"gpuflex/secagg/v1/share\\0" || lp(job_id) || u64(round) || lp(sender) || lp(receiver)``,
  where ``lp(s)`` is the UTF-8 bytes of ``s`` after their length as u16.
* Share ciphertext, :data:`CIPHERTEXT_BYTES` = 192 bytes:
  ``nonce (12, random) || AES-GCM(key, nonce, plaintext, aad=binding)`` (164 + 16-byte tag),
  ``key = HKDF-SHA256(X25519(c_sk_sender, c_pk_receiver), salt=None, info=binding)``, and
  ``plaintext = y_b (66) || y_s (66) || commit_b (32)``: the receiver's Shamir shares of the
  sender's ``b`` and ``s_sk``, and ``commit_b = SHA-256(b"gpuflex/secagg/v1/self-commit\\0" ||
  lp(job_id) || u64(round) || lp(owner) || b)``.
* A share value ``y`` is an element of GF(p), p = 2^521 - 1, as 66 bytes. Its evaluation point
  is not sent: it is ``1 + `` the holder's index in the roster sorted by node id (Python ``str``
  order, which is the order of the ids' UTF-8 bytes).
* In an unmask answer, ``("b", y_b || commit_b)`` (:data:`B_SHARE_BYTES` = 98 bytes) or
  ``("s", y_s)`` (:data:`S_SHARE_BYTES` = 66 bytes).
* Secrets as field elements: ``b`` (32 random bytes) and ``s_sk`` (the raw 32-byte X25519
  private key) read as unsigned 256-bit integers.
* Pairwise seed ``s_ij = HKDF-SHA256(X25519(s_sk_i, s_pk_j), salt=None, info=pair)`` with
  ``pair = b"gpuflex/secagg/v1/pair\\0" || lp(job_id) || u64(round) || lp(min(i, j)) ||
  lp(max(i, j))`` (ids compared as ``str``), the same seed from both ends.
* ``PRG(seed, L)``: ChaCha20 keystream under the 32-byte seed (cryptography's 16-byte nonce:
  zero counter and a fixed label, ``"gfsa-self"`` for ``b`` and ``"gfsa-pair"`` for ``s_ij``;
  every seed is used for one vector of one round), read as ``L`` little-endian uint32.

Its cost, measured, is in docs/silos.md (secure aggregation: what it costs).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import SecAggError

MODULUS: Final = 1 << 32
#: the Shamir field: GF(p) for the Mersenne prime p = 2^521 - 1
PRIME: Final = (1 << 521) - 1
FIELD_BYTES: Final = 66
KEY_BYTES: Final = 32
COMMIT_BYTES: Final = 32
NONCE_BYTES: Final = 12
TAG_BYTES: Final = 16
PLAINTEXT_BYTES: Final = 2 * FIELD_BYTES + COMMIT_BYTES
CIPHERTEXT_BYTES: Final = NONCE_BYTES + PLAINTEXT_BYTES + TAG_BYTES
B_SHARE_BYTES: Final = FIELD_BYTES + COMMIT_BYTES
S_SHARE_BYTES: Final = FIELD_BYTES
MIN_CLIENTS: Final = 3
MAX_ID_BYTES: Final = 1024

_SECRET_LIMIT: Final = 1 << (8 * KEY_BYTES)
_DOMAIN: Final = b"gpuflex/secagg/v1/"
_NONCE_SELF: Final = bytes(4) + b"gfsa-self\0\0\0"
_NONCE_PAIR: Final = bytes(4) + b"gfsa-pair\0\0\0"

RandBytes = Callable[[int], bytes]


# --------------------------------------------------------------------------- roster


@dataclass(frozen=True)
class RosterEntry:
    """One client as the server announces it: its id and its two X25519 public keys.

    ``c_pk`` encrypts the shares sent to it; ``s_pk`` derives its pairwise masks. Both are
    fresh per round, so a round's masks and ciphertexts are unlinkable to any other round's.
    """

    node_id: str
    c_pk: bytes
    s_pk: bytes

    def __post_init__(self) -> None:
        _check_id(self.node_id, "a roster entry's node id")
        for name in ("c_pk", "s_pk"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) != KEY_BYTES:
                raise SecAggError(f"roster entry {self.node_id!r}: {name} must be {KEY_BYTES} bytes")


def threshold_for(n: int) -> int:
    """The reconstruction threshold ``t`` for ``n`` clients: a strict majority, ``n // 2 + 1``.

    A majority is what keeps the unmasking safe: giving the server both a node's ``b`` and its
    ``s_sk`` would take ``t`` holders for each, ``2t > n`` in all, so no split of the honest
    clients can do it. Fewer than 3 clients is refused: with 2, each learns the other's update
    from the sum.
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise SecAggError("the number of clients must be an int")
    if n < MIN_CLIENTS:
        raise SecAggError(
            "secure aggregation needs at least 3 clients: with 2, each learns the other's update from the sum"
        )
    return max(2, n // 2 + 1)


# --------------------------------------------------------------------------- quantization


def _check_quant(clip: float, bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 31:
        raise SecAggError("bits must be an int in 1..31")
    try:
        value = float(clip)
    except (TypeError, ValueError):
        value = float("nan")
    if isinstance(clip, (bool, str, bytes)) or not np.isfinite(value) or value <= 0:
        raise SecAggError("clip must be a finite number > 0")
    return (1 << bits) - 1


def quantize(values: np.ndarray, clip: float, bits: int, rng: np.random.Generator) -> np.ndarray:
    """Floats -> uint32 levels in ``[0, 2^bits - 1]``, unbiased.

    Each value is clipped to ``[-clip, clip]`` and mapped linearly onto ``[0, M]``,
    ``M = 2^bits - 1`` (``-clip -> 0``, ``clip -> M``), then rounded stochastically: up with
    probability equal to the fractional part, so ``E[dequantized] == clipped value`` exactly and
    the error of one value is below one step ``2 * clip / M``. The shape is kept. Non-finite
    values are refused (an update with NaN or inf is a bug upstream, not something to sum).
    """
    top = _check_quant(clip, bits)
    arr = np.asarray(values)
    if arr.dtype.kind not in "fiu" or arr.dtype == np.bool_:
        raise SecAggError("quantize takes a real-valued (float or int) array")
    x = arr.astype(np.float64)
    if not np.all(np.isfinite(x)):
        raise SecAggError("quantize needs finite values: the update holds NaN or inf")
    c = float(clip)
    # divide first: (x + clip) could overflow for a clip near the float maximum
    level = (np.clip(x, -c, c) / c + 1.0) * (top / 2.0)
    floor = np.floor(level)
    up = rng.random(size=level.shape) < (level - floor)
    q: np.ndarray = np.asarray(np.clip(floor + up, 0, top)).astype(np.uint32)
    return q


def max_clients(bits: int) -> int:
    """How many ``bits``-bit quantized vectors can be summed mod 2^32 without wrapping:
    ``floor((2^32 - 1) / (2^bits - 1))`` (e.g. 65537 at 16 bits, 2 at 31 bits)."""
    top = _check_quant(1.0, bits)
    return (MODULUS - 1) // top


def dequantize_sum(total: np.ndarray, count: int, clip: float, bits: int) -> np.ndarray:
    """The uint32 sum of ``count`` quantized vectors -> float64 sum of their clipped values.

    Exact inverse of :func:`quantize`'s linear map, summed: ``total * 2 * clip / M - count *
    clip``. Refused when ``count * M >= 2^32``, i.e. when more than :func:`max_clients` ``=
    floor((2^32 - 1) / (2^bits - 1))`` vectors are summed, because the sum mod 2^32 could then
    have wrapped and would decode to garbage. Divide by ``count`` for the mean.
    """
    top = _check_quant(clip, bits)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise SecAggError("count must be an int >= 1")
    if count * top >= MODULUS:
        raise SecAggError(
            f"{count} clients at {bits} bits could wrap the sum mod 2^32: at most {(MODULUS - 1) // top}"
        )
    arr = np.asarray(total)
    if arr.dtype != np.uint32:
        raise SecAggError("dequantize_sum takes the uint32 sum")
    return (arr.astype(np.float64) * (2.0 / top) - count) * float(clip)


# --------------------------------------------------------------------------- primitives


def _check_id(node_id: object, what: str) -> str:
    if not isinstance(node_id, str) or not node_id:
        raise SecAggError(f"{what} must be a non-empty string")
    try:
        raw = node_id.encode("utf-8")
    except UnicodeEncodeError:
        raise SecAggError(f"{what} is not valid text") from None
    if len(raw) > MAX_ID_BYTES:
        raise SecAggError(f"{what} is longer than {MAX_ID_BYTES} bytes")
    return node_id


def _lp(text: str) -> bytes:
    raw = text.encode("utf-8")
    return len(raw).to_bytes(2, "big") + raw


def _u64(value: int) -> bytes:
    return value.to_bytes(8, "big")


def _share_binding(job_id: str, round_: int, sender: str, receiver: str) -> bytes:
    return _DOMAIN + b"share\0" + _lp(job_id) + _u64(round_) + _lp(sender) + _lp(receiver)


def _commit(job_id: str, round_: int, owner: str, b: bytes) -> bytes:
    return hashlib.sha256(_DOMAIN + b"self-commit\0" + _lp(job_id) + _u64(round_) + _lp(owner) + b).digest()


def _hkdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def _exchange(sk: X25519PrivateKey, pk: bytes, who: str) -> bytes:
    try:
        return sk.exchange(X25519PublicKey.from_public_bytes(pk))
    except ValueError:
        raise SecAggError(f"{who}'s X25519 public key is not usable (low order point)") from None


def _pair_seed(sk: X25519PrivateKey, pk: bytes, job_id: str, round_: int, me: str, peer: str) -> bytes:
    """``s_ij`` from ``me``'s ``s_sk`` and ``peer``'s ``s_pk``: symmetric in the two ids."""
    lo, hi = (me, peer) if me < peer else (peer, me)
    info = _DOMAIN + b"pair\0" + _lp(job_id) + _u64(round_) + _lp(lo) + _lp(hi)
    return _hkdf(_exchange(sk, pk, peer), info)


def _prg(seed: bytes, nonce: bytes, length: int) -> np.ndarray:
    """``length`` uint32 from the ChaCha20 keystream of ``seed`` (single use per round)."""
    enc = Cipher(algorithms.ChaCha20(seed, nonce), mode=None).encryptor()
    stream = enc.update(bytes(4 * length))
    return np.frombuffer(stream, dtype="<u4").astype(np.uint32, copy=False)


def _draw(rand: RandBytes, n: int) -> bytes:
    out = rand(n)
    if not isinstance(out, bytes) or len(out) != n:
        raise SecAggError(f"rng_bytes({n}) did not return {n} bytes")
    return out


def _field_element(rand: RandBytes) -> int:
    """Uniform in GF(p): 521 random bits, rejecting the one value p itself."""
    while True:
        value = int.from_bytes(_draw(rand, FIELD_BYTES), "big") & PRIME
        if value < PRIME:
            return value


def _split(secret: int, t: int, xs: Sequence[int], rand: RandBytes) -> list[int]:
    """Shamir: a random degree ``t - 1`` polynomial with ``f(0) = secret``, evaluated at xs."""
    coeffs = [secret] + [_field_element(rand) for _ in range(t - 1)]
    out = []
    for x in xs:
        acc = 0
        for c in reversed(coeffs):
            acc = (acc * x + c) % PRIME
        out.append(acc)
    return out


def _interpolate(points: Sequence[tuple[int, int]], x0: int) -> int:
    """Lagrange: the value at ``x0`` of the polynomial of degree < len(points) through them."""
    total = 0
    for i, (xi, yi) in enumerate(points):
        num = 1
        den = 1
        for j, (xj, _) in enumerate(points):
            if j != i:
                num = num * (x0 - xj) % PRIME
                den = den * (xi - xj) % PRIME
        total = (total + yi * num * pow(den, -1, PRIME)) % PRIME
    return total


def _consistent(points: Sequence[tuple[int, int]], t: int) -> bool:
    base = points[:t]
    return all(_interpolate(base, x) == y for x, y in points[t:])


def _reconstruct(points: dict[str, tuple[int, int]], t: int, what: str) -> int:
    """The secret at 0 from the holders' points, every point checked to lie on one polynomial
    of degree ``t - 1``, the result checked to be a 256-bit secret. ``points``: holder ->
    (x, y)."""
    if len(points) < t:
        raise SecAggError(f"only {len(points)} of the {t} shares needed for {what}: cannot unmask")
    ordered = sorted(points.values())
    if not _consistent(ordered, t):
        suspects = []
        if len(points) >= t + 2:
            for holder in points:
                rest = sorted(p for h, p in points.items() if h != holder)
                if _consistent(rest, t):
                    suspects.append(holder)
        blame = f" (the share from {suspects[0]!r} disagrees)" if len(suspects) == 1 else ""
        raise SecAggError(f"the {len(points)} shares of {what} do not lie on one polynomial{blame}")
    secret = _interpolate(ordered[:t], 0)
    if secret >= _SECRET_LIMIT:
        raise SecAggError(f"the shares of {what} reconstruct to no valid secret: a share is wrong")
    return secret


def _field_bytes(value: int) -> bytes:
    return value.to_bytes(FIELD_BYTES, "big")


def _field_value(raw: bytes, what: str) -> int:
    value = int.from_bytes(raw, "big")
    if value >= PRIME:
        raise SecAggError(f"{what} is not an element of GF(2^521 - 1)")
    return value


def _check_job(job_id: object, round_: object) -> None:
    _check_id(job_id, "the job id")
    if isinstance(round_, bool) or not isinstance(round_, int) or not 0 <= round_ < 1 << 64:
        raise SecAggError("the round must be an int in 0..2^64-1")


def _check_roster(roster: Sequence[RosterEntry], threshold: int) -> tuple[RosterEntry, ...]:
    """The roster sorted by node id, after checking ids and keys are unique, ``n >= 3`` and
    ``threshold == threshold_for(n)``."""
    if isinstance(roster, (str, bytes)) or not isinstance(roster, Sequence):
        raise SecAggError("the roster must be a sequence of RosterEntry")
    if not all(isinstance(e, RosterEntry) for e in roster):
        raise SecAggError("the roster must be a sequence of RosterEntry")
    ids = [e.node_id for e in roster]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})[0]
        raise SecAggError(f"the roster lists node {dup!r} more than once")
    keys = [e.c_pk for e in roster] + [e.s_pk for e in roster]
    if len(set(keys)) != len(keys):
        raise SecAggError("the roster repeats a public key: every key must be fresh and distinct")
    t = threshold_for(len(roster))
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold != t:
        raise SecAggError(f"threshold {threshold!r} for {len(roster)} clients: it must be {t}")
    return tuple(sorted(roster, key=lambda e: e.node_id))


def _id_list(ids: Sequence[str], what: str, members: Container[str]) -> list[str]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise SecAggError(f"{what} must be a sequence of node ids")
    out = list(ids)
    for node in out:
        if not isinstance(node, str):
            raise SecAggError(f"{what} must be a sequence of node ids")
        if node not in members:
            raise SecAggError(f"{what}: {node!r} is outside the set it must belong to")
    if len(set(out)) != len(out):
        raise SecAggError(f"{what} lists a node more than once")
    return out


# --------------------------------------------------------------------------- client


class SecAggClient:
    """One client's side of one round. Single use: new keys and a new self-mask seed per round.

    The secrets (``c_sk``, ``s_sk``, ``b``) never leave this object except as Shamir shares
    encrypted to peers, and as the shares :meth:`unmask_shares` hands over under its rules.
    """

    def __init__(self, node_id: str, job_id: str, round: int, *, rng_bytes: RandBytes = os.urandom) -> None:
        """Draws fresh X25519 key pairs ``c`` (share encryption) and ``s`` (pairwise masks) and
        a 32-byte self-mask seed ``b``, all from ``rng_bytes`` (a CSPRNG; injectable for tests)."""
        _check_id(node_id, "the node id")
        _check_job(job_id, round)
        self.node_id = node_id
        self.job_id = job_id
        self.round = round
        self._rand = rng_bytes
        self._c_sk = X25519PrivateKey.from_private_bytes(_draw(rng_bytes, KEY_BYTES))
        self._s_sk = X25519PrivateKey.from_private_bytes(_draw(rng_bytes, KEY_BYTES))
        self._b = _draw(rng_bytes, KEY_BYTES)
        self._entry = RosterEntry(
            node_id, self._c_sk.public_key().public_bytes_raw(), self._s_sk.public_key().public_bytes_raw()
        )
        self._roster: dict[str, RosterEntry] = {}
        self._xs: dict[str, int] = {}
        self._threshold = 0
        self._sent: tuple[tuple[RosterEntry, ...], dict[str, bytes]] | None = None
        # holder-side: owner -> (y_b, y_s, commit_b); our own shares under our own id
        self._held: dict[str, tuple[int, int, bytes]] = {}
        self._survivors: frozenset[str] | None = None
        self._answered: tuple[frozenset[str], frozenset[str]] | None = None

    @property
    def entry(self) -> RosterEntry:
        """What the server announces for this client: id, ``c_pk``, ``s_pk`` (public)."""
        return self._entry

    def shares_for(self, roster: Sequence[RosterEntry], threshold: int) -> dict[str, bytes]:
        """Shamir-split ``b`` and ``s_sk`` ``threshold``-of-``n`` and encrypt each other member's
        two shares to it; returns ``{peer id: ciphertext}`` for the server to route.

        Checks first that the roster holds this client with its own keys, unique ids and keys,
        ``n >= 3`` and ``threshold == threshold_for(n)`` (a server cannot lower the threshold
        to collect a secret from a minority). Each ciphertext is readable only by its receiver
        and bound to (job, round, sender, receiver), so the server learns nothing from routing
        it and cannot deliver it elsewhere. A repeated call with the same roster returns the
        same ciphertexts; another roster is refused (fresh shares of the same secrets to a
        different set of holders could hand a minority ``t`` of them).
        """
        ordered = _check_roster(roster, threshold)
        if self._sent is not None:
            if ordered != self._sent[0] or threshold != self._threshold:
                raise SecAggError("shares were already made for another roster this round")
            return dict(self._sent[1])
        mine = next((e for e in ordered if e.node_id == self.node_id), None)
        if mine is None:
            raise SecAggError(f"the roster does not list this client ({self.node_id!r})")
        if mine != self._entry:
            raise SecAggError(f"the roster lists other keys for this client ({self.node_id!r})")
        xs = {e.node_id: i + 1 for i, e in enumerate(ordered)}
        points = [xs[e.node_id] for e in ordered]
        b_shares = _split(int.from_bytes(self._b, "big"), threshold, points, self._rand)
        s_shares = _split(int.from_bytes(self._s_sk.private_bytes_raw(), "big"), threshold, points, self._rand)
        commit = _commit(self.job_id, self.round, self.node_id, self._b)
        out: dict[str, bytes] = {}
        for entry, y_b, y_s in zip(ordered, b_shares, s_shares, strict=True):
            if entry.node_id == self.node_id:
                self._held[self.node_id] = (y_b, y_s, commit)
                continue
            binding = _share_binding(self.job_id, self.round, self.node_id, entry.node_id)
            key = _hkdf(_exchange(self._c_sk, entry.c_pk, entry.node_id), binding)
            nonce = _draw(self._rand, NONCE_BYTES)
            plaintext = _field_bytes(y_b) + _field_bytes(y_s) + commit
            out[entry.node_id] = nonce + AESGCM(key).encrypt(nonce, plaintext, binding)
        self._roster = {e.node_id: e for e in ordered}
        self._xs = xs
        self._threshold = threshold
        self._sent = (ordered, dict(out))
        return out

    def receive(self, inbox: Mapping[str, bytes]) -> None:
        """Decrypt and keep the shares other members sent this client (``{sender id:
        ciphertext}``); may be called more than once, before :meth:`mask`.

        Only roster members other than this client may send; a ciphertext that is truncated,
        padded, tampered with, or made for another job, round, sender or receiver does not
        authenticate and is refused (SecAggError, one line). All or nothing: nothing from
        ``inbox`` is stored unless every entry opens. A sender's second, different ciphertext
        is refused.
        """
        if self._sent is None:
            raise SecAggError("receive() before shares_for(): the roster is not known yet")
        if self._survivors is not None:
            raise SecAggError("receive() after mask(): the shares come too late for this round")
        if not isinstance(inbox, Mapping):
            raise SecAggError("the inbox must map sender ids to ciphertexts")
        opened: dict[str, tuple[int, int, bytes]] = {}
        for sender, data in inbox.items():
            if not isinstance(sender, str) or sender not in self._roster:
                raise SecAggError(f"shares from {sender!r}, who is not in the roster")
            if sender == self.node_id:
                raise SecAggError("shares from this client itself: it keeps its own")
            if not isinstance(data, bytes):
                raise SecAggError(f"the ciphertext from {sender!r} is not bytes")
            if len(data) != CIPHERTEXT_BYTES:
                raise SecAggError(
                    f"the ciphertext from {sender!r} is {len(data)} bytes, not {CIPHERTEXT_BYTES}: truncated or padded"
                )
            binding = _share_binding(self.job_id, self.round, sender, self.node_id)
            key = _hkdf(_exchange(self._c_sk, self._roster[sender].c_pk, sender), binding)
            try:
                plain = AESGCM(key).decrypt(data[:NONCE_BYTES], data[NONCE_BYTES:], binding)
            except InvalidTag:
                raise SecAggError(
                    f"the ciphertext from {sender!r} does not open: tampered with, or not made by it "
                    f"for this client in this job and round"
                ) from None
            y_b = _field_value(plain[:FIELD_BYTES], f"{sender!r}'s share")
            y_s = _field_value(plain[FIELD_BYTES : 2 * FIELD_BYTES], f"{sender!r}'s share")
            held = (y_b, y_s, plain[2 * FIELD_BYTES :])
            if self._held.get(sender, held) != held:
                raise SecAggError(f"{sender!r} already sent other shares this round")
            opened[sender] = held
        self._held.update(opened)

    def mask(self, q: np.ndarray, survivors: Sequence[str]) -> np.ndarray:
        """The masked vector ``q + PRG(b) + sum_{j > self} PRG(s_ij) - sum_{j < self} PRG(s_ij)``
        mod 2^32 over the other ``survivors`` (U2), as uint32. Callable once.

        Alone it is uniformly distributed, whatever ``q`` is; only the sum over the clients
        that finish, unmasked with ``t`` answers, reveals anything. ``survivors`` must hold this
        client, be roster members, number at least ``t``, and every other survivor's shares
        must be held here: otherwise a pairwise mask could never be removed (or its owner's
        secrets could not be shared back). Once: two vectors under the same masks would give
        the server their difference.
        """
        if self._sent is None:
            raise SecAggError("mask() before shares_for()")
        if self._survivors is not None:
            raise SecAggError("mask() was already called this round: masks are single use")
        arr = q
        if not isinstance(arr, np.ndarray) or arr.dtype != np.uint32 or arr.ndim != 1 or arr.size == 0:
            raise SecAggError("mask() takes a non-empty one-dimensional uint32 vector")
        u2 = _id_list(survivors, "survivors", self._roster)
        if self.node_id not in u2:
            raise SecAggError("survivors must include this client")
        if len(u2) < self._threshold:
            raise SecAggError(f"{len(u2)} survivors, fewer than the threshold {self._threshold}")
        missing = sorted(j for j in u2 if j not in self._held)
        if missing:
            raise SecAggError(f"no shares received from survivor(s) {', '.join(map(repr, missing))}")
        length = arr.shape[0]
        out = arr.copy()
        out += _prg(self._b, _NONCE_SELF, length)
        for j in u2:
            if j == self.node_id:
                continue
            seed = _pair_seed(self._s_sk, self._roster[j].s_pk, self.job_id, self.round, self.node_id, j)
            if j > self.node_id:
                out += _prg(seed, _NONCE_PAIR, length)
            else:
                out -= _prg(seed, _NONCE_PAIR, length)
        self._survivors = frozenset(u2)
        return out

    def unmask_shares(self, alive: Sequence[str], dropped: Sequence[str]) -> dict[str, tuple[str, bytes]]:
        """This client's answer to the unmask request: ``{node: ("b", share of its self-mask
        seed)}`` for every ``alive`` node (U3, itself included) and ``{node: ("s", share of its
        s_sk)}`` for every ``dropped`` one (U2 \\ U3).

        Refused unless ``alive`` and ``dropped`` are disjoint and together are exactly the
        survivors it masked with, ``alive`` holds this client and at least ``t`` nodes, and
        :meth:`mask` ran: both kinds for one node would let the server strip that node's masks
        and read its vector. One request per round: repeating the same sets returns the same
        answer, other sets are refused (else a server could ask for ``b`` first, ``s_sk`` next).
        """
        if self._survivors is None:
            raise SecAggError("unmask_shares() before mask(): there is nothing to unmask yet")
        u3 = _id_list(alive, "alive", self._roster)
        gone = _id_list(dropped, "dropped", self._roster)
        both = sorted(set(u3) & set(gone))
        if both:
            raise SecAggError(
                f"refused: {both[0]!r} is both alive and dropped, both its shares would unmask its update"
            )
        outside = sorted((set(u3) | set(gone)) - self._survivors)
        if outside:
            raise SecAggError(f"refused: {outside[0]!r} is not among the survivors this client masked with")
        unnamed = sorted(self._survivors - set(u3) - set(gone))
        if unnamed:
            raise SecAggError(f"refused: survivor {unnamed[0]!r} is neither alive nor dropped")
        if len(u3) < self._threshold:
            raise SecAggError(f"refused: {len(u3)} alive, fewer than the threshold {self._threshold}")
        if self.node_id not in u3:
            raise SecAggError("refused: this client is not listed alive")
        request = (frozenset(u3), frozenset(gone))
        if self._answered is not None and self._answered != request:
            raise SecAggError("refused: another unmask request was already answered this round")
        self._answered = request
        out: dict[str, tuple[str, bytes]] = {}
        for node in sorted(u3):
            y_b, _, commit = self._held[node]
            out[node] = ("b", _field_bytes(y_b) + commit)
        for node in sorted(gone):
            _, y_s, _ = self._held[node]
            out[node] = ("s", _field_bytes(y_s))
        return out


# --------------------------------------------------------------------------- server


class SecAggServer:
    """The server's side of one round: collects masked vectors and unmask answers and outputs
    the sum. It never holds a secret of a node whose masked vector it uses, other than that
    node's ``b`` (which alone leaves the pairwise masks on)."""

    def __init__(self, job_id: str, round: int, roster: Sequence[RosterEntry], threshold: int, length: int) -> None:
        """``roster`` is U1 as announced to the clients, ``threshold`` must be
        ``threshold_for(len(roster))``, ``length`` the vectors' length L."""
        _check_job(job_id, round)
        ordered = _check_roster(roster, threshold)
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise SecAggError("the vector length must be an int >= 1")
        self.job_id = job_id
        self.round = round
        self.threshold = threshold
        self.length = length
        self._roster = {e.node_id: e for e in ordered}
        self._xs = {e.node_id: i + 1 for i, e in enumerate(ordered)}
        self._masked: dict[str, np.ndarray] = {}
        # holder -> node -> (kind, y, commit or b"")
        self._answers: dict[str, dict[str, tuple[str, int, bytes]]] = {}

    def add_masked(self, node_id: str, vector: np.ndarray) -> None:
        """Keep a roster member's masked vector (uint32, one-dimensional, ``length``); once each."""
        if not isinstance(node_id, str) or node_id not in self._roster:
            raise SecAggError(f"masked vector from {node_id!r}, who is not in the roster")
        if node_id in self._masked:
            raise SecAggError(f"a second masked vector from {node_id!r}")
        if (
            not isinstance(vector, np.ndarray)
            or vector.dtype != np.uint32
            or vector.shape != (self.length,)
        ):
            raise SecAggError(f"the masked vector from {node_id!r} must be uint32 of length {self.length}")
        self._masked[node_id] = vector.copy()

    def add_unmask(self, node_id: str, shares: Mapping[str, tuple[str, bytes]]) -> None:
        """Keep a roster member's unmask answer (``{node: ("b" | "s", share bytes)}``); once each.
        The shape of every share is checked here, their agreement in :meth:`result`."""
        if not isinstance(node_id, str) or node_id not in self._roster:
            raise SecAggError(f"unmask answer from {node_id!r}, who is not in the roster")
        if node_id in self._answers:
            raise SecAggError(f"a second unmask answer from {node_id!r}")
        if not isinstance(shares, Mapping):
            raise SecAggError(f"the unmask answer from {node_id!r} must map node ids to (kind, share)")
        parsed: dict[str, tuple[str, int, bytes]] = {}
        for node, item in shares.items():
            if not isinstance(node, str) or node not in self._roster:
                raise SecAggError(f"the unmask answer from {node_id!r} names {node!r}, who is not in the roster")
            if not isinstance(item, tuple) or len(item) != 2:
                raise SecAggError(f"the unmask answer from {node_id!r} for {node!r} is not a (kind, share) pair")
            kind, raw = item
            size = {"b": B_SHARE_BYTES, "s": S_SHARE_BYTES}.get(kind) if isinstance(kind, str) else None
            if size is None or not isinstance(raw, bytes) or len(raw) != size:
                raise SecAggError(
                    f"the unmask answer from {node_id!r} for {node!r} must be ('b', {B_SHARE_BYTES} bytes)"
                    f" or ('s', {S_SHARE_BYTES} bytes)"
                )
            y = _field_value(raw[:FIELD_BYTES], f"the share from {node_id!r} for {node!r}")
            parsed[node] = (kind, y, raw[FIELD_BYTES:])
        self._answers[node_id] = parsed

    def result(self, survivors: Sequence[str], alive: Sequence[str]) -> np.ndarray:
        """The sum mod 2^32 of the original vectors of ``alive`` (U3), as uint32.

        ``survivors`` (U2) and ``alive`` must be the lists the clients were given. The masked
        vectors of ``alive`` are summed (the pairwise masks among them cancel); each alive
        node's self mask is removed with its ``b`` rebuilt from ``t`` or more ``b`` shares; the
        pairwise masks each alive node shares with a dropped one are removed with the dropped
        node's ``s_sk`` rebuilt from ``t`` or more ``s`` shares. Only answers from ``alive``
        nodes count, and they may only hold ``b`` for alive and ``s`` for dropped nodes.
        SecAggError (one line) when a node lacks ``t`` shares or its shares disagree (see the
        module docstring for how): never a wrong sum.
        """
        u2 = _id_list(survivors, "survivors", self._roster)
        u3 = _id_list(alive, "alive", set(u2))
        if len(u2) < self.threshold or len(u3) < self.threshold:
            raise SecAggError(
                f"{len(u3)} alive of {len(u2)} survivors: the threshold is {self.threshold}"
            )
        no_vector = sorted(n for n in u3 if n not in self._masked)
        if no_vector:
            raise SecAggError(f"no masked vector from alive node {no_vector[0]!r}")
        alive_set = set(u3)
        dropped = sorted(set(u2) - alive_set)
        b_points: dict[str, dict[str, tuple[int, int]]] = {n: {} for n in u3}
        b_commits: dict[str, set[bytes]] = {n: set() for n in u3}
        s_points: dict[str, dict[str, tuple[int, int]]] = {n: {} for n in dropped}
        for holder, answer in self._answers.items():
            if holder not in alive_set:
                continue
            for node, (kind, y, commit) in answer.items():
                expected = "b" if node in alive_set else "s" if node in s_points else None
                if expected is None:
                    raise SecAggError(f"the unmask answer from {holder!r} holds a share for {node!r}, not a survivor")
                if kind != expected:
                    raise SecAggError(
                        f"the unmask answer from {holder!r} holds a {kind!r} share for {node!r}, "
                        f"which is {'alive' if expected == 'b' else 'dropped'}: refused"
                    )
                if kind == "b":
                    b_points[node][holder] = (self._xs[holder], y)
                    b_commits[node].add(commit)
                else:
                    s_points[node][holder] = (self._xs[holder], y)
        total = np.zeros(self.length, dtype=np.uint32)
        for node in u3:
            total += self._masked[node]
        for node in u3:
            what = f"node {node!r}'s self-mask seed"
            if len(b_points[node]) < self.threshold:
                raise SecAggError(
                    f"only {len(b_points[node])} of the {self.threshold} shares needed for {what}: cannot unmask"
                )
            if len(b_commits[node]) > 1:
                raise SecAggError(f"the holders disagree on the commitment to {what}: a share is wrong")
            b = _reconstruct(b_points[node], self.threshold, what).to_bytes(KEY_BYTES, "big")
            if _commit(self.job_id, self.round, node, b) not in b_commits[node]:
                raise SecAggError(f"{what} does not match its commitment: a share is wrong")
            total -= _prg(b, _NONCE_SELF, self.length)
        for gone in dropped:
            what = f"dropped node {gone!r}'s mask key"
            raw = _reconstruct(s_points[gone], self.threshold, what).to_bytes(KEY_BYTES, "big")
            sk = X25519PrivateKey.from_private_bytes(raw)
            if sk.public_key().public_bytes_raw() != self._roster[gone].s_pk:
                raise SecAggError(f"{what} does not match its public key: a share is wrong")
            for node in u3:
                seed = _pair_seed(sk, self._roster[node].s_pk, self.job_id, self.round, gone, node)
                # node added +PRG when gone > node and -PRG when gone < node: take it back out
                if gone > node:
                    total -= _prg(seed, _NONCE_PAIR, self.length)
                else:
                    total += _prg(seed, _NONCE_PAIR, self.length)
        return total


__all__ = [
    "B_SHARE_BYTES",
    "CIPHERTEXT_BYTES",
    "MODULUS",
    "PRIME",
    "S_SHARE_BYTES",
    "RosterEntry",
    "SecAggClient",
    "SecAggServer",
    "dequantize_sum",
    "max_clients",
    "quantize",
    "threshold_for",
]
