"""Secure aggregation's cryptographic core (protocol/secagg.py), with real cryptography.

Whole rounds for n in {3, 5, 10, 20} give the exact sum mod 2^32; dropouts before and after
sharing are handled up to n - t and refused beyond; a lone masked vector looks uniform; every
refusal the module promises happens; an altered share in an unmask answer is detected. The
share format is checked from outside: the test interpolates the documented shares itself.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
from gpuflex.protocol.errors import ProtocolError, SecAggError
from gpuflex.protocol.secagg import (
    B_SHARE_BYTES,
    CIPHERTEXT_BYTES,
    MODULUS,
    PRIME,
    S_SHARE_BYTES,
    RosterEntry,
    SecAggClient,
    SecAggServer,
    dequantize_sum,
    max_clients,
    quantize,
    threshold_for,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

JOB = "job-7f3a"
ROUND = 4


def node_ids(n: int, salt: str = "") -> list[str]:
    """Realistic ids whose sorted order differs from their creation order."""
    out = []
    for i in range(n):
        h = hashlib.sha256(f"{salt}{i}".encode()).hexdigest()
        out.append("gf1-" + "-".join(h[k : k + 4] for k in range(0, 20, 4)))
    return out


def seeded(seed: int) -> Callable[[int], bytes]:
    """A reproducible rng_bytes: c_sk, s_sk and b are its first three 32-byte draws."""
    r = random.Random(seed)
    return lambda k: r.randbytes(k)


def known_b(seed: int) -> bytes:
    r = random.Random(seed)
    r.randbytes(32)
    r.randbytes(32)
    return r.randbytes(32)


@dataclass
class Round:
    clients: dict[str, SecAggClient]
    roster: list[RosterEntry]
    t: int
    u2: list[str]
    u3: list[str]
    q: dict[str, np.ndarray]
    masked: dict[str, np.ndarray] = field(default_factory=dict)
    answers: dict[str, dict[str, tuple[str, bytes]]] = field(default_factory=dict)
    server: SecAggServer | None = None

    def expected(self) -> np.ndarray:
        total = np.zeros_like(next(iter(self.q.values())))
        for node in self.u3:
            total += self.q[node]
        return total


def run_round(
    n: int,
    length: int = 257,
    *,
    never_shared: Sequence[int] = (),
    dropped_after: Sequence[int] = (),
    silent: Sequence[int] = (),
    q: dict[str, np.ndarray] | None = None,
    seeds: Sequence[int] | None = None,
    unmask: bool = True,
) -> Round:
    """Drive one round: clients at positions `never_shared` vanish before sending shares (not in
    U2), `dropped_after` after (in U2, not U3); `silent` are alive but send no unmask answer."""
    ids = node_ids(n)
    clients = {
        node: SecAggClient(node, JOB, ROUND, **({"rng_bytes": seeded(seeds[i])} if seeds else {}))
        for i, node in enumerate(ids)
    }
    roster = [c.entry for c in clients.values()]
    t = threshold_for(n)
    gen = np.random.default_rng(n)
    if q is None:
        q = {node: gen.integers(0, MODULUS, size=length, dtype=np.uint32) for node in ids}
    u2 = [ids[i] for i in range(n) if i not in never_shared]
    u3 = [node for i, node in enumerate(ids) if node in u2 and i not in dropped_after]
    outboxes = {node: clients[node].shares_for(roster, t) for node in u2}
    rnd = Round(clients, roster, t, u2, u3, q)
    for node in u2:
        clients[node].receive({s: outboxes[s][node] for s in u2 if s != node})
    for node in u3:
        rnd.masked[node] = clients[node].mask(q[node], u2)
    server = SecAggServer(JOB, ROUND, roster, t, length)
    rnd.server = server
    for node, vec in rnd.masked.items():
        server.add_masked(node, vec)
    if unmask:
        dropped = [x for x in u2 if x not in u3]
        for i, node in enumerate(ids):
            if node in u3 and i not in silent:
                rnd.answers[node] = clients[node].unmask_shares(u3, dropped)
                server.add_unmask(node, rnd.answers[node])
    return rnd


def lagrange_at_zero(points: Sequence[tuple[int, int]]) -> int:
    """Independent of the module: Shamir reconstruction from the documented share format."""
    total = 0
    for i, (xi, yi) in enumerate(points):
        num, den = 1, 1
        for j, (xj, _) in enumerate(points):
            if i != j:
                num = num * -xj % PRIME
                den = den * (xi - xj) % PRIME
        total = (total + yi * num * pow(den, PRIME - 2, PRIME)) % PRIME
    return total


# --------------------------------------------------------------------------- whole rounds


@pytest.mark.parametrize("n", [3, 5, 10, 20])
def test_a_full_round_gives_the_exact_sum(n: int) -> None:
    rnd = run_round(n)
    assert rnd.server is not None
    out = rnd.server.result(rnd.u2, rnd.u3)
    assert out.dtype == np.uint32
    np.testing.assert_array_equal(out, rnd.expected())


@pytest.mark.parametrize("n", [3, 5, 10, 20])
def test_float_updates_through_quantization_give_the_mean(n: int) -> None:
    clip, bits, length = 0.5, 16, 2000
    gen = np.random.default_rng(100 + n)
    floats = {node: gen.normal(0.0, 0.3, size=length) for node in node_ids(n)}
    q = {node: quantize(v, clip, bits, gen) for node, v in floats.items()}
    rnd = run_round(n, length, q=q)
    assert rnd.server is not None
    total = rnd.server.result(rnd.u2, rnd.u3)
    mean = dequantize_sum(total, n, clip, bits) / n
    true_mean = np.mean([np.clip(v, -clip, clip) for v in floats.values()], axis=0)
    step = 2 * clip / ((1 << bits) - 1)
    assert np.max(np.abs(mean - true_mean)) <= step
    # stochastic rounding is unbiased: the errors average out far below one step
    assert abs(float(np.mean(mean - true_mean))) < step / 10


# --------------------------------------------------------------------------- dropouts


@pytest.mark.parametrize("n", [3, 5, 10, 20])
def test_up_to_n_minus_t_clients_may_drop_after_sharing(n: int) -> None:
    t = threshold_for(n)
    drops = list(range(1, 1 + n - t))
    rnd = run_round(n, dropped_after=drops)
    assert len(rnd.u3) == t
    assert rnd.server is not None
    np.testing.assert_array_equal(rnd.server.result(rnd.u2, rnd.u3), rnd.expected())


def test_clients_that_never_shared_are_left_out_and_mixed_drops_recover() -> None:
    n = 10
    rnd = run_round(n, never_shared=[0, 7], dropped_after=[3, 9])
    assert len(rnd.u2) == 8 and len(rnd.u3) == 6 == rnd.t
    assert rnd.server is not None
    np.testing.assert_array_equal(rnd.server.result(rnd.u2, rnd.u3), rnd.expected())
    # the dropped ones' update never enters the sum, the never-shared ones' neither
    assert set(rnd.u3).isdisjoint({node_ids(n)[i] for i in (0, 7, 3, 9)})


def test_one_drop_too_many_is_refused_by_clients_and_server() -> None:
    n = 10
    t = threshold_for(n)
    rnd = run_round(n, dropped_after=list(range(n - t + 1)), unmask=False)
    assert len(rnd.u3) == t - 1
    dropped = [x for x in rnd.u2 if x not in rnd.u3]
    for node in rnd.u3:
        with pytest.raises(SecAggError, match="fewer than the threshold"):
            rnd.clients[node].unmask_shares(rnd.u3, dropped)
    assert rnd.server is not None
    with pytest.raises(SecAggError, match="threshold"):
        rnd.server.result(rnd.u2, rnd.u3)


def test_too_few_survivors_cannot_even_mask() -> None:
    n = 5
    ids = node_ids(n)
    clients = [SecAggClient(x, JOB, ROUND) for x in ids]
    roster = [c.entry for c in clients]
    out = {c.node_id: c.shares_for(roster, 3) for c in clients}
    c0 = clients[0]
    c0.receive({ids[1]: out[ids[1]][ids[0]]})
    with pytest.raises(SecAggError, match="fewer than the threshold"):
        c0.mask(np.zeros(4, dtype=np.uint32), ids[:2])


def test_too_few_unmask_answers_is_refused_not_a_wrong_sum() -> None:
    n = 10
    t = threshold_for(n)
    # 7 alive, only t - 1 of them answer
    rnd = run_round(n, dropped_after=[0, 1, 2], silent=[3, 4])
    assert len(rnd.answers) == t - 1
    assert rnd.server is not None
    with pytest.raises(SecAggError, match=r"only 5 of the 6 shares"):
        rnd.server.result(rnd.u2, rnd.u3)


def test_exactly_t_answers_suffice() -> None:
    rnd = run_round(10, dropped_after=[5], silent=[0, 1, 2])
    assert len(rnd.answers) == rnd.t
    assert rnd.server is not None
    np.testing.assert_array_equal(rnd.server.result(rnd.u2, rnd.u3), rnd.expected())


# --------------------------------------------------------------------------- privacy


def test_a_single_masked_vector_looks_uniform() -> None:
    n, length = 5, 100_000
    ids = node_ids(n)
    # the worst input for a weak mask: all zeros, and a ramp
    q = {x: np.zeros(length, dtype=np.uint32) for x in ids}
    q[ids[1]] = np.arange(length, dtype=np.uint32)
    rnd = run_round(n, length, q=q, unmask=False)
    for node in ids[:2]:
        y = rnd.masked[node]
        assert np.count_nonzero(y == q[node]) < 5
        counts = np.bincount(y.view(np.uint8), minlength=256)
        expected = y.nbytes / 256
        chi2 = float(np.sum((counts - expected) ** 2 / expected))
        # 255 degrees of freedom: mean 255, sd 22.6; 400 is ~6.4 sd out (p < 1e-8)
        assert chi2 < 400, chi2
        mean = float(np.mean(y.astype(np.float64)))
        sd_of_mean = MODULUS / np.sqrt(12 * length)
        assert abs(mean - (MODULUS - 1) / 2) < 6 * sd_of_mean
        var = float(np.var(y.astype(np.float64)))
        assert abs(var / (MODULUS**2 / 12) - 1) < 0.05


def test_fewer_than_t_shares_do_not_give_the_secret() -> None:
    n = 5
    seeds = list(range(10, 10 + n))
    rnd = run_round(n, seeds=seeds)
    t = rnd.t
    owner_pos = 2
    owner = node_ids(n)[owner_pos]
    b = int.from_bytes(known_b(seeds[owner_pos]), "big")
    xs = {x: i + 1 for i, x in enumerate(sorted(node_ids(n)))}
    points = []
    for holder, answer in sorted(rnd.answers.items()):
        kind, raw = answer[owner]
        assert kind == "b" and len(raw) == B_SHARE_BYTES
        points.append((xs[holder], int.from_bytes(raw[:66], "big")))
    assert lagrange_at_zero(points[:t]) == b
    assert lagrange_at_zero(points[1 : t + 1]) == b
    assert lagrange_at_zero(points[: t - 1]) != b
    # and the server with t - 1 answers refuses
    server = SecAggServer(JOB, ROUND, rnd.roster, t, 257)
    for node in rnd.u3:
        server.add_masked(node, rnd.masked[node])
    for holder in sorted(rnd.answers)[: t - 1]:
        server.add_unmask(holder, rnd.answers[holder])
    with pytest.raises(SecAggError, match="cannot unmask"):
        server.result(rnd.u2, rnd.u3)


def test_a_dropped_nodes_share_answer_holds_its_s_key_share() -> None:
    """The 's' shares interpolate to the dropped node's raw X25519 key, as documented."""
    n = 5
    seeds = list(range(40, 40 + n))
    rnd = run_round(n, dropped_after=[1], seeds=seeds)
    gone = node_ids(n)[1]
    r = random.Random(seeds[1])
    r.randbytes(32)
    s_sk = int.from_bytes(r.randbytes(32), "big")
    xs = {x: i + 1 for i, x in enumerate(sorted(node_ids(n)))}
    points = []
    for holder, answer in sorted(rnd.answers.items()):
        kind, raw = answer[gone]
        assert kind == "s" and len(raw) == S_SHARE_BYTES
        points.append((xs[holder], int.from_bytes(raw, "big")))
    assert lagrange_at_zero(points[: rnd.t]) == s_sk


