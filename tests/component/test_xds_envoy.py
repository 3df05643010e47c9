"""envoy.xds_dir against the real Envoy binary: the generated bootstrap takes its backend
clusters from the files ext_proc/envoy_config/xds.py writes, and Envoy follows each
rewrite without a restart, without failing a request in flight and (EDS) without dropping
the connections of the backends that stay. No router runs: requests fail open to
`gorgo_fallback`. Last, wait_envoy with static clusters, against a stand-in for Envoy's
admin."""

from __future__ import annotations

import asyncio
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from emulator.stack.ports import free_ports
from emulator.stack.processes import envoy_binary
from ext_proc.config.load import config_from_dict
from ext_proc.config.schema import Config
from ext_proc.envoy_config.bootstrap import render_envoy_config
from ext_proc.envoy_config.xds import missing_in, wait_envoy, write_xds
from tests.xds_configs import BACKENDS, cfg_of

pytestmark = pytest.mark.component


@dataclass
class Upstream:
    """An engine stand-in: streams `n` chunks 50 ms apart and records the client port of
    every request (one port = one upstream connection of Envoy's)."""

    port: int = 0
    peers: list[int] = field(default_factory=list)
    runner: web.AppRunner | None = None

    async def start(self) -> None:
        async def handle(request: web.Request) -> web.StreamResponse:
            peer = request.transport.get_extra_info("peername") if request.transport else None
            self.peers.append(peer[1] if peer else -1)
            r = web.StreamResponse()
            await r.prepare(request)
            for i in range(int(request.query.get("n", "1"))):
                await r.write(f"data: {i}\n\n".encode())
                await asyncio.sleep(0.05)
            await r.write(b"data: [DONE]\n\n")
            return r

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self.runner:
            await self.runner.cleanup()


def fleet(tmp: Path, ups: dict[str, Upstream], ports: list[int], **envoy: Any) -> Config:
    listen, admin, grpc = ports
    return config_from_dict(
        {
            # no router listens here: Envoy fails open to the fallback route
            "listen": {"grpc": f"127.0.0.1:{grpc}"},
            "envoy": {
                "listen": f"127.0.0.1:{listen}",
                "admin": f"127.0.0.1:{admin}",
                "xds_dir": str(tmp / "xds"),
                **envoy,
            },
            "backends": [
                {"id": bid, "address": f"127.0.0.1:{u.port}", "rtt_prior_ms": int(bid[1:])}
                for bid, u in ups.items()
            ],
        }
    )


def clusters_text(cfg: Config) -> str:
    with urllib.request.urlopen(f"http://{cfg.envoy.admin}/clusters", timeout=2) as r:
        text: str = r.read().decode()
    return text


def priorities(text: str, cluster: str) -> dict[int, int]:
    """Upstream port -> priority of each endpoint of `cluster` in Envoy's /clusters."""
    out = {}
    for line in text.splitlines():
        parts = line.split("::")
        if parts[0] == cluster and len(parts) == 4 and parts[2] == "priority":
            out[int(parts[1].rsplit(":", 1)[1])] = int(parts[3])
    return out


