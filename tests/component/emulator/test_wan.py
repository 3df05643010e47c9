"""The user-space WAN delay link, with real sockets on 127.0.0.1 (no mocks)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
import socket
import statistics
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from emulator.wan import (
    RTT_PROFILES,
    DelayModel,
    DelaySettings,
    SettingError,
    WanLink,
    rtt_profile_ms,
    serve_wan,
)
from ext_proc.cli import build_parser, main

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


# -- DelayModel and settings: pure, no sockets -----------------------------------------


def samples_ms(settings: DelaySettings, n: int, seed: int = 1) -> list[float]:
    model = DelayModel(settings, random.Random(seed))
    return [model.sample_rtt_ms() for _ in range(n)]


def test_constant_delay_when_jitter_is_zero() -> None:
    rng = random.Random(5)
    state = rng.getstate()
    model = DelayModel(DelaySettings(80.0), rng)
    assert [model.sample_rtt_ms() for _ in range(100)] == [80.0] * 100
    assert model.one_way_delay_s() == 0.040
    assert rng.getstate() == state  # a constant link draws nothing


def test_seeded_samples_repeat() -> None:
    settings = DelaySettings(90.0, jitter_ms=20.0, spike_probability=0.1, spike_ms=200.0)
    assert samples_ms(settings, 200, seed=42) == samples_ms(settings, 200, seed=42)
    assert samples_ms(settings, 200, seed=42) != samples_ms(settings, 200, seed=43)


@pytest.mark.parametrize(("profile", "region"), [("paper", "eu-frankfurt"), ("paper", "ap-seoul")])
def test_lognormal_matches_profile_mean_and_std(profile: str, region: str) -> None:
    mean_ms, std_ms = rtt_profile_ms(profile, region)
    rtts = samples_ms(DelaySettings(mean_ms, std_ms), 5_000)
    assert statistics.fmean(rtts) == pytest.approx(mean_ms, rel=0.05)
    assert statistics.pstdev(rtts) == pytest.approx(std_ms, rel=0.05)
    assert min(rtts) > 0  # lognormal: never a negative delay


def test_spikes_hit_at_the_configured_rate_and_add_spike_ms() -> None:
    rtts = samples_ms(DelaySettings(100.0, spike_probability=0.02, spike_ms=500.0), 20_000)
    assert set(rtts) == {100.0, 600.0}
    # 400 expected, binomial std ~20: 300..500 is five std each side.
    assert 300 <= rtts.count(600.0) <= 500


def test_due_times_never_decrease_even_when_jitter_would_reorder() -> None:
    model = DelayModel(DelaySettings(50.0, jitter_ms=40.0), random.Random(3))
    reads_s = [i * 0.001 for i in range(2_000)]  # a chunk every ms, jitter >> 1 ms
    due_s, dues_s, raw_s = -math.inf, [], []
    for read_s in reads_s:
        delay_s = model.one_way_delay_s()
        raw_s.append(read_s + delay_s)
        due_s = max(due_s, read_s + delay_s)
        dues_s.append(due_s)
    # The same sequence through due_s(), from the same seed.
    model = DelayModel(DelaySettings(50.0, jitter_ms=40.0), random.Random(3))
    got_s: list[float] = []
    for read_s in reads_s:
        got_s.append(model.due_s(read_s, got_s[-1] if got_s else -math.inf))
    assert got_s == dues_s
    assert all(a <= b for a, b in itertools.pairwise(got_s))
    assert any(a > b for a, b in itertools.pairwise(raw_s))  # jitter would reorder
    assert all(due >= raw for due, raw in zip(got_s, raw_s, strict=True))


@given(
    gaps_s=st.lists(st.floats(0, 0.05), min_size=1, max_size=50),
    rtt_ms=st.floats(0.1, 500),
    jitter_fraction=st.floats(0, 2),
    seed=st.integers(0, 2**32),
)
def test_due_times_property(
    gaps_s: list[float], rtt_ms: float, jitter_fraction: float, seed: int
) -> None:
    model = DelayModel(DelaySettings(rtt_ms, rtt_ms * jitter_fraction), random.Random(seed))
    read_s, due_s = 0.0, -math.inf
    for gap_s in gaps_s:
        read_s += gap_s
        new_due_s = model.due_s(read_s, due_s)
        assert new_due_s >= due_s
        assert new_due_s >= read_s
        due_s = new_due_s


def test_settings_change_applies_to_next_sample() -> None:
    model = DelayModel(DelaySettings(10.0), random.Random(1))
    assert model.sample_rtt_ms() == 10.0
    model.settings = DelaySettings(120.0)
    assert model.sample_rtt_ms() == 120.0


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"rtt_ms": -1.0}, "rtt_ms"),
        ({"rtt_ms": math.inf}, "rtt_ms"),
        ({"rtt_ms": 10.0, "jitter_ms": -0.5}, "jitter_ms"),
        ({"rtt_ms": 0.0, "jitter_ms": 1.0}, "jitter_ms"),
        ({"rtt_ms": 10.0, "spike_probability": 1.5}, "spike_probability"),
        ({"rtt_ms": 10.0, "spike_probability": math.nan}, "spike_probability"),
        ({"rtt_ms": 10.0, "spike_ms": -3.0}, "spike_ms"),
    ],
)
def test_bad_settings_name_the_key(kwargs: dict[str, float], key: str) -> None:
    with pytest.raises(SettingError, match=f"^{key} ") as info:
        DelaySettings(**kwargs)
    assert info.value.key == key


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"bogus": 1}, "bogus"),
        ({"rtt_ms": "5"}, "rtt_ms"),
        ({"spike_ms": True}, "spike_ms"),
        ({"jitter_ms": None}, "jitter_ms"),
        ({"rtt_ms": 5, "spike_probability": 2}, "spike_probability"),
    ],
)
def test_merged_rejects_bad_changes(changes: dict[str, Any], key: str) -> None:
    with pytest.raises(SettingError) as info:
        DelaySettings(10.0).merged(changes)
    assert info.value.key == key


def test_merged_applies_numbers() -> None:
    merged = DelaySettings(10.0).merged({"rtt_ms": 90, "jitter_ms": 4.5})
    assert merged == DelaySettings(90.0, 4.5)
    assert merged.as_dict() == {
        "rtt_ms": 90.0,
        "jitter_ms": 4.5,
        "spike_probability": 0.0,
        "spike_ms": 0.0,
        "gbps": 0.0,
        "byte_scale": 1.0,
    }


def test_rtt_profiles() -> None:
    assert rtt_profile_ms("paper", "eu-frankfurt") == (279.0, 80.0)
    assert rtt_profile_ms("paper", "us-ashburn") == (37.0, 8.0)
    assert rtt_profile_ms("paper", "ap-seoul") == (456.0, 138.0)
    assert rtt_profile_ms("network", "us-ashburn") == pytest.approx((1.0, 0.05))
    assert rtt_profile_ms("network", "eu-frankfurt") == pytest.approx((90.0, 4.5))
    assert rtt_profile_ms("network", "ap-seoul") == pytest.approx((180.0, 9.0))
    for regions in RTT_PROFILES.values():  # every profile covers the default fleet
        assert set(regions) == {"us-ashburn", "eu-frankfurt", "ap-seoul"}


def test_rtt_profile_errors_name_the_unknown_and_list_the_known() -> None:
    with pytest.raises(ValueError, match=r"unknown RTT profile 'lan'.*network, paper"):
        rtt_profile_ms("lan", "us-ashburn")
    with pytest.raises(
        ValueError, match=r"unknown region 'mars' in RTT profile 'paper'.*ap-seoul, eu-frankfurt"
    ):
        rtt_profile_ms("paper", "mars")


def test_set_rtt_ms_keeps_or_replaces_jitter() -> None:
    wan = WanLink("127.0.0.1", 0, "127.0.0.1", 1, 90.0, jitter_ms=4.5)
    wan.set_rtt_ms(180.0)
    assert (wan.rtt_ms, wan.jitter_ms) == (180.0, 4.5)
    wan.set_rtt_ms(37.0, jitter_ms=8.0)
    assert (wan.rtt_ms, wan.jitter_ms) == (37.0, 8.0)
    with pytest.raises(SettingError, match="jitter_ms"):
        wan.set_rtt_ms(0.0)  # a lognormal needs a positive mean
    wan.set_rtt_ms(0.0, jitter_ms=0.0)
    assert wan.settings == DelaySettings(0.0)


# -- live links with jitter and the control endpoint -----------------------------------


async def test_jittered_link_keeps_byte_order_over_many_small_writes(echo: EchoServer) -> None:
    # Jitter (std 8 ms) far above the write spacing (~1 ms): the samples alone would
    # reorder chunks in both directions; due times and the FIFO writer must not let them.
    wan = WanLink(
        "127.0.0.1", 0, "127.0.0.1", echo.port, 10.0, jitter_ms=8.0, seed=11, handshake=False
    )
    await wan.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", wan.port)
        payload = b"".join(b"%04d;" % i for i in range(300))

        async def send() -> None:
            for i in range(0, len(payload), 5):
                writer.write(payload[i : i + 5])
                await writer.drain()
                await asyncio.sleep(0.001)  # separate reads at the link
            writer.write_eof()

        async with asyncio.timeout(3):
            sender = asyncio.create_task(send())
            received = await reader.read(-1)
            await sender
        assert received == payload
        writer.close()
    finally:
        await wan.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        yield session


@pytest.fixture
async def controlled(echo: EchoServer) -> AsyncIterator[WanLink]:
    wan = WanLink("127.0.0.1", 0, "127.0.0.1", echo.port, 20.0, control_port=free_port())
    await wan.start()
    yield wan
    await wan.stop()
    assert wan.connections == 0


def control_url(wan: WanLink) -> str:
    return f"http://127.0.0.1:{wan.control_port}/rtt"


async def test_control_endpoint_changes_rtt_of_an_open_connection(
    controlled: WanLink, http: aiohttp.ClientSession
) -> None:
    async with http.get(control_url(controlled)) as resp:
        assert resp.status == 200
        assert await resp.json() == {
            "rtt_ms": 20.0,
            "jitter_ms": 0.0,
            "spike_probability": 0.0,
            "spike_ms": 0.0,
            "gbps": 0.0,
            "byte_scale": 1.0,
        }
    reader, writer = await asyncio.open_connection("127.0.0.1", controlled.port)
    try:
        await round_trip_s(reader, writer)  # pay the handshake
        assert 0.020 <= await round_trip_s(reader, writer) < 0.020 + SLACK_S

        async with http.post(control_url(controlled), json={"rtt_ms": 120}) as resp:
            assert resp.status == 200
            assert (await resp.json())["rtt_ms"] == 120.0
        assert 0.120 <= await round_trip_s(reader, writer) < 0.120 + SLACK_S

        async with http.post(control_url(controlled), json={"spike_ms": 300}) as resp:
            assert await resp.json() == {
                "rtt_ms": 120.0,  # keys not posted keep their values
                "jitter_ms": 0.0,
                "spike_probability": 0.0,
                "spike_ms": 300.0,
                "gbps": 0.0,
                "byte_scale": 1.0,
            }
        async with http.get(control_url(controlled)) as resp:
            assert (await resp.json())["spike_ms"] == 300.0
    finally:
        writer.close()


@pytest.mark.parametrize(
    ("body", "key"),
    [
        ({"rtt_ms": -1}, "rtt_ms"),
        ({"jitter_ms": "5"}, "jitter_ms"),
        ({"spike_probability": 1.5}, "spike_probability"),
        ({"spike_ms": True}, "spike_ms"),
        ({"latency": 10}, "latency"),
        ({"rtt_ms": 50, "spike_probability": -0.1}, "spike_probability"),  # all or nothing
        ([20], None),
    ],
)
async def test_control_endpoint_rejects_bad_input_naming_the_key(
    controlled: WanLink, http: aiohttp.ClientSession, body: object, key: str | None
) -> None:
    before = controlled.settings
    async with http.post(control_url(controlled), json=body) as resp:
        assert resp.status == 400
        error = await resp.json()
    assert error["key"] == key
    if key is not None:
        assert key in error["error"]
    assert controlled.settings == before


async def test_control_endpoint_rejects_a_body_that_is_not_json(
    controlled: WanLink, http: aiohttp.ClientSession
) -> None:
    async with http.post(control_url(controlled), data=b"rtt_ms=5") as resp:
        assert resp.status == 400
        assert "JSON" in (await resp.json())["error"]
    assert controlled.rtt_ms == 20.0


async def test_busy_control_port_fails_start_and_leaves_nothing_listening(
    echo: EchoServer,
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        wan = WanLink(
            "127.0.0.1", 0, "127.0.0.1", echo.port, 5.0, control_port=busy.getsockname()[1]
        )
        with pytest.raises(OSError):
            await wan.start()
        with pytest.raises(RuntimeError, match="not started"):
            _ = wan.port
        await wan.stop()


async def test_serve_wan_takes_jitter_seed_spikes_and_control(
    echo: EchoServer, http: aiohttp.ClientSession
) -> None:
    port, control_port = free_port(), free_port()
    ready = asyncio.Event()
    task = asyncio.create_task(
        serve_wan(
            "127.0.0.1",
            port,
            "127.0.0.1",
            echo.port,
            20.0,
            ready,
            jitter_ms=2.0,
            seed=1,
            spike_probability=0.5,
            spike_ms=10.0,
            control_port=control_port,
        )
    )
    try:
        async with asyncio.timeout(1):
            await ready.wait()
        async with http.get(f"http://127.0.0.1:{control_port}/rtt") as resp:
            assert await resp.json() == {
                "rtt_ms": 20.0,
                "jitter_ms": 2.0,
                "spike_probability": 0.5,
                "spike_ms": 10.0,
                "gbps": 0.0,
                "byte_scale": 1.0,
            }
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await round_trip_s(reader, writer)
        assert 0.010 <= await round_trip_s(reader, writer) < 0.040 + SLACK_S
        writer.close()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


# -- the `gorgo wan` command line (no servers started) ---------------------------------


@pytest.fixture
def busy_listen() -> Iterator[str]:
    """A host:port already taken: should a bad combination slip through validation, the
    link fails to bind and main() returns 1 instead of serving forever."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield f"127.0.0.1:{busy.getsockname()[1]}"


