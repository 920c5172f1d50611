"""Bearer tokens for owners, auditors and admins.

A token is shown once; the hub keeps only its sha256 (a token carries 256 bits of
entropy, so a plain hash is enough) and compares hashes in constant time.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .db import connect
from .errors import BadRequest, Forbidden, NotFound, Unauthorized
from .numbers import parse_count

Role = Literal["owner", "auditor", "admin"]
ROLES: tuple[Role, ...] = ("owner", "auditor", "admin")
#: an enrollment token admits nodes (their operator); it opens no API route
ENROLL = "enroll"
TOKEN_PREFIX = "gft_"  # noqa: S105 - a prefix, not a secret


@dataclass(frozen=True)
class Principal:
    """Who is calling: the token's row id, role and name (the owner identity of jobs)."""

    token_id: int
    role: Role
    name: str

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    def require(self, *roles: Role) -> None:
        if self.role not in roles and not self.is_admin:
            wanted = " or ".join(roles)
            article = "an" if wanted[:1] in "aeiou" else "a"  # "an auditor token", "an owner token"
            raise Forbidden(f"this needs {article} {wanted} token; yours is {self.role}", code="wrong_role")


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def _check_role_name(role: str, name: str) -> None:
    if role not in ROLES and role != ENROLL:
        raise BadRequest(f"role must be one of {', '.join((*ROLES, ENROLL))}", code="bad_role")
    if not name or len(name) > 64 or not name.isprintable():
        raise BadRequest("token name must be 1..64 printable characters", code="bad_name")


def insert_token(conn: sqlite3.Connection, role: str, name: str) -> str:
    _check_role_name(role, name)
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    if role == ENROLL:  # its own table: it opens no API route, and names an operator
        conn.execute("INSERT INTO enroll_tokens (hash, name, created_at) VALUES (?, ?, ?)",
                     (hash_token(token), name, time.time()))
        return token
    conn.execute(
        "INSERT INTO tokens (hash, role, name, created_at) VALUES (?, ?, ?, ?)",
        (hash_token(token), role, name, time.time()),
    )
    return token


@contextlib.contextmanager
def _hub_db(data_dir: Path, store: str | None) -> Iterator[Any]:
    """One transaction on the hub's database: SQLite under `data_dir`, or the PostgreSQL database
    `store` names (hub/store_postgres.py). Commits when the block ends without an error."""
    if store is not None:
        from .store_postgres import connect as connect_postgres

        pg = connect_postgres(store)
        try:
            yield pg
            pg.commit()
        finally:
            pg.close()
        return
    conn = connect(Path(data_dir) / "hub.sqlite3")
    try:
        conn.execute("BEGIN IMMEDIATE")
        yield conn
        conn.execute("COMMIT")
    finally:
        conn.close()  # without COMMIT: rolled back


def create_token(data_dir: Path, role: str, name: str, store: str | None = None) -> str:
    """Create a token (same path as `gpuflex-hub token create`); returns it. Works while a hub runs.
    `store`: the hub's PostgreSQL URL when it runs on one (HubConfig.store)."""
    with _hub_db(data_dir, store) as conn:
        return insert_token(conn, role, name)


def list_tokens(data_dir: Path, store: str | None = None) -> list[dict[str, object]]:
    with _hub_db(data_dir, store) as conn:
        rows = conn.execute(
            "SELECT id, role, name, created_at, revoked_at FROM tokens ORDER BY id"
        ).fetchall()
        enroll = conn.execute(
            "SELECT 'e' || id AS id, 'enroll' AS role, name, created_at, revoked_at FROM enroll_tokens ORDER BY id"
        ).fetchall()
        return [dict(r) for r in rows] + [dict(r) for r in enroll]


def revoke_token(data_dir: Path, token_id: int | str, store: str | None = None) -> None:
    """Revoke an API token by id, or an enrollment token by its 'e<id>' (as `token list` shows)."""
    text = str(token_id)
    table = "enroll_tokens" if text.startswith("e") else "tokens"
    try:
        number = parse_count(text.removeprefix("e"), "a token id")
    except BadRequest:
        raise NotFound(f"no token with id {text} (see `gpuflex-hub token list`)") from None
    with _hub_db(data_dir, store) as conn:
        cur = conn.execute(
            f"UPDATE {table} SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",  # noqa: S608 - fixed names
            (time.time(), number),
        )
        if cur.rowcount != 1:
            raise NotFound(f"no live token with id {token_id} (see `gpuflex-hub token list`)")


def lookup_token(conn: sqlite3.Connection, token: str) -> Principal:
    """Resolve a raw token (e.g. from the console's login form); 401 when unknown or revoked.

    Tokens can be revoked at any time (`gpuflex-hub token revoke`): check per request.
    """
    return lookup(conn, f"Bearer {token}")


def lookup(conn: sqlite3.Connection, authorization: str | None) -> Principal:
    """Resolve an `Authorization: Bearer <token>` header to a Principal or raise 401."""
    if not authorization:
        raise Unauthorized("missing Authorization: Bearer <token> header", code="missing_token")
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or len(token) > 256:
        raise Unauthorized("Authorization header must be 'Bearer <token>'", code="bad_token")
    digest = hash_token(token)
    row = conn.execute(
        "SELECT id, hash, role, name, revoked_at FROM tokens WHERE hash = ?", (digest,)
    ).fetchone()
    # The indexed lookup finds the row; the final comparison is constant time.
    if row is None or not hmac.compare_digest(row["hash"], digest) or row["revoked_at"] is not None:
        raise Unauthorized("token is unknown or revoked", code="bad_token")
    return Principal(token_id=int(row["id"]), role=row["role"], name=str(row["name"]))


def enrollment_operator(conn: sqlite3.Connection, token: str) -> str:
    """The operator ('op-<token id>') an enrollment token names; 403 when unknown or revoked.

    A node passes the token in its signed hello (``--enroll-token`` / ``GPUFLEX_ENROLL_TOKEN``);
    every node registered with one token is one operator to the hub (hub/admission.py).
    """
    digest = hash_token(token.strip())
    row = conn.execute("SELECT id, hash, revoked_at FROM enroll_tokens WHERE hash = ?", (digest,)).fetchone()
    if row is None or not hmac.compare_digest(row["hash"], digest) or row["revoked_at"] is not None:
        raise Forbidden("the enrollment token is unknown or revoked; ask the hub's operator for a new one",
                        code="bad_enrollment")
    return f"op-{int(row['id'])}"
