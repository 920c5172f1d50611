"""Small file helpers with no heavy imports (the control CLI must start fast)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_private_file(path: Path, text: str) -> None:
    """Atomically write ``text`` to ``path`` readable by the owner only (0600)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
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
