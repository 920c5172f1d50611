"""Real text on every machine without a download: the Python standard library's own source
files, read from disk, for language-model tests and benches."""

from __future__ import annotations

import sysconfig
from pathlib import Path

#: modules of the standard library whose source is plain prose-heavy Python (docstrings)
FILES = (
    "textwrap.py",
    "difflib.py",
    "argparse.py",
    "inspect.py",
    "typing.py",
    "pathlib.py",
    "dataclasses.py",
)


def stdlib_text(n_bytes: int) -> bytes:
    """The first ``n_bytes`` of the standard library's sources in FILES, read in order (cut at a
    character boundary so it stays UTF-8)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for name in FILES:
        path = root / name
        if path.is_dir():  # pathlib is a package from Python 3.13
            path = path / "__init__.py"
        if path.is_file():
            out += path.read_bytes()
        if len(out) >= n_bytes:
            break
    if len(out) < n_bytes:
        raise RuntimeError(
            f"the standard library at {root} holds {len(out)} bytes of {FILES}, not {n_bytes}"
        )
    return out[:n_bytes].decode("utf-8", errors="ignore").encode("utf-8")
