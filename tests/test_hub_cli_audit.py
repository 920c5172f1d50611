"""The auditor's terminal: flag ids never cut and accepted by any unique prefix, a readable
`audit show` (times, device, benchmark, scores, per-layer norms and cosines), verdict
messages that say what happened. A real hub on loopback; the CLI runs in a worker thread
(it has its own event loop) exactly as `gpuflex-hub audit ...` runs it."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from gpuflex.hub.ops import cli

from tests.helpers import RunningHub, open_store

NODE = "gf1-test-node-aaaa-bbbb-cccc"
IDS = ["f-abc1230000000001", "f-abc1240000000002", "f-ffff000000000003", "f-0000000000000004",
       "f-1111000000000005"]
DEVICE = {"kind": "cpu", "name": "Test CPU", "threads": 2, "memory_bytes": 8 << 30}
BENCH = {"samples_per_s": 1234.5, "flops": 2.5e9, "measured_at": 1.795e9}


@pytest.fixture
async def flagged(running_hub: RunningHub) -> SimpleNamespace:
    """Five open flags on one node the hub knows, inserted the way verification writes them."""
    from gpuflex.hub.model.node import NodeState
    from gpuflex.hub.server.appkeys import LEDGER

    now = time.time()
    running_hub.app[LEDGER].scheduler.nodes[NODE] = NodeState(
        id=NODE, public_key=b"k" * 32, bench_sps=1234.5, ema_sps=1000.0, last_seen=now)
    conn = open_store(running_hub.data_dir)
    conn.execute(
        "INSERT INTO nodes (id, public_key, software_version, device, benchmark, bench_sps, ema_sps,"
        " registered_at, last_seen) VALUES (?, ?, '0.1.0', ?, ?, 1234.5, 1000, ?, ?)",
        (NODE, b"k" * 32, json.dumps(DEVICE), json.dumps(BENCH), now - 3600, now))
    evidence = {"problems": ["cosine -0.99 to the round's median < -0.3"], "cosine": -0.99, "norm_ratio": 1.1,
                "update_norm": 2.0, "shard_samples": 200}
    for i, flag_id in enumerate(IDS):
        conn.execute(
            "INSERT INTO flags (id, job_id, round, update_id, node_id, reason, evidence, created_at)"
            " VALUES (?, 'j-x', 1, ?, ?, 'outlier', ?, ?)", (flag_id, f"u-{i}", NODE, json.dumps(evidence), now - 120))
    conn.commit()
    conn.close()
    return SimpleNamespace(hub=running_hub, url=running_hub.url, auditor=running_hub.auditor_token)


async def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = await asyncio.to_thread(cli.main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


async def _get(url: str, token: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(url, headers={"Authorization": f"Bearer {token}"}) as r:
        return r.status, await r.json()


async def test_get_flag_accepts_a_unique_prefix_like_git(flagged):
    for ref in ("f-ffff", "ffff", "f-ffff000000000003", "f-1"):
        status, body = await _get(f"{flagged.url}/v1/flags/{ref}", flagged.auditor)
        assert status == 200, (ref, body)
        assert body["id"] == ("f-1111000000000005" if ref == "f-1" else "f-ffff000000000003")
    status, body = await _get(f"{flagged.url}/v1/flags/f-abc", flagged.auditor)
    assert status == 409 and body["error"] == "ambiguous_flag", body
    assert "f-abc1230000000001" in body["detail"] and "f-abc1240000000002" in body["detail"]
    for ref in ("f-9", "f-%", "f-_bc"):  # LIKE wildcards are plain characters here
        status, body = await _get(f"{flagged.url}/v1/flags/{ref}", flagged.auditor)
        assert status == 404 and body["error"] == "unknown_flag", (ref, body)
    status, body = await _get(f"{flagged.url}/v1/flags/f-ffff", flagged.hub.owner_token)  # not alice's job
    assert status == 404, body


async def test_audit_list_never_cuts_ids_at_80_columns(flagged, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = await _cli(capsys, "audit", "list", "--hub", flagged.url, "--token", flagged.auditor)
    assert code == 0
    for flag_id in IDS:
        assert flag_id in out, out
    assert NODE in out and "…" not in out


async def test_audit_show_and_verdict_take_a_prefix(flagged, capsys):
    code, out, err = await _cli(capsys, "audit", "show", "ffff", "--hub", flagged.url, "--token", flagged.auditor)
    assert code == 0, err
    assert "flag f-ffff000000000003" in out
    code, out, err = await _cli(capsys, "audit", "show", "f-abc", "--hub", flagged.url, "--token", flagged.auditor)
    assert code == 1 and "ambiguous" in err and "f-abc1230000000001" in err and "Traceback" not in err
    code, out, err = await _cli(capsys, "audit", "verdict", "f-0", "dismiss", "--note", "noise",
                                "--hub", flagged.url, "--token", flagged.auditor)
    assert code == 0 and out.strip() == "flag f-0000000000000004: dismissed", out


async def test_audit_show_is_readable(flagged, capsys):
    code, out, err = await _cli(capsys, "audit", "show", "f-ffff", "--hub", flagged.url, "--token", flagged.auditor)
    assert code == 0, err
    assert "1.795e+09" not in out and not re.search(r"(raised|seen|registered) +1\.", out), out  # no raw times
    assert re.search(r"raised +\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4} \(2 min ago\)", out), out
    assert re.search(r"last seen +\d{4}-\d\d-\d\d .*ago\)", out), out
    assert '{"' not in out, out  # no raw JSON
    assert "    name: Test CPU" in out and "    samples_per_s: 1234" in out, out
    assert "    memory_bytes: 8.00 GiB (8589934592 bytes)" in out, out
    assert re.search(r"    measured_at: \d{4}-\d\d-\d\d", out), out
    assert re.search(r"cosine to round centre +-0\.99 +must be ≥ -?\d", out), out
    assert "BEYOND" in out, out


async def test_verdict_messages_say_who_banned_the_node(flagged, capsys):
    outs = []
    for flag_id in IDS[:3]:
        code, out, err = await _cli(capsys, "audit", "verdict", flag_id, "confirm", "--note", "n",
                                    "--hub", flagged.url, "--token", flagged.auditor)
        assert code == 0, err
        outs.append(out.strip())
    assert outs[:2] == [f"flag {IDS[0]}: confirmed", f"flag {IDS[1]}: confirmed"]
    assert outs[2] == f"flag {IDS[2]}: confirmed; this verdict bans the node"
    # The ban leaves the node's other flags moot (not open for ever), saying why; no verdict is taken.
    code, out, err = await _cli(capsys, "audit", "show", IDS[3], "--hub", flagged.url, "--token", flagged.auditor)
    assert code == 0 and "moot" in out and "banned" in out, out
    code, out, err = await _cli(capsys, "audit", "verdict", IDS[3], "dismiss", "--note", "n",
                                "--hub", flagged.url, "--token", flagged.auditor)
    assert code != 0 and "already has a verdict (moot)" in err, err


async def test_role_refusals_read_as_english(flagged):
    status, body = await _get(f"{flagged.url}/v1/audit-log", flagged.hub.owner_token)
    assert status == 403 and body["detail"].startswith("this needs an auditor token"), body


async def test_audit_show_has_per_layer_norms_and_cosines(running_hub, tmp_path: Path, capsys):
    """A real round with a sign-flipping node: the terminal shows the same per-layer rows as the console."""

    from tests.test_console_helpers import first_flag_of, run_job_with_attacker

    other = running_hub.token("owner", "bob")
    scenario = await run_job_with_attacker(running_hub, tmp_path / "w", other_owner_token=other)
    flag = await first_flag_of(running_hub, scenario.attacker)
    status, body = await _get(f"{running_hub.url}/v1/flags/{flag['id']}", running_hub.auditor_token)
    assert status == 200
    layers = (body["evidence"].get("layers") or (body["layer_evidence"] or {}).get("layers"))
    assert layers and {"name", "norm", "centre_norm", "cosine"} <= set(layers[0]), body
    code, out, err = await _cli(capsys, "audit", "show", flag["id"][:8], "--hub", running_hub.url,
                                "--token", running_hub.auditor_token)
    assert code == 0, err
    assert "per layer against the round's centre" in out, out
    for row in layers:
        cosine = format(row["cosine"], ".4g")
        assert re.search(rf"  {re.escape(row['name'])} +\S+ +\S+ +{re.escape(cosine)}", out), out


async def test_a_referee_flag_leads_with_the_check_it_failed(running_hub, capsys):
    """`audit show` and the demo's round line name the failed binding check and its distance,
    never the replica's passing segment (the same headline as the console: evidence.headline)."""
    from gpuflex.hub.ops.demo import _flag_details

    from tests.test_console import BINDING_MISMATCH

    conn = open_store(running_hub.data_dir)
    conn.execute("INSERT INTO flags (id, job_id, round, update_id, node_id, reason, evidence, created_at)"
                 " VALUES ('f-b1d0000000000001', 'j-x', 0, 'u-test-6', ?, 'referee_mismatch', ?, ?)",
                 (NODE, json.dumps(BINDING_MISMATCH), time.time()))
    conn.commit()
    conn.close()
    expected = ("referee: the update is not the committed last state minus the round's model:"
                " relative distance 0.8125 (must be 0)")
    code, out, err = await _cli(capsys, "audit", "show", "f-b1d", "--hub", running_hub.url,
                                "--token", running_hub.auditor_token)
    assert code == 0, err
    assert out.splitlines()[1] == f"  failed    {expected}", out
    entry = {"flags": [{"flag_id": "f-b1d0000000000001", "node_id": NODE, "reason": "referee_mismatch"}]}
    details = await asyncio.to_thread(_flag_details, running_hub.url, running_hub.auditor_token, entry)
    assert details == {"f-b1d0000000000001": expected}
