"""Bearer tokens for owners, auditors and admins: their two tables, on a connection.

A token is shown once; the hub keeps only its sha256 (a token carries 256 bits of
entropy, so a plain hash is enough) and compares hashes in constant time. Creating, listing and
revoking tokens in a hub's database from outside the hub (the CLI) is hub/storage/token_admin.py.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import sqlite3
import time
from dataclasses import dataclass
from typing import Literal

from ..base.errors import BadRequest, Forbidden, Unauthorized

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
    every node registered with one token is one operator to the hub (hub/policy/admission.py).
    """
    digest = hash_token(token.strip())
    row = conn.execute("SELECT id, hash, revoked_at FROM enroll_tokens WHERE hash = ?", (digest,)).fetchone()
    if row is None or not hmac.compare_digest(row["hash"], digest) or row["revoked_at"] is not None:
        raise Forbidden("the enrollment token is unknown or revoked; ask the hub's operator for a new one",
                        code="bad_enrollment")
    return f"op-{int(row['id'])}"
