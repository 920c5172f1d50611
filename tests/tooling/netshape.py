"""Home lines for nodes: each node in its own network namespace, joined to this one by a line
shaped like a volunteer's internet connection: its rates, its round trip and its packet loss.

``HomeLines(n, up_mbit=20, down_mbit=100, rtt_ms=30, loss=0.001)`` (the issue's home line) makes
namespaces ``gfx<pid>-<i>``, each with a line: ``10.77.<i>.1`` on this side (where the hub
listens), ``10.77.<i>.2`` inside, on the device ``gfn0``.

* **Rates**: ``tc qdisc … tbf`` on this side's device shapes what goes to the node (its downlink:
  models and chunks) to ``down_mbit``, on the node's device what it sends (its uplink: updates)
  to ``up_mbit``.
* **Delay and loss**: the kernel here has no netem (nor ``tc … action gact``, nor iptables), so
  each line is two TUN devices, ``gfh<pid>-<i>`` here and ``gfn0`` in the namespace, and one
  relay process for all lines (tests/tooling/packetrelay.py) moves the IP packets between them:
  each packet is held ``rtt_ms / 2`` on its way (in order) and dropped with probability ``loss``
  (a seeded RNG per line and direction). The delay comes after the tbf queue, as a line's
  propagation delay comes after its bottleneck. TCP recovers from these losses itself. The same
  relay runs wherever TUN devices can be made, netem or not, so every machine measures the same
  line. With ``rtt_ms=0`` and ``loss=0`` the line is a veth pair and no relay runs.

Measured on these machines (2 cores; TCP congestion control bbr, the sysctl here): a TCP
connect from the namespace takes 30.4-30.7 ms (median of 20); one TCP stream carries
18.7-19.1 Mbit/s up through the 20mbit tbf and 92-94 Mbit/s down through the 100mbit one, with
loss 0 and 0.001 alike (bbr hardly slows for random loss; cubic would get less through 0.1% at
30 ms), and 18.7 / 91.5 Mbit/s at loss 0.02. Drops counted at 0.001: 22 of 26978 packets up,
89 of 77747 down; at 0.02: 549 of 28616 and 1594 of 79049. The relay process used 3-4% of a
core carrying the 20 Mbit/s uplink and 5-6% at the 100 Mbit/s downlink (user + system time,
/proc/<pid>/stat), the same with both cores kept busy, and the TUN devices dropped nothing.

Needs root, iproute2 and /dev/net/tun; ``unavailable()`` says why not, for a skip. Everything
made is removed on exit: ``close()`` ends the relay (its TUN devices go with its descriptors)
and deletes the namespaces; if the owner dies without closing (SIGTERM, SIGKILL) the relay
sees its control pipe close, deletes the namespaces itself and exits. ``HomeLines.stats()``
reads the relay's counters per line and direction (packets, bytes, dropped, forwarded).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.tooling.packetrelay import open_tun

RELAY = Path(__file__).with_name("packetrelay.py")


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
    """Why home lines cannot be made here (None: they can): namespaces, and TUN devices that
    can be moved into one."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"gfx{os.getpid()}-probe"
    try:
        _run(["ip", "netns", "add", probe])
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return f"ip netns add is not permitted here: {exc}"
    try:
        try:
            fd = open_tun(f"gfp{os.getpid() % 100000}")
        except OSError as exc:
            return f"TUN devices cannot be made here (/dev/net/tun: {exc})"
        try:
            _run(["ip", "link", "set", f"gfp{os.getpid() % 100000}", "netns", probe])
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            return f"a TUN device cannot be moved into a namespace here: {exc}"
        finally:
            os.close(fd)
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


def _tbf(argv: list[str], rate_mbit: float) -> None:
    # burst: enough for the rate at a 250 Hz kernel tick, as tc-tbf(8) asks
    burst = max(16_000, int(rate_mbit * 1e6 / 8 / 250))
    _run([*argv, "root", "tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", "100ms"])


