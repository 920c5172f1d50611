"""`gpuflex-hub migrate`: move a hub's state from SQLite (its data folder) to PostgreSQL.

What moves: every table of the hub's schema (hub/storage/db.py), tokens included, so owners, auditors,
admins and enrolled operators keep their tokens. What stays in the data folder: the hub's key,
the blobs (models, chunks, updates, checkpoint states), the audit log and the console's
sessions; a hub on PostgreSQL still runs with the same ``--data``.

How, so that nothing is lost:
1. The data folder's lock (hub/storage/datalock.py): a running hub refuses the migration, and no hub
   starts while it runs.
2. The SQLite database is opened as the hub opens it (brought to the current schema); the
   PostgreSQL database gets the same schema (hub/storage/store_postgres.py) and must hold no hub yet:
   an existing one is never merged into or overwritten.
3. Every table is copied with COPY inside ONE PostgreSQL transaction, identity counters moved
   past the copied ids, and committed: a failure half way leaves the target empty.
4. Verified: per table, the row count and an order-free digest of the rows (the sum of each
   row's sha256, as both databases return the values) must be equal on both sides.
5. Only then is ``hub.sqlite3`` renamed ``hub.sqlite3.migrated`` (kept as the backup) and
   ``migrated.json`` written beside it (where to, when, the per-table counts). A hub started on
   that folder without ``--store`` then refuses in one line instead of starting empty.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sqlite3
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..base.errors import HubError
from . import db as sqlite_db
from .datalock import data_lock

MARKER = "migrated.json"
BACKUP_SUFFIX = ".migrated"
_MOD = 1 << 256


class MigrationError(HubError):
    """The migration cannot start or did not verify; nothing was changed on either side."""

    status = 409
    code = "migration_refused"


@dataclass(frozen=True)
class TableCopy:
    table: str
    rows: int
    digest: str


def tables() -> list[str]:
    """The hub's tables, in schema order (hub/storage/db.py's _SCHEMA). These names and the columns
    PRAGMA table_info gives are the only identifiers the statements below are built from
    (never input: hence the S608 exemptions)."""
    return re.findall(r"CREATE TABLE IF NOT EXISTS (\w+)", sqlite_db._SCHEMA)


def _columns(src: sqlite3.Connection, table: str) -> list[str]:
    return [str(r[1]) for r in src.execute(f"PRAGMA table_info({table})")]


def _identity_columns(table_sql: str) -> list[str]:
    return re.findall(r"(\w+) INTEGER PRIMARY KEY\b", table_sql)


def _canon(value: Any) -> Any:
    """One value as both databases' drivers return it, in a JSON-able form."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, float):
        return repr(value)
    return value


def row_digest(rows: Iterable[Sequence[Any]]) -> tuple[int, str]:
    """(count, digest) of ``rows`` in any order: the sum mod 2**256 of each row's sha256 over a
    canonical text of its values (ints, floats by repr, text, bytes as hex, None)."""
    total = 0
    count = 0
    for row in rows:
        canon = json.dumps([_canon(v) for v in row], separators=(",", ":"), ensure_ascii=False)
        total = (total + int.from_bytes(hashlib.sha256(canon.encode()).digest(), "big")) % _MOD
        count += 1
    return count, f"{total:064x}"


def _open_sqlite(path: Path) -> sqlite3.Connection:
    try:
        return sqlite_db.connect(path)
    except (RuntimeError, sqlite3.Error) as exc:
        raise MigrationError(f"cannot open {path}: {' '.join(str(exc).split())}") from None


def migrate(data_dir: Path, url: str, *, progress: Any = None) -> list[TableCopy]:
    """Copy the hub in ``data_dir`` (SQLite) into the PostgreSQL database ``url``; see the module
    docstring. Returns the verified per-table counts. MigrationError / StoreUnavailable (one
    line) when it cannot, with both sides unchanged."""
    from .store_postgres import check_url, connect, redact

    check_url(url)
    source = data_dir / "hub.sqlite3"
    if not source.is_file():
        marker = data_dir / MARKER
        if marker.is_file():
            raise MigrationError(f"{data_dir} was already migrated ({marker.name}: "
                                 f"{json.loads(marker.read_text()).get('to', '?')}); nothing to do")
        raise MigrationError(f"no hub database in {data_dir} (hub.sqlite3); nothing to migrate")
    say = progress or (lambda _line: None)
    with data_lock(data_dir, "gpuflex-hub migrate"):
        src = _open_sqlite(source)
        try:
            target = connect(url)  # creates the schema (or brings it up to date); one-line errors
            try:
                copies = _copy(src, target, say)
            finally:
                target.close()
        finally:
            src.close()
        _retire(source, data_dir, redact(url), copies)
    return copies


