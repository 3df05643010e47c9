"""`gorgo up --pd --regions 2` live (emulator/stack/pd.py): the stack's children up, the
router pairing a prefill and a decode twin for a chat through the front door, and, driven as
SGLang's mini_lb drives a pair, a request prefilled in us-ashburn and decoded in
eu-frankfurt whose KV crosses the 90 ms link between them, while a pair within a region
crosses its 1 ms link. The stack's children stop by their pids (Stack.stop)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from emulator.stack.pd import PdSettings
from emulator.stack.stack import Stack
from tests.component.engine_harness import CHAT, read_sse
from tests.e2e.conftest import FAST_REGIONS, fast_settings

# Long (5 s and more: twelve children start on two cores): `make test-long`.
pytestmark = [pytest.mark.e2e, pytest.mark.long]
CROSS_RTT_S = 0.090  # us-ashburn <-> eu-frankfurt (emulator/wan.py REGION_RTT_MS)


@pytest.fixture(scope="module")
def pd_stack() -> Iterator[Stack]:
    stack = Stack(fast_settings(regions=FAST_REGIONS[:2], pd=PdSettings()))
    stack.start()
    yield stack
    stack.stop()


def body(salt: str) -> dict[str, Any]:
    prompt = " ".join(f"{salt}{i}" for i in range(300))
    return {
        "model": "emulated",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 4,
        "stream": True,
    }


async def first_token_s(http: aiohttp.ClientSession, url: str, req: dict[str, Any]) -> float:
    sent = time.perf_counter()
    async with http.post(url + CHAT, json=req) as resp:
        assert resp.status == 200, await resp.text()
        events = await read_sse(resp)
    assert events[-1][1] == "[DONE]"
    return next(t for t, e in events if e != "[DONE]" and json.loads(e).get("choices")) - sent


async def pair(stack: Stack, a: int, b: int, room: int) -> float:
    """mini_lb: the same body, naming region a's prefill's advertised bootstrap address, to
    that prefill and to region b's decode at once; the decode's time to first token."""
    pd = stack.settings.pd_layout()
    host, port = pd.advertised(a).rsplit(":", 1)
    req = {**body(f"r{room}"), "bootstrap_host": host, "bootstrap_port": int(port)}
    req["bootstrap_room"] = room
    prefill = f"http://127.0.0.1:{pd.prefill(a)}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
        _, ttft_s = await asyncio.gather(
            first_token_s(http, prefill, req), first_token_s(http, stack.engine_url(b), req)
        )
    return ttft_s


def test_the_pd_stack_runs_its_twins_and_links_and_serves(pd_stack: Stack) -> None:
    regions = [r.id for r in pd_stack.settings.regions]
    assert set(pd_stack.procs) >= {
        *(f"{kind}-{r}" for kind in ("prefill", "decode", "wan") for r in regions),
        *(f"kv-{a}-to-{b}" for a in regions for b in regions),
    }
    assert "P/D twins (sglang protocol, prefills and decodes routed)" in pd_stack.ready_line()

    async def through_the_front_door() -> float:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            return await first_token_s(http, pd_stack.front_door_url, body("door"))

    asyncio.run(through_the_front_door())  # the router pairs a prefill and a decode twin
    # Across regions the decode's handshake (a fresh connection: 2 RTTs) and the KV's
    # round trip cross the 90 ms link; within a region, the 1 ms one.
    cross = asyncio.run(pair(pd_stack, 0, 1, 11))
    local = asyncio.run(pair(pd_stack, 1, 1, 12))
    assert cross >= 3 * CROSS_RTT_S, cross
    assert local < cross - CROSS_RTT_S, (local, cross)
