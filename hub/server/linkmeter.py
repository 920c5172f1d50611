"""A node's round trip to the hub, as the kernel measures its TCP connection.

Linux keeps a smoothed round-trip time for every TCP connection (``struct tcp_info``'s
``tcpi_rtt``, microseconds, read with ``getsockopt(TCP_INFO)``). The hub reads it when a node
asks for work, and the scheduler keeps a moving average per node (``Presence.observe_rtt``),
which the pipeline plan uses for the node's link. Behind a reverse proxy the connection is
the proxy's, so the figure is the proxy's round trip. Elsewhere (no ``TCP_INFO``), or on a
socket that cannot say, nothing is measured and the plan keeps its assumed round trip.
"""

from __future__ import annotations

import socket
import struct

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


__all__ = ["TCPI_RTT_OFFSET", "tcp_rtt_s"]