# --------------------------------------------------------------------------- refusals


def three(seed_base: int | None = None, n: int = 5) -> tuple[list[SecAggClient], list[RosterEntry], int]:
    ids = node_ids(n)
    clients = [
        SecAggClient(x, JOB, ROUND, **({"rng_bytes": seeded(seed_base + i)} if seed_base is not None else {}))
        for i, x in enumerate(ids)
    ]
    return clients, [c.entry for c in clients], threshold_for(n)


def test_threshold_for_needs_three_clients_and_is_a_majority() -> None:
    with pytest.raises(SecAggError, match="at least 3 clients: with 2, each learns"):
        threshold_for(2)
    assert [threshold_for(n) for n in (3, 4, 5, 10, 20, 21)] == [2, 3, 3, 6, 11, 11]
    assert all(2 * threshold_for(n) > n for n in range(3, 200))
    assert issubclass(SecAggError, ProtocolError)


def test_roster_refusals() -> None:
    clients, roster, t = three()
    me = clients[0]
    with pytest.raises(SecAggError, match="does not list this client"):
        me.shares_for([*roster[1:], SecAggClient("gf1-zzzz", JOB, ROUND).entry], t)
    with pytest.raises(SecAggError, match="more than once"):
        me.shares_for([*roster, roster[2]], threshold_for(6))
    with pytest.raises(SecAggError, match="must be 3"):
        me.shares_for(roster, 2)
    with pytest.raises(SecAggError, match="must be 3"):
        me.shares_for(roster, 5)
    other = SecAggClient(me.node_id, JOB, ROUND).entry
    with pytest.raises(SecAggError, match="other keys for this client"):
        me.shares_for([other, *roster[1:]], t)
    stolen = RosterEntry("gf1-copy", roster[1].c_pk, roster[1].s_pk)
    with pytest.raises(SecAggError, match="repeats a public key"):
        me.shares_for([*roster, stolen], threshold_for(6))
    with pytest.raises(SecAggError, match="at least 3 clients"):
        me.shares_for(roster[:2], 2)
    with pytest.raises(SecAggError, match="32 bytes"):
        RosterEntry("gf1-x", b"short", bytes(32))
    # the refusals left no state: the right roster still works, and again gives the same
    first = me.shares_for(roster, t)
    assert me.shares_for(roster, t) == first
    assert set(first) == {c.node_id for c in clients[1:]}
    assert all(len(ct) == CIPHERTEXT_BYTES for ct in first.values())
    with pytest.raises(SecAggError, match="another roster"):
        me.shares_for(roster[:4], threshold_for(4))
    with pytest.raises(SecAggError):
        SecAggServer(JOB, ROUND, roster, 2, 10)


