"""What the hub's commands share (hub/ops/cli.py and the plugins it loads, hub/ops/cli_audit.py):
the owner client's hub and token, and plain aligned output."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from typing import Any

from .owner_client import OwnerClientError

ENV_HUB = "GPUFLEX_HUB"
ENV_TOKEN = "GPUFLEX_TOKEN"  # noqa: S105 - an environment variable name


def print_columns(headers: Sequence[str], rows: Sequence[Sequence[str]], *, title: str = "") -> None:
    """Plain aligned columns that never cut a value: ids are copied from here into the next
    command, so a narrow terminal wraps a long line rather than shortening an id."""
    if title:
        print(title)
    for line in column_lines(headers, rows):
        print(line)


def column_lines(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The lines `print_columns` prints: a header and one line per row, each column as wide as
    its widest value."""
    widths = [max([len(h), *(len(str(r[i])) for r in rows)]) for i, h in enumerate(headers)]
    return [
        "  ".join(str(v).ljust(w) for v, w in zip(line, widths, strict=True)).rstrip()
        for line in (headers, *rows)
    ]


def format_time(ts: Any, now: float | None = None) -> str:
    """A Unix time as local ISO time with its age: '2026-11-23 18:30:05 +0000 (3 min ago)'."""
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts <= 0:
        return "-"
    from datetime import datetime

    when = datetime.fromtimestamp(float(ts)).astimezone().strftime("%Y-%m-%d %H:%M:%S %z")
    age = (time.time() if now is None else now) - float(ts)
    if age < 0:
        return when
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if age >= size:
            return f"{when} ({age / size:.0f} {unit} ago)"
    return f"{when} ({age:.0f} s ago)"


def _hub_and_token(args: argparse.Namespace) -> tuple[str, str]:
    hub = args.hub or os.environ.get(ENV_HUB)
    token = args.token or os.environ.get(ENV_TOKEN)
    if not hub:
        raise OwnerClientError(f"no hub URL: pass --hub URL or set {ENV_HUB}")
    if not token:
        raise OwnerClientError(f"no token: pass --token T or set {ENV_TOKEN}")
    return hub.rstrip("/"), token
