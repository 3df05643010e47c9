"""A user-space WAN delay link: a TCP proxy that delays each direction by rtt_ms / 2.

netem is not available here, so WAN latency is emulated in user space. For every accepted
connection the link opens one connection to the target and runs two pipes (client->target,
target->client). A pipe stamps each chunk it reads with `due = read time + one-way delay`
(the delay in force at read time, so `set_rtt_ms` affects only data read afterwards) and a
writer task sends the chunks in order, each no earlier than its due time. Order is kept
even when the RTT drops: a chunk never overtakes the one before it.

Connection setup: the local accept is instant, but a real TCP handshake costs one RTT
before the client can send. With `handshake=True` (the default) bytes the client sends
during its first RTT are treated as sent at accept + RTT, so a fresh connection's first
request/response takes 2 RTT and later ones take 1 RTT, as over a real WAN. A target that
refuses the connection closes the client's connection at once (no RST delay is modelled).

Backpressure: each pipe holds at most `max_buffered_bytes` in its delay queue; when full
it stops reading, so the sender's TCP window closes. The bound must exceed the
bandwidth-delay product you need: 4 MiB at 90 ms one way is ~44 MiB/s per connection.
EOF is forwarded (half-close) after the data before it; an error on either side closes
both sides of the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import deque

log = logging.getLogger(__name__)

READ_CHUNK_BYTES = 64 * 1024
DEFAULT_MAX_BUFFERED_BYTES = 4 * 1024 * 1024  # see module docstring: bandwidth-delay product
# A blackholed target should not hold a client forever; a real SYN gives up after ~2 min,
# tests and the local stack want a clear failure much sooner.
CONNECT_TIMEOUT_S = 10.0


def _check_rtt_ms(rtt_ms: float) -> float:
    if not (math.isfinite(rtt_ms) and rtt_ms >= 0):
        raise ValueError(f"rtt_ms must be finite and >= 0, got {rtt_ms!r}")
    return float(rtt_ms)


class _DelayQueue:
    """FIFO of (due_s, data) for one direction, bounded by bytes. `data=None` means EOF."""

    def __init__(self, max_bytes: int) -> None:
        self._items: deque[tuple[float, bytes | None]] = deque()
        self._bytes = 0
        self._max_bytes = max_bytes
        self._changed = asyncio.Condition()

    async def put(self, due_s: float, data: bytes | None) -> None:
        async with self._changed:
            # May overshoot by one chunk; that keeps a chunk larger than the bound movable.
            await self._changed.wait_for(lambda: self._bytes < self._max_bytes)
            self._items.append((due_s, data))
            self._bytes += len(data) if data else 0
            self._changed.notify_all()

    async def get(self) -> tuple[float, bytes | None]:
        async with self._changed:
            await self._changed.wait_for(lambda: bool(self._items))
            due_s, data = self._items.popleft()
            self._bytes -= len(data) if data else 0
            self._changed.notify_all()
            return due_s, data


class WanLink:
    """Listen on listen_host:listen_port and forward each connection to target_host:
    target_port with rtt_ms / 2 of delay in each direction. listen_port=0 picks a free
    port (read it from `port` after start())."""

    def __init__(
        self,
        listen_host: str,
        listen_port: int,
        target_host: str,
        target_port: int,
        rtt_ms: float,
        *,
        handshake: bool = True,
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        if max_buffered_bytes < 1:
            raise ValueError(f"max_buffered_bytes must be >= 1, got {max_buffered_bytes}")
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.target_host = target_host
        self.target_port = target_port
        self._rtt_ms = _check_rtt_ms(rtt_ms)
        self.handshake = handshake
        self.max_buffered_bytes = max_buffered_bytes
        self.connect_timeout_s = connect_timeout_s
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    # -- configuration ----------------------------------------------------------------

    @property
    def rtt_ms(self) -> float:
        return self._rtt_ms

    def set_rtt_ms(self, rtt_ms: float) -> None:
        """New RTT for data read from now on (data already queued keeps its due time)."""
        self._rtt_ms = _check_rtt_ms(rtt_ms)

    @property
    def one_way_s(self) -> float:
        return self._rtt_ms / 2000.0

    @property
    def port(self) -> int:
        """The bound listening port."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("WanLink is not started")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def connections(self) -> int:
        """Connections currently being proxied."""
        return len(self._connections)

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("WanLink already started")
        self._server = await asyncio.start_server(
            self._on_accept, self.listen_host, self.listen_port
        )

    async def stop(self) -> None:
        """Stop listening and close every proxied connection (both sides)."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    # -- per connection ---------------------------------------------------------------

    async def _on_accept(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._proxy(client_reader, client_writer)
        except asyncio.CancelledError:
            pass  # stop(): sockets were closed in _proxy's finally
        finally:
            self._connections.discard(task)

    async def _proxy(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        loop = asyncio.get_running_loop()
        accepted_s = loop.time()
        # The client could not send before its handshake's RTT had elapsed.
        client_may_send_s = accepted_s + (self._rtt_ms / 1000.0 if self.handshake else 0.0)
        target_writer: asyncio.StreamWriter | None = None
        tasks: list[asyncio.Task[None]] = []
        try:
            try:
                target_reader, connected = await asyncio.wait_for(
                    asyncio.open_connection(self.target_host, self.target_port),
                    self.connect_timeout_s,
                )
            except (OSError, TimeoutError) as exc:
                log.debug(
                    "wan %s:%d: target unreachable: %r", self.target_host, self.target_port, exc
                )
                return
            target_writer = connected
            up = _DelayQueue(self.max_buffered_bytes)
            down = _DelayQueue(self.max_buffered_bytes)
            tasks = [
                asyncio.create_task(self._read_into(client_reader, up, client_may_send_s)),
                asyncio.create_task(self._write_from(up, connected)),
                asyncio.create_task(self._read_into(target_reader, down, accepted_s)),
                asyncio.create_task(self._write_from(down, client_writer)),
            ]
            # Returns when all four finish (both EOFs delivered) or on the first failure.
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    log.debug("wan connection closed on error: %r", task.exception())
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for writer in (client_writer, target_writer):
                if writer is not None:
                    writer.close()
            for writer in (client_writer, target_writer):
                if writer is not None:
                    with contextlib.suppress(Exception):
                        await writer.wait_closed()

    async def _read_into(
        self, reader: asyncio.StreamReader, queue: _DelayQueue, may_send_s: float
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            data = await reader.read(READ_CHUNK_BYTES)
            sent_s = max(loop.time(), may_send_s)
            await queue.put(sent_s + self.one_way_s, data or None)
            if not data:
                return

    async def _write_from(self, queue: _DelayQueue, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due_s, data = await queue.get()
            delay_s = due_s - loop.time()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            if data is None:
                if writer.can_write_eof():
                    writer.write_eof()  # half-close: the other direction keeps flowing
                else:
                    writer.close()
                return
            writer.write(data)
            await writer.drain()


async def serve_wan(
    listen_host: str,
    listen_port: int,
    target_host: str,
    target_port: int,
    rtt_ms: float,
    ready: asyncio.Event | None = None,
    *,
    handshake: bool = True,
) -> None:
    """Run one WAN link until cancelled; `ready` is set once it accepts connections."""
    link = WanLink(listen_host, listen_port, target_host, target_port, rtt_ms, handshake=handshake)
    await link.start()
    try:
        log.info(
            "wan link %s:%d -> %s:%d rtt %.1f ms",
            listen_host,
            link.port,
            target_host,
            target_port,
            rtt_ms,
        )
        if ready is not None:
            ready.set()
        await asyncio.Event().wait()  # until cancelled
    finally:
        await link.stop()
