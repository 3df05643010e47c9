"""Two router processes behind one Envoy (`gorgo up --routers 2`): Envoy spreads the
ext_proc streams over both, each decides its share, and what one saw of the other's
request (its first chunk on the observing stream, its access-log entry) reaches the one
that decided it over NATS, so every request closes where it was decided, with its TTFT."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from emulator.stack.stack import Stack
from loadgen.client.stream import chat_body, send_chat
from tests.e2e.conftest import fast_settings

pytestmark = pytest.mark.e2e
REQUESTS = 60


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack(fast_settings("gorgo", routers=2, kv_events=True))
    s.start()
    yield s
    s.stop()


def state(admin_url: str) -> Any:
    with urllib.request.urlopen(f"{admin_url}/state", timeout=5) as r:
        return json.load(r)


async def send_all(url: str) -> list[Any]:
    async with aiohttp.ClientSession() as s:
        sem = asyncio.Semaphore(8)

        async def one(i: int) -> Any:
            async with sem:
                body = chat_body(f"question {i} " * 40, 8)
                return await send_chat(s, url, body, f"two-{i}", {"x-request-id": f"two-{i}"})

        return await asyncio.gather(*(one(i) for i in range(REQUESTS)))


def test_two_routers_share_the_requests_and_each_closes_its_own(stack: Stack) -> None:
    assert len(stack.extra_routers) == 1
    results = asyncio.run(send_all(stack.front_door_url))
    assert all(r.ok and r.ttft_ms is not None for r in results)
    admins = [stack.admin_url, f"http://{stack.extra_routers[0].listen.admin}"]
    deadline = time.monotonic() + 10
    while any(state(a)["in_flight"] for a in admins) and time.monotonic() < deadline:
        time.sleep(0.1)
    views = [state(a) for a in admins]
    decided = [v["decisions"] for v in views]
    assert sum(decided) == REQUESTS and min(decided) > 0, decided  # both took a share
    for v in views:
        assert v["in_flight"] == 0
        backends = v["backends"].values()
        # every request it decided closed here, with its TTFT measured (streamed)
        assert sum(b["completed"] for b in backends) == v["decisions"]
        assert sum(b["latency_prediction"]["ttft"]["requests"] for b in backends) == v["decisions"]
    # Envoy's streams reached both: each was told of the other's requests
    assert views[0]["fleet"]["forwarded_here"] > 0 and views[1]["fleet"]["forwarded_here"] > 0
    # (a repeat, or one whose owner had closed it, is forwarded and applied by none)
    assert sum(v["fleet"]["forwarded"] for v in views) >= sum(
        v["fleet"]["forwarded_here"] for v in views
    )
