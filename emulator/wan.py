"""A user-space WAN delay link: a TCP proxy that delays each direction by about rtt_ms / 2.

netem is not available here, so WAN latency is emulated in user space. For every accepted
connection the link opens one connection to the target and runs two pipes (client->target,
target->client). A pipe stamps each chunk it reads with a due time and a writer task sends
the chunks in order, each no earlier than its due time.

Delay: `DelayModel` (pure, seeded RNG) draws one RTT sample per chunk from a lognormal with
the configured mean (`rtt_ms`) and std (`jitter_ms`; 0 = constant), adds `spike_ms` with
probability `spike_probability`, and delays the chunk by half of it. Order is kept: due =
max(previous due in that direction, read time + delay), so a chunk never overtakes the one
before it, whether jitter or a lowered RTT would let it. The two halves of a round trip are
drawn independently, so a measured round trip has the configured mean and a std of about
jitter_ms / sqrt(2).

Bandwidth: `gbps` (Gbit/s; 0 = unlimited, the default) paces each direction as one wire:
a chunk leaves when the bytes ahead of it have left, taking len * 8 * byte_scale / rate,
and arrives half an RTT sample later (`DelayModel.schedule`). The link reads from the
target only as fast as the wire takes bytes (SEND_AHEAD_S ahead, with a small receive
buffer: emulator/wan_socket.py), so bytes not yet sent stay in the target's socket: a
target that resets mid-transfer has sent only what the wire took. `byte_scale` (default
1) is what one byte stands for: twins that send their KV scaled down by S (emulator/
engine/disagg/kv.py) need a link with byte_scale S, so its bytes take their real time.

Run-time change: `WanLink.settings` / `set_rtt_ms`, or the optional HTTP control endpoint
on 127.0.0.1:`control_port` (`GET /rtt`, `POST /rtt` with a JSON object of settings, the
bandwidth's included). Changes apply to bytes read from then on; queued data keeps its due
time.

`RTT_PROFILES` holds the named region RTTs (`network`, `paper`; docs/engine-model.md).

Connection setup: the local accept is instant, but a real TCP handshake costs one RTT
before the client can send. With `handshake=True` (the default) bytes the client sends
during its first RTT (one sample) are treated as sent at accept + RTT, so a fresh
connection's first request/response takes 2 RTT and later ones take 1 RTT, as over a real
WAN. A target that refuses the connection closes the client's connection at once (no RST
delay is modelled).

Backpressure: each pipe holds at most `max_buffered_bytes` in its delay queue; when full
it stops reading, so the sender's TCP window closes. The bound must exceed the
bandwidth-delay product you need: 4 MiB at 90 ms one way is ~44 MiB/s per connection.
EOF is forwarded (half-close) after the data before it; an error on either side closes
both sides of the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import random
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING

from emulator.wan_socket import open_target

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger(__name__)

READ_CHUNK_BYTES = 64 * 1024
# With a bandwidth, how far ahead of the wire the link reads (module docstring): enough
# to keep the wire busy through event-loop delays, small beside any transfer it paces.
SEND_AHEAD_S = 0.02
DEFAULT_MAX_BUFFERED_BYTES = 4 * 1024 * 1024  # see module docstring: bandwidth-delay product
# A blackholed target should not hold a client forever; a real SYN gives up after ~2 min,
# tests and the local stack want a clear failure much sooner.
CONNECT_TIMEOUT_S = 10.0
# The control endpoint changes the link's behaviour and has no authentication: loopback only.
CONTROL_HOST = "127.0.0.1"

# Small jitter for the `network` profile: enough that samples are not all equal, far below
# the region gaps the router must tell apart.
NETWORK_JITTER_FRACTION = 0.05

# profile -> region -> (mean_ms, std_ms) of the round-trip time (docs/engine-model.md).
# RTT between regions (ms): a front door in each region reaches every backend; the
# `network` profile's row for us-ashburn is its single-proxy RTTs, and Frankfurt-Seoul is
# about the public-internet round trip between them.
REGION_RTT_MS: dict[tuple[str, str], float] = {
    ("us-ashburn", "us-ashburn"): 1.0,
    ("us-ashburn", "eu-frankfurt"): 90.0,
    ("us-ashburn", "ap-seoul"): 180.0,
    ("eu-frankfurt", "eu-frankfurt"): 1.0,
    ("eu-frankfurt", "ap-seoul"): 250.0,
    ("ap-seoul", "ap-seoul"): 1.0,
}


def region_rtt_ms(a: str, b: str) -> float:
    """The round trip between two regions of REGION_RTT_MS (symmetric)."""
    try:
        return REGION_RTT_MS[(a, b)] if (a, b) in REGION_RTT_MS else REGION_RTT_MS[(b, a)]
    except KeyError:
        raise ValueError(f"no RTT known between {a!r} and {b!r}") from None


RTT_PROFILES: dict[str, dict[str, tuple[float, float]]] = {
    "network": {
        region: (mean_ms, mean_ms * NETWORK_JITTER_FRACTION)
        for region, mean_ms in (("us-ashburn", 1.0), ("eu-frankfurt", 90.0), ("ap-seoul", 180.0))
    },
    # The GORGO paper's probe readings (mean +- std).
    "paper": {
        "us-ashburn": (37.0, 8.0),
        "eu-frankfurt": (279.0, 80.0),
        "ap-seoul": (456.0, 138.0),
    },
    # Every backend 1 ms away, as near as us-ashburn in `network`: the RTT term cannot help.
    "single": {
        region: (1.0, 1.0 * NETWORK_JITTER_FRACTION)
        for region in ("us-ashburn", "eu-frankfurt", "ap-seoul")
    },
}


def rtt_profile_ms(profile: str, region: str) -> tuple[float, float]:
    """(mean_ms, std_ms) of `region` in RTT profile `profile`; ValueError names what is
    unknown and lists the known names."""
    regions = RTT_PROFILES.get(profile)
    if regions is None:
        raise ValueError(
            f"unknown RTT profile {profile!r}; known profiles: {', '.join(sorted(RTT_PROFILES))}"
        )
    if region not in regions:
        raise ValueError(
            f"unknown region {region!r} in RTT profile {profile!r}; "
            f"known regions: {', '.join(sorted(regions))}"
        )
    return regions[region]


class SettingError(ValueError):
    """A bad delay setting; `key` names it (as in `DelaySettings` and the control API)."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key} {problem}")
        self.key = key
        self.problem = problem


