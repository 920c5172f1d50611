"""A node's link to the hub: its round trip, as the kernel measures its TCP connection, and its
uplink's rate, timed on the bodies it sends.

Linux keeps a smoothed round-trip time for every TCP connection (``struct tcp_info``'s
``tcpi_rtt``, microseconds, read with ``getsockopt(TCP_INFO)``). The hub reads it when a node
asks for work, and the scheduler keeps a moving average per node (``Presence.observe_rtt``),
which the pipeline plan uses for the node's link. Behind a reverse proxy the connection is
the proxy's, so the figure is the proxy's round trip. Elsewhere (no ``TCP_INFO``), or on a
socket that cannot say, nothing is measured and the plan keeps its assumed round trip.

The uplink: a body the hub reads (a relayed tensor, a stage's checkpoint, an update) is timed
from its first piece to its last (``BodyClock``). What the kernel had buffered before the handler
first read is not timed, so the bytes after the first piece over the time after it are the rate
the node's bytes came in at; a body with fewer than ``MIN_SAMPLE_BYTES`` after its first piece
says nothing. The scheduler keeps a moving average per node (``Presence.observe_uplink``). The
rate is the slower of the node's uplink and whatever else the bytes crossed (the hub's reading,
a proxy), which is what a stage's tensors meet on their way too. Nothing times the way down: a
pipeline plan takes the node's measured uplink for both directions, as a home line's uplink is
its narrower side.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass

from aiohttp import web

#: the offset of ``tcpi_rtt`` (u32, microseconds) in Linux's ``struct tcp_info``
TCPI_RTT_OFFSET = 68
_TCP_INFO_BYTES = 104


def tcp_rtt_s(request: web.Request) -> float | None:
    """The kernel's smoothed round trip of ``request``'s connection, in seconds, or None."""
    option = getattr(socket, "TCP_INFO", None)
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if option is None or sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, option, _TCP_INFO_BYTES)
    except OSError:
        return None
    if len(raw) < TCPI_RTT_OFFSET + 4:
        return None
    (rtt_us,) = struct.unpack_from("=I", raw, TCPI_RTT_OFFSET)
    return rtt_us / 1e6 if rtt_us > 0 else None


#: the bytes a body must bring after its first piece for its time to say the uplink's rate
MIN_SAMPLE_BYTES = 32 << 10


@dataclass
class BodyClock:
    """The arrival of one request body: ``piece(n)`` as each piece is read."""

    first_at: float | None = None
    last_at: float = 0.0
    #: bytes that came after the first piece
    after_first: int = 0

    def piece(self, size: int) -> None:
        now = time.perf_counter()
        if self.first_at is None:
            self.first_at = now
        elif size > 0:
            self.after_first += size
        if size > 0:
            self.last_at = now

    def rate(self) -> float | None:
        """Bytes per second after the first piece; None for a body too small to say."""
        if self.first_at is None or self.after_first < MIN_SAMPLE_BYTES:
            return None
        took = self.last_at - self.first_at
        return self.after_first / took if took > 0 else None


__all__ = ["MIN_SAMPLE_BYTES", "TCPI_RTT_OFFSET", "BodyClock", "tcp_rtt_s"]