def test_ciphertexts_that_do_not_authenticate_are_refused() -> None:
    clients, roster, t = three()
    a, b, c = clients[:3]
    out = {x.node_id: x.shares_for(roster, t) for x in clients}
    good = out[a.node_id][b.node_id]
    bad: list[tuple[str, bytes, str]] = []
    for pos in (0, 5, 11, 12, 40, 100, CIPHERTEXT_BYTES - 17, CIPHERTEXT_BYTES - 1):
        flipped = bytearray(good)
        flipped[pos] ^= 0x01
        bad.append((a.node_id, bytes(flipped), "does not open"))
    bad.append((a.node_id, good[:-1], "truncated or padded"))
    bad.append((a.node_id, good + b"\0", "truncated or padded"))
    bad.append((a.node_id, b"", "truncated or padded"))
    bad.append((c.node_id, good, "does not open"))  # right bytes, claimed from another sender
    bad.append((a.node_id, out[a.node_id][c.node_id], "does not open"))  # addressed to c, not b
    bad.append(("gf1-stranger", good, "not in the roster"))
    bad.append((b.node_id, out[a.node_id][b.node_id], "itself"))
    for sender, data, msg in bad:
        with pytest.raises(SecAggError, match=msg) as info:
            b.receive({sender: data})
        assert "\n" not in str(info.value)
    with pytest.raises(SecAggError, match="not bytes"):
        b.receive({a.node_id: bytearray(good)})  # type: ignore[dict-item]
    # all or nothing: a good entry beside a bad one is not stored either
    with pytest.raises(SecAggError):
        b.receive({a.node_id: good, c.node_id: good})
    with pytest.raises(SecAggError, match="no shares received from survivor"):
        b.mask(np.zeros(3, dtype=np.uint32), [a.node_id, b.node_id, c.node_id])
    # nothing was kept from the failures: the genuine ones open
    b.receive({a.node_id: good})
    b.receive({a.node_id: good})  # the same again is harmless
    b.receive({c.node_id: out[c.node_id][b.node_id]})