@pytest.fixture
def envoy_proc(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def start_envoy(cfg: Config, tmp: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    """As `gorgo envoy-config` does: the files first, then the bootstrap that names them."""
    write_xds(cfg)
    boot = tmp / "envoy.yaml"
    boot.write_text(render_envoy_config(cfg))
    log = open(tmp / "envoy.log", "wb")  # noqa: SIM115 - closed with the process
    procs.append(
        subprocess.Popen(
            [envoy_binary(), "-c", str(boot), "--disable-hot-restart", "--concurrency", "1",
             "--log-level", "info"],
            stdout=log, stderr=subprocess.STDOUT,
        )
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(f"http://{cfg.envoy.admin}/ready", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert procs[-1].poll() is None, (tmp / "envoy.log").read_text()
        assert time.monotonic() < deadline, "Envoy not ready"
        time.sleep(0.05)


@pytest.fixture
async def upstreams() -> AsyncIterator[list[Upstream]]:
    ups = [Upstream() for _ in range(5)]
    for u in ups:
        await u.start()
    yield ups
    for u in ups:
        await u.stop()


async def stream(http: aiohttp.ClientSession, cfg: Config, chunks: int) -> tuple[int, int]:
    url = f"http://{cfg.envoy.listen}/v1/chat/completions?n={chunks}"
    async with http.post(url, json={"model": "m", "messages": []}) as r:
        body = await r.read()
        return r.status, body.count(b"data:")


async def test_envoy_follows_the_files_without_failing_or_reconnecting(
    tmp_path: Path, upstreams: list[Upstream], envoy_proc: list[subprocess.Popen[bytes]]
) -> None:
    u0, u1, u2, u3 = upstreams[:4]
    ports = free_ports(3)
    three = fleet(tmp_path, {"b0": u0, "b1": u1, "b2": u2}, ports)
    start_envoy(three, tmp_path, envoy_proc)
    assert await wait_envoy(three, timeout_s=5) == []
    text = clusters_text(three)
    # each backend's cluster: itself at priority 0, the others nearest first
    assert priorities(text, "b0") == {u0.port: 0, u1.port: 1, u2.port: 2}
    assert len(priorities(text, "gorgo_fallback")) == 3

    async with aiohttp.ClientSession() as http:
        for _ in range(6):  # warm connections (one worker, least request over three)
            assert await stream(http, three, 1) == (200, 2)
        # requests in flight across every change below (each ~1 s)
        flight = [asyncio.create_task(stream(http, three, 20)) for _ in range(12)]
        await asyncio.sleep(0.2)

        # (1) add b3: Envoy routes to it after a short wait
        four = fleet(tmp_path, {"b0": u0, "b1": u1, "b2": u2, "b3": u3}, ports)
        t0 = time.monotonic()
        write_xds(four)
        assert await wait_envoy(four, timeout_s=5) == []
        added_s = time.monotonic() - t0
        text = clusters_text(four)
        assert priorities(text, "b0")[u3.port] == 3
        assert priorities(text, "b3") == {u3.port: 0, u0.port: 1, u1.port: 2, u2.port: 3}

        # (2) drain b1: its cluster stays, nothing else sends it new work
        write_xds(four, draining={"b1"})
        await asyncio.sleep(0.3)
        text = clusters_text(four)
        assert priorities(text, "b1") == {u1.port: 0, u0.port: 1, u2.port: 2, u3.port: 3}
        assert u1.port not in priorities(text, "gorgo_fallback")
        assert priorities(text, "b0") == {u0.port: 0, u2.port: 1, u3.port: 2}
        assert await wait_envoy(four, draining={"b1"}, timeout_s=1) == []

        # (3) remove b1: its cluster and its endpoint file go
        without = fleet(tmp_path, {"b0": u0, "b2": u2, "b3": u3}, ports)
        write_xds(without)
        await asyncio.sleep(0.3)
        text = clusters_text(without)
        assert not any(line.startswith("b1::") for line in text.splitlines())
        assert not (tmp_path / "xds" / "eds-b1.yaml").exists()
        assert missing_in(text, without) == []
        assert missing_in(text, four) == ["b1"]

        results = await asyncio.gather(*flight)
        assert results == [(200, 21)] * 12  # every request in flight finished whole

        # the backends that stayed kept their connections: EDS changed endpoints only
        seen = {u.port: set(u.peers) for u in (u0, u2)}
        for _ in range(9):
            assert await stream(http, without, 1) == (200, 2)
        for u in (u0, u2):
            assert set(u.peers) <= seen[u.port], "a kept backend was reconnected"
    assert added_s < 2.0, added_s
    log = (tmp_path / "envoy.log").read_text()
    assert "rejected" not in log.lower(), log[-3000:]


async def test_the_endpoint_picker_pool_follows_the_files(
    tmp_path: Path, upstreams: list[Upstream], envoy_proc: list[subprocess.Popen[bytes]]
) -> None:
    u0, u1, u2 = upstreams[:3]
    ports = free_ports(3)
    two = fleet(tmp_path, {"b0": u0, "b1": u1}, ports, mode="endpoint_picker")
    start_envoy(two, tmp_path, envoy_proc)
    assert await wait_envoy(two, timeout_s=5) == []
    three = fleet(tmp_path, {"b0": u0, "b1": u1, "b2": u2}, ports, mode="endpoint_picker")
    async with aiohttp.ClientSession() as http:
        flight = [asyncio.create_task(stream(http, two, 20)) for _ in range(6)]
        await asyncio.sleep(0.2)
        write_xds(three)
        assert await wait_envoy(three, timeout_s=5) == []
        assert set(priorities(clusters_text(three), "gorgo_pool")) == {u0.port, u1.port, u2.port}
        write_xds(three, draining={"b0"})  # out of the pool at once: the router names it no more
        await asyncio.sleep(0.3)
        assert set(priorities(clusters_text(three), "gorgo_pool")) == {u1.port, u2.port}
        assert await asyncio.gather(*flight) == [(200, 21)] * 6


async def test_static_clusters_are_confirmed_when_envoys_admin_answers() -> None:
    """xds_dir "": Envoy's clusters are not ours; a backend its admin does not list stays
    missing (pending: no 503s), and an admin out of reach confirms nothing at once."""
    from aiohttp import web

    from ext_proc.envoy_config.xds import wait_envoy

    (port,) = free_ports(1)
    cfg = cfg_of("", admin=f"127.0.0.1:{port}")
    assert await wait_envoy(cfg, timeout_s=0.3) == []  # no admin there

    async def clusters(_: web.Request) -> web.Response:
        return web.Response(text="")  # Envoy knows none of them

    app = web.Application()
    app.router.add_get("/clusters", clusters)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        assert sorted(await wait_envoy(cfg, timeout_s=0.3)) == sorted(b["id"] for b in BACKENDS)
    finally:
        await runner.cleanup()
