"""The hub's open-file limit: every connection a client holds open is a file.

A pipelined job's stage keeps up to ``node/stagelinks.IN_FLIGHT_MAX`` relay sends and as many
receives in flight, each on a connection of its own that the hub holds open while it waits (a
long-polling GET, or a POST the hub answers once the body is in). A 4-stage pipeline at that cap
holds about 800 of the hub's connections, and many systems start a process with a soft limit of
1,024 open files, so ``serve`` raises its soft limit toward the hard one (which an unprivileged
process may do) before it listens, and says so when the system allows less than ``ADVISED``.
Worker processes (``serve --workers``) inherit the raised limit.
"""

from __future__ import annotations

from typing import Final

try:
    import resource
except ImportError:  # Windows has no rlimits: nothing to raise there
    resource = None  # type: ignore[assignment]

#: the soft limit ``serve`` asks for (at most the hard limit)
WANTED: Final = 65536
#: below this the hub warns: a few pipelines at their in-flight cap can exhaust it
ADVISED: Final = 4096


def raise_open_files(wanted: int = WANTED) -> int:
    """Raise this process's soft limit on open files to ``wanted``, or to the hard limit when that
    is lower; never lower it. Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft
        return target
    return soft


def open_files_warning(limit: int) -> str | None:
    """One line for the operator when ``limit`` is below what the hub advises, else None."""
    if resource is None or limit == resource.RLIM_INFINITY or limit >= ADVISED:
        return None
    return (
        f"WARNING: the hub may hold only {limit} open files (ulimit -n); each connection a node"
        f" keeps open is one, and a pipelined job's stages keep many: raise it to {ADVISED} or more"
    )


__all__ = ["ADVISED", "WANTED", "open_files_warning", "raise_open_files"]
