"""A TCP relay between a node and its hub that cuts the link mid-transfer, once.

Stands for a home line that drops: every connection is forwarded byte for byte to the hub,
until the first request line that starts with ``cut_on`` (an update upload by default) has
been followed by ``cut_after`` more bytes from the node's side: then that connection is closed
in both directions at exactly that byte. It counts what crossed each way, so a test can tell a
resumed upload (the rest only) from one sent again from byte 0, and can keep every byte the node
sent (``captured``), so a test can search them.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field


@dataclass
class CuttingRelay:
    target_port: int
    cut_after: int
    cut_on: bytes = b"POST /v1/updates HTTP/"
    host: str = "127.0.0.1"
    port: int = 0
    sent_up: int = 0  # bytes the node sent through the relay, all connections
    sent_down: int = 0
    #: bytes the node sent from a watched request line on (every such request, cut or not, and
    #: whatever follows it on its connection)
    sent_watched: int = 0
    cut: bool = False
    #: when given, every byte the node sends (all connections, in arrival order) is appended here
    captured: bytearray | None = None
    _server: asyncio.base_events.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> CuttingRelay:
        self._server = await asyncio.start_server(self._handle, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(BaseException):
                await t

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            writer.close()
            self._tasks.discard(task)
            return
        done = asyncio.Event()

        def close_all() -> None:
            for w in (writer, up_writer):
                with contextlib.suppress(Exception):
                    w.transport.abort()
            done.set()

        async def node_to_hub() -> None:
            pos = 0  # bytes of this connection forwarded so far
            start: int | None = None  # where the watched request line begins in them
            tail = b""
            try:
                while data := await reader.read(1 << 16):
                    if self.captured is not None:
                        self.captured += data
                    if start is None:
                        at = (tail + data).find(self.cut_on)
                        if at >= 0:
                            start = pos - len(tail) + at
                            self.sent_watched -= max(0, start - pos)  # the bytes before it in this read
                        tail = (tail + data)[-len(self.cut_on):]
                    if start is not None and not self.cut and pos + len(data) >= start + self.cut_after:
                        keep = start + self.cut_after - pos
                        up_writer.write(data[:keep])
                        await up_writer.drain()
                        self.sent_up += keep
                        self.sent_watched += keep
                        self.cut = True
                        close_all()  # the line drops: both sides see the connection die
                        return
                    pos += len(data)
                    self.sent_up += len(data)
                    if start is not None:
                        self.sent_watched += len(data)
                    up_writer.write(data)
                    await up_writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    up_writer.write_eof()
                done.set()

        async def hub_to_node() -> None:
            try:
                while data := await up_reader.read(1 << 16):
                    self.sent_down += len(data)
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                done.set()

        pumps = [asyncio.create_task(node_to_hub()), asyncio.create_task(hub_to_node())]
        try:
            await asyncio.gather(*pumps)
        finally:
            for w in (writer, up_writer):
                with contextlib.suppress(Exception):
                    w.close()
            self._tasks.discard(task)
