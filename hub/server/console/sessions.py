"""Console sessions: a random id in an HttpOnly cookie, everything else on the server.

The browser only ever holds an opaque 256-bit session id. The store keeps the
SHA-256 of that id (a copy of the database does not yield live cookies), the
principal the login token resolved to, the per-session CSRF token and expiry
times. Sessions persist in their own SQLite file next to the hub's database
(``console.sqlite3`` under the hub's data dir) so a hub restart does not log
everybody out, and the console never competes for the hub database's write lock.

The login token itself is never stored: the store keeps the hub's token id so
the console can re-check on every request that the token still exists
(revoking a token ends its console sessions too).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Session", "SessionStore", "csrf_matches", "new_secret"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS console_sessions (
    sid_hash   TEXT PRIMARY KEY,
    token_id   TEXT NOT NULL,
    role       TEXT NOT NULL,
    name       TEXT NOT NULL,
    csrf       TEXT NOT NULL,
    created_at REAL NOT NULL,
    seen_at    REAL NOT NULL,
    expires_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS console_sessions_expires ON console_sessions(expires_at);
"""


def new_secret() -> str:
    """A 256-bit random, URL-safe string (session ids, CSRF tokens)."""
    return secrets.token_urlsafe(32)


def _hash(sid: str) -> str:
    return hashlib.sha256(sid.encode("utf-8", "surrogatepass")).hexdigest()


def csrf_matches(expected: str, given: str | None) -> bool:
    """Constant-time comparison of a submitted CSRF token with the session's."""
    if not given or not expected:
        return False
    return hmac.compare_digest(expected.encode(), given.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True)
class Session:
    """An authenticated console session (what a request handler sees)."""

    token_id: str
    role: str
    name: str
    csrf: str
    created_at: float
    expires_at: float


class SessionStore:
    """Sessions in SQLite: absolute lifetime ``ttl_s``, idle timeout ``idle_s``."""

    def __init__(
        self,
        path: Path,
        *,
        ttl_s: float = 12 * 3600.0,
        idle_s: float = 2 * 3600.0,
        max_sessions: int = 10_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._ttl = ttl_s
        self._idle = idle_s
        self._max = max_sessions
        self._clock = clock
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def create(self, *, token_id: str, role: str, name: str) -> tuple[str, Session]:
        """A fresh session; returns (cookie value, session). Old ones are pruned."""
        now = self._clock()
        sid = new_secret()
        s = Session(
            token_id=token_id,
            role=role,
            name=name,
            csrf=new_secret(),
            created_at=now,
            expires_at=now + self._ttl,
        )
        with self._lock:
            self._db.execute("DELETE FROM console_sessions WHERE expires_at < ?", (now,))
            # Bounded: past the cap, the least recently seen sessions go first.
            self._db.execute(
                "DELETE FROM console_sessions WHERE sid_hash IN (SELECT sid_hash FROM "
                "console_sessions ORDER BY seen_at DESC LIMIT -1 OFFSET ?)",
                (self._max - 1,),
            )
            self._db.execute(
                "INSERT INTO console_sessions VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (_hash(sid), token_id, role, name, s.csrf, now, now, s.expires_at),
            )
        return sid, s

    def get(self, sid: str | None) -> Session | None:
        """The live session for a cookie value, or None (unknown, expired or idle)."""
        if not sid or len(sid) > 128:
            return None
        now = self._clock()
        h = _hash(sid)
        with self._lock:
            row = self._db.execute(
                "SELECT token_id, role, name, csrf, created_at, seen_at, expires_at "
                "FROM console_sessions WHERE sid_hash = ?",
                (h,),
            ).fetchone()
            if row is None:
                return None
            token_id, role, name, csrf, created, seen, expires = row
            if now >= expires or now - seen > self._idle:
                self._db.execute("DELETE FROM console_sessions WHERE sid_hash = ?", (h,))
                return None
            if now - seen > min(60.0, self._idle / 4):  # not a write per request
                self._db.execute(
                    "UPDATE console_sessions SET seen_at = ? WHERE sid_hash = ?", (now, h)
                )
        return Session(
            token_id=token_id,
            role=role,
            name=name,
            csrf=csrf,
            created_at=created,
            expires_at=expires,
        )

    def delete(self, sid: str | None) -> None:
        if not sid:
            return
        with self._lock:
            self._db.execute("DELETE FROM console_sessions WHERE sid_hash = ?", (_hash(sid),))

    def delete_for_token(self, token_id: str) -> None:
        """End every session opened with this token (after it was revoked)."""
        with self._lock:
            self._db.execute("DELETE FROM console_sessions WHERE token_id = ?", (token_id,))
