"""The console's door into the hub's tokens and ledger.

What a page shows comes from the hub's read model (``gpuflex.hub.server.readmodel``), the same
functions the API's routes use. This module holds the rest: the token check behind a console
login and its session, and the verdict, which the ledger gives (``Ledger.verdict``), the very
call the API's verdict route makes. The console changes nothing itself.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from gpuflex.hub.base.errors import HubError, Unauthorized
from gpuflex.hub.server import appkeys
from gpuflex.hub.server.readmodel.access import job_row, token_alive
from gpuflex.hub.storage import tokens

from .sessions import Session

__all__ = ["HubError", "authenticate", "give_verdict", "principal", "session_alive"]


async def authenticate(app: web.Application, token: str) -> tokens.Principal | None:
    """The hub's own token check (hashed, constant-time); None when refused."""
    if not token or len(token) > 256 or not token.isprintable():
        return None
    try:
        return await app[appkeys.STORE].query(lambda c: tokens.lookup_token(c, token))
    except Unauthorized:
        return None


async def session_alive(app: web.Application, session: Session) -> tuple[str, str] | None:
    """(role, name) of the session's token while it exists and is not revoked, else None."""
    return await app[appkeys.STORE].query(lambda c: token_alive(c, session.token_id))


def principal(session: Session) -> tokens.Principal:
    """The hub's Principal for a console session (its token is re-checked per request)."""
    role: Any = session.role
    return tokens.Principal(token_id=int(session.token_id), role=role, name=session.name)


async def give_verdict(
    app: web.Application, who: tokens.Principal, flag_id: str, verdict: str, note: str
) -> None:
    """Confirm or dismiss through the ledger, as POST /v1/flags/{id}/verdict does: flag status,
    node reputation (3 confirmed flags ban), audit-log entry."""
    await app[appkeys.LEDGER].flags.verdict(who, flag_id, verdict, note)


async def roll_back(app: web.Application, who: tokens.Principal, job_id: str, before_node: str, *,
                    oldest_kept: bool = False) -> dict[str, Any]:
    """Roll the job back before the node's first unverified update, as POST /v1/jobs/{id}/rollback
    does: the same visibility (404 for a job ``who`` may not see) and the same ledger call."""
    await app[appkeys.STORE].query(lambda c: job_row(c, who, job_id))
    return await app[appkeys.LEDGER].rollbacks.roll_back(who, job_id, before_node=before_node,
                                                         oldest_kept=oldest_kept)
