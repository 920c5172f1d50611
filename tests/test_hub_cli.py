"""The gpuflex-hub command line: serve as a real process, tokens, owner job commands, SIGTERM, restart."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from gpuflex.hub import cli
from gpuflex.hub.cli import _is_loopback
from gpuflex.protocol.version import SOFTWARE_VERSION

from tests.helpers import write_digits


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0 and SOFTWARE_VERSION in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])  # (python -m gpuflex.hub runs in the hub_process fixture)
    out = capsys.readouterr().out
    assert exc.value.code == 0
    for word in ("serve", "token", "job"):
        assert word in out


def test_loopback_detection():
    assert _is_loopback("127.0.0.1") and _is_loopback("::1") and _is_loopback("localhost")
    assert not _is_loopback("0.0.0.0") and not _is_loopback("192.168.1.5") and not _is_loopback("example.org")


def test_serve_jobs_sigterm_and_restart(hub_process, tmp_path, capsys, monkeypatch):
    hp = hub_process
    assert hp.fingerprint.startswith("gf1-") and hp.admin_token.startswith("gft_")
    assert (hp.data_dir / "hub.url").read_text().strip() == hp.url
    assert (hp.data_dir / "hub.key").stat().st_mode & 0o077 == 0
    owner = hp.token("owner", "olga")
    train, val, spec = write_digits(tmp_path / "d", rounds=1)
    monkeypatch.setenv("GPUFLEX_HUB", hp.url)
    monkeypatch.setenv("GPUFLEX_TOKEN", owner)
    assert cli.main(["job", "submit", str(spec), "--train", str(train), "--val", str(val), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    job_id = doc["job_id"]
    assert cli.main(["job", "list", "--json"]) == 0
    assert [j["id"] for j in json.loads(capsys.readouterr().out)["jobs"]] == [job_id]
    assert cli.main(["job", "status", job_id]) == 0
    assert job_id in capsys.readouterr().out
    assert cli.main(["job", "download", job_id, "-o", str(tmp_path / "m.safetensors")]) == 0
    assert (tmp_path / "m.safetensors").stat().st_size > 0
    capsys.readouterr()
    assert cli.main(["job", "status", "j-nope"]) == 1
    assert "404 unknown_job" in capsys.readouterr().err
    monkeypatch.setenv("GPUFLEX_TOKEN", "gft_wrong")
    assert cli.main(["job", "list"]) == 1
    assert cli.main(["job", "cancel", job_id, "--token", owner]) == 0
    capsys.readouterr()
    # SIGTERM: clean exit, then a restart on the same data dir keeps everything
    hp.proc.send_signal(signal.SIGTERM)
    assert hp.proc.wait(timeout=30) == 0
    port = hp.url.rsplit(":", 1)[1]
    # restart on the same data dir and port, this time on all interfaces without TLS: a clear warning
    proc = subprocess.Popen([sys.executable, "-m", "gpuflex.hub", "serve", "--data", str(hp.data_dir),
                             "--host", "0.0.0.0", "--port", port],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "listening on" in line:
                break
        text = "".join(lines)
        assert "admin token" not in text  # only on first start
        assert f"hub key fingerprint: {hp.fingerprint}" in text
        assert "WARNING" in text and "without TLS" in text
        assert cli.main(["job", "status", job_id, "--json", "--hub", hp.url, "--token", owner]) == 0
        assert json.loads(capsys.readouterr().out)["state"] == "cancelled"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


@pytest.mark.parametrize("argv", [["job", "list"], ["job", "list", "--hub", "http://127.0.0.1:9"]])
def test_client_needs_hub_and_token(argv, monkeypatch, capsys):
    monkeypatch.delenv("GPUFLEX_HUB", raising=False)
    monkeypatch.delenv("GPUFLEX_TOKEN", raising=False)
    assert cli.main(argv) == 1
    assert "error:" in capsys.readouterr().err
