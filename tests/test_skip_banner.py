"""`make test` without chromium: the skipped browser tests are named loudly at the end, with
the command that installs chromium; in CI (CI=true) the run fails instead."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAKE = '''
import pytest

@pytest.mark.skipif(True, reason="/usr/bin/chromium is absent (apt-get install -y chromium)")
def test_browser():
    pass

def test_other():
    pass
'''


def _run(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_fake.py").write_text(FAKE)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.tooling.skips", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_fake.py")],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip


def test_a_missing_chromium_is_named_loudly_at_the_end(tmp_path):
    run = _run(tmp_path, None)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 TEST(S) SKIPPED" in run.stdout, run.stdout
    assert run.stdout.index("1 TEST(S) SKIPPED") > run.stdout.index("1 passed, 1 skipped"), "the banner comes last"
    assert "chromium is missing; install it: apt-get install -y chromium" in run.stdout, run.stdout


def test_in_ci_a_missing_chromium_fails_the_run(tmp_path):
    run = _run(tmp_path, "true")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "this run FAILS instead of skipping" in run.stdout, run.stdout
