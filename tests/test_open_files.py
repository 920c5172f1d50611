"""The hub raises its open-file limit before it serves (hub/ops/openfiles.py)."""

from __future__ import annotations

import resource
import subprocess
import sys

from gpuflex.hub.ops.openfiles import ADVISED, open_files_warning, raise_open_files


def test_the_soft_limit_rises_toward_the_hard_one_and_never_falls() -> None:
    """Run in a child whose soft limit starts at 256: it rises to the wanted figure within the
    hard limit, and a second call with a lower figure leaves it where it is."""
    code = (
        "import resource\n"
        "from gpuflex.hub.ops.openfiles import raise_open_files\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "print(raise_open_files(2048), raise_open_files(512),"
        " resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    first, second, now, hard = (int(x) for x in out.stdout.split())
    expected = 2048 if hard == resource.RLIM_INFINITY else min(2048, hard)
    assert first == second == now == expected


def test_a_low_limit_gets_one_warning_line() -> None:
    line = open_files_warning(1024)
    assert line is not None and "\n" not in line and "ulimit -n" in line
    assert open_files_warning(ADVISED) is None
    assert raise_open_files(1) >= 1  # asking for less changes nothing
