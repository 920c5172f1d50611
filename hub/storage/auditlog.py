"""Tamper-evident audit trail: an append-only, hash-chained, signed JSONL file.

Each line is one entry, canonical JSON (sorted keys, no spaces, ASCII)::

    {"seq": 0, "time": 1700000000.123, "kind": "aggregation", "body": {...},
     "prev": "<hash of entry seq-1, or 64 zeros>", "hash": "<sha256 hex>", "sig": "<hex>"}

- ``hash`` = sha256 over the canonical JSON of ``{seq, time, kind, body, prev}``.
- ``sig`` = the hub key's Ed25519 signature (``gpuflex.protocol.signing``, domain
  kind ``"audit"``) over the 32 raw bytes of that hash.
- Every append is written with one ``write`` on an ``O_APPEND`` descriptor and
  ``fsync``'d before ``append`` returns.

``verify_log`` needs only the lines and the hub's public key. Editing, deleting,
inserting or reordering entries breaks ``seq``, ``prev``, ``hash`` or ``sig`` at
the first affected entry, which is reported as ``bad_index`` with a one-line
``problem``. What the chain alone cannot show is that entries were cut off the
END of the file (the shorter file is a valid log): compare ``LogCheck.head`` /
``entries`` with a head hash you saw earlier (``verify_log(..., expected_head=)``).

Crash behaviour (kill -9 mid-append). The only possible damage is a torn last
line (no trailing newline, not parseable). ``verify_log`` reports it as a
truncated tail (``truncated=True``, ``bad_index`` = that line). ``AuditLog`` on
open REPAIRS exactly that case: it cuts the torn bytes, fsyncs, and appends a
``log_repaired`` entry recording how many bytes were dropped, so the repair is
itself on the record. A complete last entry that only lacks its newline gets the
newline added. Any other problem (a bad entry before the end) makes ``AuditLog``
refuse to open with `AuditLogError`: appending after a corrupt middle would bury
the evidence; an operator must move the file aside.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.signing import SigningKey, verify

from ..base.errors import HubError

__all__ = [
    "GENESIS",
    "SIGNATURE_KIND",
    "AuditLog",
    "AuditLogError",
    "LogCheck",
    "aggregation_body",
    "entry_hash",
    "verdict_body",
    "verify_file",
    "verify_log",
]

SIGNATURE_KIND = "audit"
GENESIS = "0" * 64
ENTRY_KEYS = frozenset({"seq", "time", "kind", "body", "prev", "hash", "sig"})
_KIND_RE = re.compile(r"^[a-z][a-z0-9_.]{0,63}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
MAX_LINE_BYTES = 4 << 20


class AuditLogError(HubError):
    """The audit log cannot be opened or appended to (one actionable line)."""

    status = 500
    code = "audit_log"


@dataclass(frozen=True)
class LogCheck:
    """Outcome of ``verify_log``.

    ``ok``: every line verified. ``entries``: entries that verified before the
    first problem (all of them when ok). ``bad_index``: 0-based index of the first
    problem's line (None when ok); ``line`` is the same as the 1-based line number that
    editors and ``sed -n Np`` use, and that every message says. ``problem``: one line ("" when ok). ``truncated``: the
    problem is a torn final line (crash mid-append), not tampering. ``head``: hash
    of the last good entry (GENESIS for an empty log).
    """

    ok: bool
    entries: int
    bad_index: int | None
    problem: str
    truncated: bool = False
    head: str = GENESIS

    @property
    def line(self) -> int | None:
        """The 1-based line number of the first problem (None when ok)."""
        return None if self.bad_index is None else self.bad_index + 1


def _canonical(obj: Any) -> bytes:
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def entry_hash(seq: int, time_: float, kind: str, body: Any, prev: str) -> str:
    """sha256 hex over the canonical JSON of the hashed fields."""
    return hashlib.sha256(
        _canonical({"seq": seq, "time": time_, "kind": kind, "body": body, "prev": prev})
    ).hexdigest()


def _check_entry(obj: Any, index: int, prev: str, public_key: bytes) -> str | None:
    """The one-line problem with entry ``index`` (None when it verifies)."""
    if not isinstance(obj, dict):
        return "entry is not a JSON object"
    keys = set(obj)
    if keys != ENTRY_KEYS:
        return f"entry fields {sorted(keys)} != {sorted(ENTRY_KEYS)}"
    seq, t, kind, body, p, h, sig = (
        obj["seq"], obj["time"], obj["kind"], obj["body"], obj["prev"], obj["hash"], obj["sig"]
    )  # fmt: skip
    if not isinstance(seq, int) or isinstance(seq, bool):
        return "seq is not an integer"
    if seq != index:
        return f"seq {seq} where seq {index} belongs: an entry was deleted, inserted or moved here"
    if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t):
        return "time is not a finite number"
    if not isinstance(kind, str) or not _KIND_RE.match(kind):
        return "kind is not a valid entry kind"
    if not isinstance(p, str) or p != prev:
        return "prev does not match the previous entry's hash: the chain is broken here"
    if not isinstance(h, str) or not _HEX64.match(h):
        return "hash is not 64 lowercase hex"
    try:
        recomputed = entry_hash(seq, t, kind, body, p)
    except ValueError:
        return "body holds a non-finite number"
    if recomputed != h:
        return "hash does not match the entry's content: the entry was edited"
    if not isinstance(sig, str):
        return "sig is not a hex string"
    try:
        sig_bytes = bytes.fromhex(sig)
        verify(public_key, SIGNATURE_KIND, bytes.fromhex(h), sig_bytes)
    except (ValueError, ProtocolError):
        return "signature does not verify with the hub key: forged or re-signed entry"
    return None


def _split_line(raw: bytes | str) -> tuple[bytes, bool]:
    """(content, had_newline) of one line as produced by file iteration."""
    line = raw.encode("utf-8") if isinstance(raw, str) else bytes(raw)
    if line.endswith(b"\n"):
        return line[:-1], True
    return line, False


def _with_last(items: Iterable[bytes | str]) -> Iterator[tuple[bytes | str, bool]]:
    it = iter(items)
    try:
        current = next(it)
    except StopIteration:
        return
    for nxt in it:
        yield current, False
        current = nxt
    yield current, True


def verify_log(
    lines: Iterable[bytes | str],
    hub_public_key: bytes,
    *,
    expected_head: str | None = None,
) -> LogCheck:
    """Check chain and signatures of an audit log, offline.

    ``lines`` as read from the file (``open(path, "rb")`` iterates them; the
    newline may be present or not). Stops at the first problem and locates it.
    ``expected_head``: a head hash seen earlier; the log must contain it (detects
    entries cut off the end up to that point).
    """
    prev = GENESIS
    count = 0
    seen_head = expected_head is None or expected_head == GENESIS
    for index, (raw, is_last) in enumerate(_with_last(lines)):
        content, had_newline = _split_line(raw)
        try:
            if len(content) > MAX_LINE_BYTES:
                raise ValueError("line too long")
            obj = json.loads(content)
        except (ValueError, UnicodeDecodeError):
            if is_last and not had_newline:
                return LogCheck(
                    False,
                    count,
                    index,
                    f"line {index + 1}: truncated tail - the last line is incomplete "
                    f"({len(content)} bytes, no newline): a write was cut off (crash?)",
                    truncated=True,
                    head=prev,
                )
            return LogCheck(False, count, index, f"line {index + 1}: not valid JSON", head=prev)
        problem = _check_entry(obj, index, prev, hub_public_key)
        if problem is None and _canonical(obj) != content:
            problem = "line is not in canonical form (bytes edited outside the hashed fields)"
        if problem is not None:
            return LogCheck(False, count, index, f"line {index + 1}: {problem}", head=prev)
        prev = obj["hash"]
        count += 1
        if prev == expected_head:
            seen_head = True
    if not seen_head:
        return LogCheck(
            False,
            count,
            count,
            f"line {count + 1}: log ends before the expected head {expected_head}: entries were removed from the end",
            head=prev,
        )
    return LogCheck(True, count, None, "", head=prev)


def verify_file(path: str | os.PathLike[str], hub_public_key: bytes) -> LogCheck:
    """``verify_log`` over a file on disk."""
    with open(path, "rb") as fh:
        return verify_log(fh, hub_public_key)


class AuditLog:
    """Append-only writer for one audit log file (thread-safe).

    Opening verifies the whole existing file with the key's public half, repairs a
    torn last line (see module docstring) and refuses anything else.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        signing_key: SigningKey,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path)
        self._key = signing_key
        self._clock = clock
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        repaired = self._open_and_check()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        if repaired is not None:
            self.append("log_repaired", repaired)

    def _open_and_check(self) -> dict[str, Any] | None:
        """Verify the file, repair a torn tail; return the repair record if any."""
        self._seq, self._head = 0, GENESIS
        if not self.path.exists():
            return None
        with open(self.path, "rb") as fh:
            data = fh.read()
        lines = data.splitlines(keepends=True)
        check = verify_log(lines, self._key.public_bytes)
        if check.ok:
            if data and not data.endswith(b"\n"):  # complete last entry, newline lost
                self._write_raw(b"\n")
            self._seq, self._head = check.entries, check.head
            return None
        if not check.truncated:
            raise AuditLogError(
                f"audit log {self.path} is corrupt ({check.problem}); refusing to append - "
                "move it aside and keep it as evidence"
            )
        good = sum(len(line) for line in lines[: check.entries])
        dropped = len(data) - good
        with open(self.path, "r+b") as fh:
            fh.truncate(good)
            fh.flush()
            os.fsync(fh.fileno())
        self._seq, self._head = check.entries, check.head
        return {"dropped_bytes": dropped, "after_seq": check.entries - 1, "reason": check.problem}

    def _write_raw(self, data: bytes) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    @property
    def head(self) -> str:
        """Hash of the last entry (GENESIS when empty): publish it to pin the log's end."""
        return self._head

    @property
    def entries(self) -> int:
        return self._seq

    def append(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        """Append one entry durably (fsync) and return it as written.

        ``body`` must be JSON data (str keys, finite floats); it is stored in its
        canonical JSON form (tuples become lists).
        """
        if not isinstance(kind, str) or not _KIND_RE.match(kind):
            raise AuditLogError(f"audit entry kind {kind!r} must match {_KIND_RE.pattern}")
        if not isinstance(body, dict):
            raise AuditLogError("audit entry body must be a JSON object (dict)")
        try:
            norm_body = json.loads(_canonical(body))
        except (TypeError, ValueError) as exc:
            raise AuditLogError(f"audit entry body is not plain JSON data: {exc}") from None
        with self._lock:
            if self._fd < 0:
                raise AuditLogError("audit log is closed")
            t = float(self._clock())
            seq, prev = self._seq, self._head
            h = entry_hash(seq, t, kind, norm_body, prev)
            sig = self._key.sign(SIGNATURE_KIND, bytes.fromhex(h)).hex()
            entry = {
                "seq": seq,
                "time": t,
                "kind": kind,
                "body": norm_body,
                "prev": prev,
                "hash": h,
                "sig": sig,
            }
            line = _canonical(entry) + b"\n"
            if len(line) > MAX_LINE_BYTES:
                raise AuditLogError(f"audit entry is {len(line)} bytes, limit {MAX_LINE_BYTES}")
            written = os.write(self._fd, line)
            if written != len(line):  # a regular file only short-writes when the disk is full
                raise AuditLogError(
                    f"short write to {self.path} ({written} of {len(line)} bytes): disk full?"
                )
            os.fsync(self._fd)
            self._seq, self._head = seq + 1, h
            return entry

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------ entry bodies (conventions)


def aggregation_body(
    *,
    job_id: str,
    round: int,
    model_hash: str,
    method: str,
    included: Iterable[str],
    excluded: Iterable[tuple[str, str]],
    **extra: Any,
) -> dict[str, Any]:
    """Body of an ``aggregation`` entry: the new model's hash, the update hashes
    that went in (in aggregation order) and those left out with their reason."""
    return {
        "job_id": job_id,
        "round": round,
        "model_hash": model_hash,
        "method": method,
        "included": list(included),
        "excluded": [{"update": u, "reason": r} for u, r in excluded],
        **extra,
    }


def verdict_body(
    *,
    flag_id: str,
    node_id: str,
    update: str,
    reason: str,
    verdict: str,
    auditor: str,
    note: str = "",
    **extra: Any,
) -> dict[str, Any]:
    """Body of a ``verdict`` entry: who decided what about which flag."""
    return {
        "flag_id": flag_id,
        "node_id": node_id,
        "update": update,
        "reason": reason,
        "verdict": verdict,
        "auditor": auditor,
        "note": note,
        **extra,
    }
