"""Small file helpers with no heavy imports (the control CLI must start fast)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_private_file(path: Path, text: str, *, durable: bool = True) -> None:
    """Atomically write ``text`` to ``path`` readable by the owner only (0600).

    ``durable=False`` skips the fsync: the rename still makes the file all-or-nothing, only a
    power cut may bring back the previous version (fine for counters, not for keys or pins).
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def software_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("gpuflex")
    except metadata.PackageNotFoundError:
        return "0.0.0+source"