def test_a_second_different_share_from_one_sender_is_refused() -> None:
    clients, roster, t = three(seed_base=70)
    a, b = clients[:2]
    b.shares_for(roster, t)
    b.receive({a.node_id: a.shares_for(roster, t)[b.node_id]})
    # a twin of a: the same keys (first three draws), other polynomial coefficients and nonce
    keys = seeded(70)
    draws = iter(range(3))
    twin = SecAggClient(a.node_id, JOB, ROUND, rng_bytes=lambda k: keys(k) if next(draws, None) is not None else random.randbytes(k))
    assert twin.entry == a.entry
    with pytest.raises(SecAggError, match="already sent other shares"):
        b.receive({a.node_id: twin.shares_for(roster, t)[b.node_id]})


def test_ciphertexts_from_another_job_or_round_are_refused() -> None:
    """Same keys (same rng stream), other binding: only the job/round binding can reject it."""
    ids = node_ids(3)
    base = {x: SecAggClient(x, JOB, ROUND, rng_bytes=seeded(i)) for i, x in enumerate(ids)}
    roster = [c.entry for c in base.values()]
    for job, rnd in (("job-other", ROUND), (JOB, ROUND + 1)):
        twin = SecAggClient(ids[0], job, rnd, rng_bytes=seeded(0))
        assert twin.entry == base[ids[0]].entry
        ct = twin.shares_for(roster, 2)[ids[1]]
        receiver = SecAggClient(ids[1], JOB, ROUND, rng_bytes=seeded(1))
        receiver.shares_for(roster, 2)
        with pytest.raises(SecAggError, match="does not open"):
            receiver.receive({ids[0]: ct})
        assert len(ct) == CIPHERTEXT_BYTES


