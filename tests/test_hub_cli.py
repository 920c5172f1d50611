"""The gpuflex-hub command line: serve as a real process, tokens, owner job commands, SIGTERM, restart."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import aiohttp
import pytest
from gpuflex.hub.ops import cli
from gpuflex.hub.ops.cli import _is_loopback
from gpuflex.protocol.messages import Assignment
from gpuflex.protocol.signing import SigningKey
from gpuflex.protocol.version import SOFTWARE_VERSION

from tests.helpers import RELAXED_SERVE_ARGS, SimNode, store_args, write_digits


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


async def _node_round(url: str, key, job_id: str, owner: str, want_round: int) -> dict:
    """One simulated node trains one round of `job_id`; returns the job document after it."""
    async with aiohttp.ClientSession() as s:
        node = SimNode(s, url, key=key)
        await node.register()
        a = await node.work(5.0)
        assert isinstance(a, Assignment) and a.round == want_round, a
        blob, samples, loss = await node.train(a)
        await node.upload(a, blob, samples, loss)  # acknowledged => durable
        async with s.get(f"{url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {owner}"}) as r:
            return await r.json()


async def _wait_round(url: str, job_id: str, owner: str, round_: int) -> dict:
    async with aiohttp.ClientSession() as s:
        for _ in range(400):
            async with s.get(f"{url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {owner}"}) as r:
                doc = await r.json()
            if doc["round"] >= round_:
                return doc
            await asyncio.sleep(0.05)
    raise TimeoutError(doc)


def test_serve_kill9_restart_resumes_and_sigterm_is_clean(hub_process, tmp_path, capsys, monkeypatch):
    hp = hub_process
    assert hp.fingerprint.startswith("gf1-") and hp.admin_token.startswith("gft_")
    assert (hp.data_dir / "hub.url").read_text().strip() == hp.url
    assert (hp.data_dir / "hub.key").stat().st_mode & 0o077 == 0
    owner = hp.token("owner", "olga")
    train, val, spec = write_digits(tmp_path / "d", rounds=2)
    monkeypatch.setenv("GPUFLEX_HUB", hp.url)
    monkeypatch.setenv("GPUFLEX_TOKEN", owner)
    assert cli.main(["job", "submit", str(spec), "--train", str(train), "--val", str(val), "--json"]) == 0
    job_id = json.loads(capsys.readouterr().out)["job_id"]
    assert cli.main(["job", "list", "--json"]) == 0
    assert [j["id"] for j in json.loads(capsys.readouterr().out)["jobs"]] == [job_id]
    assert cli.main(["job", "status", job_id]) == 0
    assert job_id in capsys.readouterr().out
    assert cli.main(["job", "download", job_id, "-o", str(tmp_path / "m0.safetensors")]) == 0
    capsys.readouterr()
    assert cli.main(["job", "status", "j-nope"]) == 1
    assert "404 unknown_job" in capsys.readouterr().err
    assert cli.main(["job", "list", "--token", "gft_wrong"]) == 1
    assert "401 bad_token" in capsys.readouterr().err

    # a node trains round 0; the hub is killed with -9 right after acknowledging the update
    key = SigningKey.generate()
    asyncio.run(_node_round(hp.url, key, job_id, owner, 0))
    hp.proc.kill()
    hp.proc.wait(timeout=30)

    # restart on the same data dir and port, on all interfaces without TLS: a clear warning
    port = hp.url.rsplit(":", 1)[1]
    proc = subprocess.Popen([sys.executable, "-m", "gpuflex.hub", "serve", "--data", str(hp.data_dir),
                             "--host", "0.0.0.0", "--port", port, *RELAXED_SERVE_ARGS, *store_args(hp.data_dir)],
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
        doc = asyncio.run(_wait_round(hp.url, job_id, owner, 1))  # round 0 closed (before or after the kill)
        assert len(doc["history"]) == 1 and doc["history"][0]["updates"][0]["status"] == "included"
        doc = asyncio.run(_node_round(hp.url, key, job_id, owner, 1))  # the same node, no manual step
        doc = asyncio.run(_wait_round(hp.url, job_id, owner, 2))
        assert doc["state"] == "done" and len(doc["history"]) == 2
        assert cli.main(["job", "download", job_id, "-o", str(tmp_path / "m.safetensors")]) == 0
        assert "model version 2" in capsys.readouterr().out
        assert cli.main(["job", "submit", str(spec), "--train", str(train), "--json"]) == 0
        other = json.loads(capsys.readouterr().out)["job_id"]
        assert cli.main(["job", "cancel", other]) == 0
        assert cli.main(["job", "status", other, "--json"]) == 0
        assert json.loads(capsys.readouterr().out.splitlines()[-1])["state"] == "cancelled"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0  # SIGTERM: a clean exit


@pytest.mark.parametrize("argv", [["job", "list"], ["job", "list", "--hub", "http://127.0.0.1:9"]])
def test_client_needs_hub_and_token(argv, monkeypatch, capsys):
    monkeypatch.delenv("GPUFLEX_HUB", raising=False)
    monkeypatch.delenv("GPUFLEX_TOKEN", raising=False)
    assert cli.main(argv) == 1
    assert "error:" in capsys.readouterr().err
