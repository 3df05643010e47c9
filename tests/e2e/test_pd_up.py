"""`gorgo up --pd` as it starts (emulator/stack/pd.py): the router is given both roles, so
a chat through Envoy's front door is prefilled on a prefill twin and decoded on a decode
twin, in SGLang's protocol and vLLM's, streamed to the client as one normal answer naming
both (x-gorgo-backend, x-gorgo-prefill-backend), and nothing stays in flight after.

The decode twins are kept busy by two long answers first: a vLLM decode engine may take a
request whole (ext_proc/core/pairs.py), and on an idle fleet it does, its own prefill
cheaper than a pair's transfer; with requests decoding there, the stall its prefill would
inflict makes the pair cheaper. SGLang's decode mode takes only paired requests.
The stack's children stop by their pids (Stack.stop)."""

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
from ext_proc.common.names import HEADER_BACKEND, HEADER_PREFILL_BACKEND
from tests.component.engine_harness import CHAT
from tests.e2e.conftest import FAST_REGIONS, fast_settings
from tests.e2e.stack_harness import get_json, router_state

# Long (5 s and more: fourteen children start on two cores): `make test-long`.
pytestmark = [pytest.mark.e2e, pytest.mark.long]
REGIONS = FAST_REGIONS[:2]


@pytest.fixture(scope="module", params=["sglang", "vllm"])
def pd_up(request: pytest.FixtureRequest) -> Iterator[Stack]:
    """`gorgo up --pd --pd-protocol P --regions 2`'s stack (the default policy, engine
    profile and P/D settings), on free ports."""
    protocol = request.param
    settings = fast_settings(
        policy="gorgo",
        regions=REGIONS,
        engine_args=(),
        flavor=protocol,
        pd=PdSettings(protocol=protocol),
    )
    stack = Stack(settings)
    stack.start()
    yield stack
    stack.stop()


def chat(model: str, words: int, salt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": " ".join(f"{salt}{i}" for i in range(words))}],
        "max_tokens": max_tokens,
        "stream": True,
    }


async def stream(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], started: asyncio.Event
) -> tuple[dict[str, str], list[str]]:
    """The response's headers and its SSE data lines; `started` set at the first token."""
    events: list[str] = []
    async with http.post(url + CHAT, json=body) as resp:
        assert resp.status == 200, await resp.text()
        headers = {k.lower(): v for k, v in resp.headers.items()}
        async for line in resp.content:
            if line.startswith(b"data: "):
                events.append(line[6:].decode().strip())
                started.set()
    return headers, events


def test_a_chat_through_the_front_door_is_prefilled_and_decoded_apart(pd_up: Stack) -> None:
    protocol = pd_up.settings.flavor
    assert f"P/D twins ({protocol} protocol, prefills and decodes routed)" in pd_up.ready_line()
    model = get_json(f"{pd_up.engine_url(0)}/v1/models")["data"][0]["id"]
    decodes = {r.id for r in REGIONS}
    prefills = {f"{r.id}-prefill" for r in REGIONS}

    async def run() -> list[tuple[dict[str, str], list[str]]]:
        url = pd_up.front_door_url
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            busy = []
            for k in range(2):  # one long answer decoding on each decode twin, in turn
                first = asyncio.Event()
                busy.append(
                    asyncio.ensure_future(stream(http, url, chat(model, 20, f"b{k}", 150), first))
                )
                await asyncio.wait_for(first.wait(), 20)
            probe = await stream(http, url, chat(model, 1500, "p", 8), asyncio.Event())
            return [probe, *await asyncio.gather(*busy)]

    results = asyncio.run(run())
    for _headers, events in results:
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("error" not in c for c in chunks), chunks[-1]
    headers, events = results[0]
    assert headers.get(HEADER_BACKEND) in decodes, headers
    assert headers.get(HEADER_PREFILL_BACKEND) in prefills, headers
    content = [json.loads(e) for e in events[:-1]]
    tokens = sum(1 for c in content if c["choices"] and c["choices"][0]["delta"].get("content"))
    assert tokens == 8
    # the twins the headers name served the legs: the prefill twin counted a request
    pd = pd_up.settings.pd_layout()
    i = [f"{r.id}-prefill" for r in REGIONS].index(headers[HEADER_PREFILL_BACKEND])
    assert get_json(f"http://127.0.0.1:{pd.prefill(i)}/stats")["completed_total"] >= 1
    # nothing stays in flight: the prefill leg's record ends with the decode's stream
    deadline = time.monotonic() + 5
    while router_state(pd_up)["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert router_state(pd_up)["in_flight"] == 0
