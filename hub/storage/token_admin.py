"""Tokens created, listed and revoked in a hub's database from outside the hub (`gpuflex-hub
token ...`, the local cluster, the tests): works while a hub runs. The database is the one
hub/storage/backend.py opens: SQLite in the data folder, or the PostgreSQL database ``store``
names (HubConfig.store)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ..base.errors import BadRequest, NotFound
from ..base.numbers import parse_count
from .backend import open_store
from .tokens import insert_token

T = TypeVar("T")


def _in_one_transaction(data_dir: Path, store: str | None, fn: Callable[[Any], T]) -> T:
    """``fn(conn)`` in one transaction on the hub's database: committed when it returns, rolled
    back when it raises."""
    db, _ = open_store(data_dir, store)
    try:
        return db.write_sync(fn)
    finally:
        db.close()


def create_token(data_dir: Path, role: str, name: str, store: str | None = None) -> str:
    """Create a token (same path as `gpuflex-hub token create`); returns it. Works while a hub runs.
    `store`: the hub's PostgreSQL URL when it runs on one (HubConfig.store)."""
    return _in_one_transaction(data_dir, store, lambda conn: insert_token(conn, role, name))


def list_tokens(data_dir: Path, store: str | None = None) -> list[dict[str, object]]:
    def rows(conn: Any) -> list[dict[str, object]]:
        tokens = conn.execute(
            "SELECT id, role, name, created_at, revoked_at FROM tokens ORDER BY id"
        ).fetchall()
        enroll = conn.execute(
            "SELECT 'e' || id AS id, 'enroll' AS role, name, created_at, revoked_at FROM enroll_tokens ORDER BY id"
        ).fetchall()
        return [dict(r) for r in tokens] + [dict(r) for r in enroll]

    return _in_one_transaction(data_dir, store, rows)


def revoke_token(data_dir: Path, token_id: int | str, store: str | None = None) -> None:
    """Revoke an API token by id, or an enrollment token by its 'e<id>' (as `token list` shows)."""
    text = str(token_id)
    table = "enroll_tokens" if text.startswith("e") else "tokens"
    try:
        number = parse_count(text.removeprefix("e"), "a token id")
    except BadRequest:
        raise NotFound(f"no token with id {text} (see `gpuflex-hub token list`)") from None

    def revoke(conn: Any) -> None:
        cur = conn.execute(
            f"UPDATE {table} SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",  # noqa: S608 - fixed names
            (time.time(), number),
        )
        if cur.rowcount != 1:
            raise NotFound(f"no live token with id {token_id} (see `gpuflex-hub token list`)")

    _in_one_transaction(data_dir, store, revoke)
