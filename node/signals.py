"""SIGINT / SIGTERM for a running node: the first asks for a clean exit, a second Ctrl-C leaves.

A clean exit abandons the assignment in hand (the hub is told, so the shard is reassigned)
within seconds. A second SIGINT during that exit ends the process at once with 130: only
verified blobs are ever visible in the cache, so leaving mid-way cannot corrupt it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

EXIT_SECOND_INTERRUPT = 130


@contextlib.contextmanager
def exit_on_signals(
    request_exit: Callable[[str], None],
    exiting: Callable[[], bool],
    on_hard_exit: Callable[[], None],
) -> Iterator[None]:
    """Route SIGINT/SIGTERM to ``request_exit(name)`` while the block runs (in the event loop).

    ``on_hard_exit`` runs just before ``os._exit(130)`` on a second SIGINT. Outside the main
    thread (tests) no handler is installed.
    """
    loop = asyncio.get_running_loop()

    def on_signal(name: str) -> None:
        if exiting() and name == "SIGINT":
            on_hard_exit()
            os._exit(EXIT_SECOND_INTERRUPT)
        request_exit(name)

    installed: list[signal.Signals] = []
    fallback: dict[signal.Signals, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal, sig.name)
            installed.append(sig)
        except NotImplementedError:  # Windows: route the signal into the loop by hand
            with contextlib.suppress(ValueError, OSError):
                fallback[sig] = signal.signal(
                    sig, lambda s, _f: loop.call_soon_threadsafe(on_signal, signal.Signals(s).name)
                )
        except (RuntimeError, ValueError):  # not the main thread (tests): no handlers
            pass
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        for sig, previous in fallback.items():
            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, previous)


__all__ = ["EXIT_SECOND_INTERRUPT", "exit_on_signals"]
