"""The router's own answers through real Envoy: a body it cannot read (reject mode) and
load shedding come back as JSON errors, never as a broken connection."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator

import aiohttp
import pytest

from emulator.stack.stack import Stack
from loadgen.client.stream import chat_body
from tests.e2e.conftest import fast_settings
from tests.e2e.stack_harness import router_state

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack(fast_settings("gorgo", tuner_mode="off"))
    # Reject unreadable bodies; shed once every queue estimate is past 1 ms (any backlog).
    routing = dataclasses.replace(s.config.routing, unreadable_body="reject", shed_queue_ms=1.0)
    s.config = dataclasses.replace(s.config, routing=routing)
    s.start()
    yield s
    s.stop()


async def post(url: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as session:
        headers = {"content-type": "application/json"}
        async with session.post(f"{url}/v1/chat/completions", data=body, headers=headers) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


def test_an_unreadable_body_is_rejected_with_a_json_400_naming_the_problem(stack: Stack) -> None:
    decisions_before = router_state(stack)["decisions"]
    for body, problem in (
        (b'{"messages": [oops', "invalid JSON"),
        (b'{"messages": "hi"}', "messages: expected a non-empty list"),
        (b'{"messages": [{"content": "x"}], "max_tokens": "ten"}', "max_tokens"),
    ):
        status, headers, payload = asyncio.run(post(stack.front_door_url, body))
        assert status == 400 and headers["content-type"] == "application/json"
        error = json.loads(payload)["error"]
        assert problem in error["message"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_body")
    # no backend was loaded with them
    assert router_state(stack)["decisions"] == decisions_before


def test_overload_is_shed_with_429_and_retry_after(stack: Stack) -> None:
    body = json.dumps(chat_body("load " * 2000, 4)).encode()

    async def burst() -> list[tuple[int, dict[str, str], bytes]]:
        return await asyncio.gather(*(post(stack.front_door_url, body) for _ in range(30)))

    answers = asyncio.run(burst())
    codes = sorted(status for status, _, _ in answers)
    assert set(codes) == {200, 429}, codes
    for status, headers, payload in answers:
        if status == 429:
            wait_ms = int(headers["retry-after-ms"])  # exact, and the seconds rounded up
            assert wait_ms > 0 and int(headers["retry-after"]) == -(-wait_ms // 1000)
            error = json.loads(payload)["error"]
            assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    print(f"burst of 30: {codes.count(200)} served, {codes.count(429)} shed")