def test_mask_and_unmask_refusals() -> None:
    clients, roster, t = three()
    ids = [c.node_id for c in clients]
    out = {c.node_id: c.shares_for(roster, t) for c in clients}
    me = clients[0]
    q = np.arange(8, dtype=np.uint32)
    with pytest.raises(SecAggError, match="before mask"):
        me.unmask_shares(ids, [])
    me.receive({s: out[s][me.node_id] for s in ids[1:4]})
    with pytest.raises(SecAggError, match=r"no shares received from survivor\(s\) '"):
        me.mask(q, ids)
    with pytest.raises(SecAggError, match="include this client"):
        me.mask(q, ids[1:4])
    with pytest.raises(SecAggError, match="outside"):
        me.mask(q, [*ids[:3], "gf1-stranger"])
    with pytest.raises(SecAggError, match="uint32"):
        me.mask(q.astype(np.int64), ids[:4])
    u2 = ids[:4]
    y = me.mask(q, u2)
    assert y.dtype == np.uint32 and y.shape == q.shape
    with pytest.raises(SecAggError, match="already called"):
        me.mask(q, u2)
    with pytest.raises(SecAggError, match="too late"):
        me.receive({ids[4]: out[ids[4]][me.node_id]})
    with pytest.raises(SecAggError, match="both alive and dropped"):
        me.unmask_shares(u2, [u2[1]])
    with pytest.raises(SecAggError, match="fewer than the threshold"):
        me.unmask_shares(u2[:2], u2[2:])
    with pytest.raises(SecAggError, match="not listed alive"):
        me.unmask_shares(u2[1:], [u2[0]])
    with pytest.raises(SecAggError, match="not among the survivors"):
        me.unmask_shares(u2, [ids[4]])
    with pytest.raises(SecAggError, match="neither alive nor dropped"):
        me.unmask_shares(u2[:3], [])
    with pytest.raises(SecAggError, match="more than once"):
        me.unmask_shares([*u2, u2[0]], [])
    answer = me.unmask_shares(u2, [])
    assert {k for k, _ in answer.values()} == {"b"} and set(answer) == set(u2)
    assert me.unmask_shares(list(reversed(u2)), []) == answer
    # having answered 'b' for everyone, it will not now give an 's' for any of them
    with pytest.raises(SecAggError, match="another unmask request"):
        me.unmask_shares([u2[0], *u2[2:]], [u2[1]])


