"""Which dataset files a job accepts, told apart by their content and their name.

A training or validation set is either an `.npz` archive holding arrays `x` and `y`, or a
`.csv` file with a header row naming a label column. The hub decides by content (an upload
has no trustworthy name); the CLI checks content *and* suffix before uploading, so a file
whose name says one thing and whose bytes say another is named as such instead of being
accepted silently or failing later with a message about the wrong format.

The rules are the protocol's (``protocol/dataset.py``, shared with the node's silos); this
module raises them as the hub's Unprocessable. Pure and light: no numpy, no torch, so
`gpuflex-hub job submit` checks files at once.
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
)
from gpuflex.protocol.dataset import check_dataset_file as _check_dataset_file

from ..base.errors import Unprocessable

__all__ = ["ACCEPTED", "KIND_NAMES", "SNIFF_BYTES", "SUFFIXES", "check_dataset_file", "content_problem", "sniff"]


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
