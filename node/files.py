"""Small file helpers with no heavy imports (the control CLI must start fast)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_private_file(path: Path, text: str | bytes, *, durable: bool = True) -> None:
    """Atomically write ``text`` (UTF-8, or bytes as they are) to ``path`` readable by the owner
    only (0600).

    ``durable=False`` skips the fsync: the rename still makes the file all-or-nothing, only a
    power cut may bring back the previous version (fine for counters, not for keys or pins).
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8") if isinstance(text, str) else text)
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
