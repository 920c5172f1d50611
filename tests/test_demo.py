"""`gpuflex-hub demo` as a user runs it: a real process that starts real processes, and
leaves none behind, also when interrupted with Ctrl+C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def _pids(output: str) -> set[int]:
    return {int(p) for p in re.findall(r"pid (\d+)", output)}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purpose; read its state
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


# `python -m gpuflex.hub`, with Ctrl+C handled as in a terminal's foreground job. When the
# suite runs as a background job of a non-interactive shell (`bash .ci/run &`), SIGINT is
# ignored here and a child would inherit that (Python keeps an inherited SIG_IGN).
_HUB_WITH_CTRL_C = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from gpuflex.hub.cli import main; sys.exit(main(sys.argv[1:]))"
)


def _demo(workdir: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _HUB_WITH_CTRL_C, "demo", "--workdir", str(workdir), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def test_demo_runs_flags_the_misbehaving_node_and_cleans_up(tmp_path: Path) -> None:
    proc = _demo(tmp_path, "--nodes", "3", "--rounds", "3", "--misbehaving", "1")
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert "test accuracy" in out
    assert "FLAG" in out and "sign_flip" in out, out
    assert (tmp_path / "model.safetensors").stat().st_size > 1000
    pids = _pids(out)
    assert len(pids) == 4, out  # the hub and three nodes
    time.sleep(0.5)
    assert not [p for p in pids if _alive(p)], "the demo left processes running"


def test_demo_ctrl_c_stops_every_process(tmp_path: Path) -> None:
    proc = _demo(tmp_path, "--nodes", "2", "--rounds", "500", "--misbehaving", "0")  # far more than it will run
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("round"):
            break
    assert any(line.startswith("round") for line in lines), "".join(lines)
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=30)
    out = "".join(lines) + rest
    assert proc.returncode == 130, out
    assert "interrupted" in out
    pids = _pids(out)
    assert len(pids) == 3, out
    time.sleep(0.5)
    assert not [p for p in pids if _alive(p)], "Ctrl+C left processes running"
