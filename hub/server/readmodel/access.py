"""Who may read what: the visibility rules every view applies, and the rows they start from.

An admin reads everything; an owner its own jobs, their models and flags; an auditor the
evidence (flags, the audit log, nodes) and, in the console, a review of any job (jobs.job_review),
never an owner's job document or model.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.jobspec import JobSpec, parse_job_spec

from ...base.errors import Forbidden, NotFound
from ...storage.tokens import Principal


def require_job_reader(who: Principal) -> None:
    """Jobs and models are read by their owner and by admins; an auditor's token is for the
    evidence (flags, audit log, nodes), not for an owner's jobs or models."""
    if who.role not in ("owner", "admin"):
        raise Forbidden(
            "jobs and models are read with an owner or admin token; an auditor token reads "
            "flags, the audit log and nodes",
            code="wrong_role",
        )


def visible(who: Principal) -> tuple[str, tuple[Any, ...]]:
    """The jobs `who` may read (SQL fragment): an admin all, an owner its own, an auditor none
    (403 wrong_role)."""
    require_job_reader(who)
    if who.role == "admin":
        return "1 = 1", ()
    return "owner = ?", (who.name,)


def job_row(conn: sqlite3.Connection, who: Principal, job_id: str) -> sqlite3.Row:
    where, args = visible(who)
    row = conn.execute(f"SELECT * FROM jobs WHERE id = ? AND {where}", (job_id, *args)).fetchone()  # noqa: S608
    if row is None:
        raise NotFound(f"no job {job_id} visible to you", code="unknown_job")
    return row


def any_job_row(conn: sqlite3.Connection, job_id: str) -> sqlite3.Row:
    """Any job's row by id, for an auditor's review (jobs.job_review checks the role)."""
    row = conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
    if row is None:
        raise NotFound(f"no job {job_id}", code="unknown_job")
    return row  # type: ignore[no-any-return]


def spec_of(row: sqlite3.Row) -> JobSpec | None:
    """The job's spec as stored (None for a row without one that parses)."""
    try:
        return parse_job_spec(row["spec_toml"])
    except (ProtocolError, IndexError, KeyError):
        return None


def flag_scope(who: Principal) -> tuple[str, tuple[Any, ...]]:
    """The flags `who` may see (SQL fragment over ``flags f``): auditors and admins all, an owner
    its jobs'."""
    if who.role in ("admin", "auditor"):
        return "1 = 1", ()
    return "f.job_id IN (SELECT id FROM jobs WHERE owner = ?)", (who.name,)


def token_alive(conn: sqlite3.Connection, token_id: str) -> tuple[str, str] | None:
    """(role, name) of a token that still exists and is not revoked, else None."""
    try:
        tid = int(token_id)
    except ValueError:
        return None
    row = conn.execute("SELECT role, name, revoked_at FROM tokens WHERE id = ?", (tid,)).fetchone()
    if row is None or row["revoked_at"] is not None:
        return None
    return str(row["role"]), str(row["name"])
