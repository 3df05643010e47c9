"""The prober reads an engine's models as soon as the engine answers, when the read at
start found it down: a real vLLM takes ~50 s to start, longer than the router, and with a
read only every models_interval_s the router sent any model to it (a `beta` request to
the `alpha` engine, which 404s it) for up to that interval after it came up."""

from __future__ import annotations

import asyncio
import random
import socket
import time

from aiohttp import web

from ext_proc.config.load import config_from_dict
from ext_proc.core.build import build_router
from ext_proc.service.loops.probe import Prober


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def health(_: web.Request) -> web.Response:
    return web.Response()


async def models(_: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "alpha", "parent": None}]})


async def test_an_engine_up_after_the_router_is_read_before_it_counts_as_healthy() -> None:
    port = free_port()
    cfg = config_from_dict(
        {
            "probes": {"interval_s": 0.05, "metrics_interval_s": 0, "models_interval_s": 60},
            "backends": [{"id": "a", "address": f"127.0.0.1:{port}", "engine": "vllm"}],
        }
    )
    router = build_router(cfg, time.monotonic, random.Random(0))
    prober = Prober(cfg, router)
    await prober.start()  # the engine is not up: its models are not known
    state = router.backends["a"]
    runner = None
    try:
        await asyncio.sleep(0.2)
        assert state.engine.discovered is None and state.health.suspect
        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        deadline = time.monotonic() + 5
        while state.health.suspect:  # healthy again: its models were read first, not in 60 s
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert state.engine.discovered is not None and state.engine.discovered.base == {"alpha"}
    finally:
        await prober.stop()
        if runner is not None:
            await runner.cleanup()
