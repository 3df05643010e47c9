"""The router's precise prefix state from a live engine's KV events (the emulated SGLang,
publishing over real ZMQ), falling back to its own estimate while the stream is down."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import aiohttp

from emulator.engine import EngineServer
from emulator.engine_config import EngineConfig
from emulator.kv_publisher import KvEventsConfig
from ext_proc.config.load import config_from_dict
from ext_proc.core.types import RouteRequest
from ext_proc.prompt.parse import CHAT, parse_body
from ext_proc.service.app import running_service
from tests.component.engine_harness import FAST


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine(port: int, kv_port: int) -> EngineServer:
    cfg = EngineConfig(
        name="a",
        profile=FAST,
        cache_report=True,
        kv_events=KvEventsConfig(endpoint=f"tcp://*:{kv_port}"),
    )
    return EngineServer(cfg, "127.0.0.1", port)


async def chat_usage(http: aiohttp.ClientSession, url: str, text: str) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2}
    async with http.post(f"{url}/v1/chat/completions", json=body) as r:
        return dict((await r.json())["usage"])


async def state_of(http: aiohttp.ClientSession, admin_port: int) -> dict[str, Any]:
    async with http.get(f"http://127.0.0.1:{admin_port}/state") as r:
        return dict((await r.json())["backends"]["a"])


async def metric(http: aiohttp.ClientSession, admin_port: int, name: str) -> float:
    async with http.get(f"http://127.0.0.1:{admin_port}/metrics") as r:
        text = await r.text()
    (value,) = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(f'{name}{{backend="a"}}')
    ]
    return value


async def until(check: Any, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached in time")


async def test_precise_state_follows_the_engine_and_falls_back_when_its_stream_dies() -> None:
    port, kv_port = free_port(), free_port()
    srv = engine(port, kv_port)
    await srv.start()
    cfg = config_from_dict(
        {
            "backends": [
                {
                    "id": "a",
                    "address": f"127.0.0.1:{port}",
                    "kv_events": {"endpoint": f"tcp://*:{kv_port}"},
                }
            ],
            "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
            "tuner": {"mode": "off"},
        }
    )
    text = "a shared system prompt and a long document " * 120
    try:
        async with running_service(cfg) as svc, aiohttp.ClientSession() as http:

            async def precise() -> bool:
                return (await state_of(http, svc.admin_port))["prefix_state"] == "precise"

            await until(precise)
            # a request that did not pass through this router (another router, a client)
            await chat_usage(http, srv.url, text)
            repeat = await chat_usage(http, srv.url, text)
            reported = repeat["prompt_tokens_details"]["cached_tokens"]
            llm = parse_body(
                CHAT, json.dumps({"messages": [{"role": "user", "content": text}]}).encode()
            )
            request = RouteRequest("probe", llm, None)
            (c,) = svc.router.candidates(request, svc.router.prompt_blocks(request))
            print(f"engine reports {reported} cached, the router predicts {c.cached_tokens}")
            assert reported > 0 and c.cached_tokens == reported
            kv = (await state_of(http, svc.admin_port))["kv_events"]
            assert kv["blocks"] > 0 and kv["block_size"] == FAST.block_tokens
            assert await metric(http, svc.admin_port, "gorgo_prefix_state_precise") == 1.0
            assert await metric(http, svc.admin_port, "gorgo_kv_event_blocks") == kv["blocks"]

            await srv.stop()  # the event stream dies with the engine

            async def approximate() -> bool:
                return (await state_of(http, svc.admin_port))["prefix_state"] == "approximate"

            await until(approximate, 2.0)
            assert await metric(http, svc.admin_port, "gorgo_prefix_state_precise") == 0.0
            srv = engine(port, kv_port)  # back, restarted: its sequence starts at 0 again
            await srv.start()
            await until(precise)
            await chat_usage(http, srv.url, "something new " * 100)

            async def reset() -> bool:
                return (await state_of(http, svc.admin_port))["kv_events"]["resets"] == 1

            await until(reset)
    finally:
        await srv.stop()
