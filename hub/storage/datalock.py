"""One hub process per data folder: an exclusive lock on ``<data>/hub.lock``.

Why: the hub keeps its round state in memory beside the store. Two hubs on one data folder
(or `gpuflex-hub migrate` copying a database that a running hub still writes) would each
believe their own memory, and acknowledged writes would be lost or contradicted. The lock is
``flock`` on an open file: the kernel drops it when the process ends, kill -9 included, so a
crashed hub never leaves a stale lock behind. The file holds the holder's pid and purpose,
for the one-line refusal. Where ``fcntl`` does not exist (Windows), nothing is locked.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from ..base.errors import Conflict

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: the hub runs on POSIX hosts
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = "hub.lock"


class DataFolderBusy(Conflict):
    """Another hub process (or a migration) holds the data folder."""

    code = "data_folder_busy"


class DataLock:
    """Held from `acquire` until `release` (or the process's end)."""

    def __init__(self, data_dir: Path, purpose: str) -> None:
        self.path = data_dir / LOCK_NAME
        self.purpose = purpose
        self._fd: int | None = None

    def acquire(self) -> DataLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _read(fd)
                os.close(fd)
                raise DataFolderBusy(f"{self.path.parent} is in use by {holder or 'another process'}; stop it"
                                     " first (one hub process per data folder)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{self.purpose} (pid {os.getpid()})\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # closing the file drops the flock


def _read(fd: int) -> str:
    with contextlib.suppress(OSError):
        return os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    return ""


@contextlib.contextmanager
def data_lock(data_dir: Path, purpose: str) -> Iterator[DataLock]:
    lock = DataLock(data_dir, purpose).acquire()
    try:
        yield lock
    finally:
        lock.release()
