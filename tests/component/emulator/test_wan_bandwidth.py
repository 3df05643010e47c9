"""The WAN link's bandwidth with real sockets on 127.0.0.1: a megabyte through a link of a
set rate takes about its time (bytes / rate + RTT / 2), either way, scaled or not, and a
rate posted to the control endpoint applies to the bytes read after it."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from emulator.wan import WanLink

MB = 1_000_000
RTT_MS = 20.0
SLACK_S = 0.080  # scheduling allowance on a shared 2-core machine


class Source:
    """A target that answers each connection with `size` bytes, then closes."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(1)  # the client's request
        writer.write(b"\0" * self.size)
        await writer.drain()
        writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


@pytest.fixture
async def source() -> AsyncIterator[Source]:
    src = Source(MB)
    await src.start()
    yield src
    await src.stop()


async def download_s(port: int) -> float:
    """Ask for the bytes; seconds until the last one arrived."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        start = time.perf_counter()
        writer.write(b"?")
        await writer.drain()
        async with asyncio.timeout(5):
            data = await reader.read(-1)
        assert len(data) == MB
        return time.perf_counter() - start
    finally:
        writer.close()


@pytest.mark.parametrize(("gbps", "byte_scale"), [(0.08, 1.0), (80.0, 1000.0)])
async def test_a_megabyte_takes_its_time_at_the_rate(
    source: Source, gbps: float, byte_scale: float
) -> None:
    # 10 MB/s (or a megabyte standing for a gigabyte at 10 GB/s): 0.1 s on the wire.
    wan = WanLink(
        "127.0.0.1",
        0,
        "127.0.0.1",
        source.port,
        RTT_MS,
        handshake=False,
        gbps=gbps,
        byte_scale=byte_scale,
    )
    await wan.start()
    try:
        expected_s = RTT_MS / 1000 + MB * 8 * byte_scale / (gbps * 1e9)
        took_s = await download_s(wan.port)
        assert expected_s <= took_s < expected_s + SLACK_S
    finally:
        await wan.stop()


async def test_the_upload_direction_is_paced_too() -> None:
    got = asyncio.Event()
    received = 0

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal received
        while chunk := await reader.read(65536):
            received += len(chunk)
        got.set()
        writer.close()

    server = await asyncio.start_server(sink, "127.0.0.1", 0)
    port = int(server.sockets[0].getsockname()[1])
    wan = WanLink("127.0.0.1", 0, "127.0.0.1", port, RTT_MS, handshake=False, gbps=0.08)
    await wan.start()
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", wan.port)
        start = time.perf_counter()
        writer.write(b"\0" * MB)
        writer.write_eof()
        async with asyncio.timeout(5):
            await got.wait()
        took_s = time.perf_counter() - start
        assert received == MB
        expected_s = RTT_MS / 2000 + 0.1
        assert expected_s <= took_s < expected_s + SLACK_S
        writer.close()
    finally:
        await wan.stop()
        server.close()
        await server.wait_closed()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_the_control_endpoint_sets_the_rate_at_run_time(source: Source) -> None:
    wan = WanLink(
        "127.0.0.1",
        0,
        "127.0.0.1",
        source.port,
        RTT_MS,
        handshake=False,
        control_port=free_port(),
    )
    await wan.start()
    try:
        assert await download_s(wan.port) < RTT_MS / 1000 + SLACK_S  # unlimited
        url = f"http://127.0.0.1:{wan.control_port}/rtt"
        async with aiohttp.ClientSession() as http:
            async with http.post(url, json={"gbps": 0.04}) as resp:
                assert resp.status == 200
                assert (await resp.json())["gbps"] == 0.04
            async with http.post(url, json={"gbps": -1}) as resp:
                assert resp.status == 400
                assert (await resp.json())["key"] == "gbps"
        expected_s = RTT_MS / 1000 + 0.2  # 5 MB/s
        took_s = await download_s(wan.port)
        assert expected_s <= took_s < expected_s + SLACK_S
    finally:
        await wan.stop()
