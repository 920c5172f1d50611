"""Background loops that never die silently.

`supervise` runs one of the hub's loops (the round engine, the sweep) inside the
app's TaskGroup. When the loop raises, its traceback is logged at error level, the
loop is marked down in `LoopHealth` (so `/healthz` answers 503 and names it), the
`on_crash` callback tells the job it was handling, and the loop starts again after
a capped, doubling delay. A loop that runs for a minute without dying again gets
its delay reset. Cancellation (the hub stopping) passes straight through.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("gpuflex.hub.loops")

STABLE_S = 60.0  # a loop that lived this long has recovered: its restart delay starts over


@dataclass
class LoopStatus:
    name: str
    running: bool = False
    restarts: int = 0
    last_error: str | None = None
    failed_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"running": self.running, "restarts": self.restarts, "last_error": self.last_error,
                "failed_at": self.failed_at}


class LoopHealth:
    """What `/healthz` reports about the background loops."""

    def __init__(self) -> None:
        self.loops: dict[str, LoopStatus] = {}

    def status(self, name: str) -> LoopStatus:
        return self.loops.setdefault(name, LoopStatus(name))

    @property
    def down(self) -> list[LoopStatus]:
        return [s for s in self.loops.values() if not s.running]

    def report(self) -> dict[str, Any]:
        return {name: s.to_dict() for name, s in sorted(self.loops.items())}


async def supervise(
    name: str,
    run: Callable[[], Awaitable[None]],
    health: LoopHealth,
    *,
    on_crash: Callable[[BaseException], Awaitable[None]] | None = None,
    first_delay_s: float = 1.0,
    max_delay_s: float = 30.0,
) -> None:
    """Run `run()` for ever: log, report and restart it whenever it dies."""
    status = health.status(name)
    delay = first_delay_s
    while True:
        started = time.monotonic()
        status.running = True
        try:
            await run()
            raise RuntimeError(f"the {name} loop returned; it must run until the hub stops")
        except asyncio.CancelledError:
            status.running = False
            raise
        except Exception as exc:
            status.running = False
            status.restarts += 1
            status.last_error = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
            status.failed_at = time.time()
            if time.monotonic() - started >= STABLE_S:
                delay = first_delay_s
            log.error("background loop %r died (%s); restarting in %.1f s", name, status.last_error, delay,
                      exc_info=exc)
            if on_crash is not None:
                try:
                    await on_crash(exc)
                except Exception:
                    log.exception("reporting the %r loop's failure failed too", name)
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay_s)
