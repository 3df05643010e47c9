"""The user-space WAN delay link, with real sockets on 127.0.0.1 (no mocks)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
from collections.abc import AsyncIterator

import pytest

from emulator.wan import WanLink, serve_wan

RTT_MS = 60.0
SLACK_S = 0.050  # scheduling allowance on a loaded CI machine


class EchoServer:
    """Echoes every byte; on the client's EOF, closes. Records open connections."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.open_connections = 0
        self.closed = asyncio.Event()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open_connections += 1
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()
            self.open_connections -= 1
            self.closed.set()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture
async def echo() -> AsyncIterator[EchoServer]:
    server = EchoServer()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def link(echo: EchoServer) -> AsyncIterator[WanLink]:
    wan = WanLink("127.0.0.1", 0, "127.0.0.1", echo.port, RTT_MS)
    await wan.start()
    yield wan
    await wan.stop()
    assert wan.connections == 0


async def round_trip_s(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes = b"ping"
) -> float:
    start = time.perf_counter()
    writer.write(payload)
    await writer.drain()
    async with asyncio.timeout(2):
        echoed = await reader.readexactly(len(payload))
    assert echoed == payload
    return time.perf_counter() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_round_trip_costs_one_rtt_and_setup_one_more(link: WanLink) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
    try:
        # Fresh connection: the handshake's RTT comes first, as over a real WAN.
        first_s = await round_trip_s(reader, writer)
        assert 2 * RTT_MS / 1000 <= first_s < 2 * RTT_MS / 1000 + SLACK_S
        for _ in range(3):
            rtt_s = await round_trip_s(reader, writer)
            assert RTT_MS / 1000 <= rtt_s < RTT_MS / 1000 + SLACK_S
    finally:
        writer.close()


async def test_without_handshake_first_round_trip_is_one_rtt(echo: EchoServer) -> None:
    wan = WanLink("127.0.0.1", 0, "127.0.0.1", echo.port, RTT_MS, handshake=False)
    await wan.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", wan.port)
        rtt_s = await round_trip_s(reader, writer)
        assert RTT_MS / 1000 <= rtt_s < RTT_MS / 1000 + SLACK_S
        writer.close()
    finally:
        await wan.stop()


async def test_one_mib_passes_intact_in_order_then_eof(link: WanLink) -> None:
    payload = random.Random(7).randbytes(1024 * 1024)
    reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
    try:

        async def send() -> None:
            for i in range(0, len(payload), 10_000):  # many writes: order must hold
                writer.write(payload[i : i + 10_000])
                await writer.drain()
            writer.write_eof()  # half-close: the echo must still come back

        async with asyncio.timeout(3):
            sender = asyncio.create_task(send())
            received = await reader.read(-1)  # until the link forwards the echo's EOF
            await sender
        assert len(received) == len(payload)
        assert received == payload
    finally:
        writer.close()


async def test_set_rtt_changes_delay(link: WanLink) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
    try:
        await round_trip_s(reader, writer)  # pay the handshake
        assert await round_trip_s(reader, writer) >= RTT_MS / 1000

        link.set_rtt_ms(10.0)
        assert link.rtt_ms == 10.0
        rtt_s = await round_trip_s(reader, writer)  # same connection, new delay
        assert 0.010 <= rtt_s < 0.010 + SLACK_S

        link.set_rtt_ms(150.0)
        rtt_s = await round_trip_s(reader, writer)
        assert 0.150 <= rtt_s < 0.150 + SLACK_S
    finally:
        writer.close()
    with pytest.raises(ValueError, match="rtt_ms"):
        link.set_rtt_ms(-1.0)


async def test_order_kept_when_rtt_drops(link: WanLink) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
    try:
        writer.write(b"slow-")
        await writer.drain()
        await asyncio.sleep(0.005)  # let the link stamp it with the 60 ms delay
        link.set_rtt_ms(0.0)
        writer.write(b"fast")
        async with asyncio.timeout(2):
            assert await reader.readexactly(9) == b"slow-fast"
    finally:
        writer.close()


async def test_refused_target_closes_client() -> None:
    wan = WanLink("127.0.0.1", 0, "127.0.0.1", free_port(), RTT_MS)
    await wan.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", wan.port)
        # An abortive close (reset) is also a close.
        async with asyncio.timeout(1):
            with contextlib.suppress(ConnectionResetError):
                assert await reader.read(100) == b""
        writer.close()
    finally:
        await wan.stop()


async def test_stop_closes_everything(echo: EchoServer) -> None:
    wan = WanLink("127.0.0.1", 0, "127.0.0.1", echo.port, 2.0)
    await wan.start()
    port = wan.port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await round_trip_s(reader, writer)
    assert wan.connections == 1
    assert echo.open_connections == 1

    async with asyncio.timeout(1):
        await wan.stop()
        assert await reader.read(100) == b""  # client side closed
        await echo.closed.wait()  # target side closed
    assert wan.connections == 0
    assert echo.open_connections == 0
    writer.close()
    with pytest.raises(OSError):  # no longer listening
        await asyncio.open_connection("127.0.0.1", port)


async def test_backpressure_stops_reading(echo: EchoServer) -> None:
    """A target that never reads: the link must stop reading too, so the sender blocks
    instead of the link buffering without bound."""
    stalled = asyncio.Event()

    async def never_read(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await stalled.wait()
        writer.close()

    sink = await asyncio.start_server(never_read, "127.0.0.1", 0)
    sink_port = sink.sockets[0].getsockname()[1]
    wan = WanLink("127.0.0.1", 0, "127.0.0.1", sink_port, 2.0, max_buffered_bytes=256 * 1024)
    await wan.start()
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", wan.port)
        writer.write(bytes(64 * 1024 * 1024))  # far more than all socket buffers hold
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(writer.drain(), 0.5)
        assert writer.transport.get_write_buffer_size() > 0
        writer.close()
    finally:
        stalled.set()
        await wan.stop()
        sink.close()
        await sink.wait_closed()


async def test_target_close_propagates_to_client() -> None:
    async def close_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"bye")
        await writer.drain()
        writer.close()

    target = await asyncio.start_server(close_at_once, "127.0.0.1", 0)
    wan = WanLink("127.0.0.1", 0, "127.0.0.1", target.sockets[0].getsockname()[1], RTT_MS)
    await wan.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", wan.port)
        start = time.perf_counter()
        async with asyncio.timeout(1):
            assert await reader.read(-1) == b"bye"  # data first, then EOF
        assert time.perf_counter() - start >= RTT_MS / 2000  # one way, server to client
        writer.close()
        async with asyncio.timeout(1):
            while wan.connections:
                await asyncio.sleep(0.005)
    finally:
        await wan.stop()
        target.close()
        await target.wait_closed()


async def test_serve_wan_runs_until_cancelled(echo: EchoServer) -> None:
    port = free_port()
    ready = asyncio.Event()
    task = asyncio.create_task(serve_wan("127.0.0.1", port, "127.0.0.1", echo.port, 20.0, ready))
    async with asyncio.timeout(1):
        await ready.wait()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await round_trip_s(reader, writer)
    assert 0.020 <= await round_trip_s(reader, writer) < 0.020 + SLACK_S

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    async with asyncio.timeout(1):
        assert await reader.read(100) == b""
    writer.close()
