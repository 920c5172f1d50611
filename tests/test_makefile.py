"""The Makefile's first-use install says what it is doing: the first `make demo` or `make test`
spends a minute or more in pip, and a silent minute looks like a hang. The recipe runs for real
(GNU make, this repository's Makefile); only the venv's python is a stand-in that records the
pip commands it is given, since a real torch install takes minutes and the network."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is absent")
def test_the_first_install_prints_a_line_before_each_long_step(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "pip.log"
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho "pip-called $*" >> {log}\necho "pip-called $*"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    out = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "install", f"VENV={venv}"],
                         capture_output=True, text=True, timeout=60, env=dict(os.environ, MAKEFLAGS=""))
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith(("==>", "pip-called"))]
    torch_at = next(i for i, line in enumerate(lines) if line.startswith("==> installing torch"))
    assert "minute" in lines[torch_at]  # how long to expect
    assert "pip-called -m pip install" in lines[torch_at + 1] and "torch" in lines[torch_at + 1]
    assert lines[torch_at + 2].startswith("==> installing GPUFlex")
    assert "-e .[test]" in lines[torch_at + 3]
    assert lines[-1].startswith("==> ") and "ready" in lines[-1]
    # not a terminal (CI): pip itself stays quiet, the log is a handful of lines
    assert all("--quiet" in line for line in log.read_text().splitlines())
    assert len(out.stdout.splitlines()) <= 12, out.stdout
    assert (venv / ".gpuflex-installed").exists()
    again = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "install", f"VENV={venv}"],
                           capture_output=True, text=True, timeout=60, env=dict(os.environ, MAKEFLAGS=""))
    assert "==>" not in again.stdout  # installed: nothing to say, nothing done
