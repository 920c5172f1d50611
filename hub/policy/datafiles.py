"""Which dataset files a job accepts, told apart by their content and their name.

A training or validation set is either an `.npz` archive holding arrays `x` and `y`, or a
`.csv` file with a header row naming a label column. The hub decides by content (an upload
has no trustworthy name); the CLI checks content *and* suffix before uploading, so a file
whose name says one thing and whose bytes say another is named as such instead of being
accepted silently or failing later with a message about the wrong format.

The rules are the protocol's (``protocol/dataset.py``, shared with the node's silos); this
module raises them as the hub's Unprocessable. Light: no torch, and numpy only to write a language
model's text as token windows, so `gpuflex-hub job submit` checks files at once.
"""

from __future__ import annotations

from pathlib import Path

from gpuflex.protocol.dataset import (
    ACCEPTED,
    KIND_NAMES,
    SNIFF_BYTES,
    SUFFIXES,
    DatasetError,
    content_problem,
    sniff,
    text_windows,
)
from gpuflex.protocol.dataset import check_dataset_file as _check_dataset_file

from ..base.errors import Unprocessable

__all__ = ["ACCEPTED", "KIND_NAMES", "SNIFF_BYTES", "SUFFIXES", "TEXT_SUFFIXES", "check_dataset_file", "content_problem",
           "is_text_file", "sniff", "text_as_npz", "text_context"]


def check_dataset_file(path: Path, what: str) -> str:
    """Check a local dataset file before it is uploaded; return its kind ("npz" or "csv").

    Raises Unprocessable with one line for a missing file, a directory, an unreadable file,
    content the hub does not read, and a suffix that is not .npz/.csv or disagrees with
    the content.
    """
    try:
        return _check_dataset_file(path, what)
    except DatasetError as exc:
        raise Unprocessable(str(exc), code=exc.code) from None


#: a language model's training text: UTF-8, turned into token windows before it is uploaded
TEXT_SUFFIXES = (".txt",)


def is_text_file(path: Path) -> bool:
    return path.suffix.lower() in TEXT_SUFFIXES


def text_context(spec_text: bytes, what: str) -> int | None:
    """The context length of a language model job's spec, for cutting its text into windows
    (the hub validates the rest of the spec); None when the spec's model is not a transformer
    (its data is not text: the dataset checks apply), Unprocessable when its context is not a
    whole number."""
    import tomllib

    try:
        model = tomllib.loads(spec_text.decode("utf-8")).get("model", {})
    except (UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None  # the hub names what is wrong with the spec
    if not isinstance(model, dict) or model.get("kind") != "transformer":
        return None
    context = model.get("context")
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise Unprocessable(f"{what}: the spec's model.context must be a whole number of tokens to cut the text by")
    return context


def text_as_npz(path: Path, context: int, out: Path, what: str) -> Path:
    """Write ``path``'s UTF-8 text as byte-level windows of ``context`` tokens (x, and y the
    next tokens: protocol/dataset.py text_windows) to the .npz ``out``; Unprocessable with one
    line when it is not UTF-8 text or too short."""
    import numpy as np

    try:
        data = text_windows(path.read_bytes(), context, what=f"{what} {path}")
    except DatasetError as exc:
        raise Unprocessable(str(exc), code=exc.code) from None
    np.savez(out, x=data.x, y=data.y)
    return out
