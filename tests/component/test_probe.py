"""The prober against a real HTTP engine: RTT samples and the engine's load report."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp

from emulator.engine.config import EngineConfig
from emulator.engine.server import EngineServer
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


async def test_each_engines_models_are_known_when_the_service_has_started() -> None:
    """The first read of /v1/models is part of the start: the first request routed (and
    the first /healthz) finds what each engine serves, not every backend taking every
    model; an engine that does not answer adds none and holds no one up past the probe
    timeout."""
    engines = [
        EngineServer(EngineConfig(name=n, flavor="vllm", model=m), "127.0.0.1", 0)
        for n, m in (("a", "alpha"), ("b", "beta"))
    ]
    for e in engines:
        await e.start()
    try:
        backends = [{"id": e.cfg.name, "address": f"127.0.0.1:{e.port}"} for e in engines]
        backends.append({"id": "down", "address": "127.0.0.1:9"})  # nothing listens
        cfg = config_from_dict(
            {
                "backends": [{**b, "engine": "vllm"} for b in backends],
                "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
                "probes": {"timeout_s": 1.0, "models_interval_s": 30.0},
            }
        )
        async with running_service(cfg) as svc:
            models = {b: s.models for b, s in svc.router.backends.items()}
            assert models["a"] is not None and models["a"].base == {"alpha"}
            assert models["b"] is not None and models["b"].base == {"beta"}
            assert models["down"] is None
            assert svc.router.served_models() == {"alpha": None, "beta": None}
    finally:
        for e in engines:
            await e.stop()


async def test_a_probe_into_a_silent_link_fails_after_a_few_rtts_not_the_whole_timeout() -> None:
    """A backend that has answered probes, then accepts connections and says nothing (a
    frozen link): its probe gives up after max(1 s, 5 RTTs), not probes.timeout_s."""
    from ext_proc.core.build import build_router
    from ext_proc.service.loops.probe import PROBE_TIMEOUT_FLOOR_S, Prober

    silent: list[asyncio.StreamWriter] = []

    async def swallow(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        silent.append(w)  # held open, never answered

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cfg = config_from_dict(
        {
            "backends": [{"id": "a", "address": f"127.0.0.1:{port}", "rtt_prior_ms": 20}],
            "probes": {"timeout_s": 5.0, "models_interval_s": 0, "metrics_interval_s": 0},
        }
    )
    router = build_router(cfg, time.monotonic, random.Random(0))
    prober = Prober(cfg, router)
    await prober.start()
    try:
        assert prober.timeout_s("a") == 5.0  # no probe has answered yet: the whole timeout
        router.inputs.record_probe("a", 20.0)  # it had answered once
        assert prober.timeout_s("a") == PROBE_TIMEOUT_FLOOR_S
        start = time.monotonic()
        assert await prober.probe_once(cfg.backends[0]) is None
        assert PROBE_TIMEOUT_FLOOR_S - 0.05 < time.monotonic() - start < 2.0
    finally:
        await prober.stop()
        server.close()
        for w in silent:
            w.close()


async def test_a_probe_of_a_name_the_resolver_refuses_fails_and_the_loop_lives_on() -> None:
    """The admin API's fuzzer once added `[.:.2b720faf3c.8.]:65079`: the resolver's IDNA step
    raised UnicodeError out of the probe loop, and the service's stop re-raised it. Such a
    name is refused by the address check now; a probe that meets one anyway just fails."""
    from ext_proc.service.loops.engine_http import probe_rtt, probe_session

    async with probe_session() as session:
        assert await probe_rtt(session, "http://a..b:8000/health", 1.0) is None