class HomeLines:
    """``n`` shaped lines; a context manager that removes them.

    ``rtt_ms`` (the round trip the line adds, half each way) and ``loss`` (the probability
    each packet is dropped, each way) need the packet relay; with both 0 the line is a plain
    veth pair with ``tbf`` and no relay runs.
    """

    def __init__(self, n: int, *, up_mbit: float = 20.0, down_mbit: float = 100.0, rtt_ms: float = 30.0,
                 loss: float = 0.001, seed: int = 0, first: int = 1) -> None:
        if rtt_ms < 0 or not 0.0 <= loss <= 1.0:
            raise ValueError(f"rtt_ms {rtt_ms} must be >= 0 and loss {loss} within [0, 1]")
        self.n, self.up_mbit, self.down_mbit, self.first = n, up_mbit, down_mbit, first
        self.rtt_ms, self.loss, self.seed = rtt_ms, loss, seed
        self.lines: list[HomeLine] = []
        self.relay: subprocess.Popen[str] | None = None
        #: the relay's counters when it ended (close()): netns -> {"up": {...}, "down": {...}}
        self.final_stats: dict[str, Any] | None = None

    def __enter__(self) -> list[HomeLine]:
        try:
            if self.rtt_ms > 0 or self.loss > 0:
                self._make_relayed()
            else:
                for i in range(self.first, self.first + self.n):
                    self._make_veth(i)
        except BaseException:
            self.close()
            raise
        return self.lines

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _names(self, i: int) -> tuple[HomeLine, str]:
        line = HomeLine(f"gfx{os.getpid()}-{i}", f"10.77.{i}.1", f"10.77.{i}.2")
        return line, f"gfh{os.getpid() % 100000}-{i}"

    def _make_veth(self, i: int) -> None:
        line, host_if = self._names(i)
        _run(["ip", "netns", "add", line.netns])
        self.lines.append(line)  # removed by close() from here on (and its veth pair with it)
        _run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", "gfn0", "netns", line.netns])
        self._address(line, host_if)

    def _address(self, line: HomeLine, host_if: str) -> None:
        """Addresses, links up, and the rates: ``tbf`` on this side's device shapes what goes
        to the node (its downlink), on the node's device what it sends (its uplink)."""
        ns = line.netns
        _run(["ip", "addr", "add", f"{line.hub_ip}/24", "dev", host_if])
        _run(["ip", "link", "set", host_if, "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{line.node_ip}/24", "dev", "gfn0"])
        _run(["ip", "-n", ns, "link", "set", "gfn0", "up"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        _tbf(["tc", "qdisc", "add", "dev", host_if], self.down_mbit)
        _tbf(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "gfn0"], self.up_mbit)

    def _make_relayed(self) -> None:
        """Two TUN devices per line, this side's and the node's, and one relay process for all
        lines that moves packets between them (tests/tooling/packetrelay.py)."""
        fds: list[int] = []
        config: dict[str, Any] = {"delay_s": self.rtt_ms / 2000.0, "loss": self.loss, "seed": self.seed,
                                  "lines": [], "netns": []}
        moves: list[tuple[HomeLine, str, str]] = []
        try:
            for i in range(self.first, self.first + self.n):
                line, host_if = self._names(i)
                node_if = f"gft{os.getpid() % 100000}-{i}"  # gfn0 once in its namespace
                _run(["ip", "netns", "add", line.netns])
                self.lines.append(line)
                config["netns"].append(line.netns)
                hub_fd = open_tun(host_if)
                fds.append(hub_fd)
                node_fd = open_tun(node_if)
                fds.append(node_fd)
                config["lines"].append({"name": line.netns, "hub_fd": hub_fd, "node_fd": node_fd})
                moves.append((line, host_if, node_if))
            # the devices live as long as the relay holds them: it ends, they go
            self.relay = subprocess.Popen([sys.executable, str(RELAY), json.dumps(config)], pass_fds=fds,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                          start_new_session=True)
        finally:
            for fd in fds:
                os.close(fd)
        assert self.relay.stdout is not None
        ready = self.relay.stdout.readline()
        if not ready.startswith('{"ready"'):
            raise RuntimeError(f"the packet relay did not start (exit {self.relay.poll()}): {ready!r}")
        for line, host_if, node_if in moves:
            # a TUN device keeps its descriptor when it moves to another namespace
            _run(["ip", "link", "set", node_if, "netns", line.netns])
            _run(["ip", "-n", line.netns, "link", "set", node_if, "name", "gfn0"])
            for argv in (["ip", "link", "set", host_if], ["ip", "-n", line.netns, "link", "set", "gfn0"]):
                _run([*argv, "txqueuelen", "1000"])  # a TUN device's own queue, after the qdisc
            self._address(line, host_if)

    @property
    def relay_pid(self) -> int | None:
        return self.relay.pid if self.relay is not None else None

    def stats(self) -> dict[str, Any]:
        """The relay's counters now, per line (netns): ``up`` (node to hub) and ``down``, each
        with packets, bytes, dropped, forwarded, queued (in the delay line) and errors."""
        if self.relay is None or self.relay.stdin is None or self.relay.stdout is None:
            raise RuntimeError("no packet relay runs for these lines (rtt_ms and loss are 0)")
        self.relay.stdin.write("stats\n")
        self.relay.stdin.flush()
        answer = self.relay.stdout.readline()
        if not answer:
            raise RuntimeError(f"the packet relay has ended (exit {self.relay.poll()})")
        return dict(json.loads(answer))

    def close(self) -> None:
        relay, self.relay = self.relay, None
        if relay is not None:
            try:
                out, _ = relay.communicate(timeout=15)  # closes its stdin: it prints its counters and ends
            except subprocess.TimeoutExpired:
                relay.kill()
                out, _ = relay.communicate()
            lines = [x for x in (out or "").splitlines() if x.startswith("{")]
            if lines:
                self.final_stats = json.loads(lines[-1])
        for line in self.lines:
            subprocess.run(["ip", "netns", "del", line.netns], capture_output=True, timeout=30)
        self.lines.clear()
