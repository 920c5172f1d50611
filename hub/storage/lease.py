"""The lease on a PostgreSQL database: one leading hub process per database.

Why: the hub keeps its round state in memory beside the store (hub/domain/ledger/). Two hubs on one
PostgreSQL database, on two machines or as two workers of `serve --workers N`, would each
believe their own memory: both would close the same round, hand out the same chunks, and
contradict each other's acknowledged writes. The data folder's flock (hub/storage/datalock.py) cannot
see a hub on another machine; the database can.

The lease is a session-level advisory lock (``pg_try_advisory_lock``) held on a connection of
its own. PostgreSQL drops it when that connection ends, kill -9 of the hub included, so a
crashed leader never leaves a stale lease behind: the next worker in line takes it within
``POLL_S``. A leader that can no longer reach the server cannot know whether it still holds the
lease, so the watch (``watch``) ends the process at once (fencing: better a restart than two
leaders). Advisory locks are per database: two hubs on two databases of one server do not meet.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ..base.errors import Conflict
from .store_postgres import StoreUnavailable, redact

log = logging.getLogger("gpuflex.hub.lease")

#: the advisory lock's key ("gpuflexL" in ASCII); the schema migration uses another one
LEASE_KEY = 0x677075666C65784C
#: how often a waiting worker asks for the lease, and how often the leader checks it still holds it
POLL_S = 0.5
WATCH_S = 1.0


class DatabaseBusy(Conflict):
    """Another hub process leads this PostgreSQL database."""

    code = "database_busy"


class Lease:
    """The lease on the database ``url`` names, for this process (``who`` says which, to others)."""

    def __init__(self, url: str, who: str) -> None:
        self.url = url
        self.who = f"{who} (pid {os.getpid()} on {socket.gethostname()})"[:60]
        self._conn: psycopg.Connection[Any] | None = None
        self._stop = threading.Event()
        self._watch: threading.Thread | None = None

    def _connect(self) -> psycopg.Connection[Any]:
        params: dict[str, Any] = dict(conninfo_to_dict(self.url))
        params.setdefault("connect_timeout", 10)
        params["application_name"] = self.who  # what a refused hub reads in pg_stat_activity
        try:
            return psycopg.connect(autocommit=True, **params)
        except psycopg.Error as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise StoreUnavailable(f"cannot connect to PostgreSQL at {redact(self.url)}: {first}") from None

    def try_acquire(self) -> bool:
        """Take the lease if nobody holds it; True when this process now holds it."""
        if self._conn is None or self._conn.closed:
            self._conn = self._connect()
        row = self._conn.execute("SELECT pg_try_advisory_lock(%s)", (_signed(LEASE_KEY),)).fetchone()
        return bool(row and row[0])

    def acquire(self) -> Lease:
        """Take the lease now, or raise DatabaseBusy naming the hub that holds it."""
        if not self.try_acquire():
            holder = self.holder()
            self.release()
            raise DatabaseBusy(f"the PostgreSQL database {redact(self.url)} is led by another hub"
                               f" ({holder or 'another process'}); stop it first (one hub per database;"
                               " several processes: gpuflex-hub serve --workers N)")
        return self

    def wait(self, stop: threading.Event) -> bool:
        """Block until this process holds the lease (True) or ``stop`` is set (False). Runs in a
        thread: a worker in line waits here while it forwards requests to the leader."""
        while not stop.is_set():
            try:
                if self.try_acquire():
                    return True
            except (psycopg.Error, StoreUnavailable) as exc:  # the server restarts: ask again
                log.warning("waiting for the lease: %s", str(exc).splitlines()[0] if str(exc) else exc)
                self.release()
            stop.wait(POLL_S)
        return False

    def holder(self) -> str:
        """Who holds the lease (its connection's application_name), or ''."""
        try:
            with self._connect() as conn:
                row = conn.execute(
                    "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
                    " WHERE l.locktype = 'advisory' AND l.granted AND l.database ="
                    " (SELECT oid FROM pg_database WHERE datname = current_database())"
                    " AND ((l.classid::bigint << 32) | l.objid::bigint) = %s", (LEASE_KEY & (2**64 - 1),)).fetchone()
        except (psycopg.Error, StoreUnavailable):
            return ""
        return str(row[0]) if row else ""

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Check every WATCH_S that the lease's connection is alive; ``on_lost(reason)`` (in the
        watch thread) when it is not."""
        def run() -> None:
            while not self._stop.wait(WATCH_S):
                conn = self._conn
                if conn is None:  # released
                    return
                try:
                    conn.execute("SELECT 1")
                except Exception as exc:
                    if self._stop.is_set():
                        return
                    on_lost(f"the lease's connection to PostgreSQL failed: {str(exc).splitlines()[0] if str(exc) else exc}")
                    return

        self._watch = threading.Thread(target=run, name="gpuflex-hub-lease", daemon=True)
        self._watch.start()

    def release(self) -> None:
        """Give the lease up. The lock is released by the server before this returns: closing the
        connection alone drops it only once the server has noticed the close, and a hub started
        on the same database right after would be refused until then."""
        self._stop.set()
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.execute("SELECT pg_advisory_unlock_all()")
            except psycopg.Error:
                pass  # a broken connection: the server drops the lock with it
            try:
                conn.close()
            except psycopg.Error:
                pass
        if self._watch is not None and self._watch is not threading.current_thread():
            self._watch.join(timeout=WATCH_S + 1)


def fence(reason: str) -> None:
    """A leader that lost its lease ends at once: another worker may lead already."""
    log.critical("%s: this hub process stops now so that two never lead one database", reason)
    time.sleep(0.05)  # let the log line out
    os._exit(75)


def _signed(key: int) -> int:
    """A 64-bit key as PostgreSQL's signed bigint."""
    return key - 2**64 if key >= 2**63 else key


__all__ = ["LEASE_KEY", "DatabaseBusy", "Lease", "fence"]
