"""A real Envoy, run from `gorgo envoy-config`'s bootstrap, and a real `gorgo serve` export
every metric the dashboard and the alerts name, with the labels they match on
(tests/monitoring.py reads the selectors; tests/unit/service/telemetry/test_telemetry.py checks them
against the router's rendered metrics)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from emulator.engine.config import EngineConfig
from emulator.engine.server import EngineServer
from emulator.stack.ports import free_ports
from emulator.stack.processes import envoy_binary
from ext_proc.config.load import config_from_dict
from ext_proc.config.schema import Config
from ext_proc.envoy_config.bootstrap import render_envoy_config
from ext_proc.service.app import running_service
from tests.monitoring import all_selectors, check_selectors, exported


async def _wait_http(url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{url} did not answer in {timeout_s} s")
            await asyncio.sleep(0.05)


async def _scrape(url: str) -> dict[str, list[dict[str, str]]]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200, url
        return exported(await r.text())


def _value(text: str, name: str) -> float:
    """A front-door counter's value from the raw exposition."""
    m = re.search(rf'^{name}\{{envoy_http_conn_manager_prefix="front_door"\}} (\S+)$', text, re.M)
    assert m, f"{name} missing"
    return float(m.group(1))


async def _chat(session: aiohttp.ClientSession, url: str, i: int) -> int:
    body = {"model": "m", "stream": True, "max_tokens": 4,
            "messages": [{"role": "user", "content": f"hello {i}"}]}  # fmt: skip
    async with session.post(f"{url}/v1/chat/completions", json=body) as r:
        await r.read()
        return r.status


@dataclass
class LiveFleet:
    cfg: Config
    front_door: str
    envoy_admin: str


@pytest.fixture
async def live_fleet(tmp_path: Path) -> AsyncIterator[LiveFleet]:
    """One emulated engine behind two backend ids, and a real Envoy in front, with
    nothing yet on the router's gRPC port."""
    engine = EngineServer(EngineConfig.zero_delay("us-ashburn"), "127.0.0.1", 0)
    await engine.start()
    front, admin, grpc_port, gorgo_admin = free_ports(4)
    cfg = config_from_dict(
        {
            "policy": "gorgo",
            "tuner": {"mode": "paired", "arm_size": 4},
            # on, so the flow-control series the dashboard and alerts name exist
            "flow_control": {"enabled": True},
            "listen": {"grpc": f"127.0.0.1:{grpc_port}", "admin": f"127.0.0.1:{gorgo_admin}"},
            "envoy": {"listen": f"127.0.0.1:{front}", "admin": f"127.0.0.1:{admin}"},
            "backends": [
                {"id": b, "address": f"127.0.0.1:{engine.port}", "rtt_prior_ms": 1}
                for b in ("us-ashburn", "eu-frankfurt")
            ],
        }
    )
    bootstrap = tmp_path / "envoy.yaml"
    bootstrap.write_text(render_envoy_config(cfg))
    envoy = subprocess.Popen(
        [envoy_binary(), "-c", str(bootstrap), "--disable-hot-restart", "--log-level", "warn"],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "envoy.log").open("w"),
    )
    try:
        await _wait_http(f"http://127.0.0.1:{admin}/ready")
        yield LiveFleet(cfg, f"http://127.0.0.1:{front}", f"http://127.0.0.1:{admin}")
    finally:
        envoy.terminate()
        envoy.wait(timeout=10)
        await engine.stop()


@pytest.mark.e2e
async def test_a_real_envoy_and_gorgo_serve_export_what_they_name(live_fleet: LiveFleet) -> None:
    """Router down, then up: Envoy counts each request let through without the router
    once (the fail-open share's numerator), and both export every name the dashboard and
    the alerts use, with the labels they match on."""
    stats = f"{live_fleet.envoy_admin}/stats/prometheus"
    n = 3
    async with aiohttp.ClientSession() as session:
        # the router is down: Envoy fails open, the fallback route serves
        statuses = [await _chat(session, live_fleet.front_door, i) for i in range(n)]
        assert statuses == [200] * n
        async with session.get(stats) as r:
            down = await r.text()
        assert _value(down, "envoy_http_ext_proc_failure_mode_allowed") == n
        assert _value(down, "envoy_http_downstream_rq_total") == n

        async with running_service(live_fleet.cfg) as svc:
            metrics = f"http://127.0.0.1:{svc.admin_port}/metrics"
            await _wait_http(metrics)
            statuses = [await _chat(session, live_fleet.front_door, i) for i in range(n)]
            async with session.get(f"{live_fleet.front_door}/health") as r:
                assert r.status == 200  # not an LLM call: the fallback route
            assert statuses == [200] * n
            deadline = time.monotonic() + 10
            while sum(b.stats.completed for b in svc.router.backends.values()) < n or not any(
                b.stats.fallback_completed for b in svc.router.backends.values()
            ):
                assert time.monotonic() < deadline, "completions did not arrive"
                await asyncio.sleep(0.05)
            assert svc.router.decisions == n
            router_names = await _scrape(metrics)
            async with session.get(stats) as r:
                up = await r.text()
    # with the router up, nothing more failed open
    assert _value(up, "envoy_http_ext_proc_failure_mode_allowed") == n
    assert _value(up, "envoy_http_downstream_rq_total") == 2 * n + 1

    selectors = all_selectors()
    envoy = [s for s in selectors if s.name.startswith("envoy_")]
    assert envoy
    check_selectors(envoy, exported(up), "a real Envoy's /stats/prometheus")
    # a real gorgo serve exports them too (the failover and ejection series exist at 0)
    gorgo = [
        s
        for s in selectors
        if s.name.startswith("gorgo_") and ("status", "=", "failed_over") not in s.matchers
    ]
    check_selectors(gorgo, router_names, "gorgo serve's /metrics")
