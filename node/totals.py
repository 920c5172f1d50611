"""The node's counters and how they persist in DIR/totals.json.

They are statistics for ``gpuflex-node status``: written at most every TOTALS_EVERY_S
while working and at exit, each time replaced whole (never half-written), without an
fsync, so a kill -9 or a power cut loses at most a few seconds of counts.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .files import write_private_file

TOTALS_FILE = "totals.json"
TOTALS_EVERY_S = 2.0  # how often the counters file is rewritten while working


@dataclass
class Totals:
    assignments: int = 0
    uploaded: int = 0
    rejected: int = 0
    abandoned: int = 0
    samples_trained: int = 0
    train_s: float = 0.0
    bytes_downloaded: int = 0
    bytes_uploaded: int = 0

    @classmethod
    def load(cls, path: Path) -> Totals:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
            return cls(**known)
        except (OSError, ValueError, TypeError):
            return cls()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class TotalsFile:
    """The counters of one data dir, loaded at start and saved now and then."""

    def __init__(self, data_dir: Path, *, every_s: float = TOTALS_EVERY_S) -> None:
        self.path = data_dir / TOTALS_FILE
        self.totals = Totals.load(self.path)
        self._every_s = every_s
        self._saved_at = -math.inf

    def save(self, *, force: bool = False) -> None:
        """Persist the counters: at most every ``every_s`` unless ``force`` (at exit)."""
        now = time.monotonic()
        if not force and now - self._saved_at < self._every_s:
            return
        self._saved_at = now
        with contextlib.suppress(OSError):
            write_private_file(self.path, json.dumps(self.totals.as_dict()) + "\n", durable=False)


__all__ = ["TOTALS_EVERY_S", "TOTALS_FILE", "Totals", "TotalsFile"]
