"""`gpuflex-hub audit verify-log` on a copied log: 1-based line numbers, and the hub key
taken from the hub itself (`--hub URL`, pinned with `--hub-key FINGERPRINT`)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from gpuflex.hub.ops import cli
from gpuflex.hub.server.appkeys import AUDIT, CONFIG

from tests.helpers import RunningHub


async def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = await asyncio.to_thread(cli.main, list(argv))
    out, err = capsys.readouterr()
    return code, out + err


@pytest.fixture
async def copied_log(running_hub: RunningHub, tmp_path: Path) -> Path:
    """Six signed entries, copied away from the hub's data folder (no hub.key beside them)."""
    for i in range(6):
        running_hub.app[AUDIT].append("note", {"i": i})
    copy = tmp_path / "copy" / "audit.jsonl"
    copy.parent.mkdir()
    shutil.copyfile(running_hub.app[CONFIG].audit_log_path, copy)
    return copy


async def test_copied_log_verifies_with_the_hub_url_and_fingerprint(running_hub, copied_log, capsys, monkeypatch):
    monkeypatch.delenv("GPUFLEX_HUB", raising=False)
    code, out = await _cli(capsys, "audit", "verify-log", "--from", str(copied_log),
                           "--hub", running_hub.url, "--hub-key", running_hub.fingerprint)
    assert code == 0 and out.startswith("audit log OK: 6 entries"), out
    code, out = await _cli(capsys, "audit", "verify-log", "--from", str(copied_log),
                           "--hub", running_hub.url, "--hub-key", "gf1-aaaa-bbbb-cccc-dddd-eeee")
    assert code == 1 and "not the expected gf1-aaaa-bbbb-cccc-dddd-eeee" in out, out


async def test_without_a_key_it_says_where_to_get_one(copied_log, capsys, monkeypatch):
    monkeypatch.delenv("GPUFLEX_HUB", raising=False)
    code, out = await _cli(capsys, "audit", "verify-log", "--from", str(copied_log),
                           "--hub-key", "gf1-aaaa-bbbb-cccc-dddd-eeee")
    assert code == 1 and "--hub URL" in out and "/v1/hub" in out and "--public-key HEX" in out, out
    assert len(out.strip().splitlines()) == 1


async def test_edited_fifth_line_is_called_line_5(running_hub, copied_log, capsys):
    lines = copied_log.read_text().splitlines(keepends=True)
    lines[4] = lines[4].replace('"i":4', '"i":9')
    copied_log.write_text("".join(lines))
    code, out = await _cli(capsys, "audit", "verify-log", "--from", str(copied_log),
                           "--hub", running_hub.url, "--hub-key", running_hub.fingerprint)
    assert code == 1 and "TAMPERED: line 5:" in out and "4 entries verified before it" in out, out
