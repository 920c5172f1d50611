"""What the node shows: a live display on a terminal, JSON lines otherwise.

Not a terminal (a service, a test, a pipe): one JSON object per line per event,
``{"event": "...", "ts": ..., ...}``, flushed; progress is never printed as a flood, only
as events. On a terminal: rich lines for events plus one live progress bar while an
assignment is being downloaded or trained.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, TextIO

_QUIET_ON_TTY = frozenset({"heartbeat", "no_work"})


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


class Output:
    """Event sink shared by the CLI, the agent and the control server (thread-safe)."""

    def __init__(self, stream: TextIO | None = None, *, json_lines: bool | None = None) -> None:
        self._stream = stream if stream is not None else sys.stdout
        self.json_lines = (not self._stream.isatty()) if json_lines is None else json_lines
        self._lock = threading.Lock()
        self._console: Any = None
        self._progress: Any = None
        self._task_id: Any = None
        if not self.json_lines:
            from rich.console import Console

            self._console = Console(file=self._stream, highlight=False)

    def event(self, event: str, **fields: Any) -> None:
        with self._lock:
            if self.json_lines:
                record = {"event": event, "ts": round(time.time(), 3), **_jsonable(fields)}
                self._stream.write(json.dumps(record, separators=(",", ":")) + "\n")
                self._stream.flush()
                return
            if event in _QUIET_ON_TTY or self._console is None:
                return
            style = {"error": "bold red", "rejected": "bold red", "abandoned": "yellow",
                     "uploaded": "green", "paused": "yellow"}.get(event, "")
            detail = "  ".join(f"{k}={_short(v)}" for k, v in fields.items())
            self._console.print(f"[{style}]{event}[/{style}]  {detail}" if style else f"{event}  {detail}")

    # -- live progress on a terminal (no-ops for JSON lines) ---------------------------

    @contextlib.contextmanager
    def status(self, text: str) -> Iterator[None]:
        """A spinner with ``text`` while the block runs (start-up work with nothing else to show)."""
        if self._console is None:
            yield
            return
        with self._console.status(text):
            yield

    def progress_start(self, description: str) -> None:
        if self._console is None:
            return
        with self._lock:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            if self._progress is None:
                self._progress = Progress(
                    TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>5.1f}%"),
                    TimeElapsedColumn(), console=self._console, transient=True,
                )
                self._progress.start()
            if self._task_id is not None:
                self._progress.remove_task(self._task_id)
            self._task_id = self._progress.add_task(description, total=1.0)

    def progress_update(self, fraction: float) -> None:
        if self._progress is None or self._task_id is None:
            return
        self._progress.update(self._task_id, completed=max(0.0, min(1.0, fraction)))

    def progress_stop(self) -> None:
        if self._progress is None:
            return
        with self._lock:
            self._progress.stop()
            self._progress = None
            self._task_id = None


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."
