"""The prober against a real HTTP engine: RTT samples and the engine's load report."""

from __future__ import annotations

import asyncio

import aiohttp

from emulator.engine import EngineServer
from emulator.engine_config import EngineConfig
from ext_proc.config.load import config_from_dict
from ext_proc.service.app import running_service


async def test_the_scrape_reads_the_engines_own_load_report() -> None:
    engine = EngineServer(
        EngineConfig(name="a", flavor="sglang", enable_metrics=True), "127.0.0.1", 0
    )
    await engine.start()
    try:
        cfg = config_from_dict(
            {
                "backends": [{"id": "a", "address": f"127.0.0.1:{engine.port}"}],
                "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
                "probes": {"interval_s": 0.1, "metrics_interval_s": 0.1},
            }
        )
        async with running_service(cfg) as svc, aiohttp.ClientSession() as http:
            state: dict = {}
            for _ in range(50):
                await asyncio.sleep(0.1)
                async with http.get(f"http://127.0.0.1:{svc.admin_port}/state") as r:
                    state = (await r.json())["backends"]["a"]
                if state["engine"] and state["rtt_samples"] >= 2:
                    break
            assert state["engine"] is not None  # the scrape opened its own connection
            assert state["engine"]["waiting"] == 0.0 and state["engine"]["running"] == 0.0
            assert state["engine"]["age_s"] < 1.0 and state["rtt_samples"] >= 2
    finally:
        await engine.stop()