def test_refusals_before_the_roster_and_on_bad_inputs() -> None:
    c = SecAggClient("gf1-a", JOB, ROUND)
    with pytest.raises(SecAggError, match="before shares_for"):
        c.receive({})
    with pytest.raises(SecAggError, match="before shares_for"):
        c.mask(np.zeros(2, dtype=np.uint32), ["gf1-a"])
    for bad_id in ("", 3):
        with pytest.raises(SecAggError):
            SecAggClient(bad_id, JOB, ROUND)  # type: ignore[arg-type]
    with pytest.raises(SecAggError, match="round"):
        SecAggClient("gf1-a", JOB, -1)
    with pytest.raises(SecAggError, match="did not return"):
        SecAggClient("gf1-a", JOB, ROUND, rng_bytes=lambda k: b"x")


def test_server_input_refusals() -> None:
    clients, roster, t = three()
    server = SecAggServer(JOB, ROUND, roster, t, 6)
    a = clients[0].node_id
    good = np.zeros(6, dtype=np.uint32)
    for vec in (np.zeros(5, dtype=np.uint32), np.zeros(6, dtype=np.int32), np.zeros((6, 1), dtype=np.uint32)):
        with pytest.raises(SecAggError, match="length 6"):
            server.add_masked(a, vec)
    with pytest.raises(SecAggError, match="not in the roster"):
        server.add_masked("gf1-stranger", good)
    server.add_masked(a, good)
    with pytest.raises(SecAggError, match="second masked vector"):
        server.add_masked(a, good)
    for answer in (
        {a: ("b", bytes(S_SHARE_BYTES))},
        {a: ("s", bytes(B_SHARE_BYTES))},
        {a: ("x", bytes(S_SHARE_BYTES))},
        {a: ("s", b"\xff" * S_SHARE_BYTES)},  # not a field element
        {"gf1-stranger": ("s", bytes(S_SHARE_BYTES))},
        {a: "s"},
    ):
        with pytest.raises(SecAggError):
            server.add_unmask(a, answer)  # type: ignore[arg-type]
    server.add_unmask(a, {a: ("s", bytes(S_SHARE_BYTES))})
    with pytest.raises(SecAggError, match="second unmask answer"):
        server.add_unmask(a, {})
    ids = [c.node_id for c in clients]
    with pytest.raises(SecAggError, match="no masked vector"):
        server.result(ids, ids[:3])
    with pytest.raises(SecAggError, match="outside"):
        server.result(ids[:3], ids[1:4])


