"""Which dataset files a job accepts, told apart by their content and their name.

A training or validation set is either an `.npz` archive holding arrays `x` and `y`, or a
`.csv` file with a header row naming a label column. The hub decides by content (an upload
has no trustworthy name); the CLI checks content *and* suffix before uploading, so a file
whose name says one thing and whose bytes say another is named as such instead of being
accepted silently or failing later with a message about the wrong format.

Pure and light: no numpy, no torch, so `gpuflex-hub job submit` checks files at once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

from .errors import Unprocessable

ACCEPTED: Final = ".npz (arrays x and y, from numpy.savez) or .csv (a header row with a label column)"
SUFFIXES: Final = {".npz": "npz", ".csv": "csv"}
SNIFF_BYTES: Final = 512

#: what each content kind is called in a message
KIND_NAMES: Final = {
    "npz": "an .npz archive",
    "npy": "a single .npy array",
    "json": "JSON",
    "csv": "CSV text",
    "binary": "binary data that is neither .npz nor CSV",
    "empty": "empty",
}


def sniff(head: bytes) -> str:
    """The content kind of a file from its first bytes: npz, npy, json, csv, binary or empty."""
    if not head:
        return "empty"
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return "npz"
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if text[:1] in (b"{", b"["):
        return "json"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.reason != "unexpected end of data":  # a character cut at the end is still text
            return "binary"
    if b"\x00" in head:
        return "binary"
    return "csv"


def content_problem(kind: str, what: str) -> str | None:
    """The one-line refusal for content the hub cannot read, or None for npz/csv."""
    if kind in ("npz", "csv"):
        return None
    if kind == "npy":
        return (f"{what}: this is a single .npy array; save x and y together with "
                f"numpy.savez(path, x=x, y=y). Accepted: {ACCEPTED}")
    return f"{what}: the file is {KIND_NAMES[kind]}. Accepted: {ACCEPTED}"


def check_dataset_file(path: Path, what: str) -> str:
    """Check a local dataset file before it is uploaded; return its kind ("npz" or "csv").

    Raises Unprocessable with one line for a missing file, a directory, an unreadable file,
    content the hub does not read, and a suffix that is not .npz/.csv or disagrees with
    the content.
    """
    label = f"{what} {path}"
    if not path.exists():
        raise Unprocessable(f"{label}: no such file", code="bad_dataset")
    if path.is_dir():
        raise Unprocessable(f"{label}: is a directory; give a file. Accepted: {ACCEPTED}", code="bad_dataset")
    if not os.access(path, os.R_OK):
        raise Unprocessable(f"{label}: not readable (permission denied)", code="bad_dataset")
    try:
        with open(path, "rb") as fh:
            head = fh.read(SNIFF_BYTES)
    except OSError as exc:
        raise Unprocessable(f"{label}: cannot read it ({exc.strerror or exc})", code="bad_dataset") from None
    kind = sniff(head)
    problem = content_problem(kind, label)
    if problem is not None:
        raise Unprocessable(problem, code="bad_dataset")
    suffix = path.suffix.lower()
    named = SUFFIXES.get(suffix)
    if named is None:
        raise Unprocessable(
            f"{label}: the name ends in {suffix or '(no suffix)'!r}, which is not a dataset format; "
            f"the content is {KIND_NAMES[kind]}, so name it .{kind}. Accepted: {ACCEPTED}",
            code="bad_dataset",
        )
    if named != kind:
        raise Unprocessable(
            f"{label}: the name says {suffix} but the content is {KIND_NAMES[kind]}; "
            f"rename it to .{kind} or export the data again. Accepted: {ACCEPTED}",
            code="bad_dataset",
        )
    return kind
