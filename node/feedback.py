"""Error feedback's residual, per job, on disk: what the update encoding lost so far.

``<data dir>/feedback/<job id>.gft`` holds one GFT1 state (protocol/tensors.py; never pickle):
the residual the node adds to its next update of that job (protocol/encoding.py). It is
written (0600, atomically: temp file, fsync, rename) only once the hub has accepted the update
that produced it, so a node killed at any point resumes with the residual of its last
accepted update; an update that never landed leaves the residual as it was. Residuals of jobs
the node has not worked for in ``max_age_s`` are removed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from pathlib import Path

from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.tensors import encode_state, load_state_file
from torch import Tensor

from .errors import TrainError
from .files import write_private_file

__all__ = ["FeedbackStore"]

_ID_RE = re.compile(r"[0-9A-Za-z_-]{1,64}")


class FeedbackStore:
    """One residual per job under ``root``."""

    def __init__(self, root: Path, *, max_age_s: float = 30 * 86_400.0) -> None:
        self.root = root
        self.max_age_s = max_age_s

    def path(self, job_id: str) -> Path:
        if not _ID_RE.fullmatch(job_id):
            raise TrainError(f"bad job id {job_id[:80]!r}")
        return self.root / f"{job_id}.gft"

    def load(self, job_id: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Tensor] | None:
        """The job's residual, or None when there is none, or when the file no longer fits the
        model's floating tensors (``shapes``) or cannot be read: the node then starts the
        feedback again from zero, which loses only what the residual held."""
        try:
            state = load_state_file(self.path(job_id))  # a read-only map: the residual is only read
        except (OSError, ProtocolError):
            return None
        if set(state) != set(shapes) or any(tuple(t.shape) != shapes[k] for k, t in state.items()):
            return None
        return state

    def save(self, job_id: str, residual: Mapping[str, Tensor]) -> None:
        target = self.path(job_id)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_private_file(target, encode_state(residual))
        self.prune()

    def prune(self) -> None:
        """Remove residuals of jobs not worked for in ``max_age_s``."""
        cutoff = time.time() - self.max_age_s
        try:
            entries = list(self.root.iterdir())
        except OSError:
            return
        for p in entries:
            try:
                if p.suffix == ".gft" and p.stat().st_mtime < cutoff:
                    p.unlink()
            except OSError:
                continue
