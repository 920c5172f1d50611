"""The product package ships only the demo's launcher; the end-to-end tests' own tools
(kill -9 of the hub, polling jobs, reading the API, a session-wide benchmark) live in
tests/tooling/cluster.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from gpuflex.hub.ops import localcluster

from tests.tooling import cluster

TEST_ONLY = ("kill_hub", "get_json", "get_bytes", "wait_job", "_request")


def test_the_shipped_launcher_holds_no_test_harness():
    for name in TEST_ONLY:
        assert not hasattr(localcluster.LocalCluster, name), name
    fields = {f.name for f in dataclasses.fields(localcluster.LocalCluster)}
    assert "shared_bench_cache" not in fields
    assert "urllib" not in localcluster.__dict__


def test_the_test_cluster_extends_the_demo_launcher():
    assert issubclass(cluster.LocalCluster, localcluster.LocalCluster)
    for name in TEST_ONLY:
        assert callable(getattr(cluster.LocalCluster, name)), name
    c = cluster.LocalCluster(workdir=Path("/nonexistent"), shared_bench_cache=Path("/b"))
    assert c.bench_cache == Path("/b")


def test_printed_hub_command_runs_without_an_activated_venv(monkeypatch):
    import os
    import shlex
    import subprocess
    import sys

    from gpuflex.hub.ops.demo import hub_command

    venv_bin = Path(sys.executable).parent
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # a fresh shell
    cmd = shlex.split(hub_command())
    assert cmd[0] != "gpuflex-hub", cmd
    run = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0 and run.stdout.startswith("gpuflex-hub "), run.stderr
    monkeypatch.setenv("PATH", f"{venv_bin}{os.pathsep}/usr/bin:/bin")  # an activated venv
    assert hub_command() == "gpuflex-hub"


def test_readme_quick_start_says_how_to_get_the_commands_on_path():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert ". .venv/bin/activate" in quick and ".venv/bin/gpuflex-hub" in quick
