"""`gpuflex-hub demo` as a user runs it: a real process that starts real processes, and
leaves none behind, also when interrupted with Ctrl+C."""

from __future__ import annotations

import os
import re
import shlex
import shutil
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
    "from gpuflex.hub.ops.cli import main; sys.exit(main(sys.argv[1:]))"
)


def _demo(workdir: Path | None, *extra: str, tmpdir: Path | None = None) -> subprocess.Popen[str]:
    """The demo with --workdir, or (workdir None) in a temporary folder under `tmpdir`."""
    where = ["--workdir", str(workdir)] if workdir is not None else []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    venv_bin = Path(sys.executable).parent.resolve()  # a fresh shell: the venv is not activated
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if Path(p).resolve() != venv_bin)
    env.pop("VIRTUAL_ENV", None)
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return subprocess.Popen(
        [sys.executable, "-c", _HUB_WITH_CTRL_C, "demo", *where, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )


def _printed_commands(out: str) -> list[list[str]]:
    """The `explore further` block's commands, as a shell would split them."""
    block = out.split("explore further", 1)[1]
    cmds = []
    for line in block.splitlines()[1:]:
        line = line.strip().rstrip("&").strip()
        if "gpuflex-hub" in line:
            words = shlex.split(line)
            while words and "=" in words[0] and not words[0].startswith("-"):  # VAR=value prefixes
                words.pop(0)
            cmds.append(words)
    return cmds


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
    # The notation is explained once, and each flag names the check it failed with its numbers
    # (evidence.headline: never a score that passed).
    assert out.count("How to read a round line") == 1 and "NAME:Nch" in out, out
    flags = re.findall(r"FLAG (\w+) on node-3-sign_flip: (.+)", out)
    assert flags and all(re.search(r"\d \(must be (?:[≤≥] )?[\d.e+-]+", d) for _, d in flags), out
    # the referee's own verdict on the update, not a replica's passing segment
    assert all(d.startswith(("referee: ", "agreed with ")) for why, d in flags if why == "referee_mismatch"), out
    assert "replicas " in out and "overhead" not in out
    # Every printed command runs as printed, from this directory, without an activated venv.
    cmds = _printed_commands(out)
    assert len(cmds) == 4, out
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PATH"] = "/usr/bin:/bin"  # no .venv/bin on PATH, as in a fresh shell
    for words in cmds:
        assert shutil.which(words[0], path=env["PATH"]) or Path(words[0]).is_file(), words
    run = subprocess.run([cmds[-1][0], "audit", "verify-log", "--from", str(tmp_path / "hub")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("audit log OK"), run.stdout + run.stderr


def test_demo_ctrl_c_stops_every_process_and_removes_its_folder(tmp_path: Path) -> None:
    """Without --workdir the demo works in a temporary folder (keys, tokens) and removes it, Ctrl+C included."""
    proc = _demo(None, "--nodes", "2", "--rounds", "500", "--misbehaving", "0", tmpdir=tmp_path)  # far more
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 240  # a node benchmarks itself first: slow on a loaded machine
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
    left = list(tmp_path.glob("gpuflex-demo-*"))
    assert not left, f"the demo left {left} behind"
    folder = re.search(r"GPUFlex demo in (\S+)", out)
    assert folder and f"removed {folder.group(1)}" in out, out
