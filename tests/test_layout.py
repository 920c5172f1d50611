"""The install layout: one distribution, three packages under the `gpuflex` namespace,
nothing named `hub`, `node` or `protocol` at the top level, two console scripts."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.mark.parametrize("name", ["hub", "node", "protocol"])
def test_top_level_names_do_not_leak(tmp_path: Path, name: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", f"import {name}"], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode != 0
    assert "ModuleNotFoundError" in done.stderr


@pytest.mark.parametrize("name", ["gpuflex.hub", "gpuflex.node", "gpuflex.protocol"])
def test_namespaced_packages_import_from_anywhere(tmp_path: Path, name: str) -> None:
    done = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("script", ["gpuflex-hub", "gpuflex-node"])
def test_console_scripts_have_version_and_help(script: str) -> None:
    from gpuflex.protocol.version import SOFTWARE_VERSION

    version = subprocess.run([BIN / script, "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and SOFTWARE_VERSION in version.stdout + version.stderr
    helped = subprocess.run([BIN / script, "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "usage:" in helped.stdout


def test_wheel_holds_only_the_gpuflex_namespace(tmp_path: Path) -> None:
    """`pip install .` installs what the wheel holds: check its file list, not the editable install."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("gpuflex-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"gpuflex"}
    assert not any(n.startswith("gpuflex/__init__") for n in names), "gpuflex must stay a namespace"
    for package in ("protocol", "hub", "node", "hub/server/console"):
        assert f"gpuflex/{package}/__init__.py" in names
    assert any(n.startswith("gpuflex/hub/server/console/templates/") for n in names)
    assert any(n.startswith("gpuflex/hub/server/console/static/") for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "gpuflex-hub = gpuflex.hub.ops.cli:main" in text
    assert "gpuflex-node = gpuflex.node.cli:main" in text