def _copy(src: sqlite3.Connection, target: Any, say: Any) -> list[TableCopy]:
    import psycopg  # the postgres extra: a hub on SQLite imports this module without it

    raw = target.raw
    names = tables()
    held = [(t, n) for t in names if (n := int(raw.execute(f"SELECT count(*) FROM {t}").fetchone()[0]))]  # noqa: S608
    raw.rollback()
    if held:
        what = ", ".join(f"{n} {t}" for t, n in held[:4])
        raise MigrationError(f"the PostgreSQL database already holds a hub ({what}); migrate into an empty"
                             " database (nothing was copied)")
    ddl = dict(re.findall(r"CREATE TABLE IF NOT EXISTS (\w+) \((.*?)\n\);", sqlite_db._SCHEMA, re.S))
    copies: list[TableCopy] = []
    try:
        _copy_rows(src, raw, names, ddl, say)
    except psycopg.Error as exc:  # the transaction rolled back: the target is as empty as before
        line = " ".join(str(exc).split()) or type(exc).__name__
        raise MigrationError(f"PostgreSQL refused the copy, nothing was committed: {line}") from None
    for t in names:  # verified from what each side now returns
        cols = ", ".join(_columns(src, t))
        ours = row_digest(tuple(r) for r in src.execute(f"SELECT {cols} FROM {t}"))  # noqa: S608
        with raw.cursor() as cur:
            cur.execute(f"SELECT {cols} FROM {t}")  # noqa: S608
            theirs = row_digest(cur)
        raw.rollback()
        if ours != theirs:
            raise MigrationError(f"table {t} did not verify after the copy (SQLite {ours[0]} rows, PostgreSQL"
                                 f" {theirs[0]}); the SQLite database is untouched, empty the PostgreSQL"
                                 " database before trying again")
        copies.append(TableCopy(t, ours[0], ours[1]))
    return copies


def _copy_rows(src: sqlite3.Connection, raw: Any, names: Sequence[str], ddl: dict[str, str], say: Any) -> None:
    """Every table in one PostgreSQL transaction (COPY), identity counters past the copied ids."""
    with raw.transaction():
        for t in names:
            col_list = ", ".join(_columns(src, t))
            n = 0
            with raw.cursor().copy(f"COPY {t} ({col_list}) FROM STDIN") as cp:
                for row in src.execute(f"SELECT {col_list} FROM {t}"):  # noqa: S608
                    cp.write_row(tuple(row))
                    n += 1
            for col in _identity_columns(ddl.get(t, "")):
                top = raw.execute(f"SELECT coalesce(max({col}), 0) FROM {t}").fetchone()[0]  # noqa: S608
                raw.execute(f"ALTER TABLE {t} ALTER COLUMN {col} RESTART WITH {int(top) + 1}")
            say(f"copied {t}: {n} rows")


def _retire(source: Path, data_dir: Path, where: str, copies: Sequence[TableCopy]) -> None:
    """Keep the SQLite database as ``hub.sqlite3.migrated`` and say where the state went."""
    conn = sqlite3.connect(source)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the backup is one self-contained file
    finally:
        conn.close()
    marker = data_dir / MARKER
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(json.dumps({"to": where, "at": time.time(), "backup": source.name + BACKUP_SUFFIX,
                               "tables": {c.table: asdict(c) for c in copies}}, indent=1) + "\n")
    os.replace(tmp, marker)
    os.replace(source, source.with_name(source.name + BACKUP_SUFFIX))
    for extra in ("-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(source.with_name(source.name + extra))


def refuse_if_migrated(data_dir: Path) -> None:
    """A hub started on SQLite in a folder whose state moved to PostgreSQL: one line, not an
    empty hub."""
    marker = data_dir / MARKER
    if marker.is_file() and not (data_dir / "hub.sqlite3").exists():
        try:
            where = json.loads(marker.read_text()).get("to", "PostgreSQL")
        except (OSError, ValueError):
            where = "PostgreSQL"
        raise MigrationError(f"{data_dir}'s state was moved to {where} by gpuflex-hub migrate; start the hub"
                             " with --store and that URL (the old database is kept as"
                             f" hub.sqlite3{BACKUP_SUFFIX})", code="state_moved")
