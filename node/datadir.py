"""One running node per data dir: an OS lock on DIR/node.lock, held for the process lifetime.

Two nodes on one folder would register as the same node id, share one cache and one
control endpoint, and the loser's clean-up would delete the winner's control.url. So
``gpuflex-node run`` takes an exclusive, non-blocking lock before it touches anything:
``fcntl.flock`` on POSIX, ``msvcrt.locking`` on Windows. The kernel drops the lock when
the process ends however it ends (kill -9 included), so a stale lock file never blocks
the next start. Several nodes on one machine each get their own ``--data-dir``.

The file holds the holder's pid after its first byte (the byte that is locked on Windows),
for the refusal message only; the lock, not the file, is what counts.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import IO

from .errors import DataDirBusy

LOCK_FILE = "node.lock"


def _try_lock(f: IO[bytes]) -> bool:
    if sys.platform == "win32":
        import msvcrt

        f.seek(0)
        try:
            msvcrt.locking(f.fileno(), msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True
    import fcntl

    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _holder_pid(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(1)
            text = f.read(32).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return text if text.isdigit() else ""


class DataDirLock:
    """The exclusive lock on one data dir; :meth:`release` (or process exit) frees it."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.path = data_dir / LOCK_FILE
        self._file: IO[bytes] | None = None

    def acquire(self) -> DataDirLock:
        """Take the lock or raise DataDirBusy naming the folder and what to do."""
        if self._file is not None:
            return self
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        f = os.fdopen(fd, "r+b", buffering=0)
        if not _try_lock(f):
            f.close()
            pid = _holder_pid(self.path)
            who = f" (pid {pid})" if pid else ""
            raise DataDirBusy(
                f"another gpuflex-node is already running with data dir {self.data_dir}{who}; "
                "stop it first, or give this node its own --data-dir"
            )
        with contextlib.suppress(OSError):
            f.seek(1)
            f.truncate(1)
            f.write(f"{os.getpid()}\n".encode("ascii"))
        self._file = f
        return self

    @property
    def held(self) -> bool:
        return self._file is not None

    def release(self) -> None:
        f, self._file = self._file, None
        if f is None:
            return
        with contextlib.suppress(OSError):
            if sys.platform == "win32":
                import msvcrt

                f.seek(0)
                msvcrt.locking(f.fileno(), msvcrt.LK_UNLCK, 1)
            f.close()


__all__ = ["LOCK_FILE", "DataDirLock"]
