"""The one way the hub reads a number a client wrote in a path, a query string or a header.

``str.isdigit`` and ``int`` both accept more than the digits 0-9: ``"²".isdigit()`` is true
while ``int("²")`` raises, and ``int`` takes ``"١٢"``, ``" 12 "`` and ``"1_000"``. A number
from a request is therefore read here only: ASCII digits, nothing else, and bounded.
"""

from __future__ import annotations

from .errors import BadRequest

#: the default bound: nine digits, far beyond any round, step or count a request names
MAX_COUNT = 999_999_999


def parse_count(raw: str, what: str, *, maximum: int = MAX_COUNT, code: str = "bad_number") -> int:
    """``raw`` as a non-negative integer written in ASCII digits (0-9) only, at most ``maximum``;
    BadRequest (400 ``code``) with a one-line message otherwise."""
    if not raw or len(raw) > len(str(maximum)) or not raw.isascii() or not raw.isdigit():
        shown = raw[:20].encode("ascii", "backslashreplace").decode()
        raise BadRequest(f"{what} must be a whole number from 0 to {maximum} in the digits 0-9, not {shown!r}",
                         code=code)
    value = int(raw)
    if value > maximum:
        raise BadRequest(f"{what} must be a whole number from 0 to {maximum}, not {value}", code=code)
    return value
