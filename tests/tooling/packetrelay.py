"""A packet relay between pairs of TUN devices: constant delay and random loss on IP packets.

Each home line (tests/tooling/netshape.py) is two TUN devices, one on the hub's side and one
in the node's network namespace. This relay holds both file descriptors (IFF_TUN |
IFF_NO_PI: one read is one IP packet, one write injects one): what the kernel routes out of
one device is read here, held ``delay`` seconds and written into the other, unless it is
dropped. Drops are independent per packet with probability ``loss``, from a seeded RNG per
line and direction (the gaps between drops are drawn from the geometric distribution, which
is the same thing and costs nothing per packet). The delay is the same for every packet, so a
FIFO per direction with release times keeps each direction in order. TCP sees real IP-level
delay and loss and recovers from them itself.

Run as its own process by ``netshape.HomeLines``, which opens the devices and passes their
descriptors::

    python packetrelay.py '{"delay_s": 0.015, "loss": 0.001, "seed": 0,
                            "lines": [{"name": "1", "hub_fd": 5, "node_fd": 6}], "netns": ["gfx1-1"]}'

stdin is the control channel: a line ``stats`` is answered with one JSON line on stdout
(per line name: ``up`` (node to hub) and ``down`` packets, bytes, dropped); end of file (the
owner closed it, or died) ends the relay, which prints the final stats line, deletes the
namespaces named in ``netns`` (the owner may have died without cleaning up) and exits. So
does SIGTERM/SIGINT, or the owner's exit noticed through ``getppid()``. The devices are not
persistent: they go away with the descriptors when this process ends.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import json
import math
import os
import random
import select
import signal
import struct
import subprocess
import sys
import time
from typing import Any

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
READ_SIZE = 65536  # a packet; the devices' MTU is 1500, and a read never returns more than one
BATCH = 64  # packets read from one device before the others get a turn
EARLY_S = 0.0002  # release a packet this close to its time rather than wake up again for it


def open_tun(name: str) -> int:
    """Create the (non-persistent) TUN device ``name`` and return its descriptor (non-blocking,
    close-on-exec; pass it to the relay with ``pass_fds``)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI))
    except BaseException:
        os.close(fd)
        raise
    return fd


class Direction:
    """One way of one line: a delay line with losses, and its counters."""

    __slots__ = ("bytes", "delay", "dropped", "dst", "errors", "gap", "loss", "packets", "queue", "rng", "src")

    def __init__(self, src: int, dst: int, delay: float, loss: float, rng: random.Random) -> None:
        self.src, self.dst, self.delay, self.loss, self.rng = src, dst, delay, loss, rng
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.packets = self.bytes = self.dropped = self.errors = 0
        self.gap = self._gap()

    def _gap(self) -> int:
        """Packets that pass before the next drop: geometric, P(k) = (1 - loss)^k * loss."""
        if self.loss <= 0.0:
            return -1  # never
        if self.loss >= 1.0:
            return 0
        return int(math.log(1.0 - self.rng.random()) / math.log(1.0 - self.loss))

    def pump(self, now: float) -> None:
        """Read what is waiting on ``src`` (up to BATCH packets) into the delay line."""
        read, queue, release = os.read, self.queue, now + self.delay
        for _ in range(BATCH):
            try:
                packet = read(self.src, READ_SIZE)
            except BlockingIOError:
                return
            except OSError as exc:  # the device went away (its namespace was deleted)
                if exc.errno in (errno.EBADFD, errno.EIO, errno.ENODEV):
                    return
                raise
            self.packets += 1
            self.bytes += len(packet)
            if self.gap == 0:
                self.dropped += 1
                self.gap = self._gap()
                continue
            self.gap -= 1
            if self.delay > 0.0:
                queue.append((release, packet))
            else:
                self._write(packet)

    def release(self, now: float) -> float | None:
        """Write every packet that is due; the time the next one is, if any."""
        queue, due = self.queue, now + EARLY_S
        while queue:
            at, packet = queue[0]
            if at > due:
                return at
            queue.popleft()
            self._write(packet)
        return None

    def _write(self, packet: bytes) -> None:
        try:
            os.write(self.dst, packet)
        except OSError:  # the other device is down or gone: the packet is lost
            self.errors += 1

    def stats(self) -> dict[str, int]:
        return {"packets": self.packets, "bytes": self.bytes, "dropped": self.dropped,
                "forwarded": self.packets - self.dropped - len(self.queue) - self.errors,
                "queued": len(self.queue), "errors": self.errors}


class _Stop(Exception):
    pass


def _stop(*_: Any) -> None:
    raise _Stop


def main(config: dict[str, Any]) -> int:
    delay, loss, seed = float(config["delay_s"]), float(config["loss"]), int(config.get("seed", 0))
    owner = os.getppid()
    ways: dict[str, tuple[Direction, Direction]] = {}
    by_fd: dict[int, Direction] = {}
    for k, line in enumerate(config["lines"]):
        hub_fd, node_fd = int(line["hub_fd"]), int(line["node_fd"])
        for fd in (hub_fd, node_fd):
            os.set_blocking(fd, False)
        # per line and direction a seeded RNG of its own: the drops do not depend on the other traffic
        up = Direction(node_fd, hub_fd, delay, loss, random.Random(f"{seed}-{k}-up"))
        down = Direction(hub_fd, node_fd, delay, loss, random.Random(f"{seed}-{k}-down"))
        ways[str(line["name"])] = (up, down)
        by_fd[node_fd], by_fd[hub_fd] = up, down

    def stats() -> str:
        return json.dumps({name: {"up": up.stats(), "down": down.stats()} for name, (up, down) in ways.items()})

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    stdin = sys.stdin.fileno()
    poller = select.epoll()
    poller.register(stdin, select.EPOLLIN)
    for fd in by_fd:
        poller.register(fd, select.EPOLLIN)
    directions = list(by_fd.values())
    pending = b""
    last_owner_check = time.monotonic()
    print(json.dumps({"ready": os.getpid()}), flush=True)
    try:
        while True:
            now = time.monotonic()
            wake: float | None = None
            for d in directions:
                at = d.release(now)
                if at is not None and (wake is None or at < wake):
                    wake = at
            timeout = 1.0 if wake is None else min(1.0, max(0.0, wake - time.monotonic()))
            events = poller.poll(timeout)
            now = time.monotonic()
            for fd, _ in events:
                way = by_fd.get(fd)
                if way is not None:
                    way.pump(now)
                    continue
                chunk = os.read(stdin, 4096)
                if not chunk:
                    return 0  # the owner closed the control channel, or died
                pending += chunk
                while b"\n" in pending:
                    command, pending = pending.split(b"\n", 1)
                    if command.strip() == b"stats":
                        print(stats(), flush=True)
            if now - last_owner_check > 1.0:
                last_owner_check = now
                if os.getppid() != owner:
                    return 0
    except _Stop:
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            print(stats(), flush=True)
        except OSError:
            pass
        for ns in config.get("netns", []):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
