"""Keeping the resident set flat while aggregation reads zero-copy mmap views of update blobs.

``readonly_mapping`` registers a read-only file mapping (what the round engine's ``open_deltas``
maps); a ``PageReleaser`` drops the pages of a consumed slice of a registered mapping from the
process's page tables, and leaves any other memory alone.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import mmap
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from torch import Tensor

__all__ = ["PageReleaser", "readonly_mapping"]


class PageReleaser:
    """Keeps the resident set flat while reading zero-copy mmap views of update blobs.

    Pages of a file mapping that a process has read count in its RSS until it
    unmaps them, so summing N mmap'd 100 MB updates would show N x 100 MB of RSS
    even though every slice is touched once. After a slice is consumed this
    drops its pages from our page tables with ``madvise(MADV_DONTNEED)``; the data
    stays in the page cache and a later read simply faults it back in.

    Only ranges inside the read-only file mappings registered with
    ``readonly_mapping`` (what hub/domain/updates.py ``open_deltas`` maps) are ever touched: for
    those DONTNEED cannot lose data, and a mapping leaves the registry before it is
    closed. Any other tensor (ordinary memory) is left alone; without madvise this
    is a no-op. The registry is read once per releaser, not from /proc/self/maps.
    """

    def __init__(self) -> None:
        self._ranges: list[tuple[int, int]] | None = None
        self._starts: list[int] = []

    def _load(self) -> list[tuple[int, int]]:
        with _MAPPED_LOCK:
            self._ranges = sorted(_MAPPED.values())
        self._starts = [lo for lo, _ in self._ranges]
        return self._ranges

    def release_all(self, flats: Sequence[Tensor]) -> None:
        """Drop whatever is already mapped of these tensors (e.g. by the blob's decode)."""
        for f in flats:
            self.release(f, 0, f.numel())

    def release(self, flat: Tensor, start: int, end: int) -> None:
        """Drop the whole pages of ``flat[start:end]`` if they lie in a registered read-only file mapping."""
        if end <= start or _madvise is None:
            return
        item = flat.element_size()
        addr = flat.data_ptr() + start * item
        lo = -(-addr // _PAGE) * _PAGE
        hi = (addr + (end - start) * item) // _PAGE * _PAGE
        if hi <= lo:
            return
        ranges = self._ranges if self._ranges is not None else self._load()
        if not ranges:
            return
        i = bisect.bisect_right(self._starts, lo) - 1
        if i < 0 or hi > ranges[i][1]:
            return
        _madvise(lo, hi - lo, _MADV_DONTNEED)


def _libc_madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn
    except (OSError, AttributeError):
        return None


_madvise = _libc_madvise()
#: live read-only file mappings whose pages a PageReleaser may drop: token -> (start, end) address
_MAPPED: dict[int, tuple[int, int]] = {}
_MAPPED_LOCK = threading.Lock()


@contextlib.contextmanager
def readonly_mapping(mm: mmap.mmap) -> Iterator[None]:
    """Register ``mm`` (a read-only mapping of a file) with the PageReleasers for the body; it
    must stay open until the body ends. Outside the body its pages are never touched."""
    arr = np.frombuffer(mm, dtype=np.uint8)
    start = int(arr.ctypes.data)
    del arr  # no export may outlive this line: the mapping must stay closable
    token = id(mm)
    with _MAPPED_LOCK:
        _MAPPED[token] = (start, start + len(mm))
    try:
        yield
    finally:
        with _MAPPED_LOCK:
            _MAPPED.pop(token, None)


_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4