def _check_non_negative(key: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise SettingError(key, f"must be finite and >= 0, got {value!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class DelaySettings:
    """What a link adds to each chunk: an RTT sample (lognormal, mean rtt_ms, std
    jitter_ms) plus spike_ms with probability spike_probability. Validated on creation."""

    rtt_ms: float
    jitter_ms: float = 0.0
    spike_probability: float = 0.0
    spike_ms: float = 0.0
    # Bandwidth per direction, Gbit/s (0: unlimited), and the bytes each byte stands for.
    gbps: float = 0.0
    byte_scale: float = 1.0

    def __post_init__(self) -> None:
        _check_non_negative("rtt_ms", self.rtt_ms)
        _check_non_negative("jitter_ms", self.jitter_ms)
        _check_non_negative("spike_ms", self.spike_ms)
        _check_non_negative("gbps", self.gbps)
        if not (math.isfinite(self.byte_scale) and self.byte_scale >= 1):
            raise SettingError("byte_scale", f"must be finite and >= 1, got {self.byte_scale!r}")
        if not 0.0 <= self.spike_probability <= 1.0:  # also rejects NaN
            raise SettingError(
                "spike_probability", f"must be in [0, 1], got {self.spike_probability!r}"
            )
        if self.jitter_ms > 0 and self.rtt_ms == 0:
            raise SettingError(
                "jitter_ms", "must be 0 when rtt_ms is 0 (a lognormal needs a mean > 0)"
            )

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    def merged(self, changes: Mapping[str, object]) -> DelaySettings:
        """These settings with `changes` (e.g. parsed JSON) applied; SettingError names the
        first unknown key or non-number value, or the setting that fails validation."""
        known = [f.name for f in dataclasses.fields(self)]
        clean: dict[str, float] = {}
        for key, value in changes.items():
            if key not in known:
                raise SettingError(key, f"is not a setting; known: {', '.join(known)}")
            # bool is an int subclass, but `true` is no RTT.
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise SettingError(key, f"must be a number, got {value!r}")
            clean[key] = float(value)
        return dataclasses.replace(self, **clean)


class DelayModel:
    """Pure delay logic: one RTT sample per chunk from `settings`, drawn with the injected
    `rng`. Settings may be replaced at any time; the next sample uses them."""

    def __init__(self, settings: DelaySettings, rng: random.Random) -> None:
        self._rng = rng
        self.settings = settings

    @property
    def settings(self) -> DelaySettings:
        return self._settings

    @settings.setter
    def settings(self, settings: DelaySettings) -> None:
        self._settings = settings
        self._mu = self._sigma = 0.0  # unused when jitter_ms is 0: samples are constant
        # Lognormal parameters from mean m and std s: sigma^2 = ln(1 + s^2/m^2),
        # mu = ln(m) - sigma^2/2 (then E = m and Var = s^2 exactly).
        if settings.jitter_ms > 0:
            sigma2 = math.log1p((settings.jitter_ms / settings.rtt_ms) ** 2)
            self._mu = math.log(settings.rtt_ms) - sigma2 / 2
            self._sigma = math.sqrt(sigma2)

    def sample_rtt_ms(self) -> float:
        """One round-trip sample in ms, spike included if one hits."""
        s = self._settings
        rtt_ms = self._rng.lognormvariate(self._mu, self._sigma) if s.jitter_ms > 0 else s.rtt_ms
        # Draw only when spikes are on, so a constant link uses no randomness at all.
        if s.spike_probability > 0 and self._rng.random() < s.spike_probability:
            rtt_ms += s.spike_ms
        return rtt_ms

    def one_way_delay_s(self) -> float:
        """The delay of one chunk in one direction: half an RTT sample."""
        return self.sample_rtt_ms() / 2000.0

    def due_s(self, read_s: float, previous_due_s: float = -math.inf) -> float:
        """When a chunk read at read_s may be sent: never before the previous chunk in the
        same direction (previous_due_s), so order holds whatever the samples."""
        return max(previous_due_s, read_s + self.one_way_delay_s())

    def transmit_s(self, nbytes: int) -> float:
        """How long nbytes take to leave at the link's bandwidth (0: unlimited)."""
        s = self._settings
        return nbytes * 8 * s.byte_scale / (s.gbps * 1e9) if s.gbps > 0 else 0.0

    def read_bytes(self) -> int:
        """How much to read at once: with a bandwidth, what the wire sends in SEND_AHEAD_S
        (at least 256 bytes), so a sender's unsent bytes stay with it."""
        s = self._settings
        if s.gbps <= 0:
            return READ_CHUNK_BYTES
        return max(256, min(READ_CHUNK_BYTES, int(s.gbps * 1e9 / 8 / s.byte_scale * SEND_AHEAD_S)))

    def schedule(self, pacing: Pacing, read_s: float, nbytes: int) -> float:
        """The due time of a chunk of nbytes read at read_s in `pacing`'s direction: it
        leaves once the bytes ahead of it have (at the bandwidth), then takes half an RTT
        sample, and never arrives before the chunk ahead of it."""
        pacing.sent_s = max(read_s, pacing.sent_s) + self.transmit_s(nbytes)
        pacing.due_s = self.due_s(pacing.sent_s, pacing.due_s)
        return pacing.due_s


@dataclasses.dataclass(slots=True)
class Pacing:
    """One direction's state: when its last chunk is due, and when the wire has sent every
    byte read so far."""

    due_s: float = -math.inf
    sent_s: float = -math.inf


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
    target_port with about rtt_ms / 2 of delay in each direction (see the module
    docstring for jitter and spikes). listen_port=0 picks a free port (read it from `port`
    after start()). control_port (0 or None = off) serves the HTTP control endpoint on
    127.0.0.1. seed makes the delay samples repeatable."""

    def __init__(
        self,
        listen_host: str,
        listen_port: int,
        target_host: str,
        target_port: int,
        rtt_ms: float,
        *,
        jitter_ms: float = 0.0,
        spike_probability: float = 0.0,
        spike_ms: float = 0.0,
        seed: int | None = None,
        control_port: int | None = None,
        handshake: bool = True,
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        gbps: float = 0.0,
        byte_scale: float = 1.0,
    ) -> None:
        if max_buffered_bytes < 1:
            raise ValueError(f"max_buffered_bytes must be >= 1, got {max_buffered_bytes}")
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.target_host = target_host
        self.target_port = target_port
        settings = DelaySettings(rtt_ms, jitter_ms, spike_probability, spike_ms, gbps, byte_scale)
        self._model = DelayModel(settings, random.Random(seed))
        self.control_port = control_port or None
        self.handshake = handshake
        self.max_buffered_bytes = max_buffered_bytes
        self.connect_timeout_s = connect_timeout_s
        self._server: asyncio.Server | None = None
        self._control: web.AppRunner | None = None
        self._connections: set[asyncio.Task[None]] = set()

    # -- configuration ----------------------------------------------------------------

    @property
    def settings(self) -> DelaySettings:
        """Assign new settings to apply them to data read from now on (data already
        queued keeps its due time)."""
        return self._model.settings

    @settings.setter
    def settings(self, settings: DelaySettings) -> None:
        self._model.settings = settings

    @property
    def rtt_ms(self) -> float:
        return self._model.settings.rtt_ms

    @property
    def jitter_ms(self) -> float:
        return self._model.settings.jitter_ms

    def set_rtt_ms(self, rtt_ms: float, jitter_ms: float | None = None) -> None:
        """New RTT mean (and std, if given; None keeps the current jitter_ms) for data
        read from now on. Raises SettingError (a ValueError) naming a bad value."""
        jitter = self.jitter_ms if jitter_ms is None else jitter_ms
        self.settings = dataclasses.replace(self.settings, rtt_ms=rtt_ms, jitter_ms=jitter)

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
        server = await asyncio.start_server(self._on_accept, self.listen_host, self.listen_port)
        if self.control_port is not None:
            try:
                self._control = await _start_control(self, self.control_port)
            except BaseException:
                server.close()
                await server.wait_closed()
                raise
        self._server = server

    async def stop(self) -> None:
        """Stop listening (and the control endpoint) and close every proxied connection."""
        server, self._server = self._server, None
        control, self._control = self._control, None
        if server is not None:
            server.close()
        if control is not None:
            await control.cleanup()
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
        handshake_s = self._model.sample_rtt_ms() / 1000.0 if self.handshake else 0.0
        client_may_send_s = accepted_s + handshake_s
        target_writer: asyncio.StreamWriter | None = None
        tasks: list[asyncio.Task[None]] = []
        try:
            try:
                target_reader, connected = await asyncio.wait_for(
                    open_target(self.target_host, self.target_port, self.settings.gbps > 0),
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
        pacing = Pacing()
        while True:
            if (ahead_s := pacing.sent_s - loop.time()) > SEND_AHEAD_S:
                await asyncio.sleep(ahead_s - SEND_AHEAD_S)  # the wire is busy
            data = await reader.read(self._model.read_bytes())
            due_s = self._model.schedule(pacing, max(loop.time(), may_send_s), len(data))
            await queue.put(due_s, data or None)
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


# -- control endpoint -----------------------------------------------------------------
# aiohttp is imported only when the endpoint is used: the CLI imports this module for its
# help text (RTT_PROFILES) and should stay quick to start.


def make_control_app(link: WanLink) -> web.Application:
    """`GET /rtt` -> the link's settings as JSON; `POST /rtt` with a JSON object of any of
    rtt_ms, jitter_ms, spike_probability, spike_ms, gbps, byte_scale -> applies them all or
    none and returns the new settings; 400 with {"error", "key"} naming the bad key."""
    from aiohttp import web

    def bad_request(error: str, key: str | None = None) -> web.Response:
        return web.json_response({"error": error, "key": key}, status=400)

    async def get_rtt(request: web.Request) -> web.Response:
        return web.json_response(link.settings.as_dict())

    async def post_rtt(request: web.Request) -> web.Response:
        try:
            changes = await request.json()
        except ValueError as exc:
            return bad_request(f"body must be a JSON object: {exc}")
        if not isinstance(changes, dict):
            return bad_request(f"body must be a JSON object, got {type(changes).__name__}")
        try:
            link.settings = link.settings.merged(changes)
        except SettingError as exc:
            return bad_request(str(exc), exc.key)
        log.info("wan link -> %s:%d: settings now %s", link.target_host, link.target_port, changes)
        return web.json_response(link.settings.as_dict())

    app = web.Application()
    app.router.add_get("/rtt", get_rtt)
    app.router.add_post("/rtt", post_rtt)
    return app


async def _start_control(link: WanLink, port: int) -> web.AppRunner:
    from aiohttp import web

    runner = web.AppRunner(make_control_app(link), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, CONTROL_HOST, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


async def serve_wan(
    listen_host: str,
    listen_port: int,
    target_host: str,
    target_port: int,
    rtt_ms: float,
    ready: asyncio.Event | None = None,
    *,
    jitter_ms: float = 0.0,
    seed: int | None = None,
    spike_probability: float = 0.0,
    spike_ms: float = 0.0,
    control_port: int | None = None,
    handshake: bool = True,
    gbps: float = 0.0,
    byte_scale: float = 1.0,
) -> None:
    """Run one WAN link until cancelled; `ready` is set once it accepts connections (and
    the control endpoint, if control_port is set, is up)."""
    link = WanLink(
        listen_host,
        listen_port,
        target_host,
        target_port,
        rtt_ms,
        jitter_ms=jitter_ms,
        spike_probability=spike_probability,
        spike_ms=spike_ms,
        seed=seed,
        control_port=control_port,
        handshake=handshake,
        gbps=gbps,
        byte_scale=byte_scale,
    )
    await link.start()
    try:
        s = link.settings
        control = f", control http://{CONTROL_HOST}:{control_port}/rtt" if control_port else ""
        log.info(
            "wan link %s:%d -> %s:%d: %s%s", listen_host, link.port, target_host, target_port,
            s.as_dict(), control,
        )  # fmt: skip
        if ready is not None:
            ready.set()
        await asyncio.Event().wait()  # until cancelled
    finally:
        await link.stop()
