"""Content-addressed blob store on the local disk.

A blob's id is the sha256 hex of its bytes. Writes go to a temporary name in
`tmp/`, are fsynced, renamed into place and the directory is fsynced, so a blob
that exists under its id is complete and survives a crash.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from pathlib import Path

from .errors import BadRequest, NotFound

_BLOB_ID = re.compile(r"[0-9a-f]{64}")


def is_blob_id(value: str) -> bool:
    return bool(_BLOB_ID.fullmatch(value))


def check_blob_id(value: str) -> str:
    """Refuse anything that is not 64 lowercase hex before it can touch a path."""
    if not is_blob_id(value):
        raise BadRequest("blob id must be 64 lowercase hex characters", code="bad_blob_id")
    return value


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.tmp = root / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        # Leftovers of a crash mid-upload are never referenced: clear them.
        for leftover in self.tmp.iterdir():
            leftover.unlink(missing_ok=True)

    def path(self, sha: str) -> Path:
        check_blob_id(sha)
        return self.root / sha[:2] / sha

    def has(self, sha: str) -> bool:
        return self.path(sha).is_file()

    def read(self, sha: str) -> bytes:
        p = self.path(sha)
        if not p.is_file():
            raise NotFound(f"blob {sha} is not stored", code="unknown_blob")
        return p.read_bytes()

    def temp_path(self) -> Path:
        return self.tmp / f"{secrets.token_hex(12)}.part"

    def put(self, data: bytes | bytearray | memoryview) -> str:
        """Store bytes durably; returns their id. Idempotent."""
        sha = hashlib.sha256(data).hexdigest()
        if self.has(sha):
            return sha
        tmp = self.temp_path()
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        self.commit_temp(tmp, sha)
        return sha

    def commit_temp(self, tmp: Path, sha: str) -> Path:
        """Move an fsynced temp file into place under `sha` (its caller checked the hash)."""
        final = self.path(sha)
        final.parent.mkdir(exist_ok=True)
        if final.is_file():
            tmp.unlink(missing_ok=True)
            return final
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        return final
