"""Audit log: chain, signatures, tamper detection located, crash-torn tails."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from gpuflex.hub.storage.auditlog import (
    GENESIS,
    AuditLog,
    AuditLogError,
    aggregation_body,
    entry_hash,
    verdict_body,
    verify_file,
    verify_log,
)
from gpuflex.protocol.signing import SigningKey

KEY = SigningKey.from_seed(bytes(range(32)))
OTHER = SigningKey.from_seed(bytes(range(1, 33)))
PK = KEY.public_bytes


@pytest.fixture
def log_lines(tmp_path):
    path = tmp_path / "audit.jsonl"
    clock = iter(range(1_700_000_000, 1_700_000_100))
    with AuditLog(path, KEY, clock=lambda: float(next(clock)) + 0.25) as log:
        for r in range(4):
            log.append(
                "aggregation",
                aggregation_body(
                    job_id="job-1",
                    round=r,
                    model_hash=f"{r:064x}",
                    method="fedavg",
                    included=["a" * 64, "b" * 64],
                    excluded=[("c" * 64, "outlier")],
                    loss=0.5 / (r + 1),
                ),
            )
        log.append(
            "verdict",
            verdict_body(
                flag_id="f-1",
                node_id="gf1-x",
                update="c" * 64,
                reason="outlier",
                verdict="confirm",
                auditor="ann",
            ),
        )
    return path, path.read_bytes().splitlines(keepends=True)


def test_a_clean_log_verifies_and_entries_have_the_documented_shape(log_lines):
    path, lines = log_lines
    check = verify_file(path, PK)
    assert check.ok and check.entries == 5 and check.bad_index is None and check.problem == ""
    entries = [json.loads(x) for x in lines]
    assert [e["seq"] for e in entries] == [0, 1, 2, 3, 4]
    assert set(entries[0]) == {"seq", "time", "kind", "body", "prev", "hash", "sig"}
    assert entries[0]["prev"] == GENESIS and entries[1]["prev"] == entries[0]["hash"]
    e = entries[2]
    assert e["hash"] == entry_hash(e["seq"], e["time"], e["kind"], e["body"], e["prev"])
    assert e["body"]["excluded"] == [{"update": "c" * 64, "reason": "outlier"}]
    assert check.head == entries[-1]["hash"]
    assert verify_log(lines, OTHER.public_bytes).bad_index == 0  # another hub's key


def _edit(line: bytes, fn) -> bytes:
    obj = json.loads(line)
    fn(obj)
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def _rehash(obj):
    obj["hash"] = entry_hash(obj["seq"], obj["time"], obj["kind"], obj["body"], obj["prev"])


@pytest.mark.parametrize(
    ("name", "mutate", "bad_index", "words"),
    [
        (
            "edit body",
            lambda L: [*L[:2], _edit(L[2], lambda o: o["body"].update(loss=0.0)), *L[3:]],
            2,
            "edited",
        ),
        (
            "edit time",
            lambda L: [*L[:1], _edit(L[1], lambda o: o.update(time=o["time"] + 1)), *L[2:]],
            1,
            "edited",
        ),
        (
            "edit and re-hash",
            lambda L: (
                [
                    *L[:3],
                    _edit(L[3], lambda o: (o["body"].update(method="median"), _rehash(o))),
                    *L[4:],
                ]
            ),
            3,
            "signature",
        ),
        ("delete middle", lambda L: L[:1] + L[2:], 1, "deleted, inserted or moved"),
        ("delete first", lambda L: L[1:], 0, "deleted, inserted or moved"),
        ("insert copy", lambda L: [*L[:3], L[1], *L[3:]], 3, "deleted, inserted or moved"),
        ("reorder", lambda L: [L[0], L[2], L[1], *L[3:]], 1, "deleted, inserted or moved"),
        (
            "forged signature",
            lambda L: (
                [
                    *L[:4],
                    _edit(
                        L[4],
                        lambda o: o.update(sig=OTHER.sign("audit", bytes.fromhex(o["hash"])).hex()),
                    ),
                ]
            ),
            4,
            "signature",
        ),
        (
            "whitespace",
            lambda L: [*L[:2], L[2].replace(b'"seq"', b' "seq"'), *L[3:]],
            2,
            "canonical",
        ),
        ("garbage", lambda L: [*L[:2], b"not json\n", *L[3:]], 2, "not valid JSON"),
    ],
)
def test_tampering_is_detected_and_located(log_lines, name, mutate, bad_index, words):
    _, lines = log_lines
    check = verify_log(mutate(list(lines)), PK)
    assert not check.ok and not check.truncated, name
    assert check.bad_index == bad_index, (name, check.problem)
    assert words in check.problem and check.problem.startswith(f"line {bad_index + 1}:") and check.line == bad_index + 1
    assert "\n" not in check.problem
    assert check.entries == bad_index


def test_truncated_tail_is_reported_as_such(log_lines):
    _, lines = log_lines
    check = verify_log([*lines[:4], lines[4][:57]], PK)
    assert not check.ok and check.truncated and check.bad_index == 4 and check.entries == 4
    assert "truncated tail" in check.problem


def test_entries_cut_off_the_end_need_a_known_head(log_lines):
    _, lines = log_lines
    head = json.loads(lines[-1])["hash"]
    assert verify_log(lines[:3], PK).ok  # the chain alone cannot see it ...
    check = verify_log(lines[:3], PK, expected_head=head)  # ... a pinned head can
    assert not check.ok and check.bad_index == 3 and "removed from the end" in check.problem
    assert verify_log(lines, PK, expected_head=head).ok


def test_reopen_continues_the_chain(log_lines):
    path, _ = log_lines
    with AuditLog(path, KEY) as log:
        assert log.entries == 5
        entry = log.append("note", {"text": "restarted"})
        assert entry["seq"] == 5
    assert verify_file(path, PK).entries == 6


def test_open_repairs_a_torn_tail_and_records_it(log_lines):
    path, lines = log_lines
    path.write_bytes(b"".join(lines) + lines[0][:40])  # a kill -9 mid-write
    with AuditLog(path, KEY) as log:
        assert log.entries == 6
    check = verify_file(path, PK)
    assert check.ok and check.entries == 6
    last = json.loads(path.read_bytes().splitlines()[-1])
    assert last["kind"] == "log_repaired" and last["body"]["dropped_bytes"] == 40


def test_open_adds_a_lost_final_newline(log_lines):
    path, lines = log_lines
    path.write_bytes(b"".join(lines)[:-1])
    with AuditLog(path, KEY) as log:
        log.append("note", {})
    assert verify_file(path, PK).entries == 6


def test_open_refuses_a_corrupt_middle(log_lines):
    path, lines = log_lines
    path.write_bytes(b"".join([lines[0], lines[2], *lines[3:]]))
    with pytest.raises(AuditLogError, match="line 2: seq 2 where seq 1 belongs"):
        AuditLog(path, KEY)
    other_hub = path.with_name("other.jsonl")
    other_hub.write_bytes(b"".join(lines))
    with pytest.raises(AuditLogError, match="signature"):
        AuditLog(other_hub, OTHER)  # a log written under another key


def test_bad_entries_are_refused(tmp_path):
    with AuditLog(tmp_path / "a.jsonl", KEY) as log:
        with pytest.raises(AuditLogError, match="kind"):
            log.append("Bad Kind", {})
        with pytest.raises(AuditLogError, match="plain JSON"):
            log.append("note", {"x": float("nan")})
        with pytest.raises(AuditLogError, match="plain JSON"):
            log.append("note", {"x": object()})
        e = log.append("note", {"t": (1, 2)})
        assert e["body"] == {"t": [1, 2]}
    assert verify_file(tmp_path / "a.jsonl", PK).ok


WRITER = """
import sys
from gpuflex.hub.storage.auditlog import AuditLog
from gpuflex.protocol.signing import SigningKey
log = AuditLog(sys.argv[1], SigningKey.from_seed(bytes(range(32))))
print("ready", flush=True)
i = 0
while True:
    log.append("note", {"i": i, "pad": "x" * 2000})
    i += 1
"""


def test_survives_kill_9_mid_append(tmp_path):
    path = tmp_path / "audit.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (not path.exists() or path.stat().st_size < 6_000):
            time.sleep(0.02)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    check = verify_file(path, PK)
    assert check.ok or check.truncated, check.problem
    with AuditLog(path, KEY) as log:
        n = log.entries
        log.append("note", {"after": "crash"})
    final = verify_file(path, PK)
    assert final.ok and final.entries == n + 1 >= 2
