"""Whether the router writes a request's priority for a backend's engine, and in which
order: SGLang's /server_info read (its server args), and `backends[].priority_scheduling`
(auto / on / off); vLLM reports nothing, so only `on` writes for it. And the prober reads
an SGLang engine's /server_info before the first request, and again each models interval
(an engine restarted with other flags)."""

from __future__ import annotations

import asyncio
import random
import socket
import time
from typing import Any

import pytest
from aiohttp import web

from ext_proc.config.load import config_from_dict
from ext_proc.core.build import build_router
from ext_proc.feeds.server_info import (
    EngineScheduling,
    ServerInfoError,
    parse_server_info,
    priority_writing,
)
from ext_proc.service.loops.probe import Prober
from ext_proc.vocab.backend import Backend, EngineKind, PriorityScheduling

# What SGLang's /server_info returns, trimmed to the args read and a few beside them
# (python/sglang/srt/server_args.py names; the values are the defaults).
SGLANG_INFO: dict[str, Any] = {
    "model_path": "m",
    "schedule_policy": "fcfs",
    "enable_priority_scheduling": False,
    "schedule_low_priority_values_first": False,
    "priority_scheduling_preemption_threshold": 10,
    "version": "0.5",
}


def test_sglang_server_info_says_whether_and_in_which_order() -> None:
    assert parse_server_info(SGLANG_INFO) == EngineScheduling(False, False)
    on = {**SGLANG_INFO, "enable_priority_scheduling": True}
    assert parse_server_info(on) == EngineScheduling(True, False)
    low = {**on, "schedule_low_priority_values_first": True}
    assert parse_server_info(low) == EngineScheduling(True, True)
    # an SGLang older than priority scheduling (or the twin before it) says neither: off
    assert parse_server_info({"model_path": "m"}) == EngineScheduling(False, False)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([1, 2], "expected a JSON object"),
        ({"enable_priority_scheduling": "yes"}, "enable_priority_scheduling: expected true"),
        ({"schedule_low_priority_values_first": 1}, "schedule_low_priority_values_first"),
    ],
)
def test_an_unreadable_server_info_names_what_is_wrong(doc: Any, message: str) -> None:
    with pytest.raises(ServerInfoError, match=message):
        parse_server_info(doc)


def backend(engine: EngineKind, setting: PriorityScheduling) -> Backend:
    return Backend("a", "127.0.0.1:1", engine=engine, priority_scheduling=setting)


SG, VL = EngineKind.SGLANG, EngineKind.VLLM
AUTO, ON, OFF = PriorityScheduling.AUTO, PriorityScheduling.ON, PriorityScheduling.OFF
ENABLED, LOW_FIRST = EngineScheduling(True), EngineScheduling(True, True)
DISABLED = EngineScheduling(False)


@pytest.mark.parametrize(
    ("engine", "setting", "info", "writes", "lower_first", "reason"),
    [
        # vLLM reports nothing: auto is off, on is its order (lower first)
        (VL, AUTO, None, False, True, "vLLM does not report"),
        (VL, ON, None, True, True, "--scheduling-policy priority"),
        (VL, OFF, None, False, False, "off"),
        # SGLang: auto follows /server_info
        (SG, AUTO, None, False, False, "/server_info not read"),
        (SG, AUTO, DISABLED, False, False, "enable_priority_scheduling false"),
        (SG, AUTO, ENABLED, True, False, "higher values first"),
        (SG, AUTO, LOW_FIRST, True, True, "lower values first"),
        # on: written whatever it says, in the order it says (its default before it says)
        (SG, ON, None, True, False, "default order"),
        (SG, ON, LOW_FIRST, True, True, "lower values first"),
        (SG, ON, DISABLED, True, False, "says enable_priority_scheduling false"),
        (SG, OFF, ENABLED, False, False, "off"),
    ],
)
def test_what_is_written_for_each_engine_and_setting(
    engine: EngineKind,
    setting: PriorityScheduling,
    info: EngineScheduling | None,
    writes: bool,
    lower_first: bool,
    reason: str,
) -> None:
    w = priority_writing(backend(engine, setting), info)
    assert (w.writes, w.lower_first) == (writes, lower_first)
    assert reason in w.reason
    shown = w.as_json()
    assert shown["writes"] == writes
    assert shown["order"] == (
        None if not writes else "lower_first" if lower_first else "higher_first"
    )


def test_the_objectives_order_is_kept_in_the_engines_sign() -> None:
    """gorgo: higher priority is more important; vLLM and a low-first SGLang serve lower
    values first, so the value is negated; a default SGLang takes it as it is."""
    objectives = [10, 0, -5]  # interactive, default, best effort
    vllm = priority_writing(backend(VL, ON), None)
    sglang = priority_writing(backend(SG, AUTO), ENABLED)
    low = priority_writing(backend(SG, AUTO), LOW_FIRST)
    assert [vllm.engine_value(p) for p in objectives] == [-10, 0, 5]
    assert [low.engine_value(p) for p in objectives] == [-10, 0, 5]
    assert [sglang.engine_value(p) for p in objectives] == [10, 0, -5]
    # served first = most important, in each engine's own order
    assert min(objectives, key=vllm.engine_value) == 10
    assert max(objectives, key=sglang.engine_value) == 10


def test_an_unreadable_answer_is_said_in_the_reason() -> None:
    w = priority_writing(backend(SG, AUTO), None, "HTTP 404")
    assert not w.writes and "HTTP 404" in w.reason


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_the_prober_reads_sglangs_setting_before_the_first_request_and_follows_it() -> None:
    info = {**SGLANG_INFO, "enable_priority_scheduling": True}
    reads: list[str] = []

    async def server_info(_: web.Request) -> web.Response:
        reads.append("server_info")
        return web.json_response(info)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    port = free_port()
    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/server_info", server_info)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    address = f"127.0.0.1:{port}"
    cfg = config_from_dict(
        {
            "probes": {"interval_s": 0.05, "metrics_interval_s": 0, "models_interval_s": 0.1},
            "backends": [
                {"id": "sg", "address": address, "engine": "sglang"},
                # off, and vLLM (which has no such page): never asked
                {"id": "sg-off", "address": address, "priority_scheduling": "off"},
                {"id": "vl", "address": address, "engine": "vllm", "priority_scheduling": "on"},
            ],
        }
    )
    router = build_router(cfg, time.monotonic, random.Random(0))
    prober = Prober(cfg, router)
    try:
        await prober.start()
        sg = router.backends["sg"].priority
        assert sg.writes and not sg.lower_first, sg
        assert reads == ["server_info"]  # one read, for the one SGLang backend not off
        assert not router.backends["sg-off"].priority.writes
        assert router.backends["vl"].priority.writes  # on: the config says
        assert router.backends["sg"].as_json(0.0)["priority"]["order"] == "higher_first"
        # the engine restarts with lower values first: followed within a models interval
        info["schedule_low_priority_values_first"] = True
        deadline = time.monotonic() + 5
        while not router.backends["sg"].priority.lower_first:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        info["enable_priority_scheduling"] = False
        while router.backends["sg"].priority.writes:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
    finally:
        await prober.stop()
        await runner.cleanup()
