"""The hub's one exception tree.

Domain code raises a `HubError` subclass; only the edge (the error middleware in
`app.py`) turns it into HTTP: `{"error": code, "detail": one line}` with `status`.
Messages are one line a person can act on.
"""

from __future__ import annotations


class HubError(Exception):
    """Root of every error the hub raises on purpose."""

    status: int = 500
    code: str = "internal"

    def __init__(self, detail: str, *, code: str | None = None) -> None:
        super().__init__(detail)
        self.detail = " ".join(str(detail).split())  # always one line
        if code is not None:
            self.code = code


class BadRequest(HubError):
    status = 400
    code = "bad_request"


class Unauthorized(HubError):
    status = 401
    code = "unauthorized"


class Forbidden(HubError):
    status = 403
    code = "forbidden"


class NotFound(HubError):
    status = 404
    code = "not_found"


class Conflict(HubError):
    status = 409
    code = "conflict"


class LengthRequired(HubError):
    status = 411
    code = "length_required"


class PayloadTooLarge(HubError):
    status = 413
    code = "too_large"


class Unprocessable(HubError):
    status = 422
    code = "unprocessable"


class TooManyRequests(HubError):
    """Slow down: the edge adds ``Retry-After: retry_after_s`` (whole seconds, at least 1)."""

    status = 429
    code = "rate_limited"

    def __init__(self, detail: str, *, retry_after_s: float, code: str | None = None) -> None:
        super().__init__(detail, code=code)
        self.retry_after_s = max(1, int(retry_after_s + 0.999))
