"""Home lines for nodes: each node in its own network namespace, joined to this one by a veth
pair shaped like a volunteer's internet connection.

``HomeLines(n, up_mbit=20, down_mbit=100)`` makes namespaces ``gfx<pid>-<i>`` with a veth
pair each: ``10.77.<i>.1`` on this side (where the hub listens), ``10.77.<i>.2`` inside. ``tc
qdisc … tbf`` shapes the node's side to ``up_mbit`` (its uplink: updates) and this side to
``down_mbit`` (its downlink: models and chunks). Measured on these machines: 19.2 Mbit/s
through a 20mbit tbf, 94 Mbit/s through a 100mbit one.

The kernel here has no netem, so the lines have no added delay or loss: only their rates are
those of a home line. Needs root and iproute2; ``unavailable()`` says why not, for a skip.
Everything made is removed on exit (deleting a namespace deletes its veth pair).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class HomeLine:
    netns: str
    hub_ip: str  # this side: the hub is reached here
    node_ip: str

    def prefix(self) -> list[str]:
        """Run a command inside the line's namespace."""
        return ["ip", "netns", "exec", self.netns]


def _run(argv: Sequence[str]) -> None:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip() or out.returncode}")


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"gfx{os.getpid()}-probe"
    try:
        _run(["ip", "netns", "add", probe])
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return f"ip netns add is not permitted here: {exc}"
    _run(["ip", "netns", "del", probe])
    return None


class HomeLines:
    """``n`` shaped lines; a context manager that removes them."""

    def __init__(self, n: int, *, up_mbit: float = 20.0, down_mbit: float = 100.0, first: int = 1) -> None:
        self.n, self.up_mbit, self.down_mbit, self.first = n, up_mbit, down_mbit, first
        self.lines: list[HomeLine] = []

    def __enter__(self) -> list[HomeLine]:
        try:
            for i in range(self.first, self.first + self.n):
                self.lines.append(self._make(i))
        except BaseException:
            self.close()
            raise
        return self.lines

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self, i: int) -> HomeLine:
        ns, host_if, node_if = f"gfx{os.getpid()}-{i}", f"gfh{os.getpid() % 100000}-{i}", "gfn0"
        line = HomeLine(ns, f"10.77.{i}.1", f"10.77.{i}.2")
        _run(["ip", "netns", "add", ns])
        self.lines.append(line)  # removed on failure from here on
        _run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", node_if, "netns", ns])
        _run(["ip", "addr", "add", f"{line.hub_ip}/24", "dev", host_if])
        _run(["ip", "link", "set", host_if, "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{line.node_ip}/24", "dev", node_if])
        _run(["ip", "-n", ns, "link", "set", node_if, "up"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        # burst: enough for the rate at a 250 Hz kernel tick, as tc-tbf(8) asks
        for argv, rate in ((["tc", "qdisc", "add", "dev", host_if], self.down_mbit),
                           (["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", node_if], self.up_mbit)):
            burst = max(16_000, int(rate * 1e6 / 8 / 250))
            _run([*argv, "root", "tbf", "rate", f"{rate:g}mbit", "burst", str(burst), "latency", "100ms"])
        self.lines.pop()
        return line

    def close(self) -> None:
        for line in self.lines:
            subprocess.run(["ip", "netns", "del", line.netns], capture_output=True, timeout=30)
        self.lines.clear()