def run_wan_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[object, str]:
    try:
        rc: object = main(argv)
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "one of the arguments --rtt-ms --profile is required"),
        (["--rtt-ms", "5", "--profile", "paper"], "--profile: not allowed with argument --rtt-ms"),
        (["--profile", "paper"], "--region is required with --profile"),
        (["--profile", "lan", "--region", "ap-seoul"], "--profile: invalid choice: 'lan'"),
        (["--profile", "paper", "--region", "mars"], "unknown region 'mars'"),
        (["--profile", "paper", "--region", "ap-seoul", "--jitter-ms", "3"], "--jitter-ms"),
        (["--rtt-ms", "5", "--region", "ap-seoul"], "--region goes with --profile"),
        (["--rtt-ms", "-1"], "--rtt-ms must be finite and >= 0"),
        (["--rtt-ms", "0", "--jitter-ms", "2"], "--jitter-ms must be 0 when rtt_ms is 0"),
        (["--rtt-ms", "5", "--spike-probability", "1.5"], "--spike-probability must be in [0, 1]"),
        (["--rtt-ms", "5", "--spike-ms", "-2"], "--spike-ms must be finite and >= 0"),
        (["--rtt-ms", "5", "--control-port", "70000"], "--control-port must be in 0..65535"),
        (["--rtt-ms", "five"], "--rtt-ms: invalid float value"),
    ],
)
def test_cli_rejects_bad_combinations(
    busy_listen: str, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    argv = ["wan", "--listen", busy_listen, "--target", "127.0.0.1:1", *extra]
    rc, err = run_wan_cli(argv, capsys)
    assert rc == 2
    assert message in err


def test_cli_parses_every_wan_flag() -> None:
    args = build_parser().parse_args(
        [
            "wan",
            "--listen", "127.0.0.1:18101",
            "--target", "127.0.0.1:30001",
            "--profile", "paper",
            "--region", "eu-frankfurt",
            "--seed", "7",
            "--spike-probability", "0.01",
            "--spike-ms", "300",
            "--control-port", "18201",
        ]
    )  # fmt: skip
    assert (args.profile, args.region, args.rtt_ms, args.jitter_ms) == (
        "paper",
        "eu-frankfurt",
        None,
        None,
    )
    assert (args.seed, args.spike_probability, args.spike_ms, args.control_port) == (
        7,
        0.01,
        300.0,
        18201,
    )
    args = build_parser().parse_args(
        ["wan", "--listen", ":1", "--target", ":2", "--rtt-ms", "90", "--jitter-ms", "4.5"]
    )
    assert (args.rtt_ms, args.jitter_ms, args.seed, args.spike_probability) == (
        90.0,
        4.5,
        None,
        0.0,
    )
    assert (args.spike_ms, args.control_port) == (0.0, 0)  # no spikes, no control endpoint


def test_cli_help_lists_the_profiles_numbers(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option: no wrapped names
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["wan", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for text in (
        "network: us-ashburn 1+-0.05, eu-frankfurt 90+-4.5, ap-seoul 180+-9",
        "paper: us-ashburn 37+-8, eu-frankfurt 279+-80, ap-seoul 456+-138",
        "--control-port PORT",
        "--spike-probability P",
    ):
        assert text in out