# --------------------------------------------------------------------------- altered shares


def altered(share: tuple[str, bytes], *, commit: bool = False) -> tuple[str, bytes]:
    kind, raw = share
    if commit:
        return kind, raw[:66] + bytes(b ^ 0xFF for b in raw[66:])
    y = (int.from_bytes(raw[:66], "big") + 1) % PRIME
    return kind, y.to_bytes(66, "big") + raw[66:]


def replay(rnd: Round, holders: Sequence[str], tamper: Callable[[str, dict[str, tuple[str, bytes]]], None]) -> SecAggServer:
    server = SecAggServer(JOB, ROUND, rnd.roster, rnd.t, 257)
    for node in rnd.u3:
        server.add_masked(node, rnd.masked[node])
    for holder in holders:
        answer = dict(rnd.answers[holder])
        tamper(holder, answer)
        server.add_unmask(holder, answer)
    return server


def test_an_altered_b_share_among_more_than_t_is_found_and_named() -> None:
    rnd = run_round(5)
    victim, liar = rnd.u3[1], rnd.u3[3]

    def tamper(holder: str, answer: dict[str, tuple[str, bytes]]) -> None:
        if holder == liar:
            answer[victim] = altered(answer[victim])

    server = replay(rnd, sorted(rnd.answers), tamper)
    with pytest.raises(SecAggError, match=rf"do not lie on one polynomial \(the share from '{liar}' disagrees\)"):
        server.result(rnd.u2, rnd.u3)


def test_an_altered_b_share_among_exactly_t_fails_the_commitment() -> None:
    rnd = run_round(5)
    holders = sorted(rnd.answers)[: rnd.t]
    victim, liar = rnd.u3[0], holders[1]

    def tamper(holder: str, answer: dict[str, tuple[str, bytes]]) -> None:
        if holder == liar:
            answer[victim] = altered(answer[victim])

    with pytest.raises(SecAggError, match=r"does not match its commitment|no valid secret"):
        replay(rnd, holders, tamper).result(rnd.u2, rnd.u3)

    def tamper_commit(holder: str, answer: dict[str, tuple[str, bytes]]) -> None:
        if holder == liar:
            answer[victim] = altered(answer[victim], commit=True)

    with pytest.raises(SecAggError, match="disagree on the commitment"):
        replay(rnd, holders, tamper_commit).result(rnd.u2, rnd.u3)


def test_an_altered_s_share_fails_the_public_key_or_the_polynomial() -> None:
    rnd = run_round(10, dropped_after=[2, 6])
    gone = next(x for x in rnd.u2 if x not in rnd.u3)
    liar = sorted(rnd.answers)[0]

    def tamper(holder: str, answer: dict[str, tuple[str, bytes]]) -> None:
        if holder == liar:
            answer[gone] = altered(answer[gone])

    exactly_t = sorted(rnd.answers)[: rnd.t]
    with pytest.raises(SecAggError, match=r"does not match its public key|no valid secret"):
        replay(rnd, exactly_t, tamper).result(rnd.u2, rnd.u3)
    with pytest.raises(SecAggError, match="do not lie on one polynomial"):
        replay(rnd, sorted(rnd.answers), tamper).result(rnd.u2, rnd.u3)


