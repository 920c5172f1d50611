"""`gpuflex-hub job status` in a pipe and in an 80-column terminal: every value whole.

The real CLI runs as a process against a real hub on 127.0.0.1 whose job has a closed round;
its output is read through a pipe, and through a pseudo-terminal set to 80 and to 250 columns.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import pty
import struct
import sys
import termios

from tests.helpers import job_with_a_round


def _env(hub, **extra: str) -> dict[str, str]:
    return dict(os.environ, GPUFLEX_HUB=hub.url, GPUFLEX_TOKEN=hub.owner_token, **extra)


async def _piped(hub, job_id: str, **env: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpuflex.hub", "job", "status", job_id, env=_env(hub, **env),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def _in_terminal(hub, job_id: str, columns: int) -> str:
    """The command's output on a pseudo-terminal ``columns`` wide."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {k: v for k, v in _env(hub, TERM="xterm").items() if k not in ("COLUMNS", "LINES")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpuflex.hub", "job", "status", job_id, env=env,
        stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    chunks: list[bytes] = []
    loop = asyncio.get_running_loop()
    while True:
        try:
            data = await loop.run_in_executor(None, os.read, master, 65536)
        except OSError:  # the terminal's other end closed: the process is done
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert await proc.wait() == 0
    return b"".join(chunks).decode(errors="replace")


def _check_plain(text: str, job_id: str, node_id: str) -> None:
    assert "…" not in text, text
    lines = text.replace("\r\n", "\n").splitlines()
    assert f"id: {job_id}" in lines, text
    assert "state: running" in lines and "round: 1/2" in lines, text
    assert "round 0:" in lines, text
    assert any(line.startswith("  accuracy: 0.") for line in lines), text
    assert f"  nodes: share of samples: {node_id} 100%" in lines, text


async def test_piped_and_narrow_status_print_whole_values(running_hub, tmp_path):
    job_id, _, node_id = await job_with_a_round(running_hub, tmp_path)
    _check_plain(await _piped(running_hub, job_id), job_id, node_id)
    _check_plain(await _piped(running_hub, job_id, COLUMNS="80"), job_id, node_id)
    _check_plain(await _in_terminal(running_hub, job_id, 80), job_id, node_id)
    wide = await _in_terminal(running_hub, job_id, 250)  # room for the table: the table
    assert "val loss" in wide and "nodes: share of samples" in wide and f"id: {job_id}" not in wide, wide
    assert "…" not in wide and job_id in wide and node_id in wide, wide