def test_an_answer_with_the_wrong_kind_of_share_is_refused() -> None:
    rnd = run_round(5, dropped_after=[0])
    gone = next(x for x in rnd.u2 if x not in rnd.u3)
    alive = rnd.u3[0]
    liar = sorted(rnd.answers)[0]

    def tamper(holder: str, answer: dict[str, tuple[str, bytes]]) -> None:
        if holder == liar:
            answer[alive] = ("s", bytes(S_SHARE_BYTES))

    with pytest.raises(SecAggError, match="which is alive: refused"):
        replay(rnd, sorted(rnd.answers), tamper).result(rnd.u2, rnd.u3)
    # an honest server run of the same round still works
    assert rnd.server is not None
    np.testing.assert_array_equal(rnd.server.result(rnd.u2, rnd.u3), rnd.expected())
    assert gone not in rnd.u3


# --------------------------------------------------------------------------- quantization


def test_quantize_range_unbiased_and_the_wrap_limit() -> None:
    gen = np.random.default_rng(1)
    q = quantize(np.array([-5.0, -1.0, 0.0, 1.0, 7.0]), 1.0, 8, gen)
    assert q.dtype == np.uint32
    assert q[0] == q[1] == 0 and q[3] == q[4] == 255
    many = quantize(np.full(200_000, 0.3), 1.0, 4, gen)
    mean = float(np.mean(dequantize_sum(many, 1, 1.0, 4)))
    assert abs(mean - 0.3) < 0.005
    assert max_clients(16) == 65537 and max_clients(31) == 2 and max_clients(1) == MODULUS - 1
    total = np.zeros(3, dtype=np.uint32)
    dequantize_sum(total, 65537, 1.0, 16)
    with pytest.raises(SecAggError, match="at most 65537"):
        dequantize_sum(total, 65538, 1.0, 16)
    for bits in (0, 32):
        with pytest.raises(SecAggError, match="bits"):
            quantize(np.zeros(2), 1.0, bits, gen)
    with pytest.raises(SecAggError, match="finite"):
        quantize(np.array([np.nan]), 1.0, 8, gen)
    with pytest.raises(SecAggError, match="clip"):
        quantize(np.zeros(2), 0.0, 8, gen)


finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    values=hnp.arrays(np.float64, st.integers(1, 40), elements=finite),
    clip=st.floats(min_value=1e-300, max_value=1e300),
    bits=st.integers(1, 31),
    seed=st.integers(0, 2**32 - 1),
)
def test_quantize_round_trip_is_within_one_step(values: np.ndarray, clip: float, bits: int, seed: int) -> None:
    q = quantize(values, clip, bits, np.random.default_rng(seed))
    assert q.dtype == np.uint32 and q.shape == values.shape
    assert int(q.max()) <= (1 << bits) - 1
    back = dequantize_sum(q, 1, clip, bits)
    step = 2 * clip / ((1 << bits) - 1)
    err = np.abs(back - np.clip(values, -clip, clip))
    assert np.all(err <= step * (1 + 1e-9) + 8 * np.finfo(np.float64).eps * clip)


# --------------------------------------------------------------------------- fuzz


_FUZZ_CLIENTS, _FUZZ_ROSTER, _FUZZ_T = three(seed_base=500)
_FUZZ_ME = _FUZZ_CLIENTS[0]
_FUZZ_ME.shares_for(_FUZZ_ROSTER, _FUZZ_T)
_SENDERS = [c.node_id for c in _FUZZ_CLIENTS]


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    inbox=st.dictionaries(
        st.one_of(st.sampled_from(_SENDERS), st.text(max_size=12)),
        st.one_of(
            st.binary(max_size=400),
            st.binary(min_size=CIPHERTEXT_BYTES, max_size=CIPHERTEXT_BYTES),
            st.integers(),
            st.none(),
            st.text(max_size=8),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_receive_on_arbitrary_input_raises_secagg_error_only(inbox: dict[str, object]) -> None:
    with pytest.raises(SecAggError):
        _FUZZ_ME.receive(inbox)  # type: ignore[arg-type]
